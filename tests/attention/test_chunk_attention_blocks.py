"""A prompt chunk attends the stored tokens in blocks of queries (kvhive.attention.decode):
the same output as one sdpa call, at a fraction of its memory (sdpa's CPU path with a mask
materialises every query's scores at once)."""

from __future__ import annotations

import pytest
import torch

import kvhive
from kvhive.attention import decode
from kvhive.bench import load_shape
from kvhive.memory import PhaseMemory


@pytest.mark.parametrize("mask_heads", [None, 1, 2, 4])  # no mask, broadcast, per stored head, per query head
@pytest.mark.parametrize("mask_queries", ["each", "one"])
def test_blocks_of_queries_equal_one_sdpa_call(mask_heads, mask_queries):
    generator = torch.Generator().manual_seed(0)
    batch, query_heads, heads, queries, keys_count, dim = 2, 4, 2, 600, 700, 8  # 600 queries: 3 blocks of 256
    query = torch.randn(batch, query_heads, queries, dim, generator=generator)
    keys = torch.randn(batch, heads, keys_count, dim, generator=generator)
    values = torch.randn(batch, heads, keys_count, dim, generator=generator)
    mask = None
    if mask_heads is not None:
        rows = queries if mask_queries == "each" else 1
        mask = torch.rand(batch, mask_heads, rows, keys_count, generator=generator) > 0.3
        mask[..., 0] = True  # every query attends something
    blocked = decode.sdpa_in_query_blocks(query, keys, values, mask, 0.3, query_heads // heads)
    full_mask = mask if mask is None or mask.shape[1] in (1, query_heads) else mask.repeat_interleave(2, dim=1)
    reference = torch.nn.functional.scaled_dot_product_attention(
        query, keys, values, attn_mask=full_mask, scale=0.3, enable_gqa=True
    )
    torch.testing.assert_close(blocked, reference, atol=1e-5, rtol=1e-5)


def _chunked_prefill_peak(model, prompt, monkeypatch, block: int) -> int:
    monkeypatch.setattr(decode, "QUERY_BLOCK", block)
    memory = PhaseMemory("cpu")
    assert memory.unavailable is None, memory.unavailable
    cache = kvhive.make_cache(model, "streamingllm", budget=0.1, prefill_chunk=2048)
    cache.plan_prompt(prompt.shape[1])
    start = memory.start()
    assert start is not None, memory.unavailable
    with torch.no_grad():
        for chunk_start in range(0, prompt.shape[1], 2048):
            chunk = prompt[:, chunk_start : chunk_start + 2048]
            model(input_ids=chunk, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return memory.peak() - start


def test_a_later_chunk_peaks_at_a_block_of_queries_not_at_the_chunk(monkeypatch):
    # kv-heavy (16 query heads), 2 layers, 4,096 tokens in chunks of 2,048: the second chunk attends
    # ~2,460 kept + new tokens with a mask; all 2,048 queries at once held ~750 MB of scores.
    model = load_shape("kv-heavy", 2, "cpu")
    prompt = torch.randint(3, 1000, (1, 4096), generator=torch.Generator().manual_seed(0))
    # Blocked first: memory the first run frees and the process keeps would flatter the second.
    blocked = _chunked_prefill_peak(model, prompt, monkeypatch, block=256)
    whole_chunk = _chunked_prefill_peak(model, prompt, monkeypatch, block=2048)
    assert blocked < 0.7 * whole_chunk, (blocked / 2**20, whole_chunk / 2**20)


def test_a_mask_built_per_block_equals_the_sliced_mask():
    """The causal mask of a prompt chunk built for each block of queries (``block_mask``) gives the
    output of the whole chunk's mask sliced per block."""
    generator = torch.Generator().manual_seed(0)
    batch, query_heads, heads, queries, keys_count, dim = 1, 4, 2, 600, 700, 8
    query = torch.randn(batch, query_heads, queries, dim, generator=generator)
    keys = torch.randn(batch, heads, keys_count, dim, generator=generator)
    values = torch.randn(batch, heads, keys_count, dim, generator=generator)
    positions = torch.arange(keys_count).expand(batch, heads, keys_count)
    first = keys_count - queries
    whole = kvhive.methods.base.causal_mask(positions, first, keys_count)

    def block_mask(start, stop):
        return kvhive.methods.base.causal_mask(positions, first + start, first + stop)

    sliced = decode.sdpa_in_query_blocks(query, keys, values, whole, 0.3, 2)
    built = decode.sdpa_in_query_blocks(query, keys, values, None, 0.3, 2, block_mask)
    assert torch.equal(built, sliced)
