"""``METHOD:kv_bits=N`` in ``kvhive eval``: the same method with its kept tokens stored quantized, a
setting of its own whose records say so and whose held bytes are the quantized ones."""

from __future__ import annotations

import pytest

from kvhive.cli import main as kvhive_main
from kvhive.evaluation import read_results
from kvhive.evaluation.backend import Setting, split_cache_options
from kvhive.evaluation.bytes_plot import held_bytes_points
from kvhive.evaluation.cli import default_data_dir
from kvhive.evaluation.results import ResultsSummary

DATA_DIR = default_data_dir()


def test_kv_bits_is_a_cache_option_with_its_accepted_values():
    assert split_cache_options("h2o:kv_bits=4") == ("h2o", {"kv_bits": 4})
    assert Setting("snapkv:window=4:kv_bits=8", 0.3).kv_bits == 8
    assert Setting("snapkv", 0.3).kv_bits is None
    for bad in ("3", "16", "x", ""):
        with pytest.raises(ValueError, match="kv_bits must be one of 4, 8"):
            split_cache_options(f"h2o:kv_bits={bad}")


def test_quantized_settings_run_are_labelled_and_hold_fewer_bytes(tmp_path):
    assert DATA_DIR.exists(), f"shared data not found at {DATA_DIR}"
    out = tmp_path / "kv_bits"
    code = kvhive_main(
        [
            "eval",
            "--model",
            "tiny-llama-gqa",
            "--tasks",
            "needle:lengths=300:depths=50:max_new_tokens=6,ppl:num_tokens=64:window=32",
            "--methods",
            "h2o",
            "--kv-bits",
            "8,4",
            "--budgets",
            "0.3",
            "--limit",
            "1",
            "--data-dir",
            str(DATA_DIR),
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0
    records = read_results(out)
    assert all(r["status"] == "ok" for r in records)
    by_key = {(r["task"], r["setting"]): r for r in records}
    for task in ("needle", "ppl"):
        plain, int8, int4 = (by_key[(task, f"h2o{option}@0.3")] for option in ("", ":kv_bits=8", ":kv_bits=4"))
        assert "kv_bits" not in plain and int8["kv_bits"] == 8 and int4["kv_bits"] == 4
        assert int4["cache"]["kv_bytes_mean"] < int8["cache"]["kv_bytes_mean"] < plain["cache"]["kv_bytes_mean"]
        # The same tokens are kept: only their bytes differ.
        assert int8["cache"]["kv_entries_mean"] == plain["cache"]["kv_entries_mean"]
    # The report plots quality against the bytes held: one series per bit width, at its bytes.
    assert (out / "quality_needle_bytes.png").exists() and (out / "quality_ppl_bytes.png").exists()
    points = held_bytes_points(ResultsSummary(records), "needle")
    assert set(points) == {"full (model dtype)", "h2o (model dtype)", "h2o (8-bit)", "h2o (4-bit)"}
    held = {label: series[0][0] for label, series in points.items()}
    assert held["h2o (4-bit)"] < held["h2o (8-bit)"] < held["h2o (model dtype)"]
    assert held["h2o (8-bit)"] == by_key[("needle", "h2o:kv_bits=8@0.3")]["cache"]["kv_bytes_mean"]


def test_eval_kv_bits_adds_each_method_at_each_width(capsys):
    from kvhive.evaluation.cli import with_kv_bits

    assert with_kv_bits(["full", "h2o", "snapkv:window=4"], [4, 8]) == [
        "full",
        "h2o",
        "h2o:kv_bits=4",
        "h2o:kv_bits=8",
        "snapkv:window=4",
        "snapkv:window=4:kv_bits=4",
        "snapkv:window=4:kv_bits=8",
    ]
    assert with_kv_bits({"needle": ["h2o"]}, [4]) == {"needle": ["h2o", "h2o:kv_bits=4"]}
    assert with_kv_bits(["h2o"], None) == ["h2o"]
    with pytest.raises(SystemExit):
        kvhive_main(["eval", "--tasks", "needle", "--methods", "h2o", "--kv-bits", "3"])
    assert "--kv-bits" in capsys.readouterr().err
