"""Noise checks for claim verdicts: a paired bootstrap over items and Holm's correction.

A claim compares statistics of two settings run on the same items: a mean of a per-item metric
(accuracy, exact match), or a corpus statistic that is not a mean of per-item values (perplexity
``exp(sum NLL / sum tokens)``; BUZZ's mean ROUGE, the geometric mean of the item-averaged ROUGE-1,
ROUGE-2 and ROUGE-L). Its noise comes from the items, so the interval comes from resampling items
with both settings together (the pairing removes item difficulty, which dwarfs method
differences at small n); every statistic here is a function of means of per-item components, so
one resample is a weighted mean of the item matrix.

A claim resting on several comparisons (each baseline, each budget) is decided only when each
comparison's interval, widened by Holm's step-down correction over that family, excludes the
null value. The bootstrap has a fixed seed, so a re-rendered report gives the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

BOOTSTRAP_RESAMPLES = 5000
BOOTSTRAP_SEED = 0
ROUNDING_DECIMALS = 12
# Fewer items than this decide nothing: a percentile interval over a handful of items is too
# narrow (4 items have at most 35 distinct resamples), so it is shown but not trusted.
MIN_DECIDING_ITEMS = 10
FAMILY_ERROR_RATE = 0.05  # Holm: the chance that any comparison of a claim's family is decided wrongly


@dataclass(frozen=True)
class Statistic:
    """How a metric's value over a set of items is computed: ``combine`` of the means of the
    per-item ``components`` (``[..., C]`` means -> ``[...]`` values)."""

    metric: str
    components: tuple[str, ...]
    combine: Callable[[np.ndarray], np.ndarray] = field(compare=False, repr=False)


def _first_component(means: np.ndarray) -> np.ndarray:
    return means[..., 0]


def _corpus_perplexity(means: np.ndarray) -> np.ndarray:
    return np.exp(means[..., 0] / means[..., 1])


def _geometric_mean_of_three(means: np.ndarray) -> np.ndarray:
    return np.cbrt(np.clip(means, 0.0, None).prod(axis=-1))


def statistic_of(kind: str, metric: str) -> Statistic:
    """The statistic the report shows for ``metric`` of a task of ``kind`` (see metrics.py)."""
    if kind == "perplexity" and metric == "ppl":
        return Statistic(metric, ("nll_sum", "n_tokens"), _corpus_perplexity)
    if metric == "rouge_mean":
        return Statistic(metric, ("rouge1", "rouge2", "rougeL"), _geometric_mean_of_three)
    return Statistic(metric, (metric,), _first_component)


def item_matrix(metrics: Sequence[Mapping[str, float]], statistic: Statistic) -> np.ndarray | None:
    """``[items, components]`` of per-item values, or None when an item lacks a finite component
    (then no interval can be computed from these items)."""
    rows = []
    for item in metrics:
        values = [item.get(name) for name in statistic.components]
        if any(v is None or isinstance(v, bool) or not np.isfinite(float(v)) for v in values):
            return None
        rows.append([float(v) for v in values])
    return np.asarray(rows, dtype=np.float64).reshape(len(rows), len(statistic.components))


@dataclass(frozen=True)
class Bootstrap:
    """A paired contrast's point estimate on the items and its ``resampled`` values."""

    estimate: float
    resampled: np.ndarray = field(compare=False, repr=False)
    items: int

    @property
    def standard_error(self) -> float:
        return float(self.resampled.std(ddof=1))


