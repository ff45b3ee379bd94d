"""The packed layout: rows (batch row x head) holding different numbers of tokens (head-wise budgets).

Tokens live in flat buffers ``[capacity, d]``: segment ``s = b * H + h`` occupies ``[segment_start[s],
segment_start[s] + length[s])`` of its reserved range. Nothing is padded to a common length; each
segment is whole pages (``PAGE_TOKENS``) with a small reserve for decode appends, re-laid out when
one is full. A layer becomes packed when its rows keep different counts, and stays packed until reset.
"""

from __future__ import annotations

import copy

import torch

from kvhive import static_step
from kvhive.cache.layers.buffers import (
    PAGE_TOKENS,
    SEGMENT_RESERVE_TOKENS,
    TokenBuffers,
    mark_static,
    to_device_at_once,
    true_indices,
)
from kvhive.cache.layers.counters import SegmentLengths
from kvhive.cache.layers.layout import Layout


def _whole_pages(tokens: torch.Tensor | int):
    return (tokens + PAGE_TOKENS - 1) // PAGE_TOKENS * PAGE_TOKENS


def _copied_flat(sources, source_index: torch.Tensor, destination: torch.Tensor, size: int) -> TokenBuffers:
    """Flat buffers of ``size`` slots whose slots ``destination`` take the ``sources`` rows
    ``source_index`` (``(keys, values, positions, scores)``, flat). Zeros, not empty: the paged torch
    path multiplies whole pages, reserve rows included, by weights that are 0 there, and 0 x
    uninitialised memory can be NaN. Every address fixed (a compiled step appends in place)."""
    keys, values, positions, scores = sources
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
    return TokenBuffers(
        mark_static(new_keys),
        mark_static(new_values),
        mark_static(new_positions),
        {name: mark_static(score) for name, score in new_scores.items()},
    )


