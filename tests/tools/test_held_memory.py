"""Memory is the x-axis (issue 26): every result records the KV entries and bytes its cache held
(mean and peak over the item, in the layers the budget applies to), so a method that stores one
copy of each KV head per query head (Ada-KV's ``head_granularity="query"``) is seen holding G
times the memory of its base method at the same tokens per head."""

from __future__ import annotations

import pytest

from kvhive.evaluation.backend import Setting
from kvhive.evaluation.kvhive_backend import KVHiveBackend
from kvhive.models import tiny_model, tiny_tokenizer

BUDGET = 40
PROMPT = "The quick brown fox jumps over the lazy dog while bees keep the hive warm. " * 3  # ~230 byte tokens


@pytest.fixture(scope="module")
def sizes():
    model = tiny_model("llama", "gqa")  # 4 query heads share 2 KV heads, head dim 16
    backend = KVHiveBackend(model, tiny_tokenizer(), model_name="tiny-llama-gqa")
    settings = [
        Setting("snapkv", BUDGET),
        Setting("ada-snapkv:head_granularity=query", BUDGET),
        Setting("ada-snapkv", BUDGET),  # "auto": per KV head here (2 KV heads)
    ]
    backend.generate(PROMPT, 4, settings)
    config = model.config
    return dict(zip(("snapkv", "ada-query", "ada-auto"), backend.last_cache_sizes, strict=True)), config


def test_entries_and_bytes_are_what_the_cache_stored(sizes):
    sizes, config = sizes
    layers = config.num_hidden_layers
    bytes_per_entry = 2 * config.head_dim * 4  # key + value, float32
    for name, kv_heads in (("snapkv", 2), ("ada-query", 4), ("ada-auto", 2)):
        size = sizes[name]
        assert size["stored_heads"] == kv_heads and size["layers_counted"] == layers
        # kept per stored head is a mean over heads and layers: entries are that times both
        assert size["kv_entries_mean"] == pytest.approx(size["mean_kept_per_head"] * kv_heads * layers, rel=1e-3)
        assert size["kv_entries_peak"] == pytest.approx(size["peak_kept_per_head"] * kv_heads * layers, rel=1e-6)
        assert size["kv_bytes_peak"] == size["kv_entries_peak"] * bytes_per_entry
        assert size["kv_bytes_mean"] == pytest.approx(size["kv_entries_mean"] * bytes_per_entry)


def test_a_copy_per_query_head_holds_twice_the_memory_at_the_same_tokens_per_head(sizes):
    sizes, _ = sizes
    snap, ada = sizes["snapkv"], sizes["ada-query"]
    assert ada["peak_kept_per_head"] == snap["peak_kept_per_head"]  # the same tokens per stored head ...
    assert ada["kv_entries_peak"] == 2 * snap["kv_entries_peak"]  # ... in twice as many heads


def _as_recorded_before(size: dict) -> dict:
    """The sizes a result recorded before issue 26: tokens per stored head only."""
    return {k: size[k] for k in ("mean_kept_per_head", "final_kept_per_head", "peak_kept_per_head")}


def test_derived_memory_of_earlier_results_equals_what_the_backend_measures(sizes):
    from kvhive.evaluation.memory import derive_held_memory

    sizes, config = sizes
    for method, size in (
        ("snapkv", sizes["snapkv"]),
        ("ada-snapkv:head_granularity=query", sizes["ada-query"]),
        ("ada-snapkv", sizes["ada-auto"]),
    ):
        record = {"method": method, "budget": BUDGET, "kind": "generate", "cache": _as_recorded_before(size)}
        derived = derive_held_memory(record, config)
        assert derived["stored_heads"] == size["stored_heads"] and derived["layers_counted"] == size["layers_counted"]
        assert derived["kv_entries_peak"] == size["kv_entries_peak"]
        assert derived["kv_bytes_peak"] == size["kv_bytes_peak"]
        assert derived["kv_entries_mean"] == pytest.approx(size["kv_entries_mean"], rel=1e-3)


def test_derived_memory_counts_the_sliding_layers_a_streamed_budget_compresses():
    from kvhive.evaluation.memory import derive_held_memory

    model = tiny_model("gemma3", "gqa")  # sliding and full-attention layers
    backend = KVHiveBackend(model, tiny_tokenizer(), model_name="tiny-gemma3-gqa")
    window = model.config.sliding_window
    settings = [Setting("h2o", window // 2), Setting("full", 1.0)]
    backend.streaming_nll(list(range(40, 40 + 2 * window)), settings)
    for setting, size in zip(settings, backend.last_cache_sizes, strict=True):
        record = {
            "method": setting.method,
            "budget": setting.budget,
            "kind": "perplexity",
            "cache": _as_recorded_before(size),
        }
        derived = derive_held_memory(record, model.config)
        assert derived["layers_counted"] == size["layers_counted"]
        assert derived["kv_entries_peak"] == size["kv_entries_peak"]
    compressed, full = backend.last_cache_sizes
    assert compressed["layers_counted"] == model.config.num_hidden_layers  # a budget below the window: every layer
    assert full["layers_counted"] < model.config.num_hidden_layers  # the full cache: the full-attention layers
