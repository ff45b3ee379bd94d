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

import itertools
import json
import math
import re
import warnings
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kvhive.methods.registry import method_names

from .backend import DEFAULT_DTYPE, FULL_METHOD
from .bytes_plot import quality_by_bytes_figure
from .environment import kvhive_commit, package_versions, versions_text
from .memory import held_memory
from .memory_plot import held_memory_figure
from .metrics import aggregate_item_metrics
from .results import TRANSIENT_STATUS, ResultsLineSkipped, ResultsSummary, read_results, scan_results

REPORT_FILE = "report.md"
RERUN_HINT = " (rerun the same `kvhive eval` command to retry them)"
CHANCE_MARGIN = 0.05

# display order of methods: the registry's order; others (ada-<scorer> combinations) follow alphabetically
METHOD_ORDER = tuple(method_names())


def _method_sort_key(method: str) -> tuple[int, str]:
    return (METHOD_ORDER.index(method), "") if method in METHOD_ORDER else (len(METHOD_ORDER), method)


# What can start markup mid-line; an underscore inside a word (synthetic_recall) cannot in
# GitHub markdown, so it stays as written.
_MARKDOWN_SPECIAL = re.compile(r"([\\`*\[\]|~]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9]))")


def md_text(text: Any) -> str:
    """``text`` (a method, task or model name, a reason: read from results.jsonl, so anything)
    as inert markdown inside a table cell or a heading: HTML escaped, markdown punctuation and
    pipes backslash-escaped, line breaks made spaces."""
    text = " ".join(str(text).splitlines())
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _MARKDOWN_SPECIAL.sub(r"\\\1", text)


def md_code(text: Any) -> str:
    """``text`` as inline code when it is a plain identifier (a metric name), else :func:`md_text`
    (a code span cannot be escaped from inside)."""
    text = str(text)
    return f"`{text}`" if re.fullmatch(r"[A-Za-z0-9_.@:=+-]+", text) else md_text(text)


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


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def non_finite_items(records: list[dict], name: str) -> list[str]:
    """Item ids whose per-item ``name`` is NaN or infinite (one such item makes the mean NaN)."""
    return [
        str(r["item_id"])
        for r in records
        if name in r.get("metrics", {}) and r["metrics"][name] is not None and not _finite(r["metrics"][name])
    ]


def paired_ratio_to_full(
    summary: ResultsSummary, task: str, method: str, budget: float | int | None
) -> tuple[float | None, int]:
    """(main metric of the setting ÷ the full cache's, number of items) on the items both ran.

    Computed on the shared items only, so a setting run with a smaller ``--limit`` is not compared
    with the full cache's mean over other items."""
    main = summary.main_metric(task)
    mine = {str(r["item_id"]): r for r in summary.item_records(task, method, budget)}
    full = {str(r["item_id"]): r for r in summary.item_records(task, FULL_METHOD)}
    shared = sorted(mine.keys() & full.keys())
    if not shared or main is None:
        return None, len(shared)
    kind = summary.task_info[task].get("kind", "generate")
    value = aggregate_item_metrics(kind, [mine[i]["metrics"] for i in shared]).get(main)
    reference = aggregate_item_metrics(kind, [full[i]["metrics"] for i in shared]).get(main)
    if not _finite(value) or not _finite(reference) or reference == 0:
        return None, len(shared)
    return value / reference, len(shared)


