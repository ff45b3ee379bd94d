"""BUZZ and BUZZ with log n (kvhive/methods/buzz.py; arXiv:2410.23079, docs/METHODS.md)."""

from __future__ import annotations

import itertools
import math
import os
from fractions import Fraction

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformers import AttentionInterface, AttentionMaskInterface, DynamicCache
from transformers.masking_utils import sdpa_mask

from kvhive.api import make_cache
from kvhive.compat import cache_kwarg as kvhive_cache_kwarg
from kvhive.methods import buzz as buzz_module
from kvhive.methods import buzz_layout, make_policy
from kvhive.methods.base import DECODE, PREFILL, ScoringInputs
from kvhive.methods.buzz import (
    EVICTIONS,
    OLD,
    PADDING,
    PREFILL_ROUNDS,
    SCORE,
    Buzz,
    BuzzLayout,
    BuzzLogN,
    kept_size_statistics,
    layout_for_budget,
    local_max_mask,
    mean_layout,
    old_sample_sizes,
    size_statistics,
    small_stride,
    steady_state_sizes,
    theorem_ratio,
)
from kvhive.models import TINY_ARCHITECTURES, TINY_ATTENTION_KINDS, load_model, tiny_model

from helpers import left_padded_batch, prefill_and_decode, reference_logits

ALL_TINY = [(a, k) for a in TINY_ARCHITECTURES for k in TINY_ATTENTION_KINDS]


# ----------------------------------------------------------------------------------------------
# Hand-made scoring inputs and a plain-Python model of Algorithms 1-2
# ----------------------------------------------------------------------------------------------


def scoring_for(scores: torch.Tensor, valid: torch.Tensor | None = None, phase: str = DECODE) -> ScoringInputs:
    """ScoringInputs over ``scores[B, H, N]`` (BUZZ's accumulated attention) with dummy tensors."""
    b, h, n = scores.shape
    keys = torch.zeros(b, h, n, 2)
    if valid is None:
        valid = torch.ones(b, n, dtype=torch.bool)
    return ScoringInputs(
        keys=keys,
        values=keys.clone(),
        queries=torch.zeros(b, h, 1, 2),
        positions=torch.arange(n).expand(b, h, n),
        mask=valid[:, None, None, :],
        scaling=1.0,
        layer_index=0,
        num_layers=1,
        sequence_length=n,
        phase=phase,
        token_scores={SCORE: scores.clone()},
    )


def reference_eviction(
    tokens: list[int], score: dict[int, float], sink: int, window: int, old: int, stride: int, threshold: int
) -> tuple[list[int], int]:
    """Algorithm 1 (line 13-15) and Algorithm 2 on a Python list, for one head, plus Remark 2's
    extra interval rounds when the samples still do not fit."""
    hat = (stride + 1) // 2
    body = tokens[sink : len(tokens) - window]
    samples = body[:old][::hat]
    new = body[old:]
    for start in range(0, len(new), stride):
        segment = new[start : start + stride]
        best = max(range(len(segment)), key=lambda j: (score[segment[j]], -j))  # first maximum
        samples.append(segment[best])
    while len(samples) > threshold:
        samples = samples[::hat]
    return tokens[:sink] + samples + tokens[len(tokens) - window :], len(samples)


def stream(policy: Buzz, budget: int, steps: int, heads: int = 2, seed: int = 0, bulk: bool = False):
    """Feed tokens one by one (or in bulk up to the next eviction) through ``select_decode`` as the
    cache does; compare every eviction with :func:`reference_eviction`. Returns the old-sample
    sizes after each eviction and the stored length after each step."""
    layout = policy.layout(budget)
    generator = torch.Generator().manual_seed(seed)
    kept = [[] for _ in range(heads)]
    score = [dict() for _ in range(heads)]
    state, olds, lengths, seen = {}, [], [], 0
    while seen < steps:
        arriving = (budget + 1 - len(kept[0])) if bulk else 1
        for h in range(heads):
            for token in range(seen, seen + arriving):
                score[h][token] = float(torch.rand((), generator=generator))
                kept[h].append(token)
        seen += arriving
        n = len(kept[0])
        positions = torch.tensor(kept)[None]
        scores = torch.tensor([[score[h][t] for t in kept[h]] for h in range(heads)])[None]
        old_before = state.get(OLD, 0)
        keep = policy.select_decode(scoring_for(scores), budget, state) if n > budget else None
        if keep is not None:
            expected = []
            for h in range(heads):
                tokens, count = reference_eviction(
                    kept[h], score[h], layout.sink, layout.window, old_before, policy.config.stride, layout.threshold
                )
                expected.append(tokens)
                assert count == state[OLD]
            assert positions[keep].view(heads, -1).tolist() == expected
            kept = expected
            olds.append(state[OLD])
        lengths.append(len(kept[0]))
    return layout, olds, lengths


# ----------------------------------------------------------------------------------------------
# Budget construction (Theorem 3.1)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stride,ratio", [(3, 10 / 4), (4, 3), (5, 26 / 6), (6, 5), (7, 50 / 8)])
def test_theorem_ratio(stride, ratio):
    assert float(theorem_ratio(stride)) == pytest.approx(ratio)


@pytest.mark.parametrize("budget", [12, 37, 60, 200, 1000])
@pytest.mark.parametrize("stride", [3, 4, 5, 8])
def test_peak_layout_fills_the_budget_with_theorem_ratio(budget, stride):
    layout = layout_for_budget(budget, 4, stride, "peak")
    ratio = float(theorem_ratio(stride))
    assert layout.sink + layout.window + layout.threshold == budget == layout.peak
    assert layout.window >= 1
    # Rounding the window down keeps T/w inside Eq. 13/14's band [r, r + 2s/w).
    assert ratio <= layout.threshold / layout.window < ratio + 2 * stride / layout.window


def test_small_stride():
    assert [small_stride(s) for s in (3, 4, 5, 6, 7)] == [2, 2, 3, 3, 4]


# ----------------------------------------------------------------------------------------------
# Eviction: local maxima, interval sampling, thresholds, recurrence (Eq. 10)
# ----------------------------------------------------------------------------------------------


