"""Ada-KV's allocation functions against plain-Python references written from their docstrings
(the authors' head budgets with the exact-total settlement; kvpress's safeguard + global top),
on random instances that reach every branch: rounding that misses the layer total in both
directions, heads with no room left at their candidates or at zero, padding, and the early exits.
Written for the mutants the mutation run left alive (results/mutation/summary.md)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kvhive.methods.adakv import AdaSnapKV, adaptive_allocation, allocate, authors_head_budgets, keep_head_budgets


def _floor(budget: int, alpha: float) -> int:
    return max(0, min(budget, math.floor(alpha * budget + 1e-9)))


def _round_half_even(x: float) -> int:
    return int(round(x))  # Python rounds half to even, as torch.round


def reference_head_budgets(row_scores: list[list[float]], budget: int, alpha: float, stats: dict) -> list[int]:
    """One row: f_i = entries of head i among the row's top H x budget (distinct scores);
    B_i = round((1 - alpha) f_i + floor(alpha budget)); then the total is made H x budget by moving
    one unit at a time to (or from) the heads with the largest remainder target - B_i (or B_i -
    target), ties to the lower head index, never above the head's candidates nor below zero."""
    heads, candidates = len(row_scores), len(row_scores[0])
    flat = sorted(((value, head) for head, values in enumerate(row_scores) for value in values), reverse=True)
    owned = [0] * heads
    for _, head in flat[: heads * budget]:
        owned[head] += 1
    targets = [(1 - alpha) * f + _floor(budget, alpha) for f in owned]
    budgets = [_round_half_even(t) for t in targets]
    total = heads * budget
    missing = total - sum(budgets)
    stats["above" if missing < 0 else "below" if missing > 0 else "exact"] += 1
    while missing != 0:
        step = 1 if missing > 0 else -1
        has_room = [budgets[i] < candidates if step > 0 else budgets[i] > 0 for i in range(heads)]
        by_remainder = sorted(range(heads), key=lambda i: (-(targets[i] - budgets[i]) * step, i))
        order = [i for i in by_remainder if has_room[i]]
        for head in order[: abs(missing)]:
            if step > 0 and budgets[head] == 0:
                stats["a head at 0 raised"] += 1
            if abs(missing) < len(order) and targets[order[abs(missing) - 1]] - budgets[order[abs(missing) - 1]] == (
                targets[order[abs(missing)]] - budgets[order[abs(missing)]]
            ):
                stats["tie at the cut"] += 1
            budgets[head] += step
        missing = total - sum(budgets)
    return budgets


def _instances(count: int):
    rng = random.Random(0)
    for _ in range(count):
        heads, candidates = rng.randint(1, 6), rng.randint(2, 9)
        budget = rng.randint(1, candidates - 1)
        alpha = rng.choice([0.0, 0.1, 0.2, 0.25, 0.5, 0.7, 0.9, 1.0])
        # Concentrated scores (a few heads own the top) make the rounding and the room bind.
        spread = [rng.choice([0.0, 0.5, 3.0, 8.0]) for _ in range(heads)]
        scores = [[rng.random() + spread[h] for _ in range(candidates)] for h in range(heads)]
        yield scores, budget, alpha


def test_authors_head_budgets_equal_the_reference_on_every_branch():
    stats = dict.fromkeys(["above", "below", "exact", "a head at 0 raised", "tie at the cut"], 0)
    for scores, budget, alpha in _instances(3000):
        expected = reference_head_budgets(scores, budget, alpha, stats)
        got = authors_head_budgets(torch.tensor([scores], dtype=torch.float64), budget, alpha)
        assert got.dtype == torch.long
        assert got[0].tolist() == expected, (scores, budget, alpha)
        assert sum(expected) == len(scores) * budget
    # The instances reached every branch of the settlement, so a wrong branch would have failed.
    # (The "no room" guards never bind, and a head at 1 is never lowered: a head's target is below
    # its candidates, and an exhaustive search over H <= 5, M <= 9, every owned-count vector and
    # 14 alphas found no instance where a head at its candidates, at 0 or at 1 is next in line to
    # lose or gain; results/mutation/summary.md lists the mutants of those guards as equivalent.)
    assert all(count > 0 for count in stats.values()), str(stats)


def test_authors_head_budgets_rank_padding_last_per_row():
    torch.manual_seed(0)
    scores = torch.rand(2, 3, 8)
    valid = torch.ones(2, 3, 8, dtype=torch.bool)
    valid[1, :, :3] = False  # row 1: three padded positions in every head
    got = authors_head_budgets(scores, 2, 0.5, valid)
    stats = dict.fromkeys(["above", "below", "exact", "a head at 0 raised", "tie at the cut"], 0)
    assert got[0].tolist() == reference_head_budgets(scores[0].tolist(), 2, 0.5, stats)
    padded = torch.where(valid[1], scores[1], torch.full_like(scores[1], -1e30))
    assert got[1].tolist() == reference_head_budgets(padded.tolist(), 2, 0.5, stats)
    # Padding is never kept while a real key is left (5 real keys per head, 2 kept on average).
    keep = keep_head_budgets(scores, got, valid)
    assert not bool((keep & ~valid).any())


