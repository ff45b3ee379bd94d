"""fp16 with large q.k (issue 27 item 5): every method stays finite where stock transformers does.

A tiny Llama whose q/k projections are scaled x800 makes q.k overflow fp16's range (65504) when the
product is formed in fp16 before scaling; stock sdpa accumulates in fp32 and stays finite, and so
must every method's scoring and decode attention.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import DynamicCache

import kvhive
from kvhive.methods.registry import method_names, policy_class
from kvhive.models import tiny_model

BUDGET = 32


def _large_logit_model():
    torch.manual_seed(0)
    model = tiny_model("llama", "gqa").to(torch.float16)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(800)
            layer.self_attn.k_proj.weight.mul_(800)
    return model


def _decode_finite(model, cache, steps=4) -> bool:
    prompt = torch.randint(3, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    finite = []
    with torch.no_grad():
        logits = model(input_ids=prompt, past_key_values=cache).logits
        finite.append(bool(torch.isfinite(logits).all()))
        for _ in range(steps):
            logits = model(input_ids=logits[:, -1:].argmax(-1), past_key_values=cache).logits
            finite.append(bool(torch.isfinite(logits).all()))
    return all(finite)


def test_the_product_overflows_fp16_in_this_model():
    # The test is not vacuous: some q.k of this model is beyond fp16's range.
    model = _large_logit_model()
    layer = model.model.layers[0]
    attention = layer.self_attn
    hidden = layer.input_layernorm(model.model.embed_tokens(torch.arange(3, 67)[None]))
    head_dim = attention.head_dim
    with torch.no_grad():
        queries = attention.q_proj(hidden).float()[..., :head_dim]  # first head of each
        keys = attention.k_proj(hidden).float()[..., :head_dim]
    assert (queries @ keys.transpose(-1, -2)).abs().max() > 65504


@pytest.mark.parametrize("method", method_names())
def test_method_is_finite_where_stock_is(method):
    model = _large_logit_model()
    model.set_attn_implementation("sdpa")
    assert _decode_finite(model, DynamicCache())
    budget = max(BUDGET, policy_class(method)().minimum_budget())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = (
            kvhive.make_cache(model, method) if method == "full" else kvhive.make_cache(model, method, budget=budget)
        )
    assert _decode_finite(model, cache), f"{method}: non-finite logits in fp16 where stock sdpa is finite"
