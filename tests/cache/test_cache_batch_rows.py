"""Batch rows of a kvhive cache: ``reorder_cache`` (beam search), ``batch_select_indices`` and
``batch_repeat_interleave`` move every buffer with a batch dimension (keys, values, positions,
per-token scores, per-row counters) and the method's per-layer state, so a selected row continues
exactly as that row would have alone."""

from __future__ import annotations

import pytest
import torch

import kvhive
from kvhive.compat import cache_kwarg
from kvhive.methods.registry import method_names, policy_class
from kvhive.models import tiny_model

PROMPT_TOKENS = 57
STEPS_BEFORE, STEPS_AFTER = 4, 6


def _budget(name: str) -> int | None:
    policy = policy_class(name)()
    return max(32, policy.minimum_budget()) if policy.phases else None


def _run(model, cache, tokens: torch.Tensor) -> torch.Tensor:
    """Feed ``tokens`` ``[B, n]`` one at a time; the logits of every step ``[B, n, V]``."""
    kwarg = cache_kwarg(model)
    logits = []
    with torch.no_grad():
        for step in range(tokens.shape[1]):
            logits.append(model(input_ids=tokens[:, step : step + 1], **{kwarg: cache}, use_cache=True).logits[:, -1])
    return torch.stack(logits, dim=1)


def _prefill(model, cache, prompt: torch.Tensor) -> None:
    with torch.no_grad():
        model(input_ids=prompt, **{cache_kwarg(model): cache}, use_cache=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", "gqa")


@pytest.mark.parametrize("name", method_names())
def test_selected_rows_continue_as_those_rows_alone(model, name):
    """A 3-row cache, rows [2, 0] selected after a few decode steps, decodes what a cache of those
    two rows decodes when run from the start without the third."""
    generator = torch.Generator().manual_seed(11)
    prompt = torch.randint(3, 250, (3, PROMPT_TOKENS), generator=generator)
    steps = torch.randint(3, 250, (3, STEPS_BEFORE + STEPS_AFTER), generator=generator)
    index = torch.tensor([2, 0])

    cache = kvhive.make_cache(model, name, _budget(name))
    _prefill(model, cache, prompt)
    _run(model, cache, steps[:, :STEPS_BEFORE])
    packed = any(layer.is_initialized and not layer.is_uniform for layer in cache.layers)
    try:
        cache.batch_select_indices(index)
    except NotImplementedError as error:
        # Refused by name, never a silent wrong answer: the packed (head-wise) layout, or a method
        # whose per-layer state cannot be split by row.
        assert name in str(error)
        assert packed or name == "subgen-attention", error
        return
    assert not packed or name.startswith("ada-")
    selected = _run(model, cache, steps[index, STEPS_BEFORE:])

    alone = kvhive.make_cache(model, name, _budget(name))
    _prefill(model, alone, prompt[index])
    _run(model, alone, steps[index, :STEPS_BEFORE])
    expected = _run(model, alone, steps[index, STEPS_BEFORE:])
    torch.testing.assert_close(selected, expected, rtol=1e-4, atol=1e-5)
    assert [layer.lengths_host.tolist() for layer in cache.layers] == [
        layer.lengths_host.tolist() for layer in alone.layers
    ]
    for ours, theirs in zip(cache.layers, alone.layers, strict=True):
        for score_name, score in theirs.token_scores.items():
            torch.testing.assert_close(ours.token_scores[score_name], score, rtol=1e-4, atol=1e-5)


def test_boolean_mask_and_repeat_interleave(model):
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 250, (3, 40), generator=generator)
    steps = torch.randint(3, 250, (3, 5), generator=generator)
    cache = kvhive.make_cache(model, "h2o", 16)
    _prefill(model, cache, prompt)
    cache.batch_select_indices(torch.tensor([True, False, True]))
    cache.batch_repeat_interleave(2)
    assert cache.layers[0].batch_size == 4
    got = _run(model, cache, steps[[0, 0, 2, 2]])
    alone = kvhive.make_cache(model, "h2o", 16)
    _prefill(model, alone, prompt[[0, 0, 2, 2]])
    torch.testing.assert_close(got, _run(model, alone, steps[[0, 0, 2, 2]]), rtol=1e-4, atol=1e-5)
    with pytest.raises(IndexError, match="out of range"):
        cache.batch_select_indices(torch.tensor([4]))
    with pytest.raises(ValueError, match="repeats"):
        cache.batch_repeat_interleave(0)


@pytest.mark.parametrize("name", ["full", "h2o", "snapkv", "tova", "buzz", "bumblebee"])
def test_beam_search_runs(model, name):
    """``model.generate(num_beams=2)`` reorders the cache at every step; with the full method it
    gives transformers' own cache's beams."""
    generator = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, 250, (1, 45), generator=generator)
    options = dict(max_new_tokens=10, num_beams=2, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        cache = kvhive.make_cache(model, name, _budget(name))
        output = model.generate(prompt, **{cache_kwarg(model): cache}, **options)
        assert output.shape == (1, 45 + 10)
        assert cache.layers[0].batch_size == 2
        if name == "full":
            expected = model.generate(prompt, **options)
            assert torch.equal(output, expected)


def test_packed_layout_refused_by_name(model):
    """Heads holding different counts (Ada-KV's packed layout): refused, naming the method, and the
    cache is left as it was."""
    cache = kvhive.make_cache(model, "ada-snapkv", 32)
    _prefill(model, cache, torch.randint(3, 250, (2, 50), generator=torch.Generator().manual_seed(1)))
    layer = cache.layers[1]
    keep = torch.ones(2, layer.num_heads, layer.dense_length, dtype=torch.bool)
    keep[0, 0, :3] = False  # one head of one row keeps fewer tokens: the layer is packed
    layer.keep(keep)
    assert not layer.is_uniform
    before = [layer.lengths_host.tolist() for layer in cache.layers]
    with pytest.raises(NotImplementedError, match="'ada-snapkv'.*packed"):
        cache.reorder_cache(torch.tensor([1, 0]))
    assert [layer.lengths_host.tolist() for layer in cache.layers] == before
