"""SubGen: k-center eviction (`subgen`) and the streaming attention estimator (`subgen-attention`).

The paper's testable statements (arXiv:2402.06082, docs/METHODS.md):
* Eq. (3) / Theorem 1 on (m, δ)-clusterable streams, with Eq. (5) for the partition function;
* memory O(d·(m·t + s)): grows with the number of clusters, not with n;
* Lemma 1 (M holds i.i.d. samples ∝ ‖v‖²) and Lemma 2 (clusters: representatives > δ apart,
  members within δ, counts, t i.i.d. uniform samples per cluster), checked by chi-square;
* greedy k-center: farthest point each step, 2-approximation of the optimal radius.
"""

from __future__ import annotations

import itertools
import math
import os
import signal

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import subgen_refresh_divergence
import torch

import kvhive
from kvhive.compat import cache_kwarg
from kvhive.methods.base import DECODE, PREFILL, ScoringInputs
from kvhive.methods.registry import make_policy
from kvhive.methods.subgen import (
    NEAREST_DISTANCE,
    NEAREST_POSITION,
    SubGen,
    farthest_point_order,
    maintain_candidates,
)
from kvhive.methods.subgen_attention import (
    STATE_KEY,
    MemoryPlan,
    StreamingStructures,
    SubGenAttention,
    SubGenAttentionConfig,
    cluster_counts,
    clustering_statistics,
    memory_plan,
    structures_nbytes,
)
from kvhive.methods.subgen_candidates import APPROXIMATE_STALE_REFRESH_WIDTH, padded_indices
from kvhive.models import TINY_ARCHITECTURES, TINY_ATTENTION_KINDS, tiny_model

from helpers import left_padded_batch, prefill_and_decode, reference_logits, solo_runs

ALL_TINY = [(a, k) for a in TINY_ARCHITECTURES for k in TINY_ATTENTION_KINDS]


