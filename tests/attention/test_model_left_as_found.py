"""kvhive leaves the user's model as it found it (issue 27 item 7): after ``make_cache`` a call
without a kvhive cache runs the model's own attention implementation, mask and
``prepare_inputs_for_generation`` (so ``generate(inputs_embeds=...)`` works), and a call with a
kvhive cache runs kvhive's attention whatever the model is configured with."""

from __future__ import annotations

import copy
import inspect
import pickle

import pytest
import torch
from transformers import AttentionInterface, AttentionMaskInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

import kvhive
from kvhive.models import tiny_model

SPY = "kvhive-test-spy"
_SPY_CALLS: list[int] = []


def _spy_attention(module, query, key, value, attention_mask, **kwargs):
    _SPY_CALLS.append(module.layer_idx)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _spied_model(architecture: str = "llama"):
    AttentionInterface.register(SPY, _spy_attention)
    AttentionMaskInterface.register(SPY, sdpa_mask)
    model = tiny_model(architecture, "gqa")
    model.set_attn_implementation(SPY)
    return model


def _ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 250, (1, length), generator=torch.Generator().manual_seed(seed))


def _stock_behaviour(model, ids):
    """What a user sees from calls without a kvhive cache: the configured implementation, the
    signature transformers inspects, and the outputs of forward and generate (ids and embeddings)."""
    _SPY_CALLS.clear()
    with torch.no_grad():
        logits = model(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True).logits
        from_ids = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
        embeddings = model.get_input_embeddings()(ids)
        from_embeddings = model.generate(inputs_embeds=embeddings, max_new_tokens=4, do_sample=False)
    return {
        "implementation": model.config._attn_implementation,
        "signature": inspect.signature(model.prepare_inputs_for_generation),
        "logits": logits,
        "from_ids": from_ids,
        "from_embeddings": from_embeddings,
        "own_attention_calls": len(_SPY_CALLS),
    }


@pytest.mark.parametrize("architecture", ["llama", "gemma3"])
def test_calls_without_a_kvhive_cache_behave_as_before_make_cache(architecture):
    model = _spied_model(architecture)
    ids = _ids(12)
    before = _stock_behaviour(model, ids)
    assert before["own_attention_calls"] > 0
    cache = kvhive.make_cache(model, "h2o", budget=4)
    after_make_cache = _stock_behaviour(model, ids)
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=4)
    after_kvhive_generate = _stock_behaviour(model, ids)
    for after in (after_make_cache, after_kvhive_generate):
        assert after.keys() == before.keys()
        for key, value in before.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(after[key], value), key
            else:
                assert after[key] == value, key


def test_a_kvhive_cache_runs_kvhive_attention_whatever_the_model_is_configured_with():
    model = _spied_model()
    cache = kvhive.make_cache(model, "h2o", budget=4)
    _SPY_CALLS.clear()
    with torch.no_grad():
        model(input_ids=_ids(20), past_key_values=cache, use_cache=True)
    assert _SPY_CALLS == []  # kvhive's attention ran, not the model's
    assert [int(length) for length in cache.layers[0].lengths_host.reshape(-1)] == [4, 4]  # compressed
    assert model.config._attn_implementation == SPY  # and the model's implementation is back


def test_generate_from_embeddings_with_a_kvhive_cache():
    model = tiny_model("llama", "gqa")
    ids = _ids(20)
    cache = kvhive.make_cache(model, "h2o", budget=6)
    reference = kvhive.make_cache(model, "h2o", budget=6)
    with torch.no_grad():
        embeddings = model.get_input_embeddings()(ids)
        from_embeddings = model.generate(inputs_embeds=embeddings, past_key_values=cache, max_new_tokens=5)
        from_ids = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=reference, max_new_tokens=5)
    assert torch.equal(from_embeddings, from_ids[:, ids.shape[1] :])
    assert cache.statistics()["kept_tokens_per_layer"] == reference.statistics()["kept_tokens_per_layer"]
    assert cache.get_seq_length() == ids.shape[1] + 4


def test_an_attached_model_still_pickles_and_its_copy_checks_its_own_caches():
    model = tiny_model("llama", "gqa")
    kvhive.make_cache(model, "h2o", budget=8)
    restored = pickle.loads(pickle.dumps(model))
    copied = copy.deepcopy(model)
    for other in (restored, copied):
        cache = kvhive.make_cache(other, "h2o", budget=8)
        with torch.no_grad():
            other.generate(_ids(20), attention_mask=torch.ones(1, 20, dtype=torch.long), past_key_values=cache)
        assert cache.layers[0].lengths_host.max() <= 8 + 1
        with pytest.raises(ValueError, match="does not start with the"):
            other.generate(_ids(40, seed=5), attention_mask=torch.ones(1, 40, dtype=torch.long), past_key_values=cache)