def task_table(summary: ResultsSummary, task: str) -> str:
    """Markdown table of one task: rows = full cache, then method x budget.

    The ratio to full is paired (computed on the items both the row and the full cache ran, their
    number in the next column). A metric that is NaN or infinite on some items is not averaged:
    the cell names the count and a warning below the table lists the items."""
    main = summary.main_metric(task)
    rows: list[tuple[str, str, float | int | None, dict[str, float], int, float | None]] = []
    if summary.count(task, FULL_METHOD):
        rows.append(
            (
                FULL_METHOD,
                "(all)",
                None,
                summary.aggregate(task, FULL_METHOD),
                summary.count(task, FULL_METHOD),
                summary.mean_kept_per_head(task, FULL_METHOD),
            )
        )
    for method in sorted(summary.methods(task), key=_method_sort_key):
        if method == FULL_METHOD:
            continue
        for budget in summary.budgets(task, method):
            rows.append(
                (
                    method,
                    _budget_label(budget),
                    budget,
                    summary.aggregate(task, method, budget),
                    summary.count(task, method, budget),
                    summary.mean_kept_per_head(task, method, budget),
                )
            )
    # Shown when the backend reported it: what the cache really held, since a method may stay
    # below its nominal budget (BUZZ) and should be compared at what it used.
    show_kept = any(row[5] is not None for row in rows)
    memories = [held_memory(summary, task, method, budget) for method, _, budget, _, _, _ in rows]
    show_memory = any(memory is not None for memory in memories)
    # Every layer, sliding-window ones included: what the budget saves of the whole cache.
    show_whole = any(memory is not None and "held_fraction_mean" in memory for memory in memories)
    names: list[str] = []
    for _, _, _, aggregate, _, _ in rows:
        for name in _metric_names(aggregate, main):
            if name not in names:
                names.append(name)
    has_full = summary.count(task, FULL_METHOD) > 0
    problems = {setting: summary.cell_problems(task, *setting) for setting in summary.settings_with_records(task)}
    show_problems = any(problems.get((method, budget)) for method, _, budget, *_ in rows)
    header = (
        ["method", "budget", *map(md_text, names), "n", f"{md_text(main)} / full", "n paired with full"]
        + (["mean kept / head"] if show_kept else [])
        + (["stored heads × layers", "KV entries held mean / peak", "KV MiB mean / peak"] if show_memory else [])
        + (["whole cache MiB mean / peak", "whole cache / full mean / peak"] if show_whole else [])
        + (["items not scored"] if show_problems else [])
    )
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    warnings_lines: list[str] = []
    unpaired = False
    for (method, budget_text, budget, aggregate, n, kept), memory in zip(rows, memories, strict=True):
        records = summary.item_records(task, method, budget)
        cells = [md_text(method), budget_text]
        for name in names:
            bad = non_finite_items(records, name)
            if bad:
                cells.append(f"– ({len(bad)} of {n} items non-finite)")
                shown = ", ".join(bad[:5]) + (", …" if len(bad) > 5 else "")
                warnings_lines.append(
                    f"> **Warning:** {md_text(method)} @ {budget_text}: {md_code(name)} is NaN or infinite on "
                    f"{len(bad)} of {n} item(s) ({md_text(shown)}); no mean is shown for it."
                )
            else:
                cells.append(_cell(aggregate, name))
        ratio, paired_n = paired_ratio_to_full(summary, task, method, budget) if has_full else (None, 0)
        if has_full and (paired_n != n or paired_n != summary.count(task, FULL_METHOD)):
            unpaired = True
        cells += [str(n), f"{ratio:.2f}×" if ratio is not None else "–", str(paired_n) if has_full else "–"]
        if show_kept:
            cells.append(f"{kept:.1f}" if kept is not None else "–")
        if show_memory:
            cells += _memory_cells(memory)
        if show_whole:
            cells += _whole_cache_cells(memory)
        if show_problems:
            cell_problems = problems.get((method, budget), [])
            cells.append(", ".join(f"{count} {status}" for status, count, _ in cell_problems) or "–")
        lines.append("| " + " | ".join(cells) + " |")
    if unpaired:
        lines += [
            "",
            (
                f"Some settings ran on other items than the full cache: `{main} / full` is computed on the items "
                "both ran (`n paired with full`), so it can differ from the ratio of the two means shown."
            ),
        ]
    if warnings_lines:
        lines += ["", *warnings_lines]
    if any(problems.values()):
        lines += ["", "Items without a score in a setting (not counted in its n and mean):"]
        for (method, budget), cell_problems in problems.items():
            label = "(all)" if budget is None else _budget_label(budget)
            for status, count, reason in cell_problems:
                lines.append(
                    f"- {md_text(method)} @ {label}: {count} item(s) {status}"
                    f"{RERUN_HINT if status == TRANSIENT_STATUS else ''} — {md_text(reason)}"
                )
    infeasible = summary.infeasible_settings(task)
    if infeasible:
        lines.append("")
        lines.append("Could not run (budget below the method's minimum on these contexts; not counted above):")
        for method, budget, count, reason in infeasible:
            lines.append(f"- {md_text(method)} @ {_budget_label(budget)}: {count} item(s) — {md_text(reason)}")
    not_applicable = summary.unscored_settings(task, "not_applicable")
    if not_applicable:
        lines += ["", "Not applicable (the method cannot keep its budget in this task's phase; not counted above):"]
        for method, budget, _, count, reason in not_applicable:
            lines.append(f"- {md_text(method)} @ {_budget_label(budget)}: {count} item(s) — {md_text(reason)}")
    return "\n".join(lines)


