"""BumbleBee (kvhive/methods/bumblebee.py, kvhive/methods/submodular.py; COLM 2024, docs/METHODS.md)."""

from __future__ import annotations

import dataclasses
import itertools
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from kvhive.api import make_cache
from kvhive.methods import make_policy
from kvhive.methods.base import DECODE, ScoringInputs
from kvhive.methods.bumblebee import REBUILDS, SCORE, SUMMARY, BumbleBee, BumbleBeePower
from kvhive.methods.submodular import (
    Concave,
    Mixture,
    StreamingSummary,
    greedy_maximize,
    power_concave,
    relu_cosine_similarity,
    relu_cosine_similarity_rows,
    stochastic_sample_size,
)
from kvhive.models import TINY_ARCHITECTURES, TINY_ATTENTION_KINDS, load_model, tiny_model

from helpers import (
    left_padded_batch,
    prefill_and_decode,
    random_objective,
    record_greedy_calls,
    reference_logits,
    scoring_inputs,
    solo_runs,
)

ALL_TINY = [(a, k) for a in TINY_ARCHITECTURES for k in TINY_ATTENTION_KINDS]
CONCAVES = [Concave("log"), Concave("power")]


def brute_force_best(objective: Mixture, k: int) -> torch.Tensor:
    best = torch.full((objective.rows,), -math.inf, dtype=torch.float64)
    for subset in itertools.combinations(range(objective.size), k):
        chosen = torch.zeros(objective.rows, objective.size, dtype=torch.bool)
        chosen[:, list(subset)] = True
        best = torch.maximum(best, objective.value(chosen))
    return best


def reference_greedy(objective: Mixture, k: int) -> torch.Tensor:
    """Algorithm 1 lines 4-7 straight from the definition: argmax of g(S + e) - g(S) (one row at a
    time, plain Python over elements; padding only when nothing else is left)."""
    chosen = torch.zeros(objective.rows, objective.size, dtype=torch.bool)
    for row in range(objective.rows):
        for _ in range(k):
            base = objective.value(chosen)[row]
            best, best_gain = None, -math.inf
            for element in range(objective.size):
                if chosen[row, element]:
                    continue
                trial = chosen.clone()
                trial[row, element] = True
                gain = (objective.value(trial)[row] - base).item()
                if not objective.valid[row, element]:
                    gain = -1e30
                if gain > best_gain:
                    best, best_gain = element, gain
            chosen[row, best] = True
    return chosen


def accumulated_scoring(keys, weights, mask=None, layer_index=0, num_layers=1) -> ScoringInputs:
    """``ScoringInputs`` over ``keys [b, h, n, d]`` whose accumulated attention is ``weights``
    (what prefill would have summed), positions 0..n-1, an optional key mask ``[b, 1, 1, n]``."""
    b, h, _, d = keys.shape
    scoring = scoring_inputs(torch.zeros(b, h, 1, d), keys, keys, scaling=1.0, mask=mask, phase=DECODE)
    return dataclasses.replace(
        scoring, layer_index=layer_index, num_layers=num_layers, token_scores={SCORE: weights.clone()}
    )


# ----------------------------------------------------------------------------------------------
# The objective
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("phi", CONCAVES, ids=lambda p: p.kind)
def test_normalisation_empty_is_zero_ground_set_is_one(phi):
    for lam in (0.0, 0.3, 1.0):
        objective = random_objective(lam=lam, phi=phi)
        empty = torch.zeros(objective.rows, objective.size, dtype=torch.bool)
        assert torch.allclose(objective.value(empty), torch.zeros(objective.rows, dtype=torch.float64))
        everything = torch.ones_like(empty)
        for part in (objective.facility_location, objective.feature, objective.value):
            assert torch.allclose(part(everything), torch.ones(objective.rows, dtype=torch.float64), atol=1e-12)
        # Only the valid elements count: the ground set without padding is already worth 1.
        assert torch.allclose(objective.value(objective.valid), torch.ones(objective.rows, dtype=torch.float64))


