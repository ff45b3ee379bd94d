"""GPU-grade behaviour checked on CPU (and on CUDA where present):

* every method runs in bf16 and fp16; at a covering budget its output matches the plain model in
  the same dtype; at a small budget the bytes held are exactly kept tokens x bytes per token;
* a steady decode step that evicts nothing reads nothing back from the device (counted on CPU
  by wrapping the tensor -> Python conversions; on CUDA by torch's sync debug mode);
* appends cost O(new tokens): the buffers are not re-allocated every step;
* the variable-length attention (blocked torch path, and the Triton kernel on CUDA) equals a
  per-segment reference in every dtype.
"""

from __future__ import annotations

import pytest
import torch

import kvhive
from kvhive.attention.varlen import varlen_attention_torch
from kvhive.cache.storage import MIN_RESERVE_TOKENS
from kvhive.diagnostics import HostReadCounter
from kvhive.methods.base import DECODE
from kvhive.methods.registry import method_names, policy_class
from kvhive.methods.tova import TOVA
from kvhive.models import tiny_model

from helpers import left_padded_batch, prefill_and_decode, reference_logits

LOW_PRECISION = [torch.bfloat16, torch.float16]
# Relative tolerance of last-position logits between two bf16/fp16 runs whose attention sums
# in a different order (the plain model vs kvhive over the same keys): a few bf16 ulps.
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3}
LOSSLESS = [name for name in method_names() if name != "buzz-logn"]
_MODELS: dict = {}


def _model(architecture: str, dtype: torch.dtype, attention: str = "gqa"):
    key = (architecture, attention, dtype)
    if key not in _MODELS:
        _MODELS[key] = tiny_model(architecture, attention, dtype=dtype)
    return _MODELS[key]


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).norm() / expected.float().norm())


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("method", LOSSLESS)
def test_covering_budget_matches_plain_model_in_low_precision(method, dtype):
    model = _model("llama", dtype)
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=40, pad=5)
    reference = reference_logits(model, input_ids, attention_mask, steps=8)
    cache = kvhive.make_cache(model, method, budget=10_000)
    logits = prefill_and_decode(model, cache, input_ids, attention_mask, steps=8)
    model.set_attn_implementation("sdpa")
    assert logits.dtype == dtype and torch.isfinite(logits).all()
    assert _relative(logits, reference) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("method", method_names())
def test_small_budget_in_low_precision_holds_exactly_kept_bytes(method, dtype):
    model = _model("qwen3", dtype)
    policy = policy_class(method)()
    budget = max(policy.minimum_budget(), 12)
    pad = 0 if method.startswith("buzz") else 5  # BUZZ refuses rows of different lengths (issue 9 item 5)
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=budget + 24, pad=pad)
    cache = kvhive.make_cache(model, method, budget=budget)
    logits = prefill_and_decode(model, cache, input_ids, attention_mask, steps=12)
    model.set_attn_implementation("sdpa")
    assert torch.isfinite(logits).all()
    element = torch.tensor([], dtype=dtype).element_size()
    for layer in cache.layers:
        kept = int(layer.lengths_host.sum())
        assert layer.bytes_per_token() == 2 * model.config.head_dim * element
        assert layer.nbytes() == kept * layer.bytes_per_token()
        assert layer.reserved_nbytes() >= layer.nbytes()
    if method != "full":
        assert cache.nbytes() < cache.full_cache_nbytes()


# -- host reads in a steady decode step ------------------------------------------------------------

STEADY_METHODS = {  # method -> budget: prefill-only methods compress; decode-phase methods have room
    "full": None,
    "snapkv": 16,
    "pyramidkv": 16,
    "ada-snapkv": 16,
    "knorm": 16,
    "h2o": 10_000,
    "tova": 10_000,
    "streamingllm": 10_000,
}
WINDOW = {"snapkv": 4, "pyramidkv": 4, "ada-snapkv": 4}


def _steady_decode(model, method, budget, device, length=48):
    input_ids = torch.randint(3, model.config.vocab_size, (2, length), generator=torch.Generator().manual_seed(0))
    input_ids = input_ids.to(device)
    parameters = {"window": WINDOW[method]} if method in WINDOW else {}
    cache = kvhive.make_cache(model, method, budget=budget, **parameters)
    with torch.no_grad():
        output = model(input_ids=input_ids, past_key_values=cache, use_cache=True)
        token = output.logits[:, -1:].argmax(-1)
        for _ in range(3):  # reach the steady state (the first append grows the buffers)
            token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    return cache, token


@pytest.mark.parametrize("method", list(STEADY_METHODS))
def test_steady_decode_step_reads_nothing_back(method):
    model = _model("llama", torch.float32)
    cache, token = _steady_decode(model, method, STEADY_METHODS[method], "cpu")
    if method == "ada-snapkv":
        assert any(not cache.layers[i].is_uniform for i in cache.compressed_layers)
    with torch.no_grad(), HostReadCounter() as counter:
        model(input_ids=token, past_key_values=cache, use_cache=True)
    model.set_attn_implementation("sdpa")
    assert counter.total == 0, f"{method}: host reads in a steady decode step: {dict(counter.reads)}"


