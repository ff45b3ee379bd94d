"""Run one benchmark script against two kvhive checkouts, in interleaved rounds, and compare them.

Each round runs the script once per checkout, each in a fresh subprocess whose ``PYTHONPATH`` starts
with that checkout (so ``import kvhive`` imports it: an editable install of another checkout comes
later on ``sys.path``; the import is checked). The order alternates, A B, B A, A B, ..., so that a
load that rises or falls during the run falls on both checkouts alike. Arguments after ``--`` go to
the script unchanged.

Two kinds of script are understood:

* ``benchmarks/bench_decode_cpu.py`` (the default; timed): each run is given ``--json FILE`` and its
  per-method ``ms_per_step`` (CPU time of one decode step: the best of the run's own rounds'
  medians) is read back. Printed per method: the median over rounds of A's and of B's ms/step, the
  paired ratio B/A (the median of the per-round ratios, each from two runs next to each other) with
  the range of the per-round ratios, and the same ratio taken relative to SnapKV in the same run
  (``B/A vs snapkv``: it cancels a load that differs between the two runs of a round, but not a
  change of SnapKV's own step). ``OMP_NUM_THREADS`` defaults to 1, as the script's doc asks.
* any other script that prints a table whose lines are a name followed by numbers, under a header
  line naming the columns (``/work/shared/tools/decode_ops.py``: ops and syncs per method, or
  ops per added layer with ``--layers 2,8``): every round's table is read; printed per row and
  column: A, B and B - A (the medians over rounds; counts are deterministic, one round is enough).

    python benchmarks/paired_checkouts.py --a /work/baseline --b . --rounds 4
    python benchmarks/paired_checkouts.py --a /work/baseline --b . --rounds 3 -- --methods tova,h2o --steps 16
    python benchmarks/paired_checkouts.py --a /work/baseline --b . --rounds 1 \\
        --script /work/shared/tools/decode_ops.py -- --layers 2,8

The script file itself is the one given (``--script``, resolved from the current directory) for
both checkouts, so only kvhive differs; ``--script-per-checkout`` runs each checkout's own copy
instead (give the path relative to the checkouts' root). Standard library only; the interpreter is
``--python`` (default: this one).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_SCRIPT = HERE / "bench_decode_cpu.py"
NUMBER = r"-?\d+(?:\.\d+)?"
TABLE_ROW = re.compile(rf"^(?P<name>\S.*?)\s+(?P<numbers>{NUMBER}(?:\s+{NUMBER})*)\s*$")


def is_timed(script: Path) -> bool:
    return script.name == "bench_decode_cpu.py"


def run_once(checkout: Path, script: Path, passthrough: list[str], python: str) -> tuple[dict, float, str]:
    """One run of ``script`` with ``checkout``'s kvhive: (rows {name: {column: value}}, wall s, stdout)."""
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(p for p in (str(checkout), os.environ.get("PYTHONPATH", "")) if p)
    environment.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as scratch:
        command = [python, str(script), *passthrough]
        json_file = Path(scratch) / "lines.jsonl"
        if is_timed(script):
            command += ["--json", str(json_file)]
        start = time.perf_counter()
        # cwd: the checkout, as the scripts' docs run them from the project root.
        done = subprocess.run(command, env=environment, cwd=checkout, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if done.returncode:
            raise SystemExit(f"{' '.join(command)} in {checkout} failed ({done.returncode}):\n{done.stderr[-4000:]}")
        if is_timed(script):
            rows = {}
            for line in json_file.read_text().splitlines():
                record = json.loads(line)
                rows[record["method"]] = {"ms_per_step": record["ms_per_step"], "x_snapkv": record["x_snapkv"]}
        else:
            rows = parse_table(done.stdout)
    return rows, wall, done.stdout


def parse_table(text: str) -> dict:
    """``{row name: {column: value}}`` from a printed table: a header line of column names, then rows
    of a name and as many numbers as the header has columns after its first."""
    rows: dict = {}
    columns: list[str] | None = None
    for line in text.splitlines():
        match = TABLE_ROW.match(line)
        if match and columns is not None:
            numbers = [float(n) for n in match.group("numbers").split()]
            if len(numbers) == len(columns):
                rows[match.group("name").strip()] = dict(zip(columns, numbers, strict=True))
                continue
        words = line.split()
        if words and not match and not any(re.fullmatch(NUMBER, w) for w in words) and ":" not in line:
            columns = words[1:]  # a header: "method ops syncs ops/stock"
    return rows


def check_import(checkout: Path, python: str) -> str:
    """The kvhive file a subprocess with ``checkout`` first on PYTHONPATH imports; refuses another one."""
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([str(checkout), os.environ.get("PYTHONPATH", "")]))
    found = subprocess.run(
        [python, "-c", "import kvhive; print(kvhive.__file__)"],
        env=environment,
        cwd=tempfile.gettempdir(),
        capture_output=True,
        text=True,
    )
    path = Path(found.stdout.strip() or "?").resolve()
    if path.parent != (checkout / "kvhive").resolve():
        raise SystemExit(f"with PYTHONPATH={checkout}, kvhive comes from {path}: {found.stderr[-2000:]}")
    return str(path)


