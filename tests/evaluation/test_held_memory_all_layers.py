"""The memory a setting held counts the whole cache: on a Gemma-like model (sliding-window layers
the budget leaves alone, one full-attention layer, one KV head) the held fraction of the full cache
includes the sliding layers' windows, the report and its plot show it, and a setting holding more
than the full cache (Ada-KV's copies per query head on one KV head) is warned about at run time."""

from __future__ import annotations

import json
import warnings

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from kvhive.evaluation import run_eval
from kvhive.evaluation.backend import Setting
from kvhive.evaluation.kvhive_backend import KVHiveBackend
from kvhive.evaluation.report import plot_task, task_table
from kvhive.evaluation.results import ResultsSummary
from kvhive.models import tiny_model, tiny_tokenizer

WINDOW = 64  # a realistic window relative to the prompt (the tiny default of 8 hides the sliding layers' share)
PROMPT = "The bees of the hive keep warm in winter by clustering and shivering their wing muscles. " * 3
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def model():
    return tiny_model("gemma3", "gqa", num_key_value_heads=1, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def sizes(model):
    backend = KVHiveBackend(model, tiny_tokenizer(), model_name="tiny-gemma3-one-kv-head")
    settings = [Setting("full", 1.0), Setting("snapkv", 0.2), Setting("ada-snapkv", 0.5)]
    backend.generate(PROMPT, NEW_TOKENS, settings)
    return dict(zip(("full", "snapkv", "ada"), backend.last_cache_sizes, strict=True))


def _layer_counts(model) -> tuple[int, int]:
    types = model.config.layer_types
    return types.count("sliding_attention"), types.count("full_attention")


def test_the_held_fraction_counts_the_sliding_layers(model, sizes):
    sliding_layers, full_layers = _layer_counts(model)
    assert sliding_layers and full_layers
    prompt_tokens = len(tiny_tokenizer()(PROMPT)["input_ids"])
    assert prompt_tokens > 2 * WINDOW
    bytes_per_token = 2 * model.config.head_dim * 4  # key + value of the one KV head, float32
    window_bytes = sliding_layers * (WINDOW - 1) * bytes_per_token  # what each sliding layer keeps
    snap = sizes["snapkv"]
    # The budget's layer (kv_bytes_*) plus the sliding layers' windows: the whole cache.
    assert snap["cache_bytes_peak"] == snap["kv_bytes_peak"] + window_bytes
    assert snap["cache_bytes_mean"] == pytest.approx(snap["kv_bytes_mean"] + window_bytes)
    last_tokens = prompt_tokens + NEW_TOKENS - 1  # tokens seen at the last observation
    assert snap["full_cache_bytes_peak"] == (full_layers * last_tokens) * bytes_per_token + window_bytes
    compressed_only = snap["kv_bytes_peak"] / (full_layers * last_tokens * bytes_per_token)
    assert compressed_only == pytest.approx(0.2, abs=0.05)
    whole = (snap["kv_bytes_peak"] + window_bytes) / snap["full_cache_bytes_peak"]
    assert snap["held_fraction_peak"] == pytest.approx(whole, abs=1e-4)
    assert snap["held_fraction_mean"] > 0.5  # the windows dominate: far from the 0.2 of the budget's layer
    assert sizes["full"]["held_fraction_mean"] == pytest.approx(1.0)
    assert sizes["full"]["held_fraction_peak"] == pytest.approx(1.0)


def test_copies_per_query_head_hold_more_than_the_full_cache(sizes):
    ada = sizes["ada"]
    assert ada["stored_heads"] == 4  # a copy of the one KV head per query head
    assert ada["held_fraction_peak"] > 1.0
    assert ada["held_fraction_peak"] > sizes["snapkv"]["held_fraction_peak"]


def _run(model, tmp_path):
    backend = KVHiveBackend(model, tiny_tokenizer(), model_name="tiny-gemma3-one-kv-head")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_eval(
            backend,
            ["synthetic_recall:num_pairs=12"],
            ["snapkv", "ada-snapkv"],
            [0.2, 0.5],
            limit=2,
            data_dir=None,
            out_dir=tmp_path,
            progress=False,
            model_name="tiny-gemma3-one-kv-head",
        )
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    return records, [str(w.message) for w in caught]


def test_a_run_warns_of_a_setting_above_the_full_cache_and_the_report_shows_the_whole_cache(model, tmp_path):
    records, messages = _run(model, tmp_path)
    above = {r["setting"] for r in records if r.get("cache", {}).get("held_fraction_peak", 0) > 1.0}
    assert above and all(label.startswith("ada-snapkv") for label in above)
    warned = [m for m in messages if "more bytes than the full cache" in m]
    assert {label for label in above if any(label in m for m in warned)} == above
    assert not [m for m in warned if "setting snapkv" in m]

    summary = ResultsSummary(records)
    table = task_table(summary, "synthetic_recall")
    assert "whole cache / full mean / peak" in table
    assert "**above full**" in table
    figures = []
    original = plt.close
    plt.close = lambda figure=None: figures.append(figure)
    try:
        paths = plot_task(summary, "synthetic_recall", tmp_path)
    finally:
        plt.close = original
    held = [(path, figure) for path, figure in zip(paths, figures, strict=True) if path.name.endswith("_held.png")]
    assert len(held) == 1
    axis = held[0][1].axes[0]
    xs = {
        line.get_gid() or line.get_label(): list(line.get_xdata())
        for line in axis.get_lines()
        if line.get_marker() not in (None, "None", "", " ", "_")
    }
    plotted = sorted(x for values in xs.values() for x in values)
    recorded = sorted(
        sum(r["cache"]["held_fraction_mean"] for r in records if r["setting"] == label) / 2
        for label in {r["setting"] for r in records if r["method"] != "full"}
    )
    assert plotted == pytest.approx(recorded)
    assert max(plotted) > 1.0  # ada-snapkv plots where it is: above the full cache's memory
