"""``write_report(out_dir)``: ``report.md`` + quality-vs-budget PNGs from ``results.jsonl``.

Per task: a table (one row per method x budget) with the task's aggregate metrics (main metric
first, ± standard error over items), the number of items, and the ratio of the main metric to
the full cache's; a warning when the full cache scores within ``margin`` of the task's chance
level (then method differences on that task say little); a plot of the main metric against the
budget, one line per method, the full cache as a horizontal dashed line. When the results come
from a claims run (``suite == "claims"``), a section lists each paper claim, what the paper says,
what was measured here, and the verdict.
"""

from __future__ import annotations

import math
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .backend import FULL_METHOD
from .results import ResultsSummary, read_results

REPORT_FILE = "report.md"
CHANCE_MARGIN = 0.05

# display order of methods (METHODS.md registry order); others follow alphabetically
METHOD_ORDER = (
    "full", "local", "random", "streamingllm", "h2o", "snapkv", "pyramidkv", "tova", "knorm", "buzz",
    "buzz-logn", "bumblebee", "bumblebee-power", "ada-snapkv", "ada-pyramidkv", "ada-ahakv", "subgen",
    "subgen-attention", "ahakv",
)


def _method_sort_key(method: str) -> tuple[int, str]:
    return (METHOD_ORDER.index(method), "") if method in METHOD_ORDER else (len(METHOD_ORDER), method)


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:.0f}"
        return f"{value:.{digits}f}"
    return str(value)


def _budget_label(budget: float | int) -> str:
    return f"{budget} tok" if isinstance(budget, int) else f"{budget:g}"


def _metric_names(aggregate: dict[str, float], main: str | None) -> list[str]:
    names = [k for k in aggregate if not k.endswith("_se") and k not in ("nll_sum", "n_tokens")]
    if main in names:
        names.remove(main)
        names.insert(0, main)
    return names


def _cell(aggregate: dict[str, float], name: str) -> str:
    value = aggregate.get(name)
    se = aggregate.get(f"{name}_se")
    if se is not None and not math.isnan(se):
        return f"{_fmt(value)} ± {_fmt(se)}"
    return _fmt(value)


def task_table(summary: ResultsSummary, task: str) -> str:
    """Markdown table of one task: rows = full cache, then method x budget."""
    main = summary.main_metric(task)
    full_value = summary.full(task)
    rows: list[tuple[str, str, dict[str, float], int, float | None]] = []
    if summary.count(task, FULL_METHOD):
        rows.append((FULL_METHOD, "(all)", summary.aggregate(task, FULL_METHOD), summary.count(task, FULL_METHOD),
                     summary.mean_kept_per_head(task, FULL_METHOD)))
    for method in sorted(summary.methods(task), key=_method_sort_key):
        if method == FULL_METHOD:
            continue
        for budget in summary.budgets(task, method):
            rows.append((method, _budget_label(budget), summary.aggregate(task, method, budget),
                         summary.count(task, method, budget), summary.mean_kept_per_head(task, method, budget)))
    # Shown when the backend reported it: what the cache really held, since a method may stay
    # below its nominal budget (BUZZ) and should be compared at what it used.
    show_kept = any(row[4] is not None for row in rows)
    names: list[str] = []
    for _, _, aggregate, _, _ in rows:
        for name in _metric_names(aggregate, main):
            if name not in names:
                names.append(name)
    header = ["method", "budget", *names, "n", f"{main} / full"] + (["mean kept / head"] if show_kept else [])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method, budget, aggregate, n, kept in rows:
        value = aggregate.get(main)
        ratio = value / full_value if value is not None and full_value not in (None, 0) else None
        ratio_text = f"{ratio:.2f}×" if ratio is not None and not math.isnan(ratio) else "–"
        cells = [method, budget, *(_cell(aggregate, k) for k in names), str(n), ratio_text]
        if show_kept:
            cells.append(_fmt(kept, 1) if kept is not None else "–")
        lines.append("| " + " | ".join(cells) + " |")
    infeasible = summary.infeasible_settings(task)
    if infeasible:
        lines.append("")
        lines.append("Could not run (budget below the method's minimum on these contexts; not counted above):")
        for method, budget, count, reason in infeasible:
            lines.append(f"- {method} @ {_budget_label(budget)}: {count} item(s) — {reason}")
    return "\n".join(lines)