def test_host_read_counter_sees_an_eviction_of_undeclared_size():
    # The counter is not blind: a method that does not declare its kept count (kept_per_row None)
    # and decides by a keep mask makes the cache read the counts back once per layer at every eviction.
    class UndeclaredTOVA(TOVA):
        def kept_per_row(self, phase, num_tokens, budget, state):
            return None

        def select_decode_drop(self, scoring, budget, state):
            return None

    model = _model("llama", torch.float32)
    input_ids = torch.randint(3, model.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    cache = kvhive.make_cache(model, UndeclaredTOVA(), budget=16)
    with torch.no_grad():
        token = model(input_ids=input_ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        with HostReadCounter() as counter:
            model(input_ids=token, past_key_values=cache, use_cache=True)
    model.set_attn_implementation("sdpa")
    assert DECODE in cache.policy.phases
    assert counter.reads["cpu"] >= len(cache.compressed_layers), dict(counter.reads)


def test_appends_do_not_reallocate_the_cache_every_step():
    model = _model("llama", torch.float32)
    cache, token = _steady_decode(model, "full", None, "cpu")
    pointers = [layer.buffers()[0].data_ptr() for layer in cache.layers]
    with torch.no_grad():
        for _ in range(5):
            token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    model.set_attn_implementation("sdpa")
    assert [layer.buffers()[0].data_ptr() for layer in cache.layers] == pointers
    assert all(layer.dense_length == 48 + 3 + 5 for layer in cache.layers)


def test_eviction_to_a_small_budget_releases_the_buffers():
    model = _model("llama", torch.float32)
    cache, _ = _steady_decode(model, "snapkv", 16, "cpu", length=400)
    model.set_attn_implementation("sdpa")
    for index in cache.compressed_layers:
        layer = cache.layers[index]
        # 400 prompt tokens were held; the buffer now holds 16 kept + 3 decoded plus its reserve.
        assert layer.capacity <= (16 + MIN_RESERVE_TOKENS) * layer.num_segments
        assert layer.nbytes() == (16 + 3) * layer.num_segments * layer.bytes_per_token()


# -- variable-length attention -----------------------------------------------------------------------


def _segments(lengths, dim, dtype, device, generator):
    total_capacity = int(sum(lengths)) + 7 * len(lengths)
    keys = torch.randn(total_capacity, dim, generator=generator).to(device, dtype)
    values = torch.randn(total_capacity, dim, generator=generator).to(device, dtype)
    starts = torch.tensor([sum(lengths[:i]) + 7 * i for i in range(len(lengths))], dtype=torch.long)
    return keys, values, starts


def _per_segment_reference(rows, keys, values, starts, lengths, scaling):
    outputs = []
    for s, length in enumerate(lengths):
        k = keys[starts[s] : starts[s] + length].double()
        v = values[starts[s] : starts[s] + length].double()
        weights = torch.softmax(rows[s].double() @ k.T * scaling, dim=-1)
        outputs.append(weights @ v)
    return torch.stack(outputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_blocked_varlen_attention_matches_per_segment_reference(dtype):
    generator = torch.Generator().manual_seed(1)
    lengths = [1, 63, 64, 65, 200, 3]
    keys, values, starts = _segments(lengths, 32, dtype, "cpu", generator)
    rows = torch.randn(len(lengths), 4, 32, generator=generator).to(dtype)
    expected = _per_segment_reference(rows, keys, values, starts, lengths, 0.2)
    actual = varlen_attention_torch(rows, keys, values, starts, torch.tensor(lengths), 0.2)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert actual.dtype == dtype
    assert _relative(actual, expected) <= tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_paged_varlen_attention_reads_pages_in_place_and_matches_reference(dtype):
    generator = torch.Generator().manual_seed(4)
    lengths = [1, 63, 64, 65, 200, 3]
    capacities = [(n + 32 + 63) // 64 * 64 for n in lengths]
    starts = torch.tensor([sum(capacities[:i]) for i in range(len(lengths))])
    keys = torch.randn(sum(capacities), 32, generator=generator).to(dtype)
    values = torch.randn(sum(capacities), 32, generator=generator).to(dtype)
    rows = torch.randn(len(lengths), 4, 32, generator=generator).to(dtype)
    expected = _per_segment_reference(rows, keys, values, starts, lengths, 0.2)
    actual = varlen_attention_torch(
        rows, keys, values, starts, torch.tensor(lengths), 0.2, segment_capacity_host=torch.tensor(capacities)
    )
    assert _relative(actual, expected) <= (1e-5 if dtype == torch.float32 else 1e-2)
    with pytest.raises(ValueError, match="not .* pages"):
        varlen_attention_torch(
            rows,
            keys[:-1],
            values[:-1],
            starts,
            torch.tensor(lengths),
            0.2,
            segment_capacity_host=torch.tensor(capacities),
        )


def test_blocked_varlen_attention_applies_the_model_mask_by_position():
    generator = torch.Generator().manual_seed(2)
    lengths = [5, 9]
    keys, values, starts = _segments(lengths, 16, torch.float32, "cpu", generator)
    positions = torch.zeros(keys.shape[0], dtype=torch.int32)
    for s, length in enumerate(lengths):
        positions[starts[s] : starts[s] + length] = torch.arange(length)
    mask = torch.ones(2, 1, 20, dtype=torch.bool)
    mask[0, 0, :3] = False  # batch 0: its first three positions are padding
    rows = torch.randn(2, 2, 16, generator=generator)
    actual = varlen_attention_torch(
        rows, keys, values, starts, torch.tensor(lengths), 0.25, positions=positions, mask=mask, heads=1, num_queries=1
    )
    keys_masked = [keys[starts[0] + 3 : starts[0] + 5], keys[starts[1] : starts[1] + 9]]
    values_masked = [values[starts[0] + 3 : starts[0] + 5], values[starts[1] : starts[1] + 9]]
    for s in range(2):
        weights = torch.softmax(rows[s] @ keys_masked[s].T * 0.25, dim=-1)
        torch.testing.assert_close(actual[s], weights @ values_masked[s], atol=1e-5, rtol=1e-5)