@pytest.mark.parametrize("phi", CONCAVES, ids=lambda p: p.kind)
def test_lambda_extremes_reduce_to_the_pure_components(phi):
    feature_only = random_objective(lam=0.0, phi=phi, seed=3)
    facility_only = random_objective(lam=1.0, phi=phi, seed=3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        chosen = torch.rand(4, 10, generator=generator) < 0.4
        assert torch.allclose(feature_only.value(chosen), feature_only.feature(chosen))
        assert torch.allclose(facility_only.value(chosen), facility_only.facility_location(chosen))
    # lambda = 0: c is a concave function of a modular sum, so greedy keeps the top attention mass.
    picked = greedy_maximize(feature_only, 4, "lazy")
    top = feature_only.weights.masked_fill(~feature_only.valid, -1).topk(4).indices
    assert (picked == torch.zeros_like(picked).scatter(1, top, True)).all()
    # lambda = 1: pure facility location, whatever the attention says.
    reweighted = Mixture(facility_only.sim, facility_only.weights.flip(-1), facility_only.valid, 1.0, phi)
    assert (greedy_maximize(facility_only, 4, "plain") == greedy_maximize(reweighted, 4, "plain")).all()


@pytest.mark.parametrize("phi", CONCAVES, ids=lambda p: p.kind)
@pytest.mark.parametrize("method", ["plain", "lazy"])
def test_greedy_reaches_one_minus_one_over_e_of_brute_force(phi, method):
    ratios = []
    for seed, (n, k) in enumerate([(9, 3), (10, 4), (11, 5), (8, 2)]):
        objective = random_objective(n=n, phi=phi, seed=seed)
        chosen = greedy_maximize(objective, k, method, 1e-5, torch.Generator().manual_seed(seed))
        assert (chosen.sum(-1) == k).all()
        optimum = brute_force_best(objective, k)
        ratio = objective.value(chosen) / optimum
        assert (ratio >= 1 - 1 / math.e).all(), ratio
        ratios.append(ratio)
    assert torch.cat(ratios).max() <= 1.0 + 1e-9  # brute force is the optimum


@pytest.mark.parametrize("phi", CONCAVES, ids=lambda p: p.kind)
def test_stochastic_greedy_that_samples_reaches_its_bound_in_expectation(phi):
    """Mirzasoleiman et al. (2015), Theorem 1: E[g(S)] >= (1 - 1/e - epsilon) OPT. epsilon = 0.2
    makes every step sample fewer elements than the ground set (s < n), so the draws matter."""
    epsilon = 0.2
    for seed, (n, k) in enumerate([(9, 3), (10, 4), (11, 5), (12, 3)]):
        assert stochastic_sample_size(n, k, epsilon) < n - k  # sampling really happens
        objective = random_objective(n=n, phi=phi, seed=seed)
        optimum = brute_force_best(objective, k)
        runs = [
            greedy_maximize(objective, k, "stochastic", epsilon, torch.Generator().manual_seed(draw))
            for draw in range(24)
        ]
        assert any(not torch.equal(runs[0], other) for other in runs[1:])  # the draws change the set
        ratios = torch.stack([objective.value(chosen) / optimum for chosen in runs])
        assert ratios.max() <= 1.0 + 1e-9
        assert (ratios.mean(dim=0) >= 1 - 1 / math.e - epsilon).all(), ratios.mean(dim=0)


@pytest.mark.parametrize("phi", CONCAVES, ids=lambda p: p.kind)
@pytest.mark.parametrize("rows,n,k", [(3, 12, 5), (7, 4, 2)], ids=["rows<n", "rows>n"])
def test_plain_greedy_follows_the_definition(phi, rows, n, k):
    # rows > n: many (batch, head) rows over a short prompt (the column chunking must not care).
    objective = random_objective(rows=rows, n=n, phi=phi, seed=5)
    assert (greedy_maximize(objective, k, "plain") == reference_greedy(objective, k)).all()


@pytest.mark.parametrize("phi", CONCAVES, ids=lambda p: p.kind)
@pytest.mark.parametrize("lam", [0.0, 0.3, 1.0])
def test_lazy_greedy_returns_the_same_set_as_plain_greedy(phi, lam):
    for seed in range(2):
        objective = random_objective(rows=6, n=80, dim=8, lam=lam, phi=phi, seed=seed)
        for k in (1, 7, 25, 60):  # 60: more chosen elements than one round of lazy evaluations
            plain = greedy_maximize(objective, k, "plain")
            assert (greedy_maximize(objective, k, "lazy") == plain).all()
            # epsilon this small makes the sample the whole ground set: stochastic == plain too.
            assert (greedy_maximize(objective, k, "stochastic", 1e-300) == plain).all()


@pytest.mark.parametrize("lam", [0.3, 1.0])
def test_lazy_greedy_breaks_exact_ties_like_plain_greedy(lam):
    """Lazy greedy returns plain greedy's set also when gains tie exactly (ties go to the lowest
    index in both, greedy_maximize's docstring): keys on 4 axes make every similarity 0 or 1 and
    small integer weights repeat, so many gains tie exactly (the zero facility gains once every
    axis is covered too); k up to n takes the padding of row 1 as well, and n = 90 is more than
    one round of lazy evaluations (at most 32), so the bounds decide what is evaluated."""
    generator = torch.Generator().manual_seed(11)
    rows, n = 3, 90
    keys = torch.nn.functional.one_hot(torch.randint(0, 4, (rows, n), generator=generator), 4).float()
    weights = torch.randint(1, 4, (rows, n), generator=generator).float()
    valid = torch.ones(rows, n, dtype=torch.bool)
    valid[1, :4] = False
    objective = Mixture(relu_cosine_similarity(keys, valid), weights, valid, lam, Concave("log"))
    for k in (3, 10, 40, 87, 90):
        plain = greedy_maximize(objective, k, "plain")
        assert torch.equal(greedy_maximize(objective, k, "lazy"), plain), k
        assert torch.equal(greedy_maximize(objective, k, "stochastic", 1e-300), plain), k
    # Two interleaved clusters of 11 equal keys: after one pick in each every gain ties (the
    # facility gains are all 0), and element 2 must win although stale bounds of later elements
    # sort them first; an element whose bound equals the best gain is still evaluated.
    labels = torch.tensor([0, 1, 0, 0, 1, 0, 1, 0, 1, 1, 0, 1, 1, 1, 0, 0, 0, 1, 0, 1, 0, 1])
    keys = torch.nn.functional.one_hot(labels, 2).float()[None]
    valid = torch.ones(1, len(labels), dtype=torch.bool)
    objective = Mixture(relu_cosine_similarity(keys, valid), torch.ones(1, len(labels)), valid, lam, Concave("log"))
    plain = greedy_maximize(objective, 3, "plain")
    assert plain[0].nonzero().flatten().tolist() == [0, 1, 2]
    assert torch.equal(greedy_maximize(objective, 3, "lazy"), plain)


@pytest.mark.parametrize("phi", CONCAVES, ids=lambda p: p.kind)
def test_greedy_runs_again_when_its_planned_evaluations_fall_short(monkeypatch, phi):
    """The device greedy evaluates a planned number of exact gains per step and checks, once per
    run, that every step was settled; with one evaluation per step planned it is not, the rerun
    (with what the steps needed, then everything drawn) must still return plain greedy's set,
    and the host reads stay a handful per call (the sampler's 2, one per run)."""
    import kvhive.methods.submodular as submodular_module
    from kvhive.diagnostics import HostReadCounter

    objective = random_objective(rows=5, n=120, dim=6, phi=phi, seed=8)
    plain = greedy_maximize(objective, 40, "plain")
    generators = [torch.Generator().manual_seed(row) for row in range(5)]
    planned = greedy_maximize(objective, 40, "stochastic", 1e-300, generators)
    runs = []
    original = submodular_module._lazy_greedy

    def counted(*args):
        runs.append(args[2])
        return original(*args)

    monkeypatch.setattr(submodular_module, "_lazy_greedy", counted)
    monkeypatch.setattr(submodular_module, "_LAZY_EVALUATIONS", 1)
    for method in ("lazy", "stochastic"):
        runs.clear()
        with HostReadCounter() as counter:
            chosen = greedy_maximize(objective, 40, method, 1e-300, generators)
        assert torch.equal(chosen, plain), method
        assert len(runs) >= 2 and sum(runs[-1]) > sum(runs[0]), method  # it did run again, with more
        assert counter.total == len(runs) + (2 if method == "stochastic" else 0), counter
    assert torch.equal(planned, plain)


def test_stochastic_greedy_samples_and_keeps_exact_counts():
    assert stochastic_sample_size(1000, 100, 1e-5) == math.ceil(10 * math.log(1e5))
    assert stochastic_sample_size(100, 50, 1e-5) == 24
    assert stochastic_sample_size(20, 2, 1e-5) == 20
    # s = ceil((n / k) ln(1 / epsilon)) also for k = 1, and at least one draw (never more than n).
    assert stochastic_sample_size(100, 1, 0.5) == math.ceil(100 * math.log(2)) == 70
    assert stochastic_sample_size(10, 10, 0.9) == 1 and stochastic_sample_size(1, 1, 1e-5) == 1
    objective = random_objective(rows=5, n=400, dim=8, seed=1)
    chosen = greedy_maximize(objective, 60, "stochastic", 0.5, torch.Generator().manual_seed(0))
    assert (chosen.sum(-1) == 60).all()
    assert not (chosen & ~objective.valid).any()  # padding only once real elements run out
    plain = greedy_maximize(objective, 60, "plain")
    assert (objective.value(chosen) >= 0.9 * objective.value(plain)).all()
    # Reproducible with the same generator seed; a different seed samples differently.
    again = greedy_maximize(objective, 60, "stochastic", 0.5, torch.Generator().manual_seed(0))
    other = greedy_maximize(objective, 60, "stochastic", 0.5, torch.Generator().manual_seed(1))
    assert (again == chosen).all() and not (other == chosen).all()


def test_greedy_defaults_to_stochastic_greedy_with_epsilon_1e_minus_5():
    """The paper's fast path (Appx. D): stochastic greedy with epsilon = 1e-5 unless told otherwise;
    n = 400, k = 20 makes each step sample 231 of the elements, so the draws decide."""
    objective = random_objective(rows=2, n=400, dim=8, seed=4)
    assert stochastic_sample_size(397, 20, 1e-5) < 397 - 20
    default = greedy_maximize(objective, 20, generator=torch.Generator().manual_seed(0))
    explicit = greedy_maximize(objective, 20, "stochastic", 1e-5, torch.Generator().manual_seed(0))
    assert torch.equal(default, explicit)


def test_greedy_takes_padding_only_when_real_elements_run_out():
    objective = random_objective(rows=2, n=8, seed=2)  # row 1: 3 padding, 5 real
    for method in ("plain", "lazy", "stochastic"):
        chosen = greedy_maximize(objective, 6, method, 1e-5)
        assert (chosen.sum(-1) == 6).all()
        assert chosen[1, 3:].all() and chosen[1, :3].sum() == 1
    # epsilon = 0.5: one draw per step (s = 1), so stochastic greedy also samples the padding it
    # must take once the 5 real elements are chosen (from the padding, not from the real ones).
    assert stochastic_sample_size(5, 8, 0.5) == 1
    for seed in range(6):
        for k in (6, 8):
            chosen = greedy_maximize(objective, k, "stochastic", 0.5, torch.Generator().manual_seed(seed))
            assert (chosen.sum(-1) == k).all()
            assert chosen[1, 3:].all() and chosen[1, :3].sum() == k - 5


def test_stochastic_greedy_draws_uniformly_from_the_remaining_real_elements():
    """Stochastic greedy's sample is uniform draws from the remaining elements (Mirzasoleiman et
    al. 2015, Lemma 2), padding excluded. epsilon = 0.9 gives one draw per step (s = 1), so with
    k = 1 the pick is that draw: over 1,200 rows with their own generators every real element is
    picked about equally often (the first and the last included) and padding never."""
    single = random_objective(rows=2, n=8, seed=2)  # row 1: 3 padding, 5 real
    rows = 600
    objective = Mixture(
        single.sim.repeat(rows, 1, 1), single.weights.repeat(rows, 1), single.valid.repeat(rows, 1), 0.3, single.phi
    )
    assert stochastic_sample_size(8, 1, 0.9) == stochastic_sample_size(5, 1, 0.9) == 1
    generators = [torch.Generator().manual_seed(seed) for seed in range(2 * rows)]
    chosen = greedy_maximize(objective, 1, "stochastic", 0.9, generators)
    counts = chosen.reshape(rows, 2, 8).sum(dim=0)
    assert counts[1, :3].sum() == 0
    # 600 picks over 8 (75 each) or 5 (120 each) elements: binomial spread about 8 and 10.
    assert ((counts[0] - 75).abs() <= 40).all(), counts[0]
    assert ((counts[1, 3:] - 120).abs() <= 50).all(), counts[1]
    # Every step samples, not only the first: at k = 2 the second pick is the best of at most
    # ceil(8 / 7) = 2 draws, so the 600 runs of row 0 give many more pairs than one per first pick.
    pairs = greedy_maximize(objective, 2, "stochastic", 0.9, generators).reshape(rows, 2, 8)[:, 0]
    assert len({tuple(pair.nonzero().flatten().tolist()) for pair in pairs}) > 16


def test_plain_greedy_in_column_chunks_equals_one_chunk(monkeypatch):
    """Plain greedy evaluates the gains a chunk of columns at a time to bound memory; the chunks
    (1 or 3 columns here, one chunk normally) must not change the chosen set."""
    import kvhive.methods.submodular as submodular_module

    objective = random_objective(rows=3, n=11, seed=9)
    whole = greedy_maximize(objective, 5, "plain")
    for columns in (1, 3):
        monkeypatch.setattr(submodular_module, "_PLAIN_CHUNK", columns * objective.rows * objective.size)
        assert torch.equal(greedy_maximize(objective, 5, "plain"), whole)


@pytest.mark.parametrize("dim", [16, 80, 128, 256])
def test_prefill_similarity_in_panels_equals_the_full_product_to_the_bit(dim):
    """The prefill's similarity (upper block triangle in panels of rows, mirrored, with row sums and
    maxima) is the full product's matrix bit for bit: prompts of 2 panels and a half, a last panel
    of half a panel, odd lengths, a padded row; the kept set depends on exact ties."""
    generator = torch.Generator().manual_seed(dim)
    for n in (512, 639, 640, 1537):
        keys = torch.randn(2, n, dim, generator=generator) + 2 * torch.randn(2, 1, dim, generator=generator)
        valid = torch.ones(2, n, dtype=torch.bool)
        valid[1, :37] = False
        full = relu_cosine_similarity(keys, valid)
        sim, row_sums, row_max = relu_cosine_similarity_rows(keys, valid)
        assert torch.equal(sim, full), n
        assert torch.equal(row_sums, full.sum(dim=-1)) and torch.equal(row_max, full.amax(dim=-1)), n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_similarity_of_zeroed_padding_keys_is_the_masked_product_to_the_bit(dtype):
    """Padding is zeroed in the unit keys before the product (two passes fewer over the matrix): the
    matrix, its row sums and maxima are the product of every key with the padding's rows and columns
    masked after it, bit for bit (+0 there, not -0), for padding keys of zeros or of any values."""
    generator = torch.Generator().manual_seed(3)
    for n in (300, 639):
        keys = (torch.randn(3, n, 64, generator=generator) + torch.randn(3, 1, 64, generator=generator)).to(dtype)
        keys[0, :40] = 0
        valid = torch.ones(3, n, dtype=torch.bool)
        valid[0, :40] = False
        valid[1, : n // 2] = False
        valid[2, 7] = False
        units = keys.float() / keys.float().norm(dim=-1, keepdim=True).clamp_min(1e-12)
        weight = valid.float()
        masked = (units @ units.transpose(1, 2)).clamp_(min=0).mul_(weight[:, :, None]).mul_(weight[:, None, :])
        for sim, row_sums, row_max in [
            (relu_cosine_similarity(keys, valid), None, None),
            relu_cosine_similarity_rows(keys, valid),
        ]:
            assert torch.equal(sim.view(torch.int32), masked.view(torch.int32)), n
            if row_sums is not None:
                assert torch.equal(row_sums.view(torch.int32), masked.sum(dim=-1).view(torch.int32)), n
                assert torch.equal(row_max.view(torch.int32), masked.amax(dim=-1).view(torch.int32)), n


def test_power_concave_inverse_is_accurate():
    x = torch.cat([torch.zeros(1), torch.logspace(-10, 10, 401, dtype=torch.float64)])
    # Any alpha in (0, 1] and beta >= 0 (the config's ranges): a small alpha with a small beta
    # (0.02, 1e-3) or a small alpha alone (0.01) needs Newton to start above the root.
    for alpha, beta in [(0.04, 1.0), (0.5, 1.0), (0.04, 0.0), (1.0, 2.0), (0.02, 1e-3), (0.01, 1.0)]:
        y = power_concave(x, alpha, beta)
        back = alpha * y.pow(1 / alpha) + beta * y
        assert torch.allclose(back, x, rtol=1e-12, atol=1e-300), (alpha, beta)
        assert (y[1:] > y[:-1]).all() and y[0] == 0
    # Concave (BumbleBee ♦): second differences on a uniform grid are <= 0.
    grid = torch.linspace(0, 50, 2001, dtype=torch.float64)
    values = power_concave(grid)
    assert (values[2:] - 2 * values[1:-1] + values[:-2] <= 1e-12).all()
    # Near zero it is the identity (beta = 1); for large x it grows like (x / alpha) ** alpha.
    tiny = torch.tensor([1e-6], dtype=torch.float64)
    assert torch.allclose(power_concave(tiny), tiny)
    big = torch.tensor([1e8], dtype=torch.float64)
    assert abs(power_concave(big).item() / (big / 0.04).pow(0.04).item() - 1) < 1e-3


@pytest.mark.parametrize("phi", CONCAVES, ids=lambda p: p.kind)
def test_concave_gain_and_loss_are_differences_of_phi(phi):
    """The feature function's marginal gain phi(a(S) + a_e) - phi(a(S)) (greedy, Eq. 3) and loss
    phi(a(S')) - phi(a(S') - a_e) (streaming), with phi(base) / phi(total) given or not, for masses
    below and above 1."""
    base = torch.tensor([0.0, 0.2, 0.5, 3.0, 40.0], dtype=torch.float64)
    added = torch.tensor([0.3, 0.1, 2.0, 0.25, 7.0], dtype=torch.float64)
    expected = phi(base + added) - phi(base)
    assert (expected > 0).all()
    for gain in (phi.gain(base, added), phi.gain(base, added, phi(base))):
        torch.testing.assert_close(gain, expected, rtol=1e-12, atol=0)
    total = base + added
    for loss in (phi.loss(total, added), phi.loss(total, added, phi(total))):
        torch.testing.assert_close(loss, expected, rtol=1e-9, atol=0)


def test_power_concave_uses_its_own_alpha_and_beta():
    """Concave("power", alpha, beta) is g^{-1} for g(y) = alpha y^(1/alpha) + beta y with the
    given alpha and beta (BumbleBee ♦; the config's power_alpha and power_beta)."""
    x = torch.logspace(-3, 3, 13, dtype=torch.float64)
    for alpha, beta in [(0.04, 1.0), (0.1, 2.0), (0.04, 0.25)]:
        y = Concave("power", alpha, beta)(x)
        torch.testing.assert_close(alpha * y.pow(1 / alpha) + beta * y, x, rtol=1e-12, atol=0)


def test_log_concave_gain_and_loss_do_not_cancel():
    """phi = log(1 + x): the gain is log1p(a / (1 + b)) = ln((1 + b + a) / (1 + b)), computed
    without the cancellation of log1p(b + a) - log1p(b), which loses a token with little
    attention next to a large accumulated mass (here a = 1e-9, b = 1e6)."""
    phi = Concave("log")
    base = torch.tensor([1e6], dtype=torch.float64)
    added = torch.tensor([1e-9], dtype=torch.float64)
    exact = math.log1p(1e-9 / (1 + 1e6))
    assert phi.gain(base, added).item() == pytest.approx(exact, rel=1e-9, abs=0)
    assert phi.loss(base + added, added).item() == pytest.approx(exact, rel=1e-6, abs=0)


# ----------------------------------------------------------------------------------------------
# Streaming (Algorithm 2)
# ----------------------------------------------------------------------------------------------


def decode_scoring(
    keys: torch.Tensor, scores: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor
) -> ScoringInputs:
    """ScoringInputs of a decode step over stored ``keys[B, H, N, d]`` with running ``scores``."""
    b, h, n, d = keys.shape
    return ScoringInputs(
        keys=keys,
        values=keys.clone(),
        queries=torch.zeros(b, h, 1, d),
        positions=positions,
        mask=valid[:, :, None, :],
        scaling=1.0,
        layer_index=0,
        num_layers=1,
        sequence_length=int(positions.max()) + 1,
        phase=DECODE,
        token_scores={SCORE: scores.clone()},
    )


def marginal_gains(keys: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor, lam: float, phi: Concave):
    """``g(x | S' - x)`` of every element of ``S'`` (one row per problem), from the definition,
    with ``S'`` as the ground set; invalid elements get -inf (dropped first)."""
    objective = Mixture(relu_cosine_similarity(keys, valid), weights, valid, lam, phi)
    everything = torch.ones_like(valid)
    gains = []
    for element in range(valid.shape[1]):
        without = everything.clone()
        without[:, element] = False
        gains.append(objective.value(everything) - objective.value(without))
    return torch.stack(gains, dim=1).masked_fill(~valid, -math.inf)


def test_streaming_step_hand_checked():
    """S = {u1=(1,0), u2=(0,1)}, the token leaving the local window x=(1, 0.1); lambda = 0.3, log.

    Facility location on S' (every element covers itself): gain = 1 - the largest similarity to
    another element, over f_FL(S') = 3. u1 and x are near-duplicates (cos = 1/sqrt(1.01)); u2 is
    nearly unique (cos(u2, x) = 0.1/sqrt(1.01), cos(u2, u1) = 0).
    Feature part: c gain of u = [ln(1 + A) - ln(1 + A - a_u)] / ln(1 + A), A = a(S').
    """
    cos = 1 / math.sqrt(1.01)
    facility = {"u1": (1 - cos) / 3, "u2": (1 - 0.1 * cos) / 3, "x": (1 - cos) / 3}
    for attention, expected_drop in [({"u1": 5.0, "u2": 0.2, "x": 3.0}, "u2"), ({"u1": 5.0, "u2": 1.0, "x": 0.5}, "x")]:
        total = sum(attention.values())
        feature = {u: (math.log1p(total) - math.log1p(total - a)) / math.log1p(total) for u, a in attention.items()}
        gains = {u: 0.3 * facility[u] + 0.7 * feature[u] for u in facility}
        assert min(gains, key=gains.get) == expected_drop
        # First case by hand: u1 0.3 * 0.00165 + 0.7 * 0.353 = 0.248; u2 0.3 * 0.300 + 0.7 * 0.0099
        # = 0.097; x 0.3 * 0.00165 + 0.7 * 0.178 = 0.125 -> the unique but unattended u2 goes.
        if expected_drop == "u2":
            assert gains["u1"] == pytest.approx(0.2478, abs=1e-3)
            assert gains["u2"] == pytest.approx(0.0970, abs=1e-3)
            assert gains["x"] == pytest.approx(0.1251, abs=1e-3)

        # Stored: u1, u2 (summary, tau_s = 2), x, newest (local window of 1 after the append).
        keys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.1], [0.3, -0.7]])[None, None]
        scores = torch.tensor([attention["u1"], attention["u2"], attention["x"], 1.0])[None, None]
        valid = torch.ones(1, 1, 4, dtype=torch.bool)
        positions = torch.arange(4, dtype=torch.int32)[None, None]
        brute = marginal_gains(keys[0, :, :3], scores[0, :, :3], valid[0, :, :3], 0.3, Concave("log"))[0]
        assert brute.tolist() == pytest.approx([gains["u1"], gains["u2"], gains["x"]], abs=1e-6)

        policy = BumbleBee(local_window=1)
        state = {}
        keep = policy.select_decode(decode_scoring(keys, scores, valid, positions), 3, state)
        dropped = {"u1": 0, "u2": 1, "x": 2}[expected_drop]
        assert keep[0, 0].tolist() == [index != dropped for index in range(4)]
        assert state[REBUILDS] == 1  # nothing was selected in prefill: S = the oldest tau_s tokens


