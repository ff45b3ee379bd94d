"""AhaKV: recent accumulation (Eq. 5), step-gain softmax (Eq. 12), value prior (Eq. 13-15),
decode-phase running scores (Algorithm 1), budgets and model runs."""

from __future__ import annotations

import math

import pytest
import torch

import kvhive
from kvhive.methods import make_policy
from kvhive.methods.ahakv import (
    GAIN_INPUTS,
    SCORE,
    AhaKV,
    AhaKVConfig,
    ahakv_scores,
    sg_lambda,
    sg_logit_multiplier,
    value_prior,
)
from kvhive.methods.base import ScoringInputs, keep_top_scores
from kvhive.models import TINY_ARCHITECTURES, TINY_ATTENTION_KINDS, tiny_model

from helpers import left_padded_batch, prefill_and_decode, reference_logits
from helpers import scoring_inputs as _scoring

VARIANTS = [(architecture, attention) for architecture in TINY_ARCHITECTURES for attention in TINY_ATTENTION_KINDS]


def _gaussian_inputs(seed, n=512, heads=4, dim=64, query_heads=None):
    generator = torch.Generator().manual_seed(seed)
    query_heads = query_heads or heads
    queries = torch.randn(1, query_heads, n, dim, generator=generator)
    keys = torch.randn(1, heads, n, dim, generator=generator)
    values = torch.randn(1, heads, n, dim, generator=generator)
    return queries, keys, values


# -- Eq. 12: the step gain -------------------------------------------------------------------------


def test_sg_lambda_is_eq_12():
    for n, k, d in [(1000, 32, 64), (4096, 1000, 128), (33, 32, 256), (10**6, 7, 1)]:
        assert sg_lambda(n, k, d) == pytest.approx(math.sqrt(2 * math.log(n / k) / d), rel=1e-12)
    assert sg_lambda(32, 32, 64) == 0.0 and sg_lambda(10, 32, 64) == 0.0  # n <= k: nothing to evict
    with pytest.raises(ValueError, match="budget"):
        sg_lambda(100, 0, 64)
    with pytest.raises(ValueError, match="head_dim"):
        sg_lambda(100, 10, 0)


def test_logit_multiplier_of_each_reading():
    # The factor on the model's logits q.k * scaling: raw_qk gives lambda q.k (Eq. 8-12),
    # scaled_qk gives lambda q.k / sqrt(d) (Algorithm 1, line 6), whatever the model's scaling.
    n, k, d = 2048, 128, 64
    lam = math.sqrt(2 * math.log(n / k) / d)
    for scaling in (d**-0.5, 0.3):  # the usual 1/sqrt(d), and a model with its own (Gemma 2's query_pre_attn_scalar)
        assert sg_logit_multiplier(n, k, d, scaling, "raw_qk") * scaling == pytest.approx(lam, rel=1e-12)
        assert sg_logit_multiplier(n, k, d, scaling, "scaled_qk") * scaling == pytest.approx(
            lam / math.sqrt(d), rel=1e-12
        )
    # With the usual scaling the readings multiply the model's logits by sqrt(2 ln(n/k)) and lambda.
    assert sg_logit_multiplier(n, k, d, d**-0.5, "raw_qk") == pytest.approx(math.sqrt(2 * math.log(n / k)))
    assert sg_logit_multiplier(n, k, d, d**-0.5, "scaled_qk") == pytest.approx(lam)
    with pytest.raises(ValueError, match="gain_input"):
        sg_logit_multiplier(n, k, d, 0.125, "qk")


def _reference_sg_weights(queries, keys, n, k, reading):
    """SG-softmax rows from the paper's formulas: softmax(lambda w), w = q.k (Eq. 9, 12) or
    q.k / sqrt(d) (Algorithm 1, line 6); causal."""
    d = keys.shape[-1]
    lam = math.sqrt(2 * math.log(n / k) / d)
    group = queries.shape[1] // keys.shape[1]
    w = queries @ keys.repeat_interleave(group, dim=1).transpose(-1, -2)
    if reading == "scaled_qk":
        w = w / math.sqrt(d)
    rows = queries.shape[2]
    causal = torch.ones(n, n, dtype=torch.bool).tril()[n - rows :]
    return torch.softmax((lam * w).masked_fill(~causal, float("-inf")), dim=-1)


