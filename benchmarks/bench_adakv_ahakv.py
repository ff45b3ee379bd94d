"""Prefill + compression time of Ada-SnapKV and AhaKV relative to an uncompressed prefill.

Model: ``kvhive.models.kv_heavy_model()`` (random-weight Llama, 4 layers, 16 query / 8 KV
heads of dim 128), batch 1, prompts of 2k / 4k / 8k tokens. For every length the methods run
interleaved (so background load hits them alike) and the median of ``--repeats`` runs is kept:

* ``sdpa``: plain transformers (sdpa attention, ``DynamicCache``), for reference;
* ``full``: the kvhive attention and cache without compression (the denominator: same attention
  path, so the ratio isolates scoring + selection + eviction);
* ``ada-snapkv`` and ``ahakv`` at ``--budget`` tokens per head.

    python benchmarks/bench_adakv_ahakv.py [--lengths 2048 4096 8192] [--repeats 3] [--profile]

``--profile`` prints where the compression time goes (cProfile of one run per method at the
longest length, restricted to kvhive functions).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
from transformers import DynamicCache

import kvhive
from kvhive.compat import cache_kwarg
from kvhive.models import kv_heavy_model


def _prefill(model, input_ids, method: str, budget: int) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one prefill (with compression for a method)."""
    if method == "sdpa":
        model.set_attn_implementation("sdpa")
        cache = DynamicCache(config=model.config)
    else:
        cache = kvhive.make_cache(model, method, budget=budget)
    start, start_cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        model(input_ids=input_ids, **{cache_kwarg(model): cache}, use_cache=True)
    elapsed = time.perf_counter() - start, time.process_time() - start_cpu
    if method not in ("sdpa", "full"):
        kept = cache.kept_tokens()
        assert all(int(v.sum()) == budget * v.shape[1] for v in kept.values()), kept
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--methods", nargs="+", default=["sdpa", "full", "ada-snapkv", "ahakv"])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--profile", action="store_true")
    arguments = parser.parse_args()
    if arguments.threads:
        torch.set_num_threads(arguments.threads)

    model = kv_heavy_model()
    generator = torch.Generator().manual_seed(0)
    print(f"torch threads: {torch.get_num_threads()}, budget {arguments.budget} tokens per head, batch 1")
    print("median wall seconds (median process CPU seconds); ratio = method / full")
    for length in arguments.lengths:
        input_ids = torch.randint(3, model.config.vocab_size, (1, length), generator=generator)
        _prefill(model, input_ids[:, :256], "full", arguments.budget)  # warm-up
        runs: dict[str, list[tuple[float, float]]] = {m: [] for m in arguments.methods}
        for _ in range(arguments.repeats):
            for method in arguments.methods:
                runs[method].append(_prefill(model, input_ids, method, arguments.budget))
        wall = {m: statistics.median(r[0] for r in rs) for m, rs in runs.items()}
        cpu = {m: statistics.median(r[1] for r in rs) for m, rs in runs.items()}
        cells = []
        for method in arguments.methods:
            cell = f"{method} {wall[method]:.2f}s ({cpu[method]:.2f}s)"
            if method != "full" and "full" in wall:
                cell += f" ratio {wall[method] / wall['full']:.3f} (cpu {cpu[method] / cpu['full']:.3f})"
            cells.append(cell)
        print(f"{length:>6}: " + " | ".join(cells), flush=True)

    if arguments.profile:
        length = arguments.lengths[-1]
        input_ids = torch.randint(3, model.config.vocab_size, (1, length), generator=generator)
        for method in [m for m in arguments.methods if m not in ("sdpa",)]:
            profiler = cProfile.Profile()
            profiler.enable()
            _prefill(model, input_ids, method, arguments.budget)
            profiler.disable()
            stream = io.StringIO()
            stats = pstats.Stats(profiler, stream=stream).sort_stats("cumulative")
            stats.print_stats(r"kvhive|scaled_dot_product|topk|softmax|matmul", 18)
            print(f"\n=== profile: {method} at {length} tokens ===")
            print("\n".join(line for line in stream.getvalue().splitlines() if line.strip())[-3000:])


if __name__ == "__main__":
    main()
