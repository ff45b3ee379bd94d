"""``kvhive generate`` states what a budget saves (issue 13 items 3 and 6).

The tiny Gemma 3 has 4 layers, 3 of them 8-token sliding-window layers that a budget leaves at
their window unless ``--compress-sliding``: the nominal budget says little about the bytes saved,
so the output gives ``cache_bytes / full_cache_bytes`` and the layers the budget touched.
"""

from __future__ import annotations

import json

import pytest

from kvhive.cli import main

PROMPT = "The quick brown fox jumps over the lazy dog while the bees hum. " * 2
BASE = ["generate", "--model", "tiny-gemma3-gqa", "--method", "streamingllm", "--budget", "12", "--max-new-tokens", "3"]


def _json(capsys, *extra):
    assert main([*BASE, "--json", *extra, PROMPT]) == 0
    return json.loads(capsys.readouterr().out)


def test_headline_states_fraction_of_full_cache_bytes_and_compressed_layers(capsys):
    assert main([*BASE, PROMPT]) == 0
    captured = capsys.readouterr()
    line = captured.err.strip().splitlines()[-1]
    statistics = _json(capsys)
    fraction = statistics["cache_bytes"] / statistics["full_cache_bytes"]
    # the budget saved something, but less than its nominal 12 of ~130 tokens: sliding layers keep their window
    assert 12 / statistics["tokens_seen"] < fraction < 1
    assert f"holds {fraction:.3f} of the full cache's bytes (saves {1 - fraction:.1%})" in line
    assert "budget applied to 1 of 4 layers; 3 sliding-window layers keep their 8-token window" in line
    assert statistics["cache_fraction_of_full"] == pytest.approx(fraction, abs=1e-4)
    assert (statistics["layers"], statistics["compressed_layers"], statistics["sliding_layers_at_window"]) == (4, 1, 3)
    assert captured.out.strip() and "kvhive:" not in captured.out  # stdout is the generated text only

    assert main([*BASE, "--compress-sliding", PROMPT]) == 0
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "budget applied to 4 of 4 layers" in line and "sliding-window layers keep" not in line


def test_json_statistics_are_a_summary_unless_per_layer_is_asked(capsys):
    summary = _json(capsys)
    assert "kept_tokens_per_layer" not in summary and "layer_budgets" not in summary
    assert summary["layer_budget_range"] == [12, 12] and summary["kept_tokens_total"] > 0
    assert len(json.dumps(summary, indent=2).splitlines()) < 30
    detailed = _json(capsys, "--per-layer")
    assert set(detailed["kept_tokens_per_layer"]) == {"0", "1", "2", "3"} and detailed["layer_budgets"] == {"3": 12}
    assert {k: v for k, v in detailed.items() if k not in ("kept_tokens_per_layer", "layer_budgets")} == summary


def test_per_layer_without_json_is_refused(capsys):
    with pytest.raises(SystemExit, match="--per-layer adds detail to --json"):
        main([*BASE, "--per-layer", PROMPT])
