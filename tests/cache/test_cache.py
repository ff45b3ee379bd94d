"""The foundation: per-head variable-length storage, phases, positions, sliding layers, inputs."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

import kvhive
from kvhive.api import plain_attention
from kvhive.cache import Budget, KVHiveCache
from kvhive.cache.storage import PAGE_TOKENS, SEGMENT_RESERVE_TOKENS
from kvhive.compat import cache_kwarg
from kvhive.methods.base import PREFILL, Policy, PolicyConfig
from kvhive.models import TINY_ARCHITECTURES, tiny_model

from helpers import left_padded_batch, materialised_mask, prefill_and_decode, reference_logits


@dataclass(frozen=True)
class FixedMaskConfig(PolicyConfig):
    pass


class FixedMask(Policy):
    """Test policy: keeps a given per-head mask after prefill (rows of different lengths)."""

    name = "fixed-mask"
    phases = frozenset({PREFILL})
    config_class = FixedMaskConfig

    def __init__(self, keep_by_layer: dict[int, torch.Tensor]):
        super().__init__()
        self.keep_by_layer = keep_by_layer

    def select_prefill(self, scoring, budget, state):
        return self.keep_by_layer[scoring.layer_index].clone()


def uneven_masks(model, batch: int, length: int, seed: int = 0) -> dict[int, torch.Tensor]:
    """A random keep mask per layer where every (batch, head) row keeps a different count."""
    config = model.config
    heads = config.num_key_value_heads
    generator = torch.Generator().manual_seed(seed)
    masks = {}
    for layer in range(config.num_hidden_layers):
        mask = torch.zeros(batch, heads, length, dtype=torch.bool)
        for b in range(batch):
            for h in range(heads):
                count = 3 + (b * heads + h) * 2 + layer
                chosen = torch.randperm(length - 1, generator=generator)[: count - 1]
                mask[b, h, chosen] = True
                mask[b, h, -1] = True  # every row sees the newest prompt token
        masks[layer] = mask
    return masks


_EVICTED: dict[int, torch.Tensor] = {}


def masked_reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Plain sdpa on an uncompressed cache, with evicted entries masked per head (the reference)."""
    evicted = _EVICTED[module.layer_idx]  # [B, Hkv, N_prompt]
    batch, kv_heads, length, _ = key.shape
    group = query.shape[1] // kv_heads
    allowed = attention_mask.expand(batch, kv_heads, query.shape[2], length).clone()
    prompt = evicted.shape[-1]
    if query.shape[2] < length:  # decode: the prompt part of the keys is cut per head
        allowed[..., :prompt] &= ~evicted[:, :, None, :]
    allowed = allowed.repeat_interleave(group, dim=1)
    return sdpa_attention_forward(module, query, key, value, allowed, dropout=dropout, scaling=scaling, **kwargs)


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
@pytest.mark.parametrize("attention", ["mha", "gqa"])
def test_variable_length_heads_free_memory_and_match_masked_reference(architecture, attention):
    model = tiny_model(architecture, attention)
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=24, pad=5)
    masks = uneven_masks(model, batch=2, length=24)
    # Never keep padding, so the reference and the compressed run see the same keys.
    for mask in masks.values():
        mask &= attention_mask.bool()[:, None, :]
        mask[:, :, -1] = True

    cache = kvhive.make_cache(model, FixedMask(masks), budget=20)
    forced = [torch.randint(3, 200, (2, 1), generator=torch.Generator().manual_seed(s)) for s in range(10)]
    logits = prefill_and_decode(model, cache, input_ids, attention_mask, steps=10, forced_tokens=forced)

    for layer_index, layer in enumerate(cache.layers):
        expected = masks[layer_index].sum(-1) + 10  # kept prompt tokens + 10 decoded ones
        assert torch.equal(layer.lengths, expected)
        assert not layer.is_uniform
        stored = int(layer.lengths.sum())
        assert layer.stored_keys().shape[0] == stored  # nothing padded: one row per kept entry
        assert layer.nbytes() == stored * layer.bytes_per_token()
        # Allocated: the kept entries plus each segment's bounded append reserve, rounded up to
        # whole pages (at most one partly filled page per segment).
        reserve = SEGMENT_RESERVE_TOKENS + PAGE_TOKENS - 1
        assert layer.reserved_nbytes() <= (stored + layer.num_segments * reserve) * layer.bytes_per_token()
    total_kept = sum(int(v.sum()) for v in cache.kept_tokens().values())
    assert cache.nbytes() == total_kept * cache.layers[0].bytes_per_token()

    _EVICTED.clear()
    _EVICTED.update({i: ~m for i, m in masks.items()})
    AttentionInterface.register("masked_reference", masked_reference_attention)
    AttentionMaskInterface.register("masked_reference", materialised_mask)
    model.set_attn_implementation("masked_reference")
    reference = prefill_and_decode(
        model, DynamicCache(config=model.config), input_ids, attention_mask, steps=10, forced_tokens=forced
    )
    model.set_attn_implementation("sdpa")
    # The prompt's last logits come from the uncompressed prefill in both runs.
    assert (logits - reference).abs().max() <= 1e-5


