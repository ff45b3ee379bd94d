"""A ratio budget in a left-padded batch resolves on each row's real length (issue 9 item 5: "each
row must get what it would get alone"): a shorter row keeps the share of its own prompt, not of the
padded width; a method that keeps one budget for every row while decoding refuses rows whose ratio
resolves to different counts instead of answering differently from their solo runs."""

from __future__ import annotations

import pytest

import kvhive
from kvhive.models import tiny_model

from helpers import left_padded_batch, prefill_and_decode, solo_runs

LENGTH, PAD, RATIO = 100, 30, 0.5  # real lengths 100 and 70: 50 and 35 tokens per head


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", "gqa")


@pytest.mark.parametrize("method", ["snapkv", "pyramidkv", "ada-snapkv", "knorm"])
def test_prefill_only_method_gives_each_row_its_own_share(model, method):
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=LENGTH, pad=PAD)
    cache = kvhive.make_cache(model, method, RATIO)
    logits = prefill_and_decode(model, cache, input_ids, attention_mask, steps=3)
    kept = cache.kept_tokens()
    per_row = {index: counts.sum(dim=-1).tolist() for index, counts in kept.items()}
    heads = next(iter(kept.values())).shape[1]
    solo_kept = {}
    for row, _offset, alone in solo_runs(
        model, lambda: kvhive.make_cache(model, method, RATIO), input_ids, attention_mask, [0, PAD], 3, logits
    ):
        solo_kept[row] = {index: counts.sum().item() for index, counts in alone.kept_tokens().items()}
    for index, rows in per_row.items():
        assert rows == [solo_kept[0][index], solo_kept[1][index]], (method, index)
    if method == "snapkv":  # uniform split: the prompt's share plus the 3 decoded tokens, per head
        assert per_row[min(per_row)] == [(50 + 3) * heads, (35 + 3) * heads]


@pytest.mark.parametrize("method", ["h2o", "tova", "streamingllm"])
def test_decode_phase_method_refuses_rows_whose_ratio_differs(model, method):
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=LENGTH, pad=PAD)
    cache = kvhive.make_cache(model, method, RATIO)
    with pytest.raises(ValueError, match=r"ratio=0\.5 of rows with \[100, 70\] real tokens is \[50, 35\] tokens"):
        prefill_and_decode(model, cache, input_ids, attention_mask, steps=1)


@pytest.mark.parametrize("method", ["h2o", "tova"])
def test_decode_phase_method_with_a_ratio_on_equal_rows_matches_solo_runs(model, method):
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=LENGTH, pad=0)
    cache = kvhive.make_cache(model, method, RATIO)
    logits = prefill_and_decode(model, cache, input_ids, attention_mask, steps=3)
    for _row, _offset, alone in solo_runs(
        model, lambda: kvhive.make_cache(model, method, RATIO), input_ids, attention_mask, [0, 0], 3, logits
    ):
        assert alone.mean_kept_per_head() == cache.mean_kept_per_head() == 50


def test_shortest_row_below_the_minimum_is_named(model):
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=LENGTH, pad=PAD)
    # SnapKV needs its observation window (32 tokens per head by default): 0.4 of 70 is 28.
    cache = kvhive.make_cache(model, "snapkv", 0.4)
    with pytest.raises(ValueError, match=r"row 1 of the batch: invalid budget: ratio=0\.4 of a 70-token prompt"):
        prefill_and_decode(model, cache, input_ids, attention_mask, steps=0)
