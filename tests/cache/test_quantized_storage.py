"""Quantized storage (``kv_bits``): kept keys and values held as int8 or packed int4 codes with scales.

Bytes held are the formula exactly; int4 at four times the budget holds no more than float16 at the
budget plus the stated scales; a covering budget at int8 stays within a stated tolerance of the
unquantized cache; every method runs both phases; the decode attention reads the byte buffers a block
at a time; a steady step reads nothing back and compiles to one graph.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._dynamo.utils import counters

import kvhive
from kvhive.attention import quantized_decode
from kvhive.attention.quantized_decode import BLOCK_TOKENS, blockwise_attention
from kvhive.cache.layers.quantized import SCALE_BYTES, KVCodec, dequantize_rows, quantize_rows, row_bytes
from kvhive.diagnostics import HostReadCounter
from kvhive.methods.registry import method_names, policy_class
from kvhive.models import tiny_model

PROMPT = 160
HEAD_DIM = 16  # the tiny models' key and value head size
# Covering budget, kv_bits=8, float32 tiny Llama: the largest logit difference to the unquantized cache
# over the prompt and 8 greedy steps, relative to the largest logit (stated in docs/DESIGN.md).
INT8_LOGIT_TOLERANCE = 2e-3


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return tiny_model("llama", "gqa", dtype=dtype)


def _prompt(model, length=PROMPT, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (1, length), generator=generator)


def _cache(model, method, budget, kv_bits, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if method == "full":
            return kvhive.make_cache(model, method, kv_bits=kv_bits, **options)
        return kvhive.make_cache(model, method, budget=budget, kv_bits=kv_bits, **options)


@torch.no_grad()
def _run(model, cache, steps=8, prompt=None):
    prompt = _prompt(model) if prompt is None else prompt
    logits = model(input_ids=prompt, past_key_values=cache, use_cache=True).logits[:, -1:]
    collected = [logits]
    for _ in range(steps):
        logits = model(input_ids=logits.argmax(-1), past_key_values=cache, use_cache=True).logits[:, -1:]
        collected.append(logits)
    return torch.cat(collected, dim=1)


# -- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [3, 2, 16, 0, "8", 8.0, True])
def test_unsupported_bits_are_refused_naming_kv_bits(bits):
    with pytest.raises(ValueError, match=r"kv_bits=.*expected one of 4, 8"):
        kvhive.make_cache(_model(), "snapkv", budget=32, kv_bits=bits)


def test_int4_refuses_an_odd_head_size_naming_kv_bits():
    keys = torch.randn(1, 2, 5, 15)
    with pytest.raises(ValueError, match=r"kv_bits=4 .*head sizes must be even.*kv_bits=8"):
        KVCodec(4).encode(keys, keys)
    KVCodec(8).encode(keys, keys)  # int8 serves any head size


def test_an_unsupported_model_dtype_is_refused_naming_kv_bits():
    model = _model().to(torch.float64)
    cache = _cache(model, "snapkv", 32, 8)
    with pytest.raises(ValueError, match=r"kv_bits=8 needs a float32, float16 or bfloat16 model"):
        _run(model, cache, steps=0)


def test_positions_cache_and_stacking_are_refused_naming_kv_bits():
    model = _model()
    with pytest.raises(ValueError, match="kv_bits=4 is not supported with positions='cache'"):
        kvhive.make_cache(model, "streamingllm", budget=32, kv_bits=4, positions="cache")
    cache = _cache(model, "snapkv", 32, 8)
    _run(model, cache, steps=0)
    with pytest.raises(ValueError, match="kv_bits=8 cannot be stacked"):
        kvhive.KVHiveCache.stack([cache, cache])


# -- the codec ------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [4, 8])
def test_rows_round_trip_within_half_a_step(bits):
    x = torch.randn(3, 2, 7, 32) * torch.linspace(0.1, 10, 32)
    rows = quantize_rows(x, bits)
    assert rows.dtype == torch.uint8 and rows.shape[-1] == row_bytes(32, bits) == SCALE_BYTES + 32 * bits // 8
    step = (x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)) / ((1 << bits) - 1)
    error = (dequantize_rows(rows, bits, 32) - x).abs()
    assert bool((error <= step * 0.5 + 1e-3 * step + 1e-6).all())


# -- bytes held -----------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(
    ("method", "budget"),
    [("full", None), ("snapkv", 32), ("snapkv", 64), ("h2o", 24), ("streamingllm", 40), ("ada-snapkv", 40)],
)
def test_bytes_held_are_the_formula_exactly(method, budget, bits):
    model = _model()
    cache = _cache(model, method, budget, bits)
    _run(model, cache)
    kept = sum(int(v.sum()) for v in cache.kept_tokens().values())
    per_token = row_bytes(HEAD_DIM, bits) * 2  # key row + value row: codes + scale and minimum
    assert per_token == 2 * (SCALE_BYTES + HEAD_DIM * bits // 8)
    assert cache.nbytes() == kept * per_token
    stats = cache.statistics()
    assert stats["cache_bytes"] == kept * per_token and stats["kv_bits"] == bits
    # Metadata: positions (int32) and per-token scores of the kept tokens, plus the keys' per-channel
    # scales (float32, one per stored head and channel per layer).
    unquantized = _cache(model, method, budget, None)
    _run(model, unquantized)
    assert sum(int(v.sum()) for v in unquantized.kept_tokens().values()) == kept
    channel_scales = sum(layer.num_segments * HEAD_DIM * 4 for layer in cache.layers)
    assert cache.metadata_nbytes() == unquantized.metadata_nbytes() + channel_scales
    assert cache.full_cache_nbytes() == unquantized.full_cache_nbytes()
    # The buffers are bytes: what is reserved is what is counted, codes and scales together.
    for layer in cache.layers:
        keys, values = layer.buffers()
        assert keys.dtype == values.dtype == torch.uint8
        assert keys.shape[-1] == values.shape[-1] == row_bytes(HEAD_DIM, bits)


@pytest.mark.parametrize("method", ["h2o", "tova", "streamingllm"])
def test_int4_at_four_times_the_budget_holds_no_more_than_float16_at_the_budget(method):
    model = _model(torch.float16)
    budget = 12
    fp16 = _cache(model, method, budget, None)
    int4 = _cache(model, method, 4 * budget, 4)
    _run(model, fp16)
    _run(model, int4)
    kept_int4 = sum(int(v.sum()) for v in int4.kept_tokens().values())
    kept_fp16 = sum(int(v.sum()) for v in fp16.kept_tokens().values())
    assert kept_int4 == 4 * kept_fp16
    # The stated metadata: each kept key and value row's float16 scale and minimum.
    assert int4.nbytes() <= fp16.nbytes() + kept_int4 * 2 * SCALE_BYTES
    assert int4.nbytes() == kept_int4 * 2 * (HEAD_DIM // 2 + SCALE_BYTES)


# -- quality ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["full", "snapkv", "h2o", "tova", "ada-snapkv"])
def test_int8_at_a_covering_budget_is_within_the_stated_tolerance(method):
    model = _model()
    reference = _run(model, _cache(model, method, 512, None))
    quantized = _run(model, _cache(model, method, 512, 8))
    relative = (quantized - reference).abs().max() / reference.abs().max()
    assert float(relative) <= INT8_LOGIT_TOLERANCE


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("method", method_names())
def test_every_method_runs_both_phases_quantized(method, bits):
    model = _model()
    budget = max(48, policy_class(method)().minimum_budget())
    reference = _run(model, _cache(model, method, budget, None))
    cache = _cache(model, method, budget, bits)
    quantized = _run(model, cache)
    assert torch.isfinite(quantized).all()
    # Not the same numbers (the codes are lossy), but close: a broken dequantization is far off.
    relative = (quantized - reference).abs().max() / reference.abs().max()
    assert 0 < float(relative) < (0.05 if bits == 8 else 0.25)
    assert all(layer.buffers()[0].dtype == torch.uint8 for layer in cache.layers)


# -- the decode attention -------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [4, 8])
def test_blockwise_attention_equals_attention_over_the_dequantized_cache(bits, monkeypatch):
    torch.manual_seed(1)
    batch, heads, group, length, dim = 2, 2, 3, 2 * BLOCK_TOKENS + 37, 16
    keys, values = torch.randn(batch, heads, length, dim) * 2, torch.randn(batch, heads, length, dim)
    codec = KVCodec(bits)
    key_rows, value_rows = codec.encode(keys, values)
    query = torch.randn(batch, heads * group, 1, dim)
    mask = torch.rand(batch, 1, 1, length) > 0.3
    blocks = []
    dequantize_block = codec.dequantize_block

    def counted(key_rows, value_rows, start, stop):
        blocks.append(stop - start)
        return dequantize_block(key_rows, value_rows, start, stop)

    monkeypatch.setattr(codec, "dequantize_block", counted)
    output, weights, logits, dequantized = blockwise_attention(
        query, codec, key_rows, value_rows, mask, 0.25, True, keep_blocks=True
    )
    assert max(blocks) <= BLOCK_TOKENS and sum(blocks) == length  # never the whole layer at once
    dense_keys = codec.keys_of(key_rows, codec.channel_scale[:, :, None])
    dense_values = codec.values_of(value_rows)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, dense_keys, dense_values, attn_mask=mask, scale=0.25, enable_gqa=True
    )
    torch.testing.assert_close(output, expected.transpose(1, 2), atol=1e-5, rtol=1e-5)
    assert torch.equal(dequantized[0], dense_keys) and torch.equal(dequantized[1], dense_values)
    grouped = query.reshape(batch, heads, group, 1, dim)
    expected_logits = grouped @ dense_keys[:, :, None].transpose(-1, -2) * 0.25
    torch.testing.assert_close(logits, expected_logits, atol=1e-5, rtol=1e-5)
    expected_weights = torch.softmax(expected_logits.masked_fill(~mask[:, :, None], float("-inf")), dim=-1)
    torch.testing.assert_close(weights, expected_weights.reshape(batch, heads * group, length), atol=1e-6, rtol=1e-5)


def test_a_steady_decode_step_reads_the_byte_buffers_blockwise(monkeypatch):
    model = _model()
    cache = _cache(model, "tova", 48, 4)
    _run(model, cache, steps=2)
    calls = []
    original = quantized_decode.blockwise_attention

    def spy(*args, **kwargs):
        calls.append(args[2].dtype)
        return original(*args, **kwargs)

    monkeypatch.setattr(quantized_decode, "blockwise_attention", spy)
    _run(model, cache, steps=1, prompt=torch.tensor([[5]]))
    assert calls and all(dtype == torch.uint8 for dtype in calls)


@pytest.mark.parametrize("method", method_names())
def test_steady_decode_step_with_kv_bits_makes_no_host_read(method):
    model = _model()
    cache = _cache(model, method, 48, 4)
    with torch.no_grad():
        token = model(input_ids=_prompt(model), past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        for _ in range(6):
            token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        with HostReadCounter() as reads:
            model(input_ids=token, past_key_values=cache, use_cache=True)
    assert reads.total == 0, f"{method}: {reads}"


@pytest.mark.parametrize("method", ["tova", "h2o", "streamingllm"])
def test_one_compiled_graph_serves_every_quantized_decode_step(method):
    torch._dynamo.reset()
    counters.clear()
    model = _model()

    def step(token, position, cache):
        return model(input_ids=token, position_ids=position, past_key_values=cache, use_cache=True).logits

    compiled = torch.compile(step, fullgraph=True, dynamic=False, backend="aot_eager")
    prompt = _prompt(model, 96)
    compiled_cache, eager_cache = _cache(model, method, 32, 4), _cache(model, method, 32, 4)
    assert compiled_cache.is_compileable
    with torch._dynamo.config.patch(error_on_recompile=True), torch.no_grad():
        token = model(input_ids=prompt, past_key_values=compiled_cache).logits[:, -1:].argmax(-1)
        model(input_ids=prompt, past_key_values=eager_cache)
        position = torch.full((1, 1), prompt.shape[1])
        for index in range(12):
            compiled_logits = compiled(token, position, compiled_cache)
            eager_logits = step(token, position, eager_cache)
            torch.testing.assert_close(compiled_logits, eager_logits, atol=1e-4, rtol=1e-4, msg=f"step {index}")
            token, position = compiled_logits[:, -1:].argmax(-1), position + 1
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()