def test_storage_append_keeps_segments_in_order():
    model = tiny_model("llama", "gqa")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=12, pad=0)
    masks = uneven_masks(model, batch=2, length=12, seed=3)
    cache = kvhive.make_cache(model, FixedMask(masks), budget=10)
    prefill_and_decode(model, cache, input_ids, attention_mask, steps=3)
    layer = cache.layers[0]
    offsets = layer.segment_offsets()
    for segment in range(layer.lengths.numel()):
        positions = layer.stored_flat_positions()[offsets[segment] : offsets[segment + 1]]
        b, h = divmod(segment, layer.num_heads)
        kept = masks[0][b, h].nonzero().flatten()
        assert positions.tolist() == kept.tolist() + [12, 13, 14]


def test_a_layer_is_dense_then_packed_then_dense_again_as_one_object():
    # A layer's layout is an object of its own; a layer changes layout (not identity) when its rows
    # keep different counts, so the cache and attention keep their reference, and a reset makes it dense.
    import copy

    from kvhive.cache.layers import GrowingLayout, PackedLayout
    from kvhive.cache.storage import LayerStore

    store = LayerStore(0)
    assert type(store) is LayerStore and type(store.layout) is GrowingLayout
    keys, values = torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4)
    store.update(keys, values)
    with pytest.raises(RuntimeError, match="is dense: packed"):
        store.packed()
    mask = torch.zeros(1, 2, 10, dtype=torch.bool)
    mask[0, 0, :3] = True
    mask[0, 1, 4:9] = True
    layer = store
    store.keep(mask)
    assert store is layer and type(store.layout) is PackedLayout and not store.is_uniform
    assert store.lengths_host.tolist() == [[3, 5]]
    assert torch.equal(store.stored_keys(), torch.cat([keys[0, 0, :3], keys[0, 1, 4:9]]))
    with pytest.raises(RuntimeError, match="different number of tokens per head"):
        store.dense()
    with pytest.raises(RuntimeError, match="different number of tokens per head"):
        _ = store.dense_length
    copied = copy.deepcopy(store)
    assert type(copied.layout) is PackedLayout and torch.equal(copied.stored_values(), store.stored_values())
    assert copied.layout.store is copied  # the copy's layout is its own
    store.reset()
    assert type(store.layout) is GrowingLayout and store.num_stored == 0 and store.layout.buffers is None
    assert type(copied.layout) is PackedLayout  # the copy is its own object


@pytest.mark.parametrize("architecture", TINY_ARCHITECTURES)
def test_true_sequence_length_after_eviction_and_generate_positions(architecture):
    model = tiny_model(architecture, "gqa")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=20, pad=3)
    cache = kvhive.make_cache(model, "local", budget=6)
    prefill_and_decode(model, cache, input_ids, attention_mask, steps=4)
    assert cache.get_seq_length() == 24
    full_layers = [i for i, layer in enumerate(cache.layers) if not layer.is_sliding]
    for index in full_layers:
        assert cache.layers[index].num_stored == 2 * cache.layers[index].num_heads * 6
        # sorted: a decode eviction writes the newest token into the freed slot (Policy.reads_stored_order)
        assert sorted(cache.layers[index].dense()[2][0, 0].tolist()) == list(range(18, 24))


@pytest.mark.parametrize("architecture", TINY_ARCHITECTURES)
def test_generate_with_full_budget_matches_plain_generate(architecture):
    model = tiny_model(architecture, "gqa")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=16, pad=4)
    plain = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=8, do_sample=False)
    cache = kvhive.make_cache(model, "h2o", budget=1000)
    compressed = model.generate(
        input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, max_new_tokens=8, do_sample=False
    )
    model.set_attn_implementation("sdpa")
    assert torch.equal(plain, compressed)


