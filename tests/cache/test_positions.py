"""positions="cache": kept keys re-rotated to contiguous positions (StreamingLLM-style streaming)."""

from __future__ import annotations

import pytest
import torch

import kvhive
from kvhive.attention.rope import KeyRotator
from kvhive.models import tiny_model

from helpers import left_padded_batch


def _one_layer(architecture: str):
    overrides = {"num_hidden_layers": 1, "max_position_embeddings": 64}
    if architecture == "gemma3":
        overrides["layer_types"] = ["full_attention"]
    return tiny_model(architecture, "gqa", **overrides)


@pytest.mark.parametrize("architecture", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("method", ["streamingllm", "local"])  # the same kept set in every head
def test_reindexed_stream_equals_fresh_forward_over_kept_tokens(architecture, method):
    """With one layer a key depends only on its token and position, so attending the re-indexed
    cache must equal a fresh forward over the attended tokens at positions 0..L. The stream runs
    to twice the model's trained length."""
    model = _one_layer(architecture)
    tokens = torch.randint(3, 250, (1, 128), generator=torch.Generator().manual_seed(0))
    cache = kvhive.make_cache(model, method, budget=12, positions="cache")
    worst, previous = 0.0, None
    with torch.no_grad():
        for step in range(tokens.shape[1]):
            output = model(input_ids=tokens[:, step : step + 1], past_key_values=cache, use_cache=True)
            if previous is not None and len(previous) >= 12:
                attended = sorted(set(previous) | {step})
                reference = model(input_ids=tokens[:, attended]).logits[:, -1]
                worst = max(worst, float((reference - output.logits[:, -1]).abs().max()))
            previous = cache.layers[0].dense()[2][0, 0].tolist()
    assert worst <= 1e-5
    assert cache.get_seq_length() == 12
    assert cache.layers[0].tokens_seen == 128


def test_original_positions_are_the_default_and_match_when_nothing_is_evicted():
    model = tiny_model("llama", "gqa")
    tokens = torch.randint(3, 250, (1, 20), generator=torch.Generator().manual_seed(1))
    logits = {}
    for positions in ("original", "cache"):
        cache = kvhive.make_cache(model, "streamingllm", budget=64, positions=positions)
        with torch.no_grad():
            logits[positions] = torch.stack(
                [
                    model(input_ids=tokens[:, t : t + 1], past_key_values=cache, use_cache=True).logits[0, -1]
                    for t in range(tokens.shape[1])
                ]
            )
    assert (logits["original"] - logits["cache"]).abs().max() <= 1e-5


def test_rotations_compose():
    model = tiny_model("llama", "gqa")
    rotator = KeyRotator(model)
    keys = torch.randn(1, 2, 5, 16)
    there = rotator.rotate(0, keys, torch.full((1, 2, 5), 7.0))
    back = rotator.rotate(0, rotator.rotate(0, there, torch.full((1, 2, 5), -3.0)), torch.full((1, 2, 5), -4.0))
    assert torch.allclose(back, keys, atol=1e-5)
    assert not torch.allclose(there, keys)


def test_invalid_positions_option():
    model = tiny_model("llama", "gqa")
    with pytest.raises(ValueError, match="positions"):
        kvhive.make_cache(model, "local", budget=8, positions="relative")


def test_positions_cache_refuses_a_left_padded_batch():
    # The padding mask used to be dropped: the padded row's logits were off by 0.24 even with "full".
    model = tiny_model("llama", "gqa")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=12, pad=3)
    cache = kvhive.make_cache(model, "full", positions="cache")
    with torch.no_grad(), pytest.raises(ValueError, match=r"positions='cache' does not support padded.*row\(s\) \[1\]"):
        model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
    # Without padding (all-ones mask) the batch runs, and each row equals its solo run.
    ones = torch.ones_like(input_ids)
    batched = kvhive.make_cache(model, "local", budget=6, positions="cache")
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=ones, past_key_values=batched, use_cache=True).logits[:, -1]
        for row in range(2):
            solo = kvhive.make_cache(model, "local", budget=6, positions="cache")
            alone = model(input_ids=input_ids[row : row + 1], past_key_values=solo, use_cache=True).logits[:, -1]
            assert torch.allclose(logits[row], alone[0], atol=1e-5)
