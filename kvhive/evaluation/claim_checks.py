"""How a paper claim is checked: the :class:`Claim` record, the :class:`Verdict` a check returns and
the check builders the claims suite is written with (:func:`outperforms`, :func:`mean_claim`,
:func:`retains_full`, :func:`noting_unscored_items`), with the paired statistics and the sample-size
and memory notes they put in a verdict's text. The claims themselves are data in
:mod:`kvhive.evaluation.claims`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .memory import held_memory
from .results import ResultsSummary
from .statistics import CorrectedComparison, Statistic, holm_corrected, item_matrix, paired_bootstrap, statistic_of

CheckResult = tuple[bool | None, str]  # what a check returns: a Verdict (a tuple of these two)


@dataclass(frozen=True)
class Claim:
    id: str
    paper: str
    paper_says: str  # one sentence with the paper's numbers
    task: str
    methods: tuple[str, ...]  # the paper's method first, then what it is compared with
    budgets: tuple[float | int, ...]
    check: Callable[[ResultsSummary], CheckResult] = field(compare=False, repr=False)
    metric: str | None = None  # None: the task's main metric
    # (name, billions of parameters) of the model the paper's numbers come from; None: the
    # paper's main model (PAPER_MODELS)
    paper_model: tuple[str, float] | None = None

    @property
    def tested_model(self) -> tuple[str, float]:
        return self.paper_model or PAPER_MODELS[self.paper]


# The model each paper's headline numbers come from (docs/METHODS.md, "References").
PAPER_MODELS: dict[str, tuple[str, float]] = {
    "BUZZ": ("Llama-2-7B", 6.7),  # §4.1: "By default, we all use LLaMA2-7B"
    "Ada-KV": ("Mistral-7B-Instruct-v0.2", 7.2),  # §5: the primary model (LWM-Text-Chat-1M, 7B, beside it)
    "BumbleBee": ("LLaMA-7B", 6.7),  # Table 1
    "SubGen": ("LongChat-7B-v1.5-32k", 6.7),  # LongEval lines
    "AhaKV": ("LLaMA3-8B-Instruct", 8.0),  # Table 1
}
# Parameters (billions) of the models kvhive runs the claims on.
MODEL_BILLIONS: dict[str, float] = {"gemma-3-270m": 0.27, "qwen2.5-0.5b": 0.49}
MUCH_SMALLER = 5.0  # a model this many times smaller than the paper's is said so next to the verdict


def model_size_note(claim: Claim, models: Sequence[str]) -> str:
    """The run's model against the paper's, e.g. "tested on 0.27B (gemma-3-270m); the paper on
    Llama-2-7B (6.7B), 25× larger"; said for every claim, flagged when much smaller."""
    paper_name, paper_billions = claim.tested_model
    sizes = [MODEL_BILLIONS.get(model) for model in models]
    if not models or any(size is None for size in sizes):
        return f"paper: {paper_name} ({paper_billions:g}B); this run's model size unknown ({', '.join(models) or '–'})"
    ours = max(sizes)
    text = f"tested on {', '.join(f'{m} ({b:g}B)' for m, b in zip(models, sizes, strict=True))}; paper: {paper_name} ({paper_billions:g}B)"
    if paper_billions >= MUCH_SMALLER * ours:
        text = f"**{paper_billions / ours:.0f}× smaller model than the paper's**: " + text
    return text


def _fmt(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:.4g}"


def _budget_text(budget: float | int) -> str:
    return f"{budget} tok" if isinstance(budget, int) else f"{budget:g}"


def _precheck(summary: ResultsSummary, task: str, metric: str | None) -> tuple[str | None, str | None]:
    """(metric name, reason not to judge) for a task."""
    if task not in summary.task_info:
        return None, f"no results for task {task}"
    metric = metric or summary.main_metric(task)
    if summary.near_chance(task):
        return metric, f"full cache {metric} = {_fmt(summary.full(task, metric))} is near chance on {task}"
    return metric, None


def paired_items(summary: ResultsSummary, task: str, settings: Sequence[tuple[str, float | int]]) -> set[str]:
    """Item ids that every (method, budget) in ``settings`` ran on (the full cache: any budget)."""
    shared: set[str] | None = None
    for method, budget in settings:
        items = {str(r["item_id"]) for r in summary.item_records(task, method, budget)}
        shared = items if shared is None else shared & items
    return shared or set()