def plot_task(summary: ResultsSummary, task: str, out_dir: Path) -> list[Path]:
    """Quality vs budget PNG(s) of one task: one for ratio budgets, one for token budgets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main = summary.main_metric(task)
    full_value = summary.full(task)
    methods = [m for m in sorted(summary.methods(task), key=_method_sort_key) if m != FULL_METHOD]
    paths: list[Path] = []
    for budget_type, label in ((float, "cache budget (fraction of the context)"), (int, "cache budget (tokens per head)")):
        series = []
        for method in methods:
            budgets = [b for b in summary.budgets(task, method) if isinstance(b, budget_type)]
            points = [(b, summary.value(task, method, b)) for b in budgets]
            points = [(b, v) for b, v in points if v is not None]
            if points:
                series.append((method, points))
        if not series:
            continue
        figure, axis = plt.subplots(figsize=(6.4, 4.2), dpi=110)
        for method, points in series:
            axis.plot([b for b, _ in points], [v for _, v in points], marker="o", label=method)
        if full_value is not None:
            axis.axhline(full_value, color="black", linestyle="--", linewidth=1.2, label="full cache")
        if budget_type is int:
            all_budgets = [b for _, pts in series for b, _ in pts]
            if max(all_budgets) / max(1, min(all_budgets)) >= 8:
                axis.set_xscale("log", base=2)
        axis.set_xlabel(label)
        axis.set_ylabel(main or "metric")
        axis.set_title(f"{task}: {main} vs cache budget" + (" (lower is better)" if not summary.task_info[task].get("higher_is_better", True) else ""))
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
        figure.tight_layout()
        suffix = "" if len([1 for t in (float, int) if _has_budget_type(summary, task, t)]) == 1 else ("_ratio" if budget_type is float else "_tokens")
        path = out_dir / f"quality_{_safe(task)}{suffix}.png"
        figure.savefig(path)
        plt.close(figure)
        paths.append(path)
    return paths


def _has_budget_type(summary: ResultsSummary, task: str, budget_type: type) -> bool:
    return any(isinstance(b, budget_type) for m in summary.methods(task) if m != FULL_METHOD for b in summary.budgets(task, m))


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def claims_section(summary: ResultsSummary) -> str:
    from .claims import CLAIMS, evaluate_claims

    verdict_text = {True: "holds", False: "does not hold", None: "not enough data"}
    lines = [
        "## Paper claims",
        "",
        "Each claim is checked on this run's results (the model, lengths and budgets differ from the papers'; "
        "see `kvhive/evaluation/claims.py`). *holds*: the paper's method beats the baseline(s) as stated; "
        "*not enough data*: settings missing or infeasible, a tie, a difference within two standard errors of the per-item paired difference, or the full cache scoring near chance on the task.",
        "",
        "| claim | paper | task | the paper says | measured here | verdict |",
        "|---|---|---|---|---|---|",
    ]
    counts = {v: 0 for v in verdict_text.values()}
    for claim, (holds, measured) in zip(CLAIMS, evaluate_claims(summary)):
        cells = [claim.id, claim.paper, claim.task, claim.paper_says, measured, f"**{verdict_text[holds]}**"]
        lines.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
        counts[verdict_text[holds]] += 1
    lines += ["", ", ".join(f"{v}: {n}" for v, n in counts.items())]
    return "\n".join(lines)


def write_report(out_dir: str | Path, margin: float = CHANCE_MARGIN, include_claims: bool | None = None) -> str:
    """Write ``out_dir/report.md`` and ``out_dir/quality_<task>.png``; return the markdown.

    ``include_claims``: None = when any record comes from a claims run (``suite == "claims"``).
    """
    out = Path(out_dir)
    records = read_results(out)
    summary = ResultsSummary(records)
    models = sorted({str(r.get("model")) for r in records})
    seeds = sorted({str(r.get("seed")) for r in records})
    suites = sorted({str(r.get("suite")) for r in records if r.get("suite")})
    lines = [
        "# kvhive evaluation report",
        "",
        f"- results: `{out / 'results.jsonl'}` ({len(records)} records)",
        f"- model: {', '.join(models) or '–'}; seed: {', '.join(seeds) or '–'}" + (f"; suite: {', '.join(suites)}" if suites else ""),
        f"- generated: {datetime.now(timezone.utc).isoformat(timespec='seconds')}",
        "- budgets: a decimal is a ratio of the context kept; `N tok` is N tokens per KV head per layer; "
        "`full` is the uncompressed cache. Cells: mean ± standard error over items.",
        "",
    ]
    if not records:
        lines.append("No results yet.")
    for task in summary.tasks():
        info = summary.task_info[task]
        direction = "higher is better" if info.get("higher_is_better", True) else "lower is better"
        chance = info.get("chance")
        lines += [
            f"## {task}",
            "",
            f"Kind: {info.get('kind')}; main metric: `{info.get('main_metric')}` ({direction}); chance level: {_fmt(chance)}.",
            "",
        ]
        near = summary.near_chance(task, margin)
        if near:
            lines += [
                f"> **Warning:** the full cache scores {_fmt(summary.full(task))}, no better than chance ({_fmt(chance)}) "
                f"+ {margin:g}: this model cannot do the task, so differences between methods here are not evidence.",
                "",
            ]
        elif summary.count(task, FULL_METHOD) == 0:
            lines += ["> No full-cache results for this task: ratios to full and the chance check are unavailable.", ""]
        lines += [task_table(summary, task), ""]
        for path in plot_task(summary, task, out):
            lines += [f"![{task}]({path.name})", ""]
    if include_claims is None:
        include_claims = any(r.get("suite") == "claims" for r in records)
    if include_claims:
        lines += [claims_section(summary), ""]
    text = "\n".join(lines)
    (out / REPORT_FILE).write_text(text, encoding="utf-8")
    return text


__all__ = ["write_report", "task_table", "plot_task", "claims_section"]