def chi_square_p_value(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Upper tail of the chi-square statistic (dof = cells - 1), via the regularised gamma."""
    statistic = float(((observed - expected) ** 2 / expected).sum())
    dof = observed.numel() - 1
    return float(
        torch.special.gammaincc(
            torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2, dtype=torch.float64)
        )
    )


def scoring_for(
    keys: torch.Tensor,
    valid: torch.Tensor | None = None,
    phase: str = PREFILL,
    positions: torch.Tensor | None = None,
    token_scores: dict | None = None,
) -> ScoringInputs:
    """ScoringInputs over keys ``[B, H, N, d]`` (values = keys; one query)."""
    b, h, n, d = keys.shape
    if valid is None:
        valid = torch.ones(b, h, n, dtype=torch.bool)
    if positions is None:
        positions = torch.arange(n, dtype=torch.int32).expand(b, h, n)
    mask = valid[:, :1, None, :].clone()  # [B, 1, 1, N]
    return ScoringInputs(
        keys=keys,
        values=keys.clone(),
        queries=torch.zeros(b, h, 1, d),
        positions=positions,
        mask=mask,
        scaling=1.0,
        layer_index=0,
        num_layers=1,
        sequence_length=n,
        phase=phase,
        token_scores=dict(token_scores or {}),
    )


def line_keys(xs) -> torch.Tensor:
    """Points on a line as keys ``[1, 1, N, 2]``."""
    return torch.tensor([[x, 0.0] for x in xs]).reshape(1, 1, len(xs), 2)


# ==============================================================================================
# Greedy k-center (subgen)
# ==============================================================================================


def test_kcenter_picks_the_farthest_point_each_step_hand_checked():
    #            0     1    2    3    4    5    6
    keys = line_keys([0.0, 10.0, 1.0, 4.0, 7.0, 9.5, 2.9])
    order = farthest_point_order(keys[0], torch.ones(1, 7, dtype=torch.bool), 5)
    # first = oldest (0); farthest from {0}: 10; from {0, 10}: 4 (distance 4, vs 3 for 7 and 2.9);
    # from {0, 10, 4}: 7 (distance 3); from {0, 10, 4, 7}: 2.9 (1.1, vs 1 for 1 and 0.5 for 9.5).
    assert order.tolist() == [[0, 1, 3, 4, 6]]
    policy = SubGen(recent=0)
    keep = policy.select_prefill(scoring_for(keys), 3, {})
    assert keep[0, 0].tolist() == [True, True, False, True, False, False, False]
    # recent=2 keeps 9.5 and 3 (the last two) and 2 centers of the rest: 0, then 10.
    keep = SubGen(recent=2).select_prefill(scoring_for(keys), 4, {})
    assert keep[0, 0].tolist() == [True, True, False, False, False, True, True]


def test_kcenter_never_spends_budget_on_padding():
    # Row 1 is left-padded by 3 tokens whose (garbage) keys are far from everything: a naive
    # farthest-point search would pick them first.
    keys = torch.randn(2, 2, 12, 4)
    keys[1, :, :3] = 1000.0
    valid = torch.ones(2, 2, 12, dtype=torch.bool)
    valid[1, :, :3] = False
    keep = SubGen(recent=2).select_prefill(scoring_for(keys, valid), 6, {})
    assert (keep.sum(-1) == 6).all()
    assert not keep[1, :, :3].any()
    assert keep[..., -2:].all()
    # Fewer real tokens than the budget: every real token is kept, padding fills the rest.
    keep = SubGen(recent=2).select_prefill(scoring_for(keys[:, :, :8], valid[:, :, :8]), 7, {})
    assert (keep.sum(-1) == 7).all() and keep[1, :, 3:8].all()


def test_kcenter_is_a_2_approximation_against_brute_force():
    generator = torch.Generator().manual_seed(1)
    for trial in range(25):
        n, k = 9, 2 + trial % 3
        points = torch.randn(n, 2, generator=generator).double() * (1 + trial % 4)
        distances = torch.cdist(points, points)
        order = farthest_point_order(points[None].float(), torch.ones(1, n, dtype=torch.bool), k)[0]
        greedy = float(distances[:, order].min(-1).values.max())
        subsets = torch.tensor(list(itertools.combinations(range(n), k)))
        optimum = float(distances[:, subsets].min(-1).values.max(0).values.min())
        assert greedy <= 2 * optimum + 1e-6, (trial, greedy, optimum)
        # The greedy picks are pairwise at least the final radius apart (Gonzalez' argument).
        separation = distances[order][:, order] + torch.eye(k, dtype=torch.float64) * 1e9
        assert float(separation.min()) >= greedy - 1e-5


def _naive_farthest_point(keys: torch.Tensor, candidates: torch.Tensor, count: int) -> torch.Tensor:
    """The textbook loop: distances of every point to each new center, in float64."""
    rows, n, _ = keys.shape
    order = torch.full((rows, count), -1, dtype=torch.long)
    for r in range(rows):
        pool = candidates[r].nonzero().squeeze(-1)
        if pool.numel() == 0:
            continue
        points = keys[r, pool].double()
        nearest = torch.full((pool.numel(),), float("inf"), dtype=torch.float64)
        chosen = 0
        for step in range(min(count, pool.numel())):
            order[r, step] = pool[chosen]
            nearest = torch.minimum(nearest, ((points - points[chosen]) ** 2).sum(-1))
            nearest[chosen] = -1.0
            chosen = int(nearest.argmax())
    return order


def test_batched_farthest_point_equals_the_plain_algorithm():
    generator = torch.Generator().manual_seed(2)
    for trial in range(6):
        n = 40 + 23 * trial
        keys = torch.randn(3, n, 5, generator=generator)
        candidates = torch.rand(3, n, generator=generator) > 0.25
        count = 5 + 4 * trial
        expected = _naive_farthest_point(keys, candidates, count)
        assert torch.equal(farthest_point_order(keys, candidates, count), expected)


def test_decode_evicts_the_newer_member_of_the_closest_pair_hand_checked():
    policy = SubGen(recent=1)
    # Candidates 0, 10, 4 (positions 0, 1, 3) and a newcomer at stored index 3; index 4 is recent.
    near = line_keys([0.0, 10.0, 4.0, 4.5, 50.0])
    keep = policy.select_decode(scoring_for(near, phase=DECODE), 4, {})
    assert keep[0, 0].tolist() == [True, True, True, False, True]  # (4, 4.5): newer 4.5 goes
    # the same keys at 1/100 of the scale (all squared distances below 1) evict the same token
    small = line_keys([0.0, 0.1, 0.04, 0.045, 0.5])
    assert policy.select_decode(scoring_for(small, phase=DECODE), 4, {})[0, 0].tolist() == keep[0, 0].tolist()
    far = line_keys([0.0, 10.0, 4.0, 20.0, 50.0])
    scoring = scoring_for(far, phase=DECODE)
    keep = policy.select_decode(scoring, 4, {})
    assert keep[0, 0].tolist() == [True, True, False, True, True]  # (0, 4): newer 4 goes
    # Nearest neighbours among the survivors {0, 10, 20}: 10 for 0, 0|20 for 10, 10 for 20.
    distances = scoring.token_scores[NEAREST_DISTANCE][0, 0]
    assert distances[[0, 1, 3]].tolist() == [100.0, 100.0, 100.0]
    assert scoring.token_scores[NEAREST_POSITION][0, 0, 0].item() == 1.0


def _brute_force_decode(keys: list[torch.Tensor], positions: list[int], target: int) -> set[int]:
    """Reference: while more than ``target`` candidates, drop the newer of the closest pair."""
    alive = list(range(len(keys)))
    while len(alive) > target:
        best = None
        for a, b in itertools.combinations(alive, 2):
            distance = float(((keys[a] - keys[b]) ** 2).sum())
            if best is None or distance < best[0]:
                best = (distance, a, b)
        _, a, b = best
        alive.remove(a if positions[a] > positions[b] else b)
    return {positions[i] for i in alive}


def _decode_stream_against_reference(stream: torch.Tensor, recent: int, budget: int, prompt: int = 12):
    """Simulates what the cache does over ``stream`` (prefill of ``prompt`` tokens, then one token per
    decode step; compaction of tokens and per-token scores by the keep mask) and checks every step
    against the brute-force rule on the same candidates."""
    policy = SubGen(recent=recent)
    d = stream.shape[-1]
    keys = stream[:prompt][None, None]
    positions = torch.arange(prompt, dtype=torch.int32)[None, None]
    keep = policy.select_prefill(scoring_for(keys, positions=positions), budget, {})
    keys, positions = keys[keep].reshape(1, 1, -1, d), positions[keep].reshape(1, 1, -1)
    scores: dict = {}
    for step in range(prompt, stream.shape[0]):
        keys = torch.cat([keys, stream[step][None, None, None]], dim=2)
        positions = torch.cat([positions, torch.tensor([[[step]]], dtype=torch.int32)], dim=2)
        scores = {name: torch.cat([value, value.new_zeros(1, 1, 1)], dim=2) for name, value in scores.items()}
        candidates_before = positions[0, 0, :-recent].tolist()
        scoring = scoring_for(keys, phase=DECODE, positions=positions, token_scores=scores)
        keep = policy.select_decode(scoring, budget, {})
        assert int(keep.sum()) == budget
        expected = _brute_force_decode([stream[p] for p in candidates_before], candidates_before, budget - recent)
        kept = set(positions[keep].tolist())
        assert kept == expected | set(positions[0, 0, -recent:].tolist()), step
        keys, positions = keys[keep].reshape(1, 1, -1, d), positions[keep].reshape(1, 1, -1)
        scores = {name: value[keep].reshape(1, 1, -1) for name, value in scoring.token_scores.items()}


def test_decode_bookkeeping_matches_a_from_scratch_reference_over_a_stream():
    stream = torch.randn(60, 3, generator=torch.Generator().manual_seed(3))
    _decode_stream_against_reference(stream, recent=2, budget=7)


# ==============================================================================================
# Streaming structures (subgen-attention): Lemma 1, Lemma 2, Eq. (3), memory
# ==============================================================================================


def structures(
    rows: int,
    dim: int,
    t: int,
    s: int,
    delta: float,
    seed: int = 0,
    *,
    dtype: torch.dtype = torch.float32,
    relative_delta: bool = False,
    max_clusters: int | None = None,
) -> StreamingStructures:
    return StreamingStructures(
        rows,
        dim,
        t,
        s,
        dtype=dtype,
        device=torch.device("cpu"),
        seed=seed,
        delta=delta,
        relative_delta=relative_delta,
        max_clusters=max_clusters,
    )


def insert_in_pieces(target: StreamingStructures, keys, values, pieces):
    """Insert ``[R, n, d]`` in consecutive pieces of the given sizes (batch and one-by-one paths)."""
    start, assignments = 0, []
    for size in pieces:
        chunk = slice(start, start + size)
        mask = torch.ones(keys.shape[0], size, dtype=torch.bool)
        assignments.append(target.insert(keys[:, chunk], values[:, chunk], mask))
        start += size
    assert start == keys.shape[1]
    return torch.cat(assignments, dim=1)


def test_lemma1_value_samples_are_iid_proportional_to_squared_norms():
    rows, s = 3000, 4
    weights = torch.arange(1.0, 7.0)  # ‖v_i‖² = i + 1
    keys = torch.arange(6.0)[None, :, None].expand(rows, 6, 2).contiguous()  # key[0] identifies the token
    values = torch.zeros(rows, 6, 2)
    values[..., 1] = weights.sqrt()
    target = structures(rows, 2, t=1, s=s, delta=100.0)
    insert_in_pieces(target, keys, values, [2, 1, 1, 2])
    assert torch.allclose(target.mu, torch.full((rows,), float(weights.sum()), dtype=torch.float64))
    drawn = target.m_keys[..., 0].long()  # [rows, s]
    probability = weights / weights.sum()
    observed = torch.bincount(drawn.reshape(-1), minlength=6).double()
    assert chi_square_p_value(observed, probability.double() * drawn.numel()) > 1e-3
    # Slots are independent: the joint law of slots 0 and 1 is the product law.
    joint = torch.bincount((drawn[:, 0] * 6 + drawn[:, 1]), minlength=36).double()
    expected = (probability[:, None] * probability[None, :]).reshape(-1).double() * rows
    assert chi_square_p_value(joint, expected) > 1e-3
    assert torch.allclose(target.m_sqnorm, weights[drawn])


def test_lemma2_cluster_samples_are_iid_uniform_and_invariants_hold():
    rows, t, n = 2000, 5, 7
    keys = torch.zeros(rows, n, 2)
    keys[..., 0] = 1.0 + 0.01 * torch.arange(n)  # one cluster (all within 0.06 of the first key)
    target = structures(rows, 2, t=t, s=1, delta=0.5)
    insert_in_pieces(target, keys, keys.clone(), [3, 1, 3])
    assert (target.num_clusters == 1).all() and (target.counts[:, 0] == n).all()
    assert torch.equal(target.representatives[:, 0], keys[:, 0])  # the first key represents it
    drawn = ((target.samples[:, 0, :, 0] - 1.0) / 0.01).round().long()
    observed = torch.bincount(drawn.reshape(-1), minlength=n).double()
    assert chi_square_p_value(observed, torch.full((n,), drawn.numel() / n, dtype=torch.float64)) > 1e-3
    joint = torch.bincount(drawn[:, 0] * n + drawn[:, 1], minlength=n * n).double()
    assert chi_square_p_value(joint, torch.full((n * n,), rows / n**2, dtype=torch.float64)) > 1e-3


def _sequential_clusters(points: torch.Tensor, delta: float):
    """Algorithm 1's UPDATESOFTMAXNORMALIZER, one key at a time (assignment only)."""
    representatives, counts, assignment = [], [], []
    for point in points:
        if representatives:
            distances = torch.stack([(point - rep).norm() for rep in representatives])
            best = int(distances.argmin())
            if distances[best] <= delta:
                counts[best] += 1
                assignment.append(best)
                continue
        representatives.append(point)
        counts.append(1)
        assignment.append(len(representatives) - 1)
    return torch.stack(representatives), counts, assignment


def test_batch_insertion_clusters_exactly_like_the_sequential_algorithm():
    generator = torch.Generator().manual_seed(4)
    rows, n, d, delta = 3, 300, 3, 0.6
    keys = torch.randn(rows, n, d, generator=generator)
    target = structures(rows, d, t=2, s=2, delta=delta)
    assignment = insert_in_pieces(target, keys, keys, [1, 200, 1, 1, 97])  # crosses _ASSIGN_CHUNK
    for r in range(rows):
        representatives, counts, expected = _sequential_clusters(keys[r], delta)
        m = len(counts)
        assert int(target.num_clusters[r]) == m
        assert torch.allclose(target.representatives[r, :m], representatives)
        assert target.counts[r, :m].tolist() == counts and assignment[r].tolist() == expected
        # Lemma 2 (3) and (4): members within δ of their representative, representatives > δ apart.
        assert float((keys[r] - representatives[assignment[r]]).norm(dim=-1).max()) <= delta + 1e-5
        separation = torch.cdist(representatives, representatives) + torch.eye(m) * 1e9
        assert float(separation.min()) > delta
        # Lemma 2 (5): every reservoir sample is a member of its cluster.
        for c in range(m):
            members = keys[r][assignment[r] == c]
            for sample in target.samples[r, c]:
                assert bool(((members - sample).abs().sum(-1) == 0).any())


def clusterable_stream(
    rows: int, n: int, d: int, m: int, delta: float, query_norm: float, seed: int, spread: float = 2.0
):
    """(m, δ)-clusterable keys (each within δ/2 of one of m centers), values of varying norms."""
    generator = torch.Generator().manual_seed(seed)
    centers = torch.randn(rows, m, d, generator=generator) * spread
    which = torch.randint(0, m, (rows, n), generator=generator)
    direction = torch.randn(rows, n, d, generator=generator)
    direction = direction / direction.norm(dim=-1, keepdim=True)
    offset = direction * torch.rand(rows, n, 1, generator=generator) * (delta / 2)
    keys = centers.gather(1, which[..., None].expand(-1, -1, d)) + offset
    values = torch.randn(rows, n, d, generator=generator) * (1 + 2 * torch.rand(rows, n, 1, generator=generator))
    query = torch.randn(rows, 1, d, generator=generator)
    query = query / query.norm(dim=-1, keepdim=True) * query_norm
    return keys, values, query


def estimator_error(target: StreamingStructures, keys, values, query, epsilon: float):
    z, tau, max_logit = target.query(query, 1.0)
    logits = (keys @ query.transpose(-1, -2)).squeeze(-1)
    probabilities = torch.softmax(logits, dim=-1)
    exact = (probabilities[:, None, :] @ values)[:, 0]
    error = ((z / tau[..., None])[:, 0] - exact).norm(dim=-1)
    bound = epsilon * probabilities.norm(dim=-1) * torch.linalg.matrix_norm(values, ord=2)
    # Eq. (5): τ relative to the true partition function (both relative to the max logit).
    log_ratio = (tau[:, 0].log() + max_logit[:, 0]) - torch.logsumexp(logits, dim=-1)
    return error, bound, log_ratio


@pytest.mark.parametrize("delta, query_norm, m", [(1.0, 0.5, 8), (0.5, 2.0, 16)])
def test_eq3_error_bound_holds_with_probability_099_on_clusterable_streams(delta, query_norm, m):
    # Theorem 1: t = Ω(ε⁻² e^{2δr} log n), s = Ω(ε⁻² d) give Eq. (3) w.p. ≥ 0.99. Each of the 400
    # rows is an independent stream (its own keys, values, query and random coins).
    rows, n, d, epsilon = 400, 1000, 16, 0.5
    keys, values, query = clusterable_stream(rows, n, d, m, delta, query_norm, seed=10 + m)
    target = structures(rows, d, t=64, s=256, delta=delta, seed=m)
    insert_in_pieces(target, keys, values, [n - 20] + [1] * 20)
    assert int(target.num_clusters.max()) <= m  # pigeonhole (Theorem 1's memory argument)
    error, bound, log_ratio = estimator_error(target, keys, values, query, epsilon)
    assert float((error <= bound).double().mean()) >= 0.99
    assert float((log_ratio.abs() <= math.log1p(epsilon / 3)).double().mean()) >= 0.99
    # Not vacuous: with one sample per structure the guarantee is lost (fails for >10% of rows).
    weak = structures(rows, d, t=1, s=1, delta=delta, seed=m)
    insert_in_pieces(weak, keys, values, [n])
    error, bound, _ = estimator_error(weak, keys, values, query, epsilon)
    assert float((error <= bound).double().mean()) < 0.9


def test_memory_grows_with_the_number_of_clusters_not_with_n():
    rows, d, t, s, delta = 4, 8, 8, 16, 0.5
    by_length = {}
    for n in (500, 1000, 4000):
        keys, values, _ = clusterable_stream(rows, n, d, 8, delta, 1.0, seed=5)
        target = structures(rows, d, t, s, delta)
        insert_in_pieces(target, keys, values, [n])
        assert int(target.num_clusters.max()) <= 8
        by_length[n] = (target.nbytes(), target.used_nbytes(), int(target.num_clusters.sum()))
    assert len({nbytes for nbytes, _, _ in by_length.values()}) == 1  # same allocation for 8x the tokens
    full_kv_bytes_4000 = rows * 4000 * 2 * d * 4
    assert by_length[4000][0] < full_kv_bytes_4000 / 10
    by_clusters = []
    for m in (4, 16, 64):
        # Far-apart centers: the algorithm finds exactly the m clusters.
        keys, values, _ = clusterable_stream(rows, 2000, d, m, delta, 1.0, seed=6, spread=50.0)
        target = structures(rows, d, t, s, delta)
        insert_in_pieces(target, keys, values, [2000])
        clusters = int(target.num_clusters.sum())
        assert (target.num_clusters == m).all()
        per_cluster = (t + 1) * d * 4 + 8 + 4  # representative + t samples, count, ‖x‖²
        fixed = target.used_nbytes() - clusters * per_cluster
        by_clusters.append((clusters, target.used_nbytes(), target.nbytes(), fixed))
    assert len({fixed for *_, fixed in by_clusters}) == 1  # M and the per-row scalars do not grow
    for _clusters, used, allocated, _ in by_clusters:
        assert used <= allocated <= 2 * used  # doubling capacity: at most twice what is used


def test_extra_attention_maps_query_heads_to_their_kv_head():
    # GQA: 4 query heads on 2 KV heads; compare with the estimator written out per query head.
    # budget 20: s = 5 value samples, 9 token-equivalents of clusters (4 of 3 + 1 keys), window 6.
    policy = SubGenAttention(samples_per_cluster=3, cluster_radius=0.3, relative_radius=False, cluster_fraction=0.45)
    plan = policy.plan(20)
    assert (plan.window, plan.value_samples, plan.max_clusters) == (6, 5, 4)
    generator = torch.Generator().manual_seed(7)
    b, h, n, d = 2, 2, 30, 4
    keys = torch.randn(b, h, n, d, generator=generator)
    scoring = scoring_for(keys)
    scoring.values = torch.randn(b, h, n, d, generator=generator)
    state: dict = {}
    keep = policy.select_prefill(scoring, 20, state)
    assert (keep.sum(-1) == 6).all() and keep[..., -6:].all()
    st = state[STATE_KEY]
    assert (st.tokens == n - 6).all() and (st.counts.sum(-1) == n - 6).all()
    queries = torch.randn(b, 4, 2, d, generator=generator)
    z, tau, max_logit = policy.extra_attention(state, queries, 0.7)
    for batch, query_head in itertools.product(range(b), range(4)):
        row = batch * h + query_head // 2
        q = queries[batch, query_head]
        m = int(st.num_clusters[row])
        sample_logits = (q @ st.samples[row, :m].reshape(-1, d).T) * 0.7
        weights = (st.counts[row, :m].float() / st.t).repeat_interleave(st.t)
        expected_tau = (torch.exp(sample_logits - max_logit[batch, query_head, :, None]) * weights).sum(-1)
        product_logits = (q @ st.m_keys[row].T) * 0.7
        scale = st.mu[row].float() / (st.s * st.m_sqnorm[row])
        expected_z = (torch.exp(product_logits - max_logit[batch, query_head, :, None]) * scale) @ st.m_values[row]
        assert torch.allclose(tau[batch, query_head], expected_tau, rtol=1e-5)
        assert torch.allclose(z[batch, query_head], expected_z, rtol=1e-4, atol=1e-6)
        exact_max = torch.maximum(sample_logits.amax(-1), product_logits.amax(-1))
        assert torch.allclose(max_logit[batch, query_head], exact_max)


# ==============================================================================================
# Models: full budget, decode runs, the embedded model
# ==============================================================================================


@pytest.mark.parametrize("architecture, attention", ALL_TINY)
def test_full_budget_matches_plain_transformers(architecture, attention):
    model = tiny_model(architecture, attention)
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=24, pad=5)
    expected = reference_logits(model, input_ids, attention_mask, steps=6)
    for method in ("subgen", "subgen-attention"):
        cache = (
            kvhive.make_cache(model, method, budget=64, recent=4)
            if method == "subgen"
            else kvhive.make_cache(model, method, budget=64)
        )
        logits = prefill_and_decode(model, cache, input_ids, attention_mask, steps=6)
        assert (logits - expected).abs().max() <= 1e-5, method