def test_local_max_picks_segment_argmax():
    # sink 1, stride 3, budget 8: window 2, threshold 5 (T/w = 2.5 = (9 + 1)/(3 + 1)).
    policy = Buzz(sink=1, stride=3, budget_form="peak")
    assert policy.layout(8) == layout_for_budget(8, 1, 3, "peak")
    assert (policy.layout(8).window, policy.layout(8).threshold) == (2, 5)
    # N = 9: sink [0] | new [1..6] (T + 1 = 6 tokens, segments [1,2,3] and [4,5,6]) | window [7, 8].
    scores = torch.tensor(
        [[[9.0, 0.1, 0.7, 0.3, 0.2, 0.1, 0.9, 0.0, 0.0], [0.0, 0.8, 0.1, 0.2, 0.3, 0.6, 0.5, 0.0, 0.0]]]
    )
    state = {}
    keep = policy.select_decode(scoring_for(scores), 8, state)
    assert keep[0, 0].nonzero().flatten().tolist() == [0, 2, 6, 7, 8]
    assert keep[0, 1].nonzero().flatten().tolist() == [0, 1, 5, 7, 8]
    assert state[OLD] == 2 and state[EVICTIONS] == 1

    # Second eviction: old samples [1, 2] are interval-sampled with ŝ = 2 (keeps the first),
    # new tokens [3..6] are segments [3, 4, 5] and [6] (the short last one keeps its only token).
    scores = torch.tensor([[[0.0, 5.0, 5.0, 0.1, 0.4, 0.2, 0.3, 0.0, 0.0]]])
    keep = policy.select_decode(scoring_for(scores), 8, state)
    assert keep[0, 0].nonzero().flatten().tolist() == [0, 1, 4, 6, 7, 8]
    assert state[OLD] == 3


def test_local_max_mask_matches_loop_and_prefers_first_on_ties():
    generator = torch.Generator().manual_seed(3)
    scores = torch.randint(0, 4, (2, 3, 23), generator=generator).float()  # many ties
    mask = local_max_mask(scores, 2, 21, 5)
    expected = torch.zeros_like(mask)
    for b in range(2):
        for h in range(3):
            for start in range(2, 21, 5):
                segment = scores[b, h, start : min(start + 5, 21)].tolist()
                expected[b, h, start + segment.index(max(segment))] = True
    assert torch.equal(mask, expected)


def test_nothing_is_evicted_between_thresholds():
    policy = Buzz(sink=2, stride=3, budget_form="peak")
    layout = policy.layout(16)
    state = {OLD: 3}
    for n in range(layout.sink + layout.window, layout.peak + 1):  # old + new <= T
        scores = torch.rand(1, 2, n)
        assert policy.select_decode(scoring_for(scores), 16, state) is None
    # No eviction recorded (the padding, read once, is the only other entry).
    assert state == {OLD: 3, "buzz_layout": layout, PADDING: 0}
    keep = policy.select_decode(scoring_for(torch.rand(1, 2, layout.peak + 1)), 16, state)
    assert keep is not None and state[EVICTIONS] == 1


@pytest.mark.parametrize("stride,budget", [(3, 30), (4, 41), (5, 60), (7, 90)])
def test_evictions_follow_recurrence_eq10_and_algorithms(stride, budget):
    policy = Buzz(sink=4, stride=stride, budget_form="peak")
    layout, olds, lengths = stream(policy, budget, steps=600)
    assert len(olds) >= 8
    # Exact sizes: a_n = ceil(a_{n-1}/ŝ) + ceil((T + 1 - a_{n-1})/s); within 2 of Eq. 10's floors.
    assert olds == old_sample_sizes(layout.threshold, stride, len(olds))
    hat, previous = small_stride(stride), 0
    for size in olds:
        # Eq. 10 with its first term read as floor(a/ŝ) (its bound Eq. 11 uses a/ŝ ~ 2a/(s+1)).
        floors = previous // hat + (layout.threshold - previous) // stride
        assert floors <= size <= floors + 2
        previous = size
    # Never more than the budget; between evictions the cache grows one token per step.
    assert max(lengths) == budget
    for before, after in itertools.pairwise(lengths):
        assert after == before + 1 or (before == budget and after < budget)


@pytest.mark.parametrize("stride", [3, 4, 5, 6, 7])
@pytest.mark.parametrize("budget", [400, 2000])
def test_theorem_ratio_steady_state_old_samples_approach_window(stride, budget):
    policy = Buzz(stride=stride, budget_form="peak")
    layout, olds, _ = stream(policy, budget, steps=budget * 6, heads=1, bulk=True)
    tail = olds[-4:]
    # Theorem 3.1: the limit of a_n is w (up to the floors of Eq. 11-14: a few tokens).
    assert all(abs(size - layout.window) <= 3 for size in tail), (layout, olds)
    # ... and not by accident: with another ratio the limit is far from w.
    wrong = old_sample_sizes(2 * layout.threshold, stride, 30)
    assert abs(wrong[-1] - layout.window) > 0.5 * layout.window


# ----------------------------------------------------------------------------------------------
# Prefill (Remark 2) and left padding
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "stride,length",
    # Stride 5 (window 4, threshold 22): 118 tokens give exactly 22 samples, which fit (no thinning);
    # 119 give 23, one round. Stride 3 (window 7, threshold 19, ŝ = 2): 71 tokens need exactly one round.
    [(5, 40), (5, 118), (5, 119), (5, 200), (5, 900), (3, 71), (3, 300)],
)
def test_prefill_samples_until_it_fits(stride, length):
    """Remark 2: the single pass is thinned with ŝ only while it does not fit (a pass that fits
    exactly is kept whole), and every round really thins (ŝ = 2 included)."""
    policy = Buzz(sink=4, stride=stride, budget_form="peak")
    budget = 30
    layout = policy.layout(budget)
    generator = torch.Generator().manual_seed(length)
    scores = torch.rand(1, 2, length, generator=generator)
    state = {}
    keep = policy.select_prefill(scoring_for(scores, phase=PREFILL), budget, state)
    kept = keep.sum(-1)
    assert (kept == kept.flatten()[0]).all() and int(kept[0, 0]) <= layout.sink + layout.window + layout.threshold
    assert state[OLD] <= layout.threshold and int(kept[0, 0]) == layout.sink + layout.window + state[OLD]
    for h in range(2):
        expected, _ = reference_eviction(
            list(range(length)),
            dict(enumerate(scores[0, h].tolist())),
            layout.sink,
            layout.window,
            0,
            stride,
            layout.threshold,
        )
        assert keep[0, h].nonzero().flatten().tolist() == expected


