"""benchmarks/bench_gpu_steps.py (the table scripts/gpu_quick.sh writes) cannot rot unnoticed: its CPU dry
run (``--device cpu --tiny``) measures every mode of one method beside the stock rows, writes its JSON
lines and its markdown table, and marks what does not fit its time budget as skipped."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "bench_gpu_steps.py"


def _bench_gpu_steps():
    spec = importlib.util.spec_from_file_location("bench_gpu_steps", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(tmp_path, *arguments: str) -> tuple[list[dict], str]:
    out, table = tmp_path / "steps.jsonl", tmp_path / "steps.md"
    common = ("--device", "cpu", "--tiny", "--methods", "tova", "--batches", "1", "--steps", "2")
    assert _bench_gpu_steps().main([*common, *arguments, "--out", str(out), "--table", str(table)]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()], table.read_text()


def test_cpu_dry_run_measures_every_mode_and_writes_the_table(tmp_path):
    rows, table = _run(tmp_path, "--budget-s", "600")
    assert [(row["method"], row["mode"]) for row in rows] == [
        ("stock", "eager"),
        ("tova", "eager"),
        ("tova", "+graph"),
        ("stock-static", "+compile"),
        ("tova", "+compile"),
    ]
    for row in rows:
        assert "error" not in row, row
        assert row["batch"] == 1 and row["context"] == 512 and row["layers"] == 2
    measured = [row for row in rows if row["mode"] != "+graph"]
    for row in measured:
        assert row["decode_ms_per_token"] > 0 and row["bandwidth_bound_ms"] > 0
        assert row["x_bound"] == row["decode_ms_per_token"] / row["bandwidth_bound_ms"]
    assert rows[2]["skipped"].startswith("a CUDA graph needs")  # no CUDA graph on the CPU
    for row in rows[3:]:
        assert row["compile_backend"] == "aot_eager"
        assert row["graphs_compiled_in_decode"] == 0 and row["graph_breaks_in_decode"] == 0
    tova = rows[1]
    assert tova["kv_bytes"] < rows[0]["kv_bytes"]  # 10% of the prompt against the full cache
    assert "## batch 1" in table
    assert f"| tova | {tova['decode_ms_per_token']:.2f} ({tova['x_bound']:.2f}x) | n/a | " in table


def test_rows_past_the_time_budget_are_marked_skipped(tmp_path):
    rows, table = _run(tmp_path, "--budget-s", "1e-9")
    assert [row.get("skipped") for row in rows] == ["time budget"] * 5
    assert "| tova | skipped | skipped | skipped |" in table
