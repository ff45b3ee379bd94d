"""SubGen speed on the KV-heavy shape (``kvhive.models.kv_heavy_model``, 4 layers, 8 KV heads of 128).

(a) ``subgen`` (recent + greedy k-center): prefill + compress ÷ prefill alone at 2k / 4k / 8k
    tokens (target ≤ 1.10× at 8k). The compress time (``select_prefill``, i.e. the k-center
    search of every layer) is also timed directly, which is less noisy than the difference of
    two prefills. When the target is missed, the compress step of one layer is profiled.
(b) ``subgen-attention``: per-token decode time after a long prompt, vs the full cache and vs
    ``local`` with the same exact window (the estimator's own cost is the difference to
    ``local``), with a breakdown (estimator query in ``extra_attention``, insertion into
    ``D``/``M``), the clusters held and the structures' bytes vs the full cache.

    python benchmarks/bench_subgen.py [--lengths 2048 4096 8192] [--budget 1024] [--threads 2]

Timings are wall-clock medians over ``--repeats`` runs; numbers are printed (nothing is written).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

import kvhive
from kvhive.compat import cache_kwarg
from kvhive.methods.registry import make_policy
from kvhive.methods.subgen import farthest_point_order
from kvhive.methods.subgen_attention import STATE_KEY, StreamingStructures, cluster_counts, structures_nbytes
from kvhive.models import kv_heavy_model


class Timer:
    """Accumulates the wall time spent in wrapped callables."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, name: str, function):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

        return timed