def test_rows_of_different_lengths_are_refused():
    """A left-padded row alone would follow its own eviction schedule (issue 9 item 5: 21 tokens
    alone vs 29 in the batch); the cache keeps rows at one length, so BUZZ refuses the batch."""
    policy = Buzz(sink=2, stride=3, budget_form="peak")
    n, pad = 30, 7
    valid = torch.ones(2, n, dtype=torch.bool)
    valid[1, :pad] = False
    scores = torch.rand(2, 2, n, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="different numbers of real tokens"):
        policy.select_prefill(scoring_for(scores, valid, PREFILL), 16, {})


def test_common_left_padding_gives_each_row_its_solo_selection():
    """Rows padded alike: the layout counts real tokens only, so each row keeps what it keeps alone."""
    policy = Buzz(sink=2, stride=3, budget_form="peak")
    n, pad = 30, 7
    valid = torch.ones(2, n, dtype=torch.bool)
    valid[:, :pad] = False
    scores = torch.rand(2, 2, n, generator=torch.Generator().manual_seed(0))
    keep = policy.select_prefill(scoring_for(scores, valid, PREFILL), 16, {})
    for row in range(2):
        alone = policy.select_prefill(scoring_for(scores[row : row + 1, :, pad:], phase=PREFILL), 16, {})
        assert torch.equal(keep[row : row + 1, :, pad:], alone)
        assert not keep[row, :, :pad].any()


# ----------------------------------------------------------------------------------------------
# With a model
# ----------------------------------------------------------------------------------------------


def compressed_layers(cache):
    return cache.compressed_layers


@torch.no_grad()
def run_and_watch(model, cache, input_ids, attention_mask, steps):
    """Prefill + ``steps`` greedy steps; after each forward, per compressed layer: lengths, old
    samples, eviction count. Returns (logits [steps+1, B, V], records)."""
    records = []

    def record():
        records.append(
            {
                i: (
                    cache.layers[i].lengths.clone(),
                    # Read now: a layer in a fixed decode capacity keeps them as device counters updated in place.
                    int(cache.layers[i].policy_state.get(OLD, 0)),
                    int(cache.layers[i].policy_state.get(EVICTIONS, 0)),
                )
                for i in compressed_layers(cache)
            }
        )

    logits = []
    output = model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
    logits.append(output.logits[:, -1])
    record()
    mask = attention_mask
    for _ in range(steps):
        token = output.logits[:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        output = model(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True)
        logits.append(output.logits[:, -1])
        record()
    return torch.stack(logits), records


def check_decode_records(records, layout, stride):
    """Lengths never pass the budget, grow by one between evictions, and old samples follow Eq. 10."""
    budget = layout.peak
    for layer in records[0]:
        olds = [records[0][layer][1]]
        for previous, current in itertools.pairwise(records):
            before, after = int(previous[layer][0].flatten()[0]), int(current[layer][0].flatten()[0])
            assert (current[layer][0] == after).all()  # uniform over batch and heads
            assert after <= budget
            evicted = current[layer][2] - previous[layer][2]
            if before + 1 <= budget:
                assert evicted == 0 and after == before + 1  # nothing evicted between thresholds
            else:
                assert evicted == 1 and after == layout.sink + layout.window + current[layer][1]
                olds.append(current[layer][1])
        assert olds[1:] == old_sample_sizes(layout.threshold, stride, len(olds) - 1, start=olds[0])
        assert len(olds) >= 3  # several decode evictions happened


@pytest.mark.parametrize("architecture,attention", ALL_TINY)
def test_full_budget_matches_plain_transformers(architecture, attention):
    model = tiny_model(architecture, attention)
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size)
    expected = reference_logits(model, input_ids, attention_mask, steps=20)
    cache = make_cache(model, "buzz", budget=input_ids.shape[1] + 21)
    actual = prefill_and_decode(model, cache, input_ids, attention_mask, steps=20)
    assert (actual - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("architecture,attention", ALL_TINY)
@pytest.mark.parametrize("method", ["buzz", "buzz-logn"])
def test_prefill_and_50_decode_steps_small_budget(architecture, attention, method):
    model = tiny_model(architecture, attention)
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=40, pad=0)
    budget = 20
    cache = make_cache(model, method, budget=budget, stride=3)
    layout = cache.policy.layout(budget)
    logits, records = run_and_watch(model, cache, input_ids, attention_mask, steps=50)
    assert torch.isfinite(logits).all()
    assert all(records[0][layer][2] == 1 for layer in records[0])  # the 40-token prompt was cut
    check_decode_records(records, layout, 3)
    for layer in compressed_layers(cache):
        positions = cache.layers[layer].dense()[2]
        assert (positions[:, :, :4] == torch.arange(4)).all()  # every row keeps its sinks
        assert (positions[:, :, -layout.window :] == torch.arange(90 - layout.window, 90)).all()
    # Each row of the batch gets exactly what it gets alone (issue 9 item 5).
    for row in range(2):
        alone = make_cache(model, method, budget=budget, stride=3)
        alone_logits, _ = run_and_watch(model, alone, input_ids[row : row + 1], attention_mask[row : row + 1], steps=50)
        torch.testing.assert_close(alone_logits[:, 0], logits[:, row], atol=1e-4, rtol=1e-4)
        for layer in compressed_layers(cache):
            assert torch.equal(alone.layers[layer].dense()[2][0], cache.layers[layer].dense()[2][row])


def test_left_padded_batch_is_refused_by_the_cache():
    model = tiny_model("llama", "gqa")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=40, pad=9)
    cache = make_cache(model, "buzz", budget=20, stride=3)
    with pytest.raises(ValueError, match="one at a time"):
        prefill_and_decode(model, cache, input_ids, attention_mask, steps=2)


