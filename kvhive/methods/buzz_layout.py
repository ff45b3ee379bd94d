"""BUZZ's layout arithmetic (Zhao et al., 2024; docs/METHODS.md, "BUZZ"): the window ``w`` and
threshold ``T`` a budget gives (Theorem 3.1 / Eq. 6, in the mean and the peak reading of a budget),
the exact old-sample recurrence of Eq. (10) and its steady state, and where one eviction cuts a
layer (:func:`eviction_plan`, Remark 2's thinning rounds included). Host integers only: the policy
in :mod:`kvhive.methods.buzz` applies these sizes to the scores.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction

# Evictions of Eq. (10) iterated to reach the steady state (it contracts by < 1/ŝ - ... per step;
# 200 is far past convergence for any stride >= 3), and the tail averaged over (covers cycles).
_STEADY_ITERATIONS, _STEADY_TAIL = 200, 24


def small_stride(stride: int) -> int:
    """``ŝ = floor((s + 1) / 2)`` (Table 1)."""
    return (stride + 1) // 2


def theorem_ratio(stride: int) -> Fraction:
    """Theorem 3.1 (Eq. 6): ``T / w = (s² + 1)/(s + 1)`` for odd ``s``, ``s − 1`` for even ``s``."""
    if stride % 2 == 1:
        return Fraction(stride * stride + 1, stride + 1)
    return Fraction(stride - 1)


@dataclass(frozen=True)
class BuzzLayout:
    sink: int
    window: int
    threshold: int
    stride: int = 5

    @property
    def peak(self) -> int:
        """The most tokens a layer holds after a step: ``k + w + T``."""
        return self.sink + self.window + self.threshold

    @property
    def steady_mean(self) -> Fraction:
        """The mean number of tokens held per decode step in the steady state (exact, Eq. 10)."""
        return steady_state_sizes(self)[0]


def steady_state_sizes(layout: BuzzLayout) -> tuple[Fraction, int]:
    """``(mean size held per step, largest old-sample count)`` in the steady state of Eq. (10).

    After an eviction leaving ``a`` old samples a layer holds ``k + w + a`` tokens and grows by
    one per step to ``k + w + T``; averaged over the last evictions of the exact recurrence."""
    sizes = _steady_tail(layout.threshold, layout.stride)
    base = layout.sink + layout.window
    held = sum((layout.threshold - a + 1) * (2 * base + a + layout.threshold) for a in sizes)  # 2x sum of sizes
    steps = sum(layout.threshold - a + 1 for a in sizes)
    return Fraction(held, 2 * steps), max(sizes)


@functools.lru_cache(maxsize=4096)
def _steady_tail(threshold: int, stride: int) -> tuple[int, ...]:
    """``old_sample_sizes(threshold, stride, _STEADY_ITERATIONS)[-_STEADY_TAIL:]``, exactly, without
    iterating 200 times: Eq. (10) maps an integer to an integer, so the sequence enters a cycle as
    soon as a value repeats (within a few evictions: the map contracts), and every later term is
    read off the cycle."""
    sequence, first_seen = [0], {0: 0}  # a_0, a_1, ...; the index where each value first appeared
    hat = small_stride(stride)
    while len(sequence) <= _STEADY_ITERATIONS:
        old = sequence[-1]
        new = threshold + 1 - old
        following = -(-old // hat) + -(-new // stride)
        if following in first_seen:
            start = first_seen[following]
            cycle = sequence[start:]
            break
        first_seen[following] = len(sequence)
        sequence.append(following)
    else:
        start, cycle = len(sequence), []  # no repeat within the iterations: every term is in sequence
    terms = range(_STEADY_ITERATIONS - _STEADY_TAIL + 1, _STEADY_ITERATIONS + 1)  # a_177 .. a_200
    return tuple(sequence[n] if n < start else cycle[(n - start) % len(cycle)] for n in terms)


def _mean_lower_bound_room(budget: int, sink: int, window: int) -> int:
    """The largest threshold whose layout can have a steady mean ``<= budget``.

    Every old-sample count after an eviction is in ``[1, T + 1]`` (``T >= 3`` for every stride
    >= 3, and Eq. 10 maps ``[0, T + 1]`` into ``[1, (T + 1)/2 + 2]``), so the mean size
    ``k + w + (a + T)/2`` averaged with non-negative weights ``T - a + 1`` is at least
    ``k + w + (1 + T)/2``: thresholds above ``2(C - k - w) - 1`` cannot fit."""
    return 2 * (budget - sink - window) - 1


def _too_small(budget, sink: int, stride: int, form: str) -> ValueError:
    return ValueError(
        f"invalid budget={budget!r} for BUZZ (sink={sink}, stride={stride}, budget_form={form!r}): expected an "
        f"integer >= {minimum_buzz_budget(sink, stride, form)} so that the sink, a window >= 1 and a threshold "
        f"with threshold/window = {theorem_ratio(stride)} (Theorem 3.1) fit"
    )


def peak_layout(budget: int, sink: int, stride: int) -> BuzzLayout | None:
    """``(k, w, T)`` with ``k + w + T = budget`` (module docstring); None when no window fits."""
    ratio = theorem_ratio(stride)
    room = budget - sink
    window = math.floor(Fraction(room) / (1 + ratio)) if room > 0 else 0
    if window < 1:
        return None
    return BuzzLayout(sink=sink, window=window, threshold=room - window, stride=stride)


def mean_layout(budget: int, sink: int, stride: int) -> BuzzLayout | None:
    """``(k, w, T)`` whose exact steady-state mean size is the largest one ``<= budget``, among
    the windows next to ``2(C − k)/(3 + r)`` and thresholds ``ceil(r·w) .. ceil(r·w) + s``
    (Eq. 13/14's range ``[r, r + 2s/w)``); ties go to ``T/w`` nearest ``r``. Every candidate
    must also keep the cache within the budget after any eviction (``k + w + a <= C`` for the
    largest old-sample count reached from a prefill that filled the budget). None when none fits."""
    ratio = theorem_ratio(stride)
    if budget - sink < 2:
        return None
    centre = math.floor(2 * Fraction(budget - sink) / (3 + ratio))
    best, best_key = None, None
    for window in range(max(1, centre - 2), centre + 3):
        lowest = math.ceil(ratio * window)
        # Thresholds past the lower bound on the mean are skipped without computing their mean
        # (they would fail ``mean > budget`` below): a search near the smallest budget is short.
        highest = min(lowest + stride, _mean_lower_bound_room(budget, sink, window))
        for threshold in range(lowest, highest + 1):
            layout = BuzzLayout(sink=sink, window=window, threshold=threshold, stride=stride)
            mean, largest = steady_state_sizes(layout)
            room = budget - sink - window
            if mean > budget or largest > room:
                continue
            # From a prefill that left the most old samples the budget allows, the next evictions
            # must stay within the budget too (Eq. 10 contracts towards a*, up to the ceilings).
            if max(old_sample_sizes(threshold, stride, 4, start=room)) > room:
                continue
            key = (mean, -abs(Fraction(threshold, window) - ratio))
            if best_key is None or key > best_key:
                best, best_key = layout, key
    return best


def layout_for_budget(budget: int, sink: int, stride: int, form: str = "mean") -> BuzzLayout:
    """``(k, w, T)`` for a budget ``C`` read as the mean (default) or the peak size held, with
    ``T / w`` from Theorem 3.1. Raises ValueError naming ``budget`` when ``C`` is too small."""
    layout = mean_layout(budget, sink, stride) if form == "mean" else peak_layout(budget, sink, stride)
    if layout is None:
        raise _too_small(budget, sink, stride, form)
    return layout


def minimum_buzz_budget(sink: int, stride: int, form: str = "mean") -> int:
    """The smallest budget with a layout (window >= 1).

    A layout's fit depends on ``budget - sink`` only (the sink adds to every size), so the
    smallest budget is ``sink`` plus the smallest one without a sink."""
    if form == "peak":
        return sink + math.ceil(1 + theorem_ratio(stride))
    return sink + _minimum_mean_budget_without_sink(stride)


@functools.lru_cache(maxsize=256)
def _minimum_mean_budget_without_sink(stride: int) -> int:
    """The smallest sink-free budget with a mean-form layout, searched upwards from a lower bound:
    any layout holds on average at least ``w + (1 + T)/2 >= 1 + (1 + ceil(r))/2`` tokens
    (:func:`_mean_lower_bound_room`; ``w >= 1``, ``T >= ceil(r w)``), so no smaller budget fits, and
    the search starts a few budgets below the answer instead of at 2 (a linear search from 2 took
    minutes at stride 1000)."""
    budget = max(2, math.ceil(1 + Fraction(1 + math.ceil(theorem_ratio(stride)), 2)))
    while mean_layout(budget, 0, stride) is None:
        budget += 1
    return budget


def old_sample_sizes(threshold: int, stride: int, evictions: int, start: int = 0) -> list[int]:
    """The exact recurrence of Eq. (10) for steady decoding: ``a_n`` after each eviction, each
    eviction seeing ``T + 1`` tokens between sink and window."""
    sizes, old, hat = [], start, small_stride(stride)
    for _ in range(evictions):
        new = threshold + 1 - old
        old = -(-old // hat) + -(-new // stride)
        sizes.append(old)
    return sizes


def rounds_for(capacity: int, hat: int) -> int:
    """Rounds of Remark 2 after which ``ŝ**rounds >= capacity``: any count of samples then fits in
    one token, so the host loop of :func:`eviction_plan` would have stopped by then."""
    rounds, step = 0, 1
    while step < capacity:
        step *= hat
        rounds += 1
    return rounds


@dataclass(frozen=True)
class EvictionPlan:
    """Where one eviction cuts a layer of ``n`` stored tokens (host integers, the same for every
    row and head): the sink ends at ``sink_end``, the old samples at ``old_end``, the window starts
    at ``window_start``; ``samples`` old samples remain after ``rounds`` extra rounds of Remark 2
    (every ``thinning``-th sample kept); ``kept`` tokens per row in all."""

    sink_end: int
    old_end: int
    window_start: int
    samples: int
    rounds: int
    thinning: int
    kept: int


def eviction_plan(layout: BuzzLayout, n: int, padding: int, old: int, limit: int) -> EvictionPlan | None:
    """The eviction of a layer holding ``n`` tokens (``padding`` of them at the front of every row,
    ``old`` old samples after the sink) that may keep at most ``limit`` tokens (the budget, or the
    peak for a prefill with ``prefill_fit="peak"``); None below the threshold (nothing evicted).
    Sizes only, from the host's counts: Eq. (10) gives the number of samples whatever the scores."""
    # Everything below counts real tokens from the first one (a row alone has no padding).
    real = n - padding
    sink_end = padding + min(layout.sink, real)
    window_start = max(sink_end, n - layout.window)
    old_end = min(sink_end + old, window_start)
    old = old_end - sink_end
    if window_start - sink_end <= layout.threshold:
        return None
    stride = layout.stride
    hat = small_stride(stride)
    count = -(-old // hat) + -(-(window_start - old_end) // stride)
    # The authors' code samples once; where that exceeds what the cache may hold after an
    # eviction (the limit), Remark 2: sample the old samples again with ŝ until they fit
    # (r rounds = stride ŝ**r).
    room = limit - layout.sink - layout.window
    step, rounds = 1, 0
    while -(-count // step) > room:
        step *= hat
        rounds += 1
    count = -(-count // step)
    kept = (sink_end - padding) + count + (n - window_start)
    return EvictionPlan(sink_end, old_end, window_start, count, rounds, step, kept)


@functools.lru_cache(maxsize=1024)
def cached_layout(budget: int, sink: int, stride: int, form: str) -> BuzzLayout:
    return layout_for_budget(budget, sink, stride, form)
