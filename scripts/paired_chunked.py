"""Chunked against one-shot prefill, paired per item: for every setting ``METHOD:prefill_chunk=N@B``
of an eval folder (and ``METHOD:prefill_chunk=N:prefill_question=true@B``, question-aware, a
setting of its own: method ``METHOD +question``) and its one-shot ``METHOD@B``, the mean over the items both scored of
(chunked - one-shot) on each of the task's metrics, with its standard error (and the full
cache's score on those items), per task and prompt
length (needle's ``length``, mdqa's ``num_documents``) and pooled over the lengths (``all``).

    python scripts/paired_chunked.py [--compact] results/chunked_prefill

Prints a markdown table (``--compact``: a column per method) (docs/METHODS.md, "Chunked prefill").
"""

from __future__ import annotations

import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from kvhive.evaluation.backend import FULL_BUDGET, FULL_METHOD, budget_key, split_cache_options
from kvhive.evaluation.results import read_results

LENGTH_KEYS = ("length", "num_documents")  # needle's haystack length, mdqa's document count


def length_group(record: dict) -> str:
    for key in LENGTH_KEYS:
        if key in (record.get("metadata") or {}):
            return f"{key}={record['metadata'][key]}"
    return "-"


def paired_rows(records: list[dict]) -> list[list[str]]:
    scored = {}
    for record in records:
        if record.get("status") == "ok":
            key = (record["task"], str(record["item_id"]), record["method"], budget_key(record["budget"]))
            scored[key] = record
    groups: dict[tuple, list[tuple[float, float, float, int]]] = defaultdict(list)
    for (task, item, method, budget), record in scored.items():
        base, options = split_cache_options(method)
        chunk = options.get("prefill_chunk")
        one_shot = scored.get((task, item, base, budget))
        if chunk is None or one_shot is None:
            continue
        if options.get("prefill_question"):
            base = f"{base} +question"  # its own column, never pooled with the plain chunked prefill
        full = scored.get((task, item, FULL_METHOD, budget_key(FULL_BUDGET)))
        for metric in record["metrics"]:
            pair = (
                record["metrics"][metric],
                one_shot["metrics"][metric],
                full["metrics"][metric] if full else float("nan"),
                record["prompt_tokens"],
            )
            for length in (length_group(record), "all"):  # per prompt length, and pooled over the lengths
                groups[(task, metric, length, base, budget, chunk)].append(pair)
    rows = []
    for (task, metric, length, base, budget, chunk), pairs in sorted(groups.items()):
        differences = [chunked - one_shot for chunked, one_shot, _, _ in pairs]
        n = len(differences)
        se = statistics.stdev(differences) / math.sqrt(n) if n > 1 else float("nan")
        rows.append(
            [
                task,
                metric,
                length,
                f"{statistics.mean(p[3] for p in pairs):.0f}",
                base,
                budget,
                str(chunk),
                str(n),
                f"{statistics.mean(p[2] for p in pairs):.3f}",
                f"{statistics.mean(p[1] for p in pairs):.3f}",
                f"{statistics.mean(p[0] for p in pairs):.3f}",
                f"{statistics.mean(differences):+.3f} ± {se:.3f}",
            ]
        )
    return rows


def compact_table(rows: list[list[str]]) -> str:
    """One line per (task, metric, length), a column per method: one-shot -> chunked (difference ± SE)."""
    methods = sorted({row[4] for row in rows})
    lines: dict[tuple, dict[str, str]] = {}
    for task, metric, length, tokens, method, _, _, n, full, one_shot, chunked, difference in rows:
        cells = lines.setdefault((task, metric, length, tokens, n, full), {})
        cells[method] = f"{one_shot} → {chunked} ({difference})"
    header = ["task", "metric", "length", "prompt tokens", "n", "full", *methods]
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key, cells in lines.items():
        out.append("| " + " | ".join([*key, *(cells.get(method, "–") for method in methods)]) + " |")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    compact = "--compact" in argv
    argv = [arg for arg in argv if arg != "--compact"]
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    if compact:
        print(compact_table(paired_rows(read_results(Path(argv[0])))))
        return 0
    header = [
        "task",
        "metric",
        "length",
        "prompt tokens",
        "method",
        "budget",
        "chunk",
        "n",
        "full",
        "one-shot",
        "chunked",
        "chunked − one-shot ± SE",
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in paired_rows(read_results(Path(argv[0]))):
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