def test_embedded_model_small_budget_50_steps():
    model, tokenizer = load_model()
    inputs = tokenizer(["The history of the bee hive begins with a small colony of workers that"], return_tensors="pt")
    budget = 16
    cache = make_cache(model, "buzz", budget=budget)
    layout = cache.policy.layout(budget)
    logits, records = run_and_watch(model, cache, inputs["input_ids"], inputs["attention_mask"], steps=50)
    assert torch.isfinite(logits).all()
    assert len(records[0]) == sum(not layer.is_sliding for layer in cache.layers) > 0
    check_decode_records(records, layout, cache.policy.config.stride)
    total = inputs["input_ids"].shape[1] + 50
    for layer in compressed_layers(cache):
        positions = cache.layers[layer].dense()[2]
        assert (positions[..., :4] == torch.arange(4)).all()
        assert (positions[..., -layout.window :] == torch.arange(total - layout.window, total)).all()


# ----------------------------------------------------------------------------------------------
# log n
# ----------------------------------------------------------------------------------------------


def test_logn_scale_values():
    counts = torch.tensor([[1, 8, 64, 512, 4096, 1000]])
    expected = torch.tensor([[0.0, 1 / 3, 2 / 3, 1.0, 4 / 3, math.log(1000, 512)]])
    attended = BuzzLogN(log_count="attended")
    torch.testing.assert_close(attended.logit_scale(counts), expected, rtol=0, atol=1e-6)
    # The authors' line: one n per batch row, the keys in the call (the row's largest count).
    key_length = BuzzLogN().logit_scale(torch.tensor([[1, 2, 8], [1, 1, 64]]))
    torch.testing.assert_close(key_length, torch.tensor([[1 / 3] * 3, [2 / 3] * 3]), rtol=0, atol=1e-6)
    assert Buzz().logit_scale(counts) is None
    assert float(BuzzLogN(log_base=64).logit_scale(torch.tensor([64]))[0]) == pytest.approx(1.0)


# n of the reference attention: "authors-line" = key_states.shape[2] (modify_llama_forward.py,
# batch of one, no padding); "key-length" / "attended" from the 4-D mask transformers built
# (the keys each query row may see): the row's largest count / each query row's own count.
_REFERENCE = {"count": "authors-line"}
_CAPTURED: dict[int, torch.Tensor] = {}


def logn_reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention on the full cache with logits times log_512(n), in every layer."""
    batch, kv_heads, length, head_dim = key.shape
    group = query.shape[1] // kv_heads
    num_queries = query.shape[2]
    allowed = attention_mask[:, 0, :, :length]
    seen = allowed.sum(-1).double()  # [B, q]
    if _REFERENCE["count"] == "authors-line":
        counts = torch.full((batch, num_queries), float(length), dtype=torch.float64)
    elif _REFERENCE["count"] == "key-length":
        counts = seen.amax(-1, keepdim=True).expand(batch, num_queries)
    else:
        counts = seen
    factor = math.log(512) ** -1 * torch.log(counts.clamp_min(1))
    keys = key.repeat_interleave(group, dim=1)
    values = value.repeat_interleave(group, dim=1)
    logits = torch.matmul(query, keys.transpose(-1, -2)) * scaling * factor.float()[:, None, :, None]
    logits = logits.masked_fill(~allowed[:, None], float("-inf"))
    weights = torch.nan_to_num(torch.softmax(logits, dim=-1), nan=0.0)
    summed = weights.sum(dim=2).reshape(batch, kv_heads, group, length).sum(dim=2)
    previous = _CAPTURED.get(module.layer_idx)
    if previous is not None:
        summed[..., : previous.shape[-1]] += previous
    if not getattr(module, "is_sliding", False):  # a sliding layer's cache drops tokens: no running sum
        _CAPTURED[module.layer_idx] = summed
    return torch.matmul(weights, values).transpose(1, 2).contiguous(), None


def reference_mask(*args, **kwargs):
    kwargs["allow_is_causal_skip"] = False
    kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(*args, **kwargs)


def logn_reference_run(model, input_ids, attention_mask, steps, count):
    AttentionInterface.register("buzz-logn-reference", logn_reference_attention)
    AttentionMaskInterface.register("buzz-logn-reference", reference_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation("buzz-logn-reference")
    _CAPTURED.clear()
    _REFERENCE["count"] = count
    try:
        expected = prefill_and_decode(model, DynamicCache(config=model.config), input_ids, attention_mask, steps)
    finally:
        model.set_attn_implementation(previous)
    return expected, dict(_CAPTURED)


@pytest.mark.parametrize("architecture,attention", [("llama", "mha"), ("qwen3", "gqa")])
def test_logn_matches_the_authors_line_in_every_layer(architecture, attention):
    """n = key_states.shape[2], as the authors' modify_llama_forward.py computes it (batch of one)."""
    model = tiny_model(architecture, attention)
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, pad=0)
    input_ids, attention_mask = input_ids[:1], attention_mask[:1]
    steps = 20
    plain = reference_logits(model, input_ids, attention_mask, steps=steps)
    expected, captured = logn_reference_run(model, input_ids, attention_mask, steps, "authors-line")
    cache = make_cache(model, "buzz-logn", budget=input_ids.shape[1] + steps + 1)
    actual = prefill_and_decode(model, cache, input_ids, attention_mask, steps)
    assert (actual - expected).abs().max().item() <= 1e-5
    assert (actual - plain).abs().max().item() > 1e-3  # the factor really changes the model (100x the tolerance)
    # The running accumulated attention is the model's own (scaled) attention, prefill included.
    for layer, summed in captured.items():
        stored = cache.layers[layer].dense()[3][SCORE]
        torch.testing.assert_close(stored, summed, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("count", ["key-length", "attended"])
def test_logn_scales_uncompressed_sliding_layers_too(count):
    """Gemma-3: 3 of 4 tiny layers slide and are not compressed; log n scales them as well (the
    authors patch every attention module). The prompt is longer than the sliding window."""
    model = tiny_model("gemma3", "gqa")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=40, pad=0)
    steps = 12
    expected, _ = logn_reference_run(model, input_ids, attention_mask, steps, count)
    cache = make_cache(model, "buzz-logn", budget=input_ids.shape[1] + steps + 1, log_count=count)
    assert len(cache.compressed_layers) < len(cache.layers)
    actual = prefill_and_decode(model, cache, input_ids, attention_mask, steps)
    assert (actual - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("architecture,attention", [("llama", "gqa"), ("gemma3", "gqa")])
def test_logn_padding_is_not_counted_in_n(architecture, attention):
    """A left-padded row gets the factor it gets alone (issue 9 item 5)."""
    model = tiny_model(architecture, attention)
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=24, pad=7)
    steps = 10
    cache = make_cache(model, "buzz-logn", budget=input_ids.shape[1] + steps + 1)
    batch = prefill_and_decode(model, cache, input_ids, attention_mask, steps)
    tokens = batch[:-1].argmax(-1)[:, :, None]  # the batch's greedy tokens, [steps, B, 1]
    for row, pad in ((0, 0), (1, 7)):
        alone = make_cache(model, "buzz-logn", budget=input_ids.shape[1] + steps + 1)
        solo = prefill_and_decode(
            model,
            alone,
            input_ids[row : row + 1, pad:],
            attention_mask[row : row + 1, pad:],
            steps,
            forced_tokens=tokens[:, row : row + 1],
        )
        assert (solo[:, 0] - batch[:, row]).abs().max().item() <= 1e-4