@pytest.mark.parametrize("reading", GAIN_INPUTS)
@pytest.mark.parametrize("scaling", [16**-0.5, 0.4])
def test_scores_are_recent_sg_softmax_sums_times_value_prior(reading, scaling):
    # GQA: 4 query heads over 2 KV heads; budget k = 64 of n = 300 tokens, r = 32 recent rows.
    # The model's own scaling must not enter either reading (0.4 != 1/sqrt(16)).
    n, k, r = 300, 64, 32
    queries, keys, values = _gaussian_inputs(1, n=n, heads=2, dim=16, query_heads=4)
    scoring = _scoring(queries, keys, values, scaling=scaling)
    scores = ahakv_scores(scoring, k, recent=r, kernel=7, gain_input=reading)

    weights = _reference_sg_weights(queries[:, :, -r:], keys, n, k, reading)
    recent_sum = weights.sum(dim=2)  # Eq. 5 over the last r rows
    per_kv_head = recent_sum.reshape(1, 2, 2, n).mean(dim=2)  # mean over each KV group
    norms = values.pow(2).sum(-1)  # Eq. 13: mean filter of ||v||^2 (7 taps, edges count real taps)
    padded = torch.nn.functional.pad(norms, (3, 3))
    counts = torch.nn.functional.pad(torch.ones_like(norms), (3, 3))
    gamma = padded.unfold(-1, 7, 1).sum(-1) / counts.unfold(-1, 7, 1).sum(-1)
    expected = gamma / gamma.amax(dim=-1, keepdim=True) * per_kv_head  # Eq. 14-15
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-7)
    # The policy uses the configured reading.
    policy = AhaKV(recent=r, gain_input=reading)
    keep = policy.select_prefill(_scoring(queries, keys, values, scaling=scaling), k, {})
    torch.testing.assert_close(keep, keep_top_scores(expected, k, forced=torch.arange(n) >= n - r))


def test_the_readings_keep_different_tokens():
    # Same inputs, same budget: the two readings must not silently coincide.
    n, k = 300, 64
    queries, keys, values = _gaussian_inputs(2, n=n, heads=2, dim=16, query_heads=4)
    keeps = [
        AhaKV(gain_input=reading).select_prefill(_scoring(queries, keys, values), k, {}) for reading in GAIN_INPUTS
    ]
    assert not torch.equal(*keeps)


def test_gain_entropy_on_gaussian_inputs_eq_10():
    # Eq. 10: with w ~ N(0, sigma^2) the rows of softmax(lambda w) have entropy ~ log n - lambda^2 sigma^2 / 2.
    # raw_qk (w = q.k, sigma^2 = d) reaches the paper's target log k (Eq. 11); scaled_qk
    # (w = q.k / sqrt(d), sigma^2 = 1) stays near log n - ln(n/k)/d, i.e. barely below the plain
    # softmax (log n - 1/2): on the paper's own assumptions only raw_qk has the stated property.
    dim = 64
    generator = torch.Generator().manual_seed(0)
    for n, k in [(1024, 128), (2048, 512)]:  # n / k small enough for the Gaussian estimate (appendix A)
        queries = torch.randn(1, 1, 64, dim, generator=generator)
        keys = torch.randn(1, 1, n, dim, generator=generator)
        mask = torch.ones(1, 1, 64, n, dtype=torch.bool)
        scoring = _scoring(queries, keys, keys, mask=mask)
        targets = [
            (sg_logit_multiplier(n, k, dim, scoring.scaling, "raw_qk"), math.log(k)),
            (sg_logit_multiplier(n, k, dim, scoring.scaling, "scaled_qk"), math.log(n) - math.log(n / k) / dim),
            (1.0, math.log(n) - 0.5),
        ]
        for multiplier, target in targets:
            weights = scoring.attention_weights(slice(0, 64), multiplier)
            entropy = -(weights * weights.clamp_min(1e-30).log()).sum(-1).mean().item()
            assert abs(entropy - target) < 0.25, (n, k, multiplier, entropy, target)


