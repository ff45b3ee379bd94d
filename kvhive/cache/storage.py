"""Per-layer key/value storage with a different number of tokens per head.

Tokens are held in flat buffers ``keys[T, d]``, ``values[T, d]``, ``positions[T]`` sorted by
segment (``segment = batch_index * H + head``) with ``lengths[B, H]`` tokens each. Nothing is
padded: an evicted entry is gone (eviction builds new, smaller tensors), so the bytes held are
exactly the kept tokens. When every head holds the same number of tokens, the flat buffers are
viewed as ``[B, H, L, d]`` without a copy, which is the fast dense path.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

POSITION_DTYPE = torch.int32


class LayerStore(CacheLayerMixin):
    """One layer's cache. Knows nothing about methods; ``policy_state`` is opaque to it."""

    is_compileable = False
    is_croppable = False

    def __init__(self, layer_index: int, sliding_window: int | None = None) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.positions: torch.Tensor | None = None
        self.lengths: torch.Tensor | None = None
        self.tokens_seen = 0
        # Replication of each KV head when a policy stores one copy per query head.
        self.heads_per_kv_head = 1
        self.token_scores: dict[str, torch.Tensor] = {}
        self.policy_state: dict = {}
        self.budget: int | None = None
        self.decode_steps_since_compression = 0
        self.rope_tokens_seen = 0

    # -- transformers' CacheLayerMixin ---------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads, _, head_dim = key_states.shape
        self.keys = key_states.new_empty((0, head_dim))
        self.values = value_states.new_empty((0, value_states.shape[-1]))
        self.positions = torch.empty(0, dtype=POSITION_DTYPE, device=self.device)
        self.lengths = torch.zeros(batch, heads, dtype=torch.long, device=self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append the new tokens; returns the dense view (or the flat buffers when uneven)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.heads_per_kv_head > 1:
            key_states = key_states.repeat_interleave(self.heads_per_kv_head, dim=1)
            value_states = value_states.repeat_interleave(self.heads_per_kv_head, dim=1)
        new_tokens = key_states.shape[2]
        new_positions = torch.arange(
            self.tokens_seen, self.tokens_seen + new_tokens, dtype=POSITION_DTYPE, device=self.device
        )
        self._append(key_states, value_states, new_positions)
        self.tokens_seen += new_tokens
        if self.is_uniform:
            view = self.dense()
            return view[0], view[1]
        return self.keys.unsqueeze(0).unsqueeze(0), self.values.unsqueeze(0).unsqueeze(0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The mask always spans every original position; attention gathers it at kept tokens.
        return self.tokens_seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.tokens_seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = self.positions = self.lengths = None
        self.is_initialized = False
        self.tokens_seen = 0
        self.token_scores = {}
        self.policy_state = {}
        self.heads_per_kv_head = 1
        self.decode_steps_since_compression = 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a compressed cache cannot be rolled back (evicted tokens are gone)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("beam search over a compressed cache is not supported")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("expanding the batch of a compressed cache is not supported")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("selecting batch rows of a compressed cache is not supported")

    # -- shape ---------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0]) if self.lengths is not None else -1

    @property
    def num_heads(self) -> int:
        return int(self.lengths.shape[1])

    @property
    def num_stored(self) -> int:
        return int(self.keys.shape[0]) if self.keys is not None else 0

    @property
    def is_uniform(self) -> bool:
        if self.lengths is None or self.lengths.numel() == 0:
            return True
        return bool((self.lengths == self.lengths.reshape(-1)[0]).all())

    def dense(self):
        """``(keys, values, positions, token_scores)`` viewed as ``[B, H, L, ...]`` (no copy)."""
        if not self.is_uniform:
            raise RuntimeError(
                f"layer {self.layer_index} holds a different number of tokens per head; "
                "no dense view exists (use the variable-length path)"
            )
        b, h = self.lengths.shape
        length = int(self.lengths.reshape(-1)[0]) if self.lengths.numel() else 0
        keys = self.keys.view(b, h, length, self.keys.shape[-1])
        values = self.values.view(b, h, length, self.values.shape[-1])
        positions = self.positions.view(b, h, length)
        scores = {name: score.view(b, h, length) for name, score in self.token_scores.items()}
        return keys, values, positions, scores

    def segment_offsets(self) -> torch.Tensor:
        """``[B*H + 1]`` start of each (batch, head) segment in the flat buffers."""
        flat = self.lengths.reshape(-1)
        return torch.cat([flat.new_zeros(1), flat.cumsum(0)])

    # -- mutation ------------------------------------------------------------------------------
    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor, new_positions: torch.Tensor) -> None:
        b, h, new_tokens, _ = key_states.shape
        if self.is_uniform:
            old_keys, old_values, old_positions, old_scores = self.dense()
            self.keys = torch.cat([old_keys, key_states], dim=2).reshape(-1, key_states.shape[-1])
            self.values = torch.cat([old_values, value_states], dim=2).reshape(-1, value_states.shape[-1])
            expanded = new_positions.expand(b, h, new_tokens)
            self.positions = torch.cat([old_positions, expanded], dim=2).reshape(-1)
            self.token_scores = {
                name: torch.cat([score, score.new_zeros(b, h, new_tokens)], dim=2).reshape(-1)
                for name, score in old_scores.items()
            }
        else:
            # Scatter old and new tokens into a buffer where each segment grew by new_tokens.
            flat_lengths = self.lengths.reshape(-1)
            segments = torch.arange(flat_lengths.numel(), device=self.device)
            old_segment_of_token = torch.repeat_interleave(segments, flat_lengths)
            old_destination = torch.arange(self.num_stored, device=self.device) + old_segment_of_token * new_tokens
            new_offsets = torch.cat([flat_lengths.new_zeros(1), (flat_lengths + new_tokens).cumsum(0)])
            new_destination = (
                new_offsets[:-1, None] + flat_lengths[:, None] + torch.arange(new_tokens, device=self.device)
            ).reshape(-1)
            total = self.num_stored + new_tokens * flat_lengths.numel()

            def merged(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
                out = old.new_empty((total, *old.shape[1:]))
                out[old_destination] = old
                out[new_destination] = new
                return out

            self.keys = merged(self.keys, key_states.reshape(-1, key_states.shape[-1]))
            self.values = merged(self.values, value_states.reshape(-1, value_states.shape[-1]))
            self.positions = merged(self.positions, new_positions.repeat(b * h))
            self.token_scores = {
                name: merged(score, score.new_zeros(new_tokens * b * h))
                for name, score in self.token_scores.items()
            }
        self.lengths = self.lengths + new_tokens

    def expand_to_query_heads(self, heads_per_kv_head: int) -> None:
        """Store one copy of each KV head per query head of its group (Ada-KV on GQA/MQA)."""
        if heads_per_kv_head == 1 or self.heads_per_kv_head == heads_per_kv_head:
            return
        if self.heads_per_kv_head != 1:
            raise RuntimeError("heads were already expanded with a different factor")
        keys, values, positions, scores = self.dense()
        self.keys = keys.repeat_interleave(heads_per_kv_head, dim=1).reshape(-1, keys.shape[-1])
        self.values = values.repeat_interleave(heads_per_kv_head, dim=1).reshape(-1, values.shape[-1])
        self.positions = positions.repeat_interleave(heads_per_kv_head, dim=1).reshape(-1)
        self.token_scores = {n: s.repeat_interleave(heads_per_kv_head, dim=1).reshape(-1) for n, s in scores.items()}
        self.lengths = self.lengths.repeat_interleave(heads_per_kv_head, dim=1)
        self.heads_per_kv_head = heads_per_kv_head

    def keep(self, keep_mask: torch.Tensor) -> None:
        """Drop every token whose entry in ``keep_mask`` is False and free it.

        ``keep_mask`` is ``[B, H, L]`` over the dense view, or ``[T]`` over the flat buffers.
        Rows may keep different counts; the store then becomes variable-length.
        """
        if keep_mask.dim() == 3:
            if keep_mask.shape != tuple(self.lengths.shape) + (int(self.lengths.reshape(-1)[0]),):
                raise ValueError(f"keep mask shape {tuple(keep_mask.shape)} does not match the stored layout")
            new_lengths = keep_mask.sum(dim=-1)
            flat_mask = keep_mask.reshape(-1)
        else:
            if keep_mask.shape[0] != self.num_stored:
                raise ValueError("flat keep mask must cover every stored token")
            flat_mask = keep_mask
            segment = torch.repeat_interleave(
                torch.arange(self.lengths.numel(), device=self.device), self.lengths.reshape(-1)
            )
            new_lengths = torch.zeros_like(self.lengths.reshape(-1)).index_add_(
                0, segment, flat_mask.long()
            ).view_as(self.lengths)
        if bool(flat_mask.all()):
            return
        # Boolean indexing allocates new tensors, so the evicted entries' memory is released.
        self.keys = self.keys[flat_mask]
        self.values = self.values[flat_mask]
        self.positions = self.positions[flat_mask]
        self.token_scores = {name: score[flat_mask] for name, score in self.token_scores.items()}
        self.lengths = new_lengths

    # -- accounting ----------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes of the key/value payload held."""
        if self.keys is None:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def metadata_nbytes(self) -> int:
        """Bytes of bookkeeping (positions, lengths, per-token scores)."""
        if self.keys is None:
            return 0
        total = self.positions.numel() * self.positions.element_size()
        total += self.lengths.numel() * self.lengths.element_size()
        total += sum(s.numel() * s.element_size() for s in self.token_scores.values())
        return total

    def bytes_per_token(self) -> int:
        """Key + value bytes of one token in one stored head."""
        return (self.keys.shape[-1] + self.values.shape[-1]) * self.keys.element_size()