def paired_bootstrap(
    candidate: np.ndarray,
    baseline: np.ndarray,
    statistic: Statistic,
    contrast: str = "difference",
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> Bootstrap:
    """Paired bootstrap of ``statistic(candidate) - statistic(baseline)`` (``contrast="difference"``)
    or of their ratio (``"ratio"``), averaged over the first axis (budgets).

    ``candidate`` and ``baseline``: ``[budgets, items, components]`` with item ``i`` the same item
    in both and at every budget; one resample draws items with replacement and applies the same
    draw to both settings at every budget."""
    if contrast not in ("difference", "ratio"):
        raise ValueError(f"invalid contrast={contrast!r}: expected 'difference' or 'ratio'")
    if candidate.shape != baseline.shape or candidate.ndim != 3:
        raise ValueError(
            f"paired arrays must have equal [budgets, items, components] shapes: {candidate.shape} vs {baseline.shape}"
        )
    items = candidate.shape[1]
    if items < 2:
        raise ValueError(f"a paired bootstrap needs at least 2 items, got {items}")
    rng = np.random.default_rng(seed)
    weights = rng.multinomial(items, np.full(items, 1.0 / items), size=resamples) / items  # [R, n]

    def contrast_of(mine: np.ndarray, theirs: np.ndarray) -> np.ndarray:
        values = mine - theirs if contrast == "difference" else mine / theirs
        return values.mean(axis=-1)

    def values(data: np.ndarray, item_weights: np.ndarray) -> np.ndarray:
        # [R, n] x [S, n, C] -> [R, S, C] means -> [R, S]
        return statistic.combine(np.einsum("rn,snc->rsc", item_weights, data))

    uniform = np.full((1, items), 1.0 / items)
    with np.errstate(divide="ignore", invalid="ignore"):
        estimate = float(contrast_of(values(candidate, uniform), values(baseline, uniform))[0])
        resampled = contrast_of(values(candidate, weights), values(baseline, weights))
    if not np.isfinite(estimate) or not np.all(np.isfinite(resampled)):
        raise ValueError(f"the {contrast} of {statistic.metric} is not finite on some resample of the items")
    # Weighted means carry rounding error (1e-17 where the contrast is exactly 0); it must not
    # decide on which side of 0 an interval ends.
    return Bootstrap(round(estimate, ROUNDING_DECIMALS), np.round(resampled, ROUNDING_DECIMALS), items)


@dataclass(frozen=True)
class CorrectedComparison:
    """One comparison of a family after Holm's correction.

    ``low``/``high``: the percentile interval at level ``1 - error_rate`` where ``error_rate`` is
    Holm's for this comparison's rank; ``decided``: the interval excludes ``null`` and every
    comparison of smaller p-value was decided too (Holm's step-down), on at least
    ``MIN_DECIDING_ITEMS`` items."""

    label: str
    estimate: float
    standard_error: float
    low: float
    high: float
    level: float
    null: float
    decided: bool
    items: int
    family_size: int

    @property
    def excludes_null(self) -> bool:
        return self.low > self.null or self.high < self.null

    def text(self, digits: int = 3) -> str:
        if self.decided:
            verdict = ""
        elif not self.excludes_null:
            verdict = f", includes {self.null:g}"
        elif self.items < MIN_DECIDING_ITEMS:
            verdict = f", n={self.items} < {MIN_DECIDING_ITEMS} items: too few to decide"
        else:
            verdict = ", not decided: Holm's step-down stopped at a comparison of smaller p-value"
        sign = "+" if self.null == 0 else ""
        return (
            f"{self.label} {self.estimate:{sign}.{digits}g} [{self.low:{sign}.{digits}g}, {self.high:{sign}.{digits}g}] "
            f"(s.e. {self.standard_error:.2g}; {self.level:.1%} interval{verdict})"
        )


def bootstrap_p_value(resampled: np.ndarray, null: float) -> float:
    """Two-sided bootstrap p-value of ``null``: twice the smaller tail of the resampled contrast."""
    tail = min(float(np.mean(resampled <= null)), float(np.mean(resampled >= null)))
    return min(1.0, 2.0 * tail)


def holm_corrected(
    comparisons: Sequence[tuple[str, Bootstrap]], null: float = 0.0, error_rate: float = FAMILY_ERROR_RATE
) -> list[CorrectedComparison]:
    """Holm's step-down over a family: sorted by bootstrap p-value, the comparison of rank ``r``
    (0-based) of ``m`` gets the interval at level ``1 - error_rate / (m - r)``; it is decided when
    that interval excludes ``null`` and every earlier one was decided. Returned in input order."""
    m = len(comparisons)
    order = sorted(range(m), key=lambda i: (bootstrap_p_value(comparisons[i][1].resampled, null), i))
    results: dict[int, CorrectedComparison] = {}
    still_rejecting = True
    for rank, index in enumerate(order):
        label, boot = comparisons[index]
        alpha = error_rate / (m - rank)
        low, high = (float(q) for q in np.quantile(boot.resampled, [alpha / 2, 1 - alpha / 2]))
        excludes = low > null or high < null
        still_rejecting = still_rejecting and excludes and boot.items >= MIN_DECIDING_ITEMS
        results[index] = CorrectedComparison(
            label=label,
            estimate=boot.estimate,
            standard_error=boot.standard_error,
            low=low,
            high=high,
            level=1 - alpha,
            null=null,
            decided=still_rejecting,
            items=boot.items,
            family_size=m,
        )
    return [results[i] for i in range(m)]


__all__ = [
    "BOOTSTRAP_RESAMPLES",
    "BOOTSTRAP_SEED",
    "FAMILY_ERROR_RATE",
    "MIN_DECIDING_ITEMS",
    "Bootstrap",
    "CorrectedComparison",
    "Statistic",
    "bootstrap_p_value",
    "holm_corrected",
    "item_matrix",
    "paired_bootstrap",
    "statistic_of",
]
