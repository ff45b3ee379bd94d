"""Scoring attention in half precision (issue 25 item 1, issue 27 item 5).

``ScoringInputs.attention_weights`` (and BUZZ's prefill column sums) compute the logits in the
model's dtype with fp32 accumulation, except float16, whose logits overflow past 65504: there
the product runs in float32, as the model's own sdpa keeps it finite. A tiny float16 Llama
whose q/k projections are scaled x800 makes q.k far larger than 65504: stock transformers'
logits stay finite, so the prefill scores of the accumulated-attention methods must too (the
float16 product gave inf logits and NaN scores, and BumbleBee's greedy failed on them).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvhive
from kvhive.methods.base import PREFILL, ScoringInputs
from kvhive.models import tiny_model

SCALE = 800.0


@pytest.fixture(scope="module")
def loud_model():
    model = tiny_model("llama", "gqa", dtype=torch.float16)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(SCALE)
            layer.self_attn.k_proj.weight.mul_(SCALE)
    return model


def prompt(model) -> torch.Tensor:
    return torch.randint(3, model.config.vocab_size, (1, 96), generator=torch.Generator().manual_seed(0))


def test_the_scaled_model_overflows_float16_logits_but_stock_stays_finite(loud_model):
    """The premise: stock transformers (sdpa) is finite while a float16 q.k product is not."""
    loud_model.set_attn_implementation("sdpa")
    with torch.no_grad():
        stock = loud_model(input_ids=prompt(loud_model), past_key_values=DynamicCache(config=loud_model.config))
    assert stock.logits.isfinite().all()
    captured = {}
    attention = loud_model.model.layers[0].self_attn
    handles = [
        attention.q_proj.register_forward_hook(lambda module, args, out: captured.setdefault("q", out)),
        attention.k_proj.register_forward_hook(lambda module, args, out: captured.setdefault("k", out)),
    ]
    try:
        with torch.no_grad():
            loud_model(input_ids=prompt(loud_model))
    finally:
        for handle in handles:
            handle.remove()
    head = attention.head_dim
    q = captured["q"][0, :, :head] * attention.scaling
    k = captured["k"][0, :, :head]
    assert not (q @ k.T).isfinite().all()  # float16 product of the scaled queries: inf


@pytest.mark.parametrize("method", ["h2o", "buzz", "bumblebee", "bumblebee-power", "ahakv"])
def test_prefill_scores_are_finite_where_stock_attention_is(loud_model, method):
    cache = kvhive.make_cache(loud_model, method, budget=40)
    with torch.no_grad():
        output = loud_model(input_ids=prompt(loud_model), past_key_values=cache, use_cache=True)
    assert output.logits.isfinite().all()
    scores = [score for index in cache.compressed_layers for score in cache.layers[index].token_scores.values()]
    assert scores and all(score.isfinite().all() for score in scores)
    assert all(int(kept.max()) <= 40 for kept in cache.kept_tokens().values())


def test_attention_weights_are_float32_and_match_a_float64_reference():
    """bfloat16 and float16 scoring against the same softmax in float64: float32 weights,
    rows summing to 1, within the input rounding; causal and padding masks honoured."""
    generator = torch.Generator().manual_seed(3)
    b, hq, h, n, d = 2, 4, 2, 12, 8
    queries = torch.randn(b, hq, n, d, generator=generator) * 40
    keys = torch.randn(b, h, n, d, generator=generator) * 40
    valid = torch.ones(b, n, dtype=torch.bool)
    valid[1, :3] = False  # left padding of row 1
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    mask = (causal[None] & valid[:, None, :])[:, None]  # [B, 1, q, N]
    positions = torch.arange(n).expand(b, h, n)
    for dtype in (torch.float16, torch.bfloat16):
        q, k = queries.to(dtype), keys.to(dtype)
        scoring = ScoringInputs(
            keys=k,
            values=k,
            queries=q,
            positions=positions,
            mask=mask,
            scaling=d**-0.5,
            layer_index=0,
            num_layers=1,
            sequence_length=n,
            phase=PREFILL,
        )
        weights = scoring.attention_weights(slice(0, n))
        assert weights.dtype == torch.float32 and weights.isfinite().all()
        logits = (q.double() * d**-0.5) @ k.double().repeat_interleave(hq // h, dim=1).transpose(-1, -2)
        expected = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)
        tolerance = 0.05 if dtype == torch.bfloat16 else 0.02
        torch.testing.assert_close(weights.double(), expected, atol=tolerance, rtol=0)
        summed = scoring.accumulated_attention()
        torch.testing.assert_close(summed.double(), expected.sum(dim=2), atol=tolerance * n, rtol=0)
        assert (weights[1, :, :3] == 0).all()  # padding queries carry no evidence
