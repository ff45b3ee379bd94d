"""The CPU's exact gains in pieces that stop once a row's step has settled
(``_GreedyState.settling_gains``): the best gain, the gains it evaluates and the kept sets are the ones
evaluating every candidate gives, also with ties (duplicate keys, equal weights) and padding."""

from __future__ import annotations

import pytest
import torch

import kvhive.methods.submodular as submodular
from kvhive.methods.submodular import Concave, Mixture, _GreedyState, greedy_maximize, relu_cosine_similarity

from helpers import random_objective


def tied_objective(rows=5, n=90, seed=0) -> Mixture:
    """Keys drawn from a few directions (exact duplicates: equal gains) and weights of 3 values."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(rows, 7, 6, generator=generator)
    keys = base.gather(1, torch.randint(0, 7, (rows, n, 1), generator=generator).expand(rows, n, 6))
    weights = torch.randint(0, 3, (rows, n), generator=generator).float()
    valid = torch.ones(rows, n, dtype=torch.bool)
    valid[1, :4] = False
    return Mixture(relu_cosine_similarity(keys, valid), weights, valid, 0.5, Concave("log"))


def _one_piece_per_candidate(monkeypatch, objective):
    # One candidate per row in each piece: a row can stop after any candidate.
    monkeypatch.setattr(submodular, "_GAIN_CHUNK", objective.rows * objective.size)


@pytest.mark.parametrize("objective", [random_objective(rows=4, n=60, seed=2), tied_objective()])
def test_pieces_give_the_best_gain_and_the_exact_gains_of_a_full_evaluation(monkeypatch, objective):
    rows, n = objective.rows, objective.size
    state = _GreedyState(objective)
    bounds = objective.row_sums.double() * objective.facility_scale[:, None]
    stopped = 0
    for step in range(12):
        feature = state.feature_gains(torch.arange(n).expand(rows, n))
        stale = (bounds + feature).masked_fill(~objective.valid, submodular.PADDING_GAIN)
        stale = stale.masked_fill(state.chosen, float("-inf"))
        top = stale.topk(n, dim=-1)
        elements = top.indices[:, :40]
        args = (elements, feature.gather(1, elements), objective.valid.gather(1, elements), top.values)
        full_bounds, piece_bounds = bounds.clone(), bounds.clone()
        monkeypatch.setattr(submodular, "_GAIN_CHUNK", 1 << 30)  # one piece: every candidate
        exact, best = state.settling_gains(*args, full_bounds)
        _one_piece_per_candidate(monkeypatch, objective)
        pieces, piece_best = state.settling_gains(*args, piece_bounds)
        assert torch.equal(piece_best, best), step
        evaluated = pieces > float("-inf")
        assert torch.equal(pieces[evaluated], exact[evaluated]), step
        left_out = ~evaluated & (exact > float("-inf"))
        # What was left out could not win: its bound is below the best gain, and so is its gain.
        assert (torch.where(left_out, top.values[:, :40], float("-inf")) < best[:, None]).all()
        assert (torch.where(left_out, exact, float("-inf")) < best[:, None]).all()
        # Bounds stay upper bounds of the exact gains (those left out keep their stale ones).
        assert (piece_bounds >= full_bounds).all()
        stopped += int(left_out.sum())
        picks = torch.where(exact == best[:, None], elements, n).amin(dim=-1)
        state.add(picks)
        bounds = full_bounds
    assert stopped > 0, "no row stopped early: the test checks nothing"


def _generators(rows: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(10 + row) for row in range(rows)]


@pytest.mark.parametrize("method", ["lazy", "stochastic"])
@pytest.mark.parametrize("seed", [0, 1])
def test_kept_sets_with_early_stops_are_those_of_a_full_evaluation(monkeypatch, method, seed):
    for objective in (tied_objective(seed=seed), random_objective(rows=4, n=80, seed=seed, phi=Concave("power"))):
        monkeypatch.setattr(submodular, "_GAIN_CHUNK", 1 << 30)
        reference = greedy_maximize(objective, 25, method, 1e-5, _generators(objective.rows), fast=False)
        if method == "lazy":
            assert torch.equal(reference, greedy_maximize(objective, 25, "plain"))
        _one_piece_per_candidate(monkeypatch, objective)
        calls = []
        original = _GreedyState.settling_gains

        def counting(
            self, elements, feature, elements_valid, top_values, facility_bounds, original=original, calls=calls
        ):
            exact, best = original(self, elements, feature, elements_valid, top_values, facility_bounds)
            bounded = top_values[:, : elements.shape[1]] > float("-inf")
            calls.append(int(((exact == float("-inf")) & bounded).sum()))  # candidates left out
            return exact, best

        monkeypatch.setattr(_GreedyState, "settling_gains", counting)
        chosen = greedy_maximize(objective, 25, method, 1e-5, _generators(objective.rows), fast=False)
        monkeypatch.setattr(_GreedyState, "settling_gains", original)
        assert torch.equal(chosen, reference), (method, seed)
        assert sum(calls) > 0, "no row stopped early: the test checks nothing"


def test_a_repeated_element_left_out_keeps_the_bound_its_evaluation_wrote(monkeypatch):
    """Stochastic draws repeat elements: a repeat is not eligible (bound -inf, last in bound order),
    so a row that settled before reaching it does not evaluate it; the bound of the element must
    stay the exact gain written by its evaluated copy, not go back to the stale one."""
    objective = random_objective(rows=4, n=60, seed=2)
    rows, n, m = objective.rows, objective.size, 10
    state = _GreedyState(objective)
    state.add(torch.zeros(rows, dtype=torch.long))  # some coverage: exact gains below the stale bounds
    bounds = objective.row_sums.double() * objective.facility_scale[:, None]
    feature = state.feature_gains(torch.arange(n).expand(rows, n))
    stale = (bounds + feature).masked_fill(state.chosen, float("-inf"))
    top = stale.topk(n, dim=-1)
    elements, values = top.indices[:, :m].clone(), top.values.clone()
    elements[:, m - 1] = elements[:, 0]  # the repeat of the first candidate, not eligible
    values[:, m - 1 :] = float("-inf")
    first = elements[:, :1]
    exact_facility = state.facility_gains(state.rows, first)
    assert (bounds.gather(1, first) > exact_facility).any(), "stale and exact bounds tie: the test checks nothing"
    _one_piece_per_candidate(monkeypatch, objective)
    exact, _ = state.settling_gains(
        elements, feature.gather(1, elements), objective.valid.gather(1, elements), values, bounds
    )
    assert (exact[:, m - 1] == float("-inf")).all()
    assert torch.equal(bounds.gather(1, first), exact_facility)
