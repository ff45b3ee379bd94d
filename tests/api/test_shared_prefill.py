"""One prefill serves many methods: the replayed caches equal caches that ran their own prefill."""

from __future__ import annotations

import math

import pytest
import torch

import kvhive
from kvhive.api import shared_prefill
from kvhive.evaluation.backend import Setting
from kvhive.evaluation.kvhive_backend import KVHiveBackend
from kvhive.models import tiny_model, tiny_tokenizer

SETTINGS = [("full", None), ("local", 6), ("streamingllm", 8), ("h2o", 8), ("snapkv", 8)]


def _own_prefill(model, input_ids, method, budget, **options):
    cache = kvhive.make_cache(model, method, budget, **options)
    with torch.no_grad():
        logits = model(input_ids=input_ids, past_key_values=cache, use_cache=True).logits[:, -1]
    return cache, logits


@pytest.mark.parametrize("architecture", ["llama", "gemma3"])
def test_replayed_prefill_equals_own_prefill(architecture):
    model = tiny_model(architecture, "gqa")
    input_ids = torch.randint(3, 200, (1, 30), generator=torch.Generator().manual_seed(1))
    options = {"snapkv": {"window": 4}}
    caches = [kvhive.make_cache(model, m, b, **options.get(m, {})) for m, b in SETTINGS]
    shared_logits = shared_prefill(model, input_ids, caches)
    for (method, budget), cache, logits in zip(SETTINGS, caches, shared_logits, strict=True):
        own, own_logits = _own_prefill(model, input_ids, method, budget, **options.get(method, {}))
        assert torch.allclose(logits, own_logits, atol=1e-5)
        for layer, own_layer in zip(cache.layers, own.layers, strict=True):
            assert torch.equal(layer.lengths, own_layer.lengths), method
            assert torch.equal(layer.stored_flat_positions(), own_layer.stored_flat_positions()), method
            assert torch.allclose(layer.stored_keys(), own_layer.stored_keys()), method
        # Decoding continues identically.
        token = logits.argmax(-1, keepdim=True)
        with torch.no_grad():
            a = model(input_ids=token, past_key_values=cache, use_cache=True).logits
            b = model(input_ids=token, past_key_values=own, use_cache=True).logits
        assert (a - b).abs().max() <= 1e-5, method


def test_backend_generate_shared_equals_separate():
    model, tokenizer = tiny_model("llama", "gqa"), tiny_tokenizer()
    settings = [Setting("full", 1.0), Setting("local", 8), Setting("h2o", 0.5)]
    prompt = "the quick brown fox jumps over the lazy dog " * 3
    shared = KVHiveBackend(model, tokenizer, share_prefill=True).generate(prompt, 12, settings)
    separate = KVHiveBackend(model, tokenizer, share_prefill=False).generate(prompt, 12, settings)
    assert shared == separate
    assert all(isinstance(text, str) and text for text in shared)


def test_backend_perplexity_with_full_budget_equals_plain_forward():
    model, tokenizer = tiny_model("gemma3", "gqa"), tiny_tokenizer()
    token_ids = torch.randint(3, 250, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    backend = KVHiveBackend(model, tokenizer)
    [(nll_sum, count)] = backend.streaming_nll(token_ids, [Setting("streamingllm", 1000)])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([token_ids])).logits[0, :-1]
    expected = torch.nn.functional.cross_entropy(logits, torch.tensor(token_ids[1:]), reduction="sum")
    assert count == len(token_ids) - 1
    assert math.isclose(math.exp(nll_sum / count), math.exp(float(expected) / count), rel_tol=1e-5)


def test_backend_streaming_cache_stays_at_budget_and_changes_perplexity():
    model, tokenizer = tiny_model("gemma3", "gqa"), tiny_tokenizer()
    token_ids = torch.randint(3, 250, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    backend = KVHiveBackend(model, tokenizer)
    [(full_nll, _), (small_nll, _)] = backend.streaming_nll(
        token_ids, [Setting("full", 1.0), Setting("streamingllm", 6)]
    )
    assert full_nll != small_nll


def test_backend_choice_loglikelihood_matches_plain_forward():
    model, tokenizer = tiny_model("qwen2", "gqa"), tiny_tokenizer()
    backend = KVHiveBackend(model, tokenizer)
    context, continuations = "Question: is the sky blue? Answer:", [" yes", " no, it is green"]
    [scores] = backend.choice_loglikelihoods(context, continuations, [Setting("full", 1.0)])
    for continuation, score in zip(continuations, scores, strict=True):
        ids = tokenizer(context + continuation, return_tensors="pt")["input_ids"]
        start = tokenizer(context, return_tensors="pt")["input_ids"].shape[1]
        with torch.no_grad():
            log_probs = torch.log_softmax(model(input_ids=ids).logits[0], dim=-1)
        expected = sum(float(log_probs[i - 1, ids[0, i]]) for i in range(start, ids.shape[1]))
        assert math.isclose(score, expected, rel_tol=1e-4, abs_tol=1e-4)


def test_backend_says_which_ratio_budgets_are_infeasible_on_a_context():
    model, tokenizer = tiny_model("llama", "gqa"), tiny_tokenizer()
    backend = KVHiveBackend(model, tokenizer)
    # SnapKV needs its 32-token observation window: 0.2 of 100 tokens is 20.
    reason = backend.infeasible(Setting("snapkv", 0.2), 100)
    assert reason is not None and "snapkv" in reason and "32" in reason
    assert backend.infeasible(Setting("snapkv", 0.2), 200) is None
    assert backend.infeasible(Setting("snapkv", 32), 10) is None
    assert backend.infeasible(Setting("full", 0.01), 10) is None
    # And running it anyway fails with that same reason rather than a wrong result.
    prompt = "the quick brown fox jumps over the lazy dog " * 3
    with pytest.raises(ValueError, match="needs at least 32"):
        backend.generate(prompt, 2, [Setting("snapkv", 0.2)])