def simulate_stream(
    policy: BumbleBee,
    budget: int,
    steps: int,
    joiners: int = 1,
    seed: int = 0,
    dim: int = 6,
    score_scale: float = 1.0,
):
    """Drive ``select_decode`` as the cache does (append, accumulate, compact) over 2 x 2 rows,
    row (1, *) left-padded by 2; check every drop against the brute-force argmin of
    ``g(x | S' - x)`` for one joiner at a time (with ``importance_scale="normalised"``, the
    weights are the fractions of the mass of ``S'``). ``score_scale`` multiplies every
    attention score. Returns the policy state."""
    generator = torch.Generator().manual_seed(seed)
    summary_size, _ = policy.split(budget)
    lam, phi = policy.config.mixture_weight, policy.concave
    normalised = policy.config.importance_scale == "normalised"

    def fresh_keys(count):
        return torch.randn(2, 2, count, dim, generator=generator)

    keys = fresh_keys(budget)
    scores = torch.rand(2, 2, budget, generator=generator) * 4 * score_scale
    valid = torch.ones(2, 2, budget, dtype=torch.bool)
    valid[1, :, :2] = False
    scores[~valid] = 0
    positions = torch.arange(budget, dtype=torch.int32).expand(2, 2, budget).clone()
    seen = budget
    state = {}
    for step in range(steps):
        new = fresh_keys(joiners)
        if step % 2:  # every other step, near-duplicates of the oldest members: redundancy to resolve
            new = keys[:, :, :joiners] + 0.05 * torch.randn(2, 2, joiners, dim, generator=generator)
        keys = torch.cat([keys, new], dim=2)
        scores = torch.cat([scores, torch.zeros(2, 2, joiners)], dim=2)
        scores += (
            torch.rand(scores.shape, generator=generator) ** 4
            * score_scale
            * torch.cat([valid, torch.ones(2, 2, joiners, dtype=torch.bool)], dim=2)
        )
        valid = torch.cat([valid, torch.ones(2, 2, joiners, dtype=torch.bool)], dim=2)
        arrived = torch.arange(seen, seen + joiners, dtype=torch.int32).expand(2, 2, joiners)
        positions = torch.cat([positions, arrived], dim=2)
        seen += joiners

        # Reference: joiners enter one at a time, each followed by the argmin drop.
        members = [list(range(summary_size)) for _ in range(4)]
        flat = lambda t: t.reshape(4, *t.shape[2:])  # noqa: E731
        expected_sets = []
        for row in range(4):
            current = members[row]
            for j in range(joiners):
                candidate = current + [summary_size + j]
                index = torch.tensor(candidate)
                weights, in_ground_set = flat(scores)[row : row + 1, index], flat(valid)[row : row + 1, index]
                if normalised:  # c(S) = phi(a(S) / a(S')) / phi(1)
                    weights = weights * in_ground_set / (weights * in_ground_set).sum()
                gains = marginal_gains(flat(keys)[row : row + 1, index], weights, in_ground_set, lam, phi)[0]
                order = gains.argsort(stable=True)
                assert gains[order[1]] - gains[order[0]] > 1e-9 or not torch.isfinite(gains[order[0]])
                current = [c for c in candidate if c != candidate[int(order[0])]]
            expected_sets.append(sorted(current))

        keep = policy.select_decode(decode_scoring(keys, scores, valid, positions), budget, state)
        assert keep.shape == keys.shape[:3] and (keep.sum(-1) == budget).all()
        assert keep[..., summary_size + joiners :].all()  # the local window stays
        for row in range(4):
            kept_summary = flat(keep)[row, : summary_size + joiners].nonzero().squeeze(1).tolist()
            assert kept_summary == expected_sets[row], (step, row)
        keys = keys[keep].reshape(2, 2, budget, dim)
        scores = scores[keep].reshape(2, 2, budget)
        valid = valid[keep].reshape(2, 2, budget)
        positions = positions[keep].reshape(2, 2, budget)
        # The cached matrix stays aligned with the stored order (oldest first).
        summary = state[SUMMARY]
        assert (summary.positions == positions.reshape(4, budget)[:, :summary_size]).all()
        by_rank = summary.sim.gather(1, summary.slot_of_rank[:, :, None].expand(-1, -1, summary_size))
        by_rank = by_rank.gather(2, summary.slot_of_rank[:, None, :].expand(-1, summary_size, -1))
        fresh = relu_cosine_similarity(
            keys.reshape(4, budget, dim)[:, :summary_size], valid.reshape(4, budget)[:, :summary_size]
        )
        # The matrix holds the off-diagonal similarities, self_sim the diagonal.
        self_by_rank = summary.self_sim.gather(1, summary.slot_of_rank)
        assert torch.allclose(self_by_rank, fresh.diagonal(dim1=1, dim2=2), atol=1e-5)
        fresh.diagonal(dim1=1, dim2=2).zero_()
        assert torch.allclose(by_rank, fresh, atol=1e-5)
        assert (summary.sim.diagonal(dim1=1, dim2=2) == 0).all()
        assert torch.allclose(summary.nearest, summary.sim.amax(-1), atol=1e-6)
    assert not valid[1, :, :].logical_not().any()  # the padding was dropped first
    return state


