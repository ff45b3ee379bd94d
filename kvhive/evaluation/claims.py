"""The paper-claims suite, as data.

Each :class:`Claim` names the paper, quotes what it reports (headline numbers from
the papers cited in docs/METHODS.md, "References"), the task and the methods/budgets that test it here, and a ``check``
evaluated on a :class:`~kvhive.evaluation.results.ResultsSummary` returning
``(holds, measured)``: ``holds`` is True / False, or None when data are missing, the compared
scores tie, or the full cache itself scores near chance on the task (then the comparison says
nothing). Budgets are adapted to this project's lengths (contexts of 0.1k-5k tokens instead of
the papers' 4k-37k): token budgets for needle/mdqa are 64-256, ratios elsewhere.

``claims_grid()`` turns the claims into the runner's per-task methods and budgets (the
``--suite claims`` run).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from .backend import budget_key
from .results import ResultsSummary

CheckResult = tuple[bool | None, str]
EPSILON = 1e-9


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


NOISE_STANDARD_ERRORS = 2.0  # a difference within this many paired standard errors is not a verdict


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
    """How many items the paper's gap needs here, with the per-item spread measured on ``items``."""
    gap = paper_gap * abs(baseline_value)
    needed = items_to_detect(gap, standard_error * math.sqrt(items))
    if needed is None:
        return f"paper's gap {paper_gap:.1%} of a baseline scoring 0: no size to detect"
    return f"paper's gap {paper_gap:.1%} = {gap:.3g} needs n≈{needed:,}"


def paired_difference(
    summary: ResultsSummary, task: str, metric: str, candidate: str, baseline: str, budgets: Sequence[float | int]
) -> tuple[float, float, int] | None:
    """Mean over items of (candidate - baseline), each item's value averaged over ``budgets``, with
    its standard error and the number of items both ran. Items are shared between methods, so the
    paired difference removes the item-to-item spread that dwarfs method differences at small n.
    None when items have no per-item value of ``metric`` (corpus-level or derived metrics)."""
    per_item: dict[str, list[float]] = {}
    for budget in budgets:
        mine = {str(r["item_id"]): r["metrics"].get(metric) for r in summary.item_records(task, candidate, budget)}
        theirs = {str(r["item_id"]): r["metrics"].get(metric) for r in summary.item_records(task, baseline, budget)}
        for item in mine.keys() & theirs.keys():
            if mine[item] is None or theirs[item] is None:
                return None
            per_item.setdefault(item, []).append(float(mine[item]) - float(theirs[item]))
    differences = [sum(values) / len(values) for values in per_item.values() if len(values) == len(budgets)]
    if len(differences) < 2:
        return None
    n = len(differences)
    mean_difference = sum(differences) / n
    variance = sum((d - mean_difference) ** 2 for d in differences) / (n - 1)
    return mean_difference, math.sqrt(variance / n), n