def commit_of(checkout: Path) -> str:
    commit = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    dirty = subprocess.run(
        ["git", "-C", str(checkout), "status", "--porcelain", "--untracked-files=no", "kvhive"],
        capture_output=True,
        text=True,
    )
    return commit.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def report_timed(rounds: list[dict], label_a: str, label_b: str) -> list[dict]:
    methods = [m for m in rounds[0]["a"] if all(m in r["a"] and m in r["b"] for r in rounds)]
    print(
        f"{'method':18s}{'A ms/step':>11s}{'B ms/step':>11s}{'B/A paired':>12s}  {'per-round B/A range':>20s}"
        f"{'B/A vs snapkv':>15s}"
    )
    lines = []
    for method in methods:
        a = [r["a"][method]["ms_per_step"] for r in rounds]
        b = [r["b"][method]["ms_per_step"] for r in rounds]
        ratios = [y / x for x, y in zip(a, b, strict=True)]
        relative = [
            (r["b"][method]["ms_per_step"] / r["b"]["snapkv"]["ms_per_step"])
            / (r["a"][method]["ms_per_step"] / r["a"]["snapkv"]["ms_per_step"])
            for r in rounds
            if "snapkv" in r["a"] and "snapkv" in r["b"]
        ]
        line = {
            "method": method,
            "a_ms": statistics.median(a),
            "b_ms": statistics.median(b),
            "b_over_a": statistics.median(ratios),
            "b_over_a_min": min(ratios),
            "b_over_a_max": max(ratios),
            "b_over_a_vs_snapkv": statistics.median(relative) if relative else None,
            "a_rounds_ms": a,
            "b_rounds_ms": b,
        }
        lines.append(line)
        vs_snapkv = f"{line['b_over_a_vs_snapkv']:.3f}" if relative else "-"
        print(
            f"{method:18s}{line['a_ms']:11.2f}{line['b_ms']:11.2f}{line['b_over_a']:12.3f}  "
            f"{line['b_over_a_min']:9.3f} - {line['b_over_a_max']:<8.3f}{vs_snapkv:>15s}"
        )
    ratios = [line["b_over_a"] for line in lines]
    geometric = statistics.geometric_mean(ratios) if ratios else float("nan")
    print(f"{'geometric mean':18s}{'':22s}{geometric:12.3f}")
    return lines


