"""Per-layer key/value storage: one :class:`LayerStore` per layer over a storage layout.

``store`` holds the layer (counters, the compressor's record, transformers' layer interface);
``layout`` the interface every layout implements; ``growing``, ``capacity``, ``rows`` and ``packed``
the layouts; ``buffers`` the four parallel token buffers and the helpers every layout uses;
``counters`` the counts mirrored on the host and the device.
"""

from kvhive.cache.layers.capacity import CapacityLayout
from kvhive.cache.layers.growing import GrowingLayout
from kvhive.cache.layers.layout import Layout
from kvhive.cache.layers.packed import PackedLayout
from kvhive.cache.layers.rows import RowsLayout
from kvhive.cache.layers.store import LayerStore

__all__ = ["CapacityLayout", "GrowingLayout", "Layout", "LayerStore", "PackedLayout", "RowsLayout"]