def on_items(summary: ResultsSummary, task: str, items: set[str]) -> ResultsSummary:
    """``summary`` with ``task``'s scored records restricted to ``items`` (infeasible records kept,
    so missing settings still name their reason)."""
    return ResultsSummary(
        r for r in summary.records if r["task"] != task or r.get("status") == "infeasible" or str(r["item_id"]) in items
    )


def _paired_view(
    summary: ResultsSummary, task: str, settings: Sequence[tuple[str, float | int]]
) -> tuple[ResultsSummary, int, str]:
    """(summary on the items every compared setting ran, their number, a note on items left out).

    Settings that ran on different items (a later run with another ``--limit``) are compared on
    the items they share, never a mean over 8 items against a mean over 2."""
    items = paired_items(summary, task, settings)
    ran = {str(r["item_id"]) for method, budget in settings for r in summary.item_records(task, method, budget)}
    left_out = len(ran - items)
    note = f"; {left_out} item(s) not run in every compared setting left out" if left_out and items else ""
    return on_items(summary, task, items), len(items), note


NOISE_STANDARD_ERRORS = 2.0  # the paper-gap sample-size estimate: a gap this many paired standard errors wide


class Verdict(tuple):
    """A claim's ``(holds, measured)``, plus the corrected comparisons it rests on (``evidence``).

    ``holds`` other than None needs evidence, and must follow from it: True when every comparison
    is decided in the candidate's favour, False when one is decided against it. So no verdict can
    be declared from point estimates (a comparison without an interval cannot be built)."""

    evidence: tuple[CorrectedComparison, ...]
    favourable: tuple[bool, ...]

    def __new__(
        cls,
        holds: bool | None,
        measured: str,
        evidence: Sequence[CorrectedComparison] = (),
        favourable: Sequence[bool] = (),
    ) -> Verdict:
        evidence, favourable = tuple(evidence), tuple(favourable)
        if len(evidence) != len(favourable):
            raise ValueError(f"{len(evidence)} comparisons but {len(favourable)} directions")
        if holds is not None:
            if not evidence:
                raise ValueError(f"a verdict ({holds}) needs the corrected intervals it rests on: {measured}")
            expected = (
                False
                if any(c.decided and not f for c, f in zip(evidence, favourable, strict=True))
                else (True if all(c.decided for c in evidence) else None)
            )
            if holds is not expected:
                raise ValueError(f"verdict {holds} does not follow from its intervals ({expected}): {measured}")
        verdict = super().__new__(cls, (holds, measured))
        verdict.evidence = evidence
        verdict.favourable = favourable
        return verdict


def _verdict(measured: str, evidence: Sequence[CorrectedComparison], favourable: Sequence[bool]) -> Verdict:
    """The verdict that follows from Holm-corrected comparisons (see :class:`Verdict`)."""
    if any(c.decided and not f for c, f in zip(evidence, favourable, strict=True)):
        holds: bool | None = False
    elif evidence and all(c.decided for c in evidence):
        holds = True
    else:
        holds = None
    return Verdict(holds, measured, evidence, favourable)


def relative_gap(candidate: float, baseline: float, higher_is_better: bool = True) -> float:
    """The candidate's advantage over the baseline as a fraction of the baseline's score, from a
    paper's table (``relative_gap(9.394, 9.987, higher_is_better=False)``: 5.9% lower perplexity)."""
    if baseline <= 0:
        raise ValueError(f"invalid baseline={baseline!r}: a relative gap needs a positive baseline score")
    return (candidate - baseline) / baseline if higher_is_better else (baseline - candidate) / baseline


def items_to_detect(gap: float, standard_deviation: float) -> int | None:
    """Items a paired comparison needs so that a true difference ``gap`` (in the metric's units)
    exceeds ``NOISE_STANDARD_ERRORS`` standard errors, given the per-item paired difference's
    standard deviation measured on the first items: ``n = ceil((z * sd / gap)^2)``, at least 2.
    None when the gap is zero (nothing to detect)."""
    if gap <= 0:
        return None
    return max(2, math.ceil((NOISE_STANDARD_ERRORS * standard_deviation / gap) ** 2))


def _items_needed_text(paper_gap: float, baseline_value: float, standard_error: float, items: int) -> str:
    """How many items the paper's gap needs here, with the per-item spread measured on ``items``
    (the bootstrap standard error times √n)."""
    gap = paper_gap * abs(baseline_value)
    needed = items_to_detect(gap, standard_error * math.sqrt(items))
    if needed is None:
        return f"paper's gap {paper_gap:.1%} of a baseline scoring 0: no size to detect"
    return f"paper's gap {paper_gap:.1%} = {gap:.3g} needs n≈{needed:,}"


