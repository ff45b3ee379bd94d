"""The interface every storage layout implements.

A layout is how one layer lays its tokens out in its :class:`~kvhive.cache.layers.buffers.TokenBuffers`
(held in ``buffers``; None while the layer is empty). The :class:`~kvhive.cache.layers.store.LayerStore`
holds one layout at a time and replaces it only at a transition (``LayerStore.use_layout``): the end
of a layer's prefill (``reserve_decode``), stacking rows (``set_rows``), a multi-token update, a keep
with different counts per head, a reset. A transition hands the buffers over, so their addresses
(and ``mark_static`` marks) survive it unless the new layout needs other buffers.

Every layout answers:

* ``append(keys, values, positions, new_tokens)`` -> the ``(keys, values)`` attention reads;
* ``dense()`` / ``decode_view()`` (the dense layouts) or ``packed()`` / ``packed_buffers()`` (packed);
* ``keep(mask, counts)``, ``fill_hole(hole)``, ``compact_in_place(...)``: an eviction;
* ``select_rows(device_index, rows)`` -> a layout over the selected rows, or a refusal naming the layout;
* ``lengths_host()``, ``num_stored()``, ``capacity()``, ``metadata_nbytes()``: sizes and accounting;
* ``counters()``: the counts it mirrors on the device (re-read by ``LayerStore.trust_the_device``).

What a layout cannot do it refuses with a RuntimeError naming the layout (:meth:`Layout.refuse`).
Its traits (``is_uniform``, ``fixed_capacity``, ``bounded_capacity``, ``fills_to_budget``,
``has_row_lengths``) are constants of the layout object: the store copies them when it takes the
layout, so reading them on the hot path is an attribute read.
"""

from __future__ import annotations

import torch

from kvhive.cache.layers.buffers import TokenBuffers