@pytest.mark.parametrize("architecture, attention", ALL_TINY)
def test_prefill_and_50_decode_steps_keep_exact_budgets(architecture, attention):
    model = tiny_model(architecture, attention)
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=30, pad=7)
    real_tokens = attention_mask.sum(-1)
    steps = 50
    caches = {
        "subgen": kvhive.make_cache(model, "subgen", budget=12, recent=4),
        # budget 16: 4 value samples, 4 token-equivalents of clusters (one of 4 + 1 keys), window 8.
        "subgen-attention": kvhive.make_cache(model, "subgen-attention", budget=16),
    }
    assert caches["subgen-attention"].policy.plan(16).window == 8
    for method, cache in caches.items():
        logits = prefill_and_decode(model, cache, input_ids, attention_mask, steps=steps)
        assert torch.isfinite(logits).all()
        budget = cache.layer_budgets
        assert budget and all(i in budget for i in cache.compressed_layers)
        for index in cache.compressed_layers:
            # subgen-attention: the cache's layer budget is the exact window (8 of 16).
            assert (cache.kept_tokens()[index] == budget[index]).all(), (method, index)
        if method == "subgen-attention":
            assert set(budget.values()) == {8}
    # Every real token that left the window was inserted into D and M exactly once.
    cache = caches["subgen-attention"]
    heads = cache.num_kv_heads
    for index, counts in cluster_counts(cache).items():
        st = cache.layers[index].policy_state[STATE_KEY]
        expected = (real_tokens + steps - 8).repeat_interleave(heads)
        assert torch.equal(st.tokens, expected) and torch.equal(st.counts.sum(-1), expected)
        assert (counts >= 1).all()
    # the reported bytes are every compressed layer's structures (mutation testing: "=" for "+="
    # survived while only "> 0" was checked)
    with_structures = [layer for layer in cache.layers if STATE_KEY in getattr(layer, "policy_state", {})]
    assert [cache.layers.index(layer) for layer in with_structures] == cache.compressed_layers
    assert len(with_structures) >= (1 if architecture == "gemma3" else 2)  # gemma3: sliding layers first
    assert sorted(clustering_statistics(cache)) == cache.compressed_layers
    assert structures_nbytes(cache) == sum(layer.policy_state[STATE_KEY].nbytes() for layer in with_structures)


@pytest.mark.parametrize("architecture", ["llama", "gemma3"])
def test_estimator_recovers_the_evicted_tokens_attention(architecture):
    # δ tiny (each key its own cluster, τ exact) and many ℓ2 samples: subgen-attention with a
    # window of 8 must come much closer to the full cache than the window alone (local).
    model = tiny_model(architecture, "gqa")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=40, pad=5)
    expected = reference_logits(model, input_ids, attention_mask, steps=8)
    forced = [expected[i].argmax(-1, keepdim=True) for i in range(8)]

    def error(method, **options):
        cache = kvhive.make_cache(model, method, budget=8, **options)
        logits = prefill_and_decode(model, cache, input_ids, attention_mask, steps=8, forced_tokens=forced)
        return float((logits[1:] - expected[1:]).abs().max())

    local = error("local")
    # Budget 800: 720 value samples, 72 clusters of one sample (every evicted key its own), window 8.
    options = dict(cluster_radius=1e-4, samples_per_cluster=1, value_sample_fraction=0.9, cluster_fraction=0.09)
    assert SubGenAttention(**options).plan(800).window == 8
    cache = kvhive.make_cache(model, "subgen-attention", budget=800, **options)
    logits = prefill_and_decode(model, cache, input_ids, attention_mask, steps=8, forced_tokens=forced)
    estimated = float((logits[1:] - expected[1:]).abs().max())
    assert estimated < local / 5, (estimated, local)


@pytest.fixture(scope="module")
def embedded():
    return kvhive.load_model()


@pytest.mark.parametrize(
    "method, options", [("subgen", dict(budget=48, recent=16)), ("subgen-attention", dict(budget=64))]
)
def test_embedded_model_prefill_and_50_decode_steps(embedded, method, options):
    model, tokenizer = embedded
    text = open("/work/shared/data/wikitext2/wiki.test.raw", encoding="utf-8").read()[:1200]
    encoded = tokenizer(text, return_tensors="pt")
    cache = kvhive.make_cache(model, method, **options)
    logits = prefill_and_decode(model, cache, encoded["input_ids"], encoded["attention_mask"], steps=50)
    assert torch.isfinite(logits).all()
    prompt = encoded["input_ids"].shape[1]
    assert prompt > options["budget"] + 50
    kept = options["budget"] if method == "subgen" else cache.policy.plan(options["budget"]).window
    for index in cache.compressed_layers:
        assert (cache.kept_tokens()[index] == kept).all()
    if method == "subgen-attention":
        counts = cluster_counts(cache)
        assert sorted(counts) == cache.compressed_layers
        for index in counts:
            assert (cache.layers[index].policy_state[STATE_KEY].tokens == prompt + 50 - kept).all()
        # The method's whole memory stays within the budget (token-equivalents per layer and head).
        for stats in clustering_statistics(cache).values():
            assert stats["token_equivalents"] <= stats["budget_token_equivalents"] <= options["budget"]


# ==============================================================================================
# Parameters
# ==============================================================================================


@pytest.mark.parametrize(
    "parameter, value",
    [
        ("cluster_radius", 0),
        ("cluster_radius", -1.0),
        ("cluster_radius", float("nan")),
        ("cluster_radius", float("inf")),
        ("cluster_radius", "1"),
        ("samples_per_cluster", 0),
        ("samples_per_cluster", 1.5),
        ("samples_per_cluster", True),
        ("value_sample_fraction", 0),
        ("value_sample_fraction", 1.0),
        ("cluster_fraction", -0.1),
        ("cluster_fraction", 0.8),
        ("seed", -1),
        ("relative_radius", 1),
        ("delta", 0.5),
        ("t", 4),
        ("s", 16),
    ],
)
def test_invalid_subgen_attention_parameters(parameter, value):
    with pytest.raises(ValueError, match=parameter):
        make_policy("subgen-attention", **{parameter: value})


@pytest.mark.parametrize("value", [-1, 2.5, None, True])
def test_invalid_subgen_recent(value):
    with pytest.raises(ValueError, match="recent"):
        make_policy("subgen", recent=value)


