"""The kvpress cross-check fails loudly: ``crosscheck/compare.py`` refuses to write RESULTS.md
when any case could not be compared (a kvhive case that failed, a run missing on either side),
and ``crosscheck/kvhive_side.py`` reads the kept positions through the layer store's public API.
Plain Python on synthetic artifacts (kvpress itself is not needed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
CROSSCHECK = REPO / "crosscheck"
sys.path.insert(0, str(CROSSCHECK))
from cases import CASES, COMPRESSION_RATIOS, case_key  # noqa: E402

TOKENS, LAYERS, HEADS = 100, 2, 2


def _layers(count: int) -> list[dict]:
    kept = [list(range(TOKENS - count, TOKENS))] * HEADS
    return [{"layer": i, "kept": kept, "n_kept": count} for i in range(LAYERS)]


def _hive_layers(count: int) -> list[dict]:
    kept = [list(range(TOKENS - count, TOKENS))] * HEADS
    return [{"layer": i, "kept": kept, "n_kept": [count] * HEADS, "budget": count} for i in range(LAYERS)]


def _artifacts(tmp_path: Path, broken: str | None = None, missing: str | None = None) -> Path:
    artifacts = tmp_path / "artifacts"
    (artifacts / "model").mkdir(parents=True)
    config = dict(num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=HEADS, head_dim=8)
    (artifacts / "model" / "config.json").write_text(json.dumps({**config, "initializer_range": 0.08}))
    (artifacts / "prompt.json").write_text(json.dumps({"input_ids": list(range(TOKENS))}))
    press_runs, hive_runs = {}, {}
    for spec in CASES:
        for ratio in COMPRESSION_RATIOS:
            key = case_key(spec["case"], ratio)
            count = int(TOKENS * (1 - ratio))
            press_runs[key] = {"layers": _layers(count)}
            hive_runs[key] = {"native": _hive_layers(count), "matched": _hive_layers(count)}
            if key == broken:
                hive_runs[key] = {"error": "AttributeError: 'DenseLayerStore' object has no attribute 'positions'"}
    if missing is not None:
        del press_runs[missing]
    meta = {"kvpress": "x", "transformers": "x", "torch": "x"}
    (artifacts / "kvpress.json").write_text(json.dumps({"meta": meta, "runs": press_runs}))
    hive_meta = {"kvhive_transformers": "x", "torch": "x"}
    (artifacts / "kvhive.json").write_text(json.dumps({"meta": hive_meta, "runs": hive_runs}))
    return artifacts


def _compare(artifacts: Path, results: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, str(CROSSCHECK / "compare.py"), "--artifacts", str(artifacts), "--results", str(results)]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_every_case_compared_writes_the_results(tmp_path):
    results = tmp_path / "RESULTS.md"
    done = _compare(_artifacts(tmp_path), results)
    assert done.returncode == 0, done.stderr
    text = results.read_text()
    assert "| ada-snapkv | 0.5 |" in text and "Not compared" not in text


@pytest.mark.parametrize("fault", ["broken", "missing"])
def test_an_unavailable_case_fails_and_leaves_the_results_as_they_were(tmp_path, fault):
    key = case_key("tova", COMPRESSION_RATIOS[0])
    artifacts = _artifacts(tmp_path, **{fault: key})
    results = tmp_path / "RESULTS.md"
    results.write_text("the previous results\n")
    done = _compare(artifacts, results)
    assert done.returncode != 0
    assert key in done.stderr and "was not written" in done.stderr
    assert results.read_text() == "the previous results\n"


def test_the_kvhive_side_reads_kept_positions_through_the_store_api():
    """``kept_positions`` on a real cache (dense and head-wise packed layouts) gives each head's
    stored positions, sorted, with the per-head counts."""
    from kvhive_side import kept_positions

    import kvhive
    from kvhive.models.tiny import tiny_model

    model = tiny_model("llama", "gqa")
    ids = torch.randint(3, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    for method, options in [("snapkv", {"window": 4}), ("ada-snapkv", {"window": 4, "head_granularity": "kv"})]:
        cache = kvhive.make_cache(model, method, 12, **options)
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache)
        for layer in kept_positions(cache):
            store = cache.layers[layer["layer"]]
            assert layer["n_kept"] == store.lengths_host[0].tolist()
            assert sum(layer["n_kept"]) == 12 * len(layer["n_kept"])
            for head, positions in enumerate(layer["kept"]):
                assert positions == sorted(positions) and len(set(positions)) == len(positions)
                assert positions[-4:] == list(range(36, 40))  # the observation window
                if method == "snapkv":
                    assert positions == sorted(store.dense()[2][0, head].tolist())
