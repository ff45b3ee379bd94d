"""Stacked caches and fixed batch slots stay usable and never mistake a placeholder for a row: a
refused decode step (a slot past its capacity) changes nothing and names the slot and the
capacity; row selection, ``add_rows`` and stacking refuse a cache of fixed slots (its free slots
hold placeholders); a stacked forward given no ``position_ids`` puts each row at its own position."""

from __future__ import annotations

import warnings

import pytest
import torch

import kvhive
from kvhive.cache import KVHiveCache
from kvhive.compat import cache_kwarg
from kvhive.models import tiny_model

LENGTHS = (20, 30)


@pytest.fixture(scope="module")
def gemma():
    """Three sliding layers (window 8) before a full-attention one: the full layer is the one that
    outgrows a slot, after the sliding layers took their token."""
    return tiny_model("gemma3", "gqa")


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", "gqa")


def _prompts(lengths=LENGTHS, seed: int = 2):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (1, n), generator=generator) for n in lengths]


def _prefilled(model, method, budget, prompt):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = kvhive.make_cache(model, method, budget)
        with torch.no_grad():
            model(input_ids=prompt, **{cache_kwarg(model): cache}, use_cache=True)
    return cache


def _step(model, cache, tokens, position_ids=True):
    extra = {"position_ids": cache.next_position_ids()} if position_ids else {}
    with torch.no_grad():
        return model(input_ids=tokens, **{cache_kwarg(model): cache}, use_cache=True, **extra).logits[:, -1]


def test_a_slot_overflow_is_refused_before_anything_is_stored(gemma):
    """The row in slot 1 reaches its slot's capacity: the next step is refused naming the slot, the
    layer and the capacity, with every layer as it was; once the slot is freed, the other row
    decodes on exactly as alone."""
    prompts = _prompts()
    slotted = KVHiveCache.stack([_prefilled(gemma, "full", None, p) for p in prompts], batch_slots=2, slot_capacity=32)
    alone = _prefilled(gemma, "full", None, prompts[0])
    tokens = torch.randint(3, 250, (2, 6), generator=torch.Generator().manual_seed(5))
    for step in range(2):  # slot 1: 30 -> 32 tokens in the full-attention layer
        got = _step(gemma, slotted, tokens[:, step : step + 1])
        expected = _step(gemma, alone, tokens[:1, step : step + 1], position_ids=False)
        torch.testing.assert_close(got[0], expected[0], rtol=1e-4, atol=1e-5)
    seen = [layer.row_tokens_seen for layer in slotted.layers]
    held = [layer.lengths_host.tolist() for layer in slotted.layers]
    with pytest.raises(ValueError, match=r"slot 1 holds 32 tokens in layer 3: 1 more would pass its capacity of 32"):
        _step(gemma, slotted, tokens[:, 2:3])
    assert [layer.row_tokens_seen for layer in slotted.layers] == seen
    assert [layer.lengths_host.tolist() for layer in slotted.layers] == held
    slotted.free_slots([1])
    for step in range(2, 6):
        got = _step(gemma, slotted, tokens[:, step : step + 1])
        expected = _step(gemma, alone, tokens[:1, step : step + 1], position_ids=False)
        torch.testing.assert_close(got[0], expected[0], rtol=1e-4, atol=1e-5)


def test_a_slotted_cache_refuses_what_would_make_placeholders_rows(llama):
    """Selecting rows (beam search, batch slicing), appending rows or stacking a cache of fixed
    slots would make its free slots' placeholders rows of their own: refused by name, the cache
    left as it was (it decodes on)."""
    prompts = _prompts((40, 57))
    slotted = KVHiveCache.stack([_prefilled(llama, "h2o", 32, p) for p in prompts], batch_slots=3)
    seen = slotted.row_tokens_seen()
    for select in (
        lambda: slotted.batch_select_indices(torch.tensor([0, 2])),
        lambda: slotted.reorder_cache(torch.tensor([2, 1, 0])),
        lambda: slotted.batch_repeat_interleave(2),
    ):
        with pytest.raises(ValueError, match=r"selecting its rows .* 3 fixed batch slots \(free: \[2\]\)"):
            select()
    with pytest.raises(ValueError, match="add_rows is not supported on a cache of 3 fixed batch slots"):
        slotted.add_rows([_prefilled(llama, "h2o", 32, prompts[0])])
    with pytest.raises(ValueError, match=r"stacking caches\[1\] is not supported .* fill_slots"):
        KVHiveCache.stack([_prefilled(llama, "h2o", 32, prompts[0]), slotted])
    assert slotted.active_slots == [True, True, False]
    assert slotted.row_tokens_seen() == seen
    assert _step(llama, slotted, torch.ones(3, 1, dtype=torch.long)).shape[0] == 3


def test_a_stacked_forward_without_position_ids_puts_each_row_at_its_own_position(llama):
    """Without ``position_ids`` transformers numbers every row from the most-seen row's count; a
    stacked cache gives each row its own next position instead, so the logits are those of each
    row alone."""
    prompts = _prompts((40, 57))
    stacked = KVHiveCache.stack([_prefilled(llama, "tova", 32, p) for p in prompts])
    alone = [_prefilled(llama, "tova", 32, p) for p in prompts]
    tokens = torch.randint(3, 250, (2, 3), generator=torch.Generator().manual_seed(7))
    for step in range(3):
        got = _step(llama, stacked, tokens[:, step : step + 1], position_ids=False)
        for row, cache in enumerate(alone):
            expected = _step(llama, cache, tokens[row : row + 1, step : step + 1], position_ids=False)
            torch.testing.assert_close(got[row], expected[0], rtol=1e-4, atol=1e-5)
    assert stacked.row_tokens_seen() == [43, 60]