def test_subgen_budget_must_exceed_recent():
    model = tiny_model("llama", "gqa")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=24, pad=0)
    for budget in (4, 3):
        with pytest.raises(ValueError, match="budget"):
            cache = kvhive.make_cache(model, "subgen", budget=budget, recent=4)
            prefill_and_decode(model, cache, input_ids, attention_mask, steps=0)
    cache = kvhive.make_cache(model, "subgen", budget=5, recent=4)  # k = 1 works
    prefill_and_decode(model, cache, input_ids, attention_mask, steps=3)
    assert (cache.kept_tokens()[0] == 5).all()
    with pytest.raises(ValueError, match="unknown parameter"):
        make_policy("subgen", window=4)


# ==============================================================================================
# Budget = the whole memory; clusterable or not; batch rows (issue 10 item 7, issue 9 items 5, 7)
# ==============================================================================================


def test_budget_bounds_window_clusters_and_samples_and_state_does_not_grow():
    """A budget of 32 token-equivalents: the state is allocated once (bytes constant in n) and the
    window + samples + clusters never exceed the budget, however long the stream."""
    model = tiny_model("llama", "gqa")
    budget = 32
    sizes, held = [], []
    for length in (40, 120):
        input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=length, pad=0)
        cache = kvhive.make_cache(model, "subgen-attention", budget=budget)
        prefill_and_decode(model, cache, input_ids, attention_mask, steps=20)
        held.append(cache.statistics()["policy_state_bytes"])
        for stats in clustering_statistics(cache).values():
            assert stats["token_equivalents"] <= stats["budget_token_equivalents"] <= budget
            sizes.append(stats["clusters"])
            assert stats["clusters"] <= stats["max_clusters"]
    assert held[0] == held[1] > 0
    # Bytes: the window's tokens plus the structures, per (batch, KV head) row and layer, at most
    # the budget's tokens plus small per-row/per-cluster counters.
    plan = cache.policy.plan(budget)
    rows = 2 * model.config.num_key_value_heads
    per_token = cache.layers[cache.compressed_layers[0]].bytes_per_token()
    counters = rows * (8 * 8 + plan.max_clusters * 12 + plan.value_samples * 4)
    assert held[1] <= len(cache.compressed_layers) * (
        (budget - plan.window) * per_token * rows // rows + counters
    ) + len(cache.compressed_layers) * (budget - plan.window) * per_token * (rows - 1)


def test_clusterable_streams_grow_sublinearly_and_others_are_reported():
    """Clusterable keys (m well-separated groups): m clusters whatever n, no key beyond the
    radius. Random keys at a small radius: the clusters stop at max_clusters and every key that
    could not found one is counted (the statistics say the stream is not clusterable)."""
    rows, d, t, s, delta = 2, 8, 4, 8, 0.5
    for n in (400, 1600):
        keys, values, _ = clusterable_stream(rows, n, d, 6, delta, 1.0, seed=5)
        target = structures(rows, d, t, s, delta, max_clusters=12)
        target.insert(keys, values, torch.ones(rows, n, dtype=torch.bool))
        assert (target.num_clusters <= 6).all() and int(target.beyond_radius.sum()) == 0
        assert (
            target.nbytes()
            == StreamingStructures(
                rows,
                d,
                t,
                s,
                dtype=torch.float32,
                device=torch.device("cpu"),
                seed=0,
                delta=delta,
                relative_delta=False,
                max_clusters=12,
            ).nbytes()
        )
    noise = torch.randn(rows, 500, d, generator=torch.Generator().manual_seed(1)) * 10
    target = structures(rows, d, t, s, 0.1, max_clusters=12)
    target.insert(noise, noise, torch.ones(rows, 500, dtype=torch.bool))
    assert (target.num_clusters == 12).all()
    assert (target.beyond_radius == 500 - 12).all()
    assert (target.counts.sum(-1) == 500).all()  # every key still counted in a cluster

    model = tiny_model("llama", "gqa")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=80, pad=0)
    cache = kvhive.make_cache(model, "subgen-attention", budget=16, cluster_radius=1e-3)
    prefill_and_decode(model, cache, input_ids, attention_mask, steps=5)
    stats = clustering_statistics(cache)
    assert stats and all(not layer["clusterable"] and layer["beyond_radius"] > 0 for layer in stats.values())


def test_a_left_padded_row_gets_what_it_gets_alone():
    """Issue 9 item 5: the reservoir and ℓ2 draws are hashes of (seed, layer, head, the row's own
    token count), and the ‖v‖² draw skips padding, so a padded row matches its solo run."""
    model = tiny_model("llama", "gqa")
    pad = 7
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=40, pad=pad)
    budget, steps = 16, 10
    cache = kvhive.make_cache(model, "subgen-attention", budget=budget)
    batch = prefill_and_decode(model, cache, input_ids, attention_mask, steps)
    heads = model.config.num_key_value_heads

    def new_cache():
        return kvhive.make_cache(model, "subgen-attention", budget=budget)

    for row, _offset, alone in solo_runs(model, new_cache, input_ids, attention_mask, (0, pad), steps, batch):
        for layer in cache.compressed_layers:
            mine = cache.layers[layer].policy_state[STATE_KEY]
            theirs = alone.layers[layer].policy_state[STATE_KEY]
            rows = slice(row * heads, (row + 1) * heads)
            # Values are not rotated: the same l2 samples (up to the batched matmuls' rounding; keys
            # carry their RoPE position, which left padding shifts; the logits above cover them).
            torch.testing.assert_close(mine.m_values[rows], theirs.m_values, atol=1e-5, rtol=1e-4)
            assert torch.equal(mine.counts[rows], theirs.counts)
            assert torch.equal(mine.beyond_radius[rows], theirs.beyond_radius)


_ALLOWED: dict[int, torch.Tensor] = {}