def truncation_note(records: list[dict], task: str) -> str:
    """How many of ``task``'s items had their prompt cut to fit the model's context, and what was
    cut (each record carries ``metadata.truncated_from_tokens``), or ``""``."""
    items = {str(r["item_id"]) for r in records if r["task"] == task}
    cut: dict[str, dict] = {}
    for record in records:
        metadata = record.get("metadata") or {}
        if record["task"] == task and isinstance(metadata, dict) and metadata.get("truncated_from_tokens"):
            cut.setdefault(str(record["item_id"]), metadata)
    if not cut:
        return ""
    longest = max(int(m["truncated_from_tokens"]) for m in cut.values())
    what = sorted({str(m.get("truncated") or "the middle of the prompt") for m in cut.values()})
    return (
        f"> **Note:** {len(cut)} of {len(items)} item(s) had a prompt longer than the model's context "
        f"(up to {longest} tokens) and were cut to fit: {md_text('; '.join(what))}."
    )


def _memory_cells(memory: dict | None) -> list[str]:
    if memory is None:
        return ["–", "not recorded", "–"]
    heads = "/".join(str(h) for h in memory["stored_heads"]) or "?"
    layers = "/".join(str(n) for n in memory["layers_counted"]) or "?"
    return [
        f"{heads} × {layers}",
        f"{memory['kv_entries_mean']:,.0f} / {memory['kv_entries_peak']:,.0f}",
        f"{memory['kv_bytes_mean'] / 2**20:.2f} / {memory['kv_bytes_peak'] / 2**20:.2f}",
    ]


def _whole_cache_cells(memory: dict | None) -> list[str]:
    if memory is None or "held_fraction_mean" not in memory:
        return ["–", "not recorded"]
    peak = memory["held_fraction_max"]
    return [
        f"{memory['cache_bytes_mean'] / 2**20:.2f} / {memory['cache_bytes_peak'] / 2**20:.2f}",
        f"{memory['held_fraction_mean']:.3f} / {peak:.3f}" + (" **above full**" if peak > 1.0 else ""),
    ]


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*", "h", "p")
DODGE_SPREAD = 0.5  # the series at one budget spread over this fraction of the gap to the next budget


def _dodged(budgets: list[float], index: int, count: int, log_axis: bool) -> list[float]:
    """x positions of series ``index`` of ``count``: a small horizontal offset per series, so that
    methods with equal scores are drawn side by side instead of on top of each other. Offsets are
    in log2 units on a log axis, else a fraction of the smallest gap between budgets."""
    if count == 1:
        return list(budgets)
    centred = index - (count - 1) / 2
    if log_axis:
        return [b * 2 ** (centred * DODGE_SPREAD / count) for b in budgets]
    distinct = sorted(set(budgets))
    gaps = [high - low for low, high in itertools.pairwise(distinct)]
    gap = min(gaps) if gaps else max(0.1 * abs(distinct[0]), 0.05)
    return [b + centred * gap * DODGE_SPREAD / count for b in budgets]