# ----------------------------------------------------------------------------------------------
# Parameters
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "parameters,name",
    [
        ({"stride": 0}, "stride"),
        ({"stride": 1}, "stride"),
        ({"stride": 2}, "stride"),
        ({"stride": 2.5}, "stride"),
        ({"sink": -1}, "sink"),
        ({"sink": "4"}, "sink"),
        ({"window": 8}, "window"),
        ({"budget_form": "average"}, "budget_form"),
        ({"prefill_fit": "literal"}, "prefill_fit"),
        ({"prefill_fit": None}, "prefill_fit"),
    ],
)
@pytest.mark.parametrize("method", ["buzz", "buzz-logn"])
def test_invalid_parameters_raise(method, parameters, name):
    with pytest.raises(ValueError, match=name):
        make_policy(method, **parameters)


def test_invalid_log_base_raises():
    with pytest.raises(ValueError, match="log_base"):
        BuzzLogN(log_base=1)


@pytest.mark.parametrize(
    "sink,stride,form,smallest",
    [
        (4, 5, "peak", 10),
        (0, 3, "peak", 4),
        (4, 4, "peak", 8),
        (1, 7, "peak", 9),
        (4, 5, "mean", 9),
        (0, 3, "mean", 4),
        (4, 4, "mean", 8),
        (1, 7, "mean", 7),
    ],
)
def test_budget_smaller_than_sink_plus_window_plus_threshold_raises(sink, stride, form, smallest):
    policy = Buzz(sink=sink, stride=stride, budget_form=form)
    assert policy.minimum_budget() == smallest
    assert policy.layout(smallest).window == 1
    for budget in (smallest - 1, sink, 1):
        with pytest.raises(ValueError, match="budget"):
            policy.layout(budget)


def test_cache_rejects_too_small_budget():
    model = tiny_model("llama", "gqa")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, pad=0)
    with pytest.raises(ValueError, match="budget"):
        cache = make_cache(model, "buzz", budget=8)
        prefill_and_decode(model, cache, input_ids, attention_mask, steps=0)


# ----------------------------------------------------------------------------------------------
# The budget as the mean size held (issue 10 item 1)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [20, 37, 60, 200, 1000, 4000])
@pytest.mark.parametrize("stride", [3, 4, 5, 7])
def test_mean_layout_holds_the_budget_on_average(budget, stride):
    layout = layout_for_budget(budget, 4, stride)  # the default form
    mean = layout.steady_mean
    assert budget - 1 <= mean <= budget, (layout, float(mean))
    assert layout.peak > budget  # the peak form would hold ~70% of the budget on average
    ratio = float(theorem_ratio(stride))
    assert ratio <= layout.threshold / layout.window < ratio + 2 * stride / layout.window
    peak = layout_for_budget(budget, 4, stride, "peak")
    assert peak.peak == budget and peak.steady_mean < (0.85 * budget if budget >= 60 else budget)


@pytest.mark.parametrize("stride,budget", [(3, 30), (5, 60), (4, 100)])
def test_mean_form_stream_holds_the_budget_on_average_and_the_peak_at_most(stride, budget):
    """Token by token, as the cache calls it: the measured mean size over the steady state is
    the budget (within a token), the largest size k + w + T, and after every eviction at most
    the budget (the cache's hard limit)."""
    policy = Buzz(stride=stride)
    layout = policy.layout(budget)
    _, olds, lengths = stream(policy, budget, steps=40 * budget, heads=1)
    steady = lengths[len(lengths) // 2 :]
    assert abs(sum(steady) / len(steady) - budget) <= 1.0
    assert max(lengths) == layout.peak > budget
    for before, after in itertools.pairwise(lengths):
        assert after == before + 1 or (before == layout.peak and after <= budget)


def _mean_layout_by_brute_force(budget: int, sink: int, stride: int) -> BuzzLayout | None:
    """Every window from 1 to the budget (not only those next to Eq. 13/14's centre), thresholds in
    the paper's range ``ceil(r w) .. ceil(r w) + s``: the layout of largest exact steady mean <= C
    that never exceeds C after an eviction, ties to ``T/w`` nearest ``r``."""
    ratio = theorem_ratio(stride)
    best, best_key = None, None
    for window in range(1, budget - sink + 1):
        lowest = math.ceil(ratio * window)
        for threshold in range(lowest, lowest + stride + 1):
            layout = BuzzLayout(sink=sink, window=window, threshold=threshold, stride=stride)
            mean, largest = steady_state_sizes(layout)
            room = budget - sink - window
            if mean > budget or largest > room or max(old_sample_sizes(threshold, stride, 4, start=room)) > room:
                continue
            key = (mean, -abs(Fraction(threshold, window) - ratio))
            if best_key is None or key > best_key:
                best, best_key = layout, key
    return best


@pytest.mark.parametrize("stride", [3, 4, 5])
def test_mean_layout_is_the_best_layout_over_every_window(stride):
    # The search looks at five windows around 2(C - k)/(3 + r) only; over all windows nothing does better.
    for budget in range(4, 90):
        assert mean_layout(budget, 4, stride) == _mean_layout_by_brute_force(budget, 4, stride), budget


def test_statistics_report_the_mean_and_peak_sizes_held():
    model = tiny_model("llama", "gqa")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=40, pad=0)
    input_ids, attention_mask = input_ids[:1], attention_mask[:1]
    steps = 150
    for form in ("mean", "peak"):
        budget = 24
        cache = make_cache(model, "buzz", budget=budget, stride=3, budget_form=form)
        sizes = []
        output = model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
        sizes.append(cache.mean_kept_per_head())
        for _ in range(steps):
            token = output.logits[:, -1].argmax(-1, keepdim=True)
            output = model(input_ids=token, past_key_values=cache, use_cache=True)
            sizes.append(cache.mean_kept_per_head())
        stats = kept_size_statistics(cache)
        layout = cache.policy.layout(budget)
        assert stats["mean_kept"] == pytest.approx(sum(sizes) / len(sizes))
        assert stats["peak_kept"] == max(sizes) == layout.peak
        layer = stats["per_layer"][cache.compressed_layers[0]]
        assert layer["steps"] == steps + 1 and layer["steady_peak_kept"] == layout.peak
        # Every recorded field (results carry them): the layout that ran and its exact steady mean.
        assert (layer["sink"], layer["window"], layer["threshold"]) == (layout.sink, layout.window, layout.threshold)
        assert layer["steady_mean_kept"] == float(layout.steady_mean)
        assert layer["prefill_rounds"] == 0  # no Remark 2 thinning beyond the single pass: 40 tokens fit
        assert layer["mean_kept"] == pytest.approx(sum(sizes) / len(sizes)) and layer["peak_kept"] == layout.peak
        assert set(stats["per_layer"]) == set(cache.compressed_layers)
        if form == "peak":
            assert layout.peak == budget and stats["mean_kept"] < 0.85 * budget
        else:
            assert abs(stats["mean_kept"] - budget) <= 1.5 and layout.peak > budget


