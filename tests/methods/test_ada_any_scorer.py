"""Ada-KV wraps any score-based method (``ada-<scorer>``): budgets kept exactly per layer, the
scorer's protected tokens kept in every head, and the paper/kvhive labels."""

from __future__ import annotations

import pytest
import torch

import kvhive
from kvhive.methods.base import ScorerPolicy
from kvhive.methods.registry import method_names, policy_class
from kvhive.models import tiny_model

from helpers import left_padded_batch, prefill_and_decode

SCORERS = [
    name for name in method_names() if not name.startswith("ada-") and issubclass(policy_class(name), ScorerPolicy)
]


def test_every_scorer_is_listed():
    assert {"snapkv", "pyramidkv", "h2o", "tova", "knorm", "streamingllm", "local", "random", "ahakv", "vnorm"} <= set(
        SCORERS
    )


@pytest.mark.parametrize("scorer", SCORERS)
def test_ada_over_any_scorer_keeps_the_layer_budget(scorer):
    model = tiny_model("llama", "gqa")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=56, pad=5)
    budget = max(policy_class(scorer)().minimum_budget(), 12)
    cache = kvhive.make_cache(model, f"ada-{scorer}", budget=budget)
    logits = prefill_and_decode(model, cache, input_ids, attention_mask, steps=3)
    assert torch.isfinite(logits).all()
    for layer in cache.compressed_layers:
        lengths = cache.layers[layer].lengths_host
        assert (
            lengths.sum(-1) == (cache.row_layer_budgets[layer][0] + 3) * lengths.shape[1]
        ).all() or cache.row_layer_budgets[layer][0] >= 56


def test_labels():
    assert policy_class("ada-snapkv").describe()["paper"].startswith("Feng et al. 2024")
    assert policy_class("ada-pyramidkv").describe()["paper"].startswith("Feng et al. 2024")
    for name in ("ada-ahakv", "ada-tova", "ada-vnorm"):
        assert policy_class(name).describe()["paper"].startswith("kvhive combination, not a paper method")
    with pytest.raises(ValueError, match="score-based"):
        policy_class("ada-full")


def test_sinks_are_kept_in_every_head_under_ada_streamingllm():
    model = tiny_model("llama", "mha")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=40, pad=5)
    cache = kvhive.make_cache(model, "ada-streamingllm", budget=10, sink=4)
    prefill_and_decode(model, cache, input_ids, attention_mask, steps=0)
    from golden_kept import kept_positions

    for layer in cache.compressed_layers:
        rows = kept_positions(cache.layers[layer])
        assert all(set(range(4)) <= set(head) for head in rows[0])
        assert all(set(range(5, 9)) <= set(head) for head in rows[1])  # the padded row's first real tokens