@pytest.mark.parametrize("method", ["bumblebee", "bumblebee-power"])
@pytest.mark.parametrize("joiners", [1, 3])
def test_streaming_drops_the_minimum_marginal_gain_with_the_cached_matrix(method, joiners):
    policy = make_policy(method, local_window=3)
    state = simulate_stream(policy, budget=9, steps=24 // joiners, joiners=joiners)
    assert state[REBUILDS] == 1  # built once from the stored tokens, then only updated


@pytest.mark.parametrize("method", ["bumblebee", "bumblebee-power"])
@pytest.mark.parametrize("score_scale", [1.0, 0.01])
def test_streaming_with_normalised_importance_drops_the_minimum_marginal_gain(method, score_scale):
    """importance_scale="normalised" in decode too: every drop is the argmin of g(x | S' - x) with
    c(S) = phi(a(S) / a(S')) / phi(1) (module doc), whether the mass of S' is above 1 or, at
    score_scale 0.01, below it (the fraction is taken all the same)."""
    policy = make_policy(method, local_window=3, importance_scale="normalised")
    simulate_stream(policy, budget=9, steps=16, score_scale=score_scale)


def test_streaming_step_applies_phi_to_the_raw_mass_by_default():
    """StreamingSummary.step's default is BumbleBee's default importance_scale="raw"
    (normalise_mass=False), and the two scales drop different tokens here."""
    generator = torch.Generator().manual_seed(1)
    rows, size, joiners, dim = 4, 5, 6, 4
    keys = torch.randn(rows, size + joiners, dim, generator=generator)
    weights = torch.rand(rows, size + joiners, generator=generator) ** 2 * 40
    valid = torch.ones(rows, size + joiners, dtype=torch.bool)
    positions = torch.arange(size + joiners).expand(rows, -1)

    def dropped(**normalise):
        summary = StreamingSummary.from_keys(keys[:, :size], valid[:, :size], positions[:, :size])
        return summary.step(keys, valid, weights, positions, size, joiners, 0.3, Concave("log"), **normalise)

    default = dropped()
    assert torch.equal(default, dropped(normalise_mass=False))
    assert not torch.equal(default, dropped(normalise_mass=True))


def test_streaming_nearest_values_are_the_row_maxima_of_the_cached_matrix():
    """StreamingSummary.step rescans a member when the leaving one attains its maximum (no argmax is
    kept): after every step, each nearest value is its row's maximum of the cached matrix (zero
    diagonal), also for a matrix that a product's rounding left not exactly symmetric; a step where
    nothing joins (``active`` False, or x itself leaves) leaves the matrix as it was."""
    generator = torch.Generator().manual_seed(5)
    rows, size, local, dim = 6, 7, 2, 5
    tokens = size + local
    keys = torch.randn(rows, tokens, dim, generator=generator).round()  # ties between members
    valid = torch.ones(rows, tokens, dtype=torch.bool)
    positions = torch.arange(tokens).expand(rows, tokens).contiguous()
    sim = relu_cosine_similarity(keys[:, :size])
    sim = sim + 1e-6 * torch.rand(sim.shape, generator=generator) * (sim > 0)  # not symmetric
    summary = StreamingSummary.from_similarity(sim, keys[:, :size].norm(dim=-1), valid[:, :size], positions[:, :size])
    phi, seen = Concave("log"), tokens
    for step in range(40):
        new = keys[:, :1] + 0.1 * torch.randn(rows, 1, dim, generator=generator) if step % 2 else None
        keys = torch.cat([keys, torch.randn(rows, 1, dim, generator=generator) if new is None else new], dim=1)
        valid = torch.cat([valid, valid[:, :1]], dim=1)
        positions = torch.cat([positions, torch.full((rows, 1), seen)], dim=1)
        weights = torch.rand(rows, tokens + 1, generator=generator)
        seen += 1
        active = torch.tensor(step % 5 != 4)
        before = summary.sim.clone(), summary.nearest.clone()
        dropped = summary.step(keys, valid, weights, positions, size, 1, 0.5, phi, active=active)
        assert (summary.sim.diagonal(dim1=1, dim2=2) == 0).all()
        assert torch.equal(summary.nearest, summary.sim.amax(dim=-1)), step
        # Rows where nothing joined keep their matrix and nearest values exactly.
        unchanged = (dropped[:, 0] == size) | ~active
        assert torch.equal(summary.sim[unchanged], before[0][unchanged]), step
        assert torch.equal(summary.nearest[unchanged], before[1][unchanged]), step
        keep = torch.ones(rows, tokens + 1, dtype=torch.bool)
        if bool(active):
            keep.scatter_(1, dropped, False)
        else:
            keep[:, -1] = False  # nothing joined: the test forgets the newest token
        keys = keys[keep].reshape(rows, tokens, dim)
        valid = valid[keep].reshape(rows, tokens)
        positions = positions[keep].reshape(rows, tokens)


def test_decode_rebuilds_the_summary_when_the_stored_tokens_changed():
    """Module doc: a decode step checks the summary's member positions against the stored tokens
    and rebuilds the matrix from the keys if they differ; REBUILDS counts every rebuild. Here the
    second step sees other tokens (positions 50..59): it must act exactly as on a fresh state."""
    generator = torch.Generator().manual_seed(2)
    b, h, n, d, budget = 1, 2, 10, 4, 9
    policy = BumbleBee(local_window=3)
    valid = torch.ones(b, h, n, dtype=torch.bool)

    def scoring(offset):
        keys = torch.randn(b, h, n, d, generator=generator)
        scores = torch.rand(b, h, n, generator=generator) * 4
        return decode_scoring(keys, scores, valid, torch.arange(offset, offset + n).expand(b, h, n))

    state = {}
    policy.select_decode(scoring(0), budget, state)
    assert state[REBUILDS] == 1
    other = scoring(50)
    keep = policy.select_decode(other, budget, state)
    assert state[REBUILDS] == 2
    assert torch.equal(keep, policy.select_decode(other, budget, {}))
    # aligned_with: the first T stored positions (T or more of them) are the members, in order.
    summary = state[SUMMARY]
    members = summary.positions
    assert summary.aligned_with(members) and summary.aligned_with(torch.cat([members, members + 100], dim=1))
    assert not summary.aligned_with(members.flip(-1)) and not summary.aligned_with(members[:, :-1])


# ----------------------------------------------------------------------------------------------
# Through the cache and the model
# ----------------------------------------------------------------------------------------------


def compressed_layers(cache):
    return [i for i, layer in enumerate(cache.layers) if cache.is_compressed(i)]


def assert_summary_matches_store(layer, summary_size: int) -> None:
    """The cached summary is the oldest ``tau_s`` stored tokens (by position: the cache writes the
    newest token into a freed slot), and its similarity matrix (by slot) is ReLU(cos) of their
    stored keys."""
    keys, _, positions, _ = layer.dense()
    rows = keys.shape[0] * keys.shape[1]
    summary = layer.policy_state[SUMMARY]
    assert summary.size == summary_size
    order = positions.reshape(rows, -1).argsort(dim=-1)[:, :summary_size]
    assert (summary.positions == positions.reshape(rows, -1).gather(1, order)).all()
    slot_of_rank = summary.slot_of_rank
    by_rank = summary.sim.gather(1, slot_of_rank[:, :, None].expand(-1, -1, summary_size))
    by_rank = by_rank.gather(2, slot_of_rank[:, None, :].expand(-1, summary_size, -1))
    stored = keys.reshape(rows, -1, keys.shape[-1]).gather(1, order[:, :, None].expand(-1, -1, keys.shape[-1]))
    valid = summary.valid.gather(1, slot_of_rank)
    fresh = relu_cosine_similarity(stored, valid)
    # The matrix holds the off-diagonal similarities, self_sim the diagonal.
    assert torch.allclose(summary.self_sim.gather(1, slot_of_rank), fresh.diagonal(dim1=1, dim2=2), atol=1e-5)
    fresh.diagonal(dim1=1, dim2=2).zero_()
    assert torch.allclose(by_rank, fresh, atol=1e-5)


@torch.no_grad()
def run_checked(model, cache, input_ids, attention_mask, budget: int, steps: int, pad: int):
    """Prefill + ``steps`` greedy decode steps; after each, every compressed layer holds exactly
    ``budget`` tokens per (batch, head) row, no padding, and its local window."""
    policy = cache.policy
    _, local = policy.split(budget)
    output = model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
    mask, seen = attention_mask, input_ids.shape[1]
    logits = [output.logits[:, -1]]
    for step in range(steps + 1):
        for index in compressed_layers(cache):
            layer = cache.layers[index]
            assert (layer.lengths == budget).all(), (step, index, layer.lengths)
            positions = layer.dense()[2].sort(dim=-1).values  # by position: freed slots take the newest
            assert (positions[-1] >= pad).all()  # the padded row keeps no padding
            assert (positions[..., budget - local :] == torch.arange(seen - local, seen)).all()
            assert_summary_matches_store(layer, budget - local)
            assert REBUILDS not in layer.policy_state  # the prefill selection seeded Algorithm 2
        if step == steps:
            break
        next_token = output.logits[:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(next_token)], dim=1)
        output = model(input_ids=next_token, attention_mask=mask, past_key_values=cache, use_cache=True)
        logits.append(output.logits[:, -1])
        seen += 1
    return torch.stack(logits)