class Layout:
    """Base of the storage layouts: the shared fields and the refusals of what a layout lacks."""

    name = "layout"
    is_uniform = True
    """Every row holds the same number of tokens (a dense layout)."""
    fixed_capacity = False
    """Appends write at a device index into room reserved once (``reserve_decode``)."""
    bounded_capacity = False
    """The reserved room is a bound the layer's decisions keep: an append never checks it on the host."""
    fills_to_budget = False
    """The capacity is the budget plus the new token, filled by a method that keeps min(budget, N)."""
    has_row_lengths = False
    """Rows hold different numbers of tokens in slots of a common capacity."""
    known_length = None
    """A fixed capacity's tokens per row when the host knows them, else None."""
    row_lengths_device = None
    """``[B]`` int64 tokens per row on the device (rows of different lengths), else None."""
    start = 0
    """Dense layouts: slot of the oldest stored token in every row."""

    def __init__(self, store, buffers: TokenBuffers | None) -> None:
        self.store = store
        self.buffers = buffers

    # -- refusals -------------------------------------------------------------------------------
    def refuse(self, what: str):
        raise RuntimeError(
            f"layer {self.store.layer_index} holds the {self.name} layout: {what} is not supported there"
        )

    def not_dense(self, what: str):
        """The refusal of a dense-only operation (this layout is not dense)."""
        self.refuse(what)

    def not_packed(self, what: str):
        """The refusal of a packed-only operation (this layout is not packed)."""
        self.refuse(what)

    # -- what each layout implements ------------------------------------------------------------
    def append(self, key_states, value_states, positions, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def num_stored(self) -> int:
        raise NotImplementedError

    def lengths_host(self) -> torch.Tensor:
        raise NotImplementedError

    def capacity(self) -> int:
        raise NotImplementedError

    def token_scores(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def stored_index(self) -> torch.Tensor:
        """Buffer index of every stored token, in segment order (``[T]`` on the device)."""
        raise NotImplementedError

    def keep(self, keep_mask: torch.Tensor, counts) -> None:
        raise NotImplementedError

    def reserve(self, tokens: int, exact: bool) -> None:
        raise NotImplementedError

    def select_rows(self, device_index: torch.Tensor, rows: list[int]) -> Layout:
        raise NotImplementedError

    def row_lengths_host(self) -> list[int] | None:
        """Tokens per batch row (host) where rows hold different numbers of tokens, else None."""
        return None

    def flat_counts(self, keep_mask: torch.Tensor, counts) -> torch.Tensor:
        """Kept tokens per segment ``[S]`` (host) of a flat mask over the stored tokens."""
        if keep_mask.shape[0] != self.num_stored():
            raise ValueError("flat keep mask must cover every stored token")
        if counts is None:
            device = self.store.device
            segments = self.store.num_segments
            segment = torch.repeat_interleave(
                torch.arange(segments, device=device),
                self.lengths_host().reshape(-1).to(device),
                output_size=keep_mask.shape[0],
            )
            counts = torch.zeros(segments, dtype=torch.long, device=device).index_add_(0, segment, keep_mask.long())
            counts = counts.cpu()
        return counts.reshape(-1).long()

    def counters(self) -> tuple:
        """The counts this layout mirrors on the device."""
        return ()

    def metadata_nbytes(self) -> int:
        """Bytes of this layout's own tables (beyond each token's position and scores)."""
        return 0

    def take_chunk(self) -> None:
        """Before a multi-token update (a prompt chunk or a continuation)."""

    def release_unused(self) -> None:
        """After a prefill: buffers of the stored tokens plus the append reserve, where they hold more."""

    def check_rows_selectable(self, method: str) -> None:
        """Refuse (before anything changes) when the rows of this layout cannot be selected."""

    def hold_free_rows(self, active: list[bool]) -> None:
        """Fixed batch slots: the free rows (False in ``active``) stop growing."""

    # -- dense-only -----------------------------------------------------------------------------
    def dense(self):
        self.not_dense("a dense view")

    @property
    def max_length(self) -> int:
        raise NotImplementedError

    def decode_view(self):
        self.not_dense("decode_view")

    def set_token_scores(self, name: str, scores: torch.Tensor) -> None:
        self.not_dense("per-token scores")

    def drop_oldest(self, count: int) -> None:
        if count > 0:
            self.not_dense("drop_oldest")

    def drop_newest(self, count: int) -> None:
        self.not_dense("drop_newest")

    def expand_to_query_heads(self, heads_per_kv_head: int) -> None:
        self.not_dense("expand_to_query_heads")

    def fill_hole(self, hole: torch.Tensor) -> None:
        """Every row drops exactly one stored token, the one at stored index ``hole`` (``[B, H]``, or
        flat): the newest token (the last stored) moves into the dropped token's slot, so a steady
        decode eviction moves one token per row instead of every token after the dropped one. The
        stored order is then no longer the tokens' order (``stored_in_order``); only a method that
        reads none (``Policy.reads_stored_order`` False) is held this way. The per-token scores move
        too, those nothing reads of the newest token's (``reset_score_names``) excepted."""
        self.not_dense("fill_hole")

    def compact_in_place(self, keep_mask, kept, at_most_one_dropped: bool = False, fill_hole: bool = False) -> None:
        raise RuntimeError(f"layer {self.store.layer_index} has no fixed decode capacity")

    def fill_hole_in_capacity(self, hole: torch.Tensor, kept) -> None:
        raise RuntimeError(f"layer {self.store.layer_index} has no fixed decode capacity")

    def write_row(self, row: int, keys, values, positions, scores: dict) -> None:
        self.not_dense("write_row")

    def reserve_rows(self, capacity: int) -> None:
        raise RuntimeError(f"layer {self.store.layer_index} holds one length for every row")

    # -- packed-only ----------------------------------------------------------------------------
    def packed(self):
        self.not_packed("packed()")

    def packed_buffers(self):
        self.not_packed("packed_buffers()")

    def packed_pages(self):
        self.not_packed("packed_pages()")

    segment_capacity_host = None
    """Packed layout: tokens reserved per segment (whole pages), CPU ``[S]``; None otherwise."""
