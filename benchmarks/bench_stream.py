"""A stream of a million tokens at a fixed budget: memory and step time must stay flat (issue 24 item 4).

Streams ``--tokens`` random tokens through a model in chunks of ``--chunk`` tokens with a kvhive
cache at ``--budget`` tokens per head and ``positions="cache"`` (kept keys re-rotated to contiguous
positions, so the stream runs past the model's trained length), and records every ``--every``
tokens: the process's peak memory over that stretch (CPU: VmHWM, reset through
``/proc/self/clear_refs``; CUDA: ``max_memory_allocated``), the milliseconds per chunk over that
stretch, and the tokens the cache holds. One JSON line per record, written as it goes to ``--out``
(a rerun skips the methods already complete there, and streams again a method whose run was
interrupted, its earlier records dropped).

CPU (the committed numbers): ``python benchmarks/bench_stream.py``; the 8B shape on a GPU:
``python benchmarks/bench_stream.py --shape llama3-8b --device cuda --dtype bfloat16 --budget 32768``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings
from pathlib import Path

import torch

import kvhive
from kvhive.models.shapes import kv_heavy_model_config, llama3_8b_shape_config


def tiny_stream_config():
    """A tiny Llama (2 layers, 4 query / 2 KV heads of 16): the cost per token is the cache's, not the MLP's."""
    return kv_heavy_model_config(
        num_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16
    )


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with open("/proc/self/clear_refs", "w") as clear_refs:  # resets VmHWM to the current RSS
        clear_refs.write("5")


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmHWM not found in /proc/self/status: the CPU peak cannot be measured here")


def stream(model, method: str, args, device: torch.device, write) -> None:
    # Re-indexed positions let the stream run past the trained length; a method whose estimator keeps
    # keys outside the cache (SubGen's) refuses them and streams at original positions (RoPE of any
    # position is defined; a random-weight model has no trained length to leave).
    positions = "cache"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            cache = kvhive.make_cache(model, method, budget=args.budget, positions="cache")
        except ValueError as error:
            if "positions='cache' is not supported" not in str(error):
                raise
            positions = "original"
            cache = kvhive.make_cache(model, method, budget=args.budget)
    generator = torch.Generator().manual_seed(0)
    seen, stretch_start, chunks = 0, time.perf_counter(), 0
    stretch_cpu = time.process_time()
    _reset_peak(device)
    with torch.no_grad():
        while seen < args.tokens:
            size = min(args.chunk, args.tokens - seen)
            ids = torch.randint(3, model.config.vocab_size, (1, size), generator=generator).to(device)
            model(input_ids=ids, past_key_values=cache, use_cache=True)
            seen += size
            chunks += 1
            if seen % args.every == 0 or seen == args.tokens:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                elapsed = time.perf_counter() - stretch_start
                elapsed_cpu = time.process_time() - stretch_cpu
                write(
                    {
                        "method": method,
                        "tokens_seen": seen,
                        "ms_per_chunk": 1000 * elapsed / chunks,
                        # This process's CPU time: with one thread, what other processes on the
                        # cores take is left out (wall time on a shared machine is not).
                        "cpu_ms_per_chunk": 1000 * elapsed_cpu / chunks,
                        "threads": torch.get_num_threads(),
                        "chunk": args.chunk,
                        "peak_bytes": _peak_bytes(device),
                        "kept_tokens_max": max(layer.max_length for layer in cache.layers),
                        "cache_bytes": cache.nbytes(),
                        "budget": args.budget,
                        "positions": positions,
                        "device": str(device),
                    }
                )
                _reset_peak(device)
                stretch_start, chunks, stretch_cpu = time.perf_counter(), 0, time.process_time()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="h2o,buzz,subgen,streamingllm")
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--chunk", type=int, default=1000)  # --every must be a multiple
    parser.add_argument("--every", type=int, default=50_000)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--shape", choices=("tiny", "llama3-8b"), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--out", default="results/stream/stream_cpu.jsonl")
    args = parser.parse_args()
    for name in ("tokens", "chunk", "every", "budget"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be an integer >= 1, got {getattr(args, name)}")
    if args.every % args.chunk:
        parser.error(f"--every ({args.every}) must be a multiple of --chunk ({args.chunk})")
    device = torch.device(args.device)
    config = tiny_stream_config() if args.shape == "tiny" else llama3_8b_shape_config()
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=getattr(torch, args.dtype)).to(device).eval()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    if out.exists():
        for line in out.read_text().splitlines():
            record = json.loads(line)
            if record["tokens_seen"] == args.tokens:
                done.add(record["method"])

    def write(record):
        print(json.dumps(record), flush=True)
        with out.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    for method in args.methods.split(","):
        if method in done:
            print(f"{method}: complete in {out}, skipped")
            continue
        _drop_partial_run(out, method)
        stream(model, method, args, device, write)


def _drop_partial_run(out: Path, method: str) -> None:
    """A stream cannot resume mid-way (its cache is gone with the process): the records of an
    interrupted run of ``method`` are removed before it streams again, so none is counted twice."""
    if not out.exists():
        return
    lines = out.read_text().splitlines()
    kept = [line for line in lines if json.loads(line)["method"] != method]
    if len(kept) != len(lines):
        print(f"{method}: {len(lines) - len(kept)} records of an interrupted run dropped from {out}; streaming again")
        temporary = out.with_suffix(out.suffix + ".tmp")
        temporary.write_text("".join(line + "\n" for line in kept))
        temporary.replace(out)


if __name__ == "__main__":
    main()