def quality_figures(summary: ResultsSummary, task: str):
    """``[(budget type, figure)]``: the main metric against the budget, one figure for ratio
    budgets and one for token budgets.

    Every method is visible: its own marker, a small horizontal dodge, error bars of one standard
    error over items (n per series in the legend); the full cache is a dashed line with its
    standard error as a band, the task's chance level a dotted line; a metric bounded by 1
    (accuracy, exact match, ROUGE) is drawn on a 0-1 axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main = summary.main_metric(task)
    info = summary.task_info[task]
    higher_is_better = info.get("higher_is_better", True)
    full_value = summary.full(task)
    full_se = summary.aggregate(task, FULL_METHOD).get(f"{main}_se") if summary.count(task, FULL_METHOD) else None
    chance = info.get("chance")
    methods = [m for m in sorted(summary.methods(task), key=_method_sort_key) if m != FULL_METHOD]
    figures = []
    for budget_type, label in (
        (float, "cache budget (fraction of the context)"),
        (int, "cache budget (tokens per head)"),
    ):
        series = []
        for method in methods:
            points = []
            for budget in summary.budgets(task, method):
                value = summary.value(task, method, budget) if isinstance(budget, budget_type) else None
                if value is None:
                    continue
                se = summary.aggregate(task, method, budget).get(f"{main}_se")
                points.append((budget, value, se if _finite(se) else 0.0, summary.count(task, method, budget)))
            if points:
                series.append((method, points))
        if not series:
            continue
        all_budgets = [p[0] for _, points in series for p in points]
        log_axis = budget_type is int and max(all_budgets) / max(1, min(all_budgets)) >= 8
        values = [p[1] for _, points in series for p in points] + ([full_value] if full_value is not None else [])
        bounded = higher_is_better and all(0.0 <= v <= 1.0 for v in values) and (chance is None or 0 <= chance <= 1)
        figure, axis = plt.subplots(figsize=(7.2, 4.6), dpi=110)
        for index, (method, points) in enumerate(series):
            xs = _dodged([float(p[0]) for p in points], index, len(series), log_axis)
            counts = sorted({p[3] for p in points})
            n_text = f"n={counts[0]}" if len(counts) == 1 else f"n={counts[0]}-{counts[-1]}"
            axis.errorbar(
                xs,
                [p[1] for p in points],
                yerr=[p[2] for p in points],
                marker=MARKERS[index % len(MARKERS)],
                markersize=6,
                linewidth=1.2,
                capsize=3,
                label=f"{method} ({n_text})",
                gid=f"series:{method}",
            )
        if full_value is not None:
            n_full = summary.count(task, FULL_METHOD)
            axis.axhline(full_value, color="black", linestyle="--", linewidth=1.2, label=f"full cache (n={n_full})")
            if _finite(full_se) and full_se > 0:
                axis.axhspan(full_value - full_se, full_value + full_se, color="black", alpha=0.08, linewidth=0)
        if chance is not None and bounded:
            axis.axhline(chance, color="grey", linestyle=":", linewidth=1.5, label=f"chance ({chance:.2f})")
        if log_axis:
            axis.set_xscale("log", base=2)
        distinct = sorted(set(all_budgets))
        axis.set_xticks(distinct)
        axis.set_xticklabels([_budget_label(b) for b in distinct])
        axis.minorticks_off()
        if len(distinct) == 1:  # one budget: room for the dodged series around it
            width = max(0.1 * float(distinct[0]), 0.05) if not log_axis else float(distinct[0]) * 0.5
            axis.set_xlim(float(distinct[0]) - width, float(distinct[0]) + width)
        if bounded:
            axis.set_ylim(-0.03, 1.03)
        elif min(values) >= 0 and max(values) / max(min(values), 1e-12) < 10:
            axis.set_ylim(bottom=0)
        elif min(values) > 0:
            axis.set_yscale("log")
        axis.set_xlabel(label + ("; methods dodged sideways" if len(series) > 1 else ""))
        axis.set_ylabel(
            f"{main or 'metric'} (mean ± s.e. over items)" if info.get("kind") != "perplexity" else f"{main} (corpus)"
        )
        axis.set_title(f"{task}: {main} vs cache budget" + ("" if higher_is_better else " (lower is better)"))
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
        figure.tight_layout()
        figures.append((budget_type, figure))
    return figures


def plot_task(summary: ResultsSummary, task: str, out_dir: Path) -> list[Path]:
    """Quality vs budget PNG(s) of one task (see :func:`quality_figures`), and quality vs the memory
    the whole cache held where the results recorded it (:func:`held_memory_figure`, ``_held``)."""
    import matplotlib.pyplot as plt

    figures = quality_figures(summary, task)
    named = [("" if len(figures) == 1 else ("_ratio" if kind is float else "_tokens"), f) for kind, f in figures]
    held = held_memory_figure(summary, task)
    if held is not None:
        named.append(("_held", held))
    paths: list[Path] = []
    for suffix, figure in named:
        path = out_dir / f"quality_{_safe(task)}{suffix}.png"
        figure.savefig(path)
        plt.close(figure)
        paths.append(path)
    by_bytes = quality_by_bytes_figure(summary, task)  # settings stored quantized: quality per byte
    if by_bytes is not None:
        path = out_dir / f"quality_{_safe(task)}_bytes.png"
        by_bytes.savefig(path)
        plt.close(by_bytes)
        paths.append(path)
    return paths


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


VERDICT_TEXT = {True: "holds", False: "does not hold", None: "not decided"}


def _table_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |"


def _verdict_counts(results) -> str:
    counts = {text: 0 for text in VERDICT_TEXT.values()}
    for holds, _ in results:
        counts[VERDICT_TEXT[holds]] += 1
    return ", ".join(f"{text}: {n}" for text, n in counts.items())


NOISE_CHECK_TEXT = (
    "Every verdict rests on intervals: each comparison is the paired bootstrap over items (items resampled "
    "with both settings together, 5,000 resamples, seed 0, so a re-rendered report gives the same numbers) of the "
    "candidate's statistic minus the baseline's — a corpus statistic (perplexity, BUZZ's geometric-mean ROUGE) is "
    "recomputed on each resample — and the comparisons a claim rests on (each baseline × each budget it names, or "
    "each baseline on the mean over its budgets; the family is named in the cell) are corrected together by Holm's "
    "step-down (family error rate 0.05). *holds*: every corrected interval lies on the paper's side of 0; *does not "
    "hold*: one lies on the other side; *not decided*: an interval includes 0, data are missing or infeasible, or "
    "the full cache scores near chance on the task. A claim that the method keeps a fraction of the full cache uses "
    "the paired bootstrap of the ratio of the two statistics, its 95% interval against that fraction. *held KV "
    "entries mean/peak*: the keys and values the cache held in the layers the budget applies to, mean and peak over "
    "an item, averaged over the items (stored heads counted: Ada-KV on a one-KV-head model stores one copy per "
    "query head, labelled *×N memory*). *whole cache / full*: the bytes every layer held (sliding-window layers "
    "included), as a fraction of the full cache's at the same tokens, mean and peak over an item (the peak column: "
    "the largest of any item)."
)
SAMPLE_SIZE_TEXT = (
    "*paper's gap … needs n≈N*: the candidate's advantage the paper reports over that baseline, as a fraction of "
    "the baseline's score measured here, and the items a true gap of that size would need to exceed two paired "
    "standard errors, given the per-item spread of this run's items (n = (2 sd / gap)^2)."
)


def _verdict_cell(claim, holds, models: Sequence[str]) -> str:
    from .claims import model_size_note

    return f"**{VERDICT_TEXT[holds]}** ({model_size_note(claim, models)})"


def claims_section(summary: ResultsSummary) -> str:
    from .claims import CLAIMS, evaluate_claims

    models = sorted({str(r.get("model")) for r in summary.records})
    lines = [
        "## Paper claims",
        "",
        "Each claim is checked on this run's results (the model, lengths and budgets differ from the papers'; "
        "see `kvhive/evaluation/claims.py`).",
        "",
        NOISE_CHECK_TEXT,
        "",
        SAMPLE_SIZE_TEXT,
        "",
        "| claim | paper | task | the paper says | measured here | verdict |",
        "|---|---|---|---|---|---|",
    ]
    results = evaluate_claims(summary)
    for claim, (holds, measured) in zip(CLAIMS, results, strict=True):
        lines.append(
            _table_row(
                [claim.id, claim.paper, claim.task, claim.paper_says, measured, _verdict_cell(claim, holds, models)]
            )
        )
    lines += ["", _verdict_counts(results)]
    return "\n".join(lines)


def _dtypes(records: list[dict]) -> list[str]:
    """The dtypes of a run's records (records written before the field existed are float32)."""
    return sorted({str(r.get("dtype", DEFAULT_DTYPE)) for r in records})