def test_sliding_layers_keep_their_window_and_match_transformers():
    model = tiny_model("gemma3", "gqa")
    window = model.config.sliding_window
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=3 * window, pad=2)
    reference = reference_logits(model, input_ids, attention_mask, steps=6)
    cache = kvhive.make_cache(model, "full")
    logits = prefill_and_decode(model, cache, input_ids, attention_mask, steps=6)
    assert (logits - reference).abs().max() <= 1e-5
    for layer in cache.layers:
        if layer.is_sliding:
            assert torch.all(layer.lengths == window - 1)
        else:
            assert torch.all(layer.lengths == 3 * window + 6)
    assert cache.full_cache_nbytes() == cache.nbytes()


@pytest.mark.parametrize("method", ["full", "snapkv"])
def test_a_sliding_layer_after_a_long_prompt_frees_all_but_its_window(method):
    # A 300-token prompt over an 8-token window: a sliding layer keeps 7 tokens, and its buffers
    # must be the window plus the append reserve, not the prompt's 300 tokens (the model's own cache
    # keeps only the window: kvhive held ~4x its bytes on Gemma 3 at 15k tokens before).
    from kvhive.cache.storage import reserve

    model = tiny_model("gemma3", "gqa")
    window = model.config.sliding_window
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=300, pad=3)
    cache = kvhive.make_cache(model, method, budget=None if method == "full" else 48)
    key = cache_kwarg(model)
    with torch.no_grad():
        output = model(input_ids=input_ids, attention_mask=attention_mask, **{key: cache}, use_cache=True)
    sliding = [layer for layer in cache.layers if layer.is_sliding]
    assert sliding
    held = (window - 1) + reserve(window - 1)
    for layer in sliding:
        assert torch.all(layer.lengths == window - 1)
        # key and value buffers of 2 rows x KV heads x (window + reserve) tokens
        assert layer.reserved_nbytes() == 2 * model.config.num_key_value_heads * held * layer.bytes_per_token()
    # Decoding: the window slides in the same buffers (no reallocation at a steady step).
    pointers = [layer.dense()[0].data_ptr() for layer in sliding]
    mask = attention_mask
    with torch.no_grad():
        for _ in range(4):
            token = output.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, mask.new_ones(2, 1)], dim=1)
            output = model(input_ids=token, attention_mask=mask, **{key: cache}, use_cache=True)
    assert [layer.dense()[0].data_ptr() for layer in sliding] == pointers
    assert all(
        layer.reserved_nbytes() == 2 * model.config.num_key_value_heads * held * layer.bytes_per_token()
        for layer in sliding
    )


@pytest.mark.parametrize("ratio", [0.3, 0.5, 0.7])
@pytest.mark.parametrize("method", ["snapkv", "tova", "subgen"])
def test_a_prefill_compression_frees_what_it_drops_at_any_budget(method, ratio):
    # The buffers after a prefill hold the kept tokens plus the append reserve, whatever share of
    # the prompt is kept: a compaction re-allocates only below half (for decode steps), so budgets of
    # half the prompt or more used to keep buffers of the whole prompt (nothing freed).
    from kvhive.cache.storage import reserve

    model = tiny_model("llama", "gqa")
    input_ids = torch.randint(3, model.config.vocab_size, (1, 600), generator=torch.Generator().manual_seed(0))
    cache = kvhive.make_cache(model, method, ratio=ratio)
    with torch.no_grad():
        model(input_ids=input_ids, **{cache_kwarg(model): cache}, use_cache=True)
    kept = int(600 * ratio)
    for layer in cache.layers:
        assert torch.all(layer.lengths == kept)
        tokens = model.config.num_key_value_heads * (kept + reserve(kept))
        assert layer.reserved_nbytes() == tokens * layer.bytes_per_token(), (method, ratio)
    assert cache.reserved_nbytes() < cache.full_cache_nbytes() * (ratio + 0.12)