def outperforms(
    task: str,
    candidate: str,
    baselines: Sequence[str],
    budgets: Sequence[float | int],
    metric: str | None = None,
    mode: str = "each",
    shown: Sequence[str] = (),
    paper_gaps: Mapping[str, float] | None = None,
) -> Callable[[ResultsSummary], CheckResult]:
    """``candidate`` beats every baseline: at every budget (``mode="each"``) or on the mean over
    ``budgets`` (``mode="mean"``). Lower is better when the task says so (perplexity).
    ``shown``: extra methods listed in the measured text but not judged.
    ``paper_gaps``: per baseline, the candidate's advantage the paper reports, as a fraction of the
    baseline's score (:func:`relative_gap`); each paired comparison then states how many items a gap
    of that size needs to exceed the noise threshold here (:func:`items_to_detect`)."""
    if paper_gaps is not None:
        unknown = set(paper_gaps) - set(baselines)
        if unknown or any(not gap > 0 for gap in paper_gaps.values()):
            raise ValueError(f"invalid paper_gaps={dict(paper_gaps)!r}: expected gaps > 0 for baselines {baselines}")

    def check(summary: ResultsSummary) -> CheckResult:
        metric_name, reason = _precheck(summary, task, metric)
        if metric_name is None:
            return None, reason or "no data"
        higher = summary.task_info[task].get("higher_is_better", True)
        methods = [candidate, *baselines]
        settings = [(m, b) for m in methods for b in budgets]
        if all(summary.count(task, m, b) for m, b in settings):
            if not paired_items(summary, task, settings):
                return None, f"{metric_name}: no item was run in every compared setting ({', '.join(methods)})"
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
            comparisons = [(score(candidate), score(base), base, tuple(budgets)) for base in baselines]
        else:
            parts = []
            for b in budgets:
                parts.append(
                    f"@{_budget_text(b)}: " + ", ".join(f"{m} {_fmt(values[(m, b)])}" for m in [*methods, *shown])
                )
            text = f"{metric_name} " + "; ".join(parts)
            comparisons = [
                (values[(candidate, b)], values[(base, b)], base, (b,)) for base in baselines for b in budgets
            ]
        text += f"; full {_fmt(full)}; {n_text}"
        if missing or reason:
            # both when both: a run may skip the compressed settings where the full cache is at chance
            notes = ([f"missing: {', '.join(missing)}"] if missing else []) + ([reason] if reason else [])
            return None, text + "; " + "; ".join(notes)
        wins = losses = ties = within_noise = 0
        paired_notes: list[str] = []
        for mine, theirs, base, compared_budgets in comparisons:
            if abs(mine - theirs) <= EPSILON:
                ties += 1
                continue
            paired = paired_difference(summary, task, metric_name, candidate, base, compared_budgets)
            if paired is not None:
                difference, standard_error, items = paired
                where = "" if mode == "mean" or len(budgets) == 1 else f"@{_budget_text(compared_budgets[0])}"
                note = f"vs {base}{where} {difference:+.3g} ± {standard_error:.2g}"
                if paper_gaps is not None and base in paper_gaps:
                    note += f" ({_items_needed_text(paper_gaps[base], theirs, standard_error, items)})"
                paired_notes.append(note)
                if abs(difference) <= NOISE_STANDARD_ERRORS * standard_error:
                    within_noise += 1
                    continue
            if (mine > theirs) == higher:
                wins += 1
            else:
                losses += 1
        if paired_notes:
            text += f"; {candidate} minus baseline per item (mean ± s.e.): " + ", ".join(paired_notes)
        if losses:
            return False, text
        if ties or within_noise:
            reasons = []
            if ties:
                reasons.append(f"{ties} tie(s)")
            if within_noise:
                reasons.append(f"{within_noise} difference(s) within {NOISE_STANDARD_ERRORS:g} standard errors")
            return None, text + f"; {', '.join(reasons)}: not distinguishable at this n"
        return True, text

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
) -> Callable[[ResultsSummary], CheckResult]:
    """``method`` at ``budget`` scores at least ``fraction`` of the full cache (higher is better)."""

    def check(summary: ResultsSummary) -> CheckResult:
        metric_name, reason = _precheck(summary, task, metric)
        if metric_name is None:
            return None, reason or "no data"
        summary, n, left_out = _paired_view(summary, task, [(method, budget), ("full", None)])
        value = summary.value(task, method, budget, metric_name)
        full = summary.full(task, metric_name)
        if value is None or full is None:
            return (
                None,
                f"{metric_name}: {method}@{_budget_text(budget)} {_fmt(value)}, full {_fmt(full)} (missing data)"
                + (f"; {reason}" if reason else ""),
            )
        ratio = value / full if full else float("nan")
        text = (
            f"{metric_name}: {method}@{_budget_text(budget)} {_fmt(value)} = {_fmt(ratio)} of full ({_fmt(full)}); "
            f"n={n} items run by both{left_out}"
        )
        if reason:
            return None, text + f"; {reason}"
        return bool(value >= fraction * full - EPSILON), text

    return noting_unscored_items(check, task, [(method, budget), ("full", None)])


def noting_unscored_items(
    check: Callable[[ResultsSummary], CheckResult], task: str, settings: Sequence[tuple[str, float | int | None]]
) -> Callable[[ResultsSummary], CheckResult]:
    """``check`` whose text also names the compared settings with items that have no score
    (failed, transient, too long, missing), so no verdict rests on them unsaid."""

    def check_noting(summary: ResultsSummary) -> CheckResult:
        holds, text = check(summary)
        note = summary.problems_note(task, settings) if task in summary.task_info else ""
        return holds, f"{text}; {note}" if note else text

    return check_noting


