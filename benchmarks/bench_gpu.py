"""Decode and prefill on a GPU, kvhive vs stock transformers, side by side in one process.

    PYTHONPATH=. python benchmarks/bench_gpu.py --context 32768 --batch 1 --out runs/gpu.jsonl

Model: Llama-3-8B shape (32 layers, 32 query heads, 8 KV heads of 128), random bf16 weights.
For every configuration: prefill seconds (one forward over the prompt, compression included),
decode ms/token (``--decode-tokens`` steps launched back to back, one synchronisation at the
end, as a serving loop runs), KV bytes held, peak CUDA memory above the weights, and the
bandwidth bound of a decode step ((weights + KV read) / measured copy bandwidth) with its ratio.
Stock transformers (sdpa + ``DynamicCache``) is run with cuDNN's sdpa on and off; the best of
the two is the baseline. ``--profile METHOD`` adds a ``torch.profiler`` trace of decode steps
(host time, GPU kernel time, device->host synchronisations per step). Each result is one JSON
line, written as soon as it is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

STOCK = ("stock-cudnn-on", "stock-cudnn-off")


def versions() -> dict:
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        ).stdout.strip() or os.environ.get("KVHIVE_COMMIT")
    except OSError:
        commit = os.environ.get("KVHIVE_COMMIT")
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "commit": os.environ.get("KVHIVE_COMMIT", commit),
    }


def copy_bandwidth() -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    source = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        target.copy_(source)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / 10
    del source, target
    return 2 * (1 << 29) * 2 / seconds


def build_model(num_layers: int):
    from transformers import LlamaForCausalLM

    from kvhive.models import llama3_8b_shape_config

    config = llama3_8b_shape_config(num_layers=num_layers)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    return model


def kv_bytes(cache) -> int:
    if hasattr(cache, "nbytes"):
        return cache.nbytes()
    return sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)


def make(model, config: str, budget: float):
    from transformers import DynamicCache

    if config in STOCK:
        torch.backends.cuda.enable_cudnn_sdp(config == "stock-cudnn-on")
        model.set_attn_implementation("sdpa")
        return DynamicCache(config=model.config)
    torch.backends.cuda.enable_cudnn_sdp(True)  # kvhive chooses its own kernels whatever this says
    import kvhive

    config, _, dense_decode = config.partition("@")
    try:  # "snapkv@kernel": dense decode through kvhive's Triton kernel instead of sdpa
        from kvhive.attention import integration

        integration.DENSE_DECODE = dense_decode or os.environ.get("KVHIVE_DENSE_DECODE", "sdpa")
    except ImportError:
        pass
    if config == "full":
        return kvhive.make_cache(model, "full")
    return kvhive.make_cache(model, config, ratio=budget)


@torch.no_grad()
def run_one(model, config, input_ids, budget, decode_tokens, weights_bytes, bandwidth, profile_steps=0):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    cache = make(model, config, budget)
    torch.cuda.synchronize()
    start = time.perf_counter()
    output = model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    torch.cuda.synchronize()
    prefill = time.perf_counter() - start
    token = output.logits[:, -1:].argmax(-1)
    del output
    for _ in range(3):  # warm-up (first appends, kernel compilation)
        token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(decode_tokens):
        token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    torch.cuda.synchronize()
    decode_ms = 1e3 * (time.perf_counter() - start) / decode_tokens
    held = kv_bytes(cache)
    result = {
        "config": config,
        "budget": None if config in STOCK or config == "full" else budget,
        "context": input_ids.shape[1],
        "batch": input_ids.shape[0],
        "prefill_s": prefill,
        "decode_ms_per_token": decode_ms,
        "kv_bytes": held,
        "reserved_bytes": cache.reserved_nbytes() if hasattr(cache, "reserved_nbytes") else held,
        "peak_above_weights_bytes": torch.cuda.max_memory_allocated() - base,
        "bandwidth_bound_ms": 1e3 * (weights_bytes + held) / bandwidth,
    }
    result["bound_over_measured"] = result["bandwidth_bound_ms"] / decode_ms
    if profile_steps:
        result["profile"] = profile(model, cache, token, profile_steps)
    del cache
    return result


def profile(model, cache, token, steps: int) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        host = time.perf_counter() - start
        torch.cuda.synchronize()
    events = prof.key_averages()
    syncs = sum(e.count for e in events if "Synchronize" in e.key or "synchronize" in e.key)
    device_to_host = sum(e.count for e in events if "DtoH" in e.key or "Memcpy DtoH" in e.key)
    kernel_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
    return {
        "steps": steps,
        "host_ms_per_step": 1e3 * host / steps,
        "gpu_kernel_ms_per_step": kernel_us / 1e3 / steps,
        "synchronize_calls_per_step": syncs / steps,
        "device_to_host_copies_per_step": device_to_host / steps,
        "top_host_ops": [(e.key, round(e.self_cpu_time_total / 1e3 / steps, 3)) for e in top],
    }


def varlen_rows(contexts, batches) -> list[dict]:
    from kvhive.bench import variable_length_attention_benchmark

    rows = []
    for batch in batches:
        for context in contexts:
            rows.append(
                variable_length_attention_benchmark(
                    context=context,
                    kv_heads=8,
                    group_size=4,
                    head_dim=128,
                    batch_size=batch,
                    repeats=50,
                    device="cuda",
                    dtype=torch.bfloat16,
                )
            )
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--budget", type=float, default=0.1, help="ratio of the prompt kept")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument(
        "--configs",
        default="stock-cudnn-on,stock-cudnn-off,full,full@kernel,snapkv,snapkv@kernel,"
        "ada-snapkv,pyramidkv,tova,knorm,streamingllm",
    )
    parser.add_argument("--profile", default="", help="comma-separated configs to profile")
    parser.add_argument("--varlen", action="store_true", help="also time variable-length vs dense attention")
    parser.add_argument("--label", default="kvhive")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"label": args.label, **versions()}
    bandwidth = copy_bandwidth()
    meta["copy_bandwidth_GBps"] = bandwidth / 1e9
    print(json.dumps(meta), flush=True)

    def write(row):
        row = {**meta, **row}
        with out.open("a") as handle:
            handle.write(json.dumps(row) + "\n")
        print(json.dumps({k: v for k, v in row.items() if k not in meta}), flush=True)

    if args.varlen:
        for row in varlen_rows([8192, 32768], [1, 8]):
            write({"kind": "varlen", **row})
    model = build_model(args.layers)
    weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, model.config.vocab_size, (args.batch, args.context), generator=generator).cuda()
    profiled = set(filter(None, args.profile.split(",")))
    for config in args.configs.split(","):
        try:
            row = run_one(
                model,
                config,
                input_ids,
                args.budget,
                args.decode_tokens,
                weights_bytes,
                bandwidth,
                profile_steps=5 if config in profiled else 0,
            )
            write({"kind": "e2e", **row})
        except Exception as error:  # noqa: BLE001 - a failing method is a result to record, not a crash
            write({"kind": "e2e", "config": config, "error": f"{type(error).__name__}: {error}"[:500]})
            torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