def test_default_reading_is_raw_qk():
    # The paper's stated property (Eq. 11: row entropy log k, sharper than the plain softmax) is
    # what Eq. 8-12 derive for raw q.k; see the module docstring for the measurements.
    assert AhaKVConfig().gain_input == "raw_qk"
    assert AhaKV().config.gain_input == "raw_qk"


# -- Eq. 13-14: the value prior ----------------------------------------------------------------------


def test_value_prior_mean_filter_and_normalisation():
    values = torch.zeros(1, 1, 10, 1)
    values[0, 0, 4, 0] = 3.0  # ||v||^2 = 9 at position 4
    values[0, 0, 0, 0] = 1.0  # ||v||^2 = 1 at position 0 (edge: averaged over 2 real taps)
    gamma = value_prior(values, None, kernel=3)[0, 0]
    expected = torch.tensor([0.5, 1 / 3, 0, 3, 3, 3, 0, 0, 0, 0]) / 3
    torch.testing.assert_close(gamma, expected)
    # Padding (positions 0, 1) counts neither in the filter's sums and tap counts nor in the max:
    # ||v||^2 = 6 at 2 and 9 at 4 give gamma = 6/2 (2 real taps), 15/3, 9/3, 9/3 at 2..5.
    valid = torch.ones(1, 1, 10, dtype=torch.bool)
    valid[0, 0, :2] = False
    values[0, 0, 1, 0] = 100.0
    values[0, 0, 2, 0] = math.sqrt(6.0)
    gamma = value_prior(values, valid, kernel=3)[0, 0]
    assert gamma[:2].tolist() == [0.0, 0.0]
    torch.testing.assert_close(gamma[2:7], torch.tensor([3.0, 5.0, 3.0, 3.0, 0.0]) / 5)


# -- kept sets -------------------------------------------------------------------------------------


def test_kept_set_hand_checked():
    # One head, d = 1, scaling 1, n = 10, budget 4 = B_s 2 + B_r 2, kernel 1 (no filtering).
    # Recent rows 8 and 9 have q = 1; keys: k2 = 3, k6 = 2.5, k4 = 2, others 0, so every recent
    # row gives key j the weight exp(g k_j) / Z_row with the step gain g = sqrt(2 ln(10/4)) = 1.354.
    # Value prior: ||v4||^2 = 1.9, others 1 -> gamma_bar_4 = 1, others 1/1.9. Scores (times the
    # common factor 1/Z_8 + 1/Z_9): S2 = e^{3g}/1.9 = 30.5, S6 = e^{2.5g}/1.9 = 15.5,
    # S4 = e^{2g} = 15.0, others 1/1.9 -> keep {2, 6} + the recent {8, 9}.
    # (With the plain softmax, g = 1: S6 = 6.4 < S4 = 7.4, so 4 would be kept instead of 6;
    # without the prior, 6 > 4 too: each of gain and prior matters here.)
    n = 10
    keys = torch.zeros(1, 1, n, 1)
    keys[0, 0, 2], keys[0, 0, 6], keys[0, 0, 4] = 3.0, 2.5, 2.0
    values = torch.ones(1, 1, n, 1)
    values[0, 0, 4] = math.sqrt(1.9)
    queries = torch.ones(1, 1, n, 1)
    policy = AhaKV(recent=2, kernel=1)
    keep = policy.select_prefill(_scoring(queries, keys, values, scaling=1.0), 4, {})
    assert torch.nonzero(keep[0, 0]).flatten().tolist() == [2, 6, 8, 9]
    # The same inputs scored with a plain softmax keep 4 instead of 6 (the gain matters).
    plain = _scoring(queries, keys, values, scaling=1.0)
    plain_scores = plain.recent_accumulated_attention(2) * value_prior(values, None, 1)
    recent = torch.zeros(n, dtype=torch.bool)
    recent[-2:] = True
    assert torch.nonzero(keep_top_scores(plain_scores, 4, forced=recent)[0, 0]).flatten().tolist() == [2, 4, 8, 9]
    # A stronger prior flips it (the prior matters): ||v4||^2 = 10 -> S4 = e^{2g} = 15.0 beats
    # S6 = e^{2.5g}/10 = 2.9 and S2 = e^{3g}/10 = 5.8 -> keep {2, 4} + {8, 9}.
    values[0, 0, 4] = math.sqrt(10.0)
    keep = policy.select_prefill(_scoring(queries, keys, values, scaling=1.0), 4, {})
    assert torch.nonzero(keep[0, 0]).flatten().tolist() == [2, 4, 8, 9]