class PackedLayout(Layout):
    """Segments of whole pages in flat buffers; ``lengths`` its tokens per segment (host and device)."""

    name = "packed"
    is_uniform = False

    def __init__(self, store, buffers: TokenBuffers, fixed_capacity: bool) -> None:
        super().__init__(store, buffers)
        self.fixed_capacity = fixed_capacity

    @classmethod
    def laid_out(
        cls, store, counts, sources, source_index, reserve_tokens: int = SEGMENT_RESERVE_TOKENS, fixed_capacity=False
    ) -> PackedLayout:
        """A packed layout holding ``counts[s]`` tokens in segment ``s``: the ``sources`` rows
        ``source_index`` (flat buffers), in segment order; each segment gets ``reserve_tokens`` of
        room, rounded up to whole pages."""
        counts = counts.reshape(-1).long().cpu()
        capacities = _whole_pages(counts + reserve_tokens)
        starts = torch.cumsum(capacities, 0) - capacities
        total = int(counts.sum())
        offsets = torch.cumsum(counts, 0) - counts
        pages_per_segment = capacities // PAGE_TOKENS
        total_pages = int(capacities.sum()) // PAGE_TOKENS
        page_segment = torch.repeat_interleave(torch.arange(counts.numel()), pages_per_segment, output_size=total_pages)
        first_page = torch.cumsum(pages_per_segment, 0) - pages_per_segment
        page_offset = (torch.arange(total_pages) - first_page[page_segment]) * PAGE_TOKENS
        # Every per-segment and per-page table in one host-to-device copy.
        shift, lengths, segment_start, segment_capacity, page_segment_on_device, page_offset_on_device = (
            to_device_at_once(store.device, starts - offsets, counts, starts, capacities, page_segment, page_offset)
        )
        destination = torch.repeat_interleave(shift, lengths, output_size=total) + torch.arange(
            total, device=store.device
        )
        layout = cls(store, _copied_flat(sources, source_index, destination, int(capacities.sum())), fixed_capacity)
        layout.segment_start_host, layout.segment_capacity_host = starts, capacities
        layout.segment_start = mark_static(segment_start)
        layout.segment_capacity = mark_static(segment_capacity)
        layout.page_segment = mark_static(page_segment_on_device)
        layout.page_offset = mark_static(page_offset_on_device)
        layout.lengths = SegmentLengths(
            counts, mark_static(lengths.to(torch.int32)), capacities, empty_room=SEGMENT_RESERVE_TOKENS
        )
        # The largest capacity is the longest segment's (capacities grow with counts): no other read.
        layout.bound = _whole_pages(layout.lengths.longest + reserve_tokens)
        return layout

    def relaid(self, reserve_tokens: int, fixed_capacity: bool) -> PackedLayout:
        """Every segment laid out anew with ``reserve_tokens`` of room."""
        return PackedLayout.laid_out(
            self.store,
            self.lengths.value.clone(),
            self.buffers.flat(),
            self.stored_index(),
            reserve_tokens,
            fixed_capacity,
        )

    def not_dense(self, what: str):
        raise RuntimeError(
            f"layer {self.store.layer_index} holds a different number of tokens per head (packed): {what} needs the "
            "dense layout (use the variable-length path)"
        )

    refuse = not_dense

    @property
    def length(self) -> int:
        self.not_dense("dense_length")

    # -- appends --------------------------------------------------------------------------------
    def append(self, key_states, value_states, positions, new_tokens: int):
        lengths = self.lengths
        if self.fixed_capacity and static_step.in_static_step():
            # A compiled step: write at the device lengths, decide nothing on the host (the host
            # mirrors are refreshed when next read outside). Past a segment's capacity the write
            # would land in the next segment: the device refuses it instead.
            torch._assert_async(
                (lengths.device + new_tokens <= self.segment_capacity).all(),
                "kvhive: a decode step went past the decode_capacity reserved in a packed layer",
            )
            self._write(key_states, value_states, positions, new_tokens)
            lengths.mark_stale()  # a constant store: no guard on the host lengths
            return self._view()
        if new_tokens > lengths.room():
            # A segment is full (past a reserved capacity too): re-lay every segment out with a fresh
            # reserve, host-decided (a chunk may exceed the usual reserve).
            layout = self.relaid(max(SEGMENT_RESERVE_TOKENS, new_tokens), fixed_capacity=False)
            self.store.use_layout(layout)
            return layout.append(key_states, value_states, positions, new_tokens)
        self._write(key_states, value_states, positions, new_tokens)
        lengths.advance(new_tokens)
        return self._view()

    def take_chunk(self) -> None:
        """A multi-token update leaves a reserved capacity: later appends re-lay out on the host."""
        if self.fixed_capacity:
            layout = copy.copy(self)
            layout.fixed_capacity = False
            self.store.use_layout(layout)

    def _write(self, key_states, value_states, positions, new_tokens: int) -> None:
        """Write the new tokens at each segment's device length and advance it (no host value read)."""
        store, buffers, lengths = self.store, self.buffers, self.lengths
        grow = torch.arange(new_tokens, device=store.device)
        destination = ((self.segment_start + lengths.device.long())[:, None] + grow).reshape(-1)
        buffers.keys.index_copy_(0, destination, key_states.reshape(-1, key_states.shape[-1]))
        buffers.values.index_copy_(0, destination, value_states.reshape(-1, value_states.shape[-1]))
        flat_positions = positions if positions.dim() == 1 else positions.reshape(-1)
        buffers.positions.index_copy_(0, destination, flat_positions.repeat(store.num_segments))
        for buffer in buffers.scores.values():
            buffer.index_fill_(0, destination, 0.0)
        lengths.device.add_(new_tokens)

    def _view(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.buffers.keys.unsqueeze(0).unsqueeze(0), self.buffers.values.unsqueeze(0).unsqueeze(0)

    def reserve(self, tokens: int, exact: bool) -> None:
        """Room for ``tokens`` more tokens in every segment (re-laid out once, each segment's capacity
        its kept tokens plus ``tokens``, whole pages; nothing is padded to the largest segment), then
        appends write at the device lengths until the room is used."""
        if exact:
            raise RuntimeError(f"layer {self.store.layer_index} is packed: an exact (bounded) capacity is dense only")
        if self.lengths.room() < tokens:
            layout = self.relaid(tokens, fixed_capacity=True)
        else:
            layout = copy.copy(self)
            layout.fixed_capacity = True
        self.store.use_layout(layout)

    # -- sizes and views ------------------------------------------------------------------------
    @property
    def max_length(self) -> int:
        return self.lengths.most()

    def num_stored(self) -> int:
        return int(self.lengths.value.sum())

    def lengths_host(self) -> torch.Tensor:
        return self.lengths.value.view(self.store.batch_size, self.store.num_heads).clone()

    def capacity(self) -> int:
        return int(self.buffers.keys.shape[0])

    def stored_index(self) -> torch.Tensor:
        device = self.store.device
        lengths = self.lengths.value
        total = int(lengths.sum())
        # token j of segment s sits at starts[s] + j = (starts[s] - offset[s]) + global index.
        offsets = torch.cumsum(lengths, 0) - lengths
        shift = (self.segment_start_host - offsets).to(device)
        return torch.repeat_interleave(shift, lengths.to(device), output_size=total) + torch.arange(
            total, device=device
        )

    def token_scores(self) -> dict[str, torch.Tensor]:
        index = self.stored_index()
        return {name: buffer[index] for name, buffer in self.buffers.scores.items()}

    def keep(self, keep_mask: torch.Tensor, counts) -> None:
        if keep_mask.dim() == 3:
            raise ValueError(f"keep mask shape {tuple(keep_mask.shape)} does not match the stored layout")
        counts = self.flat_counts(keep_mask, counts)
        if torch.equal(counts, self.lengths.value):
            return
        store = self.store
        source_index = self.stored_index().index_select(0, true_indices(keep_mask, counts))
        store.use_layout(
            PackedLayout.laid_out(
                store, counts, self.buffers.flat(), source_index, store.segment_reserve_tokens, self.fixed_capacity
            )
        )

    def check_rows_selectable(self, method: str) -> None:
        raise NotImplementedError(
            f"method {method!r} holds a different number of tokens per head in layer {self.store.layer_index} (the "
            "packed, head-wise layout of Ada-KV): selecting, reordering or repeating its batch rows (beam search, "
            "batch_select_indices) is not implemented for that layout"
        )

    def select_rows(self, device_index: torch.Tensor, rows: list[int]) -> Layout:
        self.check_rows_selectable("(any)")

    def metadata_nbytes(self) -> int:
        # Per segment: start and capacity (int64), length (int32); per page: its segment and offset.
        return self.store.num_segments * (8 + 8 + 4) + self.page_segment.numel() * (8 + 8)

    def packed_pages(self):
        """``(page_segment [P], page_offset [P], bound)``: the segment of each page of the packed
        buffers, the offset of its first slot in that segment (device), and the largest segment
        capacity (host int; fixed by the layout, a bound on every segment's length)."""
        return self.page_segment, self.page_offset, self.bound

    def packed(self):
        """``(keys [C, d], values [C, dv], positions [C], segment_start [S] int64, segment_length
        [S] int32, max_length)``: the flat layout read by the variable-length attention."""
        buffers = self.buffers
        return (
            buffers.keys,
            buffers.values,
            buffers.positions,
            self.segment_start,
            self.lengths.device,
            self.max_length,
        )

    def packed_buffers(self):
        """``(keys [C, d], values [C, dv], positions [C], segment_start [S] int64, segment_length
        [S] int32, scores {name: [C]})``: the packed buffers as they are (the scores aligned with the
        slots, 0 in empty ones); nothing is read on the host."""
        buffers = self.buffers
        return (
            buffers.keys,
            buffers.values,
            buffers.positions,
            self.segment_start,
            self.lengths.device,
            dict(buffers.scores),
        )