def _statistic(summary: ResultsSummary, task: str, metric: str) -> Statistic:
    return statistic_of(summary.task_info[task].get("kind", "generate"), metric)


def paired_arrays(
    summary: ResultsSummary,
    task: str,
    statistic: Statistic,
    settings: Sequence[Sequence[tuple[str, float | int | None]]],
) -> tuple[list[np.ndarray], int] | str:
    """Per group of settings (one group per side of a comparison, one setting per budget), the
    ``[budgets, items, components]`` array on the items every setting ran, sorted by item id, and
    their number; or why there is none (a component missing on some item)."""
    flat = [setting for group in settings for setting in group]
    items = sorted(paired_items(summary, task, flat))
    arrays = []
    for group in settings:
        per_budget = []
        for method, budget in group:
            by_item = {str(r["item_id"]): r["metrics"] for r in summary.item_records(task, method, budget)}
            matrix = item_matrix([by_item[item] for item in items], statistic)
            if matrix is None:
                return f"{method}@{_budget_text(budget) if budget is not None else 'all'} lacks a finite {', '.join(statistic.components)} on some item"
            per_budget.append(matrix)
        arrays.append(np.stack(per_budget))
    return arrays, len(items)


UNEQUAL_MEMORY = 1.25  # a candidate holding this many times the first baseline's entries, or 1/this, is labelled


def _memory_text(summary: ResultsSummary, task: str, methods: Sequence[str], budgets: Sequence[float | int]) -> str:
    """Held memory of each compared setting, with a ``×N memory`` label on the candidate when it
    holds clearly more or less than the first baseline at the same budget (Ada-KV storing one copy
    per query head on a one-KV-head model: ×4; BUZZ's mean form below a baseline pinned at its
    budget), so a comparison at unequal memory says so."""
    if all(held_memory(summary, task, m, b) is None for m in methods for b in budgets):
        return "held KV memory: not recorded by this run"
    parts = []
    for budget in budgets:
        cells = []
        reference = held_memory(summary, task, methods[1], budget) if len(methods) > 1 else None
        for method in methods:
            memory = held_memory(summary, task, method, budget)
            if memory is None:
                cells.append(f"{method} not recorded")
                continue
            cell = (
                f"{method} {memory['kv_entries_mean']:,.0f}/{memory['kv_entries_peak']:,.0f} "
                f"({memory['kv_bytes_mean'] / 2**20:.2f}/{memory['kv_bytes_peak'] / 2**20:.2f} MiB)"
            )
            if reference is not None and method == methods[0] and reference["kv_entries_mean"]:
                factor = memory["kv_entries_mean"] / reference["kv_entries_mean"]
                if not 1 / UNEQUAL_MEMORY < factor < UNEQUAL_MEMORY:
                    cell += f" **×{factor:.2g} memory** of {methods[1]}"
            cells.append(cell)
        parts.append(f"@{_budget_text(budget)}: " + ", ".join(cells))
    return "held KV entries mean/peak per item (MiB): " + "; ".join(parts)


