"""Foundation benchmarks on the KV-heavy shape (issue: cache, attention, baselines).

(a) variable-length decode attention vs dense sdpa at equal lengths,
(b) decode ms/token at 10% budget vs the full cache,
(c) prefill + compress vs prefill alone for SnapKV and H2O,
(d) cache bytes / (kept tokens x bytes per token).

Each configuration runs in its own process (so peak RSS is per configuration) and its JSON
line is appended to results/bench_foundation.jsonl as soon as it is known; a rerun skips
configurations already measured.

    python benchmarks/bench_foundation.py [--context 8192] [--layers 4] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--shape", default="kv-heavy")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "bench_foundation.jsonl")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    if args.out.exists():
        for line in args.out.read_text().splitlines():
            try:
                done.add(json.loads(line)["key"])
            except (json.JSONDecodeError, KeyError):
                continue
    kvhive = [sys.executable, "-m", "kvhive.cli", "bench", "--json", "--device", args.device]
    configurations = {
        f"varlen-{args.context}": kvhive + ["--varlen", "--context", str(args.context)],
    }
    for method in ("snapkv", "h2o", "local", "streamingllm"):
        configurations[f"{args.shape}-{method}-0.1-{args.context}"] = kvhive + [
            "--shape",
            args.shape,
            "--method",
            method,
            "--budget",
            "0.1",
            "--context",
            str(args.context),
            "--num-layers",
            str(args.layers),
            "--decode-tokens",
            str(args.decode_tokens),
        ]
    for key, command in configurations.items():
        if key in done:
            continue
        completed = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
        if completed.returncode != 0:
            print(f"{key}: failed\n{completed.stderr[-2000:]}", file=sys.stderr)
            continue
        result = json.loads(completed.stdout)
        result["key"] = key
        with args.out.open("a") as handle:
            handle.write(json.dumps(result) + "\n")
        print(json.dumps(result))


if __name__ == "__main__":
    main()