@pytest.mark.parametrize("architecture,attention", ALL_TINY)
def test_full_budget_matches_plain_transformers(architecture, attention):
    model = tiny_model(architecture, attention)
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size)
    expected = reference_logits(model, input_ids, attention_mask, steps=20)
    for method in ("bumblebee", "bumblebee-power"):
        cache = make_cache(model, method, budget=input_ids.shape[1] + 21)
        actual = prefill_and_decode(model, cache, input_ids, attention_mask, steps=20)
        assert (actual - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("architecture,attention", ALL_TINY)
def test_prefill_and_50_decode_steps_small_budget(architecture, attention):
    model = tiny_model(architecture, attention)
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=40, pad=9)
    method = "bumblebee-power" if attention == "gqa" else "bumblebee"
    cache = make_cache(model, method, budget=14)
    logits = run_checked(model, cache, input_ids, attention_mask, budget=14, steps=50, pad=9)
    assert torch.isfinite(logits).all()


def test_embedded_model_small_budget_50_steps():
    # One row: the 262k-word output layer dominates the run time; padding is covered by every
    # tiny model above.
    model, tokenizer = load_model()
    inputs = tokenizer(
        ["The history of the bee hive begins with a small colony of workers that gather pollen"], return_tensors="pt"
    )
    budget = 10
    assert inputs["input_ids"].shape[1] > budget
    cache = make_cache(model, "bumblebee", budget=budget)
    logits = run_checked(model, cache, inputs["input_ids"], inputs["attention_mask"], budget, steps=50, pad=0)
    assert torch.isfinite(logits).all()
    assert len(compressed_layers(cache)) == sum(not layer.is_sliding for layer in cache.layers) > 0


def test_decode_every_4_lets_several_tokens_join_per_decision():
    model = tiny_model("mistral", "gqa")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=40, pad=9)
    budget = 12
    cache = make_cache(model, "bumblebee", budget=budget, decode_every=4)
    logits = prefill_and_decode(model, cache, input_ids, attention_mask, steps=30)
    assert torch.isfinite(logits).all()
    summary_size, _ = cache.policy.split(budget)
    for index in compressed_layers(cache):
        layer = cache.layers[index]
        assert (layer.lengths <= budget + 3).all() and (layer.lengths >= budget).all()
        # 30 steps after the cut: the last decision (step 28) let 4 tokens join, 2 arrived since.
        assert (layer.lengths == budget + 2).all()
        assert REBUILDS not in layer.policy_state
        assert_summary_matches_store(layer, summary_size)
        assert (layer.dense()[2][1] >= 9).all()


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_greedy_variants_agree_inside_the_model(architecture):
    model = tiny_model(architecture, "gqa")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=48, pad=7)
    kept = {}
    for greedy in ("plain", "lazy", "stochastic"):
        cache = make_cache(model, "bumblebee", budget=16, greedy=greedy, epsilon=1e-300)
        prefill_and_decode(model, cache, input_ids, attention_mask, steps=0)
        kept[greedy] = [cache.layers[i].dense()[2].clone() for i in compressed_layers(cache)]
    for greedy in ("lazy", "stochastic"):
        assert all((a == b).all() for a, b in zip(kept["plain"], kept[greedy], strict=True))