XSUM_BUDGETS = (0.1, 0.2, 0.4, 0.6)
SMALL_TOKEN_BUDGETS = (64, 128, 256)
# AhaKV Table 1 (LLaMA3-8B-Inst): AhaKV against each baseline.
AHAKV_MDQA_GAPS = {
    "snapkv": relative_gap(31.85, 31.06),
    "h2o": relative_gap(31.85, 30.76),
    "tova": relative_gap(31.85, 30.74),
    "streamingllm": relative_gap(31.85, 26.88),
}
# AhaKV Table 1's baselines (Sink = StreamingLLM) and the token budgets its claims are checked at.
AHAKV_BASELINES = ("snapkv", "h2o", "tova", "streamingllm")
AHAKV_BUDGETS = (128, 256)
AHAKV_RETRIEVAL_GAPS = {
    "snapkv": relative_gap(54.83, 54.33),
    "h2o": relative_gap(54.83, 41.70),
    "tova": relative_gap(54.83, 53.30),
    "streamingllm": relative_gap(54.83, 26.50),
}

CLAIMS: list[Claim] = [
    # ---------------------------------------------------------------- BUZZ (buzz.txt)
    Claim(
        id="buzz-xsum-99pct",
        paper="BUZZ",
        paper_says="On XSUM (Llama-2-7B) BUZZ reaches and even exceeds the 99% accuracy baseline with only about 40% of the original cache size (abstract: 2.5x less cache at >99% accuracy).",
        task="xsum",
        methods=("buzz",),
        budgets=(0.4,),
        metric="rouge_mean",
        check=retains_full("xsum", "buzz", 0.4, 0.99, metric="rouge_mean"),
    ),
    Claim(
        id="buzz-xsum-vs-baselines",
        paper="BUZZ",
        paper_says="Table 2 (XSUM, geometric-mean ROUGE, 10-60% cache): BUZZ outperforms H2O and StreamingLLM overall (e.g. 12.3 vs 11.6 and 11.2 at 40%) and Local is far below (0.1-7.6).",
        task="xsum",
        methods=("buzz", "h2o", "streamingllm", "local"),
        budgets=XSUM_BUDGETS,
        metric="rouge_mean",
        check=outperforms(
            "xsum",
            "buzz",
            ["h2o", "streamingllm", "local"],
            XSUM_BUDGETS,
            "rouge_mean",
            mode="mean",
            # 40% cache; Local's best (7.6) over the budgets, the smallest gap the paper shows.
            paper_gaps={
                "h2o": relative_gap(12.3, 11.6),
                "streamingllm": relative_gap(12.3, 11.2),
                "local": relative_gap(12.3, 7.6),
            },
        ),
    ),
    Claim(
        id="buzz-logn-xsum-vs-baselines",
        paper="BUZZ",
        paper_says="Figure 5 / Table 2: BUZZ and BUZZ with log n consistently achieve the highest ROUGE scores on XSUM (log n: 10.4-12.3 mean ROUGE vs H2O 10.2-11.8, StreamingLLM 3.8-11.9).",
        task="xsum",
        methods=("buzz-logn", "h2o", "streamingllm", "local"),
        budgets=XSUM_BUDGETS,
        metric="rouge_mean",
        check=outperforms(
            "xsum",
            "buzz-logn",
            ["h2o", "streamingllm", "local"],
            XSUM_BUDGETS,
            "rouge_mean",
            mode="mean",
            # The tops of the reported ranges: the smallest gaps.
            paper_gaps={
                "h2o": relative_gap(12.3, 11.8),
                "streamingllm": relative_gap(12.3, 11.9),
                "local": relative_gap(12.3, 7.6),
            },
        ),
    ),
    Claim(
        id="buzz-xsum-10pct",
        paper="BUZZ",
        paper_says="Table 2: at 10% cache StreamingLLM collapses to 3.8 mean ROUGE on XSUM while BUZZ keeps 10.9 (H2O 10.2).",
        task="xsum",
        methods=("buzz", "h2o", "streamingllm"),
        budgets=(0.1,),
        metric="rouge_mean",
        check=outperforms(
            "xsum",
            "buzz",
            ["h2o", "streamingllm"],
            (0.1,),
            "rouge_mean",
            paper_gaps={"h2o": relative_gap(10.9, 10.2), "streamingllm": relative_gap(10.9, 3.8)},
        ),
    ),
    Claim(
        id="buzz-ppl",
        paper="BUZZ",
        paper_says="Table 3 (WikiText perplexity, cache 50 / 100 tokens): BUZZ 9.394 / 8.037 vs H2O 9.987 / 8.881, StreamingLLM 11.722 / 9.330, Local 194.8 / 35.98 (full 7.382).",
        task="ppl",
        methods=("buzz", "h2o", "streamingllm", "local", "buzz-logn"),
        budgets=(50, 100),
        check=outperforms(
            "ppl",
            "buzz",
            ["h2o", "streamingllm", "local"],
            (50, 100),
            shown=("buzz-logn",),
            # The smaller of the two budgets' gaps (lower perplexity is better).
            paper_gaps={
                "h2o": relative_gap(9.394, 9.987, higher_is_better=False),
                "streamingllm": relative_gap(8.037, 9.330, higher_is_better=False),
                "local": relative_gap(8.037, 35.98, higher_is_better=False),
            },
        ),
    ),
    Claim(
        id="buzz-mdqa",
        paper="BUZZ",
        paper_says="Multi-document QA (10 documents, gold at position 0/4/9, cache about 25% of the input): BUZZ has the best average EM, ahead of H2O and StreamingLLM (abstract: +7.69%).",
        task="mdqa",
        methods=("buzz", "h2o", "streamingllm"),
        budgets=(0.25,),
        # The abstract's +7.69% average, taken as relative to each baseline.
        check=outperforms(
            "mdqa", "buzz", ["h2o", "streamingllm"], (0.25,), paper_gaps={"h2o": 0.0769, "streamingllm": 0.0769}
        ),
    ),
    # ---------------------------------------------------------------- Ada-KV (adakv.txt)
    mean_claim(
        id="ada-snapkv-needle",
        paper="Ada-KV",
        paper_says="Needle-in-a-Haystack: adaptive allocation improves retrieval; average score Ada-SnapKV 95.99 vs SnapKV 94.84.",
        task="needle",
        candidate="ada-snapkv",
        baselines=("snapkv",),
        budgets=SMALL_TOKEN_BUDGETS,
        paper_gaps={"snapkv": relative_gap(95.99, 94.84)},
    ),
    mean_claim(
        id="ada-pyramid-needle",
        paper="Ada-KV",
        paper_says="Needle-in-a-Haystack: average score Ada-Pyramid 96.69 vs Pyramid 96.02.",
        task="needle",
        candidate="ada-pyramidkv",
        baselines=("pyramidkv",),
        budgets=SMALL_TOKEN_BUDGETS,
        paper_gaps={"pyramidkv": relative_gap(96.69, 96.02)},
    ),
    # The single needle is found by nearly every method on this model; the multi-key variant
    # (several look-alike needles, one asked) is where allocations differ.
    mean_claim(
        id="ada-snapkv-needle-multikey",
        paper="Ada-KV",
        paper_says="Needle-in-a-Haystack (adaptive allocation keeps more of the heads that attend to the needle): Ada-SnapKV 95.99 vs SnapKV 94.84 on average; here the harder multi-key variant.",
        task="needle_multikey",
        candidate="ada-snapkv",
        baselines=("snapkv",),
        budgets=SMALL_TOKEN_BUDGETS,
        paper_gaps={"snapkv": relative_gap(95.99, 94.84)},
    ),
    mean_claim(
        id="ada-pyramid-needle-multikey",
        paper="Ada-KV",
        paper_says="Needle-in-a-Haystack: Ada-Pyramid 96.69 vs Pyramid 96.02 on average; here the harder multi-key variant.",
        task="needle_multikey",
        candidate="ada-pyramidkv",
        baselines=("pyramidkv",),
        budgets=SMALL_TOKEN_BUDGETS,
        paper_gaps={"pyramidkv": relative_gap(96.69, 96.02)},
    ),
    mean_claim(
        id="ada-snapkv-kv-retrieval",
        paper="Ada-KV",
        paper_says="Needle-in-a-Haystack: adaptive allocation improves retrieval; Ada-SnapKV 95.99 vs SnapKV 94.84 on average; here lost-in-the-middle's key-value retrieval (75 UUID pairs, about 5.2k tokens).",
        task="kv_retrieval",
        candidate="ada-snapkv",
        baselines=("snapkv",),
        budgets=SMALL_TOKEN_BUDGETS,
        paper_gaps={"snapkv": relative_gap(95.99, 94.84)},
    ),
    mean_claim(
        id="ada-snapkv-mdqa",
        paper="Ada-KV",
        paper_says="LongBench (16 datasets, Mistral-7B, B=128h): Ada-SnapKV raises the average from 35.09 to 36.71 over SnapKV, gains largest at small budgets.",
        task="mdqa",
        candidate="ada-snapkv",
        baselines=("snapkv",),
        budgets=SMALL_TOKEN_BUDGETS,
        paper_gaps={"snapkv": relative_gap(36.71, 35.09)},
    ),
    mean_claim(
        id="ada-pyramid-mdqa",
        paper="Ada-KV",
        paper_says="LongBench (Mistral-7B, B=128h): Ada-Pyramid raises the average from 35.58 to 36.81 over Pyramid.",
        task="mdqa",
        candidate="ada-pyramidkv",
        baselines=("pyramidkv",),
        budgets=SMALL_TOKEN_BUDGETS,
        paper_gaps={"pyramidkv": relative_gap(36.81, 35.58)},
    ),
    # ---------------------------------------------------------------- BumbleBee (bumblebee.txt)
    Claim(
        id="bumblebee-piqa",
        paper="BumbleBee",
        paper_says="Table 1 (5-shot PIQA, 10% cache, LLaMA-7B): BumbleBee (log) 78.24 vs H2+Local 77.31, Attention sinks+Local 78.07, Local 58.27 (All 80.03).",
        task="piqa",
        methods=("bumblebee", "h2o", "streamingllm", "local", "random", "bumblebee-power"),
        budgets=(0.1,),
        check=outperforms(
            "piqa",
            "bumblebee",
            ["h2o"],
            (0.1,),
            shown=("streamingllm", "local", "random", "bumblebee-power"),
            paper_gaps={"h2o": relative_gap(78.24, 77.31)},
        ),
    ),
    Claim(
        id="bumblebee-openbookqa",
        paper="BumbleBee",
        paper_says="Table 1 (5-shot OpenBookQA, 10% cache, LLaMA-7B): BumbleBee (log) 43.2 vs H2+Local 41.4, Attention sinks+Local 41.6, Local 28.4 (All 44.6).",
        task="openbookqa",
        methods=("bumblebee", "h2o", "streamingllm", "local", "random", "bumblebee-power"),
        budgets=(0.1,),
        check=outperforms(
            "openbookqa",
            "bumblebee",
            ["h2o"],
            (0.1,),
            shown=("streamingllm", "local", "random", "bumblebee-power"),
            paper_gaps={"h2o": relative_gap(43.2, 41.4)},
        ),
    ),
    # ---------------------------------------------------------------- SubGen (subgen.txt)
    Claim(
        id="subgen-lines",
        paper="SubGen",
        paper_says="Table 1 (LongEval lines, 200/300/400 lines, cache cut by 35/42/50%): SubGen 0.86/0.66/0.44 vs H2O 0.66/0.58/0.38 and Sink 0.56/0.56/0.38 (exact 0.98/1.0/0.68).",
        task="lines",
        methods=("subgen", "h2o", "streamingllm"),
        budgets=(0.5, 0.65),
        # The smallest gap over the three lengths.
        check=outperforms(
            "lines",
            "subgen",
            ["h2o", "streamingllm"],
            (0.5, 0.65),
            paper_gaps={"h2o": relative_gap(0.66, 0.58), "streamingllm": relative_gap(0.44, 0.38)},
        ),
    ),
    # ---------------------------------------------------------------- AhaKV (arXiv:2506.03762)
    mean_claim(
        id="ahakv-mdqa",
        paper="AhaKV",
        paper_says="Table 1 (LongBench multi-doc QA, LLaMA3-8B-Inst, 1000-token budget): AhaKV 31.85 vs SnapKV 31.06, H2O 30.76, TOVA 30.74, Sink 26.88 (full 32.33).",
        task="mdqa",
        candidate="ahakv",
        baselines=AHAKV_BASELINES,
        budgets=AHAKV_BUDGETS,
        paper_gaps=AHAKV_MDQA_GAPS,
    ),
    mean_claim(
        id="ahakv-needle",
        paper="AhaKV",
        paper_says="Table 1 (LongBench passage retrieval, LLaMA3-8B-Inst): AhaKV 54.83 vs SnapKV 54.33, TOVA 53.30, H2O 41.70, Sink 26.50 (full 54.83).",
        task="needle",
        candidate="ahakv",
        baselines=AHAKV_BASELINES,
        budgets=AHAKV_BUDGETS,
        paper_gaps=AHAKV_RETRIEVAL_GAPS,
    ),
    mean_claim(
        id="ahakv-needle-multikey",
        paper="AhaKV",
        paper_says="Table 1 (LongBench retrieval, LLaMA3-8B-Inst): AhaKV at or above SnapKV, TOVA, H2O and Sink (54.83 vs 54.33 / 53.30 / 41.70 / 26.50); here the multi-key needle.",
        task="needle_multikey",
        candidate="ahakv",
        baselines=AHAKV_BASELINES,
        budgets=AHAKV_BUDGETS,
        paper_gaps=AHAKV_RETRIEVAL_GAPS,
    ),
    mean_claim(
        id="ahakv-kv-retrieval",
        paper="AhaKV",
        paper_says="Table 1 (LongBench retrieval, LLaMA3-8B-Inst): AhaKV at or above SnapKV, TOVA, H2O and Sink (54.83 vs 54.33 / 53.30 / 41.70 / 26.50); here lost-in-the-middle's key-value retrieval (75 UUID pairs, about 5.2k tokens).",
        task="kv_retrieval",
        candidate="ahakv",
        baselines=AHAKV_BASELINES,
        budgets=AHAKV_BUDGETS,
        paper_gaps=AHAKV_RETRIEVAL_GAPS,
    ),
    Claim(
        id="ahakv-openbookqa-4pct",
        paper="AhaKV",
        paper_says="Figure 4 (OpenBookQA and other short texts, budgets 60%-4%): AhaKV tends to beat H2O as the budget shrinks and is best at the most extreme 4% budget.",
        task="openbookqa",
        methods=("ahakv", "h2o"),
        budgets=(0.04,),
        check=outperforms("openbookqa", "ahakv", ["h2o"], (0.04,)),
    ),
]


