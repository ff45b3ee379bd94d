"""AhaKV's edges the mutation run found untested (results/mutation/summary.md): the smallest budget
of Eq. 12, the errors of the gain's arguments, a row's padding without a mask, the value prior of a
padded row, and re-scoring when a prefill is scored again with another budget."""

from __future__ import annotations

import math

import pytest
import torch

from kvhive.methods.ahakv import (
    AhaKV,
    ahakv_scores,
    row_padding,
    sg_lambda,
    sg_logit_multiplier,
    value_prior,
)
from kvhive.methods.base import ScoringInputs

from helpers import scoring_inputs as _scoring


def _inputs(seed: int, n: int = 40, heads: int = 2, dim: int = 8):
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, heads, n, dim, generator=generator) for _ in range(3))


def test_eq12_gain_at_the_smallest_budget():
    # k = 1 is a valid budget: lambda = sqrt(2 ln n / d); n == k evicts nothing (gain 0).
    assert sg_lambda(100, 1, 64) == pytest.approx(math.sqrt(2 * math.log(100) / 64))
    assert sg_lambda(5, 5, 64) == 0.0
    with pytest.raises(ValueError, match=r"invalid budget=0: expected an integer >= 1"):
        sg_lambda(100, 0, 64)


def test_gain_arguments_are_refused_with_their_names_and_ranges():
    with pytest.raises(ValueError, match=r"^invalid scaling=-1\.0: expected a number > 0$"):
        sg_logit_multiplier(100, 10, 64, -1.0)
    with pytest.raises(ValueError, match=r"^invalid scaling=0\.0: expected a number > 0$"):
        sg_logit_multiplier(100, 10, 64, 0.0)
    with pytest.raises(ValueError, match=r"^invalid gain_input='qk': expected one of \('raw_qk', 'scaled_qk'\)$"):
        sg_logit_multiplier(100, 10, 64, 0.125, "qk")


def test_row_padding_without_a_mask_is_zero_for_every_row():
    queries, keys, values = (torch.cat([t, t]) for t in _inputs(0))
    scoring = _scoring(queries, keys, values)
    unmasked = ScoringInputs(**{**scoring.__dict__, "mask": None})
    assert row_padding(unmasked) == [0, 0]


def test_value_prior_of_a_left_padded_row_equals_the_row_alone():
    queries, keys, values = _inputs(1)
    pad = 6
    padded = [torch.cat([torch.randn(1, 2, pad, 8) * 50, t], dim=2) for t in (queries, keys, values)]
    n = keys.shape[2] + pad
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    mask[:, :pad] = False
    mask = mask[None, None]
    alone = _scoring(queries, keys, values)
    with_padding = _scoring(*padded, mask=mask)
    # The value prior of Eq. 13-14 ignores the (large) padded values ...
    prior = value_prior(padded[2], with_padding.valid, 3)
    assert torch.allclose(prior[..., pad:], value_prior(values, alone.valid, 3), atol=1e-6)
    assert bool((prior[..., :pad] == 0).all())
    # ... and so do the scores (Eq. 15), the gain's n being the row's real tokens.
    assert torch.allclose(ahakv_scores(with_padding, 16)[..., pad:], ahakv_scores(alone, 16), atol=1e-5)


def test_value_prior_mean_filter_by_hand():
    values = torch.tensor([[[[1.0], [2.0], [3.0], [0.0], [4.0]]]])  # ||v||^2 = 1, 4, 9, 0, 16
    valid = torch.tensor([[[False, True, True, True, True]]])
    # Centred mean over real tokens only, kernel 3: (4+9)/2, (4+9+0)/3, (9+0+16)/3, (0+16)/2.
    expected = torch.tensor([0.0, 6.5, 13 / 3, 25 / 3, 8.0])
    assert torch.allclose(value_prior(values, valid, 3)[0, 0], expected / expected.max())


def test_a_prefill_scored_again_with_another_budget_is_rescored():
    queries, keys, values = _inputs(2, n=64)
    scoring = _scoring(queries, keys, values)
    policy, state = AhaKV(), {}
    first = policy.score(scoring, 40, state).clone()
    assert torch.allclose(first, ahakv_scores(scoring, 40))
    # k of Eq. 12 changed: the gain, hence the scores, change with it.
    second = policy.score(scoring, 56, state)
    assert torch.allclose(second, ahakv_scores(scoring, 56))
    assert not torch.allclose(first, second)