def run_provenance(out_dir: str | Path) -> str:
    """The kvhive commit and package versions a run recorded in its ``run_config.json``."""
    path = Path(out_dir) / "run_config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    if "kvhive_commit" not in config:
        return "kvhive commit and package versions of the run: not recorded (runs before issue 26)"
    return f"run at kvhive commit {config['kvhive_commit']} with {versions_text(config.get('versions', {}))}"


def _model_text(models: Sequence[str]) -> str:
    from .claims import MODEL_BILLIONS

    return ", ".join(
        f"{m} ({MODEL_BILLIONS[m]:g}B parameters)" if m in MODEL_BILLIONS else f"{m} (size unknown)" for m in models
    )


def _items_text(summary: ResultsSummary) -> str:
    """Items per task: the most any setting of the task was scored on."""
    counts = []
    for task in summary.tasks():
        settings = [(m, b) for m in summary.methods(task) for b in summary.budgets(task, m)]
        # A task whose items all went unscored (e.g. every prompt too long) has no scored setting.
        scored = max((summary.count(task, m, b) for m, b in settings), default=0)
        counts.append(f"{md_text(task)} {scored}")
    return ", ".join(counts) or "–"


def claims_comparison(out_dirs: Sequence[str | Path]) -> str:
    """The paper claims side by side over several runs (one column per run: what was measured
    and the verdict), e.g. the same claims suite on two models."""
    from .claims import CLAIMS, evaluate_claims

    if len(out_dirs) < 2:
        raise ValueError(f"claims_comparison needs at least 2 runs, got {len(out_dirs)}")
    columns = []
    for out_dir in out_dirs:
        records = read_results(out_dir)
        if not records:
            raise ValueError(f"no results in {out_dir}")
        models = sorted({str(r.get("model")) for r in records})
        label = f"{', '.join(models)} ({', '.join(_dtypes(records))})"
        columns.append((label, evaluate_claims(ResultsSummary(records)), models))
    lines = [
        "## Paper claims across runs",
        "",
        "Each run's results checked by the same claims (`kvhive/evaluation/claims.py`): "
        + "; ".join(
            f"**{label}**: `{Path(d) / 'results.jsonl'}` ({run_provenance(d)})"
            for (label, _, _), d in zip(columns, out_dirs, strict=True)
        )
        + ".",
        "",
        NOISE_CHECK_TEXT,
        "",
        "| claim | paper | the paper says | " + " | ".join(label for label, _, _ in columns) + " |",
        "|---|---|---|" + "---|" * len(columns),
    ]
    for index, claim in enumerate(CLAIMS):
        cells = [claim.id, claim.paper, claim.paper_says]
        for _, results, models in columns:
            holds, measured = results[index]
            cells.append(f"{_verdict_cell(claim, holds, models)}: {measured}")
        lines.append(_table_row(cells))
    for label, results, _ in columns:
        lines += ["", f"{label}: {_verdict_counts(results)}"]
    return "\n".join(lines)


