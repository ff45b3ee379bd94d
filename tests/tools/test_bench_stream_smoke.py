"""benchmarks/bench_stream.py (issue 24 item 4) on a short stream: records every --every tokens,
a rerun skips a complete method, and an interrupted method streams again without its earlier
records counted twice."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_stream.py"


def _run(out: Path, methods: str) -> str:
    command = [sys.executable, str(SCRIPT), "--methods", methods, "--tokens", "3000", "--chunk", "500"]
    command += ["--every", "1000", "--budget", "64", "--out", str(out)]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_a_stream_records_as_it_goes_and_resumes_without_duplicates(tmp_path):
    out = tmp_path / "stream.jsonl"
    _run(out, "streamingllm")
    first = _records(out)
    assert [r["tokens_seen"] for r in first] == [1000, 2000, 3000]
    assert all(r["kept_tokens_max"] <= 64 and r["peak_bytes"] > 0 for r in first)
    # An interrupted h2o run left one record; the rerun skips streamingllm and redoes h2o.
    out.write_text(out.read_text() + json.dumps({**first[0], "method": "h2o"}) + "\n")
    printed = _run(out, "streamingllm,h2o")
    assert "streamingllm: complete" in printed and "h2o: 1 records of an interrupted run dropped" in printed
    records = _records(out)
    assert [(r["method"], r["tokens_seen"]) for r in records] == [
        ("streamingllm", 1000),
        ("streamingllm", 2000),
        ("streamingllm", 3000),
        ("h2o", 1000),
        ("h2o", 2000),
        ("h2o", 3000),
    ]
