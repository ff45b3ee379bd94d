"""Rolling back the newest tokens (``crop``): transformers' assisted / speculative decoding crops the
rejected drafts. Supported where nothing is evicted while decoding and the drafts came after the
prompt's compression; refused, before anything changes, everywhere else."""

from __future__ import annotations

import pytest
import torch

import kvhive
from kvhive.models.tiny import tiny_model

PROMPT_ONLY = [("full", {}), ("snapkv", {"budget": 32}), ("pyramidkv", {"budget": 32}), ("knorm", {"budget": 32})]


def _model():
    torch.manual_seed(0)
    return tiny_model("llama", "gqa")


def _untied_model():
    # Untied embeddings: greedy text that varies (a tied tiny model repeats one token, which any
    # wrong cache reproduces too).
    return tiny_model("llama", "gqa", tie_word_embeddings=False)


def _repetitive_prompt(model):
    # Repeats, so prompt lookup proposes drafts (some accepted, some cropped).
    base = torch.randint(3, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    return base.repeat(1, 4)


@pytest.mark.parametrize(("method", "options"), PROMPT_ONLY)
def test_assisted_decoding_equals_plain_greedy_after_the_prompt(method, options):
    model = _untied_model()
    prompt = _repetitive_prompt(model)
    new_tokens = 20
    outputs, removed = [], []
    for assisted in (False, True):
        cache = kvhive.make_cache(model, method, **options)
        original = cache.crop

        def counting(tokens_to_remove, _original=original):
            removed.append(tokens_to_remove)
            return _original(tokens_to_remove)

        cache.crop = counting
        with torch.no_grad():
            model(input_ids=prompt[:, :-1], past_key_values=cache)  # the prompt is compressed first
        extra = {"prompt_lookup_num_tokens": 4} if assisted else {}
        outputs.append(
            model.generate(prompt, past_key_values=cache, max_new_tokens=new_tokens, do_sample=False, **extra)
        )
        assert cache.is_croppable
        # The prompt went through the cache once: its tokens, then every new token but the last.
        assert cache.get_seq_length() == prompt.shape[1] + new_tokens - 1
    assert len(set(outputs[0][0, prompt.shape[1] :].tolist())) > 2  # the greedy text varies
    assert torch.equal(outputs[0], outputs[1])
    assert any(count < 0 for count in removed), removed  # drafts were rejected and rolled back


def test_drafts_compressed_with_the_prompt_cannot_be_rolled_back():
    model = _model()
    prompt = _repetitive_prompt(model)
    cache = kvhive.make_cache(model, "snapkv", budget=32)
    with pytest.raises(ValueError, match=r"compressed with the first 84 tokens, so it cannot be rolled back to 80"):
        model.generate(prompt, past_key_values=cache, max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=4)


def test_a_method_that_evicts_while_decoding_is_not_croppable():
    model = _model()
    cache = kvhive.make_cache(model, "h2o", budget=32)
    with torch.no_grad():
        model(input_ids=_repetitive_prompt(model), past_key_values=cache)
    assert not cache.is_croppable
    with pytest.raises(ValueError, match=r"method 'h2o' evicts while decoding, so its cache cannot be rolled back"):
        cache.crop(-1)


def test_crop_frees_the_newest_tokens_and_refuses_before_changing_anything():
    model = _model()
    cache = kvhive.make_cache(model, "snapkv", budget=32, decode_capacity=8)
    prompt = _repetitive_prompt(model)
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=cache)
        reference = [layer.dense()[0].clone() for layer in cache.layers]
        for step in range(3):
            token = torch.tensor([[5 + step]])
            model(input_ids=token, position_ids=torch.tensor([[80 + step]]), past_key_values=cache)
    assert cache.get_seq_length() == 83
    cache.crop(-2)
    assert cache.get_seq_length() == 81
    for layer, keys in zip(cache.layers, reference, strict=True):
        assert layer.dense_length == 33 and torch.equal(layer.dense()[0][:, :, :32], keys)
        buffer = layer.buffers()[0]
        assert torch.equal(buffer[:, :, 33:], torch.zeros_like(buffer[:, :, 33:]))  # freed slots hold zeros
    cache.crop(81)  # the legacy form: the absolute length to keep
    assert cache.get_seq_length() == 81
    with pytest.raises(ValueError, match=r"cannot be rolled back to 79"):
        cache.crop(-2)  # into the compressed prompt
    assert cache.get_seq_length() == 81 and all(layer.dense_length == 33 for layer in cache.layers)


def test_a_full_sliding_window_is_not_croppable():
    torch.manual_seed(0)
    model = tiny_model("gemma3")
    window = model.config.sliding_window
    cache = kvhive.make_cache(model, "full")
    with torch.no_grad():
        model(input_ids=torch.randint(3, 100, (1, window // 2)), past_key_values=cache)
        assert cache.is_croppable
        model(input_ids=torch.randint(3, 100, (1, window)), past_key_values=cache)
    assert not cache.is_croppable


def test_head_wise_counts_are_refused_by_name():
    model = _model()
    cache = kvhive.make_cache(model, "ada-snapkv", budget=32, window=4)
    with torch.no_grad():
        model(input_ids=_repetitive_prompt(model), past_key_values=cache)
        model(input_ids=torch.tensor([[7]]), past_key_values=cache)
    assert any(not layer.is_uniform for layer in cache.layers)  # heads keep different counts
    assert not cache.is_croppable
    with pytest.raises(ValueError, match=r"different number of tokens per head or per row"):
        cache.crop(-1)
    assert cache.get_seq_length() == 81


def test_speculative_decoding_with_an_assistant_feeds_the_prompt_once():
    model = _untied_model()
    assistant = tiny_model("llama", "gqa", seed=1, tie_word_embeddings=False)
    prompt = _repetitive_prompt(model)
    outputs = []
    for extra in ({}, {"assistant_model": assistant}):
        cache = kvhive.make_cache(model, "snapkv", budget=32)
        with torch.no_grad():
            model(input_ids=prompt[:, :-1], past_key_values=cache)
        outputs.append(model.generate(prompt, past_key_values=cache, max_new_tokens=12, do_sample=False, **extra))
        assert cache.get_seq_length() == prompt.shape[1] + 12 - 1
    assert torch.equal(outputs[0], outputs[1])
