"""Summarise results/buzz_remark2 (run.py): corpus perplexity of each setting over the windows all
its comparison's settings ran, the KV entries held (mean and peak over a window, averaged over
windows), and paired bootstrap intervals (kvhive.evaluation.statistics: items resampled, both
settings together, 5,000 resamples, seed 0) of the perplexity difference literal - budget reading:

* same C: both readings at budget C;
* equal memory (a): the literal reading at C against the budget reading at C', whose mean held
  entries over a window match the literal reading's at C;
* equal memory (b): the literal reading at C'' against the budget reading at C (matched the other way).

Writes summary.md (with reading.md below the tables) and summary.json beside it.

    PYTHONPATH=$PWD .venv/bin/python results/buzz_remark2/summary.py
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kvhive.evaluation import read_results
from kvhive.evaluation.statistics import item_matrix, paired_bootstrap, statistic_of

HERE = Path(__file__).parent
LITERAL = "buzz:prefill_fit=peak"
RUNS = {"c100": (100, 108, 95, 512), "c50": (50, 51, 49, 256)}  # C, C' (budget reading), C'' (literal), prompt


def _setting(method: str, budget: int) -> str:
    return f"{method}@{budget}"


def summarise(name: str, budget: int, matched: int, matched_literal: int, prompt: int) -> dict:
    records = [r for r in read_results(HERE / name) if r.get("status") == "ok"]
    settings = ["full@1.0", _setting("buzz", budget), _setting(LITERAL, budget), _setting("buzz", matched),
                _setting(LITERAL, matched_literal)]
    by_item: dict[str, dict[str, dict]] = {}
    for record in records:
        by_item.setdefault(record["item_id"], {})[record["setting"]] = record
    items = sorted(item for item, got in by_item.items() if all(s in got for s in settings))
    statistic = statistic_of("perplexity", "ppl")
    matrices = {s: item_matrix([by_item[i][s]["metrics"] for i in items], statistic) for s in settings}
    rows = {}
    for setting in settings:
        cache = [by_item[i][setting].get("cache", {}) for i in items]
        means = matrices[setting].mean(axis=0)
        rows[setting] = {
            "ppl": float(np.exp(means[0] / means[1])),
            "kv_entries_mean": float(np.mean([c.get("kv_entries_mean", np.nan) for c in cache])),
            "kv_entries_peak": float(np.mean([c.get("kv_entries_peak", np.nan) for c in cache])),
            "mean_kept_per_head": float(np.mean([c.get("mean_kept_per_head", np.nan) for c in cache])),
            "peak_kept_per_head": float(np.mean([c.get("peak_kept_per_head", np.nan) for c in cache])),
        }
    comparisons = {
        "same C": (_setting(LITERAL, budget), _setting("buzz", budget)),
        "equal memory (a)": (_setting(LITERAL, budget), _setting("buzz", matched)),
        "equal memory (b)": (_setting(LITERAL, matched_literal), _setting("buzz", budget)),
    }
    contrasts = {}
    for label, (candidate, baseline) in comparisons.items():
        boot = paired_bootstrap(matrices[candidate][None], matrices[baseline][None], statistic)
        low, high = (float(q) for q in np.quantile(boot.resampled, [0.025, 0.975]))
        wins = sum(
            by_item[i][candidate]["metrics"]["nll_sum"] < by_item[i][baseline]["metrics"]["nll_sum"] for i in items
        )
        contrasts[label] = {
            "candidate": candidate,
            "baseline": baseline,
            "difference": boot.estimate,
            "standard_error": boot.standard_error,
            "interval_95": [low, high],
            "candidate_lower_nll_items": wins,
            "memory_ratio": rows[candidate]["kv_entries_mean"] / rows[baseline]["kv_entries_mean"],
        }
    return {"budget": budget, "prompt_tokens": prompt, "continuation_tokens": 128, "items": len(items),
            "settings": rows, "contrasts": contrasts}


def main() -> None:
    config = json.loads((HERE / "c100" / "run_config.json").read_text())
    summary = {name: summarise(name, *spec) for name, spec in RUNS.items() if (HERE / name / "results.jsonl").exists()}
    summary["commit"] = config.get("kvhive_commit") or config.get("environment", {}).get("kvhive_commit")
    (HERE / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    lines = [
        "# BUZZ Remark 2 in the mean form: thin the prefill to the budget C or to T + k + w (issue 26)",
        "",
        "Written by `summary.py` from `c100/` and `c50/` (`run.py`): Gemma-3-270M, fp32, CPU, one thread;",
        "WikiText-2 test windows, a prompt of P tokens (BOS included) prefilled in one forward, then 128",
        "tokens teacher-forced one at a time; every layer compressed (the sliding ones too, as the",
        "streaming task does below Gemma's 512-token window). `buzz` = `prefill_fit=\"budget\"` (default),",
        f"`{LITERAL}` = the paper's literal container. Perplexity is corpus perplexity over the windows",
        "every setting of the table ran; KV entries are per window (mean and peak over the prompt's",
        "compressed state and each continuation step), averaged over windows.",
        "",
    ]
    for name, result in summary.items():
        if name == "commit":
            continue
        lines += [f"## C = {result['budget']}, P = {result['prompt_tokens']}, n = {result['items']} windows", "",
                  "| setting | perplexity | KV entries mean | KV entries peak | kept/head mean | kept/head peak |",
                  "|---|---|---|---|---|---|"]
        for setting, row in result["settings"].items():
            lines.append(f"| {setting} | {row['ppl']:.3f} | {row['kv_entries_mean']:.1f} | {row['kv_entries_peak']:.0f} "
                         f"| {row['mean_kept_per_head']:.2f} | {row['peak_kept_per_head']:.1f} |")
        lines += ["", "Paired differences, literal - budget reading (perplexity; 95% percentile bootstrap interval):", "",
                  "| comparison | literal | budget reading | difference | s.e. | 95% interval | memory ratio | windows literal lower |",
                  "|---|---|---|---|---|---|---|---|"]
        for label, c in result["contrasts"].items():
            lines.append(
                f"| {label} | {c['candidate']} | {c['baseline']} | {c['difference']:+.3f} | {c['standard_error']:.3f} | "
                f"[{c['interval_95'][0]:+.3f}, {c['interval_95'][1]:+.3f}] | {c['memory_ratio']:.3f} | "
                f"{c['candidate_lower_nll_items']}/{result['items']} |"
            )
        lines.append("")
    reading = HERE / "reading.md"  # the hand-written reading of these numbers, kept below them
    if reading.exists():
        lines.append(reading.read_text())
    (HERE / "summary.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