def _kept_position_statistics(keep, recent):
    """Kept positions outside the recent part, scaled to [0, 1): mean and KS distance to uniform."""
    n = keep.shape[-1] - recent
    positions = torch.nonzero(keep[..., :n])[:, -1].double() / n
    ordered = positions.sort().values
    count = ordered.numel()
    empirical = torch.arange(1, count + 1, dtype=torch.double) / count
    ks = torch.maximum((empirical - ordered).abs(), (empirical - 1 / count - ordered).abs()).max().item()
    return positions.mean().item(), ks, count


def test_kept_positions_are_unbiased_on_iid_inputs():
    # Sec. 4.1: with i.i.d. queries and keys, the plain accumulated score (H2O, Eq. 2) decays
    # with the position, so its top keys crowd the start; AhaKV's recent accumulation keeps
    # positions spread evenly. 6 seeds x 4 heads x B_s = 32 positions each.
    n, budget, recent = 512, 64, 32
    aha_keep, h2o_keep = [], []
    for seed in range(6):
        queries, keys, values = _gaussian_inputs(seed, n=n)
        scoring = _scoring(queries, keys, values)
        aha_keep.append(AhaKV(recent=recent).select_prefill(scoring, budget, {}))
        recent_part = torch.zeros(n, dtype=torch.bool)
        recent_part[-recent:] = True
        h2o_keep.append(keep_top_scores(scoring.accumulated_attention(), budget, forced=recent_part))
    aha_mean, aha_ks, count = _kept_position_statistics(torch.cat(aha_keep), recent)
    h2o_mean, h2o_ks, _ = _kept_position_statistics(torch.cat(h2o_keep), recent)
    critical = 1.95 / math.sqrt(count)  # KS test against uniform positions at the 0.1 % level
    assert count == 6 * 4 * (budget - recent)
    assert abs(aha_mean - 0.5) < 0.06 and aha_ks < critical, (aha_mean, aha_ks, critical)
    assert h2o_mean < 0.2 and h2o_ks > 4 * critical, (h2o_mean, h2o_ks)


