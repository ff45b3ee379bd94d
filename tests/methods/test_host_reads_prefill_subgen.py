"""Issue 25 item 3 for SubGen and subgen-attention: the prefill compression makes no host read of
its own, whatever the prompt length (tiny Llama-GQA, ratio 0.25, 256 and 2,048 tokens).

Before: SubGen read a bool per picked k-center (64 reads at 256 tokens, 934 at 2,048), the
subgen-attention insertion looped on ``nonzero``/``bool``/``int`` (62 and 380)."""

from __future__ import annotations

import pytest
import torch
from host_read_hooks import count_policy_reads

import kvhive
from kvhive.diagnostics import HostReadCounter
from kvhive.models import tiny_model

LENGTHS = (256, 2048)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", "gqa")


@torch.no_grad()
def _prefill_reads(model, method: str, length: int):
    input_ids = torch.randint(3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    cache = kvhive.make_cache(model, method, budget=0.25)
    reads, calls = count_policy_reads(cache.policy)
    with HostReadCounter() as total:
        model(input_ids=input_ids, past_key_values=cache, use_cache=True)
    assert calls["select_prefill"] == model.config.num_hidden_layers  # every layer was compressed
    assert all(int(kept.max()) < length for kept in cache.kept_tokens().values())
    return reads, total.total


@pytest.mark.parametrize("method", ["subgen", "subgen-attention"])
def test_prefill_compression_reads_nothing_on_the_host_at_any_prompt_length(model, method):
    totals = []
    for length in LENGTHS:
        reads, total = _prefill_reads(model, method, length)
        assert sum(reads.values()) == 0, (length, dict(reads))
        totals.append(total)
    # The whole forward pass (the cache's share included) reads the same at both lengths, and at
    # most 4 times per layer (issue 25's budget).
    assert totals[0] == totals[1], totals
    assert totals[1] <= 4 * model.config.num_hidden_layers, totals