def reference_kvpress_keep(row_scores: list[list[float]], budget: int, alpha: float) -> list[list[bool]]:
    heads, candidates = len(row_scores), len(row_scores[0])
    floor = _floor(budget, alpha)
    keep = [[False] * candidates for _ in range(heads)]
    for head, values in enumerate(row_scores):
        for index in sorted(range(candidates), key=lambda i: -values[i])[:floor]:
            keep[head][index] = True
    rest = sorted(
        (
            (values[i], head, i)
            for head, values in enumerate(row_scores)
            for i in range(candidates)
            if not keep[head][i]
        ),
        reverse=True,
    )
    for _, head, index in rest[: heads * (budget - floor)]:
        keep[head][index] = True
    return keep


def test_kvpress_allocation_equals_the_reference():
    for scores, budget, alpha in _instances(1500):
        got = adaptive_allocation(torch.tensor([scores], dtype=torch.float64), budget, alpha)
        assert got.dtype == torch.bool
        assert got[0].tolist() == reference_kvpress_keep(scores, budget, alpha), (scores, budget, alpha)
    # One head, one token, no safeguard: the whole budget is the adaptive part (a single entry).
    assert adaptive_allocation(torch.tensor([[[0.1, 0.9, 0.3]]]), 1, 0.5).tolist() == [[[False, True, False]]]


@pytest.mark.parametrize("function", [adaptive_allocation, lambda s, b, a: allocate(s, b, a, "authors")])
def test_early_exits_return_boolean_masks_of_the_scores_shape(function):
    scores = torch.rand(2, 3, 5, dtype=torch.float64)
    everything = function(scores, 5, 0.5)
    assert everything.dtype == torch.bool and everything.shape == scores.shape and bool(everything.all())
    assert bool(function(scores, 9, 0.5).all())
    for budget in (0, -2):
        nothing = function(scores, budget, 0.5)
        assert nothing.dtype == torch.bool and nothing.shape == scores.shape and not bool(nothing.any())
    # the smallest budget that allocates: H x 1 entries per row, not an early exit
    one = function(scores, 1, 0.5)
    assert one.sum(dim=(1, 2)).tolist() == [3, 3]


def test_keep_head_budgets_keeps_each_heads_own_top():
    scores = torch.tensor([[[0.1, 0.9, 0.5, 0.7], [0.8, 0.2, 0.6, 0.4]]])
    keep = keep_head_budgets(scores, torch.tensor([[3, 1]]))
    assert keep.tolist() == [[[False, True, True, True], [True, False, False, False]]]
    assert keep.dtype == torch.bool


@pytest.mark.parametrize("allocation", ["authors", "kvpress"])
def test_protected_sinks_path_serves_each_row_of_a_padded_batch_as_alone(allocation):
    """``AdaKV._keep_with_protected`` (sinks protected, not a trailing window): each row of a
    left-padded batch keeps its sinks plus the allocation of ``H x (budget - sinks)`` over its own
    real, unprotected tokens, as the row alone; padding is never kept; a budget equal to the
    protected count keeps only the protected tokens."""
    generator = torch.Generator().manual_seed(11)
    scores = torch.rand(2, 3, 16, generator=generator)
    valid = torch.ones(2, 3, 16, dtype=torch.bool)
    valid[1, :, :5] = False  # row 1 is left-padded by 5
    protected = torch.zeros(2, 3, 16, dtype=torch.bool)
    protected[0, :, 0] = True  # each row's first real token is its sink
    protected[1, :, 5] = True
    # Padding would win every head's ranking if it were not masked.
    scores[1, :, :5] = 10.0
    policy = AdaSnapKV(window=2, kernel=1, allocation=allocation)
    keep = policy._keep_with_protected(scores, protected, 5, valid)
    for row in range(2):
        alone = policy._keep_with_protected(scores[row : row + 1], protected[row : row + 1], 5, valid[row : row + 1])
        assert torch.equal(keep[row], alone[0]), row
        selectable = valid[row : row + 1] & ~protected[row : row + 1]
        expected = (
            allocate(
                scores[row : row + 1].masked_fill(protected[row : row + 1], float("-inf")),
                4,
                policy.config.alpha,
                allocation,
                selectable,
            )[0]
            | protected[row]
        )
        assert torch.equal(keep[row], expected), row
        assert int(keep[row].sum()) == 3 * 5
    assert not bool((keep & ~valid).any())
    only_sinks = policy._keep_with_protected(scores, protected, 1, valid)
    assert torch.equal(only_sinks, protected)


def test_authors_head_budgets_settle_a_missed_total_without_reading_the_device():
    # The settlement runs as tensor passes: no host read, even where the rounding missed the total
    # (it read every head's remainder on the host before, so a prefill's reads grew with the data).
    from kvhive.diagnostics import HostReadCounter

    stats = dict.fromkeys(["above", "below", "exact", "a head at 0 raised", "tie at the cut"], 0)
    missed = 0
    for scores, budget, alpha in _instances(300):
        expected = reference_head_budgets(scores, budget, alpha, stats)
        before = stats["exact"]
        row = torch.tensor([scores], dtype=torch.float64)
        with HostReadCounter() as reads:
            got = authors_head_budgets(row, budget, alpha)
        assert reads.total == 0, reads.reads
        assert got[0].tolist() == expected
        missed += stats["exact"] == before
    assert missed > 0  # the settlement ran
