"""Per-layer key/value storage with a different number of tokens per head.

Two layouts, chosen by what the layer holds, each a class of its own (a layer is one object from
start to end: it is a :class:`DenseLayerStore` until its rows keep different counts, then a
:class:`PackedLayerStore`; ``LayerStore(...)`` makes a dense one):

* **dense** — every (batch, head) row holds the same number of tokens ``L``. Keys live in a
  buffer ``[B, H, capacity, d]`` and the stored tokens are the slice ``[start, start + L)``,
  so the dense view handed to attention is a strided view (no copy). Appending writes into the
  slice's tail (O(new tokens)); the buffer grows geometrically when full and the oldest tokens
  of a sliding layer are dropped by moving ``start`` (compacted when the tail is reached).
* **packed** — rows hold different counts (head-wise budgets). Tokens live in flat buffers
  ``[capacity, d]``: segment ``s = b * H + h`` occupies ``[segment_start[s],
  segment_start[s] + length[s])`` of its reserved range. Nothing is padded to a common length;
  each segment has a small reserve for decode appends, re-laid out when one is full.

Rows prefilled separately and stacked (``KVHiveCache.stack``) keep their own tokens seen (a host
list and a device ``[B]`` counter); when they hold different numbers of tokens the dense buffers
are a common capacity whose row ``b`` fills slots ``[0, L_b)``, with a per-row length. In fixed
batch slots (``KVHiveCache.stack(batch_slots=...)``) a row is replaced in place
(:meth:`DenseLayerStore.write_row`) and a free row stops growing (``row_active_device``).

Lengths are mirrored on the host (they only change by appends, whose size the host knows,
and by evictions, which report their counts once), so a decode step that evicts nothing reads
nothing back from the device. ``nbytes()`` counts the kept tokens' payload exactly;
``reserved_nbytes()`` the allocated buffers (kept tokens plus append reserve).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from kvhive.static_step import in_static_step

POSITION_DTYPE = torch.int32
# Append reserve: a buffer re-allocated for ``n`` tokens gets room for ``reserve(n)`` more, so
# appends are amortised O(new tokens) while the over-allocation stays a small fraction.
MIN_RESERVE_TOKENS = 64
RESERVE_FRACTION = 16  # reserve n // 16 tokens on top of n
SEGMENT_RESERVE_TOKENS = 32  # per packed segment (at least; rounded up to whole pages)
# Packed segments are whole pages: every capacity is a multiple of PAGE_TOKENS and segments tile
# the buffer in order, so attention reads the buffer as [pages, PAGE_TOKENS, d] without a copy.
# At most one partly filled page per segment beyond the reserve (reported by reserved_nbytes).
PAGE_TOKENS = 64


def reserve(tokens: int) -> int:
    return max(MIN_RESERVE_TOKENS, tokens // RESERVE_FRACTION)


def row_index(indices, batch: int) -> torch.Tensor:
    """Batch rows as a 1-D long tensor on the host: ``indices`` may be a boolean mask over the
    batch, a tensor of row numbers, or a list (transformers passes either)."""
    index = torch.as_tensor(indices).detach().to("cpu")
    if index.dtype == torch.bool:
        if index.shape != (batch,):
            raise IndexError(f"a boolean row mask must have {batch} entries, got shape {tuple(index.shape)}")
        return index.nonzero().reshape(-1)
    return index.to(torch.long).reshape(-1)


def first_false(mask: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """The index of the first False along the last dimension of a boolean ``mask`` (the last index
    where there is none: a one-token move from the last slot onto itself, a no-op).

    Not ``mask.to(torch.int8).argmin(-1)``: Inductor's CPU code (torch 2.13) gets an argmin over
    8-bit integers wrong once the row is long enough to vectorise (16 or more; it answers 0 for
    rows whose first False is later), which moved the newest token into slot 0 in a compiled
    step (tests/test_compiled_decode.py). A min over the slot indices has no ties to break."""
    last = mask.shape[-1] - 1
    slots = torch.arange(mask.shape[-1], device=mask.device)
    return torch.where(mask, last, slots).amin(dim=-1, keepdim=keepdim)


def true_indices(mask: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The indices of ``mask``'s True entries (``[N]`` bool), in order, their number being the sum of
    the host tensor ``counts``: a stable sort puts them first, so the device's result has a size the
    host knows (boolean-mask indexing waits for the device to count them: a synchronisation)."""
    total = int(counts.sum())
    return torch.sort((~mask).to(torch.uint8), stable=True).indices[:total]


def to_device_at_once(device, *host_tensors: torch.Tensor) -> list[torch.Tensor]:
    """Host int64 tensors moved to ``device`` in one host-to-device copy (not one each), as tensors of
    their own (each owns its storage: buffers updated in place keep to themselves)."""
    if not host_tensors:
        return []
    moved = torch.cat([tensor.reshape(-1).long() for tensor in host_tensors]).to(device)
    pieces = moved.split([tensor.numel() for tensor in host_tensors])
    return [piece.view(tensor.shape).clone() for piece, tensor in zip(pieces, host_tensors, strict=True)]


def _static(buffer: torch.Tensor) -> torch.Tensor:
    """Mark a dense buffer's address as fixed, as transformers' StaticLayer does: a compiled decode
    step then reads and writes it in place (an unmarked buffer mutated in place makes CUDA graphs
    skip the step, or be copied in at every replay). The buffers a decode step uses are the ones
    allocated after the prefill; they keep their address while the budget is kept."""
    torch._dynamo.mark_static_address(buffer)
    return buffer


# The per-token score the cache itself reads for every stored token, the newest included: the flag
# (1.0) of a padded prompt's left padding, which a static decode step's attention masks by
# (kvhive.attention.integration._stored_decode_mask). A new token's entry is reset (0: real) and
# moves with its token into a freed slot whatever its method reads (LayerStore.new_token_scores_read).
PADDING_SCORE = "_padding"


def _score_buffer(shape: tuple[int, ...], device) -> torch.Tensor:
    """A new per-token score buffer. Only the slots a caller copies tokens' scores into are defined:
    no decision may read the rest (zeros here, so that a read of them would at least repeat;
    tests/test_unset_scores.py fills them with NaN and requires every output unchanged)."""
    return torch.zeros(shape, dtype=torch.float32, device=device)