def test_prefill_keeps_padding_only_when_a_row_has_too_few_real_tokens():
    model = tiny_model("llama", "mha")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=40, pad=34)  # 6 real tokens
    cache = make_cache(model, "bumblebee", budget=16)
    prefill_and_decode(model, cache, input_ids, attention_mask, steps=3)
    for index in compressed_layers(cache):
        layer = cache.layers[index]
        assert (layer.lengths == 16).all()
        positions = layer.dense()[2]
        assert ((positions[1] >= 34).sum(-1) == 9).all()  # all 6 + 3 generated real tokens are kept
        assert (positions[0] >= 0).all()


def test_registry_and_defaults():
    plain, power = make_policy("bumblebee"), make_policy("bumblebee-power")
    assert isinstance(plain, BumbleBee) and isinstance(power, BumbleBeePower)
    assert plain.concave.kind == "log" and power.concave.kind == "power"
    assert plain.config.mixture_weight == 0.3 and plain.config.greedy == "stochastic" and plain.config.epsilon == 1e-5
    assert (power.config.power_alpha, power.config.power_beta) == (0.04, 1.0)
    assert plain.split(100) == (50, 50) and plain.split(7) == (4, 3)
    assert BumbleBee(local_window=10).split(25) == (15, 10)
    assert BumbleBee(local_fraction=0.0).split(5) == (5, 0)


@pytest.mark.parametrize(
    "parameters,name",
    [
        ({"mixture_weight": -0.1}, "mixture_weight"),
        ({"mixture_weight": 1.5}, "mixture_weight"),
        ({"mixture_weight": float("nan")}, "mixture_weight"),
        ({"epsilon": 0.0}, "epsilon"),
        ({"epsilon": -1e-5}, "epsilon"),
        ({"epsilon": 1.0}, "epsilon"),
        ({"greedy": "fast"}, "greedy"),
        ({"concave": "sqrt"}, "concave"),
        ({"power_alpha": 0.0}, "power_alpha"),
        ({"power_alpha": 2.0}, "power_alpha"),
        ({"power_beta": -1.0}, "power_beta"),
        ({"local_fraction": 1.0}, "local_fraction"),
        ({"local_fraction": -0.5}, "local_fraction"),
        ({"local_window": -1}, "local_window"),
        ({"local_window": 2.5}, "local_window"),
        ({"seed": -1}, "seed"),
        # Numbers only: a bool or a numeric string is rejected with the parameter's name.
        ({"power_alpha": True}, "power_alpha"),
        ({"power_beta": "1.0"}, "power_beta"),
        ({"epsilon": "1e-5"}, "epsilon"),
    ],
)
@pytest.mark.parametrize("method", ["bumblebee", "bumblebee-power"])
def test_invalid_parameters_raise(method, parameters, name):
    with pytest.raises(ValueError, match=name):
        make_policy(method, **parameters)


def test_budget_below_local_window_plus_one_raises():
    policy = BumbleBee(local_window=8)
    assert policy.minimum_budget() == 9 and policy.split(9) == (1, 8)
    with pytest.raises(ValueError, match=r"budget=8: .* local_window \+ 1 = 9 tokens"):
        policy.split(8)
    model = tiny_model("llama", "gqa")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size)
    with pytest.raises(ValueError, match="budget"):
        cache = make_cache(model, "bumblebee", budget=8, local_window=8)
        prefill_and_decode(model, cache, input_ids, attention_mask, steps=0)


# ----------------------------------------------------------------------------------------------
# Scores, evictions and memory against independent references (issue 10 tests, issue 9 items 5-6)
# ----------------------------------------------------------------------------------------------

_COLUMN_SUMS: dict[int, torch.Tensor] = {}
_ALLOWED: dict[int, torch.Tensor] = {}


