"""The fixed capacity layout: dense rows of one length in buffers sized once, written at a device index.

``reserve_decode`` gives the buffers the prompt's kept tokens plus room for the decode steps; new
tokens are then written at the device length (no host value read) and attention runs over the whole
capacity with the empty slots masked, so a layer keeps one shape from step to step (what a compiled
or captured decode step needs). Two parameters, fixed when the layout is made:

* ``bounded``: the capacity is a bound the layer's decisions keep (``reserve_decode(exact=True)``,
  ``compact_in_place`` after every append), so an append never checks it on the host. An unbounded
  capacity that an eager append would overflow goes back to the growing layout.
* ``fills_to_budget``: the capacity is the budget plus the new token, filled by a method that keeps
  ``min(budget, N)`` because the prompt left fewer tokens than the budget (the cache's plan; the
  cache reads it when it decides over the capacity).
"""

from __future__ import annotations

import torch

from kvhive import static_step
from kvhive.cache.layers.buffers import TokenBuffers, first_false, mark_static
from kvhive.cache.layers.counters import Count
from kvhive.cache.layers.growing import GrowingLayout
from kvhive.cache.layers.layout import Layout


class CapacityLayout(GrowingLayout):
    """Dense rows of one length (``counter``: host and device) in slots ``[0, length)`` of a fixed
    capacity, the slots past it zero or copies of dropped tokens (masked as empty)."""

    name = "fixed capacity"
    fixed_capacity = True

    def __init__(
        self, store, buffers: TokenBuffers, length: int, bounded: bool = False, fills_to_budget: bool = False
    ) -> None:
        Layout.__init__(self, store, buffers)
        # One device length per layer, kept across transitions (its address is what a compiled step reads).
        if store.length_device is None:
            store.length_device = mark_static(torch.zeros((), dtype=torch.int64, device=store.device))
        self.counter = Count(length, store.length_device)
        store.length_device.fill_(length)
        self.bounded_capacity = bounded
        self.fills_to_budget = fills_to_budget

    @property
    def length(self) -> int:
        """Tokens per row (host); read from the device counter, once, after compiled steps moved it."""
        counter = self.counter
        return counter.refresh() if counter.stale else counter.host

    @length.setter
    def length(self, value: int) -> None:
        self.counter.set(value)

    @property
    def known_length(self) -> int | None:
        """Tokens per row when the host knows them without asking the device (eager steps whose
        method declared what it keeps, ``Policy.kept_per_row``), else None: in a compiled step (the
        device counter is what the graph reads) or after one."""
        if static_step.in_static_step() or self.counter.stale:  # first: a compiled step guards on nothing here
            return None
        return self.counter.host

    def append(self, key_states, value_states, positions, new_tokens: int):
        buffers, store, counter = self.buffers, self.store, self.counter
        if not (
            self.bounded_capacity
            or static_step.in_static_step()
            or (counter.refresh() if counter.stale else counter.host) + new_tokens <= buffers.keys.shape[2]
        ):
            # Past the reserved capacity (more tokens than reserved): back to geometric growth.
            growing = GrowingLayout(store, buffers, 0, self.length)
            store.use_layout(growing)
            return growing.append(key_states, value_states, positions, new_tokens)
        if new_tokens == 1 and store.row_seen is None:
            index = counter.device.view(1)  # a decode step: the device length itself is the slot
        else:
            index = torch.arange(new_tokens, device=store.device) + counter.device
        shape = (store.batch_size, store.num_heads, new_tokens)
        buffers.keys.index_copy_(2, index, key_states)
        buffers.values.index_copy_(2, index, value_states)
        buffers.positions.index_copy_(2, index, positions.expand(shape))
        for name in buffers.reset_score_names(store.new_token_scores_read):
            buffers.scores[name].index_fill_(2, index, 0.0)
        counter.advance(new_tokens)
        return buffers.keys, buffers.values

    def take_chunk(self) -> None:
        """A prompt chunk (or a multi-token continuation): the growing layout from here on (a decode
        step reserves again)."""
        self.store.use_layout(GrowingLayout(self.store, self.buffers, 0, self.length))

    def counters(self) -> tuple:
        return (self.counter,)

    def decode_view(self):
        """``(keys, values, positions, token_scores, filled)`` over the whole capacity: ``filled [C]``
        True on the slots holding a token (None when the host knows every slot holds one)."""
        buffers = self.buffers
        capacity = buffers.keys.shape[2]
        if self.known_length == capacity:  # an eager step of a full capacity: nothing to mask
            return buffers.keys, buffers.values, buffers.positions, dict(buffers.scores), None
        filled = torch.arange(capacity, device=self.store.device) < self.counter.device
        return buffers.keys, buffers.values, buffers.positions, dict(buffers.scores), filled

    def set_token_scores(self, name: str, scores: torch.Tensor) -> None:
        self.write_scores(name, scores, 0, self.buffers.keys.shape[2])  # the whole capacity, empty slots too

    def compaction_target(self, kept: int) -> TokenBuffers:
        return self.buffers  # a fixed capacity keeps its buffers

    def release_unused(self) -> None:
        """A fixed capacity is sized by ``reserve_decode`` and keeps its addresses."""

    def compact_in_place(
        self,
        keep_mask: torch.Tensor,
        kept: torch.Tensor | int,
        at_most_one_dropped: bool = False,
        fill_hole: bool = False,
    ) -> None:
        """Keep the tokens where ``keep_mask [B, H, C]`` (over the whole capacity, False on the empty
        slots) is True, compacted at the front in their stored order; ``kept`` is their number per
        row (a 0-d device tensor, the same for every row; an int where the host knows it, which then
        stays the host length). Fixed shapes and no host read: the host length is refreshed from the
        device when next asked for. The slots past ``kept`` hold copies of dropped tokens.

        ``at_most_one_dropped``: at most one filled slot per row is dropped (every False past the
        first is an empty slot at the end), so the kept tokens just move down past the first False,
        found without a sort. ``fill_hole`` (with it; for a method that reads no stored order): the
        newest token, at the end of the filled slots, moves into the dropped token's slot instead.
        With nothing dropped, it is copied to the first empty slot, past the kept ones."""
        if fill_hole:
            if not at_most_one_dropped:
                raise ValueError("fill_hole moves one token per row: it needs at_most_one_dropped")
            self.fill_hole_in_capacity(first_false(keep_mask), kept)
            return
        self.buffers.gather_in_place(self.compaction_rows(keep_mask, at_most_one_dropped))
        self.set_kept(kept)

    def compaction_rows(self, keep_mask: torch.Tensor, at_most_one_dropped: bool) -> torch.Tensor:
        """Flat row of the token each slot takes in a compaction: the kept tokens first, in order."""
        store = self.store
        capacity = self.buffers.keys.shape[2]
        if at_most_one_dropped:
            hole = first_false(keep_mask, keepdim=True)
            slots = torch.arange(capacity, device=store.device)
            order = (slots + (slots >= hole).to(slots.dtype)).clamp_(max=capacity - 1)
        else:
            # Kept tokens first, in their stored (oldest first) order: a stable sort puts True first.
            order = torch.argsort((~keep_mask).to(torch.int8), dim=-1, stable=True)
        segments = store.num_segments
        return (torch.arange(segments, device=store.device)[:, None] * capacity + order.reshape(segments, -1)).reshape(
            -1
        )

    def set_kept(self, kept: torch.Tensor | int) -> None:
        """The new length: a device count (the host's is then stale), or an int the host knows."""
        if isinstance(kept, int):
            self.counter.set(kept)
        else:
            self.counter.device.copy_(kept)
            self.counter.mark_stale()

    def fill_hole_in_capacity(self, hole: torch.Tensor, kept: torch.Tensor | int) -> None:
        """Every row drops the token at stored index ``hole`` (``[B, H]``, or flat; the last filled slot
        where a row drops none): the newest token, at the end of the filled slots, moves into the
        freed slot (:meth:`compact_in_place` with ``fill_hole``); ``kept`` as there."""
        store = self.store
        hole = hole.reshape(-1)
        segments = store.batch_size * store.num_heads
        base = torch.arange(segments, device=store.device) * self.buffers.keys.shape[2]
        self.buffers.move_rows(base + hole, base + (self.counter.device - 1).expand_as(hole))
        self.set_kept(kept)
        store.stored_in_order = False