def test_a_decode_capacity_is_the_kept_tokens_plus_its_room_not_the_prompt():
    # A prefill-only method decoding in a fixed capacity (compiled decode asks for one): the
    # capacity follows what is kept, so a longer prompt at the same kept count is the same graph,
    # and the prompt's buffers are freed (at 0.7 of 600 tokens they were kept as the capacity).
    from kvhive.cache.storage import reserve

    model = tiny_model("llama", "gqa")
    key = cache_kwarg(model)
    capacities = []
    for length in (600, 700):
        input_ids = torch.randint(3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
        cache = kvhive.make_cache(model, "snapkv", budget=420, decode_capacity=16)
        with torch.no_grad():
            model(input_ids=input_ids, **{key: cache}, use_cache=True)
        for layer in cache.layers:
            assert layer.fixed_capacity and torch.all(layer.lengths == 420)
            tokens = model.config.num_key_value_heads * (420 + max(reserve(420), 16))
            assert layer.reserved_nbytes() == tokens * layer.bytes_per_token()
        capacities.append([layer.decode_view()[0].shape[2] for layer in cache.layers])
    assert capacities[0] == capacities[1]


def test_compress_sliding_layers_on_request():
    model = tiny_model("gemma3", "gqa")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=20, pad=0)
    cache = kvhive.make_cache(model, "streamingllm", budget=6, compress_sliding=True, sink=2)
    prefill_and_decode(model, cache, input_ids, attention_mask, steps=5)
    for layer in cache.layers:
        assert torch.all(layer.lengths == 6)
    default = kvhive.make_cache(model, "streamingllm", budget=6, sink=2)
    prefill_and_decode(model, default, input_ids, attention_mask, steps=5)
    assert [int(layer.lengths[0, 0]) for layer in default.layers] == [
        6 if not layer.is_sliding else model.config.sliding_window - 1 for layer in default.layers
    ]


def test_decode_schedule_every_and_slack():
    model = tiny_model("llama", "gqa")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=10, pad=0)
    every = kvhive.make_cache(model, "local", budget=8, decode_every=4)
    lengths = []
    output = model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=every, use_cache=True)
    for _ in range(8):
        output = model(input_ids=output.logits[:, -1:].argmax(-1), past_key_values=every, use_cache=True)
        lengths.append(int(every.layers[0].lengths[0, 0]))
    assert lengths == [9, 10, 11, 8, 9, 10, 11, 8]
    slack = kvhive.make_cache(model, "local", budget=8, decode_slack=2)
    output = model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=slack, use_cache=True)
    lengths = []
    for _ in range(6):
        output = model(input_ids=output.logits[:, -1:].argmax(-1), past_key_values=slack, use_cache=True)
        lengths.append(int(slack.layers[0].lengths[0, 0]))
    assert lengths == [9, 10, 8, 9, 10, 8]


def test_statistics_and_accounting():
    model = tiny_model("llama", "mha")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=30, pad=0)
    cache = kvhive.make_cache(model, "local", budget=10)
    prefill_and_decode(model, cache, input_ids, attention_mask, steps=0)
    stats = cache.statistics()
    per_token = cache.layers[0].bytes_per_token()
    heads = model.config.num_key_value_heads
    layers = model.config.num_hidden_layers
    assert stats["kept_tokens_total"] == 2 * heads * layers * 10
    assert stats["cache_bytes"] == stats["kept_tokens_total"] * per_token
    assert stats["full_cache_bytes"] == 2 * heads * layers * 30 * per_token
    assert stats["layer_budgets"] == {str(i): 10 for i in range(layers)}


def test_ratio_budget_resolves_against_the_prompt():
    model = tiny_model("llama", "gqa")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=40, pad=0)
    cache = kvhive.make_cache(model, "local", ratio=0.25)
    prefill_and_decode(model, cache, input_ids, attention_mask, steps=0)
    assert all(int(layer.lengths[0, 0]) == 10 for layer in cache.layers)


def test_context_manager_restores_attention_implementation():
    model = tiny_model("llama", "gqa")
    assert model.config._attn_implementation == "sdpa"
    with kvhive.compression(model):
        assert model.config._attn_implementation == "kvhive"
    assert model.config._attn_implementation == "sdpa"
    kvhive.make_cache(model, "local", budget=8)  # leaves the model's implementation (issue 27 item 7)
    assert model.config._attn_implementation == "sdpa"
    with kvhive.compression(model), plain_attention(model):
        assert model.config._attn_implementation == "sdpa"
    assert model.config._attn_implementation == "sdpa"


def test_kvhive_attention_with_another_cache_is_plain_sdpa():
    model = tiny_model("qwen2", "gqa")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=12, pad=2)
    reference = reference_logits(model, input_ids, attention_mask, steps=3)
    with kvhive.compression(model):
        logits = prefill_and_decode(model, DynamicCache(config=model.config), input_ids, attention_mask, steps=3)
    assert (logits - reference).abs().max() <= 1e-5


# -- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -3, True])
def test_budget_tokens_must_be_positive(value):
    model = tiny_model("llama", "gqa")
    with pytest.raises(ValueError, match="budget"):
        kvhive.make_cache(model, "local", budget=value)


