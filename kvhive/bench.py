"""Speed and memory benchmarks (numbers, not timed tests).

``run_benchmark`` measures, for one method at one context length and budget: prefill time with
an uncompressed kvhive cache, prefill + compression time with the method (compression time is
the difference), decode ms/token for both, cache bytes against the full cache, and peak RSS.
``variable_length_attention_benchmark`` compares the variable-length decode attention path with
dense sdpa over the same number of tokens.
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

from kvhive.api import make_cache
from kvhive.compat import cache_kwarg
from kvhive.models.embedded import EMBEDDED_MODELS

# "embedded" is the default embedded model; an embedded model's name picks that one.
SHAPES = ("embedded", *EMBEDDED_MODELS, "kv-heavy", "llama3-8b")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def load_shape(shape: str, num_layers: int | None = None, device: str = "cpu", dtype=torch.float32):
    """The model of a benchmark shape (random weights except ``embedded``)."""
    from kvhive import models

    if shape == "embedded" or shape in models.EMBEDDED_MODELS:
        model, _ = models.load_model(models.DEFAULT_MODEL if shape == "embedded" else shape, dtype=dtype)
    elif shape == "kv-heavy":
        model = models.kv_heavy_model(num_layers=4 if num_layers is None else num_layers, dtype=dtype)
    elif shape == "llama3-8b":
        from transformers import LlamaForCausalLM

        config = models.llama3_8b_shape_config(num_layers=32 if num_layers is None else num_layers)
        with torch.device(device):
            model = LlamaForCausalLM(config).to(dtype).eval()
    else:
        raise ValueError(f"invalid shape={shape!r}: expected one of {', '.join(SHAPES)}")
    return model.to(device)


def _synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def _timed_run(model, input_ids, method: str, budget, decode_tokens: int, method_parameters: dict):
    cache = make_cache(model, method, budget, **method_parameters)
    cache_key = cache_kwarg(model)
    device = input_ids.device
    _synchronize(device)
    start = time.perf_counter()
    output = model(input_ids=input_ids, **{cache_key: cache}, use_cache=True, logits_to_keep=1)
    _synchronize(device)
    prefill_seconds = time.perf_counter() - start
    next_token = output.logits[:, -1:].argmax(-1)
    step_seconds = []
    for _ in range(decode_tokens):
        start = time.perf_counter()
        output = model(input_ids=next_token, **{cache_key: cache}, use_cache=True)
        _synchronize(device)
        step_seconds.append(time.perf_counter() - start)
        next_token = output.logits[:, -1:].argmax(-1)
    return cache, prefill_seconds, step_seconds


def run_benchmark(
    shape: str = "kv-heavy",
    method: str = "snapkv",
    budget: int | float | str | None = 0.1,
    context: int = 8192,
    decode_tokens: int = 32,
    batch_size: int = 1,
    repeats: int = 1,
    num_layers: int | None = None,
    device: str = "cpu",
    method_parameters: dict | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """Benchmark ``method`` against an uncompressed cache; returns a dict of numbers."""
    if isinstance(context, bool) or not isinstance(context, int) or context < 2:
        raise ValueError(f"invalid context={context!r}: expected an integer >= 2 (prompt tokens)")
    if isinstance(decode_tokens, bool) or not isinstance(decode_tokens, int) or decode_tokens < 0:
        raise ValueError(f"invalid decode_tokens={decode_tokens!r}: expected an integer >= 0")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"invalid repeats={repeats!r}: expected an integer >= 1")
    if num_layers is not None and (isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1):
        raise ValueError(f"invalid num_layers={num_layers!r}: expected an integer >= 1 (or none for the shape's own)")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"invalid batch_size={batch_size!r}: expected an integer >= 1")
    method_parameters = method_parameters or {}
    model = load_shape(shape, num_layers, device, dtype=dtype)
    limit = model.config.get_text_config().max_position_embeddings
    if context + decode_tokens > limit:
        raise ValueError(f"invalid context={context}: context + decode tokens exceed the model's {limit} positions")
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.get_text_config().vocab_size
    input_ids = torch.randint(3, vocab, (batch_size, context), generator=generator).to(device)

    _timed_run(model, input_ids[:, : min(context, 64)], "full", None, 1, {})  # warm-up
    full_prefill, full_steps, method_prefill, method_steps = [], [], [], []
    for _ in range(repeats):
        full_cache, prefill_seconds, steps = _timed_run(model, input_ids, "full", None, decode_tokens, {})
        full_prefill.append(prefill_seconds)
        full_steps.extend(steps)
        full_bytes = full_cache.nbytes()
        del full_cache
        cache, prefill_seconds, steps = _timed_run(model, input_ids, method, budget, decode_tokens, method_parameters)
        method_prefill.append(prefill_seconds)
        method_steps.extend(steps)
    kept = sum(int(v.sum()) for v in cache.kept_tokens().values())
    bytes_per_token = cache.layers[0].bytes_per_token()
    prefill = statistics.median(full_prefill)
    compressed_prefill = statistics.median(method_prefill)
    result = {
        "shape": shape,
        "device": device,
        "method": method,
        "budget": cache.budget_label(),
        "context": context,
        "batch_size": batch_size,
        "decode_tokens": decode_tokens,
        "prefill_seconds": prefill,
        "prefill_and_compress_seconds": compressed_prefill,
        "compression_seconds": compressed_prefill - prefill,
        "prefill_ratio": compressed_prefill / prefill,
        "decode_ms_per_token_full": 1e3 * statistics.median(full_steps) if full_steps else None,
        "decode_ms_per_token": 1e3 * statistics.median(method_steps) if method_steps else None,
        "dtype": str(dtype).removeprefix("torch."),
        "cache_bytes": cache.nbytes(),
        "reserved_bytes": cache.reserved_nbytes(),
        "metadata_bytes": cache.metadata_nbytes(),
        "full_cache_bytes": full_bytes,
        "cache_fraction": cache.nbytes() / full_bytes if full_bytes else None,
        "kept_tokens": kept,
        "bytes_over_kept_tokens": cache.nbytes() / (kept * bytes_per_token) if kept else None,
        "peak_rss_bytes": peak_rss_bytes(),
    }
    if device.startswith("cuda"):
        result["peak_cuda_bytes"] = torch.cuda.max_memory_allocated()
    return result


@torch.no_grad()
def variable_length_attention_benchmark(
    context: int = 8192,
    kv_heads: int = 8,
    group_size: int = 2,
    head_dim: int = 128,
    batch_size: int = 1,
    spread: float = 0.5,
    repeats: int = 20,
    device: str = "cpu",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """Decode attention over heads holding different token counts (mean ``context``, counts
    uniform in ``context·(1 ± spread)``) vs dense sdpa over ``context`` tokens per head."""
    from kvhive.attention.integration import _decode_variable_length
    from kvhive.cache.storage import LayerStore

    generator = torch.Generator().manual_seed(seed)
    segments = batch_size * kv_heads
    low, high = int(context * (1 - spread)), int(context * (1 + spread))
    lengths = torch.randint(low, high + 1, (segments,), generator=generator)
    lengths = lengths - (lengths.sum() - context * segments) // segments  # same total as dense
    total = int(lengths.sum())
    longest = int(lengths.max())
    store = LayerStore(0)
    store.update(
        torch.randn(batch_size, kv_heads, longest, head_dim, generator=generator).to(device, dtype),
        torch.randn(batch_size, kv_heads, longest, head_dim, generator=generator).to(device, dtype),
    )
    keep = torch.arange(longest)[None, :] < lengths[:, None]
    store.keep(keep.view(batch_size, kv_heads, longest).to(device), lengths.view(batch_size, kv_heads))
    store.tokens_seen = longest + 1

    class _Cache:
        layers = [store]

    query = torch.randn(batch_size, kv_heads * group_size, 1, head_dim, generator=generator).to(device, dtype)
    dense_keys = torch.randn(batch_size, kv_heads, total // segments, head_dim, generator=generator).to(device, dtype)
    dense_values = torch.randn_like(dense_keys)

    def timed(function) -> float:
        function()
        _synchronize(device)
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            function()
            _synchronize(device)
            samples.append(time.perf_counter() - start)
        return 1e3 * statistics.median(samples)

    variable_ms = timed(lambda: _decode_variable_length(_Cache, 0, query, None, head_dim**-0.5))
    from kvhive.attention.integration import _backends

    def dense():
        with _backends(query.device):  # the best sdpa backends (cuDNN re-plans per length)
            return F.scaled_dot_product_attention(query, dense_keys, dense_values, enable_gqa=True)

    dense_ms = timed(dense)
    return {
        "context": context,
        "kv_heads": kv_heads,
        "group_size": group_size,
        "head_dim": head_dim,
        "batch_size": batch_size,
        "min_length": int(lengths.min()),
        "max_length": int(lengths.max()),
        "variable_length_ms": variable_ms,
        "dense_sdpa_ms": dense_ms,
        "slowdown": variable_ms / dense_ms,
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
    }