def prompt(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 1024, (1, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def timed_prefill(model, method: str, input_ids: torch.Tensor, **options) -> tuple[float, float, object]:
    """(prefill seconds, seconds inside select_prefill, cache)."""
    policy = make_policy(method, **{k: v for k, v in options.items() if k not in ("budget", "ratio")})
    timer = Timer()
    if hasattr(policy, "select_prefill"):
        policy.select_prefill = timer.wrap("compress", policy.select_prefill)
    cache = kvhive.make_cache(model, policy, budget=options.get("budget"), ratio=options.get("ratio"))
    start = time.perf_counter()
    model(input_ids=input_ids, **{cache_kwarg(model): cache}, use_cache=True)
    return time.perf_counter() - start, timer.seconds.get("compress", 0.0), cache


def part_a(model, lengths, budget, ratio, repeats, target) -> None:
    print(
        f"(a) subgen prefill + compress / prefill (full cache), kv_heavy 4 layers, "
        f"budget {budget} tokens (recent 32 + k {budget - 32})" + (f" and ratio {ratio}" if ratio else "")
    )
    print(
        f"{'n':>6} {'budget':>8} {'prefill s':>10} {'+compress s':>12} {'compress s':>11} "
        f"{'ratio (wall)':>13} {'ratio (direct)':>15}"
    )
    at_max = []
    settings = [dict(budget=budget)] + ([dict(ratio=ratio)] if ratio else [])
    for length in lengths:
        input_ids = prompt(length)
        for setting in settings:
            plain, with_compress, compress = [], [], []
            for _ in range(repeats):
                plain.append(timed_prefill(model, "full", input_ids, budget=length)[0])
                seconds, inside, _ = timed_prefill(model, "subgen", input_ids, **setting)
                with_compress.append(seconds)
                compress.append(inside)
            p, w, c = statistics.median(plain), statistics.median(with_compress), statistics.median(compress)
            label = setting.get("budget") or f"{setting['ratio']:g}"
            print(f"{length:>6} {label!s:>8} {p:>10.2f} {w:>12.2f} {c:>11.2f} {w / p:>13.3f} {(p + c) / p:>15.3f}")
            if length == max(lengths):
                kept = setting.get("budget") or max(33, round(setting["ratio"] * length))
                at_max.append(((p + c) / p, w / p, length, kept, label))
    for direct, wall, length, kept, label in at_max:
        verdict = "met" if direct <= target else "MISSED"
        print(
            f"target ≤ {target:.2f}x at n={length} (budget {label}): {verdict} (direct {direct:.3f}x, wall {wall:.3f}x)"
        )
        if direct > target:
            profile_compress(length, kept)


def profile_compress(length: int, budget: int) -> None:
    """Profile the k-center search of one layer-sized input (8 KV heads of 128)."""
    print(f"profile of one layer's k-center search (n={length}, k={budget - 32}, 8 heads of 128):")
    keys = torch.randn(8, length, 128, generator=torch.Generator().manual_seed(1))
    candidates = torch.ones(8, length, dtype=torch.bool)
    candidates[:, -32:] = False
    from torch.profiler import profile

    with profile() as prof:
        farthest_point_order(keys, candidates, budget - 32)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


@torch.no_grad()
def decode_time(model, method: str, input_ids: torch.Tensor, tokens: int, **options):
    """(ms per decode token, breakdown dict, cache) after prefilling ``input_ids``."""
    policy = make_policy(method, **{k: v for k, v in options.items() if k != "budget"})
    timer = Timer()
    if method == "subgen-attention":
        policy.extra_attention = timer.wrap("estimator query", policy.extra_attention)
        original_insert = StreamingStructures.insert
        StreamingStructures.insert = timer.wrap("insert into D/M", original_insert)
    try:
        cache = kvhive.make_cache(model, policy, budget=options.get("budget", input_ids.shape[1] + tokens))
        output = model(input_ids=input_ids, **{cache_kwarg(model): cache}, use_cache=True)
        timer.seconds.clear()
        token = output.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(tokens):
            output = model(input_ids=token, **{cache_kwarg(model): cache}, use_cache=True)
            token = output.logits[:, -1:].argmax(-1)
        elapsed = time.perf_counter() - start
    finally:
        if method == "subgen-attention":
            StreamingStructures.insert = original_insert
    per_token = {name: seconds / tokens * 1e3 for name, seconds in timer.seconds.items()}
    return elapsed / tokens * 1e3, per_token, cache


def part_b(model, length: int, window: int, tokens: int, deltas) -> None:
    print(f"\n(b) decode after a {length}-token prompt, {tokens} tokens, kv_heavy 4 layers")
    input_ids = prompt(length, seed=2)
    full_ms, _, full_cache = decode_time(model, "full", input_ids, tokens)
    local_ms, _, _ = decode_time(model, "local", input_ids, tokens, budget=window)
    print(f"  full cache                      {full_ms:8.1f} ms/token   cache {full_cache.nbytes() / 2**20:8.1f} MiB")
    print(f"  local (window {window})            {local_ms:8.1f} ms/token")
    for delta in deltas:
        # The budget is the method's whole memory (window + samples + clusters, token-equivalents).
        ms, breakdown, cache = decode_time(
            model, "subgen-attention", input_ids, tokens, budget=window, cluster_radius=delta
        )
        clusters = cluster_counts(cache)
        total_clusters = sum(int(c.sum()) for c in clusters.values())
        heads = sum(c.numel() for c in clusters.values())
        inserted = sum(
            int(layer.policy_state[STATE_KEY].tokens.sum()) for layer in cache.layers if STATE_KEY in layer.policy_state
        )
        parts = ", ".join(f"{name} {value:.1f} ms" for name, value in breakdown.items())
        plan = cache.policy.plan(window)
        print(
            f"  subgen-attention δ={delta:<4} (budget {window}: window {plan.window}, s={plan.value_samples}, "
            f"<= {plan.max_clusters} clusters of t={plan.samples_per_cluster}) {ms:8.1f} ms/token "
            f"= {ms / full_ms:.2f}x full, +{ms - local_ms:.1f} ms over local [{parts}]"
        )
        print(
            f"      clusters {total_clusters} for {inserted} inserted tokens over {heads} heads "
            f"({total_clusters / max(inserted, 1):.2f} per token); window {cache.nbytes() / 2**20:.1f} MiB + "
            f"structures {structures_nbytes(cache) / 2**20:.1f} MiB vs full {cache.full_cache_nbytes() / 2**20:.1f} MiB"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--ratio", type=float, default=None, help="also time a ratio budget (e.g. 0.5)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--target", type=float, default=1.10)
    parser.add_argument("--decode-prompt", type=int, default=2048)
    parser.add_argument("--decode-window", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--deltas", type=float, nargs="+", default=[0.5, 1.2])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--skip", choices=["a", "b"], default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    model = kv_heavy_model()
    if args.skip != "a":
        part_a(model, args.lengths, args.budget, args.ratio, args.repeats, args.target)
    if args.skip != "b":
        part_b(model, args.decode_prompt, args.decode_window, args.decode_tokens, args.deltas)


if __name__ == "__main__":
    main()