# -- decode ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reading", GAIN_INPUTS)
def test_decode_adds_the_new_query_sg_softmax_to_the_running_score(reading):
    # Algorithm 1, line 27: F_t = SG-softmax(A_t) + F_{t-1} over the stored keys, n = tokens seen.
    generator = torch.Generator().manual_seed(3)
    stored, seen, budget = 13, 100, 12
    keys = torch.randn(2, 2, stored, 16, generator=generator)
    queries = torch.randn(2, 4, 1, 16, generator=generator)
    mask = torch.ones(2, 1, 1, stored, dtype=torch.bool)
    mask[1, 0, 0, :3] = False  # padding of the second sequence
    scoring = _scoring(queries, keys, keys, sequence_length=seen, mask=mask, phase="decode")
    previous = torch.rand(2, 2, stored, generator=generator)
    scoring.token_scores[SCORE] = previous.clone()
    policy = AhaKV(recent=4, gain_input=reading)
    state = {}
    policy.observe_decode(scoring, state, budget=budget)  # the layer budget, passed by the cache
    # Eq. 12 with n = the row's tokens seen (the second row's 3 padding tokens excluded), k = the budget
    lam = torch.tensor([math.sqrt(2 * math.log(n / budget) / 16) for n in (seen, seen - 3)]).view(2, 1, 1, 1)
    logits = queries @ keys.repeat_interleave(2, dim=1).transpose(-1, -2)  # [2, 4, 1, stored]
    logits = logits * lam / (4.0 if reading == "scaled_qk" else 1.0)  # / sqrt(d) on Algorithm 1's reading
    weights = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)[:, :, 0]
    expected = previous + weights.reshape(2, 2, 2, stored).mean(dim=2)
    torch.testing.assert_close(scoring.token_scores[SCORE], expected)
    # Re-selection: the top B_s = 8 by F_t outside the recent 4, plus the recent 4.
    keep = policy.select_decode(scoring, budget, state)
    assert (keep.sum(-1) == budget).all()
    assert keep[..., -4:].all()
    top = expected[0, :, :-4].topk(8, dim=-1).indices  # first sequence: no padding
    assert torch.equal(keep[0, :, :-4], torch.zeros_like(keep[0, :, :-4]).scatter_(-1, top, True))
    # Second sequence: only 6 real tokens outside the recent part -> all kept, + 2 of the padding.
    assert keep[1, :, 3:-4].all() and (keep[1, :, :3].sum(-1) == 2).all()


def test_decode_n_stored_counts_the_keys_the_new_query_attends():
    # The other reading of Eq. 12's n while decoding (issue 26 item 6): the row's stored real keys
    # (13, and 10 for the row with 3 padding keys) instead of its tokens seen (100, 97).
    generator = torch.Generator().manual_seed(3)
    stored, seen, budget = 13, 100, 12
    keys = torch.randn(2, 2, stored, 16, generator=generator)
    queries = torch.randn(2, 4, 1, 16, generator=generator)
    mask = torch.ones(2, 1, 1, stored, dtype=torch.bool)
    mask[1, 0, 0, :3] = False
    scoring = _scoring(queries, keys, keys, sequence_length=seen, mask=mask, phase="decode")
    previous = torch.rand(2, 2, stored, generator=generator)
    scoring.token_scores[SCORE] = previous.clone()
    AhaKV(recent=4, decode_n="stored").observe_decode(scoring, {}, budget=budget)
    gains = [math.sqrt(2 * math.log(n / budget) / 16) if n > budget else 0.0 for n in (stored, stored - 3)]
    lam = torch.tensor(gains).view(2, 1, 1, 1)
    logits = queries @ keys.repeat_interleave(2, dim=1).transpose(-1, -2) * lam
    weights = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)[:, :, 0]
    expected = previous + weights.reshape(2, 2, 2, stored).mean(dim=2)
    torch.testing.assert_close(scoring.token_scores[SCORE], expected)
    # the second row has 10 <= 12 real keys: no gain, a plain uniform softmax over them
    torch.testing.assert_close(weights[1, :, 3:], torch.full((4, 10), 0.1))
    with pytest.raises(ValueError, match="decode_n"):
        AhaKV(decode_n="tokens")