def report_table(rounds: list[dict]) -> list[dict]:
    names = [n for n in rounds[0]["a"] if all(n in r["a"] for r in rounds)]
    names += [n for n in rounds[0]["b"] if n not in names and all(n in r["b"] for r in rounds)]
    columns: list[str] = []
    for name in names:
        for column in {**rounds[0]["a"].get(name, {}), **rounds[0]["b"].get(name, {})}:
            if column not in columns:
                columns.append(column)
    print(f"{'':22s}" + "".join(f"{c + ' A':>12s}{c + ' B':>12s}{'B-A':>9s}" for c in columns))
    lines = []
    for name in names:
        cells, line = [], {"name": name}
        for column in columns:
            a = [r["a"][name][column] for r in rounds if column in r["a"].get(name, {})]
            b = [r["b"][name][column] for r in rounds if column in r["b"].get(name, {})]
            a_value = statistics.median(a) if a else None
            b_value = statistics.median(b) if b else None
            line[column] = {"a": a_value, "b": b_value}
            difference = f"{b_value - a_value:+9.4g}" if a and b else f"{'-':>9s}"
            cells.append(
                (f"{a_value:12.4g}" if a else f"{'-':>12s}") + (f"{b_value:12.4g}" if b else f"{'-':>12s}") + difference
            )
        lines.append(line)
        print(f"{name[:22]:22s}" + "".join(cells))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], usage="%(prog)s --a PATH --b PATH [options] [-- script arguments]"
    )
    parser.add_argument("--a", required=True, help="the first checkout (before)")
    parser.add_argument("--b", required=True, help="the second checkout (after)")
    parser.add_argument("--script", default=None, help="default: benchmarks/bench_decode_cpu.py (this checkout's)")
    parser.add_argument("--script-per-checkout", action="store_true", help="run each checkout's own copy of --script")
    parser.add_argument("--rounds", type=int, default=3, help="runs per checkout, interleaved")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--json", default=None, help="write the rounds and the comparison here")
    parser.add_argument("--show-output", action="store_true", help="print each run's own output")
    argv = sys.argv[1:]
    passthrough = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    checkouts = {"a": Path(args.a).resolve(), "b": Path(args.b).resolve()}
    if args.script_per_checkout:
        own = Path(args.script or DEFAULT_SCRIPT.relative_to(HERE.parent))
        if own.is_absolute():
            raise SystemExit("--script-per-checkout: give --script relative to the checkouts' root")
        scripts = {side: checkout / own for side, checkout in checkouts.items()}
    else:
        scripts = {side: Path(args.script or DEFAULT_SCRIPT).resolve() for side in checkouts}
    for side, script in scripts.items():
        if not script.exists():
            raise SystemExit(f"no script {script} for checkout {side}")
    labels = {side: f"{side.upper()} = {checkout} @ {commit_of(checkout)}" for side, checkout in checkouts.items()}
    imported = {side: check_import(checkout, args.python) for side, checkout in checkouts.items()}
    print(f"{labels['a']}\n{labels['b']}")
    print(f"script: {scripts['b'] if args.script_per_checkout else scripts['a']} {' '.join(passthrough)}")
    rounds = []
    started = time.perf_counter()
    for index in range(args.rounds):
        order = ("a", "b") if index % 2 == 0 else ("b", "a")
        record: dict = {"order": "".join(order)}
        for side in order:
            rows, wall, stdout = run_once(checkouts[side], scripts[side], passthrough, args.python)
            record[side], record[f"{side}_wall_s"] = rows, round(wall, 1)
            if args.show_output:
                print(f"--- round {index + 1}, {side.upper()}:\n{stdout}")
        print(
            f"round {index + 1}/{args.rounds} ({record['order'].upper()}): A {record['a_wall_s']} s, "
            f"B {record['b_wall_s']} s wall",
            flush=True,
        )
        rounds.append(record)
    print(f"{args.rounds} round(s) in {time.perf_counter() - started:.0f} s")
    timed = is_timed(scripts["a"])
    comparison = report_timed(rounds, labels["a"], labels["b"]) if timed else report_table(rounds)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "a": labels["a"],
                    "b": labels["b"],
                    "imported": imported,
                    "script": str(scripts["a"]),
                    "arguments": passthrough,
                    "rounds": rounds,
                    "comparison": comparison,
                },
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
