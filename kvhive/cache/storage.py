"""Per-layer key/value storage, re-exported from :mod:`kvhive.cache.layers` (its home): one
:class:`LayerStore` per layer over a storage layout, and the constants and helpers the layouts share."""

from kvhive.cache.layers.buffers import (
    MIN_RESERVE_TOKENS,
    PADDING_SCORE,
    PAGE_TOKENS,
    POSITION_DTYPE,
    RESERVE_FRACTION,
    SEGMENT_RESERVE_TOKENS,
    TokenBuffers,
    first_false,
    mark_static,
    new_score_buffer,
    reserve,
    row_index,
    to_device_at_once,
    true_indices,
)
from kvhive.cache.layers.store import LayerStore

__all__ = [
    "MIN_RESERVE_TOKENS",
    "PADDING_SCORE",
    "PAGE_TOKENS",
    "POSITION_DTYPE",
    "RESERVE_FRACTION",
    "SEGMENT_RESERVE_TOKENS",
    "LayerStore",
    "TokenBuffers",
    "first_false",
    "mark_static",
    "new_score_buffer",
    "reserve",
    "row_index",
    "to_device_at_once",
    "true_indices",
]