@pytest.mark.parametrize("value", [0.0, 1.5, -0.1, math.nan])
def test_ratio_must_be_in_unit_interval(value):
    model = tiny_model("llama", "gqa")
    with pytest.raises(ValueError, match=r"ratio.*\(0, 1\]"):
        kvhive.make_cache(model, "local", ratio=value)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        kvhive.make_cache(model, "local", budget=value)


def test_budget_strings_parse_or_fail_clearly():
    assert Budget.parse("128") == Budget(tokens=128)
    assert Budget.parse("0.25") == Budget(ratio=0.25)
    with pytest.raises(ValueError, match="budget"):
        Budget.parse("lots")
    with pytest.raises(ValueError, match="budget"):
        Budget.parse("nan")


def test_unknown_method_and_parameter():
    model = tiny_model("llama", "gqa")
    with pytest.raises(ValueError, match="unknown method='nope'.*snapkv"):
        kvhive.make_cache(model, "nope", budget=8)
    with pytest.raises(ValueError, match="unknown parameter.*'windw'"):
        kvhive.make_cache(model, "snapkv", budget=64, windw=3)


def test_budget_below_method_minimum():
    model = tiny_model("llama", "gqa")
    with pytest.raises(ValueError, match="budget=8.*snapkv.*at least 32"):
        kvhive.make_cache(model, "snapkv", budget=8)


@pytest.mark.parametrize("name,value", [("decode_every", 0), ("decode_slack", -1)])
def test_schedule_parameters(name, value):
    model = tiny_model("llama", "gqa")
    with pytest.raises(ValueError, match=name):
        kvhive.make_cache(model, "local", budget=8, **{name: value})


def test_empty_and_too_long_prompts():
    from kvhive.models import tiny_tokenizer

    model, tokenizer = tiny_model("llama", "gqa"), tiny_tokenizer()
    with pytest.raises(ValueError, match="prompt"):
        kvhive.generate(model, tokenizer, "   ", "local", 8)
    too_long = "a" * (model.config.max_position_embeddings + 1)
    with pytest.raises(ValueError, match="prompt.*context length"):
        kvhive.generate(model, tokenizer, too_long, "local", 8)
    with pytest.raises(ValueError, match="max_new_tokens"):
        kvhive.generate(model, tokenizer, "hello", "local", 8, max_new_tokens=0)


def test_cache_refuses_rollback():
    model = tiny_model("llama", "gqa")
    cache = KVHiveCache(model.config, kvhive.make_policy("local"), 8)
    with pytest.raises(ValueError, match="'local' evicts while decoding, so its cache cannot be rolled back"):
        cache.crop(-1)


@pytest.mark.parametrize("method", ["h2o", "snapkv", "streamingllm"])
def test_compressed_sliding_layers_never_keep_more_than_their_window(method):
    # Budget 40 over a 7-token window: the sliding layers used to keep 40 tokens (2.6x the bytes,
    # same outputs); the window bounds them, so they keep exactly what transformers' cache keeps.
    model = tiny_model("gemma3", "gqa")
    window = model.config.sliding_window
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=60, pad=0)
    cache = kvhive.make_cache(model, method, budget=40, compress_sliding=True)
    logits = prefill_and_decode(model, cache, input_ids, attention_mask, steps=6)
    for layer in cache.layers:
        if layer.is_sliding:
            assert int(layer.lengths_host.max()) <= window - 1, (method, layer.layer_index)
    # The full-attention layers hold 40 (decode methods) or 40 + 6 (prefill-only) tokens, as before.
    assert all(int(layer.lengths_host.max()) <= 46 for layer in cache.layers if not layer.is_sliding)
    # Exactly as leaving the sliding layers to the model's own window.
    plain = kvhive.make_cache(model, method, budget=40)
    assert torch.allclose(logits, prefill_and_decode(model, plain, input_ids, attention_mask, steps=6), atol=1e-5)


def test_prefill_only_method_on_a_compressed_sliding_layer_stays_within_the_window():
    # Budget 4 < window: SnapKV cuts the prompt to 4, then decoding appends; the window still bounds it.
    model = tiny_model("gemma3", "gqa")
    window = model.config.sliding_window
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=60, pad=0)
    cache = kvhive.make_cache(model, "knorm", budget=4, compress_sliding=True)
    prefill_and_decode(model, cache, input_ids, attention_mask, steps=2 * window)
    for layer in cache.layers:
        if layer.is_sliding:
            assert int(layer.lengths_host.max()) <= window - 1
