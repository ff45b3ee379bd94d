"""Quality against the bytes a cache holds: the figure that sets settings of different bit widths
(``METHOD:kv_bits=4``) side by side with full-precision ones, each at the key/value bytes it held.

A budget counts tokens; a quantized cache holds each token in fewer bytes, so at equal bytes an int4
cache keeps about four times the tokens of a float16 one. The x axis is each setting's mean held
bytes over items (``record["cache"]["kv_bytes_mean"]``: codes and scales for a quantized cache), the y
axis the task's main metric (mean and standard error over items, as the budget figures)."""

from __future__ import annotations

from statistics import fmean

from kvhive.evaluation.backend import split_cache_options


def held_bytes_points(summary, task: str) -> dict[str, list[tuple[float, float, float]]]:
    """Per method family (the method spec without ``kv_bits``) and bit width: ``[(mean held bytes,
    value, standard error)]`` over its budgets, for the settings whose records carry cache sizes."""
    main = summary.main_metric(task)
    series: dict[str, list[tuple[float, float, float]]] = {}
    for method in summary.methods(task):
        name, options = split_cache_options(method)
        label = f"{name} ({options['kv_bits']}-bit)" if "kv_bits" in options else f"{name} (model dtype)"
        for budget in summary.budgets(task, method):
            held = [
                r["cache"]["kv_bytes_mean"]
                for r in summary.records
                if r["task"] == task
                and r["method"] == method
                and r["budget"] == budget
                and "cache" in r
                and r.get("status", "ok") == "ok"
            ]
            value = summary.value(task, method, budget)
            if not held or value is None:
                continue
            se = summary.aggregate(task, method, budget).get(f"{main}_se") or 0.0
            series.setdefault(label, []).append((fmean(held), value, se if se == se else 0.0))
    return {label: sorted(points) for label, points in sorted(series.items())}


def quality_by_bytes_figure(summary, task: str):
    """The figure (matplotlib), or None when no setting of the task was stored quantized."""
    if not any("kv_bits" in split_cache_options(m)[1] for m in summary.methods(task)):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = held_bytes_points(summary, task)
    if not series:
        return None
    main = summary.main_metric(task)
    figure, axis = plt.subplots(figsize=(7.2, 4.6), dpi=110)
    for label, points in series.items():
        axis.errorbar(
            [p[0] / 2**20 for p in points],
            [p[1] for p in points],
            yerr=[p[2] for p in points],
            marker="o",
            linestyle="--" if "model dtype" not in label else "-",
            capsize=3,
            label=label,
            gid=f"series:{label}",
        )
    axis.set_xscale("log", base=2)
    axis.set_xlabel("key/value bytes held (MiB, mean over items)")
    axis.set_ylabel(f"{main or 'metric'} (mean ± s.e. over items)")
    axis.set_title(f"{task}: {main} vs bytes held")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    figure.tight_layout()
    return figure
