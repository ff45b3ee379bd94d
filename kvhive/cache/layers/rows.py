"""The rows layout: stacked batch rows holding different numbers of tokens.

Rows prefilled separately and stacked (``KVHiveCache.stack``) that hold different numbers of tokens
fill slots ``[0, L_b)`` of a common capacity, each row ``b`` with its own length (host list and
device ``[B]`` counter, :class:`~kvhive.cache.layers.counters.RowCounts`); attention reads the whole
capacity with the empty slots masked. The capacity is bounded where the layer's decisions keep it
(a method that evicts in such rows compacts them after every append, ``reserve_rows``; fixed batch
slots of a layer that grows, ``set_rows(row_capacity=...)``, where an append past it is refused so
rows joining later fit in place), else it grows when a row reaches its end. In fixed batch slots a
free row (``LayerStore.row_active_device`` False) keeps one token and does not grow.

A sliding-window layer whose rows hold their last tokens (``window``: a capacity of the window) keeps
each row within its window after every step (:meth:`RowsLayout.drop_outside_window`): a row holding
the whole window drops its oldest token, the newest moving into its slot, so rows of prompts shorter
than the window grow while longer ones slide, with no host read and one shape.
"""

from __future__ import annotations

import copy

import torch

from kvhive import static_step
from kvhive.cache.layers.buffers import TokenBuffers, first_false, mark_static, reserve
from kvhive.cache.layers.capacity import CapacityLayout
from kvhive.cache.layers.counters import RowCounts
from kvhive.cache.layers.layout import Layout


def stacked_buffers(keys, values, positions, scores, capacity: int) -> TokenBuffers:
    """Dense buffers of ``capacity`` slots per row holding row ``i``'s stored tokens (``keys[i]``
    ``[1, H, L_i, d]`` and the rest alike) in slots ``[0, L_i)``, zeros beyond (empty slots are
    attended with weight 0: never uninitialised memory)."""
    first = keys[0]
    made = TokenBuffers.dense(first, values[0], len(keys), first.shape[1], capacity)
    for buffer in made.tensors():
        buffer.zero_()
    made.scores = {name: made.zero_scores() for name in sorted({name for row in scores for name in row})}
    for row, length in enumerate(int(k.shape[2]) for k in keys):
        made.keys[row, :, :length].copy_(keys[row][0])
        made.values[row, :, :length].copy_(values[row][0])
        made.positions[row, :, :length].copy_(positions[row][0])
        for name, score in scores[row].items():
            made.scores[name][row, :, :length].copy_(score[0])
    return made