def evaluate_claims(summary: ResultsSummary, claims: Sequence[Claim] | None = None) -> list[CheckResult]:
    return [claim.check(summary) for claim in (CLAIMS if claims is None else claims)]


def claims_grid(
    claims: Sequence[Claim] | None = None,
) -> tuple[list[str], dict[str, list[str]], dict[str, list[float | int]]]:
    """(tasks, methods per task, budgets per task) covering every claim (the union per task)."""
    tasks: list[str] = []
    methods: dict[str, list[str]] = {}
    budgets: dict[str, list[float | int]] = {}
    for claim in CLAIMS if claims is None else claims:
        if claim.task not in tasks:
            tasks.append(claim.task)
        for method in claim.methods:
            methods.setdefault(claim.task, [])
            if method not in methods[claim.task]:
                methods[claim.task].append(method)
        for budget in claim.budgets:
            known = budgets.setdefault(claim.task, [])
            if budget_key(budget) not in {budget_key(b) for b in known}:
                known.append(budget)
    for _task, values in budgets.items():
        values.sort(key=lambda b: (isinstance(b, int), float(b)))  # ratios first, then tokens, ascending
    return tasks, methods, budgets


def claim_ids() -> list[str]:
    return [c.id for c in CLAIMS]


__all__ = [
    "Claim",
    "CLAIMS",
    "paired_items",
    "on_items",
    "outperforms",
    "retains_full",
    "evaluate_claims",
    "claims_grid",
    "claim_ids",
]
