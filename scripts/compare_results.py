"""Check that a rerun reproduces committed results: every (task, item, method, budget) of NEW that
OLD also holds must have the same item hash, output and metrics.

    kvhive eval --suite claims --model qwen2.5-0.5b --limit 1 --out /tmp/rerun
    python scripts/compare_results.py /tmp/rerun results/claims_qwen

Prints the counts and each difference; exits 1 when a result differs or is missing from OLD.
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvhive.evaluation.results import read_results, result_key


def keyed(out_dir: Path) -> dict[tuple, dict]:
    return {result_key(r): r for r in read_results(out_dir)}


def compare(new_dir: Path, old_dir: Path) -> tuple[int, list[str]]:
    new, old = keyed(new_dir), keyed(old_dir)
    same, problems = 0, []
    for key, record in sorted(new.items(), key=str):
        previous = old.get(key)
        if previous is None:
            problems.append(f"missing in {old_dir}: {key}")
            continue
        fields = [f for f in ("item_hash", "status", "output", "metrics") if record.get(f) != previous.get(f)]
        if fields:
            problems.append(
                f"differs in {', '.join(fields)}: {key}: {record.get('metrics')} vs {previous.get('metrics')}"
            )
        else:
            same += 1
    return same, problems


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    same, problems = compare(Path(argv[0]), Path(argv[1]))
    for line in problems:
        print(line)
    print(f"{same} identical, {len(problems)} different or missing")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