def outperforms(
    task: str,
    candidate: str,
    baselines: Sequence[str],
    budgets: Sequence[float | int],
    metric: str | None = None,
    mode: str = "each",
    shown: Sequence[str] = (),
    paper_gaps: Mapping[str, float] | None = None,
) -> Callable[[ResultsSummary], Verdict]:
    """``candidate`` beats every baseline: at every budget (``mode="each"``; the family is each
    baseline × each budget) or on the mean over ``budgets`` (``mode="mean"``; the family is each
    baseline). Lower is better when the task says so (perplexity).

    Each comparison is the paired bootstrap of the candidate's statistic minus the baseline's over
    the items every compared setting ran (:func:`~kvhive.evaluation.statistics.paired_bootstrap`),
    corrected by Holm over the family; the claim holds when every corrected interval lies on the
    candidate's side of 0, does not hold when one lies on the other side, and is not decided
    otherwise.
    ``shown``: extra methods listed in the measured text but not judged.
    ``paper_gaps``: per baseline, the candidate's advantage the paper reports, as a fraction of the
    baseline's score (:func:`relative_gap`); each comparison then states how many items a gap
    of that size needs to exceed the noise threshold here (:func:`items_to_detect`)."""
    if paper_gaps is not None:
        unknown = set(paper_gaps) - set(baselines)
        if unknown or any(not gap > 0 for gap in paper_gaps.values()):
            raise ValueError(f"invalid paper_gaps={dict(paper_gaps)!r}: expected gaps > 0 for baselines {baselines}")

    def check(summary: ResultsSummary) -> Verdict:
        metric_name, reason = _precheck(summary, task, metric)
        if metric_name is None:
            return Verdict(None, reason or "no data")
        higher = summary.task_info[task].get("higher_is_better", True)
        methods = [candidate, *baselines]
        settings = [(m, b) for m in methods for b in budgets]
        complete = all(summary.count(task, m, b) for m, b in settings)
        if complete:
            if not paired_items(summary, task, settings):
                return Verdict(None, f"{metric_name}: no item was run in every compared setting ({', '.join(methods)})")
            summary, n, left_out = _paired_view(summary, task, settings)
            n_text = f"n={n} items, the same in every compared setting{left_out}"
        else:  # some setting has no result at all: no verdict; show what there is
            n_text = f"n={min(summary.count(task, m, b) for m, b in settings)} items in the smallest setting"
        values = {(m, b): summary.value(task, m, b, metric_name) for m in [*methods, *shown] for b in budgets}
        missing = [
            f"{m}@{_budget_text(b)}"
            + (" (infeasible: budget below the method's minimum)" if summary.infeasible(task, m, b) else "")
            for m in methods
            for b in budgets
            if values[(m, b)] is None
        ]
        full = summary.full(task, metric_name)
        if mode == "mean":

            def score(m: str) -> float | None:
                vals = [values[(m, b)] for b in budgets]
                return None if any(v is None for v in vals) else sum(vals) / len(vals)

            listed = "; ".join(f"{m} {_fmt(score(m))}" for m in [*methods, *shown])
            text = f"{metric_name}, mean over budgets {', '.join(map(_budget_text, budgets))}: {listed}"
            comparisons = [(base, tuple(budgets), f"vs {base}", score(base)) for base in baselines]
            family = f"each of {', '.join(baselines)} on the mean over the budgets"
        else:
            parts = []
            for b in budgets:
                parts.append(
                    f"@{_budget_text(b)}: " + ", ".join(f"{m} {_fmt(values[(m, b)])}" for m in [*methods, *shown])
                )
            text = f"{metric_name} " + "; ".join(parts)
            at = len(budgets) > 1
            comparisons = [
                (base, (b,), f"vs {base}" + (f"@{_budget_text(b)}" if at else ""), values[(base, b)])
                for base in baselines
                for b in budgets
            ]
            family = f"each of {', '.join(baselines)}" + (
                f" × each budget {', '.join(map(_budget_text, budgets))}" if at else f" at {_budget_text(budgets[0])}"
            )
        text += f"; full {_fmt(full)}; {n_text}"
        if complete:
            text += "; " + _memory_text(summary, task, methods, budgets)
        if missing or reason:
            # both when both: a run may skip the compressed settings where the full cache is at chance
            notes = ([f"missing: {', '.join(missing)}"] if missing else []) + ([reason] if reason else [])
            return Verdict(None, text + "; " + "; ".join(notes))
        statistic = _statistic(summary, task, metric_name)
        boots = []
        for base, compared, label, _ in comparisons:
            arrays = paired_arrays(
                summary, task, statistic, [[(candidate, b) for b in compared], [(base, b) for b in compared]]
            )
            if isinstance(arrays, str):
                return Verdict(None, text + f"; no interval: {arrays}")
            (mine, theirs), items = arrays
            if items < 2:
                return Verdict(None, text + f"; no interval: {items} paired item(s), a bootstrap needs 2")
            boots.append((label, paired_bootstrap(mine, theirs, statistic)))
        corrected = holm_corrected(boots)
        favourable = [(c.estimate > 0) == higher for c in corrected]
        notes = []
        for (base, _, _, base_value), (_, boot), comparison in zip(comparisons, boots, corrected, strict=True):
            note = comparison.text()
            if paper_gaps is not None and base in paper_gaps:
                note += f" ({_items_needed_text(paper_gaps[base], base_value, boot.standard_error, boot.items)})"
            notes.append(note)
        text += (
            f"; {candidate} minus baseline, paired bootstrap over items with Holm's correction over the family of "
            f"{len(corrected)} comparison(s) ({family}): " + ", ".join(notes)
        )
        ties = sum(1 for _, boot in boots if not np.any(boot.resampled))
        undecided = sum(1 for c in corrected if not c.decided)
        if undecided and not any(c.decided and not f for c, f in zip(corrected, favourable, strict=True)):
            reasons = [f"{undecided} comparison(s) not decided"] + ([f"{ties} tie(s)"] if ties else [])
            text += f"; {', '.join(reasons)}: not decided at this n"
        return _verdict(text, corrected, favourable)

    return noting_unscored_items(check, task, [(m, b) for m in (candidate, *baselines) for b in budgets])


