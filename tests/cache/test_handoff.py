"""``kvhive.cache.handoff``: a cache's ``update`` hands itself and its layer to kvhive's attention,
through transformers' per-layer kwargs, or (older transformers, no kwargs) through its thread's last
update, matched by the returned keys and never seen by another thread."""

from __future__ import annotations

import gc
import threading

import torch
from transformers.cache_utils import Cache

from kvhive.cache.handoff import UPDATE_KWARG, active_update, mark_update


class _Cache(Cache):
    def __init__(self) -> None:
        super().__init__(layers=[])


def test_handed_through_the_attention_kwargs():
    cache, keys = _Cache(), torch.zeros(1)
    layer_kwargs: dict = {}
    mark_update(cache, 3, keys, {"kwargs": layer_kwargs})
    assert layer_kwargs == {UPDATE_KWARG: (cache, 3)}
    assert active_update(keys, layer_kwargs) == (cache, 3)
    assert UPDATE_KWARG not in layer_kwargs  # taken out before the kwargs reach sdpa


def test_without_kwargs_the_threads_last_update_matched_by_its_keys():
    cache, keys = _Cache(), torch.zeros(1)
    mark_update(cache, 2, keys, {})
    assert active_update(torch.zeros(1), {}) == (None, None)  # other keys: not this update
    assert active_update(keys, {}) == (cache, 2)
    assert active_update(keys, {}) == (None, None)  # read once
    seen = []
    mark_update(cache, 1, keys, {})
    thread = threading.Thread(target=lambda: seen.append(active_update(keys, {})))
    thread.start()
    thread.join()
    assert seen == [(None, None)]  # another thread never sees this thread's update
    assert active_update(keys, {}) == (cache, 1)


def test_the_fallback_keeps_no_cache_alive():
    cache, keys = _Cache(), torch.zeros(1)
    mark_update(cache, 0, keys, {})
    del cache
    gc.collect()
    assert active_update(keys, {})[0] is None