def test_full_budget_in_the_mean_form_calls_the_policy_and_matches_plain_transformers():
    """Between the budget and BUZZ's threshold the cache asks for evictions at every step and
    BUZZ keeps everything: outputs equal plain transformers while select_decode really runs."""
    model = tiny_model("llama", "gqa")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=30, pad=0)
    steps = 5
    budget = 26
    cache = make_cache(model, "buzz", budget=budget, stride=5)
    assert cache.policy.layout(budget).peak >= 30 + steps  # never reaches the threshold
    calls = []
    original = cache.policy.select_decode
    cache.policy.select_decode = lambda *args: calls.append(1) or original(*args)
    expected = reference_logits(model, input_ids, attention_mask, steps=steps)
    actual = prefill_and_decode(model, cache, input_ids, attention_mask, steps=steps)
    assert len(calls) == steps * len(cache.compressed_layers)
    assert (actual - expected).abs().max().item() <= 1e-5


# ----------------------------------------------------------------------------------------------
# Statistics and error reports (mutation testing, issue 10)
# ----------------------------------------------------------------------------------------------


def test_statistics_of_a_cache_before_any_forward_are_zero():
    """kept_size_statistics reports exactly zero sizes and no layers before BUZZ ran (the keys
    every result record carries)."""
    model = tiny_model("llama", "gqa")
    cache = make_cache(model, "buzz", budget=24, stride=3)
    assert kept_size_statistics(cache) == {"mean_kept": 0.0, "peak_kept": 0, "per_layer": {}}


def test_statistics_count_the_remark_2_prefill_rounds():
    """``prefill_rounds`` counts Remark 2's extra interval rounds beyond the authors' single pass:
    a 120-token prompt at budget 24 needs two (the samples shrink by ŝ = 2 per round until they fit);
    a prompt that never reached the threshold was not sampled at all: 0 rounds."""
    model = tiny_model("llama", "gqa")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=120, pad=0)
    for length, rounds in ((120, 2), (10, 0)):
        cache = make_cache(model, "buzz", budget=24, stride=3)
        prefill_and_decode(model, cache, input_ids[:1, :length], attention_mask[:1, :length], steps=2)
        per_layer = kept_size_statistics(cache)["per_layer"]
        assert set(per_layer) == set(cache.compressed_layers)
        assert [per_layer[layer]["prefill_rounds"] for layer in cache.compressed_layers] == [rounds] * len(per_layer)


@pytest.mark.parametrize("form,smallest", [("peak", 10), ("mean", 9)])
def test_too_small_budget_error_names_the_budget_its_form_and_the_smallest_budget(form, smallest):
    """The ValueError says which budget was refused, under which reading, and the smallest one that fits."""
    with pytest.raises(ValueError, match=rf"budget={smallest - 1} .*budget_form='{form}'.*>= {smallest} "):
        layout_for_budget(smallest - 1, 4, 5, form)


@pytest.mark.parametrize("start,stop", [(3, 4), (3, 3), (5, 2)])
def test_local_max_mask_keeps_a_one_token_segment_and_nothing_from_an_empty_region(start, stop):
    """Algorithm 2: a single new token is its own (short) segment, so it is its local maximum and
    is kept; an empty region keeps nothing."""
    scores = torch.rand(1, 2, 9, generator=torch.Generator().manual_seed(1))
    mask = local_max_mask(scores, start, stop, 5)
    expected = torch.zeros(1, 2, 9, dtype=torch.bool)
    expected[..., start:stop] = True
    assert torch.equal(mask, expected)


def test_steady_mean_is_the_exact_mean_size_over_whole_eviction_cycles():
    """Sec. 3.3 / Eq. 10: after an eviction leaving a old samples a layer holds k + w + a tokens and
    grows by one per step to k + w + T; the steady-state mean (the budget in the mean form) is the
    exact mean of the sizes held over whole cycles, here k + w + (a* + T)/2 = 19 + (16 + 65)/2."""
    policy = Buzz(stride=5)
    layout, olds, lengths = stream(policy, 60, steps=1500, heads=1)
    assert (layout.sink, layout.window, layout.threshold) == (4, 15, 65) and olds[-1] == 16
    drops = [i for i in range(1, len(lengths)) if lengths[i] < lengths[i - 1]]
    cycles = lengths[drops[5] : drops[-1]]  # whole cycles, each from k + w + a* up to the peak
    assert Fraction(sum(cycles), len(cycles)) == layout.steady_mean == Fraction(119, 2)