def mean_claim(
    *,
    id: str,
    paper: str,
    paper_says: str,
    task: str,
    candidate: str,
    baselines: Sequence[str],
    budgets: Sequence[float | int],
    paper_gaps: Mapping[str, float],
) -> Claim:
    """A claim that ``candidate`` beats every baseline on the mean over ``budgets``: its methods
    and its check are built from the same names, so they cannot drift apart."""
    return Claim(
        id=id,
        paper=paper,
        paper_says=paper_says,
        task=task,
        methods=(candidate, *baselines),
        budgets=tuple(budgets),
        check=outperforms(task, candidate, list(baselines), budgets, mode="mean", paper_gaps=paper_gaps),
    )


def retains_full(
    task: str, method: str, budget: float | int, fraction: float, metric: str | None = None
) -> Callable[[ResultsSummary], Verdict]:
    """``method`` at ``budget`` scores at least ``fraction`` of the full cache (higher is better):
    the paired bootstrap of the ratio of the two statistics over the items both ran; holds when
    its 95% interval lies at or above ``fraction``, does not hold when it lies below."""

    def check(summary: ResultsSummary) -> Verdict:
        metric_name, reason = _precheck(summary, task, metric)
        if metric_name is None:
            return Verdict(None, reason or "no data")
        summary, n, left_out = _paired_view(summary, task, [(method, budget), ("full", None)])
        value = summary.value(task, method, budget, metric_name)
        full = summary.full(task, metric_name)
        if value is None or full is None:
            return Verdict(
                None,
                f"{metric_name}: {method}@{_budget_text(budget)} {_fmt(value)}, full {_fmt(full)} (missing data)"
                + (f"; {reason}" if reason else ""),
            )
        ratio = value / full if full else float("nan")
        text = (
            f"{metric_name}: {method}@{_budget_text(budget)} {_fmt(value)} = {_fmt(ratio)} of full ({_fmt(full)}); "
            f"n={n} items run by both{left_out}; " + _memory_text(summary, task, [method, "full"], [budget])
        )
        if reason:
            return Verdict(None, text + f"; {reason}")
        statistic = _statistic(summary, task, metric_name)
        arrays = paired_arrays(summary, task, statistic, [[(method, budget)], [("full", None)]])
        if isinstance(arrays, str) or arrays[1] < 2:
            why = arrays if isinstance(arrays, str) else f"{arrays[1]} paired item(s), a bootstrap needs 2"
            return Verdict(None, text + f"; no interval: {why}")
        (mine, theirs), _ = arrays
        try:
            boot = paired_bootstrap(mine, theirs, statistic, contrast="ratio")
        except ValueError as error:  # the full cache scores 0 on some resample: no ratio
            return Verdict(None, text + f"; no interval: {error}")
        (corrected,) = holm_corrected([(f"{method} ÷ full", boot)], null=fraction)
        text += f"; paired bootstrap of the ratio over items: {corrected.text()}" + (
            "" if corrected.decided else f"; the interval includes {fraction:g}: not decided at this n"
        )
        return _verdict(text, [corrected], [corrected.estimate >= fraction])

    return noting_unscored_items(check, task, [(method, budget), ("full", None)])


def noting_unscored_items(
    check: Callable[[ResultsSummary], CheckResult], task: str, settings: Sequence[tuple[str, float | int | None]]
) -> Callable[[ResultsSummary], CheckResult]:
    """``check`` whose text also names the compared settings with items that have no score
    (failed, transient, too long, missing), so no verdict rests on them unsaid."""

    def check_noting(summary: ResultsSummary) -> CheckResult:
        result = check(summary)
        holds, text = result
        note = summary.problems_note(task, settings) if task in summary.task_info else ""
        if not note:
            return result
        if isinstance(result, Verdict):  # the same verdict and evidence, with the note in its text
            return Verdict(holds, f"{text}; {note}", result.evidence, result.favourable)
        return holds, f"{text}; {note}"

    return check_noting
