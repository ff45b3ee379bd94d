"""The evaluation grid in one process vs on Ray with 1, 2, ... workers; and the driver's write rate.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_ray.py --suite quick --limit 2 --workers 1,2 --json results/ray_scaling.json

For each run: wall time (Ray runs: starting the local instance and the first model load apart
from the grid itself), and whether every result equals the single-process one (generated text
and metrics exactly; log-likelihoods and perplexity within 1e-6 relative). Then the rate at which
the driver can append records with ``fsync`` (:class:`~kvhive.evaluation.results.ResultsWriter`),
the only work of the driver that does not spread over the workers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from kvhive.evaluation import read_results, run_eval
from kvhive.evaluation.cli import default_data_dir
from kvhive.evaluation.distributed import RayPool
from kvhive.evaluation.kvhive_backend import make_backend
from kvhive.evaluation.results import ResultsWriter, result_key
from kvhive.evaluation.suites import get_suite

TIMING_FIELDS = {"wall_s", "time"}


def differences(mine: list[dict], reference: dict) -> list[str]:
    """What differs between a run's records and the single-process ones (empty: equal)."""
    problems = []
    if {result_key(r) for r in mine} != set(reference):
        problems.append(f"different result keys: {len(mine)} vs {len(reference)}")
    for record in mine:
        theirs = reference.get(result_key(record))
        if theirs is None:
            continue
        for name in set(record) | set(theirs):
            if name in TIMING_FIELDS:
                continue
            a, b = record.get(name), theirs.get(name)
            if name in ("output", "metrics") and record["kind"] != "generate" and a is not None and b is not None:
                pairs = zip(a, b, strict=True) if name == "output" else ((a[k], b.get(k)) for k in a)
                same = all(
                    isinstance(x, (int, float))
                    and isinstance(y, (int, float))
                    and math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-6)
                    for x, y in pairs
                ) and (len(a) == len(b))
            else:
                same = a == b
            if not same:
                problems.append(f"{record['setting']} {record['task']}/{record['item_id']}: {name}")
    return problems


def write_rate(sample: dict, count: int, directory: Path) -> float:
    """Records per second that one ResultsWriter appends (one os.write + fsync each)."""
    out = directory / "write-rate"
    shutil.rmtree(out, ignore_errors=True)
    records = [{**sample, "item_id": f"bench{i}"} for i in range(count)]
    with ResultsWriter(out) as writer:
        start = time.perf_counter()
        for record in records:
            writer.append(record)
        elapsed = time.perf_counter() - start
    shutil.rmtree(out, ignore_errors=True)
    return count / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--suite", default="quick")
    parser.add_argument("--limit", type=int, default=None, help="items per task (default: the suite's)")
    parser.add_argument(
        "--workers", default="1,2", help="comma-separated worker counts, in run order (repeats allowed)"
    )
    parser.add_argument("--tasks", default=None, help="comma-separated task names: keep only these of the suite's")
    parser.add_argument(
        "--data-dir", type=Path, default=default_data_dir(), help="default $KVHIVE_DATA_DIR or <repo>/../shared/data"
    )
    parser.add_argument("--write-records", type=int, default=2000, help="records appended to measure the write rate")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = parser.parse_args()
    suite = get_suite(args.suite)
    limit = args.limit if args.limit is not None else suite.limit
    tasks = list(suite.tasks)
    if args.tasks:
        wanted = args.tasks.split(",")
        tasks = [t for t in tasks if t.split(":")[0] in wanted]
        if not tasks:
            raise SystemExit(f"--tasks: none of {wanted} is in suite {args.suite!r} ({list(suite.tasks)})")
    methods = {t.split(":")[0]: suite.methods for t in tasks} if not isinstance(suite.methods, dict) else suite.methods
    budgets = suite.budgets
    if isinstance(budgets, dict):
        budgets = {name: value for name, value in budgets.items() if name in {t.split(":")[0] for t in tasks}}
    grid = (tasks, methods, budgets, limit, args.data_dir)
    cores = os.cpu_count() or 1
    scratch = Path(tempfile.mkdtemp(prefix="bench_ray_"))
    rows = []

    torch.set_num_threads(cores)  # the single-process run gets every core, as `kvhive eval` does
    start = time.perf_counter()
    backend = make_backend(args.model)
    loaded = time.perf_counter()
    run = run_eval(backend, *grid, scratch / "single", progress=False, model_name=args.model, suite=args.suite)
    done = time.perf_counter()
    reference = {result_key(r): r for r in read_results(scratch / "single")}
    rows.append(
        {
            "run": "one process",
            "workers": 0,
            "startup_s": round(loaded - start, 2),
            "grid_s": round(done - loaded, 2),
            "wall_s": round(done - start, 2),
            "results": run.written,
            "equal_to_single_process": True,
        }
    )
    print(rows[-1], flush=True)
    del backend

    for number, workers in enumerate(int(w) for w in args.workers.split(",")):
        out = scratch / f"ray{number}-{workers}"
        start = time.perf_counter()
        with RayPool(make_backend, args.model, workers=workers) as pool:
            pool.tokenizer  # noqa: B018 - starts Ray and the first worker (model load)
            started = time.perf_counter()
            run = run_eval(pool, *grid, out, progress=False, model_name=args.model, suite=args.suite, executor=pool)
            done = time.perf_counter()
        problems = differences(read_results(out), reference)
        rows.append(
            {
                "run": f"ray, {workers} worker(s)",
                "workers": workers,
                "startup_s": round(started - start, 2),
                "grid_s": round(done - started, 2),
                "wall_s": round(done - start, 2),
                "results": run.written,
                "equal_to_single_process": not problems,
                "differences": problems[:10],
            }
        )
        print(rows[-1], flush=True)

    sample = next(iter(reference.values()))
    rate = write_rate(sample, args.write_records, scratch)
    record_bytes = len(json.dumps(sample)) + 1
    produced = max(r["results"] / r["grid_s"] for r in rows if r["grid_s"] > 0)
    summary = {
        "model": args.model,
        "suite": args.suite,
        "tasks": tasks,
        "limit": limit,
        "cores": cores,
        "load_average_at_end": os.getloadavg(),
        "machine": platform.platform(),
        "torch": torch.__version__,
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "runs": rows,
        "driver_write_rate_records_per_s": round(rate, 1),
        "record_bytes": record_bytes,
        "fastest_result_rate_per_s": round(produced, 2),
        "driver_busy_fraction_at_fastest": round(produced / rate, 5),
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