def _random_scoring(phase: str, n: int, queries: int, seed: int = 0) -> ScoringInputs:
    """Causal attention inputs with random queries and keys (2 KV heads, groups of 2), no token scores."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, 2, n, 4, generator=generator)
    return ScoringInputs(
        keys=keys,
        values=keys.clone(),
        queries=torch.randn(1, 4, queries, 4, generator=generator),
        positions=torch.arange(n).expand(1, 2, n),
        mask=torch.ones(n, n, dtype=torch.bool).tril()[-queries:].expand(1, 1, queries, n),
        scaling=0.5,
        layer_index=0,
        num_layers=1,
        sequence_length=n,
        phase=phase,
    )


@pytest.mark.parametrize("phase,queries", [(PREFILL, 40), (DECODE, 1)])
def test_selection_without_stored_scores_uses_the_accumulated_attention_of_its_inputs(phase, queries):
    """The policy API alone (no cache): without stored scores BUZZ seeds them from the attention of
    the queries it is given (H2O's accumulated attention summed over each KV group) and selects
    exactly as with those scores stored."""
    policy = Buzz(sink=2, stride=3, budget_form="peak")
    bare = _random_scoring(phase, 40, queries)
    seeded = _random_scoring(phase, 40, queries)
    seeded.token_scores[SCORE] = seeded.accumulated_attention().reshape(1, 2, 2, 40).sum(dim=2)
    keep = policy._evict(bare, 16, {})
    assert keep is not None and keep.dtype == torch.bool
    assert torch.equal(keep, policy._evict(seeded, 16, {}))
    torch.testing.assert_close(bare.token_scores[SCORE], seeded.token_scores[SCORE])


def test_statistics_count_real_tokens_only_in_a_left_padded_row():
    """Sizes held are real tokens per head (issue 9 item 5): a left-padded row reports exactly the
    statistics it reports without its padding."""
    model = tiny_model("llama", "gqa")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=40, pad=7)
    stats = []
    for ids, mask in ((input_ids[1:], attention_mask[1:]), (input_ids[1:, 7:], attention_mask[1:, 7:])):
        cache = make_cache(model, "buzz", budget=20, stride=3)
        prefill_and_decode(model, cache, ids, mask, steps=30)
        stats.append(kept_size_statistics(cache))
    assert stats[0] == stats[1] and stats[0]["peak_kept"] > 0


def test_a_single_kv_head_records_its_sizes():
    """Multi-query attention (one KV head, e.g. Gemma-3 1B): BUZZ runs and counts the tokens of its only head."""
    policy = Buzz(sink=2, stride=3, budget_form="peak")
    scores = torch.rand(1, 1, 30, generator=torch.Generator().manual_seed(0))
    inputs = scoring_for(scores, phase=PREFILL)
    state = {}
    policy.initialize_decode(inputs, state)
    keep = policy.select_prefill(inputs, 16, state)
    assert keep.shape == (1, 1, 30)
    stats = size_statistics(state)
    assert stats["steps"] == 1 and stats["mean_kept"] == stats["peak_kept"] == int(keep.sum())


@pytest.mark.parametrize("count", ["key-length", "attended"])
def test_logn_factor_is_log_512_of_n_rounded_once_to_float32(count):
    """Eq. 7's factor log_512(n) is computed in float64 and rounded once (the reference attention
    above does the same): exact for integer key counts of every size, not a float32 logarithm."""
    counts = torch.arange(1, 5001)[:, None]  # one query row per count
    expected = torch.tensor([[math.log(n, 512)] for n in range(1, 5001)], dtype=torch.float64).float()
    assert torch.equal(BuzzLogN(log_count=count).logit_scale(counts), expected)


# ----------------------------------------------------------------------------------------------
# Every search over a parameter is bounded (issue 27 item 9)
# ----------------------------------------------------------------------------------------------


def _linear_minimum(sink: int, stride: int) -> int:
    """The smallest mean-form budget by definition: every budget from sink + 2 upwards."""
    budget = sink + 2
    while mean_layout(budget, sink, stride) is None:
        budget += 1
    return budget


@pytest.mark.parametrize("stride", [3, 4, 5, 6, 7, 9, 12, 17, 24, 33])
@pytest.mark.parametrize("sink", [0, 4])
def test_minimum_budget_equals_the_search_from_the_smallest_budget(stride, sink):
    # The search starts at a lower bound on any layout's mean; it must find what a search from
    # sink + 2 finds (the bound is never above the answer).
    assert buzz_module.minimum_buzz_budget(sink, stride) == _linear_minimum(sink, stride)


@pytest.mark.parametrize("threshold", [3, 4, 7, 30, 65, 257, 1000])
@pytest.mark.parametrize("stride", [3, 4, 5, 8, 33, 1024])
def test_steady_state_reads_the_cycle_of_the_exact_recurrence(threshold, stride):
    # Read off the cycle, the tail is the one of the 200 evictions iterated one by one.
    sizes = old_sample_sizes(threshold, stride, 200)[-24:]
    layout = BuzzLayout(sink=4, window=3, threshold=threshold, stride=stride)
    mean, largest = steady_state_sizes(layout)
    steps = sum(threshold - a + 1 for a in sizes)
    held = sum((threshold - a + 1) * (2 * 7 + a + threshold) for a in sizes)
    assert (mean, largest) == (Fraction(held, 2 * steps), max(sizes))


def test_minimum_budget_at_a_large_stride_takes_a_few_layout_searches(monkeypatch):
    """make_cache(m, "buzz", budget=64, stride=1000) ran for minutes: the smallest budget was found
    by trying every budget from sink + 2 (about 500 layout searches of 5,000 candidates each).
    Counted, not timed: a few searches near the answer; the count stops a linear search early."""
    calls = []
    searched = buzz_layout.mean_layout

    def counted(budget, sink, stride):
        calls.append(budget)
        if len(calls) > 20:
            raise AssertionError(f"minimum_buzz_budget searched {len(calls)} budgets: {calls[:5]}...")
        return searched(budget, sink, stride)

    monkeypatch.setattr(buzz_layout, "mean_layout", counted)
    for cached in ("minimum_buzz_budget", "_minimum_mean_budget_without_sink"):
        if hasattr(getattr(buzz_layout, cached, None), "cache_clear"):
            getattr(buzz_layout, cached).cache_clear()
    policy = Buzz(sink=5, stride=1000)
    assert policy.minimum_budget() >= 500
    assert len(calls) <= 5


def test_a_budget_below_a_large_stride_s_minimum_is_refused_naming_the_minimum():
    model = tiny_model("llama", "gqa")
    minimum = buzz_module.minimum_buzz_budget(4, 1000)
    with pytest.raises(ValueError, match=rf"budget=64 .*at least {minimum} tokens per head.*stride=1000"):
        make_cache(model, "buzz", budget=64, stride=1000)


def test_stride_above_the_largest_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"invalid stride=1025: expected an integer in \[3, 1024\]"):
        Buzz(stride=1025)


def test_mean_form_prefill_thins_to_the_budget_not_to_the_peak():
    # Remark 2 in the mean form (issue 26 item 3): budget C = 100 gives the layout (k, w, T) =
    # (4, 26, 113), peak 143. A 450-token prompt's single sampling pass keeps 4 + ceil(420/5) + 26
    # = 114 tokens: within the paper's literal limit T + k + w = 143, but above C. kvhive thins the
    # old samples once more with ŝ = 3 (ceil(84/3) = 28), so the layer holds 4 + 28 + 26 = 58 <= C;
    # the literal reading would keep 114 and is pinned out here.
    policy = make_policy("buzz")
    layout = policy.layout(100)
    assert (layout.sink, layout.window, layout.threshold) == (4, 26, 113)
    n = 450
    scores = torch.rand(1, 1, n, generator=torch.Generator().manual_seed(0))
    state: dict = {}
    keep = policy.select_prefill(scoring_for(scores, phase=PREFILL), 100, state)
    assert int(keep.sum()) == 4 + 28 + 26
    assert state[PREFILL_ROUNDS] == 1
    assert keep[..., :4].all() and keep[..., -26:].all()


def test_prefill_fit_refusal_names_the_parameter_and_both_readings():
    with pytest.raises(
        ValueError, match=r"invalid prefill_fit='T\+k\+w': expected 'budget' .* or 'peak' .*T \+ k \+ w"
    ):
        Buzz(prefill_fit="T+k+w")


@pytest.mark.parametrize("n,kept_budget,kept_peak", [(450, 4 + 28 + 26, 4 + 84 + 26), (900, 4 + 58 + 26, 4 + 58 + 26)])
def test_mean_form_literal_prefill_fit_thins_to_the_peak_not_to_the_budget(n, kept_budget, kept_peak):
    # Remark 2's literal reading (issue 26): prefill_fit="peak" thins the single pass only until the
    # samples fit the container T + k + w (143 at C = 100, layout (4, 26, 113)). A 450-token prompt
    # keeps the single pass's 84 samples (114 tokens, over C = 100; the default thins them to 28,
    # 58 tokens). A 900-token prompt's pass (174 samples) exceeds T = 113 too: one round of ŝ = 3
    # gives 58 samples under both readings (58 <= 70 = C - k - w), so they agree there.
    scores = torch.rand(1, 1, n, generator=torch.Generator().manual_seed(n))
    kept = {}
    for fit in ("budget", "peak"):
        policy = make_policy("buzz", prefill_fit=fit)
        assert policy.prefill_limit(100) == (100 if fit == "budget" else 143)
        state: dict = {}
        keep = policy.select_prefill(scoring_for(scores, phase=PREFILL), 100, state)
        kept[fit] = keep
        assert int(keep.sum()) == (kept_budget if fit == "budget" else kept_peak)
        assert policy.kept_per_row(PREFILL, n, 100, {PADDING: 0}) == int(keep.sum())
        assert keep[..., :4].all() and keep[..., -26:].all()
    # The budget reading's samples are every 3rd of the literal reading's (one more round of ŝ).
    samples = {fit: keep[0, 0, 4:-26].nonzero().flatten().tolist() for fit, keep in kept.items()}
    assert samples["budget"] == (samples["peak"][::3] if n == 450 else samples["peak"])


@pytest.mark.parametrize("budget", [30, 60])
def test_peak_form_prefill_fit_changes_nothing(budget):
    """In the peak form C = k + w + T: the two readings of Remark 2 are the same limit."""
    scores = torch.rand(1, 2, 400, generator=torch.Generator().manual_seed(budget))
    keeps = []
    for fit in ("budget", "peak"):
        policy = Buzz(budget_form="peak", prefill_fit=fit)
        assert policy.prefill_limit(budget) == budget
        keeps.append(policy.select_prefill(scoring_for(scores, phase=PREFILL), budget, {}))
    assert torch.equal(keeps[0], keeps[1])


def test_cache_holds_the_literal_prefill_over_the_budget_then_decodes_within_it():
    """A cache with prefill_fit="peak" accepts a prefill over its budget (up to k + w + T) and its
    decode evictions keep the budget again. Mean form, C = 30: layout (4, 6, 31); a 150-token
    prompt's single pass keeps 28 samples (38 tokens > 30; the default keeps ceil(28/3) = 10, 20
    tokens); the next eviction comes when old + new reaches T + 1 = 32, four steps later, and keeps
    ceil(28/3) + ceil(4/5) = 11 samples (21 tokens)."""
    model = tiny_model("llama", "gqa")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=150, pad=0)
    ids, mask = input_ids[:1], attention_mask[:1]
    held = {}
    for fit in ("budget", "peak"):
        cache = make_cache(model, "buzz", budget=30, prefill_fit=fit)
        sizes = []
        for steps in range(0, 6):
            if steps == 0:
                prefill_and_decode(model, cache, ids, mask, steps=0)
            else:
                token = torch.tensor([[7]])
                mask = torch.ones(1, 150 + steps, dtype=attention_mask.dtype)
                model(input_ids=token, attention_mask=mask, **{kvhive_cache_kwarg(model): cache}, use_cache=True)
            sizes.append({int(cache.layers[i].lengths_host.max()) for i in cache.compressed_layers})
        held[fit] = [next(iter(s)) for s in sizes]
        assert all(len(s) == 1 for s in sizes)
    assert held["budget"] == [20, 21, 22, 23, 24, 25]
    assert held["peak"] == [38, 39, 40, 41, 21, 22]
