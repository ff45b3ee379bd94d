"""Summarise a mutmut run over kvhive/methods/ (scripts/mutation.sh) as markdown: mutants per module
by status, and each surviving mutant with the function it lives in and its one-line change.

Reads mutmut's own result files (``mutants/**/*.meta``) and asks ``mutmut show`` for each survivor's
diff, so the numbers are mutmut's. Usage: ``python scripts/mutation_summary.py > results/mutation/summary.md``.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

# mutmut's exit-code meanings (mutmut.stats.status_by_exit_code, mutmut 3.8).
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", None: "not checked", 36: "timeout"}
COLUMNS = ("killed", "survived", "no tests", "timeout", "not checked", "other")


def load(root: Path) -> dict[str, dict[str, str]]:
    by_module: dict[str, dict[str, str]] = {}
    for meta in sorted(root.glob("kvhive/methods/*.py.meta")):
        codes = json.loads(meta.read_text()).get("exit_code_by_key", {})
        by_module[meta.name.removesuffix(".meta")] = {key: STATUS.get(code, "other") for key, code in codes.items()}
    return by_module


# Written reasons for survivors that are not paper elements, by the shape of the change.
REASONS = (
    ("device=", "equivalent on CPU: only the tensor's device changes"),
    ('"-INF"', 'equivalent: float("-INF") is float("-inf")'),
    ("XX", "message or key text only (a ValueError's wording, a statistics key)"),
    ("raise ValueError(None)", "message text only: the error is still raised"),
)
FUNCTION_REASONS = (
    ("describe", "`kvhive methods` listing text"),
    ("__repr__", "repr text"),
    ("_too_small", "error message wording (the error itself is tested)"),
    ("validate", "parameter validation; each bound is tested by test_invalid_parameters, see the mutant"),
)


def reason(name: str, change: str) -> str:
    for pattern, why in REASONS:
        if pattern in change:
            return why
    function = name.split("ǁ")[-1] if "ǁ" in name else name.split(".")[-1]
    for pattern, why in FUNCTION_REASONS:
        if pattern in function:
            return why
    return "to review"


def changed_line(name: str) -> str:
    """The mutant's changed line(s) from ``mutmut show`` (the + side of its diff)."""
    shown = subprocess.run([sys.executable, "-m", "mutmut", "show", name], capture_output=True, text=True).stdout
    added = [line[1:].strip() for line in shown.splitlines() if line.startswith("+") and not line.startswith("+++")]
    return " / ".join(added)[:160] or "(see mutmut show)"


def main() -> None:
    by_module = load(Path("mutants"))
    print("# Mutation testing of kvhive/methods/ (mutmut)\n")
    print("| module | mutants | " + " | ".join(COLUMNS) + " | kill rate of checked |")
    print("|---|---|" + "---|" * len(COLUMNS) + "---|")
    totals: collections.Counter[str] = collections.Counter()
    for module, statuses in by_module.items():
        counts = collections.Counter(statuses.values())
        totals.update(counts)
        checked = counts["killed"] + counts["survived"]
        rate = f"{counts['killed'] / checked:.0%}" if checked else "–"
        row = " | ".join(str(counts[c]) for c in COLUMNS)
        print(f"| {module} | {len(statuses)} | {row} | {rate} |")
    checked = totals["killed"] + totals["survived"]
    row = " | ".join(str(totals[c]) for c in COLUMNS)
    rate = f"{totals['killed'] / checked:.0%}" if checked else "–"
    print(f"| **all** | {sum(totals.values())} | {row} | {rate} |\n")
    print("## Surviving mutants\n")
    for module, statuses in by_module.items():
        survivors = sorted(name for name, status in statuses.items() if status == "survived")
        if not survivors:
            continue
        print(f"### {module} ({len(survivors)})\n")
        for name in survivors:
            change = changed_line(name)
            print(f"- `{name}`: `{change}` — {reason(name, change)}")
        print()


if __name__ == "__main__":
    main()
