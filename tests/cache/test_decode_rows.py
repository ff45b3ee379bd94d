"""Settings decoded as the rows of one batch (``CacheRows``) give what each setting gives alone.

The evaluation backend decodes all settings of an item together (one weight read per step for
every setting); a row must still be its own cache: the same generated text, the same streaming
NLL and the same cache sizes as decoding that setting by itself.
"""

from __future__ import annotations

import math

import pytest
import torch

import kvhive
from kvhive.cache.rows import CacheRows
from kvhive.evaluation.backend import Setting
from kvhive.evaluation.kvhive_backend import KVHiveBackend
from kvhive.methods.base import DECODE
from kvhive.methods.registry import method_names, policy_class
from kvhive.models import tiny_model, tiny_tokenizer

MODELS = [("llama", "gqa"), ("qwen2", "mha"), ("gemma3", "gqa")]
PROMPT = " ".join(f"w{i % 37} x{(i * 7) % 23}" for i in range(60))


def _settings(methods) -> list[Setting]:
    settings = [Setting("full", 1.0)]
    for name in methods:
        minimum = policy_class(name)().minimum_budget()
        settings.append(Setting(name, minimum + 8))
    return settings


@pytest.mark.parametrize("architecture,attention", MODELS)
def test_generate_rows_equal_settings_alone(architecture, attention):
    model, tokenizer = tiny_model(architecture, attention), tiny_tokenizer()
    settings = _settings([name for name in method_names() if name != "full"])
    batched = KVHiveBackend(model, tokenizer, share_decode=True)
    alone = KVHiveBackend(model, tokenizer, share_decode=False)
    batched_texts = batched.generate(PROMPT, 16, settings)
    alone_texts = alone.generate(PROMPT, 16, settings)
    for setting, a, b in zip(settings, batched_texts, alone_texts, strict=True):
        assert a == b, setting
    assert batched.last_cache_sizes == alone.last_cache_sizes
    # The comparison is not vacuous: the rows held different caches and said different things.
    full_size = batched.last_cache_sizes[0]["mean_kept_per_head"]
    assert all(sizes["mean_kept_per_head"] < full_size for sizes in batched.last_cache_sizes[1:])


@pytest.mark.parametrize("architecture,attention", MODELS)
def test_rows_compute_each_cache_alone(architecture, attention):
    """Forced tokens through every method at once: each row's logits and kept positions equal
    that cache decoded alone (a row served from another row's cache, or a mask of another
    row, would not)."""
    model = tiny_model(architecture, attention)
    settings = _settings([name for name in method_names() if name != "full"])
    generator = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 250, (1, 70), generator=generator)
    steps = torch.randint(3, 250, (12,), generator=generator).tolist()

    def caches():
        made = [kvhive.make_cache(model, s.method, None if s.method == "full" else s.budget) for s in settings]
        kvhive.api.shared_prefill(model, prompt, made)
        return made

    together, alone = caches(), caches()
    with torch.no_grad():
        for token in steps:
            rows = model(
                input_ids=torch.full((len(together), 1), token), past_key_values=CacheRows(together), use_cache=True
            ).logits[:, -1]
            for row, cache in enumerate(alone):
                own = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[:, -1]
                assert (rows[row] - own[0]).abs().max() <= 1e-5, settings[row]
    differing = 0
    for setting, a, b in zip(settings, together, alone, strict=True):
        for layer_a, layer_b in zip(a.layers, b.layers, strict=True):
            assert torch.equal(layer_a.lengths_host, layer_b.lengths_host), setting
            assert torch.equal(layer_a.stored_flat_positions(), layer_b.stored_flat_positions()), setting
        differing += not torch.equal(rows[0], rows[settings.index(setting)])
    assert differing >= len(settings) // 2  # the rows really held different caches


@pytest.mark.parametrize("architecture,attention", MODELS)
def test_streaming_rows_equal_settings_alone(architecture, attention):
    model, tokenizer = tiny_model(architecture, attention), tiny_tokenizer()
    decode_methods = [name for name in method_names() if DECODE in policy_class(name)().phases]
    settings = _settings(decode_methods)
    token_ids = torch.randint(3, 250, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    batched = KVHiveBackend(model, tokenizer, share_decode=True)
    alone = KVHiveBackend(model, tokenizer, share_decode=False)
    batched_nll = batched.streaming_nll(token_ids, settings)
    alone_nll = alone.streaming_nll(token_ids, settings)
    for setting, (a_total, a_count), (b_total, b_count) in zip(settings, batched_nll, alone_nll, strict=True):
        assert a_count == b_count == len(token_ids) - 1, setting
        assert math.isclose(a_total, b_total, rel_tol=1e-5), setting
    assert batched.last_cache_sizes == alone.last_cache_sizes
    assert len({round(total, 3) for total, _ in batched_nll}) > len(settings) // 2


def test_rows_must_be_at_the_same_position():
    model = tiny_model("llama", "gqa")
    short, long = kvhive.make_cache(model, "h2o", 8), kvhive.make_cache(model, "h2o", 8)
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]), past_key_values=short, use_cache=True)
        model(input_ids=torch.tensor([[5, 6, 7, 8]]), past_key_values=long, use_cache=True)
    with pytest.raises(ValueError, match="different numbers of tokens"):
        CacheRows([short, long])


def test_rows_refuse_re_indexed_positions_and_batched_caches():
    model = tiny_model("llama", "gqa")
    with pytest.raises(ValueError, match="positions"):
        CacheRows([kvhive.make_cache(model, "streamingllm", 8, positions="cache")])
    batch = kvhive.make_cache(model, "h2o", 8)
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7], [8, 9, 10]]), past_key_values=batch, use_cache=True)
    with pytest.raises(ValueError, match="one row"):
        CacheRows([batch])
    with pytest.raises(ValueError, match="non-empty"):
        CacheRows([])
