"""How a cache's ``update`` hands the cache and layer to kvhive's attention function.

transformers does not pass the cache object to attention functions. It passes ``Cache.update``
the kwargs it will give the attention (transformers >= 5.24), so the cache puts itself there
(:func:`mark_update`) and the attention takes it out (:func:`active_update`). On older versions,
where no kwargs reach ``update``, each thread's last update is kept instead, held weakly so a dead
cache is never kept alive and threads never see each other's caches.
"""

from __future__ import annotations

import threading
import weakref

import torch
from transformers.cache_utils import Cache

# The key under which ``update`` hands the attention function its cache and layer through
# transformers' per-layer kwargs (the same dict is then unpacked into the attention call).
UPDATE_KWARG = "kvhive_layer"


class LastUpdates(threading.local):
    """Older transformers: each thread's last update, ``(cache ref, layer index, keys ref)`` or None."""

    last: tuple[weakref.ref, int, weakref.ref] | None = None


# The one module-level record, read only where transformers passes no kwargs to ``update``.
LAST_UPDATES = LastUpdates()


def active_update(keys: torch.Tensor, attention_kwargs: dict) -> tuple[Cache | None, int | None]:
    """The cache and layer whose ``update`` just returned ``keys``, or ``(None, None)`` (module docstring)."""
    handed = attention_kwargs.pop(UPDATE_KWARG, None)
    return handed if handed is not None else last_update(keys)


def last_update(keys: torch.Tensor) -> tuple[Cache | None, int | None]:
    """Older transformers: the thread's last update, if it returned ``keys`` (matched by identity)."""
    last = LAST_UPDATES.last
    if last is None:
        return None, None
    cache_ref, layer_index, keys_ref = last
    if keys_ref() is keys:
        LAST_UPDATES.last = None
        return cache_ref(), layer_index
    return None, None


def mark_update(cache: Cache, layer_index: int, keys: torch.Tensor, update_kwargs: dict) -> None:
    """Hand ``cache`` and ``layer_index`` to the attention that reads ``keys`` next (module docstring)."""
    layer_kwargs = update_kwargs.get("kwargs")
    if isinstance(layer_kwargs, dict):
        layer_kwargs[UPDATE_KWARG] = (cache, layer_index)
    else:
        LAST_UPDATES.last = (weakref.ref(cache), layer_index, weakref.ref(keys))