@pytest.mark.parametrize("reading", GAIN_INPUTS)
def test_initialize_decode_scores_the_prompt_with_the_configured_reading_and_keeps_each_rows_padding(reading):
    # Algorithm 1 line 19 (F_0 = S_hat) with the configured gain reading; the rows' prompt padding is
    # recorded, because n of Eq. 12 while decoding excludes it even after the padding was evicted.
    queries, keys, values = _gaussian_inputs(7, n=40, heads=2, dim=16, query_heads=4)
    queries, keys, values = (t.expand(2, -1, -1, -1).clone() for t in (queries, keys, values))
    n = keys.shape[2]
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None].repeat(2, 1, 1, 1)
    mask[1, 0, :, :3] = False  # three padding tokens in the second row
    policy = AhaKV(recent=4, gain_input=reading)
    scoring, state = _scoring(queries, keys, values, mask=mask), {}
    policy.initialize_decode(scoring, state, budget=12)
    expected = ahakv_scores(_scoring(queries, keys, values, mask=mask), 12, 4, policy.config.kernel, reading)
    torch.testing.assert_close(scoring.token_scores[SCORE], expected)
    other = GAIN_INPUTS[1 - GAIN_INPUTS.index(reading)]
    assert not torch.allclose(
        expected, ahakv_scores(_scoring(queries, keys, values, mask=mask), 12, 4, policy.config.kernel, other)
    )
    assert state["ahakv_row_padding"] == [0, 3]
    # A decode step after the padding was evicted (every stored key real): row 1's n is still seen - 3.
    seen, stored = 100, 13
    decode = _scoring(
        queries[:, :, -1:], keys[:, :, :stored], keys[:, :, :stored], sequence_length=seen, phase="decode"
    )
    decode.mask = torch.ones(2, 1, 1, stored, dtype=torch.bool)
    decode.token_scores[SCORE] = torch.zeros(2, 2, stored)
    policy.observe_decode(decode, state, budget=12)
    lam = torch.tensor([math.sqrt(2 * math.log(m / 12) / 16) for m in (seen, seen - 3)]).view(2, 1, 1, 1)
    logits = queries[:, :, -1:] @ keys[:, :, :stored].repeat_interleave(2, dim=1).transpose(-1, -2)
    logits = logits * lam / (4.0 if reading == "scaled_qk" else 1.0)
    weights = torch.softmax(logits, dim=-1)[:, :, 0]
    torch.testing.assert_close(decode.token_scores[SCORE], weights.reshape(2, 2, 2, stored).mean(dim=2))


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "padding-mask"])
@pytest.mark.parametrize(
    "multiplier",
    [2.3, 0.0, (2.0, 0.7), torch.tensor(1.9, dtype=torch.float64), torch.tensor([0.0, 1.4], dtype=torch.float64)],
    ids=["float", "zero", "per-row", "device", "device-per-row"],
)
def test_decode_weights_from_the_attentions_logits_equal_the_recomputed_ones(masked, multiplier):
    # A decode step rescales the logits its attention computed (last_query_logits) instead of a
    # second q.K^T: the same SG-softmax weights, a zero gain included (uniform over the real keys).
    generator = torch.Generator().manual_seed(5)
    stored = 13
    keys = torch.randn(2, 2, stored, 16, generator=generator)
    queries = torch.randn(2, 4, 1, 16, generator=generator)
    mask = None
    if masked:
        mask = torch.ones(2, 1, 1, stored, dtype=torch.bool)
        mask[1, 0, 0, :3] = False
    scoring = _scoring(queries, keys, keys, sequence_length=100, mask=mask, phase="decode")
    scoring.mask = mask  # None: every stored key precedes the new query, as in the attention
    expected = scoring.attention_weights(slice(0, 1), multiplier)[:, :, 0]
    grouped = queries.reshape(2, 2, 2, 16) @ keys.transpose(-1, -2)  # the attention's product
    scoring.last_query_logits = (grouped * scoring.scaling).view(2, 2, 2, 1, stored)
    given = scoring.last_query_logits.clone()
    got = scoring.last_query_attention(multiplier)
    torch.testing.assert_close(got, expected)
    assert torch.equal(scoring.last_query_logits, given)  # the attention's logits are left as they were
    if isinstance(multiplier, float) and multiplier == 0.0:
        real = stored - 3 if masked else stored
        torch.testing.assert_close(got[1, :, -real:], torch.full((4, real), 1 / real))


