"""Issue 23 item 2 for subgen, subgen-attention and random: a steady decode step makes no host
read in the method's hooks (observe/select/extra attention), on tiny Llama-GQA (2 layers, budget
48, prompt 160, after 6 warm-up steps).

Before: subgen 16 reads per step (bool/int/boolean-mask index), subgen-attention 24 (nonzero,
tolist, bool, int), random 4 (tolist of the per-row draw counts)."""

from __future__ import annotations

import pytest
import torch
from host_read_hooks import count_policy_reads

import kvhive
from kvhive.models import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", "gqa")


@torch.no_grad()
@pytest.mark.parametrize("method", ["subgen", "subgen-attention", "random"])
def test_a_steady_decode_step_reads_nothing_in_the_method(model, method):
    input_ids = torch.randint(3, model.config.vocab_size, (1, 160), generator=torch.Generator().manual_seed(0))
    budget = 48
    cache = kvhive.make_cache(model, method, budget=budget)
    token = model(input_ids=input_ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    for _ in range(6):
        token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    reads, calls = count_policy_reads(cache.policy)
    model(input_ids=token, past_key_values=cache, use_cache=True)
    layers = model.config.num_hidden_layers
    # The step decided in every layer: a steady step names its dropped token (SubGen; a scorer's
    # select_decode wrapped here is its own no more, so it hands a keep mask) or keeps a mask.
    decided = calls["select_decode"] if method != "subgen" else calls["select_decode_drop"]
    assert decided == layers
    if method == "subgen-attention":
        assert calls["extra_attention"] == layers  # and the estimator answered the query
    assert sum(reads.values()) == 0, dict(reads)
    # The kept count the cache may trust without reading it back.
    for kept in cache.kept_tokens().values():
        expected = cache.policy.kept_per_row("decode", budget + 1, cache.layer_budgets[0], {})
        assert (kept == expected).all()
