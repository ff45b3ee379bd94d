"""Chunked prefill with compression as it goes (issue 24 item 1).

The prompt is fed in chunks; after each chunk every compressed layer holds at most its budget
(plus the chunk while it is being attended): streaming methods evict by their decode rule once per
chunk, prefill-only methods score kept + new tokens with the chunk's queries. One chunk covering
the whole prompt is exactly today's one-shot prefill.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import kvhive
from kvhive.models.tiny import tiny_model, tiny_tokenizer

BUDGET = 48
PARAMETERS = {"snapkv": {"window": 4}, "pyramidkv": {"window": 4}}
METHODS = ["snapkv", "pyramidkv", "knorm", "h2o", "tova", "streamingllm", "local"]


def _model():
    torch.manual_seed(0)
    return tiny_model("llama", "gqa")


def _prompt_ids(model, length=300):
    return torch.randint(3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("method", METHODS)
def test_one_chunk_covering_the_prompt_is_the_one_shot_prefill(method):
    model, tokenizer = _model(), tiny_tokenizer()
    prompt = " ".join(f"word{i}" for i in range(60))
    one_shot, one_shot_cache = kvhive.generate(
        model, tokenizer, prompt, method, BUDGET, max_new_tokens=6, **PARAMETERS.get(method, {})
    )
    chunked, chunked_cache = kvhive.generate(
        model, tokenizer, prompt, method, BUDGET, max_new_tokens=6, prefill_chunk=100_000, **PARAMETERS.get(method, {})
    )
    assert chunked == one_shot
    for index in one_shot_cache.compressed_layers:
        keys, _, positions, _ = one_shot_cache.layers[index].dense()
        chunked_keys, _, chunked_positions, _ = chunked_cache.layers[index].dense()
        assert torch.equal(positions, chunked_positions)
        assert torch.equal(keys, chunked_keys)


@pytest.mark.parametrize("method", METHODS)
def test_every_chunk_leaves_at_most_the_budget(method):
    model = _model()
    ids = _prompt_ids(model)
    cache = kvhive.make_cache(model, method, BUDGET, prefill_chunk=64, **PARAMETERS.get(method, {}))
    with torch.no_grad():
        for start in range(0, ids.shape[1], 64):
            model(input_ids=ids[:, start : start + 64], past_key_values=cache)
            seen = min(ids.shape[1], start + 64)
            for index in cache.compressed_layers:
                layer = cache.layers[index]
                assert layer.tokens_seen == seen
                if seen > BUDGET:
                    budget = cache.layer_budgets[index]
                    assert layer.max_length == budget, (method, start, layer.max_length, budget)
                    if method not in ("knorm", "tova"):  # the others always keep a recent window
                        assert int(layer.dense()[2].max()) == seen - 1
    assert cache.get_seq_length() == ids.shape[1]


def test_a_chunked_prompt_continues_to_decode():
    model, tokenizer = _model(), tiny_tokenizer()
    prompt = " ".join(f"word{i}" for i in range(60))
    text, cache = kvhive.generate(
        model, tokenizer, prompt, "snapkv", BUDGET, max_new_tokens=6, prefill_chunk=32, window=4
    )
    assert isinstance(text, str) and len(text) > 0
    prompt_tokens = tokenizer(prompt, return_tensors="pt").input_ids.shape[1]
    assert cache.get_seq_length() == prompt_tokens + 5  # the last new token is not fed back
    assert all(cache.layers[i].max_length <= BUDGET + 5 for i in cache.compressed_layers)


def test_a_ratio_needs_the_whole_prompt_length():
    model = _model()
    ids = _prompt_ids(model, 200)
    cache = kvhive.make_cache(model, "snapkv", 0.2, window=4, prefill_chunk=100)
    with torch.no_grad():
        model(input_ids=ids[:, :100], past_key_values=cache)
        with pytest.raises(ValueError, match=r"ratio=0.2 was resolved on the first 100 prompt tokens.*plan_prompt"):
            model(input_ids=ids[:, 100:], past_key_values=cache)
    planned = kvhive.make_cache(model, "snapkv", 0.2, window=4)
    planned.plan_prompt(200)
    with torch.no_grad():
        model(input_ids=ids[:, :100], past_key_values=planned)
        model(input_ids=ids[:, 100:], past_key_values=planned)
    assert all(planned.layers[i].max_length == 40 for i in planned.compressed_layers)  # 0.2 of 200


def test_plan_prompt_refuses_bad_input():
    model = _model()
    cache = kvhive.make_cache(model, "snapkv", 0.2, window=4)
    with pytest.raises(ValueError, match=r"invalid prompt_length=0"):
        cache.plan_prompt(0)
    with torch.no_grad():
        model(input_ids=_prompt_ids(model, 60), past_key_values=cache)
    with pytest.raises(ValueError, match="empty cache"):
        cache.plan_prompt(200)
    with pytest.raises(ValueError, match=r"invalid prefill_chunk=0"):
        kvhive.make_cache(model, "snapkv", 32, prefill_chunk=0)


def test_head_wise_budgets_refuse_a_second_chunk():
    model = _model()
    ids = _prompt_ids(model, 200)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = kvhive.make_cache(model, "ada-snapkv", BUDGET, window=4, prefill_chunk=100)
    with torch.no_grad():
        model(input_ids=ids[:, :100], past_key_values=cache)
        if all(cache.layers[i].is_uniform for i in cache.compressed_layers):
            pytest.fail("the allocation came out uniform: this test needs head-wise counts")
        with pytest.raises(ValueError, match="cannot be scored over head-wise budgets yet"):
            model(input_ids=ids[:, 100:], past_key_values=cache)
        # Refused before anything was stored: the cache decodes on.
        assert cache.get_seq_length() == 100
        model(input_ids=ids[:, 100:101], past_key_values=cache)
    assert cache.get_seq_length() == 101


def test_without_chunked_prefill_a_continuation_is_not_compressed():
    # A multi-token forward after the prompt of a cache not made for chunks (e.g. a multiple-choice
    # answer scored over the compressed prompt) is a continuation: a prefill-only method leaves it
    # as it is, and a ratio budget resolved on the prompt is not refused.
    model = _model()
    ids = _prompt_ids(model, 200)
    cache = kvhive.make_cache(model, "snapkv", 0.2, window=4)
    with torch.no_grad():
        model(input_ids=ids[:, :150], past_key_values=cache)
        model(input_ids=ids[:, 150:], past_key_values=cache)
    assert all(cache.layers[i].max_length == 30 + 50 for i in cache.compressed_layers)  # 0.2 of 150, + 50
