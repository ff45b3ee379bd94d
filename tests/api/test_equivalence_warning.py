"""A head-wise method where it cannot differ from its base method warns once (issue 13 item 4).

Ada-KV allocates one layer budget across the stored heads; with one stored head per layer (one
KV head at ``head_granularity="kv"``) it keeps exactly what SnapKV keeps, so a comparison of the
two measures nothing. ``make_cache`` says so, once per method and head shape.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import kvhive
from kvhive import api
from kvhive.models import tiny_model


@pytest.fixture(autouse=True)
def fresh_warning_registry():
    api.EQUIVALENCE_WARNINGS.clear()
    yield
    api.EQUIVALENCE_WARNINGS.clear()


def _caught(model, method, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = kvhive.make_cache(model, method, budget=48, **kwargs)
    return cache, [w for w in caught if "allocates its budget across heads" in str(w.message)]


def test_headwise_method_on_one_kv_head_warns_once_and_is_really_equivalent():
    model = tiny_model("llama", num_key_value_heads=1)
    # average pooling: max pooling makes ties, which the two top-k selections may break differently
    # The default ("auto") stores query heads on a one-KV-head model, so only an explicit "kv" warns.
    assert _caught(model, "ada-snapkv", pooling="avg")[1] == []
    cache, first = _caught(model, "ada-snapkv", pooling="avg", head_granularity="kv")
    assert len(first) == 1
    message = str(first[0].message)
    assert "'ada-snapkv'" in message and "head_granularity='kv'" in message and "1 KV head(s)" in message
    assert "head_granularity='query'" in message.split("Pass")[1]
    assert first[0].filename == __file__  # points at the caller, not at kvhive
    _, second = _caught(model, "ada-snapkv", pooling="avg", head_granularity="kv")
    assert second == []  # once

    # The warning's claim holds: the same positions as SnapKV in every layer.
    base = kvhive.make_cache(model, "snapkv", budget=48, pooling="avg")
    input_ids = torch.randint(3, 200, (1, 120), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for each in (cache, base):
            model(input_ids=input_ids, past_key_values=each, use_cache=True)
    for layer, layer_base in zip(cache.layers, base.layers, strict=True):
        assert torch.equal(layer.stored_flat_positions(), layer_base.stored_flat_positions())


def test_no_warning_where_allocation_can_differ():
    one_kv_head = tiny_model("llama", num_key_value_heads=1)
    assert _caught(one_kv_head, "ada-snapkv", head_granularity="query")[1] == []  # 4 query heads
    assert _caught(one_kv_head, "snapkv")[1] == []  # not head-wise
    assert _caught(tiny_model("llama", "gqa"), "ada-pyramidkv")[1] == []  # 2 KV heads


def test_other_headwise_methods_warn_too():
    model = tiny_model("qwen2", num_key_value_heads=1)
    methods = ("ada-pyramidkv", "ada-ahakv", "pyramidkv", "h2o")
    warned = [method for method in methods[:2] if _caught(model, method, head_granularity="kv")[1]]
    warned += [method for method in methods[2:] if _caught(model, method)[1]]
    assert warned == ["ada-pyramidkv", "ada-ahakv"]