def write_report(
    out_dir: str | Path,
    margin: float = CHANCE_MARGIN,
    include_claims: bool | None = None,
    compare: Sequence[str | Path] = (),
) -> str:
    """Write ``out_dir/report.md`` and ``out_dir/quality_<task>.png``; return the markdown.

    ``include_claims``: None = when any record comes from a claims run (``suite == "claims"``).
    ``compare``: other runs' output folders; the claims are then also given side by side
    (:func:`claims_comparison`), this run first.
    """
    out = Path(out_dir)
    records, skipped = scan_results(out)
    for line in skipped:
        warnings.warn(f"{line}: skipped", ResultsLineSkipped, stacklevel=2)
    summary = ResultsSummary(records)
    models = sorted({str(r.get("model")) for r in records})
    seeds = sorted({str(r.get("seed")) for r in records})
    dtypes = _dtypes(records) or ["–"]
    suites = sorted({str(r.get("suite")) for r in records if r.get("suite")})
    lines = [
        "# kvhive evaluation report",
        "",
        f"- results: `{out / 'results.jsonl'}` ({len(records)} records)",
        *(f"- skipped line {line.number} of `results.jsonl`: {md_text(line.reason)}" for line in skipped),
        f"- model: {_model_text(models) or '–'}; dtype: {md_text(', '.join(dtypes))}; "
        f"seed: {md_text(', '.join(seeds)) or '–'}" + (f"; suite: {md_text(', '.join(suites))}" if suites else ""),
        f"- items per task: {_items_text(summary)}",
        f"- {run_provenance(out)}",
        f"- rendered at kvhive commit {kvhive_commit()} with {versions_text(package_versions())}",
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
            f"## {md_text(task)}",
            "",
            f"Kind: {md_text(info.get('kind'))}; main metric: {md_code(info.get('main_metric'))} ({direction}); "
            f"chance level: {_fmt(chance) if isinstance(chance, (int, float)) else md_text(chance)}.",
            "",
        ]
        if any(
            "rouge_mean" in summary.aggregate(task, m, b)
            for m in summary.methods(task)
            for b in summary.budgets(task, m)
        ):
            lines += [
                (
                    "`rouge_mean` is the geometric mean of the item-averaged ROUGE-1, ROUGE-2 and ROUGE-L F1 (BUZZ's \"Mean "
                    'ROUGE"), so it is 0 whenever ROUGE-2 is 0; it has no per-item standard error.'
                ),
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
        truncated = truncation_note(records, task)
        if truncated:
            lines += [truncated, ""]
        for path in plot_task(summary, task, out):
            lines += [f"![{md_text(task)}]({path.name})", ""]
    if include_claims is None:
        include_claims = any(r.get("suite") == "claims" for r in records)
    if include_claims:
        lines += [claims_section(summary), ""]
    if compare:
        lines += [claims_comparison([out, *compare]), ""]
    text = "\n".join(lines)
    (out / REPORT_FILE).write_text(text, encoding="utf-8")
    return text


__all__ = [
    "write_report",
    "task_table",
    "plot_task",
    "quality_figures",
    "paired_ratio_to_full",
    "claims_section",
    "claims_comparison",
]