def eager_reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Plain eager attention over a DynamicCache. Records the column sums of every query's weights
    (the accumulated attention, averaged over the query heads of a KV group) and, in decode,
    attends only the positions ``_ALLOWED[layer]`` (``[B, H, N]``) when given."""
    batch, kv_heads, length, _ = key.shape
    group = query.shape[1] // kv_heads
    allowed = attention_mask[:, :, :, :length].expand(batch, kv_heads, query.shape[2], length)
    kept = _ALLOWED.get(module.layer_idx)
    if kept is not None and query.shape[2] == 1:
        allowed = allowed & kept[:, :, None, :]
    allowed = allowed.repeat_interleave(group, dim=1)
    logits = torch.matmul(query, key.repeat_interleave(group, dim=1).transpose(-1, -2)) * scaling
    weights = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
    summed = weights.sum(dim=2).reshape(batch, kv_heads, group, length).mean(dim=2)
    previous = _COLUMN_SUMS.get(module.layer_idx)
    if previous is not None:
        summed[..., : previous.shape[-1]] += previous
    _COLUMN_SUMS[module.layer_idx] = summed
    return torch.matmul(weights, value.repeat_interleave(group, dim=1)).transpose(1, 2).contiguous(), None


def use_eager_reference(model):
    from transformers import AttentionInterface, AttentionMaskInterface

    from helpers import materialised_mask

    AttentionInterface.register("bumblebee-reference", eager_reference_attention)
    AttentionMaskInterface.register("bumblebee-reference", materialised_mask)
    model.set_attn_implementation("bumblebee-reference")


@pytest.mark.parametrize("method", ["bumblebee", "bumblebee-power"])
def test_accumulated_attention_is_every_query_of_prefill_and_decode(method):
    """The scores BumbleBee's feature term weighs (Eq. 3: a_n^i, accumulated attention) equal the
    column sums of every query the model ran, prefill and decode (kills the mutants
    "observe_decode does nothing" and "prefill scores are the last query's attention")."""
    from transformers import DynamicCache

    model = tiny_model("llama", "gqa")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=24, pad=5)
    steps = 10
    cache = make_cache(model, method, budget=input_ids.shape[1] + steps + 1)
    logits = prefill_and_decode(model, cache, input_ids, attention_mask, steps)
    tokens = logits[:-1].argmax(-1)[:, :, None]
    _COLUMN_SUMS.clear()
    _ALLOWED.clear()
    use_eager_reference(model)
    try:
        prefill_and_decode(
            model, DynamicCache(config=model.config), input_ids, attention_mask, steps, forced_tokens=tokens
        )
    finally:
        model.set_attn_implementation("sdpa")
    for layer in cache.compressed_layers:
        stored = cache.layers[layer].dense()[3][SCORE]
        torch.testing.assert_close(stored, _COLUMN_SUMS[layer], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("architecture,attention", [("llama", "gqa"), ("qwen3", "mha")])
def test_evicting_run_equals_attention_over_exactly_the_kept_tokens(architecture, attention):
    """With evictions at every step: each decode step's logits equal plain attention restricted
    to the tokens the cache held for that step (prefill and decode evictions both exercised)."""
    from transformers import DynamicCache

    model = tiny_model(architecture, attention)
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=30, pad=0)
    budget, steps = 12, 15
    cache = make_cache(model, "bumblebee", budget=budget)
    reference_cache = DynamicCache(config=model.config)
    batch = input_ids.shape[0]
    with torch.no_grad():
        output = model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
        use_eager_reference(model)
        _ALLOWED.clear()
        _COLUMN_SUMS.clear()
        expected = model(
            input_ids=input_ids, attention_mask=attention_mask, past_key_values=reference_cache, use_cache=True
        )
        model.set_attn_implementation("kvhive")
        mask = attention_mask
        for step in range(steps):
            token = output.logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            total = mask.shape[1]
            _ALLOWED.clear()
            for layer in cache.compressed_layers:
                positions = cache.layers[layer].dense()[2].long()
                assert positions.shape[-1] == budget  # the cache was cut to the budget
                allowed = torch.zeros(batch, positions.shape[1], total, dtype=torch.bool)
                allowed.scatter_(2, positions, True)
                allowed[..., -1] = True  # the new token
                _ALLOWED[layer] = allowed
            output = model(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True)
            use_eager_reference(model)
            expected = model(input_ids=token, attention_mask=mask, past_key_values=reference_cache, use_cache=True)
            model.set_attn_implementation("kvhive")
            assert (output.logits[:, -1] - expected.logits[:, -1]).abs().max().item() <= 1e-4, step
    _ALLOWED.clear()


def test_policy_state_bytes_count_the_summary_and_stay_within_a_summary_matrix():
    model = tiny_model("llama", "gqa")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=40, pad=0)
    budget = 16
    cache = make_cache(model, "bumblebee", budget=budget)
    prefill_and_decode(model, cache, input_ids, attention_mask, steps=30)
    summary_size, _ = cache.policy.split(budget)
    rows = input_ids.shape[0] * model.config.num_key_value_heads
    held = cache.statistics()["policy_state_bytes"]
    expected = 0
    for layer in cache.compressed_layers:
        summary = cache.layers[layer].policy_state[SUMMARY]
        expected += sum(
            getattr(summary, name).nbytes
            for name in (
                "sim",
                "self_sim",
                "nearest",
                "norms",
                "valid",
                "slot_of_rank",
                "rank_of_slot",
                "positions",
            )
        )
    assert held == expected > 0
    # Bounded by a tau_s x tau_s float32 matrix plus O(tau_s) per row and layer, whatever the length.
    per_layer_bound = rows * (summary_size * summary_size * 4 + 8 * summary_size * 8)
    assert held <= len(cache.compressed_layers) * per_layer_bound
    longer = make_cache(model, "bumblebee", budget=budget)
    prefill_and_decode(model, longer, input_ids, attention_mask, steps=60)
    assert longer.statistics()["policy_state_bytes"] == held  # does not grow with the stream


@pytest.mark.parametrize("method", ["bumblebee", "bumblebee-power"])
def test_a_left_padded_row_gets_what_it_gets_alone(method):
    """Issue 9 item 5: stochastic greedy's draws and sample size are the row's own (epsilon 0.3:
    each step samples ~5 of the ~25 candidates, so the draws decide)."""
    model = tiny_model("llama", "gqa")
    pad = 9
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=40, pad=pad)
    budget, steps = 14, 12
    assert stochastic_sample_size(40 - pad - 7, 7, 0.3) < 40 - pad - 7 - 7
    cache = make_cache(model, method, budget=budget, epsilon=0.3)
    batch_logits = prefill_and_decode(model, cache, input_ids, attention_mask, steps)

    def new_cache():
        return make_cache(model, method, budget=budget, epsilon=0.3)

    for row, offset, alone in solo_runs(model, new_cache, input_ids, attention_mask, (0, pad), steps, batch_logits):
        for layer in cache.compressed_layers:
            in_batch = cache.layers[layer].dense()[2][row] - offset
            assert torch.equal(alone.layers[layer].dense()[2][0], in_batch)


def test_stochastic_draws_are_seeded_by_seed_layer_and_head_not_batch_row():
    """Module doc: one generator per (batch row, KV head) seeded with seed, the layer and the head
    (not the batch row). Every row here has the same keys and scores, and epsilon = 0.5 samples 4
    of the 50 candidates per step: heads draw differently, batch rows alike, and another layer or
    another seed draws differently."""
    generator = torch.Generator().manual_seed(6)
    b, h, n, d, budget = 2, 2, 60, 6, 20
    keys = torch.randn(1, 1, n, d, generator=generator).expand(b, h, n, d).contiguous()
    weights = torch.rand(1, 1, n, generator=generator).expand(b, h, n).contiguous()
    assert stochastic_sample_size(50, 10, 0.5) == 4

    def kept(seed=0, layer=0):
        scoring = accumulated_scoring(keys, weights, layer_index=layer, num_layers=2)
        return BumbleBee(epsilon=0.5, seed=seed).select_prefill(scoring, budget, {})

    first = kept()
    assert torch.equal(first[0], first[1])
    assert not torch.equal(first[0, 0], first[0, 1])
    assert not torch.equal(first, kept(layer=1))
    assert not torch.equal(first, kept(seed=1))


def test_prefill_without_running_scores_uses_the_prompts_accumulated_attention():
    """select_prefill on scoring inputs without running scores weighs each token by the attention
    the prompt's queries gave it (Eq. 3's a_n^i), as it does with those scores stored."""
    generator = torch.Generator().manual_seed(8)
    b, hq, h, n, d, budget = 1, 4, 2, 24, 8, 10
    queries = torch.randn(b, hq, n, d, generator=generator)
    keys = torch.randn(b, h, n, d, generator=generator)
    fresh = scoring_inputs(queries, keys, keys.clone())
    stored = scoring_inputs(queries, keys, keys.clone())
    stored.token_scores[SCORE] = stored.to_kv_heads(stored.accumulated_attention()).float()
    policy = BumbleBee(greedy="plain", mixture_weight=0.1)
    assert torch.equal(policy.select_prefill(fresh, budget, {}), policy.select_prefill(stored, budget, {}))
    torch.testing.assert_close(fresh.token_scores[SCORE], stored.token_scores[SCORE])


def test_importance_scale_normalised_applies_phi_to_the_mass_fraction():
    """importance_scale="normalised": c(S) = phi(a(S)/a(V)) / phi(1); "raw" (default): phi(a(S)) / phi(a(V))."""
    policy = BumbleBee()
    assert policy.config.importance_scale == "raw"
    with pytest.raises(ValueError, match="importance_scale"):
        BumbleBee(importance_scale="fraction")
    generator = torch.Generator().manual_seed(0)
    b, h, n, d = 1, 2, 40, 8
    keys = torch.randn(b, h, n, d, generator=generator)
    weights = torch.rand(b, h, n, generator=generator) * 30
    kept = {}
    for scale in ("raw", "normalised"):
        policy = BumbleBeePower(importance_scale=scale, greedy="plain", mixture_weight=0.05)
        scoring = accumulated_scoring(keys, weights)
        kept[scale] = policy.select_prefill(scoring, 12, {})
        # The objective the greedy maximised, rebuilt by hand for one head.
        candidates = n - policy.split(12)[1]
        w = weights[0, 0, :candidates].double()
        if scale == "normalised":
            w = w / w.sum()
        chosen = kept[scale][0, 0, :candidates]
        phi = Concave("power")
        expected_feature = phi(w[chosen].sum()) / phi(w.sum())
        objective = Mixture(
            relu_cosine_similarity(keys[0, :1, :candidates]),
            w[None].float(),
            torch.ones(1, candidates, dtype=torch.bool),
            0.05,
            phi,
        )
        torch.testing.assert_close(objective.feature(chosen[None])[0], expected_feature)
    assert not torch.equal(kept["raw"], kept["normalised"])


@pytest.mark.parametrize("scale", ["raw", "normalised"])
def test_prefill_keeps_the_greedy_optimum_of_the_objective_with_its_importance_scale(scale):
    """Algorithm 1 on each head's own objective: the kept summary equals the plain greedy of
    Mixture(sim, w, valid, lambda, power) straight from the definition, where w is the head's
    accumulated attention ("raw") or its fraction of the head's real mass ("normalised"), with the
    left padding of the row carrying no weight. Head masses of ~15 and ~0.25 and lambda = 0.5 make
    the selection depend on the scale (mutation testing: the normalisation's branch, its clamp, its
    sum axis and its padding handling were not pinned; each mutant fails this test)."""
    generator = torch.Generator().manual_seed(3)
    b, h, n, d, budget, pad = 1, 2, 36, 8, 12, 3
    keys = torch.randn(b, h, n, d, generator=generator)
    weights = torch.rand(b, h, n, generator=generator) * torch.tensor([30.0, 0.5])[None, :, None]
    mask = torch.ones(b, 1, 1, n, dtype=torch.bool)
    mask[..., :pad] = False
    policy = BumbleBeePower(importance_scale=scale, greedy="plain", mixture_weight=0.5)
    scoring = accumulated_scoring(keys, weights, mask)
    kept = policy.select_prefill(scoring, budget, {})
    summary_size, local = policy.split(budget)
    candidates = n - local
    valid = mask[0, 0, 0, :candidates]
    for head in range(h):
        w = weights[0, head, :candidates].double() * valid
        if scale == "normalised":
            w = w / w.sum()
        objective = Mixture(
            relu_cosine_similarity(keys[0, head : head + 1, :candidates], valid[None]),
            w[None],
            valid[None],
            0.5,
            Concave("power"),
        )
        expected = reference_greedy(objective, summary_size)[0]
        assert torch.equal(kept[0, head, :candidates], expected), (scale, head)
        assert kept[0, head, candidates:].all()


def test_prefill_within_the_budget_keeps_every_token():
    policy = BumbleBee()
    b, h, n, d = 2, 3, 10, 4
    keys = torch.randn(b, h, n, d, generator=torch.Generator().manual_seed(0))
    scoring = accumulated_scoring(keys, torch.rand(b, h, n))
    for budget in (n, n + 5):
        state = {}
        kept = policy.select_prefill(scoring, budget, state)
        assert kept.dtype == torch.bool and kept.shape == (b, h, n) and kept.all()
        # No prefill selection, so no summary: decode builds it from the stored tokens (REBUILDS).
        assert state == {}
        # Decode within the budget evicts nothing (None) and leaves the state alone.
        assert policy.select_decode(scoring, budget, state) is None and state == {}


@pytest.mark.parametrize("rows_per_chunk", [1, 3])
def test_prefill_in_chunks_of_rows_equals_one_chunk(monkeypatch, rows_per_chunk):
    # The similarity matrices are built a chunk of (batch, head) rows at a time to bound memory;
    # the kept tokens and the streaming summary must not depend on the chunking.
    import kvhive.methods.bumblebee as bumblebee_module

    b, h, n, d, budget = 2, 3, 30, 6, 10
    generator = torch.Generator().manual_seed(5)
    keys = torch.randn(b, h, n, d, generator=generator)
    weights = torch.rand(b, h, n, generator=generator)

    def run():
        scoring = accumulated_scoring(keys, weights, layer_index=1, num_layers=2)
        state = {}
        return BumbleBee().select_prefill(scoring, budget, state), state[SUMMARY]

    whole, whole_summary = run()
    candidates = n - BumbleBee().split(budget)[1]
    monkeypatch.setattr(bumblebee_module, "MAX_SIMILARITY_ELEMENTS", rows_per_chunk * candidates * candidates)
    chunked, chunked_summary = run()
    assert torch.equal(whole, chunked)
    for field in dataclasses.fields(whole_summary):
        assert torch.equal(getattr(whole_summary, field.name), getattr(chunked_summary, field.name)), field.name


@pytest.mark.parametrize("method", ["bumblebee", "bumblebee-power"])
def test_an_eager_full_capacity_step_knows_its_length_and_keeps_what_the_device_path_keeps(method):
    """Eager steps of a full fixed capacity (issue 23): the host knows every slot holds a token
    (``known_length``, kept by ``kept_per_row``), so the step builds no mask of filled or empty slots.
    Its logits, stored positions (slot by slot) and summaries equal those of the same steps taken
    by the device path (the host length forgotten before every step, as after a compiled step)."""
    model = tiny_model("llama", "gqa")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=40, pad=5)

    def run(forget: bool):
        cache = make_cache(model, method, 20)
        records = []
        with torch.no_grad():
            output = model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
            mask = attention_mask
            for _ in range(12):
                layers = [cache.layers[i] for i in compressed_layers(cache)]
                assert all(layer.fixed_capacity for layer in layers)
                if forget:
                    for layer in layers:
                        layer.layout.counter.mark_stale()
                else:
                    capacity = layers[0].buffers()[0].shape[2]
                    # Known before the step (budget) and full once the new token is appended.
                    assert all(layer.known_length == capacity - 1 for layer in layers)
                token = output.logits[:, -1].argmax(-1, keepdim=True)
                mask = torch.cat([mask, torch.ones_like(token)], dim=1)
                output = model(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True)
                records.append(
                    (
                        output.logits,
                        [layer.dense()[2].clone() for layer in layers],
                        [dataclasses.astuple(layer.policy_state[SUMMARY]) for layer in layers],
                    )
                )
        return records

    known, device = run(False), run(True)
    for (logits, positions, summaries), (logits_d, positions_d, summaries_d) in zip(known, device, strict=True):
        assert torch.equal(logits, logits_d)
        assert all(torch.equal(a, b) for a, b in zip(positions, positions_d, strict=True))
        for one, other in zip(summaries, summaries_d, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(one, other, strict=True))


@pytest.mark.parametrize("method, padded", [("bumblebee", False), ("bumblebee", True), ("bumblebee-power", False)])
def test_the_joiners_similarities_from_the_attentions_product_keep_what_its_own_product_keeps(
    method, padded, monkeypatch
):
    """On the CPU in float32 the joiner's products with the stored keys come from the step's
    attention (``decode_key_probes``: its key joins the rows of the ``q·Kᵀ`` product), not from a
    multiply-sum over the stored keys: the same dot products summed in another order. Every
    evicting step of every compressed layer must take them; the kept positions must be those of
    the multiply-sum and the summaries equal to rounding."""
    from kvhive.methods.submodular import StreamingSummary

    model = tiny_model("llama", "gqa")
    generator = torch.Generator().manual_seed(7)
    if padded:
        input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=40, pad=5)
    else:
        input_ids = torch.randint(3, model.config.vocab_size, (2, 40), generator=generator)
        attention_mask = torch.ones_like(input_ids)
    forced = [torch.randint(3, model.config.vocab_size, (2, 1), generator=generator) for _ in range(16)]
    original = StreamingSummary.step

    def run(probes: bool):
        joiners = {"probed": 0, "own": 0}

        def counted(self, *args, **kwargs):
            joiners["probed" if kwargs.get("joiner") is not None else "own"] += 1
            if kwargs.get("joiner") is not None:  # the products are the keys' dot products
                index, key, products = kwargs["joiner"]
                torch.testing.assert_close(products, torch.linalg.vecdot(args[0], key), rtol=1e-5, atol=1e-6)
            return original(self, *args, **kwargs)

        monkeypatch.setattr(StreamingSummary, "step", counted)
        monkeypatch.setattr(BumbleBee, "takes_key_probes", probes)
        cache = make_cache(model, method, 20)
        prefill_and_decode(model, cache, input_ids, attention_mask, steps=len(forced), forced_tokens=forced)
        layers = [cache.layers[i] for i in compressed_layers(cache)]
        kept = [layer.dense()[2].sort(-1).values for layer in layers]
        summaries = [dataclasses.astuple(layer.policy_state[SUMMARY]) for layer in layers]
        return kept, summaries, joiners, len(layers)

    probed_kept, probed_summaries, probed_joiners, layers = run(True)
    own_kept, own_summaries, own_joiners, _ = run(False)
    steps = len(forced) * layers
    assert probed_joiners == {"probed": steps, "own": 0} and own_joiners == {"probed": 0, "own": steps}
    assert all(torch.equal(a, b) for a, b in zip(probed_kept, own_kept, strict=True))
    for probed, own in zip(probed_summaries, own_summaries, strict=True):
        for a, b in zip(probed, own, strict=True):
            if a.is_floating_point():
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            else:
                assert torch.equal(a, b)


def test_a_joiners_products_serve_one_joiner_and_more_are_refused():
    """``StreamingSummary.step(joiner=...)`` carries one joiner's products: asked to let two join with
    them it refuses, naming the parameter, instead of using the one joiner's products twice."""
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 8, 4, generator=generator)
    valid = torch.ones(2, 8, dtype=torch.bool)
    positions = torch.arange(8).expand(2, 8)
    weights = torch.rand(2, 8, generator=generator)
    summary = StreamingSummary.from_keys(keys[:, :4], valid[:, :4], positions[:, :4])
    index = torch.full((2, 1), 4)
    joiner = (index, keys[:, 4:5], torch.linalg.vecdot(keys, keys[:, 4:5]))
    with pytest.raises(ValueError, match="joiners=2"):
        summary.step(keys, valid, weights, positions, 4, 2, 0.5, Concave("log"), joiner=joiner)
    # One joiner: the step runs and drops one stored index per row.
    assert summary.step(keys, valid, weights, positions, 4, 1, 0.5, Concave("log"), joiner=joiner).shape == (2, 1)


