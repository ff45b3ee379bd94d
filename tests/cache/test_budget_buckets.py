"""Ratio budgets in a few sizes (issue 23 item 1): prompts of different lengths whose ratio budgets
round up to one size share one compiled decode graph; without the rounding each length is a new
graph. Rounding keeps at most 25% more tokens than asked, never fewer."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch._dynamo.utils import counters

import kvhive
from kvhive.cache.budget import Budget, bucket_up
from kvhive.models.tiny import tiny_model, tiny_tokenizer


@given(st.integers(1, 10**7))
def test_a_bucket_holds_the_budget_and_at_most_a_quarter_more(tokens):
    size = bucket_up(tokens)
    assert tokens <= size <= max(tokens, 1.25 * tokens)
    assert bucket_up(size) == size  # a size is its own bucket
    assert bucket_up(tokens + 1) >= size  # monotone


def test_there_are_four_sizes_an_octave():
    assert sorted({bucket_up(t) for t in range(2048, 4097)}) == [2048, 2560, 3072, 3584, 4096]


def test_bad_bucket_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match=r"invalid tokens=0: expected an integer >= 1"):
        bucket_up(0)
    with pytest.raises(ValueError, match=r"invalid bucket_budget='yes': expected True or False"):
        kvhive.make_cache(tiny_model("llama", "gqa"), "h2o", ratio=0.2, bucket_budget="yes")


def test_a_bucketed_ratio_resolves_up_and_never_past_the_prompt():
    assert Budget(ratio=0.1, bucketed=True).resolve(32768) == 3584  # 3277 tokens, rounded up
    assert Budget(ratio=0.1).resolve(32768) == 3277
    assert Budget(ratio=1.0, bucketed=True).resolve(1000) == 1000  # 1000 -> 1024 would exceed the prompt
    assert Budget(tokens=100, bucketed=True).resolve(32768) == 100  # a token budget is one size already


@pytest.fixture
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _compiled_steps(model, caches_and_prompts, steps=4):
    def step(token, position, cache):
        return model(input_ids=token, position_ids=position, past_key_values=cache, use_cache=True).logits

    compiled = torch.compile(step, fullgraph=True, dynamic=False, backend="aot_eager")
    with torch.no_grad():
        for cache, prompt in caches_and_prompts:
            token = model(input_ids=prompt, past_key_values=cache).logits[:, -1:].argmax(-1)
            position = torch.full((1, 1), prompt.shape[1])
            for _ in range(steps):
                token = compiled(token, position, cache)[:, -1:].argmax(-1)
                position = position + 1


def _prompts(model, lengths):
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, model.config.vocab_size, (1, n), generator=generator) for n in lengths]


@pytest.mark.usefixtures("_fresh_dynamo")
def test_prompts_of_different_lengths_share_one_graph_when_bucketed():
    torch.manual_seed(0)
    model = tiny_model("llama", "gqa")
    prompts = _prompts(model, (200, 213))  # 15%: 30 and 32 tokens, both in the bucket of 32
    caches = [kvhive.make_cache(model, "h2o", ratio=0.15, bucket_budget=True) for _ in prompts]
    with torch._dynamo.config.patch(error_on_recompile=True):
        _compiled_steps(model, zip(caches, prompts, strict=True))
    assert counters["stats"]["unique_graphs"] == 1
    assert [cache.layer_budgets[0] for cache in caches] == [32, 32]
    assert all(cache.get_seq_length() == prompt.shape[1] + 4 for cache, prompt in zip(caches, prompts, strict=True))


@pytest.mark.usefixtures("_fresh_dynamo")
def test_without_buckets_a_new_prompt_length_is_a_new_graph():
    # The check above can fail: the same two prompts at their exact ratios recompile.
    torch.manual_seed(0)
    model = tiny_model("llama", "gqa")
    prompts = _prompts(model, (200, 213))
    caches = [kvhive.make_cache(model, "h2o", ratio=0.15) for _ in prompts]
    assert [cache.budget.resolve(prompt.shape[1]) for cache, prompt in zip(caches, prompts, strict=True)] == [30, 32]
    with torch._dynamo.config.patch(error_on_recompile=True), pytest.raises(Exception, match="[Rr]ecompil"):
        _compiled_steps(model, zip(caches, prompts, strict=True))


def test_generate_with_compile_buckets_a_ratio_and_says_so():
    torch.manual_seed(0)
    model, tokenizer = tiny_model("llama", "gqa"), tiny_tokenizer()
    _, cache = kvhive.generate(model, tokenizer, "a prompt " * 30, "h2o", 0.15, max_new_tokens=3, compile=True)
    assert cache.budget.bucketed and "bucketed" in cache.budget_label()
    _, exact = kvhive.generate(
        model, tokenizer, "a prompt " * 30, "h2o", 0.15, max_new_tokens=3, compile=True, bucket_budget=False
    )
    assert not exact.budget.bucketed