class RowsLayout(CapacityLayout):
    """Rows of different lengths (``lengths``) in slots ``[0, L_b)`` of a common capacity."""

    name = "rows of different lengths"
    has_row_lengths = True
    known_length = None

    def __init__(
        self, store, buffers: TokenBuffers, lengths: RowCounts, bounded: bool, window: int | None = None
    ) -> None:
        Layout.__init__(self, store, buffers)
        self.lengths = lengths
        self.bounded_capacity = bounded
        # A sliding layer's window, where each row holds its last tokens (consecutive positions) in a
        # capacity of the window: drop_outside_window keeps it so. None: the rows never slide here.
        self.window = window

    @classmethod
    def of_lengths(cls, store, buffers: TokenBuffers, lengths: list[int], bounded: bool) -> RowsLayout:
        device = mark_static(torch.tensor(lengths, dtype=torch.int64, device=store.device))
        return cls(store, buffers, RowCounts(list(lengths), device), bounded)

    @property
    def row_lengths_device(self) -> torch.Tensor:
        return self.lengths.device

    @property
    def length(self) -> int:
        """The longest row (host)."""
        return max(self.lengths.value)

    def row_lengths_host(self) -> list[int]:
        return self.lengths.value

    def counters(self) -> tuple:
        return (self.lengths,)

    def refuse(self, what: str):
        raise RuntimeError(
            f"layer {self.store.layer_index} holds rows of different lengths (stacked rows): {what} is not supported "
            "in that layout"
        )

    def num_stored(self) -> int:
        return self.store.num_heads * sum(self.lengths.value)

    def lengths_host(self) -> torch.Tensor:
        store = self.store
        return (
            torch.tensor(self.lengths.value, dtype=torch.long)[:, None]
            .expand(store.batch_size, store.num_heads)
            .clone()
        )

    # -- appends --------------------------------------------------------------------------------
    def append(self, key_states, value_states, positions, new_tokens: int):
        """Row ``b``'s new tokens go to slots ``[L_b, L_b + new)`` (a free row of fixed batch slots
        overwrites its slots past ``L_b`` and does not grow)."""
        store, lengths = self.store, self.lengths
        capacity = self.buffers.keys.shape[2]
        # A captured step, or lengths its evictions changed on the device, read no host length: a
        # bounded capacity is then checked on the device.
        device_only = static_step.in_static_step() or lengths.stale
        longest = 0 if device_only else max(lengths.host) + new_tokens
        if longest > capacity and self.bounded_capacity:
            raise ValueError(
                f"a row of layer {store.layer_index} would hold {longest} tokens, past its fixed capacity of "
                f"{capacity} (fixed batch slots: give a larger slot_capacity)"
            )
        if longest > capacity:  # past the room reserved at stacking: a larger capacity, zeros beyond
            self.reallocate(longest + reserve(longest), capacity)
        buffers = self.buffers
        batch, heads = store.batch_size, store.num_heads
        slots = (lengths.device[:, None] + torch.arange(new_tokens, device=store.device))[:, None, :]
        slots = slots.expand(batch, heads, new_tokens)
        d, dv = key_states.shape[-1], value_states.shape[-1]
        buffers.keys.scatter_(2, slots[..., None].expand(batch, heads, new_tokens, d), key_states)
        buffers.values.scatter_(2, slots[..., None].expand(batch, heads, new_tokens, dv), value_states)
        buffers.positions.scatter_(2, slots, positions.expand(batch, heads, new_tokens))
        for name in buffers.reset_score_names(store.new_token_scores_read):
            buffers.scores[name].scatter_(2, slots, 0.0)
        lengths.advance(new_tokens, store.row_active_device, store.row_active)
        if device_only and self.bounded_capacity:
            torch._assert_async(
                (lengths.device <= capacity).all(),
                f"a row of layer {store.layer_index} outgrew its fixed capacity of {capacity}",
            )
        return buffers.keys, buffers.values

    def take_chunk(self) -> None:
        """(A stacked cache decodes one token per row: the cache refuses a chunk before it gets here.)"""

    def reallocate(self, capacity: int, keep: int) -> None:
        """New buffers of ``capacity`` slots per row holding the first ``keep`` slots of the old ones,
        zeros beyond."""
        new = TokenBuffers.zeros_like_rows(self.buffers, capacity)
        new.copy_front(self.buffers.window(0, keep), keep)
        self.buffers = new

    # -- views and decisions --------------------------------------------------------------------
    def decode_view(self):
        """The whole capacity, ``filled [B, C]``: each row its own filled slots."""
        buffers = self.buffers
        filled = torch.arange(buffers.keys.shape[2], device=self.store.device)[None, :] < self.lengths.device[:, None]
        return buffers.keys, buffers.values, buffers.positions, dict(buffers.scores), filled

    def compact_in_place(self, keep_mask, kept, at_most_one_dropped: bool = False, fill_hole: bool = False) -> None:
        """Every row keeps its tokens where ``keep_mask [B, H, C]`` is True, compacted at the front;
        ``kept [B]`` is each row's count (every head of a row keeps the same count). By a sort, or
        where each row drops at most one filled slot (``at_most_one_dropped``) by moving the later
        tokens down one slot, or (``fill_hole``, for a method that reads no stored order) by moving
        each row's newest token into the freed slot. The host lengths are read back when next asked for."""
        if fill_hole:
            if not at_most_one_dropped:
                raise ValueError("fill_hole moves one token per row: it needs at_most_one_dropped")
            self.move_newest(first_false(keep_mask))
            self.store.stored_in_order = False
        else:
            self.buffers.gather_in_place(self.compaction_rows(keep_mask, at_most_one_dropped))
        self.lengths.device.copy_(kept)
        self.lengths.mark_stale()

    def move_newest(self, hole: torch.Tensor) -> None:
        """Each row's newest token (its last filled slot) moves into slot ``hole`` (``[B, H]``, or
        ``[B]`` for every head of a row); a row whose hole is past its newest token (it drops none)
        copies it into an empty slot, which changes nothing it holds."""
        store = self.store
        heads, capacity = store.num_heads, self.buffers.keys.shape[2]
        segments = store.batch_size * heads
        newest = (self.lengths.device - 1).clamp(min=0).repeat_interleave(heads, output_size=segments)
        hole = hole.reshape(-1) if hole.dim() == 2 else hole.repeat_interleave(heads, output_size=segments)
        base = torch.arange(segments, device=store.device) * capacity
        self.buffers.move_rows(base + hole, base + newest)

    def drop_outside_window(self) -> None:
        """A sliding layer's step (``window``): each row drops the token the next query can no longer
        attend (its position before each row's ``tokens_seen - window + 1``; a row holds consecutive
        positions, so at most one, and only a row holding the whole window), its newest token taking
        the slot. Device work of one shape; the host lengths stay known in an eager step."""
        store, lengths, window = self.store, self.lengths, self.window
        capacity = self.buffers.keys.shape[2]
        filled = torch.arange(capacity, device=store.device)[None, :] < lengths.device[:, None]
        first_kept = store.row_seen.device - (window - 1)
        # (Every head of a row holds the same positions: the first head's say where the oldest is.)
        leaving = filled & (self.buffers.positions[:, 0] < first_kept[:, None])
        dropped = leaving.any(dim=-1)
        newest = (lengths.device - 1).clamp(min=0)
        self.move_newest(torch.where(dropped, first_false(~leaving), newest))
        lengths.device.sub_(dropped.to(lengths.device.dtype))
        if static_step.in_static_step() or lengths.stale:
            lengths.mark_stale()
        else:  # consecutive positions: a row drops one exactly when it holds more than window - 1
            lengths.host = [min(length, window - 1) for length in lengths.host]

    def fill_hole_in_capacity(self, hole, kept) -> None:
        self.refuse("fill_hole_in_capacity")

    def keep(self, keep_mask, counts) -> None:
        self.refuse("keep (the rows compact in place)")

    def fill_hole(self, hole) -> None:
        self.refuse("fill_hole")

    def drop_oldest(self, count: int) -> None:
        if count > 0:
            self.refuse("drop_oldest")

    def drop_newest(self, count: int) -> None:
        self.refuse("drop_newest")

    def expand_to_query_heads(self, heads_per_kv_head: int) -> None:
        self.refuse("expand_to_query_heads")

    def reserve(self, tokens: int, exact: bool) -> None:
        self.refuse("reserve_decode (its capacity is set by reserve_rows)")

    # -- rows -----------------------------------------------------------------------------------
    def select_rows(self, device_index: torch.Tensor, rows: list[int]) -> Layout:
        selected = copy.copy(self)
        selected.buffers = self.buffers.select_rows(device_index)
        selected.lengths = self.lengths.select(rows, device_index)
        return selected

    def write_row(self, row: int, keys, values, positions, scores: dict) -> None:
        """Fixed batch slots: row ``row`` takes another request's tokens, up to the capacity."""
        length, capacity = int(keys.shape[2]), self.buffers.keys.shape[2]
        if length > capacity:
            raise ValueError(
                f"the joining row holds {length} tokens in layer {self.store.layer_index}, more than its slot's "
                f"capacity of {capacity}: give a larger slot_capacity"
            )
        buffers = self.buffers
        buffers.write_row(row, slice(0, length), keys, values, positions, scores)
        for buffer in (buffers.keys, buffers.values, buffers.positions):
            buffer[row, :, length:].zero_()  # empty slots are attended with weight 0
        self.lengths.set_row(row, length)

    def hold_free_rows(self, active: list[bool]) -> None:
        """A free row keeps one token (its first) and stops growing, so it never outgrows its slot
        however long it stays free."""
        lengths = [
            length if running else min(length, 1) for length, running in zip(self.lengths.value, active, strict=True)
        ]
        self.lengths.set(lengths)

    def reserve_rows(self, capacity: int, window: int | None = None) -> None:
        """Exactly ``capacity`` slots per row, a bound the layer's decisions keep: an append never asks
        for the host lengths. Slots past each row's length are zero. ``window``: a sliding layer whose
        rows keep their last tokens (:meth:`drop_outside_window`)."""
        longest = self.length
        if capacity < longest:
            raise ValueError(f"capacity {capacity} is below the longest row ({longest} tokens)")
        if capacity != self.buffers.keys.shape[2]:
            self.reallocate(capacity, longest)
        self.store.use_layout(RowsLayout(self.store, self.buffers, self.lengths, bounded=True, window=window))
