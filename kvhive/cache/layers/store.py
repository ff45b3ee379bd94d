"""One layer's cache: counters, a storage layout and the compressor's record, in one object.

A :class:`LayerStore` is one object from start to end (the cache, compiled steps and callers keep its
reference). What changes is its ``layout`` (:mod:`kvhive.cache.layers.layout`), replaced only at a
transition, through :meth:`LayerStore.use_layout`:

* a new or reset layer grows (:class:`~kvhive.cache.layers.growing.GrowingLayout`);
* ``reserve_decode`` (the end of a layer's prefill) fixes its capacity
  (:class:`~kvhive.cache.layers.capacity.CapacityLayout`); a multi-token update, or an eager append
  past an unbounded capacity, makes it grow again;
* a keep with different counts per head packs it (:class:`~kvhive.cache.layers.packed.PackedLayout`);
* stacking rows of different lengths (``set_rows``) gives each row its own length
  (:class:`~kvhive.cache.layers.rows.RowsLayout`).

The store's public members keep one shape whatever the layout: what differs they hand to it. Tokens
seen are mirrored on the host and the device (:mod:`kvhive.cache.layers.counters`); rows stacked from
caches prefilled separately keep their own count each (``row_tokens_seen``). ``nbytes()`` counts the
kept tokens' payload exactly; ``reserved_nbytes()`` the allocated buffers (kept tokens plus append
reserve).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from kvhive import static_step
from kvhive.cache.layers.buffers import POSITION_DTYPE, SEGMENT_RESERVE_TOKENS, mark_static, reserve, row_index
from kvhive.cache.layers.capacity import CapacityLayout
from kvhive.cache.layers.counters import Count, RowCounts
from kvhive.cache.layers.growing import GrowingLayout
from kvhive.cache.layers.layout import Layout
from kvhive.cache.layers.rows import RowsLayout, stacked_buffers


class CompressorRecord:
    """What the cache's compressor records per layer; the store keeps it and knows nothing of it.

    * ``policy_state``: the method's per-layer state (opaque here);
    * ``decode_steps_since_compression``: decode steps since the layer last evicted;
    * ``settled_tokens``: tokens seen when the layer last evicted in a prompt (crop cannot roll
      back below it);
    * ``rope_tokens_seen``: tokens seen when the kept keys were last re-rotated (re-indexed positions);
    * ``has_padding``: whether the prompt had left padding (recorded by the attention at prefill);
    * ``in_prefill``, ``last_update_tokens``: whether the latest update was the layer's first (its
      prefill), and how many tokens it had.
    """

    def reset_record(self) -> None:
        """The record of an emptied layer (``rope_tokens_seen`` and ``last_update_tokens`` are kept:
        the next update sets the one, the next re-indexing the other)."""
        self.policy_state: dict = {}
        self.decode_steps_since_compression = 0
        self.settled_tokens = 0
        self.has_padding = False
        self.in_prefill = False


class LayerStore(CompressorRecord, CacheLayerMixin):
    """One layer's cache (see the module docstring). ``layout`` holds the tokens; the layout's traits
    (``is_uniform``, ``fixed_capacity``, ``bounded_capacity``, ``fills_to_budget``,
    ``has_row_lengths``, ``row_lengths_device``) are copied here when the store takes it."""

    is_croppable = False

    def __init__(self, layer_index: int, sliding_window: int | None = None) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        # Whether the method reads a new token's per-token scores before writing them
        # (Policy.reads_newest_token_scores): an append zeroes them, and fill_hole moves them with
        # the newest token; else neither, but for the cache's own (PADDING_SCORE).
        self.new_token_scores_read = True
        # Room each packed segment gets for appends when the layer is packed (a cache with a decode
        # capacity sets it to that capacity, so the layout made at prefill already has the room).
        self.segment_reserve_tokens = SEGMENT_RESERVE_TOKENS
        self.rope_tokens_seen = 0
        self.last_update_tokens = 0
        # Quantized storage (``kv_bits``): the codec that encodes appends and dequantizes what is read
        # (``layers/quantized.py``); None: the model's dtype.
        self.codec = None
        self.reset()

    def use_layout(self, layout: Layout) -> None:
        """Take ``layout`` (a transition): the only place the layout and its traits change."""
        self.layout = layout
        self.forget_decode_route()
        self.is_uniform = layout.is_uniform
        self.fixed_capacity = layout.fixed_capacity
        self.bounded_capacity = layout.bounded_capacity
        self.fills_to_budget = layout.fills_to_budget
        self.has_row_lengths = layout.has_row_lengths
        self.row_lengths_device = layout.row_lengths_device

    def forget_decode_route(self) -> None:
        """At a transition: the next eager decode step runs the general attention and chooses the
        layer's route again (``kvhive.attention.routes``); the cache checks its next update in full."""
        self.decode_route = None
        self.steady_key_shape = None

    def capacity_layout(self, buffers, length: int, exact: bool) -> Layout:
        """The fixed capacity layout over ``buffers`` holding ``length`` tokens (the growing layout's
        ``reserve`` transition), with this layer's ``fills_to_budget``."""
        return CapacityLayout(self, buffers, length, exact, self.fills_to_budget)

    def reset(self) -> None:
        """Empty the layer: nothing stored, nothing seen, the growing layout."""
        self.is_initialized = False
        self.batch_size, self.num_heads = -1, 0
        # Tokens seen, on the host and on the device (a captured step reads and advances the device
        # counter; it may not read or change a Python int).
        self.seen = Count(0)
        # Rows stacked from caches prefilled separately (KVHiveCache.stack): each row's count. None
        # for a cache whose rows advance together; ``tokens_seen`` is then every row's count,
        # otherwise the most any row has seen.
        self.row_seen: RowCounts | None = None
        # Fixed batch slots (KVHiveCache.stack(batch_slots=...)): which slots hold a running row (host
        # list and device [B] bool). A free slot keeps decoding (one shape for every step) but its row
        # of a layer with per-row lengths does not grow.
        self.row_active: list[bool] | None = None
        self.row_active_device: torch.Tensor | None = None
        self.grows_in_slots = False
        # A fixed capacity's device length (made by the first reserve_decode, kept until a reset).
        self.length_device: torch.Tensor | None = None
        # Replication of each KV head when a policy stores one copy per query head.
        self.heads_per_kv_head = 1
        # Whether the stored order is the tokens' order (oldest first); False once a decode eviction
        # wrote the newest token into the freed slot (fill_hole), until the layer is emptied.
        self.stored_in_order = True
        if self.codec is not None:
            self.codec.reset()
        self.reset_record()
        self.use_layout(GrowingLayout(self))

    # -- counters ---------------------------------------------------------------------------------
    @property
    def tokens_seen(self) -> int:
        """Tokens this layer has seen (a host int; read from the device counter, once, after compiled
        decode steps advanced it)."""
        seen = self.seen
        return seen.refresh() if seen.stale else seen.host

    @tokens_seen.setter
    def tokens_seen(self, value: int) -> None:
        self.seen.set(value)

    @property
    def tokens_seen_device(self) -> torch.Tensor | None:
        return self.seen.device

    @property
    def row_tokens_seen_device(self) -> torch.Tensor | None:
        """Tokens seen by each stacked row, ``[B]`` int64 on the device (None unless stacked)."""
        return None if self.row_seen is None else self.row_seen.device

    @property
    def row_tokens_seen(self) -> list[int]:
        """Tokens seen by each batch row (host)."""
        if self.row_seen is not None:
            return list(self.row_seen.value)
        return [self.tokens_seen] * max(self.batch_size, 0)

    @property
    def row_lengths(self) -> list[int] | None:
        """Tokens held by each batch row (host) where rows hold different numbers, else None."""
        return self.layout.row_lengths_host()

    def trust_the_device(self) -> None:
        """Read every counter mirrored on the host back from the device, now (a leave or a join of
        fixed batch slots, ``KVHiveCache.free_slots``/``fill_slots``, which may read the host; the
        steps after it then read nothing). A captured step (a CUDA graph) marks the host mirrors
        stale once, as it is captured; its replays run no Python, so they advance the device counters
        without telling the host, and a mirror read back since the capture is behind them by every
        replay after that read."""
        if not self.is_initialized:
            return
        self.seen.reread()
        if self.row_seen is not None:
            self.row_seen.reread()
        for counter in self.layout.counters():
            counter.reread()

    # -- transformers' CacheLayerMixin ------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads = key_states.shape[0], key_states.shape[1]
        # A fixed address, as transformers' StaticLayer marks its buffers: a compiled step then
        # reads it in place instead of copying it in (or skipping CUDA graphs).
        self.seen.device = mark_static(torch.zeros((), dtype=torch.int64, device=self.device))
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append the new tokens; returns what attention reads (``Layout.append``)."""
        new_tokens = self.last_update_tokens = key_states.shape[2]
        self.in_prefill = not self.is_initialized
        if self.in_prefill or new_tokens > 1:
            self.start_update(key_states, value_states)
        if self.heads_per_kv_head > 1:
            key_states = key_states.repeat_interleave(self.heads_per_kv_head, dim=1)
            value_states = value_states.repeat_interleave(self.heads_per_kv_head, dim=1)
        if new_tokens == 1 and self.row_seen is None:  # a decode step: no arange, no add
            positions = self.seen.device.view(1).to(POSITION_DTYPE)
        else:
            positions = self.new_positions(new_tokens)
        if self.codec is not None:  # byte rows in the buffers (kvhive.cache.layers.quantized)
            return self.codec.append(self, key_states, value_states, positions, new_tokens)
        views = self.layout.append(key_states, value_states, positions, new_tokens)
        self.seen.advance(new_tokens)
        if self.row_seen is not None:
            self.row_seen.advance(new_tokens)
        return views

    def start_update(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """An update that is not a decode step: the layer's first (its prefill) initialises it; a later
        one of several tokens (a prompt chunk) makes it grow again (a transition)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        else:
            self.layout.take_chunk()
            self.forget_decode_route()

    def new_positions(self, new_tokens: int) -> torch.Tensor:
        """Original positions of ``new_tokens`` appended tokens: ``[new]``, or ``[B, 1, new]`` when
        rows have seen different numbers of tokens."""
        row_seen = self.row_seen
        if new_tokens == 1 and row_seen is None:
            return self.seen.device.view(1).to(POSITION_DTYPE)  # a decode step: no arange, no add
        grow = torch.arange(new_tokens, device=self.device)
        if row_seen is not None:
            return (grow + row_seen.device[:, None]).to(POSITION_DTYPE)[:, None, :]
        return (grow + self.seen.device).to(POSITION_DTYPE)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if query_length == 1 and static_step.in_static_step():
            # kvhive's mask function builds no mask for one new query (kvhive's attention masks a
            # decode step itself), so the size is unused; a constant keeps the step static.
            return 1, 0
        # The mask spans every original position; attention gathers it at kept tokens.
        return self.tokens_seen + query_length, 0

    def get_seq_length(self) -> int | torch.Tensor:
        # In a compiled step, the device counter (as transformers' StaticLayer): model positions
        # then come from a tensor instead of a Python int the graph would specialise on.
        if static_step.in_static_step():
            return self.seen.device
        return self.tokens_seen

    def get_max_length(self) -> int:
        return -1

    # -- rolling back (assisted decoding) ---------------------------------------------------------
    def crop_problem(self, tokens_to_remove: int) -> str | None:
        """Why :meth:`crop` cannot roll this layer back (``None`` when it can). Reads the stored
        positions back: a crop happens between forwards, never inside a compiled step."""
        remove = self._tokens_to_crop(tokens_to_remove)
        if remove == 0:
            return None
        if remove > self.tokens_seen:
            return f"cannot remove {remove} tokens from layer {self.layer_index}: it has seen {self.tokens_seen}"
        if not self.is_uniform or self.row_seen is not None:
            return (
                f"layer {self.layer_index} keeps a different number of tokens per head or per row (head-wise budgets, "
                "or stacked caches): rolling it back is not supported"
            )
        length, new_seen = self.layout.length, self.tokens_seen - remove
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
        if remove:
            self.layout.drop_newest(remove)
            self.tokens_seen = self.tokens_seen - remove

    def drop_newest(self, count: int) -> None:
        """Forget the ``count`` newest stored tokens, appended by the forward now running and not yet
        evicted from (a question-aware chunked prefill's copy of the question, once the layer's
        attention ran): the layer has then seen ``count`` tokens fewer."""
        if not self.is_uniform or self.row_seen is not None or count > self.layout.length:
            raise RuntimeError(
                f"layer {self.layer_index}: cannot drop its {count} newest tokens (a copy of the question): the layer "
                "holds a different number of tokens per head or per row, or fewer tokens"
            )
        self.layout.drop_newest(count)
        self.tokens_seen = self.tokens_seen - count

    # -- batch rows (beam search, contrastive search, batch slicing) -------------------------------
    # ``KVHiveCache`` overrides the cache-level methods to select its method's per-layer state too;
    # these move the layer's tokens.
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.select_rows(torch.arange(max(self.batch_size, 0)).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.select_rows(row_index(indices, max(self.batch_size, 0)))

    def check_rows_selectable(self, method: str) -> None:
        """Refuse (before anything changes) a layout whose rows cannot be selected yet (packed)."""
        self.layout.check_rows_selectable(method)

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (1-D; rows may repeat or be reordered) in every buffer with a
        batch dimension: keys, values, positions, per-token scores and the per-row counters. The
        buffers keep their capacity (a fresh allocation of the selected rows)."""
        if not self.is_initialized:
            return
        self.check_rows_selectable("(any)")
        host_index = index.detach().to("cpu", torch.long).reshape(-1)
        rows = host_index.tolist()
        if rows and (min(rows) < 0 or max(rows) >= self.batch_size):
            raise IndexError(f"batch row index {rows} out of range for a batch of {self.batch_size} row(s)")
        device_index = host_index.to(self.device)
        if self.layout.buffers is not None:
            self.use_layout(self.layout.select_rows(device_index, rows))
        if self.codec is not None:
            self.codec.select_rows(device_index)
        if self.row_seen is not None:
            self.row_seen = self.row_seen.select(rows, device_index)
        if self.row_active is not None:
            self.row_active = [self.row_active[row] for row in rows]
            self.row_active_device = self.row_active_device.index_select(0, device_index)
        self.batch_size = len(rows)
        self.forget_decode_route()

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
        Rows of equal length make the growing layout; rows of different lengths the rows layout, a
        common capacity of ``max L_i + decode_room`` (``per_row_lengths``: that layout whatever the
        lengths, for a layer whose rows' lengths will part while decoding). ``row_capacity`` (fixed
        batch slots of a layer that grows): that capacity per row whatever the lengths, in the rows
        layout, held fixed (an append past it is refused, so rows joining later fit in place)."""
        first = keys[0]
        self.dtype, self.device = first.dtype, first.device
        self.batch_size, self.num_heads = len(keys), first.shape[1]
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
        buffers = stacked_buffers(keys, values, positions, scores, capacity)
        self.is_initialized = True
        most = max(tokens_seen)
        self.seen = Count(most, mark_static(torch.full((), most, dtype=torch.int64, device=self.device)))
        self.row_seen = RowCounts(
            list(tokens_seen), mark_static(torch.tensor(tokens_seen, dtype=torch.int64, device=self.device))
        )
        if ragged:
            self.use_layout(RowsLayout.of_lengths(self, buffers, lengths, bounded=row_capacity is not None))
        else:
            self.use_layout(GrowingLayout(self, buffers, 0, longest))
        self.grows_in_slots = row_capacity is not None

    def set_active_rows(self, active: list[bool]) -> None:
        """Fixed batch slots of a layer that grows (``set_rows(row_capacity=...)``): which rows run
        (True) and which are free. A free row keeps one token (its first) and stops growing, so it
        never outgrows its slot however long it stays free. (A free row of a layer that evicts
        keeps decoding as it was: its method keeps it within the capacity.)"""
        if len(active) != self.batch_size:
            raise ValueError(f"expected {self.batch_size} active flags, got {len(active)}")
        if not self.grows_in_slots:
            return
        if self.row_active_device is None:
            self.row_active_device = mark_static(torch.ones(self.batch_size, dtype=torch.bool, device=self.device))
        self.row_active = list(active)
        self.forget_decode_route()
        self.row_active_device.copy_(torch.tensor(active, dtype=torch.bool), non_blocking=False)
        self.layout.hold_free_rows(self.row_active)

    def write_row(self, row: int, keys, values, positions, scores: dict, tokens_seen: int) -> None:
        """Fixed batch slots: replace row ``row`` in place with another request's stored tokens
        (``keys [1, H, L, d]`` and the rest as ``set_rows`` takes them) and tokens seen; no buffer
        is reallocated. A layer with per-row lengths takes any ``L`` up to its capacity; a uniform
        layer (every row one length) only its current length."""
        if not 0 <= row < self.batch_size:
            raise IndexError(f"batch row {row} out of range for a batch of {self.batch_size} row(s)")
        self.layout.write_row(row, keys, values, positions, scores)
        self.row_seen.set_row(row, tokens_seen)

    def reserve_rows(self, capacity: int, window: int | None = None) -> None:
        """Rows of different lengths held in exactly ``capacity`` slots, a bound the layer's
        decisions keep (``bounded_capacity``: a method that evicts in such rows compacts them after
        every append; ``window``: a sliding layer whose rows keep their last tokens, each dropping
        its oldest once it holds the window), so an append never asks for the host lengths. Slots
        past each row's length are zero."""
        self.layout.reserve_rows(capacity, window)

    @property
    def keeps_window_per_row(self) -> bool:
        """Stacked rows of a sliding layer, each keeping its own window (``reserve_rows(window=...)``)."""
        return getattr(self.layout, "window", None) is not None

    # -- shape (host-side: never reads the device) ------------------------------------------------
    @property
    def num_segments(self) -> int:
        return max(self.batch_size, 0) * self.num_heads

    @property
    def num_stored(self) -> int:
        return self.layout.num_stored() if self.is_initialized else 0

    @property
    def lengths_host(self) -> torch.Tensor:
        """Stored tokens per row as a CPU ``[B, H]`` int64 tensor."""
        if not self.is_initialized:
            return torch.zeros(0, 0, dtype=torch.long)
        return self.layout.lengths_host()

    @property
    def lengths(self) -> torch.Tensor | None:
        """Stored tokens per row, ``[B, H]`` on the cache's device (made from the host mirror)."""
        if not self.is_initialized:
            return None
        return self.lengths_host.to(self.device)

    @property
    def max_length(self) -> int:
        """The longest row (host-side)."""
        return self.layout.max_length

    @property
    def capacity(self) -> int:
        """Tokens the allocated buffers can hold (all rows together)."""
        return 0 if self.layout.buffers is None else self.layout.capacity()

    def buffers(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The allocated key and value buffers (dense: ``[B, H, capacity, d]``)."""
        buffers = self.layout.buffers
        return (None, None) if buffers is None else (buffers.keys, buffers.values)

    @property
    def token_buffers(self):
        """The layer's :class:`~kvhive.cache.layers.buffers.TokenBuffers` (None while empty)."""
        return self.layout.buffers

    @property
    def slice_start(self) -> int:
        """Dense layouts: index of the oldest stored token in every row of the buffers."""
        return self.layout.start

    @property
    def token_scores(self) -> dict[str, torch.Tensor]:
        """Per-token float32 scores aligned with the stored tokens (``[B, H, L]`` views when
        dense, flat ``[T]`` in segment order when packed)."""
        if not self.is_initialized or self.layout.buffers is None:
            return {}
        return self.layout.token_scores()

    @property
    def segment_capacity_host(self) -> torch.Tensor | None:
        """Packed layout: tokens reserved per segment (whole pages), CPU ``[S]``; None when dense."""
        return self.layout.segment_capacity_host

    # -- the dense layouts' views (the packed layout refuses them) ----------------------------------
    def dense(self):
        """``(keys, values, positions, token_scores)`` viewed as ``[B, H, L, ...]`` (no copy; quantized
        storage: the keys and values dequantized, a copy)."""
        view = self.layout.dense()
        return view if self.codec is None else self.codec.dense_view(view)

    @property
    def dense_length(self) -> int:
        """Tokens per row in a dense layout (the longest row's where rows hold different numbers)."""
        return self.layout.length

    def decode_view(self):
        """``(keys, values, positions, token_scores, filled)`` for a dense decode step's attention: the
        stored tokens and None, or with a fixed capacity the whole buffers and ``filled`` (``[C]``, or
        ``[B, C]`` for rows of different lengths; None when the host knows every slot holds one).
        Quantized storage: the keys and values dequantized (a copy of the layer)."""
        view = self.layout.decode_view()
        return view if self.codec is None else self.codec.dense_view(view)

    @property
    def known_length(self) -> int | None:
        """A fixed capacity's tokens per row when the host knows them without asking the device, else
        None (see ``CapacityLayout.known_length``)."""
        return self.layout.known_length

    def set_token_scores(self, name: str, scores: torch.Tensor) -> None:
        """Store per-token scores ``[B, H, L]`` (dense) aligned with the stored tokens (with a fixed
        capacity, ``[B, H, C]`` over the whole capacity)."""
        self.layout.set_token_scores(name, scores)

    def set_keys(self, keys: torch.Tensor) -> None:
        """Overwrite the stored keys (dense ``[B, H, L, d]``), e.g. after re-rotating them."""
        if self.codec is not None:
            raise RuntimeError(f"layer {self.layer_index} stores quantized keys (kv_bits): they cannot be rewritten")
        self.dense()[0].copy_(keys)

    def drop_oldest(self, count: int) -> None:
        """Forget the ``count`` oldest tokens of every row (dense layout; see ``GrowingLayout.drop_oldest``)."""
        self.layout.drop_oldest(count)

    def release_unused(self) -> None:
        """After a prefill: buffers of the stored tokens plus the append reserve, where they hold
        more (a packed layer sizes its segments so already; a fixed capacity keeps its size)."""
        self.layout.release_unused()

    def expand_to_query_heads(self, heads_per_kv_head: int) -> None:
        """Store one copy of each KV head per query head of its group (Ada-KV on GQA/MQA)."""
        if heads_per_kv_head == 1 or self.heads_per_kv_head == heads_per_kv_head:
            return
        self.layout.expand_to_query_heads(heads_per_kv_head)
        if self.codec is not None:
            self.codec.expand_to_query_heads(heads_per_kv_head)

    # -- the packed layout's views (the dense layouts refuse them) ----------------------------------
    def packed(self):
        """The flat layout read by the variable-length attention (``PackedLayout.packed``; quantized
        storage: keys and values dequantized, a copy)."""
        view = self.layout.packed()
        return view if self.codec is None else self.codec.flat_view(view, self.layout.segment_capacity)

    def packed_buffers(self):
        """The packed buffers as they are (``PackedLayout.packed_buffers``; quantized storage: keys and
        values dequantized, a copy)."""
        view = self.layout.packed_buffers()
        return view if self.codec is None else self.codec.flat_view(view, self.layout.segment_capacity)

    def packed_pages(self):
        """The page table of the packed buffers (``PackedLayout.packed_pages``)."""
        return self.layout.packed_pages()

    # -- eviction ---------------------------------------------------------------------------------
    def reserve_decode(self, tokens: int, exact: bool = False) -> None:
        """Give the buffers room for ``tokens`` more tokens at once and switch the layer to its fixed
        decode capacity: appends write at a device index. Dense: ``decode_view`` is the whole capacity
        with a mask of the filled slots (``CapacityLayout``); packed: every segment gets the room and
        attention reads every page of the buffers, the slots past each segment's device length masked
        (``packed_pages``).

        ``exact`` (dense): the capacity is exactly the stored tokens plus ``tokens`` (attention runs
        over all of it) and a bound the layer's decisions keep (``compact_in_place`` after every
        append), so appends never check it on the host. ``fills_to_budget`` (set by the cache before)
        becomes the capacity's parameter."""
        if not self.is_initialized or self.layout.buffers is None:
            return
        self.layout.reserve(tokens, exact)

    def keep(self, keep_mask: torch.Tensor, counts: torch.Tensor | int | None = None) -> None:
        """Drop every token whose entry in ``keep_mask`` is False and free it.

        ``keep_mask`` is ``[B, H, L]`` over the dense view, or ``[T]`` over the stored tokens in
        segment order (packed). ``counts`` (``[B, H]`` kept per row, on the host, or one int when
        every row of a dense mask keeps the same count) saves reading them back when the caller
        already has them. Rows may keep different counts; the layer is then packed. Buffers are
        re-allocated when the kept tokens fill less than half of them, so evicted memory is released.
        """
        if keep_mask.dtype != torch.bool:
            raise TypeError(f"a keep mask must be boolean, got {keep_mask.dtype}")
        self.layout.keep(keep_mask, counts)

    def fill_hole(self, hole: torch.Tensor) -> None:
        """Every row drops the token at stored index ``hole``; the newest takes its slot
        (``GrowingLayout.fill_hole``)."""
        self.layout.fill_hole(hole)

    def compact_in_place(
        self,
        keep_mask: torch.Tensor,
        kept: torch.Tensor | int,
        at_most_one_dropped: bool = False,
        fill_hole: bool = False,
    ) -> None:
        """Fixed capacity: keep the tokens where ``keep_mask`` is True, compacted at the front, with no
        host read (``CapacityLayout.compact_in_place``, ``RowsLayout.compact_in_place``)."""
        self.layout.compact_in_place(keep_mask, kept, at_most_one_dropped, fill_hole)

    def fill_hole_in_capacity(self, hole: torch.Tensor, kept: torch.Tensor | int) -> None:
        """Fixed capacity: the newest token moves into the slot each row drops (``hole``)."""
        self.layout.fill_hole_in_capacity(hole, kept)

    def stored_flat_positions(self) -> torch.Tensor:
        """Original positions of the stored tokens, ``[T]`` in segment order."""
        return self.layout.buffers.flat()[2][self.layout.stored_index()]

    def stored_keys(self) -> torch.Tensor:
        """Keys of the stored tokens, ``[T, d]`` in segment order (a copy)."""
        keys = self.layout.buffers.flat()[0][self.layout.stored_index()]
        return keys if self.codec is None else self.codec.stored_keys(keys, self.lengths_host.reshape(-1))

    def stored_values(self) -> torch.Tensor:
        """Values of the stored tokens, ``[T, dv]`` in segment order (a copy)."""
        values = self.layout.buffers.flat()[1][self.layout.stored_index()]
        return values if self.codec is None else self.codec.values_of(values).to(self.dtype)

    def segment_offsets(self) -> torch.Tensor:
        """``[B*H + 1]`` (host) start of each row in the segment order of ``stored_*``."""
        flat = self.lengths_host.reshape(-1)
        return torch.cat([flat.new_zeros(1), flat.cumsum(0)])

    # -- accounting -------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes of the kept tokens' key/value payload."""
        buffers = self.layout.buffers
        return 0 if buffers is None else self.num_stored * buffers.bytes_per_token()

    def reserved_nbytes(self) -> int:
        """Bytes of the allocated key/value buffers (kept tokens plus the append reserve)."""
        buffers = self.layout.buffers
        return 0 if buffers is None else buffers.reserved_nbytes()

    def metadata_nbytes(self) -> int:
        """Bytes of bookkeeping (positions, lengths, per-token scores) of the kept tokens."""
        buffers = self.layout.buffers
        if buffers is None:
            return 0
        codec_bytes = 0 if self.codec is None else self.codec.metadata_nbytes()
        return self.num_stored * buffers.metadata_bytes_per_token() + self.layout.metadata_nbytes() + codec_bytes

    def bytes_per_token(self) -> int:
        """Key + value bytes of one token in one stored head (at the model's dtype, quantized or not:
        what an uncompressed cache holds per token)."""
        if self.codec is not None:
            return self.codec.full_precision_bytes_per_token()
        return self.layout.buffers.bytes_per_token()
