"""CUDA-only checks: the compiled Triton variable-length kernel in every dtype, no host-device
synchronisation in a steady decode step (torch's CUDA sync checker), bf16 on CUDA against fp32 on
CPU. They run on a GPU machine with ``python -m pytest tests_gpu`` and FAIL (never skip) where no
CUDA device exists; CI, which has none, runs ``tests/`` only. The same logic is tested without a
GPU in tests/test_dtypes_and_decode_path.py and tests/test_triton_kernel_interpreted.py (the kernel
in Triton's interpreter)."""

from __future__ import annotations

import pytest
import torch
from test_dtypes_and_decode_path import (
    STEADY_METHODS,
    _per_segment_reference,
    _relative,
    _segments,
    _steady_decode,
)

import kvhive
from kvhive.attention.varlen import kernel_supports, varlen_attention_kernel
from kvhive.models import tiny_model

from helpers import left_padded_batch, prefill_and_decode


@pytest.fixture(autouse=True, scope="module")
def cuda_device():
    if not torch.cuda.is_available():
        raise RuntimeError("tests_gpu needs a CUDA device: run tests/ on a machine without one")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_triton_varlen_kernel_matches_reference(dtype):
    generator = torch.Generator().manual_seed(3)
    lengths = [1, 63, 64, 65, 5000, 3, 17000, 128]
    keys, values, starts = _segments(lengths, 128, dtype, "cuda", generator)
    rows = torch.randn(len(lengths), 4, 128, generator=generator).to("cuda", dtype)
    assert kernel_supports(rows, keys, values)
    expected = _per_segment_reference(rows.cpu(), keys.cpu(), values.cpu(), starts, lengths, 0.088)
    output = varlen_attention_kernel(
        rows,
        keys,
        values,
        0.088,
        max(lengths),
        segment_start=starts.cuda(),
        segment_length=torch.tensor(lengths, dtype=torch.int32, device="cuda"),
    )
    assert _relative(output.cpu(), expected) <= (1e-3 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("method", list(STEADY_METHODS))
def test_cuda_steady_decode_step_never_synchronises(method):
    model = tiny_model("llama", "gqa", dtype=torch.bfloat16).cuda()
    cache, token = _steady_decode(model, method, STEADY_METHODS[method], "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            model(input_ids=token, past_key_values=cache, use_cache=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("method", ["full", "snapkv", "ada-snapkv", "pyramidkv", "h2o", "tova"])
def test_cuda_bf16_matches_cpu_fp32(method):
    cpu_model = tiny_model("llama", "gqa")
    gpu_model = tiny_model("llama", "gqa", dtype=torch.bfloat16).cuda()
    input_ids, attention_mask = left_padded_batch(cpu_model.config.vocab_size, length=60, pad=5)
    forced = [torch.randint(3, 200, (2, 1), generator=torch.Generator().manual_seed(s)) for s in range(6)]
    expected = prefill_and_decode(
        cpu_model,
        kvhive.make_cache(cpu_model, method, budget=24),
        input_ids,
        attention_mask,
        steps=6,
        forced_tokens=forced,
    )
    actual = prefill_and_decode(
        gpu_model,
        kvhive.make_cache(gpu_model, method, budget=24),
        input_ids.cuda(),
        attention_mask.cuda(),
        steps=6,
        forced_tokens=[f.cuda() for f in forced],
    )
    assert _relative(actual.cpu(), expected) <= 5e-2