def test_rows_per_similarity_chunk_fill_the_device_room(monkeypatch):
    """On CUDA the rows whose float32 matrices fit in DEVICE_SIMILARITY_FRACTION of the room the device
    has (at least 1, at most all), elsewhere MAX_SIMILARITY_ELEMENTS' bound; a room short of one row's
    matrix is refused as out of memory, naming the chunked prefill; the kept tokens and the summary
    are those of one chunk."""
    import kvhive.methods.bumblebee as bumblebee_module

    rows_of = bumblebee_module.similarity_rows_per_chunk
    assert rows_of(8, 7_400, "cpu") == 8 and rows_of(8, 16_000, "cpu") == 2 and rows_of(8, 29_500, "cpu") == 1
    per_row = 4 * 29_500 * 29_500
    # 3 rows fit: 3 chunks, shared evenly (3 + 3 + 2); 7 fit: 2 chunks of 4, not 7 + 1.
    for room, expected in [(2 * 3 * per_row + 5, 3), (2 * 7 * per_row, 4), (per_row, 1), (80 * per_row, 8)]:
        monkeypatch.setattr(bumblebee_module, "_device_room", lambda device, room=room: room)
        assert rows_of(8, 29_500, "cuda") == expected, room

    monkeypatch.setattr(bumblebee_module, "_device_room", lambda device: per_row - 1)
    with pytest.raises(torch.OutOfMemoryError, match=r"29,500 x 29,500 .*3\.2 GiB.*prefill_chunk=N"):
        rows_of(8, 29_500, "cuda")

    b, h, n, d, budget = 2, 3, 30, 6, 10
    generator = torch.Generator().manual_seed(6)
    keys = torch.randn(b, h, n, d, generator=generator)
    weights = torch.rand(b, h, n, generator=generator)
    candidates = n - BumbleBee().split(budget)[1]
    chunks = []
    record_greedy_calls(monkeypatch, bumblebee_module, lambda objective: chunks.append(objective.rows))

    def run(room):
        monkeypatch.setattr(bumblebee_module, "_device_room", lambda device: room)
        chunks.clear()
        state = {}
        kept = BumbleBee().select_prefill(
            accumulated_scoring(keys, weights, layer_index=1, num_layers=2), budget, state
        )
        return kept, state[SUMMARY], list(chunks)

    whole, whole_summary, whole_chunks = run(None)
    chunked, chunked_summary, chunked_chunks = run(2 * 4 * 4 * candidates * candidates)
    assert whole_chunks == [6] and chunked_chunks == [3, 3]  # 4 rows fit: 2 chunks, shared evenly
    assert torch.equal(whole, chunked)
    for field in dataclasses.fields(whole_summary):
        assert torch.equal(getattr(whole_summary, field.name), getattr(chunked_summary, field.name)), field.name