def _kept_only_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention over a DynamicCache; a decode query attends only ``_ALLOWED[layer]``."""
    batch, kv_heads, length, _ = key.shape
    group = query.shape[1] // kv_heads
    allowed = attention_mask[:, :, :, :length].expand(batch, kv_heads, query.shape[2], length)
    kept = _ALLOWED.get(module.layer_idx)
    if kept is not None and query.shape[2] == 1:
        allowed = allowed & kept[:, :, None, :]
    allowed = allowed.repeat_interleave(group, dim=1)
    logits = torch.matmul(query, key.repeat_interleave(group, dim=1).transpose(-1, -2)) * scaling
    weights = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.matmul(weights, value.repeat_interleave(group, dim=1)).transpose(1, 2).contiguous(), None


def test_evicting_subgen_run_equals_attention_over_exactly_the_kept_tokens():
    """The prompt is cut (k-center + recent) and every decode step evicts: each step's logits equal
    plain attention restricted to the tokens the cache held for it."""
    from transformers import AttentionInterface, AttentionMaskInterface, DynamicCache

    from helpers import materialised_mask

    AttentionInterface.register("subgen-kept-only", _kept_only_attention)
    AttentionMaskInterface.register("subgen-kept-only", materialised_mask)
    model = tiny_model("llama", "gqa")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=30, pad=0)
    budget, steps = 12, 12
    cache = kvhive.make_cache(model, "subgen", budget=budget, recent=4)
    reference_cache = DynamicCache(config=model.config)
    batch = input_ids.shape[0]
    try:
        with torch.no_grad():
            output = model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
            model.set_attn_implementation("subgen-kept-only")
            _ALLOWED.clear()
            model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=reference_cache, use_cache=True)
            mask = attention_mask
            for step in range(steps):
                token = output.logits[:, -1].argmax(-1, keepdim=True)
                mask = torch.cat([mask, torch.ones_like(token)], dim=1)
                _ALLOWED.clear()
                for layer in cache.compressed_layers:
                    positions = cache.layers[layer].dense()[2].long()
                    assert positions.shape[-1] == budget
                    allowed = torch.zeros(batch, positions.shape[1], mask.shape[1], dtype=torch.bool)
                    allowed.scatter_(2, positions, True)
                    allowed[..., -1] = True
                    _ALLOWED[layer] = allowed
                expected = model(input_ids=token, attention_mask=mask, past_key_values=reference_cache, use_cache=True)
                model.set_attn_implementation("kvhive")
                output = model(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True)
                model.set_attn_implementation("subgen-kept-only")
                assert (output.logits[:, -1] - expected.logits[:, -1]).abs().max().item() <= 1e-4, step
    finally:
        model.set_attn_implementation("sdpa")
        _ALLOWED.clear()


def test_token_equivalents_count_the_vectors_each_row_holds():
    """The memory subgen-attention reports (clustering_statistics' token_equivalents) in the unit
    of every other method, a cached token = a key and a value: per row, the s sampled (key, value)
    pairs of M plus, per cluster in use, its representative key and its t sampled keys. Counted
    here from the tensors' shapes (mutation testing: the formula was only bounded, not pinned)."""
    rows, dim, t, s = 3, 4, 3, 5
    target = structures(rows, dim, t, s, delta=0.8, seed=1)
    generator = torch.Generator().manual_seed(2)
    keys = torch.randn(rows, 40, dim, generator=generator) * torch.tensor([0.1, 1.0, 3.0])[:, None, None]
    insert_in_pieces(target, keys, torch.randn(rows, 40, dim, generator=generator), [7, 1, 32])
    clusters = target.num_clusters
    assert len(set(clusters.tolist())) > 1  # rows of different sizes
    m_vectors = target.m_keys.shape[1] + target.m_values.shape[1]
    per_cluster = 1 + target.samples.shape[2]  # the representative and its t samples
    expected = (m_vectors + clusters.double() * per_cluster) / 2
    torch.testing.assert_close(target.token_equivalents().double(), expected)


def test_memory_plan_token_equivalents_are_the_budget_split():
    for budget in (64, 100, 257):
        plan = SubGenAttention().plan(budget)
        clusters = plan.max_clusters * (plan.samples_per_cluster + 1) / 2
        assert plan.token_equivalents == plan.window + plan.value_samples + clusters
        assert plan.token_equivalents <= budget


def test_padded_indices_lists_each_rows_true_columns_in_order():
    mask = torch.tensor([[False, True, True, False, True], [False] * 5, [True, False, False, False, False]])
    index, present = padded_indices(mask, 3)
    assert index.shape == present.shape == (3, 3)
    assert present.tolist() == [[True] * 3, [False] * 3, [True, False, False]]
    assert index[0].tolist() == [1, 2, 4] and index[2, 0].item() == 0
    long = torch.rand(4, 3000, generator=torch.Generator().manual_seed(0)) < 0.3
    index, present = padded_indices(long, 3000)
    for row in range(4):
        assert index[row][present[row]].tolist() == long[row].nonzero().flatten().tolist()
    # by position (tokens stored out of their order): the oldest True columns, oldest first
    positions = torch.tensor([[9, 4, 7, 0, 2], [0, 1, 2, 3, 4], [5, 3, 1, 4, 2]]).float()
    index, present = padded_indices(mask, 3, positions)
    assert present.tolist() == [[True] * 3, [False] * 3, [True, False, False]]
    assert index[0].tolist() == [4, 1, 2] and index[2, 0].item() == 0
    # no rows: an empty listing, not an error
    index, present = padded_indices(torch.zeros(0, 7, dtype=torch.bool), 0)
    assert index.shape == present.shape == (0, 0)


def test_farthest_point_order_edges_scale_exhausted_rows_one_center_no_rows():
    # Mutation testing: clamping the running distances at 1, the -1 fill of a row whose candidates
    # run out, a single center and an empty batch were not reached by the batched-vs-plain test.
    generator = torch.Generator().manual_seed(4)
    keys = torch.randn(2, 60, 8, generator=generator, dtype=torch.float64)
    candidates = torch.ones(2, 60, dtype=torch.bool)
    candidates[1, 5:] = False  # row 1 has 5 candidates for 12 centers
    expected = _naive_farthest_point(keys, candidates, 12)
    assert (expected[1, 5:] == -1).all() and (expected[1, :5] >= 0).all()
    assert torch.equal(farthest_point_order(keys, candidates, 12), expected)
    # k-center compares distances only: at 1/100 of the scale (every distance below 1) the same
    assert torch.equal(farthest_point_order(keys * 1e-2, candidates, 12), expected)
    assert torch.equal(farthest_point_order(keys, candidates, 1), expected[:, :1])
    assert farthest_point_order(keys[:0], candidates[:0], 3).shape == (0, 3)


@pytest.mark.parametrize(("heads", "joining", "dim", "seed"), [(3, 1, 2, 0), (3, 3, 2, 1), (2, 3, 6, 2), (2, 2, 4, 3)])
def test_decode_bookkeeping_matches_the_reference_per_head_with_several_joining(heads, joining, dim, seed):
    # As above, with several heads (each its own stream and kept set) and several tokens joining
    # the candidates per decision (decode_every > 1): the incremental nearest-neighbour bookkeeping
    # must give the brute-force rule's survivors at every step (mutation testing: its partial
    # updates survived the one-head, one-token stream).
    generator = torch.Generator().manual_seed(seed)
    recent, budget = 2, 8
    policy = SubGen(recent=recent)
    stream = torch.randn(heads, 70, dim, generator=generator)
    keys = stream[:, :12][None]
    positions = torch.arange(12, dtype=torch.int32).expand(1, heads, 12)
    keep = policy.select_prefill(scoring_for(keys, positions=positions), budget, {})
    keys, positions = keys[keep].reshape(1, heads, -1, dim), positions[keep].reshape(1, heads, -1)
    scores: dict = {}
    for step in range(12, 70 - joining + 1, joining):
        new = torch.arange(step, step + joining, dtype=torch.int32)
        keys = torch.cat([keys, stream[:, step : step + joining][None]], dim=2)
        positions = torch.cat([positions, new.expand(1, heads, joining)], dim=2)
        scores = {name: torch.cat([v, v.new_zeros(1, heads, joining)], dim=2) for name, v in scores.items()}
        scoring = scoring_for(keys, phase=DECODE, positions=positions, token_scores=scores)
        keep = policy.select_decode(scoring, budget, {})
        for head in range(heads):
            candidates = positions[0, head, :-recent].tolist()
            expected = _brute_force_decode([stream[head, p] for p in candidates], candidates, budget - recent)
            kept = set(positions[0, head][keep[0, head]].tolist())
            assert kept == expected | set(positions[0, head, -recent:].tolist()), (step, head)
        keys, positions = keys[keep].reshape(1, heads, -1, dim), positions[keep].reshape(1, heads, -1)
        scores = {name: value[keep].reshape(1, heads, -1) for name, value in scoring.token_scores.items()}


def test_estimate_is_algorithm_1s_z_over_tau_and_approaches_exact_attention():
    # SubGenAttention.estimate, Algorithm 1's output over the inserted tokens alone: with every key
    # its own cluster (tau exact) and many l2 samples of the values it approaches exact softmax
    # attention over those tokens; nothing inserted, no estimate.
    generator = torch.Generator().manual_seed(6)
    rows, n, dim = 2, 30, 4
    keys = torch.randn(rows, n, dim, generator=generator)
    values = torch.randn(rows, n, dim, generator=generator)
    target = structures(rows, dim, t=1, s=4000, delta=1e-4, seed=7)
    insert_in_pieces(target, keys, values, [n])
    policy = SubGenAttention()
    queries = torch.randn(1, 2 * rows, 1, dim, generator=generator)  # 2 query heads per stored row
    assert policy.estimate({}, queries, 0.5) is None
    estimate = policy.estimate({STATE_KEY: target}, queries, 0.5)
    grouped = queries.reshape(rows, 2, dim)
    exact = torch.softmax(grouped @ keys.transpose(1, 2) * 0.5, dim=-1) @ values
    assert estimate.shape == (1, 2 * rows, 1, dim)
    torch.testing.assert_close(estimate.reshape(rows, 2, dim), exact, atol=0.1, rtol=0)


def test_structures_store_vectors_in_the_model_dtype_and_start_empty():
    # The bytes subgen-attention reports follow the tensors' dtypes: keys and values in the model's
    # dtype (bf16 here), norms in float32, counters as integers; no cluster is allocated before the
    # first insertion (mutation testing: every dtype and the initial capacity survived in fp32 tests).
    target = structures(2, 4, 3, 5, 0.5, dtype=torch.bfloat16)
    expected = {
        "representatives": torch.bfloat16,
        "representative_sq": torch.float32,
        "counts": torch.long,
        "samples": torch.bfloat16,
        "num_clusters": torch.long,
        "radius": torch.float32,
        "m_keys": torch.bfloat16,
        "m_values": torch.bfloat16,
        "m_sqnorm": torch.float32,
        "mu": torch.float64,
        "tokens": torch.long,
        "beyond_radius": torch.long,
    }
    assert {name: x.dtype for name, x in target.tensors().items()} == expected
    assert target.capacity == 0 and target.representatives.shape == (2, 0, 4)
    assert target.representative_sq.shape == (2, 0) and target.samples.shape == (2, 0, 3, 4)
    assert target.radius.isnan().all()
    keys = torch.randn(2, 9, 4, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    insert_in_pieces(target, keys, keys.clone(), [9])
    assert {name: x.dtype for name, x in target.tensors().items()} == expected


# ==============================================================================================
# Mutation testing (issue 10): the memory plan's bounds, the radius, the coins, the reports
# ==============================================================================================


def test_memory_plan_needs_one_of_each_part_and_the_smallest_budget_is_found():
    """The budget split (module docstring of subgen_attention): at least one ℓ2 sample, one
    cluster and one window token; exactly one of each is enough, and a budget missing any part is
    refused with an error naming ``budget`` (issue 10: each bound of memory_plan survived)."""
    config = SubGenAttentionConfig
    # defaults (s = C/4, a quarter of C for clusters of 4 + 1 keys): budget 12 is the first fit
    assert memory_plan(12, config()) == MemoryPlan(6, 3, 1, 4)
    assert memory_plan(11, config()) is None
    assert memory_plan(10, config()) is None  # 2 samples, a window of 6, but 2 tokens < one cluster
    assert SubGenAttention().minimum_budget() == 12
    with pytest.raises(ValueError, match="budget"):
        SubGenAttention().plan(11)
    # one value sample is enough (10 * 0.1 = 1)
    assert memory_plan(10, config(value_sample_fraction=0.1, cluster_fraction=0.5, samples_per_cluster=1)) == (
        MemoryPlan(4, 1, 5, 1)
    )
    # no value sample (10 * 0.05 < 1) with clusters and a window: refused
    assert memory_plan(10, config(value_sample_fraction=0.05, samples_per_cluster=1)) is None
    # a window of one token is enough (20 - 9 - 10 = 1)
    assert memory_plan(20, config(value_sample_fraction=0.45, cluster_fraction=0.5, samples_per_cluster=1)) == (
        MemoryPlan(1, 9, 10, 1)
    )


def test_relative_radius_is_delta_times_the_mean_real_key_norm_at_first_insertion():
    """Radius choice (module docstring): ``cluster_radius`` times the mean L2 norm of a row's real
    keys at its first insertion; a row of all-zero keys gets ``cluster_radius`` itself, a row with
    no real key yet stays unset, and later insertions do not move it (issue 10)."""
    target = structures(4, 2, 1, 1, 0.5, relative_delta=True)
    keys = torch.full((4, 3, 2), 100.0)  # masked-out keys: far larger, must not count
    mask = torch.zeros(4, 3, dtype=torch.bool)
    keys[0, 0], keys[0, 1], mask[0, :2] = torch.tensor([0.2, 0.0]), torch.tensor([0.0, 0.6]), True  # mean 0.4
    keys[1, 2], mask[1, 2] = torch.tensor([3.0, 0.0]), True  # a single key of norm 3
    keys[2], mask[2] = 0.0, True  # all-zero keys
    target.insert(keys, keys.clone(), mask)
    expected = torch.tensor([0.5 * 0.4, 0.5 * 3.0, 0.5, float("nan")])
    torch.testing.assert_close(target.radius, expected, equal_nan=True)
    later = torch.zeros(4, 2, 2)
    later[..., 0] = torch.tensor([5.0, 7.0])  # row 3's first real keys: mean norm 6
    target.insert(later, later.clone(), torch.ones(4, 2, dtype=torch.bool))
    expected[3] = 0.5 * 6.0
    torch.testing.assert_close(target.radius, expected)


def _identical_streams(dtype=torch.float32) -> torch.Tensor:
    """Keys ``[2, 2, 60, 4]``: the same stream in every (batch row, KV head)."""
    stream = torch.randn(60, 4, generator=torch.Generator().manual_seed(8)) * 2
    return stream.expand(2, 2, 60, 4).to(dtype).contiguous()


def test_policy_structures_take_the_layer_dtype_relative_radius_and_per_head_layer_seed_draws():
    """SubGenAttention builds one row of structures per (batch row, KV head): vectors in the
    model's dtype, the relative radius of its config, and draws indexed by the config's seed,
    the layer and the head only (issue 9 item 5: a batch row draws what it draws
    alone). With the same stream in every row, the ℓ2 samples of M therefore agree across batch
    rows of a head and differ between heads, layers and seeds (issue 10: each seed argument)."""
    policy_options = dict(samples_per_cluster=2, value_sample_fraction=0.25, cluster_fraction=0.25)
    budget = 40  # 10 value samples, 6 clusters of 2 + 1 keys, a window of 20: 40 tokens leave

    def draws(seed=0, layer=0, dtype=torch.float32):
        scoring = scoring_for(_identical_streams(dtype))
        scoring.layer_index = layer
        state: dict = {}
        SubGenAttention(seed=seed, **policy_options).select_prefill(scoring, budget, state)
        return state[STATE_KEY]

    st = draws()
    assert torch.equal(st.m_keys[0], st.m_keys[2]) and torch.equal(st.m_keys[1], st.m_keys[3])  # head 0, head 1
    assert not torch.equal(st.m_keys[0], st.m_keys[1])
    assert not torch.equal(draws(layer=1).m_keys[0], st.m_keys[0])
    assert not torch.equal(draws(seed=1).m_keys[0], st.m_keys[0])
    # relative_radius (default): 0.5 x the mean norm of the 40 keys that left the window
    mean_norm = _identical_streams()[0, 0, :40].norm(dim=-1).mean()
    torch.testing.assert_close(st.radius, torch.full((4,), 0.5 * float(mean_norm)))
    assert {x.dtype for x in (st.m_keys, st.m_values, st.representatives, st.samples)} == {torch.float32}
    low = draws(dtype=torch.bfloat16)
    assert {x.dtype for x in (low.m_keys, low.m_values, low.representatives, low.samples)} == {torch.bfloat16}


def test_a_given_config_is_used_and_extra_attention_answers_in_the_query_dtype():
    """A config object passed to SubGenAttention is the policy's config, and extra_attention's
    ``(z, τ, max)`` come back in the queries' dtype, the attention integration's (issue 10)."""
    config = SubGenAttentionConfig(samples_per_cluster=3, cluster_radius=0.25, seed=5)
    policy = SubGenAttention(config)
    assert policy.config == config
    state: dict = {}
    policy.select_prefill(scoring_for(_identical_streams()), 40, state)
    assert state[STATE_KEY].t == 3
    queries = torch.randn(2, 4, 1, 4, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    assert [x.dtype for x in policy.extra_attention(state, queries, 0.5)] == [torch.bfloat16] * 3


def test_clustering_statistics_and_cluster_counts_report_the_layers_with_structures():
    """The reports of docs/METHODS.md, exact: per layer that inserted tokens, the plan's window and
    samples, the clusters used, the keys inserted, the keys beyond the radius and whether the
    stream was clusterable, and the token-equivalents held (window + samples + (t+1)/2 per
    cluster); cluster_counts the clusters per row (issue 10: keys and values survived)."""
    from types import SimpleNamespace

    policy = SubGenAttention(cluster_radius=4.0, relative_radius=False)  # one cluster per row
    plan = policy.plan(40)  # window 20, 10 samples, at most 4 clusters of 4 + 1 keys
    state: dict = {}
    policy.select_prefill(scoring_for(_identical_streams() * 0.1), 40, state)
    cache = SimpleNamespace(layers=[SimpleNamespace(policy_state={}), SimpleNamespace(policy_state=state)])
    st = state[STATE_KEY]
    assert (st.num_clusters == 1).all() and int(st.beyond_radius.sum()) == 0
    assert clustering_statistics(cache) == {
        1: {
            "window": 20,
            "value_samples": 10,
            "max_clusters": plan.max_clusters,
            "clusters": 1,
            "inserted": 4 * 40,
            "beyond_radius": 0,
            "clusterable": True,
            "token_equivalents": 20 + 10 + 1 * (4 + 1) / 2,
            "budget_token_equivalents": plan.token_equivalents,
        }
    }
    counts = cluster_counts(cache)
    assert list(counts) == [1] and torch.equal(counts[1], st.num_clusters)


def test_insert_marks_tokens_not_inserted_with_minus_one_and_a_lone_token_founds_a_full_cluster():
    """insert's contract: the cluster of each token, -1 where the mask is False; a key that founds
    a cluster is its representative, its t samples and count 1 (Lemma 2's Case 2), also when it is
    the only token of the insertion (issue 10)."""
    target = structures(1, 2, t=3, s=2, delta=0.5)
    first = torch.tensor([[[1.0, 2.0]]])
    assert target.insert(first, first, torch.ones(1, 1, dtype=torch.bool)).tolist() == [[0]]
    assert target.counts[0, :1].tolist() == [1]
    assert torch.equal(target.samples[0, 0], first[0].expand(3, 2))
    second = torch.tensor([[[9.0, 9.0], [1.25, 2.0]]])
    assignment = target.insert(second, second, torch.tensor([[False, True]]))
    assert assignment.tolist() == [[-1, 0]] and target.counts[0, :1].tolist() == [2]
    assert int(target.tokens[0]) == 2


@pytest.mark.parametrize("relative_delta", [True, False])
def test_one_token_insertion_is_the_batch_path_bit_for_bit(relative_delta):
    """A decode step inserts one token per row into bounded structures through a path of its own
    (only the joined cluster's coins hashed, M blended on its bits, one founding round); it must
    leave exactly the state the general batch path leaves for that one token: the same draws,
    clusters, samples, counts, M and radius, whether the row's radius is set yet or not."""
    generator = torch.Generator().manual_seed(11)
    rows, dim, t, s, capacity = 6, 16, 3, 7, 5

    def make():
        return structures(rows, dim, t, s, 0.9, seed=3, relative_delta=relative_delta, max_clusters=capacity)

    fast, general = make(), make()

    for step in range(200):
        keys = torch.randn(rows, 1, dim, generator=generator) * 1.5
        values = torch.randn(rows, 1, dim, generator=generator) * torch.rand(rows, 1, 1, generator=generator)
        mask = torch.rand(rows, 1, generator=generator) > (0.6 if step < 10 else 0.15)
        assert torch.equal(fast.insert(keys, values, mask), general._insert_batch(keys, values, mask)), step
        for name, value in fast.tensors().items():
            expected = general.tensors()[name]
            assert torch.equal(value.nan_to_num(7.0), expected.nan_to_num(7.0)), (step, name)
    assert int(fast.num_clusters.min()) == capacity and int(fast.beyond_radius.sum()) > 0  # both cases ran


def test_a_key_at_exactly_delta_joins_and_ties_go_to_the_older_cluster():
    """Algorithm 1, lines 12-13: i* = argmin_i ‖x_i − k‖ and the key joins when ‖k − x_i*‖ ≤ δ
    (inclusive), both when the representative was founded in an earlier insertion and in the same
    batch; only a key strictly beyond δ counts as beyond the radius. Ties in the argmin go to the
    first (older) representative, as the one-key-at-a-time algorithm does: batch insertion is
    exactly the sequential algorithm (module docstring). Distances here are exact in float32."""

    def line(*xs):
        return torch.tensor([[[x, 0.0] for x in xs]])

    def ones(n):
        return torch.ones(1, n, dtype=torch.bool)

    for pieces in ([1, 1], [2]):
        target = structures(1, 2, t=1, s=1, delta=0.5)
        assert insert_in_pieces(target, line(0.0, 0.5), line(0.0, 0.5), pieces).tolist() == [[0, 0]]
        assert int(target.num_clusters[0]) == 1
    bounded = structures(1, 2, 1, 1, 0.5, max_clusters=1)
    bounded.insert(line(0.0), line(0.0), ones(1))
    bounded.insert(line(0.5, 2.0), line(0.5, 2.0), ones(2))
    assert bounded.beyond_radius.tolist() == [1] and bounded.counts[0].tolist() == [3]
    # 0.75 is 0.75 from both representatives (0 and 1.5, founded before it): the older one wins
    keys = line(0.0, 1.5, 0.75)
    _, counts, expected = _sequential_clusters(keys[0], 1.0)
    assert expected == [0, 1, 0] and counts == [2, 1]
    for pieces in ([3], [1, 1, 1], [2, 1]):
        target = structures(1, 2, t=1, s=1, delta=1.0)
        assert insert_in_pieces(target, keys, keys, pieces).tolist() == [expected], pieces


def _with_uniforms(target: StreamingStructures, value: float) -> StreamingStructures:
    """Every uniform the structures draw is ``value`` (a point of their grid k·2^-24)."""

    def constant(purpose, index):
        shape = (target.rows, *index.shape[1:])
        return torch.full(shape, value, dtype=torch.float64), torch.full(shape, value, dtype=torch.float64)

    target._draws = constant
    return target


def test_reservoir_and_l2_coins_are_exact_at_their_boundaries():
    """Lemma 1 / Lemma 2 need each slot replaced with probability exactly p = added/(old+added)
    (‖v‖²/(μ+‖v‖²) for M, 1/count for a cluster). torch.rand draws u on the grid k·2^-24 of
    [0, 1), so ``u < p`` holds for exactly p·2^24 grid points (``u ≤ p`` would be one more): at
    u = p = 1/2 nothing is replaced, one grid point below everything is. The ‖v‖² draw inverts the
    CDF on [0, 1) (token i on [c_{i-1}, c_i)), so even u = 0 never draws a zero-weight (padding)
    token; small values (‖v‖² < 1) are sampled like any others (issue 10)."""
    keys = torch.tensor([[[9.0, 9.0], [1.0, 0.0]]])  # token 0: padding, far away
    values = torch.tensor([[[3.0, 3.0], [0.0, 0.5]]])  # ‖v‖² = 0.25 for the real token
    later_key, later_value = torch.tensor([[[1.25, 0.0]]]), torch.tensor([[[0.0, 0.5]]])  # p = 1/2 in both
    for u, replaced in [(0.5, False), (0.5 - 2**-24, True)]:
        target = _with_uniforms(structures(1, 2, t=2, s=3, delta=10.0), 0.0)
        target.insert(keys, values, torch.tensor([[False, True]]))
        assert torch.equal(target.m_keys[0], keys[0, 1].expand(3, 2))  # the real token, in every slot
        assert torch.equal(target.samples[0, 0], keys[0, 1].expand(2, 2))
        _with_uniforms(target, u).insert(later_key, later_value, torch.ones(1, 1, dtype=torch.bool))
        expected = later_key[0, 0] if replaced else keys[0, 1]
        assert torch.equal(target.m_keys[0], expected.expand(3, 2)), u
        assert torch.equal(target.samples[0, 0], expected.expand(2, 2)), u
        assert target.counts[0, :1].tolist() == [2] and float(target.mu[0]) == 0.5


def test_query_max_is_over_held_entries_and_z_scales_with_the_values():
    """QUERYSTREAMATTN relative to a max logit: the max is over the entries the structures hold
    (cluster samples, filled M slots); an empty M slot (all values zero so far: ‖v‖² = 0 is never
    drawn) is not an entry, and a row with nothing inserted has no entry (max = the dtype's
    minimum, τ = 0, z = 0). z = Σ_M μ/(s‖v‖²) e^l v is linear in the values' scale, whatever
    their norms (the same draws: the ‖v‖² law is scale-free) (issue 10)."""
    generator = torch.Generator().manual_seed(11)
    rows, n, dim = 3, 12, 4
    keys = torch.randn(rows, n, dim, generator=generator)
    values = torch.randn(rows, n, dim, generator=generator)
    keys[1] = keys[1].abs() + 0.1
    values[1] = 0.0
    mask = torch.ones(rows, n, dtype=torch.bool)
    mask[2] = False
    query = -torch.ones(rows, 1, dim)  # every logit of row 1 is negative
    outputs = []
    for scale in (1.0, 0.25):
        target = structures(rows, dim, t=2, s=6, delta=0.8, seed=3)
        target.insert(keys, values * scale, mask)
        outputs.append(target.query(query, 1.0))
    (z, tau, max_logit), (z_small, tau_small, max_small) = outputs
    assert (target.m_sqnorm[1] == 0).all() and float(target.mu[1]) == 0.0
    used = int(target.num_clusters[1])
    sample_logits = query[1] @ target.samples[1, :used].reshape(-1, dim).T
    assert float(sample_logits.max()) < 0
    torch.testing.assert_close(max_logit[1], sample_logits.amax(-1))
    assert float(max_logit[2]) == torch.finfo(torch.float32).min
    assert float(tau[2]) == 0.0 and (z[2] == 0).all() and (z[1] == 0).all() and float(tau[1]) > 0
    torch.testing.assert_close(z_small, 0.25 * z)
    torch.testing.assert_close(tau_small, tau)
    torch.testing.assert_close(max_small, max_logit)


def test_padding_never_displaces_a_real_token_wherever_it_lies():
    """DESIGN.md §2: every method ranks padding below every real token, so a row keeps padding
    only when it has fewer real tokens than its budget. Checked with the padding in the last
    columns (a right-padded prompt), where it would otherwise win the recency and tie orders:
    subgen's k-center prefill and closest-pair decode, and subgen-attention's window, which must
    hold the last ``window`` real tokens and insert only the real tokens that leave (issue 10)."""
    keys = torch.randn(1, 1, 20, 4, generator=torch.Generator().manual_seed(12))
    valid = torch.ones(1, 1, 20, dtype=torch.bool)
    valid[..., -3:] = False
    for phase in (PREFILL, DECODE):
        select = SubGen.select_prefill if phase == PREFILL else SubGen.select_decode
        keep = select(SubGen(recent=4), scoring_for(keys, valid, phase=phase), 8, {})
        assert keep.dtype == torch.bool and int(keep.sum()) == 8 and not keep[..., -3:].any(), phase
        assert keep[..., 15:17].all()  # the real tokens among the last 4 columns (recent)
    policy = SubGenAttention()
    window = policy.plan(24).window  # 12
    state: dict = {}
    keep = policy.select_prefill(scoring_for(keys, valid), 24, state)
    assert keep[0, 0].tolist() == [False] * 5 + [True] * window + [False] * 3
    assert state[STATE_KEY].tokens.tolist() == [5]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_follows_the_reference_rule_among_exactly_tied_distances(seed):
    """Keys on a small integer grid (squared distances exact in float32, many equal): the decode
    rule still evicts, at every step, what the from-scratch reference evicts — the newer member
    of the first closest pair in age order (the oldest candidate of a closest pair with its
    oldest nearest neighbour) — so a candidate's recorded nearest neighbour only moves to a
    newcomer strictly closer than it (issue 10: the tie of that update survived random keys)."""
    stream = torch.randint(-3, 4, (60, 2), generator=torch.Generator().manual_seed(20 + seed)).float()
    _decode_stream_against_reference(stream, recent=2, budget=7)


def test_query_in_bfloat16_reports_the_max_logit_it_scaled_by_in_the_query_dtype():
    """z and τ are relative to the max logit QUERYSTREAMATTN returns, and the attention layer reads that
    max back in the queries' dtype to combine the estimate with the exact window: so the max the
    structures scale by must be exactly representable in that dtype, or the estimate is off by
    e^(rounding) (up to a few % in bfloat16) against the window's part (issue 10)."""
    generator = torch.Generator().manual_seed(4)
    rows, n, dim = 2, 16, 4
    keys = (torch.randn(rows, n, dim, generator=generator) * 3).bfloat16()
    values = torch.randn(rows, n, dim, generator=generator).bfloat16()
    target = structures(rows, dim, 2, 4, 0.5, dtype=torch.bfloat16)
    target.insert(keys, values, torch.ones(rows, n, dtype=torch.bool))
    query = (torch.randn(rows, 1, dim, generator=generator) * 2.3).bfloat16()
    z, tau, max_logit = target.query(query, 0.37)
    assert max_logit.dtype == torch.float32
    assert torch.equal(max_logit.to(torch.bfloat16).float(), max_logit)
    assert (tau > 0).all()


def test_a_dropped_hub_refreshes_its_stale_neighbours_smallest_first():
    """maintain_candidates refreshes at most ``stale_refresh_width`` candidates whose nearest
    neighbour was dropped, smallest recorded distance first; the others keep their recorded
    distance, a lower bound of the true one. Five keys around a hub all have the hub as nearest
    neighbour; the hub is the newest and goes first."""
    angles = torch.arange(5) * (2 * math.pi / 5)
    radii = torch.tensor([1.00, 1.01, 1.02, 1.03, 1.04])
    ring = torch.stack([radii * angles.cos(), radii * angles.sin()], dim=-1)
    far = torch.tensor([[20.0, 0.0], [20.0, 3.0]])
    keys = torch.cat([far, ring, torch.zeros(1, 2)])[None]  # hub last: the newest
    positions = torch.arange(8)[None]
    candidates = torch.ones(1, 8, dtype=torch.bool)
    target = 6

    def run(width):
        nearest_sq = torch.full((1, 8), float("inf"))
        nearest_position = torch.full((1, 8), -1.0)
        ready = torch.zeros(1, 8, dtype=torch.bool)
        kept, _ = maintain_candidates(
            keys,
            positions,
            candidates,
            target,
            nearest_sq,
            nearest_position,
            ready,
            newcomer_bound=8,
            removal_bound=2,
            stale_refresh_width=width,
        )
        return kept, nearest_sq

    expected = _brute_force_decode(list(keys[0]), list(range(8)), target)
    assert 7 not in expected  # the hub went first
    kept, _ = run(None)  # the exact rule (the default): every stale candidate refreshed
    assert set(kept[0].nonzero().flatten().tolist()) == expected
    kept, nearest_sq = run(8)
    assert set(kept[0].nonzero().flatten().tolist()) == expected
    survivors = kept[0].nonzero().flatten()
    true = torch.cdist(keys[0, survivors], keys[0, survivors]).fill_diagonal_(float("inf")).min(-1).values ** 2
    torch.testing.assert_close(nearest_sq[0, survivors], true)
    # One refresh per removal: the count is still exact and every recorded distance a lower bound.
    kept, nearest_sq = run(1)
    assert int(kept.sum()) == target
    survivors = kept[0].nonzero().flatten()
    true = torch.cdist(keys[0, survivors], keys[0, survivors]).fill_diagonal_(float("inf")).min(-1).values ** 2
    assert (nearest_sq[0, survivors] <= true + 1e-5).all()
    assert (nearest_sq[0, survivors] < true - 1e-3).any()  # some entries are still stale


def test_decode_marks_stale_candidates_and_keeps_their_neighbours_live_over_a_long_stream():
    # The decode step finds stale candidates (nearest neighbour dropped) by a recorded position of
    # -1, not by searching every candidate's neighbour: that needs every candidate's recorded
    # position to be -1 or a candidate's after each step, and the recorded key norms to be the
    # keys' own. Checked with the general search (every candidate's neighbour looked up among the
    # candidates) over a high-dimensional stream where more candidates go stale at once than a
    # removal refreshes (hubs: many share a neighbour).
    from kvhive.methods.subgen import KEY_NORM

    def stale_by_search(candidates, positions, nearest_position):
        alive = ((positions[:, None, :] == nearest_position[:, :, None]) & candidates[:, None, :]).any(-1)
        return candidates & ~alive

    generator = torch.Generator().manual_seed(5)
    recent, budget, prompt, d = 4, 40, 48, 64
    policy = SubGen(recent=recent)
    stream = torch.randn(200, d, generator=generator) * torch.rand(200, 1, generator=generator) * 3
    keys, positions = stream[:prompt][None, None], torch.arange(prompt, dtype=torch.int32)[None, None]
    scoring = scoring_for(keys, positions=positions)
    keep = policy.select_prefill(scoring, budget, {})
    scores = {name: value[keep].reshape(1, 1, -1) for name, value in scoring.token_scores.items()}
    keys, positions = keys[keep].reshape(1, 1, -1, d), positions[keep].reshape(1, 1, -1)
    most_stale = 0
    for step in range(prompt, stream.shape[0]):
        keys = torch.cat([keys, stream[step][None, None, None]], dim=2)
        positions = torch.cat([positions, torch.tensor([[[step]]], dtype=torch.int32)], dim=2)
        scores = {name: torch.cat([value, value.new_zeros(1, 1, 1)], dim=2) for name, value in scores.items()}
        scoring = scoring_for(keys, phase=DECODE, positions=positions, token_scores=scores)
        keep = policy.select_decode(scoring, budget, {})
        keys, positions = keys[keep].reshape(1, 1, -1, d), positions[keep].reshape(1, 1, -1)
        scores = {name: value[keep].reshape(1, 1, -1) for name, value in scoring.token_scores.items()}
        candidates = torch.ones_like(scores[NEAREST_POSITION][0], dtype=torch.bool)
        candidates[:, -recent:] = False  # the tokens are kept in order here: the last ones are recent
        nearest = scores[NEAREST_POSITION][0]
        stale = stale_by_search(candidates, positions[0].float(), nearest)
        assert torch.equal(stale, candidates & (nearest < 0)), step
        norms = (keys[0, 0] * keys[0, 0]).sum(-1)
        assert torch.equal(scores[KEY_NORM][0, 0][candidates[0]], norms[candidates[0]]), step
        most_stale = max(most_stale, int(stale.sum()))
    assert most_stale > APPROXIMATE_STALE_REFRESH_WIDTH  # the lower-bound path was taken


@pytest.mark.parametrize("dim, seed", [(16, 0), (32, 1), (64, 2)])
@pytest.mark.parametrize("masked", [False, True])
def test_default_decode_takes_the_true_closest_pair_on_every_decision_of_a_hub_stream(dim, seed, masked):
    """Keys with hubs (Gaussian directions, random scales: a small key is the nearest neighbour of
    many), d >= 16: a removal leaves more candidates stale (nearest neighbour dropped) than the
    approximate refresh width. The default decode refreshes them all: every decision equals the
    brute-force closest-pair rule on the same candidates (the newer member of the closest pair among
    all candidates dropped), with and without the model mask (row-masked and every-row-full steps)."""
    stream = subgen_refresh_divergence.hub_stream(48 + 150, dim, seed)
    result = subgen_refresh_divergence.decode_against_closest_pair(
        stream, SubGen(recent=4), budget=40, prompt=48, masked=masked, fail_fast=True
    )
    assert result.decisions == 150 and result.differing == []
    assert result.most_stale > APPROXIMATE_STALE_REFRESH_WIDTH  # more stale than the width refreshes


def test_an_approximate_stale_refresh_width_changes_decisions_on_a_hub_stream():
    """``stale_refresh_width`` is an approximation: on a hub stream where the default takes the true
    closest pair on every decision, a width of 8 (the former default) or 1 takes some decisions on
    a lower bound (drops a stale candidate instead of the closest pair's newer member)."""
    stream = subgen_refresh_divergence.hub_stream(48 + 200, 32, 0)

    def differing(width):
        policy = SubGen(recent=4, stale_refresh_width=width)
        return subgen_refresh_divergence.decode_against_closest_pair(stream, policy, budget=40, prompt=48).differing

    assert differing(None) == []
    assert differing(APPROXIMATE_STALE_REFRESH_WIDTH) != []
    assert differing(1) != []


@pytest.mark.parametrize("width", [0, -1, 2.5, True, "8"])
def test_stale_refresh_width_is_validated(width):
    with pytest.raises(ValueError, match="stale_refresh_width.*integer >= 1"):
        SubGen(stale_refresh_width=width)
    assert SubGen().config.stale_refresh_width is None  # exact by default
    assert SubGen(stale_refresh_width=3).config.stale_refresh_width == 3


def test_subgen_knows_the_caches_rope_position_score_name():
    from kvhive.cache.kv_cache import ROPE_POSITION
    from kvhive.methods.subgen import _ROPE_POSITION

    assert _ROPE_POSITION == ROPE_POSITION


@pytest.mark.parametrize("width", [None, APPROXIMATE_STALE_REFRESH_WIDTH])
@pytest.mark.parametrize("recent", [0, 1, 4])
def test_decode_in_the_cache_is_the_same_whether_or_not_the_newest_tokens_scores_are_kept(recent, width, monkeypatch):
    """With a recent window the cache neither resets a new token's per-token scores nor moves them
    with the newest token into a freed slot (``reads_newest_token_scores`` False): SubGen writes a
    token's neighbour bookkeeping only when it leaves the window. Every decode step must keep what a
    cache that resets and moves the scores keeps; with ``recent = 0`` the newest token is a
    candidate at once, and its scores must move. (The exact refresh, the default, recomputes every
    candidate's neighbour in a steady step, so only the approximate width's steps show the loss.)"""
    model = tiny_model("llama", "gqa")
    generator = torch.Generator().manual_seed(30 + recent)
    input_ids = torch.randint(3, model.config.vocab_size, (2, 28), generator=generator)
    forced = [torch.randint(3, model.config.vocab_size, (2, 1), generator=generator) for _ in range(40)]
    assert SubGen(recent=recent).reads_newest_token_scores == (recent == 0)

    def kept(reads: bool | None):
        if reads is not None:
            monkeypatch.setattr(SubGen, "reads_newest_token_scores", property(lambda self: reads))
        cache = kvhive.make_cache(model, "subgen", budget=12, recent=recent, stale_refresh_width=width)
        assert all(
            store.new_token_scores_read == SubGen(recent=recent).reads_newest_token_scores for store in cache.layers
        )
        snapshots = []
        key = cache_kwarg(model)
        with torch.inference_mode():
            model(input_ids=input_ids, **{key: cache}, use_cache=True)
            for token in forced:
                model(input_ids=token, **{key: cache}, use_cache=True)
                layer = cache.layers[cache.compressed_layers[-1]]
                snapshots.append(layer.dense()[2].sort(-1).values.clone())
        assert not cache.layers[cache.compressed_layers[-1]].stored_in_order  # freed slots were filled
        return torch.stack(snapshots)

    default = kept(None)
    assert torch.equal(default, kept(True))
    if recent == 0 and width is not None:  # without the move the newest candidate's bookkeeping is lost
        assert not torch.equal(default, kept(False))


@pytest.mark.parametrize("recent, padded", [(0, False), (4, False), (4, True)])
def test_decode_with_the_attentions_key_probes_keeps_what_its_own_product_keeps(recent, padded, monkeypatch):
    """On the CPU in float32 a steady decode step's distances come from the attention: SubGen names
    the rows (newcomer, stale candidates) before it (``decode_key_probes``) and the attention
    computes their products with its logits, so the keys are read once a step. Every steady step of
    every compressed layer must take them, and leave the state SubGen's own product leaves (the
    same attention in both runs: only where the products come from differs), to the bit; and the
    run must stay what sdpa's attention, without probes, gives."""
    import kvhive.methods.subgen_candidates as subgen_candidates

    model = tiny_model("llama", "gqa")
    generator = torch.Generator().manual_seed(50 + recent)
    if padded:
        input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=28, seed=recent)
    else:
        input_ids = torch.randint(3, model.config.vocab_size, (2, 28), generator=generator)
        attention_mask = torch.ones_like(input_ids)
    forced = [torch.randint(3, model.config.vocab_size, (2, 1), generator=generator) for _ in range(30)]
    original = subgen_candidates.steady_step

    def run(probes: bool, products_used: bool = True):
        calls = {"probed": 0, "own": 0}
        states = []

        def recorded(*args):  # every layer's tokens and state after each steady step, by position
            probe = args[-1] if products_used else None
            calls["probed" if probe is not None else "own"] += 1
            result = original(*args[:-1], probe)
            positions = args[2]
            order = positions.argsort(-1)
            states.append([positions.gather(1, order)] + [t.gather(1, order) for t in (args[3], *args[5:7], args[1])])
            return result

        monkeypatch.setattr(SubGen, "takes_key_probes", probes)
        monkeypatch.setattr(subgen_candidates, "steady_step", recorded)
        cache = kvhive.make_cache(model, "subgen", budget=12, recent=recent)
        logits = prefill_and_decode(model, cache, input_ids, attention_mask, steps=len(forced), forced_tokens=forced)
        return logits, states, calls

    probed_logits, probed_states, probed_calls = run(True)
    own_logits, own_states, own_calls = run(True, products_used=False)
    steps = len(forced) * len(kvhive.make_cache(model, "subgen", budget=12, recent=recent).compressed_layers)
    assert probed_calls == {"probed": steps, "own": 0} and own_calls == {"probed": 0, "own": steps}
    # The candidates, each one's nearest distance and position and key norm, to the bit.
    assert len(probed_states) == len(own_states) == steps
    for probed, own in zip(probed_states, own_states, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(probed, own, strict=True))
    assert torch.equal(probed_logits, own_logits)
    # Without probes the attention is sdpa's: the same softmax, rounded apart.
    sdpa_logits, _, sdpa_calls = run(False)
    assert sdpa_calls == {"probed": 0, "own": steps}
    torch.testing.assert_close(probed_logits, sdpa_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_key_probes_are_taken_only_where_the_attentions_product_is_the_methods(dtype, monkeypatch):
    """The attention computes SubGen's products only from float32 keys: a 16-bit product is not
    the float32 distances SubGen computes, so with 16-bit keys every steady step computes its own."""
    import kvhive.methods.subgen_candidates as subgen_candidates

    model = tiny_model("llama", "gqa").to(dtype)
    original = subgen_candidates.steady_step
    calls = {"probed": 0, "own": 0}

    def counted(*args):
        calls["probed" if args[-1] is not None else "own"] += 1
        return original(*args)

    monkeypatch.setattr(subgen_candidates, "steady_step", counted)
    cache = kvhive.make_cache(model, "subgen", budget=12, recent=4)
    input_ids = torch.randint(3, model.config.vocab_size, (2, 28), generator=torch.Generator().manual_seed(1))
    prefill_and_decode(model, cache, input_ids, torch.ones_like(input_ids), steps=5)
    assert calls == {"probed": 0, "own": 5 * len(cache.compressed_layers)}


def _smallest_budget_counting_up(config) -> int:
    budget = 1
    while memory_plan(budget, config) is None:
        budget += 1
    return budget


@pytest.mark.parametrize("samples_per_cluster", [1, 2, 3, 4, 7, 16, 63])
@pytest.mark.parametrize(("value_fraction", "cluster_fraction"), [(0.25, 0.25), (0.1, 0.5), (0.05, 0.3), (0.3, 0.05)])
def test_minimum_budget_is_the_smallest_budget_with_a_plan(samples_per_cluster, value_fraction, cluster_fraction):
    config = SubGenAttentionConfig(
        samples_per_cluster=samples_per_cluster,
        value_sample_fraction=value_fraction,
        cluster_fraction=cluster_fraction,
    )
    smallest = SubGenAttention(config).minimum_budget()
    assert smallest == _smallest_budget_counting_up(config)
    assert memory_plan(smallest, config) is not None and memory_plan(smallest - 1, config) is None


def _raise_timeout(signum, frame):
    raise TimeoutError("the minimum-budget search ran past 20 s")


def test_minimum_budget_of_huge_clusters_is_found_without_counting_up():
    # Counting up one token at a time took ~10**12 steps here: the refusal hung instead of naming it.
    # (An alarm turns a hang into a failure.)
    policy = SubGenAttention(samples_per_cluster=10**12)
    previous = signal.signal(signal.SIGALRM, _raise_timeout)
    signal.alarm(20)
    try:
        smallest = policy.minimum_budget()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert smallest == math.ceil((10**12 // 2 + 1) / 0.25)
    assert memory_plan(smallest, policy.config) is not None and memory_plan(smallest - 1, policy.config) is None
    with pytest.raises(ValueError, match=rf"invalid budget=64 for subgen-attention: expected an integer >= {smallest}"):
        policy.plan(64)
