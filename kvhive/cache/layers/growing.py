"""The growing layout: every row holds the same number of tokens ``L`` in a dense slice.

Keys live in a buffer ``[B, H, capacity, d]`` and the stored tokens are the slice ``[start, start +
L)``, so the dense view handed to attention is a strided view (no copy). Appending writes into the
slice's tail (O(new tokens)); the buffer grows geometrically when full, and the oldest tokens of a
sliding layer are dropped by moving the kept window to the front. A layer starts in this layout and
returns to it when a fixed capacity is left (a multi-token update, an append past the room).
"""

from __future__ import annotations

import copy

import torch

from kvhive.cache.layers.buffers import TokenBuffers, first_false, reserve, to_device_at_once, true_indices
from kvhive.cache.layers.layout import Layout
from kvhive.cache.layers.packed import PackedLayout


class GrowingLayout(Layout):
    """Dense rows of one length ``length`` in slots ``[start, start + length)`` of buffers that grow."""

    name = "growing"

    def __init__(self, store, buffers: TokenBuffers | None = None, start: int = 0, length: int = 0) -> None:
        super().__init__(store, buffers)
        self.start = start
        self.length = length

    def not_packed(self, what: str):
        raise RuntimeError(f"layer {self.store.layer_index} is dense: {what} needs the packed layout")

    # -- appends --------------------------------------------------------------------------------
    def append(self, key_states, value_states, positions, new_tokens: int):
        buffers, end = self.buffers, self.start + self.length
        if buffers is None or end + new_tokens > buffers.keys.shape[2]:
            buffers, end = self.make_room(key_states, value_states, new_tokens)
        stop = end + new_tokens
        buffers.keys[:, :, end:stop].copy_(key_states)
        buffers.values[:, :, end:stop].copy_(value_states)
        buffers.positions[:, :, end:stop].copy_(positions)
        for name in buffers.reset_score_names(self.store.new_token_scores_read):
            buffers.scores[name][:, :, end:stop].zero_()
        self.length += new_tokens
        return buffers.keys[:, :, self.start : stop], buffers.values[:, :, self.start : stop]

    def make_room(self, key_states, value_states, new_tokens: int) -> tuple[TokenBuffers, int]:
        """Buffers with room for ``new_tokens`` after the stored ones, and the slot they start at: the
        first tokens (the prompt) get exactly their size, a later append grows the buffers
        geometrically, or (a sliding slice reached the end) moves the slice to their front."""
        if self.buffers is None:
            store = self.store
            self.buffers = TokenBuffers.dense(key_states, value_states, store.batch_size, store.num_heads, new_tokens)
            return self.buffers, self.start + self.length
        needed, capacity = self.length + new_tokens, self.buffers.keys.shape[2]
        if needed + reserve(needed) // 2 > capacity:
            capacity = needed + reserve(needed)
        self.move_to_front(capacity)
        return self.buffers, self.length

    def move_to_front(self, capacity: int) -> None:
        """Copy the stored slice to the front of new buffers of ``capacity`` slots (or of the same
        buffers, staged through a copy, when the capacity is theirs)."""
        buffers, length = self.buffers, self.length
        window = buffers.window(self.start, self.start + length)
        if capacity == buffers.keys.shape[2]:
            # Overlapping ranges (rare: only when a sliding slice reaches the end).
            keys, values, positions, scores = window
            window = (keys.clone(), values.clone(), positions.clone(), {n: s.clone() for n, s in scores.items()})
            target = buffers
        else:
            store = self.store
            target = TokenBuffers.dense(
                buffers.keys, buffers.values, store.batch_size, store.num_heads, capacity, buffers.scores
            )
        target.copy_front(window, length)
        self.buffers, self.start = target, 0

    # -- views ----------------------------------------------------------------------------------
    def dense(self):
        """``(keys, values, positions, token_scores)`` viewed as ``[B, H, L, ...]`` (no copy)."""
        if self.buffers is None:
            raise RuntimeError(f"layer {self.store.layer_index} holds no tokens yet")
        return self.buffers.window(self.start, self.start + self.length)

    def decode_view(self):
        buffers = self.buffers
        if buffers is None:
            self.dense()  # (refuses: no tokens yet)
        span = slice(self.start, self.start + self.length)
        scores = {name: buffer[:, :, span] for name, buffer in buffers.scores.items()}
        return buffers.keys[:, :, span], buffers.values[:, :, span], buffers.positions[:, :, span], scores, None

    @property
    def max_length(self) -> int:
        return self.length

    def num_stored(self) -> int:
        return self.store.batch_size * self.store.num_heads * self.length

    def lengths_host(self) -> torch.Tensor:
        return torch.full((self.store.batch_size, self.store.num_heads), self.length, dtype=torch.long)

    def capacity(self) -> int:
        return self.store.batch_size * self.store.num_heads * int(self.buffers.keys.shape[2])

    def token_scores(self) -> dict[str, torch.Tensor]:
        return self.dense()[3]

    def set_token_scores(self, name: str, scores: torch.Tensor) -> None:
        self.write_scores(name, scores, self.start, self.length)

    def write_scores(self, name: str, scores: torch.Tensor, start: int, span: int) -> None:
        """Store per-token scores ``[B, H, span]`` in slots ``[start, start + span)`` of score ``name``
        (a new buffer where there is none)."""
        buffers = self.buffers
        buffer = buffers.scores.get(name)
        if buffer is None:
            buffer = buffers.scores[name] = buffers.new_score()
        if not torch.compiler.is_compiling() and (
            scores.data_ptr() == buffer.data_ptr() + start * buffer.stride(2) * buffer.element_size()
            and scores.stride() == buffer.stride()
            and scores.shape[-1] == span
        ):
            return  # the policy handed back the stored view itself (a compiled step copies it onto itself)
        target = buffer if span == buffer.shape[2] else buffer[:, :, start : start + span]
        target.copy_(scores.reshape(self.store.batch_size, self.store.num_heads, -1))

    def stored_index(self) -> torch.Tensor:
        lengths = self.lengths_host().reshape(-1)
        total = int(lengths.sum())
        capacity = self.buffers.keys.shape[2]
        starts = torch.arange(lengths.numel(), dtype=torch.long) * capacity + self.start
        # token j of segment s sits at starts[s] + j = (starts[s] - offset[s]) + global index.
        offsets = torch.cumsum(lengths, 0) - lengths
        shift, lengths = to_device_at_once(self.store.device, starts - offsets, lengths)
        return torch.repeat_interleave(shift, lengths, output_size=total) + torch.arange(
            total, device=self.store.device
        )

    # -- evictions ------------------------------------------------------------------------------
    def keep(self, keep_mask: torch.Tensor, counts) -> None:
        store = self.store
        shape = (store.batch_size, store.num_heads, self.length)
        if keep_mask.dim() != 3:
            # Stored order is segment order: the dense view's mask is the same bits.
            counts = self.flat_counts(keep_mask, counts)
            keep_mask = keep_mask.view(shape)
        if tuple(keep_mask.shape) != shape:
            raise ValueError(f"keep mask shape {tuple(keep_mask.shape)} does not match the stored layout")
        if isinstance(counts, int):
            # Every row keeps ``counts`` tokens, known on the host: nothing is read back.
            if counts != self.length:
                self.compact(keep_mask, counts)
            return
        if counts is None:
            counts = keep_mask.sum(dim=-1).cpu()
        counts = counts.reshape(shape[:2]).long()
        first = int(counts.reshape(-1)[0]) if counts.numel() else 0
        if bool((counts == first).all()):
            if first != self.length:
                self.compact(keep_mask, first)
        else:
            self.pack(keep_mask.reshape(-1), counts.reshape(-1))

    def compact(self, keep_mask: torch.Tensor, kept: int) -> None:
        """Every row keeps its ``kept`` tokens where ``keep_mask`` is True, moved to the front in
        their stored order."""
        store = self.store
        segments = store.batch_size * store.num_heads
        if kept == self.length - 1:
            # One token left each row (a steady decode step): every kept token moves down past
            # the row's one hole (the first False), with no sort over the row.
            hole = first_false(keep_mask, keepdim=True)
            slots = torch.arange(kept, device=store.device)
            order = slots + (slots >= hole).to(slots.dtype)
        else:
            # Kept tokens in their stored (oldest first) order: a stable sort puts True first.
            order = torch.argsort((~keep_mask).to(torch.int8), dim=-1, stable=True)[..., :kept]
        capacity = self.buffers.keys.shape[2]
        # Row index of every kept token in the flat buffers: index_select copies whole rows, far
        # faster than a gather with an index expanded over the head dimension.
        rows = (
            torch.arange(segments, device=store.device)[:, None] * capacity + self.start + order.reshape(segments, kept)
        ).reshape(-1)
        keys, values, positions, scores = self.buffers.flat()
        shape = (store.batch_size, store.num_heads, kept)
        gathered = (
            keys.index_select(0, rows).view(*shape, keys.shape[-1]),
            values.index_select(0, rows).view(*shape, values.shape[-1]),
            positions.index_select(0, rows).view(shape),
            {name: score.index_select(0, rows).view(shape) for name, score in scores.items()},
        )
        target = self.compaction_target(kept)
        target.copy_front(gathered, kept)
        self.buffers, self.start = target, 0
        self.length = kept

    def compaction_target(self, kept: int) -> TokenBuffers:
        """The buffers ``kept`` compacted tokens go to: new ones sized to them when they fill less than
        half of the current ones (the evicted memory is released), else the current ones."""
        buffers = self.buffers
        if buffers.keys.shape[2] > 2 * (kept + reserve(kept)):
            store = self.store
            return TokenBuffers.dense(
                buffers.keys, buffers.values, store.batch_size, store.num_heads, kept + reserve(kept), buffers.scores
            )
        return buffers

    def pack(self, flat_mask: torch.Tensor, counts: torch.Tensor) -> None:
        """Rows keep different counts: the kept tokens (``flat_mask`` over the stored tokens in
        segment order) are re-laid out packed, each segment with its own append reserve."""
        store = self.store
        source_index = self.stored_index().index_select(0, true_indices(flat_mask, counts))
        store.use_layout(
            PackedLayout.laid_out(
                store, counts, self.buffers.flat(), source_index, store.segment_reserve_tokens, self.fixed_capacity
            )
        )

    def fill_hole(self, hole: torch.Tensor) -> None:
        """Every row drops its token at stored index ``hole`` (``[B, H]`` or flat); the newest moves into
        that slot (``Layout.fill_hole``), its per-token scores too (``reset_score_names``)."""
        store, buffers = self.store, self.buffers
        hole = hole.reshape(-1)
        # Slot j of segment s is row s * capacity + j of the flat buffers.
        capacity, newest = buffers.keys.shape[2], self.start + self.length - 1
        rows = store.batch_size * store.num_heads * capacity
        first_slots = torch.arange(self.start, self.start + rows, capacity, device=store.device)
        newest_rows = torch.arange(newest, newest + rows, capacity, device=store.device)
        buffers.move_rows(first_slots + hole, newest_rows, buffers.reset_score_names(store.new_token_scores_read))
        self.length -= 1
        store.stored_in_order = False

    def drop_oldest(self, count: int) -> None:
        """Forget the ``count`` oldest tokens of every row. The kept tokens move to the front of the
        buffers (a copy of at most a window), so a sliding layer in its steady state starts at the
        same place every step: each decode step has the same shapes and offsets and compiles to one
        graph, and the buffers never move."""
        if count <= 0:
            return
        count = min(count, self.length)
        length = self.length - count
        kept = slice(self.start + count, self.start + self.length)
        for buffer in self.buffers.tensors():
            # Staged through a copy: the source and destination ranges overlap.
            buffer[:, :, :length].copy_(buffer[:, :, kept].clone())
        self.start, self.length = 0, length

    def drop_newest(self, count: int) -> None:
        """Forget the ``count`` newest tokens; their slots are zeroed (as a fixed capacity's empty
        slots must be)."""
        length = self.length
        freed = slice(self.start + length - count, self.start + length)
        for buffer in self.buffers.tensors():
            buffer[:, :, freed].zero_()
        self.length = length - count

    # -- transitions and rows -------------------------------------------------------------------
    def reserve(self, tokens: int, exact: bool) -> None:
        """Room for ``tokens`` more tokens in every row, and the fixed capacity layout from here on:
        appends write at a device index (the store builds the
        :class:`~kvhive.cache.layers.capacity.CapacityLayout`, which builds on this module)."""
        store = self.store
        capacity = self.length + tokens
        if exact and capacity != self.buffers.keys.shape[2]:
            self.move_to_front(capacity)
        elif self.start != 0 or capacity > self.buffers.keys.shape[2]:
            self.move_to_front(max(capacity, self.buffers.keys.shape[2]))
        # The empty slots are attended with weight 0, and 0 x uninitialised memory can be NaN:
        # they hold zeros until a token is written there.
        self.buffers.zero_from(self.length)
        store.use_layout(store.capacity_layout(self.buffers, self.length, exact))

    def release_unused(self) -> None:
        """After a prefill: buffers of the stored tokens plus the append reserve, where they hold more.
        A prefill's compression re-allocates only when the kept tokens fill less than half the
        buffers, and a sliding layer kept its window in buffers of the prompt's length: the copy
        costs less than the compression did, once a prompt."""
        if self.buffers is None:
            return
        capacity = self.length + reserve(self.length)
        if self.buffers.keys.shape[2] > capacity:
            self.move_to_front(capacity)

    def expand_to_query_heads(self, heads_per_kv_head: int) -> None:
        """Store one copy of each KV head per query head of its group (Ada-KV on GQA/MQA)."""
        store = self.store
        if store.heads_per_kv_head != 1:
            raise RuntimeError("heads were already expanded with a different factor")
        keys, values, positions, scores = self.dense()
        repeat = heads_per_kv_head
        self.buffers = TokenBuffers(
            keys.repeat_interleave(repeat, dim=1),
            values.repeat_interleave(repeat, dim=1),
            positions.repeat_interleave(repeat, dim=1),
            {name: score.repeat_interleave(repeat, dim=1) for name, score in scores.items()},
        )
        self.start = 0
        store.num_heads *= repeat
        store.heads_per_kv_head = repeat

    def select_rows(self, device_index: torch.Tensor, rows: list[int]) -> Layout:
        selected = copy.copy(self)
        selected.buffers = self.buffers.select_rows(device_index)
        return selected

    def write_row(self, row: int, keys, values, positions, scores: dict) -> None:
        """Fixed batch slots: row ``row`` takes another request's tokens, of this layer's one length."""
        length = int(keys.shape[2])
        if length != self.length:
            raise ValueError(
                f"the joining row holds {length} tokens in layer {self.store.layer_index}, where every row holds "
                f"{self.length} (a layer that evicts while decoding keeps one length for every row)"
            )
        self.buffers.write_row(row, slice(self.start, self.start + length), keys, values, positions, scores)