class LayerStore(CacheLayerMixin):
    """One layer's cache. Knows nothing about methods; ``policy_state`` is opaque to it.

    The state and logic both layouts share (tokens seen, phases, transformers' interface, eviction
    and accounting entry points); :class:`DenseLayerStore` and :class:`PackedLayerStore` hold the
    tokens. ``LayerStore(...)`` makes a dense layer; it turns packed (the same object) when its rows
    keep different counts, and dense again when reset."""

    is_croppable = False

    def __new__(cls, *args, **kwargs):
        return super().__new__(DenseLayerStore if cls is LayerStore else cls)

    def __init__(self, layer_index: int, sliding_window: int | None = None) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        # Tokens seen, twice: a host int for the host-side logic, and a device counter that a
        # captured decode step reads and advances (it may not read or change a Python int: a
        # compiled step guards on such values and would recompile at every step). Inside a
        # compiled step only the device counter moves; the host copy is refreshed from it (one
        # read) the next time it is asked for outside.
        self._tokens_seen = 0
        self._tokens_seen_stale = False
        self.tokens_seen_device: torch.Tensor | None = None
        # Rows that have seen different numbers of tokens (caches prefilled separately and stacked,
        # KVHiveCache.stack): each row's count on the host and on the device ([B] int64). None for a
        # cache whose rows advance together; ``tokens_seen`` is then every row's count, otherwise
        # the most any row has seen.
        # The host lists are refreshed from the device counters, once, when asked for after
        # decode steps that advanced only the device (a captured step, or rows in fixed slots).
        self._rows_stale = False
        self._row_tokens_seen: list[int] | None = None
        self.row_tokens_seen_device: torch.Tensor | None = None
        # Fixed batch slots (KVHiveCache.stack(batch_slots=...)): which slots hold a running row
        # (host list and device [B] bool). A free slot keeps decoding (one shape for every step)
        # but its row of a layer with per-row lengths does not grow.
        self.row_active: list[bool] | None = None
        self.row_active_device: torch.Tensor | None = None
        self.grows_in_slots = False
        # Stacked rows holding different numbers of tokens (a layer that does not evict while
        # decoding): each row fills slots [0, length) of a common capacity, lengths on the host and
        # on the device ([B] int64); attention reads the whole capacity with the empty slots masked.
        # A layer whose decisions change its rows' lengths on the device (a method that evicts in
        # rows of different lengths, ``Policy.decodes_rows_of_different_lengths``) marks the host
        # list stale; it is read back, once, the next time it is asked for outside a decode step.
        self._row_lengths = None
        self.row_lengths_device: torch.Tensor | None = None
        # A fixed decode capacity (reserve_decode): the dense buffers hold the prompt's kept tokens
        # plus room for every decode step, new tokens are written at a device index, and attention
        # runs over the whole capacity with the empty slots masked, so a layer that grows by a
        # token per step (the full cache, prefill-only methods) keeps one shape from step to step.
        self.length_device: torch.Tensor | None = None
        self._length_value = 0
        self._length_stale = False
        self.fixed_capacity = False
        # Whether the fixed capacity is a bound its decisions keep (reserve_decode(exact=True)): every
        # decode append then fits, so an append never asks for the host length.
        self.bounded_capacity = False
        # Held in a capacity of its budget (plus the new token) by a method that keeps min(budget, N),
        # because the prompt left fewer tokens than the budget (KVHiveCache._reserve_decode).
        self.fills_to_budget = False
        # Whether the method reads a new token's per-token scores before writing them
        # (Policy.reads_newest_token_scores): an append zeroes them, and fill_hole moves them with
        # the newest token; else neither, but for the cache's own (PADDING_SCORE: _reset_scores).
        self.new_token_scores_read = True
        # Whether the stored order is the tokens' order (oldest first); False once a decode eviction
        # wrote the newest token into the freed slot (fill_hole), until the layer is emptied.
        self.stored_in_order = True
        # Whether the latest update was this layer's first (its prefill), and how many tokens it had.
        self.in_prefill = False
        self.last_update_tokens = 0
        # Whether the prompt had left padding (recorded by the attention at prefill).
        self.has_padding = False
        # Replication of each KV head when a policy stores one copy per query head.
        self.heads_per_kv_head = 1
        # Room each packed segment gets for appends when the layer is packed (a cache with a decode
        # capacity sets it to that capacity, so the layout made at prefill already has the room).
        self.segment_reserve_tokens = SEGMENT_RESERVE_TOKENS
        self.policy_state: dict = {}
        self.decode_steps_since_compression = 0
        self.rope_tokens_seen = 0
        # Tokens seen when the layer last evicted in a prompt (crop cannot roll back below it).
        self.settled_tokens = 0
        self._clear()

    def _clear(self) -> None:
        """Empty the layer: the dense layout, nothing stored (a packed layer becomes dense again)."""
        self.__class__ = DenseLayerStore
        for name in PackedLayerStore.LAYOUT_FIELDS:
            self.__dict__.pop(name, None)
        self.is_initialized = False
        self._key_buffer: torch.Tensor | None = None  # [B, H, C, d] (dense) or [C, d] (packed)
        self._value_buffer: torch.Tensor | None = None
        self._position_buffer: torch.Tensor | None = None  # [B, H, C] or [C]
        self._score_buffers: dict[str, torch.Tensor] = {}
        self._start = 0
        self._length = 0
        self._batch = 0
        self._heads = 0

    def _reset_scores(self) -> list[str]:
        """The per-token scores whose entry a new token resets to 0 when it is appended, and that move
        with the newest token into a freed slot (``fill_hole``): every score where the method reads a
        new token's before writing them (``new_token_scores_read``), else only the cache's own
        (``PADDING_SCORE``: the attention reads it for the newest token too). The slot of a score left
        out holds whatever was there (a dropped token's entry, or a new buffer's unset slot)."""
        return [name for name in self._score_buffers if self.new_token_scores_read or name == PADDING_SCORE]

    @property
    def _row_tokens_seen(self) -> list[int] | None:
        if self._rows_stale:
            self._refresh_rows()
        return self._row_tokens_seen_value

    @_row_tokens_seen.setter
    def _row_tokens_seen(self, value: list[int] | None) -> None:
        self._row_tokens_seen_value = value

    @property
    def _row_lengths(self) -> list[int] | None:
        if self._rows_stale:
            self._refresh_rows()
        return self._row_lengths_value

    @_row_lengths.setter
    def _row_lengths(self, value: list[int] | None) -> None:
        self._row_lengths_value = value

    def trust_the_device(self) -> None:
        """Read every counter mirrored on the host back from the device, now (a leave or a join of
        fixed batch slots, ``KVHiveCache.free_slots``/``fill_slots``, which may read the host; the
        steps after it then read nothing). A captured step (a CUDA graph) marks the host mirrors
        stale once, as it is captured; its replays run no Python, so they advance the device counters
        without telling the host, and a mirror read back since the capture is behind them by every
        replay after that read."""
        if not self.is_initialized:
            return
        if self.tokens_seen_device is not None:
            self._tokens_seen_stale = True
            _ = self.tokens_seen
        if self.row_tokens_seen_device is not None or self.row_lengths_device is not None:
            self._refresh_rows()
        if self.fixed_capacity and self.length_device is not None and self.row_lengths_device is None:
            self._length_stale = True
            _ = self._length

    def _refresh_rows(self) -> None:
        """Read the per-row counters back (once) after steps that advanced only the device."""
        self._rows_stale = False
        if self.row_tokens_seen_device is not None:
            self._row_tokens_seen_value = self.row_tokens_seen_device.tolist()
        if self.row_lengths_device is not None:
            self._row_lengths_value = self.row_lengths_device.tolist()
            self._length = max(self._row_lengths_value)

    @property
    def tokens_seen(self) -> int:
        """Tokens this layer has seen (a host int; read from the device counter, once, after
        compiled decode steps advanced it)."""
        if self._tokens_seen_stale:
            self._tokens_seen = int(self.tokens_seen_device)
            self._tokens_seen_stale = False
        return self._tokens_seen

    @tokens_seen.setter
    def tokens_seen(self, value: int) -> None:
        self._tokens_seen = value
        self._tokens_seen_stale = False
        if self.tokens_seen_device is not None:
            self.tokens_seen_device.fill_(value)

    # -- transformers' CacheLayerMixin ---------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self._batch, self._heads = key_states.shape[0], key_states.shape[1]
        self.tokens_seen_device = torch.zeros((), dtype=torch.int64, device=self.device)
        # A fixed address, as transformers' StaticLayer marks its buffers: a compiled step then
        # reads it in place instead of copying it in (or skipping CUDA graphs).
        torch._dynamo.mark_static_address(self.tokens_seen_device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append the new tokens; returns the dense view (or the flat buffers when packed)."""
        self.in_prefill = not self.is_initialized
        self.last_update_tokens = key_states.shape[2]
        if self.fixed_capacity and key_states.shape[2] > 1 and self.row_lengths_device is None:
            # A prompt chunk (or a multi-token continuation): the growing layout from here on (a
            # decode step reserves again).
            self.fixed_capacity = self.bounded_capacity = self.fills_to_budget = False
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.heads_per_kv_head > 1:
            key_states = key_states.repeat_interleave(self.heads_per_kv_head, dim=1)
            value_states = value_states.repeat_interleave(self.heads_per_kv_head, dim=1)
        new_tokens = key_states.shape[2]
        self._append(key_states, value_states, new_tokens)
        self.tokens_seen_device.add_(new_tokens)
        if self.row_tokens_seen_device is not None:
            self.row_tokens_seen_device.add_(new_tokens)
            if in_static_step() or self._rows_stale:
                self._rows_stale = True  # no guard on (or read of) the host lists
            else:
                self._row_tokens_seen = [seen + new_tokens for seen in self._row_tokens_seen]
        if in_static_step():
            self._tokens_seen_stale = True  # a constant store: no guard on the host count
        else:
            self._tokens_seen = self.tokens_seen + new_tokens
        return self._attention_view()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if query_length == 1 and in_static_step():
            # kvhive's mask function builds no mask for one new query (kvhive's attention masks a
            # decode step itself), so the size is unused; a constant keeps the step static.
            return 1, 0
        # The mask spans every original position; attention gathers it at kept tokens.
        return self.tokens_seen + query_length, 0

    def get_seq_length(self) -> int | torch.Tensor:
        # In a compiled step, the device counter (as transformers' StaticLayer): model positions
        # then come from a tensor instead of a Python int the graph would specialise on.
        if in_static_step():
            return self.tokens_seen_device
        return self.tokens_seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self._clear()
        self._tokens_seen, self._tokens_seen_stale, self.tokens_seen_device = 0, False, None
        self._rows_stale = False
        self._row_tokens_seen, self.row_tokens_seen_device = None, None
        self._row_lengths, self.row_lengths_device = None, None
        self.row_active, self.row_active_device, self.grows_in_slots = None, None, False
        self.length_device, self._length_value, self._length_stale, self.fixed_capacity = None, 0, False, False
        self.bounded_capacity = self.fills_to_budget = False
        self.stored_in_order = True
        self.in_prefill = False
        self.has_padding = False
        self.policy_state = {}
        self.heads_per_kv_head = 1
        self.decode_steps_since_compression = 0
        self.settled_tokens = 0

    def crop_problem(self, tokens_to_remove: int) -> str | None:
        """Why :meth:`crop` cannot roll this layer back (``None`` when it can). Reads the stored
        positions back: a crop happens between forwards, never inside a compiled step."""
        remove = self._tokens_to_crop(tokens_to_remove)
        if remove == 0:
            return None
        if remove > self.tokens_seen:
            return f"cannot remove {remove} tokens from layer {self.layer_index}: it has seen {self.tokens_seen}"
        if not self.is_uniform or self._row_tokens_seen is not None:
            return (
                f"layer {self.layer_index} keeps a different number of tokens per head or per row (head-wise budgets, "
                "or stacked caches): rolling it back is not supported"
            )
        length, new_seen = self._length, self.tokens_seen - remove
        if new_seen < self.settled_tokens:
            return (
                f"layer {self.layer_index} was compressed with the first {self.settled_tokens} tokens, so it cannot be "
                f"rolled back to {new_seen}: run the prompt through the cache before generating with an assistant "
                "(transformers feeds the prompt and the first drafts in one forward)"
            )
        positions = self.dense()[2]
        # Only tokens appended since the layer last evicted can go: the newest ``remove`` stored
        # tokens must be exactly those at or past the new length.
        if remove > length or not bool((positions[..., length - remove :] >= new_seen).all()):
            return (
                f"layer {self.layer_index} evicted some of the last {remove} tokens (or compressed after they "
                "arrived): they cannot be rolled back"
            )
        if self.is_sliding and length - remove < min(new_seen, self.sliding_window - 1):
            return f"layer {self.layer_index}'s window slid past tokens the rolled-back cache needs again"
        return None

    def _tokens_to_crop(self, tokens_to_remove: int) -> int:
        # transformers passes minus the number of tokens to remove; a positive value is the legacy
        # absolute length to keep (transformers < 5.24).
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int):
            raise ValueError(f"invalid tokens_to_remove={tokens_to_remove!r}: expected an integer")
        if not self.is_initialized:
            return 0
        if tokens_to_remove <= 0:
            return -tokens_to_remove
        return max(0, self.tokens_seen - tokens_to_remove)

    def crop(self, tokens_to_remove: int) -> None:
        """Roll back the newest tokens: assisted or speculative decoding's rejected drafts. Only
        tokens appended since the layer last evicted can be removed (``crop_problem``); the freed
        slots are zeroed, as a fixed decode capacity's empty slots must be."""
        problem = self.crop_problem(tokens_to_remove)
        if problem is not None:
            raise ValueError(problem)
        remove = self._tokens_to_crop(tokens_to_remove)
        if remove == 0:
            return
        self._drop_newest(remove)

    def drop_newest(self, count: int) -> None:
        """Forget the ``count`` newest stored tokens, appended by the forward now running and not yet
        evicted from (a question-aware chunked prefill's copy of the question, once the layer's
        attention ran): the layer has then seen ``count`` tokens fewer."""
        if not self.is_uniform or self._row_tokens_seen is not None or count > self._length:
            raise RuntimeError(
                f"layer {self.layer_index}: cannot drop its {count} newest tokens (a copy of the question): the layer "
                "holds a different number of tokens per head or per row, or fewer tokens"
            )
        self._drop_newest(count)

    def _drop_newest(self, remove: int) -> None:
        length = self._length
        freed = slice(self._start + length - remove, self._start + length)
        for buffer in (self._key_buffer, self._value_buffer, self._position_buffer, *self._score_buffers.values()):
            buffer[:, :, freed].zero_()
        self._length = length - remove
        self.tokens_seen = self.tokens_seen - remove

    # Batch rows (beam search, contrastive search, batch slicing). ``KVHiveCache`` overrides the
    # cache-level methods to select its method's per-layer state too; these move the layer's tokens.
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.select_rows(torch.arange(max(self._batch, 0)).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.select_rows(row_index(indices, self._batch))

    def check_rows_selectable(self, method: str) -> None:
        """Refuse (before anything changes) a layout whose rows cannot be selected yet (packed)."""

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (1-D; rows may repeat or be reordered) in every buffer with a
        batch dimension: keys, values, positions, per-token scores and the per-row counters. The
        buffers keep their capacity (a fresh allocation of the selected rows)."""
        if not self.is_initialized:
            return
        self.check_rows_selectable("(any)")
        host_index = index.detach().to("cpu", torch.long).reshape(-1)
        rows = host_index.tolist()
        if rows and (min(rows) < 0 or max(rows) >= self._batch):
            raise IndexError(f"batch row index {rows} out of range for a batch of {self._batch} row(s)")
        device_index = host_index.to(self.device)
        if self._key_buffer is not None:
            self._key_buffer = _static(self._key_buffer.index_select(0, device_index))
            self._value_buffer = _static(self._value_buffer.index_select(0, device_index))
            self._position_buffer = _static(self._position_buffer.index_select(0, device_index))
            self._score_buffers = {
                name: _static(buffer.index_select(0, device_index)) for name, buffer in self._score_buffers.items()
            }
        if self._row_tokens_seen is not None:
            self._row_tokens_seen = [self._row_tokens_seen[row] for row in rows]
            self.row_tokens_seen_device = self.row_tokens_seen_device.index_select(0, device_index)
        if self.row_lengths_device is not None:
            self._row_lengths = [self._row_lengths[row] for row in rows]
            self.row_lengths_device = self.row_lengths_device.index_select(0, device_index)
        if self.row_active is not None:
            self.row_active = [self.row_active[row] for row in rows]
            self.row_active_device = self.row_active_device.index_select(0, device_index)
        self._batch = len(rows)

    # -- rows that have seen different numbers of tokens (stacked caches) ------------------------
    @property
    def row_tokens_seen(self) -> list[int]:
        """Tokens seen by each batch row (host)."""
        if self._row_tokens_seen is not None:
            return list(self._row_tokens_seen)
        return [self.tokens_seen] * max(self._batch, 0)

    @property
    def has_row_lengths(self) -> bool:
        """Whether rows hold different numbers of tokens in slots of a common capacity."""
        return self.row_lengths_device is not None

    def _new_positions(self, new_tokens: int) -> torch.Tensor:
        """Original positions of ``new_tokens`` appended tokens: ``[new]``, or ``[B, 1, new]`` when
        rows have seen different numbers of tokens."""
        if new_tokens == 1 and self.row_tokens_seen_device is None:
            return self.tokens_seen_device.view(1).to(POSITION_DTYPE)  # a decode step: no arange, no add
        grow = torch.arange(new_tokens, device=self.device)
        if self.row_tokens_seen_device is not None:
            return (grow + self.row_tokens_seen_device[:, None]).to(POSITION_DTYPE)[:, None, :]
        return (grow + self.tokens_seen_device).to(POSITION_DTYPE)

    # -- shape (host-side: never reads the device) ---------------------------------------------
    @property
    def batch_size(self) -> int:
        return self._batch if self.is_initialized else -1

    @property
    def num_heads(self) -> int:
        return self._heads

    @property
    def num_segments(self) -> int:
        return self._batch * self._heads

    @property
    def num_stored(self) -> int:
        return self._num_stored() if self.is_initialized else 0

    @property
    def lengths_host(self) -> torch.Tensor:
        """Stored tokens per row as a CPU ``[B, H]`` int64 tensor."""
        if not self.is_initialized:
            return torch.zeros(0, 0, dtype=torch.long)
        return self._lengths_host()

    @property
    def lengths(self) -> torch.Tensor | None:
        """Stored tokens per row, ``[B, H]`` on the cache's device (made from the host mirror)."""
        if not self.is_initialized:
            return None
        return self.lengths_host.to(self.device)

    @property
    def capacity(self) -> int:
        """Tokens the allocated buffers can hold (all rows together)."""
        return 0 if self._key_buffer is None else self._capacity()

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The allocated key and value buffers (dense: ``[B, H, capacity, d]``)."""
        return self._key_buffer, self._value_buffer

    @property
    def slice_start(self) -> int:
        """Dense layout: index of the oldest stored token in every row of the buffers."""
        return self._start

    @property
    def token_scores(self) -> dict[str, torch.Tensor]:
        """Per-token float32 scores aligned with the stored tokens (``[B, H, L]`` views when
        dense, flat ``[T]`` in segment order when packed)."""
        if not self.is_initialized or self._key_buffer is None:
            return {}
        return self._token_scores()

    def reserve_decode(self, tokens: int, exact: bool = False) -> None:
        """Give the buffers room for ``tokens`` more tokens at once and switch the layer to its
        fixed decode capacity (see ``fixed_capacity``): appends write at a device index. Dense:
        ``decode_view`` is the whole capacity with a mask of the filled slots; packed: every segment
        gets the room (``PackedLayerStore._reserve``) and attention reads every page of the buffers, the slots
        past each segment's device length masked (``packed_pages``).

        ``exact`` (dense): the capacity is exactly the stored tokens plus ``tokens`` (attention runs
        over all of it) and a bound the layer's decisions keep (``compact_in_place`` after every
        append), so appends never check it on the host."""
        if not self.is_initialized or self._key_buffer is None:
            return
        self._reserve(tokens, exact)

    # -- eviction ----------------------------------------------------------------------------------
    def keep(self, keep_mask: torch.Tensor, counts: torch.Tensor | int | None = None) -> None:
        """Drop every token whose entry in ``keep_mask`` is False and free it.

        ``keep_mask`` is ``[B, H, L]`` over the dense view, or ``[T]`` over the stored tokens in
        segment order (packed). ``counts`` (``[B, H]`` kept per row, on the host, or one int when
        every row of a dense mask keeps the same count) saves reading them back when the caller
        already has them. Rows may keep different counts; the layer is
        then packed. Buffers are re-allocated when the kept tokens fill less than half of them,
        so evicted memory is released.
        """
        if keep_mask.dtype != torch.bool:
            raise TypeError(f"a keep mask must be boolean, got {keep_mask.dtype}")
        self._keep(keep_mask, counts)

    def _flat_counts(self, keep_mask: torch.Tensor, counts) -> torch.Tensor:
        """Kept tokens per segment ``[S]`` (host) of a flat mask over the stored tokens."""
        if keep_mask.shape[0] != self.num_stored:
            raise ValueError("flat keep mask must cover every stored token")
        if counts is None:
            segment = torch.repeat_interleave(
                torch.arange(self.num_segments, device=self.device),
                self.lengths_host.reshape(-1).to(self.device),
                output_size=keep_mask.shape[0],
            )
            counts = (
                torch.zeros(self.num_segments, dtype=torch.long, device=self.device)
                .index_add_(0, segment, keep_mask.long())
                .cpu()
            )
        return counts.reshape(-1).long()

    def stored_flat_positions(self) -> torch.Tensor:
        """Original positions of the stored tokens, ``[T]`` in segment order."""
        _, _, positions, _ = self._flat_buffers()
        return positions[self._stored_index()]

    def stored_keys(self) -> torch.Tensor:
        """Keys of the stored tokens, ``[T, d]`` in segment order (a copy)."""
        keys, _, _, _ = self._flat_buffers()
        return keys[self._stored_index()]

    def stored_values(self) -> torch.Tensor:
        """Values of the stored tokens, ``[T, dv]`` in segment order (a copy)."""
        _, values, _, _ = self._flat_buffers()
        return values[self._stored_index()]

    def segment_offsets(self) -> torch.Tensor:
        """``[B*H + 1]`` (host) start of each row in the segment order of ``stored_*``."""
        flat = self.lengths_host.reshape(-1)
        return torch.cat([flat.new_zeros(1), flat.cumsum(0)])

    def set_keys(self, keys: torch.Tensor) -> None:
        """Overwrite the stored keys (dense ``[B, H, L, d]``), e.g. after re-rotating them."""
        self.dense()[0].copy_(keys)

    # -- one layout's views (the other layout refuses them) ---------------------------------------
    def dense(self):
        """``(keys, values, positions, token_scores)`` viewed as ``[B, H, L, ...]`` (no copy)."""
        self._not_dense("a dense view")

    @property
    def dense_length(self) -> int:
        """Tokens per row in the dense layout."""
        self._not_dense("dense_length")

    def set_token_scores(self, name: str, scores: torch.Tensor) -> None:
        """Store per-token scores ``[B, H, L]`` (dense) aligned with the stored tokens."""
        self._not_dense("per-token scores")

    def decode_view(self):
        """``(keys, values, positions, token_scores, filled)`` for a dense decode step's attention."""
        self._not_dense("decode_view")

    @property
    def known_length(self) -> int | None:
        """A dense fixed capacity's tokens per row when the host knows them (``DenseLayerStore``)."""
        return None

    def drop_oldest(self, count: int) -> None:
        """Forget the ``count`` oldest tokens of every row (dense layout)."""
        if count > 0:
            self._not_dense("drop_oldest")

    def release_unused(self) -> None:
        """After a prefill: buffers of the stored tokens plus the append reserve, where they hold
        more (the packed layout sizes its segments so already; a fixed capacity keeps its size)."""

    def expand_to_query_heads(self, heads_per_kv_head: int) -> None:
        """Store one copy of each KV head per query head of its group (Ada-KV on GQA/MQA)."""
        if heads_per_kv_head == 1 or self.heads_per_kv_head == heads_per_kv_head:
            return
        self._not_dense("expand_to_query_heads")

    def packed(self):
        """The flat layout read by the variable-length attention (packed layer)."""
        self._not_packed("packed()")

    def packed_buffers(self):
        """The packed buffers as they are (packed layer)."""
        self._not_packed("packed_buffers()")

    def packed_pages(self):
        """The page table of the packed buffers (packed layer)."""
        self._not_packed("packed_pages()")

    @property
    def segment_capacity_host(self) -> torch.Tensor | None:
        """Packed layout: tokens reserved per segment (whole pages), CPU ``[S]``; None when dense."""
        return None

    # -- what each layout implements ------------------------------------------------------------
    is_uniform = True
    """Every row holds the same number of tokens (the dense layout)."""

    def _append(self, key_states, value_states, new_tokens: int) -> None:
        raise NotImplementedError

    def _attention_view(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _num_stored(self) -> int:
        raise NotImplementedError

    def _lengths_host(self) -> torch.Tensor:
        raise NotImplementedError

    def _capacity(self) -> int:
        raise NotImplementedError

    def _token_scores(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _reserve(self, tokens: int, exact: bool = False) -> None:
        raise NotImplementedError

    def _keep(self, keep_mask: torch.Tensor, counts) -> None:
        raise NotImplementedError

    def _stored_index(self) -> torch.Tensor:
        """Buffer index of every stored token, in segment order (``[T]`` on the device)."""
        raise NotImplementedError

    def _flat_buffers(self):
        """``(keys [C, d], values [C, dv], positions [C], scores {name: [C]})`` over every slot."""
        raise NotImplementedError

    def _layout_metadata_nbytes(self) -> int:
        return 0

    def _not_dense(self, what: str):
        raise RuntimeError(
            f"layer {self.layer_index} holds a different number of tokens per head (packed): {what} needs the "
            "dense layout (use the variable-length path)"
        )

    def _not_packed(self, what: str):
        raise RuntimeError(f"layer {self.layer_index} is dense: {what} needs the packed layout")

    # -- accounting ----------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes of the kept tokens' key/value payload."""
        if self._key_buffer is None:
            return 0
        return self.num_stored * self.bytes_per_token()

    def reserved_nbytes(self) -> int:
        """Bytes of the allocated key/value buffers (kept tokens plus the append reserve)."""
        if self._key_buffer is None:
            return 0
        return (
            self._key_buffer.numel() * self._key_buffer.element_size()
            + self._value_buffer.numel() * self._value_buffer.element_size()
        )

    def metadata_nbytes(self) -> int:
        """Bytes of bookkeeping (positions, lengths, per-token scores) of the kept tokens."""
        if self._key_buffer is None:
            return 0
        per_token = self._position_buffer.element_size() + 4 * len(self._score_buffers)
        total = self.num_stored * per_token
        return total + self._layout_metadata_nbytes()

    def bytes_per_token(self) -> int:
        """Key + value bytes of one token in one stored head."""
        return (self._key_buffer.shape[-1] + self._value_buffer.shape[-1]) * self._key_buffer.element_size()


class DenseLayerStore(LayerStore):
    """A layer whose rows all hold the same number of tokens: buffers ``[B, H, capacity, d]``, the
    stored tokens the slice ``[start, start + L)`` (see the module docstring)."""

    is_uniform = True

    @property
    def _length(self) -> int:
        """Tokens per row in the dense layout (host); read from the device counter, once, after
        compiled decode steps appended to a layer with a fixed decode capacity. (Rows' token counts
        that a captured step advanced on the device only are no part of it: a layer with one length
        for every row, stacked or in slots, answers without reading them back.)"""
        if self.row_lengths_device is not None and self._rows_stale:
            self._refresh_rows()
        if self._length_stale:
            if self.row_lengths_device is not None:  # rows of different lengths: the longest
                self._length_value = max(self._row_lengths)
            else:
                self._length_value = int(self.length_device)
            self._length_stale = False
        return self._length_value

    @_length.setter
    def _length(self, value: int) -> None:
        self._length_value = value
        self._length_stale = False
        if self.length_device is not None:
            self.length_device.fill_(value)

    def _num_stored(self) -> int:
        if self.row_lengths_device is not None:
            return self._heads * sum(self._row_lengths)
        return self.num_segments * self._length

    @property
    def max_length(self) -> int:
        """The longest row (host-side)."""
        return self._length

    def _lengths_host(self) -> torch.Tensor:
        if self.row_lengths_device is not None:
            return torch.tensor(self._row_lengths, dtype=torch.long)[:, None].expand(self._batch, self._heads).clone()
        return torch.full((self._batch, self._heads), self._length, dtype=torch.long)

    def _capacity(self) -> int:
        return self.num_segments * int(self._key_buffer.shape[2])

    def _token_scores(self) -> dict[str, torch.Tensor]:
        return self.dense()[3]

    def _attention_view(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fixed_capacity:  # the whole buffers (decode_view's, without its filled mask)
            return self._key_buffer, self._value_buffer
        view = self.dense()
        return view[0], view[1]

    def dense(self):
        """``(keys, values, positions, token_scores)`` viewed as ``[B, H, L, ...]`` (no copy)."""
        if self._key_buffer is None:
            raise RuntimeError(f"layer {self.layer_index} holds no tokens yet")
        window = slice(self._start, self._start + self._length)
        scores = {name: buffer[:, :, window] for name, buffer in self._score_buffers.items()}
        return (
            self._key_buffer[:, :, window],
            self._value_buffer[:, :, window],
            self._position_buffer[:, :, window],
            scores,
        )

    @property
    def dense_length(self) -> int:
        """Tokens per row in the dense layout."""
        return self._length

    def set_token_scores(self, name: str, scores: torch.Tensor) -> None:
        """Store per-token scores ``[B, H, L]`` (dense) aligned with the stored tokens."""
        buffer = self._score_buffers.get(name)
        if buffer is None:
            buffer = _static(_score_buffer(self._key_buffer.shape[:3], self.device))
            self._score_buffers[name] = buffer
        start = 0 if self.fixed_capacity else self._start  # fixed: the whole capacity, empty slots included
        if not torch.compiler.is_compiling() and (
            scores.data_ptr() == buffer.data_ptr() + start * buffer.stride(2) * buffer.element_size()
            and scores.stride() == buffer.stride()
            and scores.shape[-1] == (buffer.shape[2] if self.fixed_capacity else self._length)
        ):
            return  # the policy handed back the stored view itself (a compiled step copies it onto itself)
        target = buffer if self.fixed_capacity else buffer[:, :, start : start + self._length]
        target.copy_(scores.reshape(self._batch, self._heads, -1))

    def _allocate_dense(self, capacity: int, head_dim: int, value_dim: int):
        b, h = self._batch, self._heads
        keys = torch.empty(b, h, capacity, head_dim, dtype=self.dtype, device=self.device)
        values = torch.empty(b, h, capacity, value_dim, dtype=self.dtype, device=self.device)
        positions = torch.empty(b, h, capacity, dtype=POSITION_DTYPE, device=self.device)
        return _static(keys), _static(values), _static(positions)

    def _move_dense(self, capacity: int) -> None:
        """Copy the stored slice to the front of new (or the same, when it fits) buffers."""
        window = slice(self._start, self._start + self._length)
        same = capacity == self._key_buffer.shape[2]
        if same:
            # Overlapping ranges: stage through a copy (rare: only when a sliding slice reaches the end).
            keys = self._key_buffer[:, :, window].clone()
            values = self._value_buffer[:, :, window].clone()
            positions = self._position_buffer[:, :, window].clone()
            scores = {name: buffer[:, :, window].clone() for name, buffer in self._score_buffers.items()}
            new_keys, new_values, new_positions = self._key_buffer, self._value_buffer, self._position_buffer
            new_scores = self._score_buffers
        else:
            keys, values = self._key_buffer[:, :, window], self._value_buffer[:, :, window]
            positions = self._position_buffer[:, :, window]
            scores = {name: buffer[:, :, window] for name, buffer in self._score_buffers.items()}
            new_keys, new_values, new_positions = self._allocate_dense(
                capacity, self._key_buffer.shape[-1], self._value_buffer.shape[-1]
            )
            new_scores = {name: _static(_score_buffer(new_keys.shape[:3], self.device)) for name in self._score_buffers}
        length = self._length
        new_keys[:, :, :length].copy_(keys)
        new_values[:, :, :length].copy_(values)
        new_positions[:, :, :length].copy_(positions)
        for name, score in scores.items():
            new_scores[name][:, :, :length].copy_(score)
        self._key_buffer, self._value_buffer, self._position_buffer = new_keys, new_values, new_positions
        self._score_buffers = new_scores
        self._start = 0

    def _reserve(self, tokens: int, exact: bool = False) -> None:
        capacity = self._length + tokens
        if exact and capacity != self._key_buffer.shape[2]:
            self._move_dense(capacity)
        elif self._start != 0 or capacity > self._key_buffer.shape[2]:
            self._move_dense(max(capacity, self._key_buffer.shape[2]))
        # The empty slots are attended with weight 0, and 0 x uninitialised memory can be NaN:
        # they hold zeros until a token is written there.
        for buffer in (self._key_buffer, self._value_buffer, self._position_buffer, *self._score_buffers.values()):
            buffer[:, :, self._length :].zero_()
        if self.length_device is None:
            self.length_device = torch.zeros((), dtype=torch.int64, device=self.device)
            torch._dynamo.mark_static_address(self.length_device)
        self.length_device.fill_(self._length)
        self.fixed_capacity = True
        self.bounded_capacity = exact

    @property
    def known_length(self) -> int | None:
        """A fixed capacity's tokens per row when the host knows them without asking the device (eager
        steps whose method declared what it keeps, ``Policy.kept_per_row``), else None: in a compiled
        step (the device counter is what the graph reads), after a compiled step, or with rows of
        different lengths."""
        if in_static_step():  # first: a compiled step guards on nothing the host tracks here
            return None
        if not self.fixed_capacity or self._length_stale or self.row_lengths_device is not None:
            return None
        return self._length_value

    def decode_view(self):
        """``(keys, values, positions, token_scores, filled)`` for a decode step's attention: the
        stored tokens and None, or with a fixed capacity the whole buffers and ``filled [C]`` (True
        on the slots holding a token; None when the host knows every slot holds one)."""
        if not self.fixed_capacity:
            return (*self.dense(), None)
        capacity = self._key_buffer.shape[2]
        if self.known_length == capacity:  # an eager step of a full capacity: nothing to mask
            return self._key_buffer, self._value_buffer, self._position_buffer, dict(self._score_buffers), None
        if self.row_lengths_device is not None:  # [B, C]: each row its own filled slots
            filled = torch.arange(capacity, device=self.device)[None, :] < self.row_lengths_device[:, None]
            return self._key_buffer, self._value_buffer, self._position_buffer, dict(self._score_buffers), filled
        filled = torch.arange(capacity, device=self.device) < self.length_device
        return self._key_buffer, self._value_buffer, self._position_buffer, dict(self._score_buffers), filled

    def compact_in_place(
        self,
        keep_mask: torch.Tensor,
        kept: torch.Tensor | int,
        at_most_one_dropped: bool = False,
        fill_hole: bool = False,
    ) -> None:
        """Fixed capacity: keep the tokens where ``keep_mask [B, H, C]`` (over the whole capacity,
        False on the empty slots) is True, compacted at the front in their stored order; ``kept`` is
        their number per row (a 0-d device tensor, the same for every row; an int where the host knows
        it, which then stays the host length). Fixed shapes and no host read: the host length is
        refreshed from the device when next asked for. The slots past
        ``kept`` hold copies of dropped tokens (finite values, masked as empty).

        ``at_most_one_dropped``: the caller knows at most one filled slot per row is dropped (every
        False past the first is an empty slot at the end), so the kept tokens just move down past the
        first False, found without a sort. ``fill_hole`` (with it; for a method that reads no stored
        order, ``Policy.reads_stored_order``): the newest token, at the end of the filled slots, moves
        into the dropped token's slot instead (one token per row moved; the stored order is then no
        longer the tokens' order). With nothing dropped, it is copied to the first empty slot, past
        the kept ones."""
        if not self.fixed_capacity:
            raise RuntimeError(f"layer {self.layer_index} has no fixed decode capacity")
        capacity = self._key_buffer.shape[2]
        if self.row_lengths_device is not None and (fill_hole or at_most_one_dropped):
            raise ValueError("a layer of rows of different lengths compacts by a sort (kept per row)")
        if fill_hole:
            if not at_most_one_dropped:
                raise ValueError("fill_hole moves one token per row: it needs at_most_one_dropped")
            self.fill_hole_in_capacity(first_false(keep_mask), kept)
            return
        if at_most_one_dropped:
            hole = first_false(keep_mask, keepdim=True)
            slots = torch.arange(capacity, device=self.device)
            order = (slots + (slots >= hole).to(slots.dtype)).clamp_(max=capacity - 1)
        else:
            # Kept tokens first, in their stored (oldest first) order: a stable sort puts True first.
            order = torch.argsort((~keep_mask).to(torch.int8), dim=-1, stable=True)
        rows = (
            torch.arange(self.num_segments, device=self.device)[:, None] * capacity
            + order.reshape(self.num_segments, -1)
        ).reshape(-1)
        keys, values, positions, scores = self._flat_buffers()
        gathered = [buffer.index_select(0, rows) for buffer in (keys, values, positions, *scores.values())]
        for buffer, moved in zip((keys, values, positions, *scores.values()), gathered, strict=True):
            buffer.copy_(moved)
        if self.row_lengths_device is not None:
            # Rows of different lengths: ``kept`` [B] is each row's count (every head of a row keeps
            # the same count); the host lengths are read back when next asked for.
            self.row_lengths_device.copy_(kept)
            self._rows_stale = True
            self._length_stale = True
        else:
            self._set_length(kept)

    def _set_length(self, kept: torch.Tensor | int) -> None:
        """The fixed capacity's new length: a device count (the host's is then stale), or an int the
        host knows (both set)."""
        if isinstance(kept, int):
            self._length = kept
        else:
            self.length_device.copy_(kept)
            self._length_stale = True

    def fill_hole(self, hole: torch.Tensor) -> None:
        """Dense layout, every row dropping exactly one stored token, the one at stored index
        ``hole`` (``[B, H]``, or flat): the newest token (the last stored) moves into the dropped
        token's slot, so a steady decode eviction moves one token per row instead of every token after
        the dropped one. The stored order is then no longer the tokens' order (``stored_in_order``);
        only a method that reads none (``Policy.reads_stored_order`` False) is held this way. The
        per-token scores move too, those nothing reads of the newest token's (``_reset_scores``) excepted."""
        hole = hole.reshape(-1)
        # Slot j of segment s is row s * capacity + j of the flat buffers (one arange each, not a
        # base computed and added to each slot index).
        capacity, newest = self._key_buffer.shape[2], self._start + self._length - 1
        rows = self.num_segments * capacity
        first_slots = torch.arange(self._start, self._start + rows, capacity, device=self.device)
        newest_rows = torch.arange(newest, newest + rows, capacity, device=self.device)
        self._move_rows(first_slots + hole, newest_rows, self._reset_scores())
        self._length = self._length - 1
        self.stored_in_order = False

    def fill_hole_in_capacity(self, hole: torch.Tensor, kept: torch.Tensor | int) -> None:
        """Fixed capacity, every row dropping the token at stored index ``hole`` (``[B, H]``, or flat;
        the last filled slot where a row drops none): the newest token, at the end of the filled
        slots, moves into the freed slot (:meth:`compact_in_place` with ``fill_hole``); ``kept`` as
        there."""
        hole = hole.reshape(-1)
        self._move_token_per_segment(hole, (self.length_device - 1).expand_as(hole))
        self._set_length(kept)
        self.stored_in_order = False

    def _move_token_per_segment(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        """Copy the token in slot ``source[s]`` of every segment ``s`` (``[S]`` slot indices of the
        buffers) to slot ``destination[s]``: keys, values, position and per-token scores."""
        base = torch.arange(self.num_segments, device=self.device) * self._key_buffer.shape[2]
        self._move_rows(base + destination, base + source)

    def _move_rows(
        self, destination_rows: torch.Tensor, source_rows: torch.Tensor, score_names: list[str] | None = None
    ) -> None:
        """Copy row ``source_rows[s]`` of the flat buffers to row ``destination_rows[s]``: keys,
        values, position and the per-token scores (those of ``score_names`` where given)."""
        keys, values, positions, scores = self._flat_buffers()
        moved = scores.values() if score_names is None else [scores[name] for name in score_names]
        for buffer in (keys, values, positions, *moved):
            buffer.index_copy_(0, destination_rows, buffer.index_select(0, source_rows))

    def _append_at_device_index(self, key_states, value_states, new_tokens: int) -> None:
        """Fixed capacity: write the new tokens at the device length (no host value read)."""
        if new_tokens == 1 and self.row_tokens_seen_device is None:
            # A decode step: the device length itself is the slot, the device count the position
            # (no arange and add for either).
            index = self.length_device.view(1)
        else:
            index = torch.arange(new_tokens, device=self.device) + self.length_device
        positions = self._new_positions(new_tokens)
        self._key_buffer.index_copy_(2, index, key_states)
        self._value_buffer.index_copy_(2, index, value_states)
        self._position_buffer.index_copy_(2, index, positions.expand(self._batch, self._heads, new_tokens))
        for name in self._reset_scores():
            self._score_buffers[name].index_fill_(2, index, 0.0)
        self.length_device.add_(new_tokens)
        if in_static_step() or self._length_stale:
            self._length_stale = True  # a constant store: no guard on (or read of) the host length
        else:
            self._length_value += new_tokens

    def _append(self, key_states, value_states, new_tokens: int) -> None:
        if self.row_lengths_device is not None:
            self._append_rows(key_states, value_states, new_tokens)
            return
        if self.fixed_capacity:
            if self.bounded_capacity or in_static_step() or self._length + new_tokens <= self._key_buffer.shape[2]:
                self._append_at_device_index(key_states, value_states, new_tokens)
                return
            # Past the reserved capacity (more tokens than reserved): back to geometric growth.
            self.fixed_capacity = False
        if self._key_buffer is None:
            # First tokens (the prompt): exactly their size; a later append grows the buffer.
            self._key_buffer, self._value_buffer, self._position_buffer = self._allocate_dense(
                new_tokens, key_states.shape[-1], value_states.shape[-1]
            )
            self._start, self._length = 0, 0
        end = self._start + self._length
        if end + new_tokens > self._key_buffer.shape[2]:
            needed = self._length + new_tokens
            capacity = self._key_buffer.shape[2]
            if needed + reserve(needed) // 2 > capacity:
                # Grow geometrically; otherwise (a sliding slice reached the end) move it to the front.
                capacity = needed + reserve(needed)
            self._move_dense(capacity)
            end = self._length
        stop = end + new_tokens
        self._key_buffer[:, :, end:stop].copy_(key_states)
        self._value_buffer[:, :, end:stop].copy_(value_states)
        self._position_buffer[:, :, end:stop].copy_(self._new_positions(new_tokens))
        for name in self._reset_scores():
            self._score_buffers[name][:, :, end:stop].zero_()
        self._length += new_tokens

    def set_rows(
        self,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        positions: list[torch.Tensor],
        scores: list[dict[str, torch.Tensor]],
        tokens_seen: list[int],
        decode_room: int,
        per_row_lengths: bool = False,
        row_capacity: int | None = None,
    ) -> None:
        """Fill an empty layer with rows prefilled separately: ``keys[i]`` ``[1, H, L_i, d]`` (and
        the rest alike) are row ``i``'s stored tokens, ``tokens_seen[i]`` the tokens it has seen.
        Rows of equal length make the usual dense layout; rows of different lengths fill slots
        ``[0, L_i)`` of a common capacity (``max L_i + decode_room``, empty slots zero) with a
        per-row length (``per_row_lengths``: that layout whatever the lengths, for a layer whose
        rows' lengths will part while decoding). ``row_capacity`` (fixed batch slots of a layer that
        grows): that capacity per row whatever the lengths, in the per-row layout, held fixed (an
        append past it is refused, so rows joining later fit in place)."""
        first = keys[0]
        self.dtype, self.device = first.dtype, first.device
        self._batch, self._heads = len(keys), first.shape[1]
        lengths = [int(k.shape[2]) for k in keys]
        longest = max(lengths)
        ragged = len(set(lengths)) > 1 or per_row_lengths or row_capacity is not None
        capacity = longest + (decode_room if ragged else reserve(longest))
        if row_capacity is not None:
            if row_capacity < longest:
                raise ValueError(
                    f"invalid row capacity {row_capacity}: a row holds {longest} tokens in layer {self.layer_index}"
                )
            capacity = row_capacity
        self._key_buffer, self._value_buffer, self._position_buffer = self._allocate_dense(
            capacity, first.shape[-1], values[0].shape[-1]
        )
        names = sorted({name for row in scores for name in row})
        self._score_buffers = {
            name: _static(torch.zeros(self._key_buffer.shape[:3], dtype=torch.float32, device=self.device))
            for name in names
        }
        for buffer in (self._key_buffer, self._value_buffer, self._position_buffer):
            buffer.zero_()  # empty slots are attended with weight 0: never uninitialised memory
        for row, length in enumerate(lengths):
            self._key_buffer[row, :, :length].copy_(keys[row][0])
            self._value_buffer[row, :, :length].copy_(values[row][0])
            self._position_buffer[row, :, :length].copy_(positions[row][0])
            for name, score in scores[row].items():
                self._score_buffers[name][row, :, :length].copy_(score[0])
        self._start = 0
        self.is_initialized = True
        most = max(tokens_seen)
        self.tokens_seen_device = torch.full((), most, dtype=torch.int64, device=self.device)
        torch._dynamo.mark_static_address(self.tokens_seen_device)
        self.tokens_seen = most
        self._row_tokens_seen = list(tokens_seen)
        self.row_tokens_seen_device = torch.tensor(tokens_seen, dtype=torch.int64, device=self.device)
        self._length = longest
        if ragged:
            self._row_lengths = lengths
            self.row_lengths_device = torch.tensor(lengths, dtype=torch.int64, device=self.device)
            torch._dynamo.mark_static_address(self.row_lengths_device)
            self.fixed_capacity = True
            self.bounded_capacity = row_capacity is not None
        self.grows_in_slots = row_capacity is not None
        torch._dynamo.mark_static_address(self.row_tokens_seen_device)

    def set_active_rows(self, active: list[bool]) -> None:
        """Fixed batch slots of a layer that grows (``set_rows(row_capacity=...)``): which rows run
        (True) and which are free. A free row keeps one token (its first) and stops growing, so it
        never outgrows its slot however long it stays free. (A free row of a layer that evicts
        keeps decoding as it was: its method keeps it within the capacity.)"""
        if len(active) != self._batch:
            raise ValueError(f"expected {self._batch} active flags, got {len(active)}")
        if not self.grows_in_slots:
            return
        if self.row_active_device is None:
            self.row_active_device = torch.ones(self._batch, dtype=torch.bool, device=self.device)
            torch._dynamo.mark_static_address(self.row_active_device)
        self.row_active = list(active)
        self.row_active_device.copy_(torch.tensor(active, dtype=torch.bool), non_blocking=False)
        if self.row_lengths_device is not None:
            lengths = [
                length if running else min(length, 1) for length, running in zip(self._row_lengths, active, strict=True)
            ]
            self._row_lengths = lengths
            self.row_lengths_device.copy_(torch.tensor(lengths, dtype=torch.int64))
            self._length = max(lengths)

    def write_row(
        self,
        row: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        scores: dict[str, torch.Tensor],
        tokens_seen: int,
    ) -> None:
        """Fixed batch slots: replace row ``row`` in place with another request's stored tokens
        (``keys [1, H, L, d]`` and the rest as ``set_rows`` takes them) and tokens seen; no buffer
        is reallocated. A layer with per-row lengths takes any ``L`` up to its capacity; a uniform
        layer (every row one length) only its current length."""
        if not 0 <= row < self._batch:
            raise IndexError(f"batch row {row} out of range for a batch of {self._batch} row(s)")
        length = int(keys.shape[2])
        capacity = self._key_buffer.shape[2]
        if self.row_lengths_device is not None:
            if length > capacity:
                raise ValueError(
                    f"the joining row holds {length} tokens in layer {self.layer_index}, more than its slot's "
                    f"capacity of {capacity}: give a larger slot_capacity"
                )
            window = slice(0, length)
        else:
            if length != self._length:
                raise ValueError(
                    f"the joining row holds {length} tokens in layer {self.layer_index}, where every row holds "
                    f"{self._length} (a layer that evicts while decoding keeps one length for every row)"
                )
            window = slice(self._start, self._start + length)
        for buffer, source in (
            (self._key_buffer, keys),
            (self._value_buffer, values),
            (self._position_buffer, positions),
        ):
            buffer[row, :, window].copy_(source[0])
            if self.row_lengths_device is not None:
                buffer[row, :, length:].zero_()  # empty slots are attended with weight 0
        for name in scores.keys() - self._score_buffers.keys():
            self._score_buffers[name] = _static(
                torch.zeros(self._key_buffer.shape[:3], dtype=torch.float32, device=self.device)
            )
        for name, buffer in self._score_buffers.items():
            buffer[row].zero_()
            if name in scores:
                buffer[row, :, window].copy_(scores[name][0])
        seen = self._row_tokens_seen
        seen[row] = tokens_seen
        self._row_tokens_seen = seen
        self.row_tokens_seen_device[row].fill_(tokens_seen)
        if self.row_lengths_device is not None:
            lengths = self._row_lengths
            lengths[row] = length
            self._row_lengths = lengths
            self.row_lengths_device[row].fill_(length)
            self._length = max(lengths)

    def _reallocate_rows(self, capacity: int, keep: int) -> None:
        """Rows of different lengths: new buffers of ``capacity`` slots per row holding the first
        ``keep`` slots of the old ones, zeros beyond (empty slots are attended with weight 0)."""
        old = (self._key_buffer, self._value_buffer, self._position_buffer, self._score_buffers)
        self._key_buffer, self._value_buffer, self._position_buffer = self._allocate_dense(
            capacity, self._key_buffer.shape[-1], self._value_buffer.shape[-1]
        )
        self._score_buffers = {
            name: _static(torch.zeros(self._key_buffer.shape[:3], dtype=torch.float32, device=self.device))
            for name in old[3]
        }
        for new, previous in zip((self._key_buffer, self._value_buffer, self._position_buffer), old[:3], strict=True):
            new.zero_()
            new[:, :, :keep].copy_(previous[:, :, :keep])
        for name, previous in old[3].items():
            self._score_buffers[name][:, :, :keep].copy_(previous[:, :, :keep])

    def reserve_rows(self, capacity: int) -> None:
        """Rows of different lengths held in exactly ``capacity`` slots, a bound the layer's
        decisions keep (``bounded_capacity``: a method that evicts in such rows compacts them after
        every append), so an append never asks for the host lengths. Slots past each row's length
        are zero."""
        if self.row_lengths_device is None:
            raise RuntimeError(f"layer {self.layer_index} holds one length for every row")
        longest = max(self._row_lengths)
        if capacity < longest:
            raise ValueError(f"capacity {capacity} is below the longest row ({longest} tokens)")
        if capacity != self._key_buffer.shape[2]:
            self._reallocate_rows(capacity, longest)
        self.fixed_capacity = True
        self.bounded_capacity = True

    def _append_rows(self, key_states, value_states, new_tokens: int) -> None:
        """Rows of different lengths: row ``b``'s new tokens go to slots ``[L_b, L_b + new)`` (a free
        row of fixed batch slots overwrites its slots past ``L_b`` and does not grow)."""
        capacity = self._key_buffer.shape[2]
        # A captured step, or lengths its evictions changed on the device, read no host length: a
        # bounded capacity is then checked on the device.
        device_only = in_static_step() or self._rows_stale
        longest = 0 if device_only else max(self._row_lengths) + new_tokens
        if longest > capacity and self.bounded_capacity:
            raise ValueError(
                f"a row of layer {self.layer_index} would hold {longest} tokens, past its fixed capacity of "
                f"{capacity} (fixed batch slots: give a larger slot_capacity)"
            )
        if longest > capacity:  # past the room reserved at stacking: a larger capacity, zeros beyond
            self._reallocate_rows(longest + reserve(longest), capacity)
        batch, heads = self._batch, self._heads
        slots = (self.row_lengths_device[:, None] + torch.arange(new_tokens, device=self.device))[:, None, :]
        slots = slots.expand(batch, heads, new_tokens)
        d, dv = key_states.shape[-1], value_states.shape[-1]
        self._key_buffer.scatter_(2, slots[..., None].expand(batch, heads, new_tokens, d), key_states)
        self._value_buffer.scatter_(2, slots[..., None].expand(batch, heads, new_tokens, dv), value_states)
        self._position_buffer.scatter_(2, slots, self._new_positions(new_tokens).expand(batch, heads, new_tokens))
        for name in self._reset_scores():
            self._score_buffers[name].scatter_(2, slots, 0.0)
        if self.row_active_device is None:
            self.row_lengths_device.add_(new_tokens)
        else:
            self.row_lengths_device.add_(self.row_active_device.to(torch.int64) * new_tokens)
        if device_only and self.bounded_capacity:
            torch._assert_async(
                (self.row_lengths_device <= capacity).all(),
                f"a row of layer {self.layer_index} outgrew its fixed capacity of {capacity}",
            )
        if device_only:
            self._rows_stale = True  # no guard on (or read of) the host lists
            return
        active = self.row_active or [True] * self._batch
        self._row_lengths = [
            length + new_tokens if running else length
            for length, running in zip(self._row_lengths, active, strict=True)
        ]
        self._length = max(self._row_lengths)

    def release_unused(self) -> None:
        """After a prefill: buffers of the stored tokens plus the append reserve, where they hold
        more. A prefill's compression compacts the kept tokens in place and re-allocates only when
        they fill less than half the buffers (a decode step that compacts must not re-allocate), so
        a budget of half the prompt or more kept buffers of the whole prompt: nothing was freed; a
        sliding layer kept its window in buffers of the prompt's length (Gemma 3's 5 of 6 layers,
        15k-token prompt: ~4x the model's own cache). A
        prefill happens once a prompt: the copy of the kept tokens costs less than the compression
        did. A fixed decode capacity is sized by ``reserve_decode`` and keeps its addresses."""
        if self._key_buffer is None or self.fixed_capacity or self.row_lengths_device is not None:
            return
        capacity = self._length + reserve(self._length)
        if self._key_buffer.shape[2] > capacity:
            self._move_dense(capacity)

    def drop_oldest(self, count: int) -> None:
        """Forget the ``count`` oldest tokens of every row (dense layout).

        The kept tokens move to the front of the buffers (a copy of at most a window), so a
        sliding layer in its steady state starts at the same place every step: each decode step
        has the same shapes and offsets and compiles to one graph, and the buffers never move.
        (After a prompt longer than the window, ``release_unused`` frees the rest of the buffers.)"""
        if count <= 0:
            return
        count = min(count, self._length)
        length = self._length - count
        kept = slice(self._start + count, self._start + self._length)
        buffers = [self._key_buffer, self._value_buffer, self._position_buffer, *self._score_buffers.values()]
        for buffer in buffers:
            # Staged through a copy: the source and destination ranges overlap.
            buffer[:, :, :length].copy_(buffer[:, :, kept].clone())
        self._start, self._length = 0, length

    def expand_to_query_heads(self, heads_per_kv_head: int) -> None:
        """Store one copy of each KV head per query head of its group (Ada-KV on GQA/MQA)."""
        if heads_per_kv_head == 1 or self.heads_per_kv_head == heads_per_kv_head:
            return
        if self.heads_per_kv_head != 1:
            raise RuntimeError("heads were already expanded with a different factor")
        keys, values, positions, scores = self.dense()
        self._heads *= heads_per_kv_head
        self._key_buffer = keys.repeat_interleave(heads_per_kv_head, dim=1)
        self._value_buffer = values.repeat_interleave(heads_per_kv_head, dim=1)
        self._position_buffer = positions.repeat_interleave(heads_per_kv_head, dim=1)
        self._score_buffers = {n: s.repeat_interleave(heads_per_kv_head, dim=1) for n, s in scores.items()}
        self._start = 0
        self.heads_per_kv_head = heads_per_kv_head

    def _keep(self, keep_mask: torch.Tensor, counts) -> None:
        if keep_mask.dim() == 3:
            if tuple(keep_mask.shape) != (self._batch, self._heads, self._length):
                raise ValueError(f"keep mask shape {tuple(keep_mask.shape)} does not match the stored layout")
            if isinstance(counts, int):
                # Every row keeps ``counts`` tokens, known on the host: nothing is read back.
                if counts != self._length:
                    self._compact_dense(keep_mask, counts)
                return
            if counts is None:
                counts = keep_mask.sum(dim=-1).cpu()
            counts = counts.reshape(self._batch, self._heads).long()
            first = int(counts.reshape(-1)[0]) if counts.numel() else 0
            if bool((counts == first).all()):
                if first == self._length:
                    return
                self._compact_dense(keep_mask, first)
            else:
                self._pack(keep_mask.reshape(-1), counts.reshape(-1))
            return
        # Stored order is segment order: the dense view's mask is the same bits.
        counts = self._flat_counts(keep_mask, counts)
        self._keep(keep_mask.view(self._batch, self._heads, self._length), counts)

    def _compact_dense(self, keep_mask: torch.Tensor, kept: int) -> None:
        if kept == self._length - 1:
            # One token left each row (a steady decode step): every kept token moves down past
            # the row's one hole (the first False, first_false), with no sort over the row.
            hole = first_false(keep_mask, keepdim=True)
            slots = torch.arange(kept, device=self.device)
            order = slots + (slots >= hole).to(slots.dtype)
        else:
            # Kept tokens in their stored (oldest first) order: a stable sort puts True first.
            order = torch.argsort((~keep_mask).to(torch.int8), dim=-1, stable=True)[..., :kept]
        capacity = self._key_buffer.shape[2]
        # Row index of every kept token in the flat buffers: index_select copies whole rows, far
        # faster than a gather with an index expanded over the head dimension.
        rows = (
            torch.arange(self.num_segments, device=self.device)[:, None] * capacity
            + self._start
            + order.reshape(self.num_segments, kept)
        ).reshape(-1)
        keys, values, positions, scores = self._flat_buffers()
        d, dv = keys.shape[-1], values.shape[-1]
        shape = (self._batch, self._heads, kept)
        gathered_keys = keys.index_select(0, rows).view(*shape, d)
        gathered_values = values.index_select(0, rows).view(*shape, dv)
        gathered_positions = positions.index_select(0, rows).view(shape)
        gathered_scores = {name: score.index_select(0, rows).view(shape) for name, score in scores.items()}
        if capacity > 2 * (kept + reserve(kept)) and not self.fixed_capacity:
            # Release the evicted memory: new buffers sized to what is kept.
            capacity = kept + reserve(kept)
            self._key_buffer, self._value_buffer, self._position_buffer = self._allocate_dense(capacity, d, dv)
            self._score_buffers = {
                name: _static(_score_buffer(self._key_buffer.shape[:3], self.device)) for name in scores
            }
        self._key_buffer[:, :, :kept].copy_(gathered_keys)
        self._value_buffer[:, :, :kept].copy_(gathered_values)
        self._position_buffer[:, :, :kept].copy_(gathered_positions)
        for name, score in gathered_scores.items():
            self._score_buffers[name][:, :, :kept].copy_(score)
        self._start, self._length = 0, kept

    def _stored_index(self) -> torch.Tensor:
        lengths = self.lengths_host.reshape(-1)
        total = int(lengths.sum())
        capacity = self._key_buffer.shape[2]
        starts = torch.arange(self.num_segments, dtype=torch.long) * capacity + self._start
        # token j of segment s sits at starts[s] + j = (starts[s] - offset[s]) + global index.
        offsets = torch.cumsum(lengths, 0) - lengths
        shift, lengths = to_device_at_once(self.device, starts - offsets, lengths)
        return torch.repeat_interleave(shift, lengths, output_size=total) + torch.arange(total, device=self.device)

    def _flat_buffers(self):
        d, dv = self._key_buffer.shape[-1], self._value_buffer.shape[-1]
        return (
            self._key_buffer.view(-1, d),
            self._value_buffer.view(-1, dv),
            self._position_buffer.view(-1),
            {name: buffer.view(-1) for name, buffer in self._score_buffers.items()},
        )

    def _pack(self, flat_mask: torch.Tensor, counts: torch.Tensor) -> None:
        """Re-lay the kept tokens (``flat_mask`` over stored tokens in segment order) out packed,
        each segment with its own append reserve: the layer becomes a :class:`PackedLayerStore`."""
        source_index = self._stored_index().index_select(0, true_indices(flat_mask, counts))
        keys, values, positions, scores = self._flat_buffers()
        self.__class__ = PackedLayerStore
        self._start, self._length_value, self._length_stale = 0, 0, False
        self._set_packed(counts, keys, values, positions, scores, source_index, self.segment_reserve_tokens)


class PackedLayerStore(LayerStore):
    """A layer whose rows hold different counts (head-wise budgets): flat buffers ``[capacity, d]``,
    one segment of whole pages per (row, head) (see the module docstring)."""

    is_uniform = False
    # Attributes only this layout has (dropped when the layer is reset to the dense layout).
    LAYOUT_FIELDS = (
        "_segment_start_host",
        "_segment_length_host_value",
        "_segment_capacity_host",
        "_segment_start",
        "_segment_length",
        "_segment_capacity",
        "_page_segment",
        "_page_offset",
        "_packed_bound",
        "_packed_stale",
        "_packed_max_length_value",
        "_packed_headroom_value",
    )

    # Packed layout, host mirrors: refreshed from the device lengths after compiled decode steps.
    @property
    def _segment_length_host(self) -> torch.Tensor | None:
        if self._packed_stale:
            self._refresh_packed()
        return self._segment_length_host_value

    @_segment_length_host.setter
    def _segment_length_host(self, value: torch.Tensor | None) -> None:
        self._segment_length_host_value = value

    @property
    def _packed_max_length(self) -> int:
        if self._packed_stale:
            self._refresh_packed()
        return self._packed_max_length_value

    @_packed_max_length.setter
    def _packed_max_length(self, value: int) -> None:
        self._packed_max_length_value = value

    @property
    def _packed_headroom(self) -> int:
        if self._packed_stale:
            self._refresh_packed()
        return self._packed_headroom_value

    @_packed_headroom.setter
    def _packed_headroom(self, value: int) -> None:
        self._packed_headroom_value = value

    def _refresh_packed(self) -> None:
        """Read the device lengths back (once) after compiled decode steps appended at them."""
        lengths = self._segment_length.cpu().long()
        self._packed_stale = False
        self._segment_length_host_value = lengths
        self._packed_max_length_value = int(lengths.max()) if lengths.numel() else 0
        headroom = self._segment_capacity_host - lengths
        self._packed_headroom_value = int(headroom.min()) if lengths.numel() else SEGMENT_RESERVE_TOKENS

    def _num_stored(self) -> int:
        return int(self._segment_length_host.sum())

    @property
    def max_length(self) -> int:
        """The longest row (host-side)."""
        return self._packed_max_length

    def _lengths_host(self) -> torch.Tensor:
        return self._segment_length_host.view(self._batch, self._heads).clone()

    def _capacity(self) -> int:
        return int(self._key_buffer.shape[0])

    def _attention_view(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._key_buffer.unsqueeze(0).unsqueeze(0), self._value_buffer.unsqueeze(0).unsqueeze(0)

    def check_rows_selectable(self, method: str) -> None:
        """Refuse (before anything changes) a layout whose rows cannot be selected yet."""
        if self.is_initialized:
            raise NotImplementedError(
                f"method {method!r} holds a different number of tokens per head in layer {self.layer_index} (the "
                "packed, head-wise layout of Ada-KV): selecting, reordering or repeating its batch rows (beam search, "
                "batch_select_indices) is not implemented for that layout"
            )

    def _token_scores(self) -> dict[str, torch.Tensor]:
        index = self._stored_index()
        return {name: buffer[index] for name, buffer in self._score_buffers.items()}

    def _keep(self, keep_mask: torch.Tensor, counts) -> None:
        if keep_mask.dim() == 3:
            raise ValueError(f"keep mask shape {tuple(keep_mask.shape)} does not match the stored layout")
        counts = self._flat_counts(keep_mask, counts)
        if torch.equal(counts, self._segment_length_host):
            return
        self._pack(keep_mask, counts)

    def _pack(self, flat_mask: torch.Tensor, counts: torch.Tensor) -> None:
        """Re-lay the kept tokens (``flat_mask`` over stored tokens in segment order) out anew."""
        source_index = self._stored_index().index_select(0, true_indices(flat_mask, counts))
        keys, values, positions, scores = self._flat_buffers()
        self._set_packed(counts, keys, values, positions, scores, source_index, self.segment_reserve_tokens)

    def _set_packed(
        self, counts, keys, values, positions, scores, source_index, reserve_tokens: int = SEGMENT_RESERVE_TOKENS
    ) -> None:
        counts = counts.reshape(-1).long().cpu()
        capacities = (counts + reserve_tokens + PAGE_TOKENS - 1) // PAGE_TOKENS * PAGE_TOKENS
        starts = torch.cumsum(capacities, 0) - capacities
        total = int(counts.sum())
        offsets = torch.cumsum(counts, 0) - counts
        size = int(capacities.sum())
        pages_per_segment = capacities // PAGE_TOKENS
        total_pages = size // PAGE_TOKENS
        page_segment = torch.repeat_interleave(torch.arange(counts.numel()), pages_per_segment, output_size=total_pages)
        first_page = torch.cumsum(pages_per_segment, 0) - pages_per_segment
        page_offset = (torch.arange(total_pages) - first_page[page_segment]) * PAGE_TOKENS
        # Every per-segment and per-page table in one host-to-device copy.
        (
            shift,
            counts_on_device,
            starts_on_device,
            capacities_on_device,
            page_segment_on_device,
            page_offset_on_device,
        ) = to_device_at_once(self.device, starts - offsets, counts, starts, capacities, page_segment, page_offset)
        destination = torch.repeat_interleave(shift, counts_on_device, output_size=total) + torch.arange(
            total, device=self.device
        )
        # Zeros, not empty: the paged torch path multiplies whole pages, reserve rows included, by
        # weights that are 0 there, and 0 x uninitialised memory can be NaN.
        new_keys = keys.new_zeros((size, keys.shape[-1]))
        new_values = values.new_zeros((size, values.shape[-1]))
        new_positions = positions.new_zeros(size)
        new_keys[destination] = keys[source_index]
        new_values[destination] = values[source_index]
        new_positions[destination] = positions[source_index]
        new_scores = {}
        for name, score in scores.items():
            new_scores[name] = score.new_zeros(size)
            new_scores[name][destination] = score[source_index]
        # Fixed addresses (as the dense buffers): a compiled decode step appends into them in place.
        self._key_buffer, self._value_buffer, self._position_buffer = (
            _static(new_keys),
            _static(new_values),
            (_static(new_positions)),
        )
        self._score_buffers = {name: _static(score) for name, score in new_scores.items()}
        self._packed_stale = False
        self._segment_start_host, self._segment_length_host, self._segment_capacity_host = starts, counts, capacities
        self._segment_start = _static(starts_on_device)
        self._segment_length = _static(counts_on_device.to(torch.int32))
        self._segment_capacity = _static(capacities_on_device)
        self._page_segment = _static(page_segment_on_device)
        self._page_offset = _static(page_offset_on_device)
        # Host-side ints, so a decode append decides without touching any tensor.
        self._packed_max_length = int(counts.max()) if counts.numel() else 0
        # The largest capacity is the longest segment's (capacities grow with counts): no other read.
        self._packed_bound = (self._packed_max_length + reserve_tokens + PAGE_TOKENS - 1) // PAGE_TOKENS * PAGE_TOKENS
        self._packed_headroom = int((capacities - counts).min()) if counts.numel() else SEGMENT_RESERVE_TOKENS

    def _append(self, key_states, value_states, new_tokens: int) -> None:
        if self.fixed_capacity:
            if in_static_step():
                # A compiled step: write at the device lengths, decide nothing on the host (the host
                # mirrors are refreshed when next read outside). Past a segment's capacity the write
                # would land in the next segment: the device refuses it instead.
                torch._assert_async(
                    (self._segment_length + new_tokens <= self._segment_capacity).all(),
                    "kvhive: a decode step went past the decode_capacity reserved in a packed layer",
                )
                self._write_packed(key_states, value_states, new_tokens)
                self._packed_stale = True  # a constant store: no guard on the host lengths
                return
            if new_tokens > self._packed_headroom:
                # Past the reserved capacity (more tokens than reserved): back to re-laying out.
                self.fixed_capacity = False
        if new_tokens > self._packed_headroom:
            # A segment is full: re-lay every segment out with a fresh reserve (host-decided).
            keys, values, positions, scores = self._flat_buffers()
            self._set_packed(
                self._segment_length_host.clone(),
                keys,
                values,
                positions,
                scores,
                self._stored_index(),
                reserve_tokens=max(SEGMENT_RESERVE_TOKENS, new_tokens),  # a chunk may exceed the usual reserve
            )
        lengths = self._segment_length_host
        self._write_packed(key_states, value_states, new_tokens)
        self._segment_length_host = lengths + new_tokens
        self._packed_headroom -= new_tokens
        self._packed_max_length += new_tokens

    def _write_packed(self, key_states, value_states, new_tokens: int) -> None:
        """Write the new tokens at each segment's device length and advance it (no host value read)."""
        grow = torch.arange(new_tokens, device=self.device)
        destination = ((self._segment_start + self._segment_length.long())[:, None] + grow).reshape(-1)
        d, dv = key_states.shape[-1], value_states.shape[-1]
        self._key_buffer.index_copy_(0, destination, key_states.reshape(-1, d))
        self._value_buffer.index_copy_(0, destination, value_states.reshape(-1, dv))
        new_positions = (grow + self.tokens_seen_device).to(POSITION_DTYPE).repeat(self.num_segments)
        self._position_buffer.index_copy_(0, destination, new_positions)
        for buffer in self._score_buffers.values():
            buffer.index_fill_(0, destination, 0.0)
        self._segment_length += new_tokens

    def _reserve(self, tokens: int, exact: bool = False) -> None:
        """Packed layout: room for ``tokens`` more tokens in every segment (re-laid out once, each
        segment's capacity its kept tokens plus ``tokens``, whole pages; nothing is padded to the
        largest segment), then appends write at the device lengths until the room is used."""
        if exact:
            raise RuntimeError(f"layer {self.layer_index} is packed: an exact (bounded) capacity is dense only")
        if self._packed_headroom < tokens:
            keys, values, positions, scores = self._flat_buffers()
            self._set_packed(
                self._segment_length_host.clone(), keys, values, positions, scores, self._stored_index(), tokens
            )
        self.fixed_capacity = True

    def packed_pages(self):
        """``(page_segment [P], page_offset [P], bound)``: the segment of each page of the packed
        buffers, the offset of its first slot in that segment (device), and the largest segment
        capacity (host int; fixed by the layout, a bound on every segment's length)."""
        return self._page_segment, self._page_offset, self._packed_bound

    @property
    def segment_capacity_host(self) -> torch.Tensor:
        """Packed layout: tokens reserved per segment (whole pages), CPU ``[S]``."""
        return self._segment_capacity_host

    def packed(self):
        """``(keys [C, d], values [C, dv], positions [C], segment_start [S] int64, segment_length
        [S] int32, max_length)``: the flat layout read by the variable-length attention."""
        return (
            self._key_buffer,
            self._value_buffer,
            self._position_buffer,
            self._segment_start,
            self._segment_length,
            self.max_length,
        )

    def packed_buffers(self):
        """``(keys [C, d], values [C, dv], positions [C], segment_start [S] int64, segment_length
        [S] int32, scores {name: [C]})``: the packed buffers as they are (the scores aligned with the
        slots, 0 in empty ones); nothing is read on the host."""
        return (
            self._key_buffer,
            self._value_buffer,
            self._position_buffer,
            self._segment_start,
            self._segment_length,
            dict(self._score_buffers),
        )

    def _stored_index(self) -> torch.Tensor:
        lengths = self._segment_length_host
        total = int(lengths.sum())
        # token j of segment s sits at starts[s] + j = (starts[s] - offset[s]) + global index.
        offsets = torch.cumsum(lengths, 0) - lengths
        shift = (self._segment_start_host - offsets).to(self.device)
        return torch.repeat_interleave(shift, lengths.to(self.device), output_size=total) + torch.arange(
            total, device=self.device
        )

    def _flat_buffers(self):
        return self._key_buffer, self._value_buffer, self._position_buffer, self._score_buffers

    def _layout_metadata_nbytes(self) -> int:
        # Per segment: start and capacity (int64), length (int32); per page: its segment and offset.
        return self.num_segments * (8 + 8 + 4) + self._page_segment.numel() * (8 + 8)
