"""benchmarks/bench_gpu.py cannot rot unnoticed: its CPU smoke path (``--device cpu --tiny``) runs
here end to end, each configuration in its own process, and a second run resumes from the results
file; a configuration that fails or whose process dies is recorded as such (issue 23 item 7)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "bench_gpu.py"
# One stock eager row, the best stock decode compiled (StaticCache + torch.compile, aot_eager on the
# CPU) and one kvhive method that evicts at every decode step.
SMOKE_CONFIGS = "stock-cudnn-off,stock-static+compile,tova"


def _bench_gpu():
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(*arguments: str) -> int:
    # The driver runs in this process (it only reads and appends the results file); each
    # configuration still runs in a fresh worker process of its own.
    return _bench_gpu().main(["--device", "cpu", "--tiny", *arguments])


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_cpu_smoke_run_writes_one_line_per_configuration_and_resumes(tmp_path, capsys):
    out = tmp_path / "bench.jsonl"
    assert _run("--configs", SMOKE_CONFIGS, "--out", str(out)) == 0
    rows = _lines(out)
    assert [row["config"] for row in rows] == SMOKE_CONFIGS.split(",")
    for row in rows:
        assert "error" not in row, row
        assert row["device_kind"] == "cpu" and row["tiny"] and row["layers"] == 2 and row["context"] == 512
        assert row["prefill_s"] > 0 and row["decode_ms_per_token"] > 0 and row["warm_up_s"] > 0
        assert 0 < row["kv_bytes"] <= row["reserved_bytes"]
        assert row["bandwidth_bound_ms"] == pytest.approx(
            1e3 * (row["weights_bytes"] + row["kv_bytes"]) / (row["copy_bandwidth_GBps"] * 1e9)
        )
        assert "peak_prefill_above_weights_bytes" not in row and row["peak_memory"].startswith("not measured")
    stock, compiled, tova = rows
    assert stock["budget_applied"] is None and tova["budget_applied"] == 0.1
    # 10% of 512 tokens per head, two layers, two KV heads of 16 fp32 values, keys and values.
    assert tova["kv_bytes"] == 2 * 2 * 51 * 16 * 4 * 2
    assert compiled["compile_backend"] == "aot_eager"
    assert compiled["graphs_compiled_in_decode"] == 0 and compiled["graph_breaks_in_decode"] == 0
    assert "graphs_compiled_in_decode" not in stock

    capsys.readouterr()
    assert _run("--configs", SMOKE_CONFIGS, "--out", str(out)) == 0
    assert _lines(out) == rows
    assert capsys.readouterr().out.count("already in") == 3


def test_a_worker_that_dies_is_recorded_and_rerun(tmp_path):
    out = tmp_path / "bench.jsonl"
    assert _run("--configs", "full", "--timeout", "0.5", "--out", str(out)) == 0
    (row,) = _lines(out)
    assert row["config"] == "full" and row["error"] == "worker timed out after 0.5 s"
    bench_gpu = _bench_gpu()
    settings = {name: row[name] for name in (*bench_gpu.SETTINGS, "config")}
    assert not bench_gpu.done(out, settings)  # an error is not a result: the next run retries it
    bench_gpu.append_line(out, {**settings, "kind": "e2e", "decode_ms_per_token": 1.0})
    assert bench_gpu.done(out, settings)
    assert not bench_gpu.done(out, {**settings, "context": 1024})


def test_a_failing_configuration_is_a_line_with_its_error(tmp_path):
    bench_gpu = _bench_gpu()
    out = tmp_path / "bench.jsonl"
    settings = {
        "label": "t",
        "commit": None,
        "device_kind": "cpu",
        "tiny": True,
        "context": 256,  # 10% is 26 tokens: below SnapKV's 32-token minimum
        "batch": 1,
        "budget": 0.1,
        "layers": 2,
        "decode_tokens": 2,
        "compile_backend": "aot_eager",
        "config": "snapkv",
        "profile": False,
    }
    assert bench_gpu.worker(settings, out) == 0
    (row,) = _lines(out)
    assert row["error"].startswith("ValueError: invalid budget") and "snapkv" in row["error"]


def test_configuration_names_are_checked_and_compile_rows_added(capsys):
    bench_gpu = _bench_gpu()
    assert bench_gpu.with_compiled_rows(["stock-cudnn-on", "stock-cudnn-off", "full@kernel", "tova"]) == [
        "stock-cudnn-on",
        "stock-cudnn-off",
        "full@kernel",
        "tova",
        "stock-static+compile",
        "full@kernel+compile",
        "tova+compile",
    ]
    assert bench_gpu.parse_config("snapkv@kernel+compile") == {
        "config": "snapkv@kernel+compile",
        "stock": False,
        "method": "snapkv",
        "dense_decode": "kernel",
        "compiled": True,
        "graph": False,
    }
    assert bench_gpu.parse_config("tova+graph")["graph"] is True
    for bad, message in [
        ("nosuch", "expected one of stock-cudnn-on"),
        ("snapkv@fast", "expected @kernel or @sdpa"),
        ("stock-static@kernel", "apply to kvhive methods only"),
        ("stock-static+graph", "apply to kvhive methods only"),
        ("tova+graph+compile", "not both"),
    ]:
        with pytest.raises(ValueError, match=message):
            bench_gpu.parse_config(bad)
    with pytest.raises(SystemExit) as refused:
        _run("--configs", "tova,nosuch", "--out", "/nonexistent/never-written.jsonl")
    assert refused.value.code == 2 and "invalid config 'nosuch'" in capsys.readouterr().err


def test_a_left_padded_batch_runs_with_its_mask_and_is_refused_where_it_cannot(tmp_path):
    """``--left-padding``: every other row left-padded, the prefill and each eager decode step with the
    attention mask (the rows a padded batch's column-sum route is measured by); recorded as a setting,
    so a run without padding is not taken for it; refused with +compile/+graph, one row, or padding
    that leaves no real token."""
    out = tmp_path / "padded.jsonl"
    configs = "stock-cudnn-off,h2o"
    assert (
        _run("--configs", configs, "--batch", "2", "--left-padding", "100", "--decode-tokens", "2", "--out", str(out))
        == 0
    )
    rows = _lines(out)
    assert [row["config"] for row in rows] == configs.split(",")
    for row in rows:
        assert "error" not in row, row
        assert row["left_padding"] == 100 and row["batch"] == 2 and row["prefill_s"] > 0
    assert rows[1]["budget_tokens"] == 51  # 10% of the 512-token prompt, the same in both rows
    assert _bench_gpu().done(out, {**rows[1], "left_padding": 100})
    assert not _bench_gpu().done(out, {**rows[1], "left_padding": 0})
    for arguments in (
        ("--configs", "tova+graph", "--batch", "2", "--left-padding", "8"),
        ("--configs", "stock-static+compile", "--batch", "2", "--left-padding", "8"),
        ("--configs", "h2o", "--batch", "1", "--left-padding", "8"),
        ("--configs", "h2o", "--batch", "2", "--left-padding", "512"),
    ):
        with pytest.raises(SystemExit) as refused:
            _run(*arguments, "--out", str(tmp_path / "refused.jsonl"))
        assert refused.value.code == 2
    assert not (tmp_path / "refused.jsonl").exists()
