"""Quality against the KV memory a setting held (every layer, sliding-window ones included), as a
fraction of the full cache's bytes: the plot that compares settings at what they held rather than
at their nominal budget."""

from __future__ import annotations

import math

from kvhive.methods.registry import method_names

from .backend import FULL_METHOD
from .memory import whole_cache_held
from .results import ResultsSummary

HELD_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*", "h", "p")
METHOD_ORDER = tuple(method_names())


def method_sort_key(method: str) -> tuple[int, str]:
    """The registry's order; other names (ada-<scorer> combinations) after it, alphabetically."""
    return (METHOD_ORDER.index(method), "") if method in METHOD_ORDER else (len(METHOD_ORDER), method)


def budget_text(budget: float | int) -> str:
    """``N tok`` for a token budget, the ratio otherwise."""
    return f"{budget} tok" if isinstance(budget, int) else f"{budget:g}"


def held_memory_figure(summary: ResultsSummary, task: str):
    """The main metric against what the whole cache held (every layer, sliding-window ones included)
    as a fraction of the full cache's bytes, mean over items, one point per setting with one standard
    error; the full cache at its own fraction (1) as a dashed line; None when no setting recorded it.
    Settings are compared at the memory they held, not at their nominal budget: on a model whose
    sliding-window layers the budget leaves alone, or with Ada-KV's copies per query head, the two
    differ."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main = summary.main_metric(task)
    series = []
    for method in [m for m in sorted(summary.methods(task), key=method_sort_key) if m != FULL_METHOD]:
        points = []
        for budget in summary.budgets(task, method):
            held = whole_cache_held(summary.item_records(task, method, budget))
            value = summary.value(task, method, budget)
            if held is None or value is None:
                continue
            se = summary.aggregate(task, method, budget).get(f"{main}_se")
            points.append(
                (held["held_fraction_mean"], value, se if isinstance(se, float) and math.isfinite(se) else 0.0, budget)
            )
        if points:
            series.append((method, sorted(points)))
    if not series:
        return None
    figure, axis = plt.subplots(figsize=(7.2, 4.6), dpi=110)
    for index, (method, points) in enumerate(series):
        axis.errorbar(
            [p[0] for p in points],
            [p[1] for p in points],
            yerr=[p[2] for p in points],
            marker=HELD_MARKERS[index % len(HELD_MARKERS)],
            markersize=6,
            linewidth=1.2,
            capsize=3,
            label=f"{method} ({', '.join(budget_text(p[3]) for p in points)})",
            gid=f"series:{method}",
        )
    full_value = summary.full(task)
    if full_value is not None:
        axis.axhline(full_value, color="black", linestyle="--", linewidth=1.2, label="full cache")
    axis.axvline(1.0, color="grey", linestyle=":", linewidth=1.2, label="the full cache's memory")
    axis.set_xlabel("KV memory held, all layers (fraction of the full cache; mean over items)")
    axis.set_ylabel(f"{main or 'metric'} (mean ± s.e. over items)")
    axis.set_title(f"{task}: {main} vs memory held")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    figure.tight_layout()
    return figure


__all__ = ["budget_text", "held_memory_figure", "method_sort_key"]