def test_a_decode_step_reads_the_keys_once(monkeypatch):
    # The new query's SG-softmax comes from the attention's logits: no scoring product in a decode step.
    model = tiny_model("llama", "gqa")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size)
    cache = kvhive.make_cache(model, "ahakv", budget=12, recent=4)
    prefill_and_decode(model, cache, input_ids, attention_mask, steps=0)

    def refuse(*args, **kwargs):
        raise AssertionError("a decode step recomputed q.K^T for its scores")

    monkeypatch.setattr(ScoringInputs, "attention_weights", refuse)
    token = input_ids[:, -1:]
    mask = torch.cat([attention_mask, torch.ones_like(token)], dim=1)
    with torch.no_grad():
        model(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True)
    assert all((cache.layers[i].lengths == 12).all() for i in cache.compressed_layers)


# -- runs on the tiny models --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models():
    return {variant: tiny_model(*variant) for variant in VARIANTS}


@pytest.mark.parametrize("variant", VARIANTS, ids=["-".join(v) for v in VARIANTS])
def test_full_budget_matches_transformers(models, variant):
    model = models[variant]
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size)
    reference = reference_logits(model, input_ids, attention_mask, steps=20)
    cache = kvhive.make_cache(model, "ahakv", budget=64)  # 24 prompt + 20 generated tokens fit
    logits = prefill_and_decode(model, cache, input_ids, attention_mask, steps=20)
    assert (logits - reference).abs().max().item() <= 1e-5


@pytest.mark.parametrize("variant", VARIANTS, ids=["-".join(v) for v in VARIANTS])
def test_small_budget_prefill_and_50_decode_steps(models, variant):
    model = models[variant]
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=40)
    cache = kvhive.make_cache(model, "ahakv", budget=12, recent=4)
    logits = prefill_and_decode(model, cache, input_ids, attention_mask, steps=50)
    assert torch.isfinite(logits).all()
    for layer in cache.compressed_layers:
        store = cache.layers[layer]
        assert (store.lengths == 12).all()  # exactly the budget in every head, after 50 evictions
        assert store.token_scores[SCORE].numel() == store.num_stored  # running scores stay aligned
        assert store.policy_state["ahakv_scored_with"] == 12


def test_decode_phase_evicts_once_the_budget_is_reached():
    # The prompt fits (no prefill eviction); decoding then keeps the layer at its budget, with
    # Eq. 12's k known from the cache's budget.
    model = tiny_model("llama", "gqa")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size)
    cache = kvhive.make_cache(model, "ahakv", budget=30, recent=8)
    prefill_and_decode(model, cache, input_ids, attention_mask, steps=0)
    assert all((cache.layers[i].lengths == 24).all() for i in cache.compressed_layers)
    logits = []
    mask = attention_mask
    token = input_ids[:, -1:]
    with torch.no_grad():
        for step in range(20):
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            output = model(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True)
            token = output.logits[:, -1].argmax(-1, keepdim=True)
            logits.append(output.logits)
            for i in cache.compressed_layers:
                assert (cache.layers[i].lengths == min(30, 25 + step)).all()
                assert cache.layers[i].policy_state["ahakv_scored_with"] == 30
    assert torch.isfinite(torch.cat(logits)).all()


# -- parameters --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "parameters, name",
    [
        ({"recent": 0}, "recent"),
        ({"recent": 2.5}, "recent"),
        ({"kernel": 0}, "kernel"),
        ({"kernel": 6}, "kernel"),
        ({"window": 8}, "window"),  # AhaKV has no window: its recent budget is called recent
        ({"gain_input": "qk"}, "gain_input"),
        ({"gain_input": None}, "gain_input"),
    ],
)
def test_invalid_parameters(parameters, name):
    with pytest.raises(ValueError, match=name):
        make_policy("ahakv", **parameters)


def test_budget_below_recent_budget_is_rejected():
    model = tiny_model("llama", "gqa")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size)
    with pytest.raises(ValueError, match="budget"):
        cache = kvhive.make_cache(model, "ahakv", budget=16)  # below B_r = 32
        prefill_and_decode(model, cache, input_ids, attention_mask, steps=0)
    queries, keys, values = _gaussian_inputs(0, n=64)
    with pytest.raises(ValueError, match="budget"):
        AhaKV().select_prefill(_scoring(queries, keys, values), 16, {})
