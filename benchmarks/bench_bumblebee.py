"""BumbleBee benchmarks (CPU): prefill overhead, greedy scaling, streaming (decode) overhead.

    python benchmarks/bench_bumblebee.py                    # everything (several minutes at 8k)
    python benchmarks/bench_bumblebee.py --parts greedy     # one part: prefill | greedy | decode | accumulated
    python benchmarks/bench_bumblebee.py --lengths 2048 4096 --threads 1

1. ``prefill``: time of a prefill that compresses with BumbleBee (budget ``--ratio`` of the
   prompt, the paper's LongBench 20 %) divided by the same prefill with the uncompressed kvhive
   cache, on ``kv_heavy_model()`` (4 layers, 8 KV heads of dim 128). The BumbleBee time is split
   into the accumulated attention (``ScoringInputs.accumulated_attention``, shared with H2O and
   every accumulated-attention method), the similarity matrix, the greedy loop and the rest.
   Target: <= 1.30x at 8k.
2. ``greedy``: similarity-matrix and greedy time vs ground-set size ``n`` and summary size
   ``tau_s`` on synthetic anisotropic keys (8 rows = one layer of 8 KV heads, d = 128).
3. ``decode``: per-token cost of a decode step with BumbleBee (Algorithm 2 every step) vs a
   full-cache decode step at the same context length, split into the policy (observe +
   select: the streaming update), the cache's compaction (``LayerStore.keep``) and the rest.
   Target: policy time <= 25 % of a full-cache step.
4. ``accumulated``: the framework's accumulated attention of one layer vs a leaner computation
   of the same numbers (keys transposed once, mask applied in place, causal trimming) — the
   largest part of the compressing prefill, shared with H2O-family methods.

Timings are medians (decode) or single runs (prefill at 8k, minutes each). The load average is
printed first: on a shared machine every number moves with it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch
from transformers import DynamicCache

import kvhive.methods.bumblebee as bumblebee
from kvhive.api import make_cache, plain_attention
from kvhive.cache.storage import LayerStore
from kvhive.compat import cache_kwarg
from kvhive.methods.base import ScoringInputs
from kvhive.methods.submodular import Concave, Mixture, greedy_maximize, relu_cosine_similarity
from kvhive.models import kv_heavy_model


@contextlib.contextmanager
def timing(totals: dict[str, float], targets: list[tuple[object, str, str]]):
    """Accumulate wall time of ``owner.attribute`` calls into ``totals[label]`` (outermost call only)."""
    originals = []
    depth = {label: 0 for _, _, label in targets}
    for owner, attribute, label in targets:
        original = getattr(owner, attribute)
        originals.append((owner, attribute, original))

        def wrapper(*args, __original=original, __label=label, **kwargs):
            depth[__label] += 1
            start = time.perf_counter()
            try:
                return __original(*args, **kwargs)
            finally:
                depth[__label] -= 1
                if depth[__label] == 0:
                    totals[__label] = totals.get(__label, 0.0) + time.perf_counter() - start

        setattr(owner, attribute, wrapper)
    try:
        yield totals
    finally:
        for owner, attribute, original in reversed(originals):
            setattr(owner, attribute, original)


def random_prompt(length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def prefill_seconds(model, cache, input_ids) -> float:
    start = time.perf_counter()
    model(input_ids=input_ids, **{cache_kwarg(model): cache}, use_cache=True)
    return time.perf_counter() - start


# ----------------------------------------------------------------------------------------------
# 1. prefill + compress vs prefill
# ----------------------------------------------------------------------------------------------


def bench_prefill(lengths: list[int], ratio: float, method: str) -> None:
    print(f"\n== prefill + compress / prefill  (kv_heavy_model, {method}, budget = {ratio:g} x prompt) ==")
    print(
        f"{'n':>6} {'sdpa s':>7} {'full s':>7} {'bb s':>8} {'ratio':>6} | {'acc.attn':>8} {'sim':>7} "
        f"{'greedy':>7} {'other':>7} | {'ratio w/o acc.attn':>17}"
    )
    model = kv_heavy_model()
    for length in lengths:
        input_ids = random_prompt(length, model.config.vocab_size)
        with plain_attention(model):
            sdpa = prefill_seconds(model, DynamicCache(config=model.config), input_ids)
        full = prefill_seconds(model, make_cache(model, "full"), input_ids)
        totals: dict[str, float] = {}
        targets = [
            (ScoringInputs, "accumulated_attention", "accumulated"),
            (bumblebee, "relu_cosine_similarity", "similarity"),
            (bumblebee, "greedy_maximize", "greedy"),
            (bumblebee.BumbleBee, "select_prefill", "select"),
        ]
        with timing(totals, targets):
            compressed = prefill_seconds(model, make_cache(model, method, ratio=ratio), input_ids)
        # A second uncompressed run after the compressed one: the load on a shared box drifts.
        full = min(full, prefill_seconds(model, make_cache(model, "full"), input_ids))
        accumulated = totals.get("accumulated", 0.0)
        other = totals.get("select", 0.0) - totals.get("similarity", 0.0) - totals.get("greedy", 0.0)
        print(
            f"{length:>6} {sdpa:>7.2f} {full:>7.2f} {compressed:>8.2f} {compressed / full:>6.2f} | "
            f"{accumulated:>8.2f} {totals.get('similarity', 0.0):>7.2f} {totals.get('greedy', 0.0):>7.2f} "
            f"{other:>7.2f} | {(compressed - accumulated) / full:>17.2f}",
            flush=True,
        )


def causal_accumulated_attention(
    queries: torch.Tensor, keys: torch.Tensor, scaling: float, chunk_elements: int = 1 << 24
) -> torch.Tensor:
    """Prefill column sums of the causal softmax ``[B, Hq, N]`` computed the lean way: each
    query chunk only multiplies the keys it can see (causal trimming), the keys are transposed
    once, the scale is folded into the queries and the mask is applied in place. For comparison
    with ``ScoringInputs.accumulated_attention`` (same numbers, see ``bench_accumulated``)."""
    batch, query_heads, length, dim = queries.shape
    heads = keys.shape[1]
    grouped = (queries * scaling).reshape(batch, heads, query_heads // heads, length, dim)
    keys_t = keys.transpose(-1, -2).contiguous()[:, :, None]  # [B, H, 1, d, N], transposed once
    total = queries.new_zeros(batch, query_heads, length)
    rows = max(1, chunk_elements // max(1, batch * query_heads * length))
    columns = torch.arange(length)
    for start in range(0, length, rows):
        stop = min(length, start + rows)
        logits = torch.matmul(grouped[:, :, :, start:stop], keys_t[..., :stop])
        logits = logits.reshape(batch, query_heads, stop - start, stop)
        logits.masked_fill_(columns[None, :stop] > torch.arange(start, stop)[:, None], float("-inf"))
        total[:, :, :stop] += torch.softmax(logits, dim=-1).sum(dim=2)
    return total


def bench_accumulated(lengths: list[int]) -> None:
    """The framework's accumulated attention vs a causal-trimmed computation (one layer of
    kv_heavy_model's shape: 16 query heads, 8 KV heads, d = 128)."""
    print("\n== accumulated attention of one layer: ScoringInputs (framework) vs lean (seconds, best of 2) ==")
    print(f"{'n':>6} {'framework':>9} {'lean':>8} {'speed-up':>8} {'max diff':>9}")
    from kvhive.methods.base import PREFILL

    for length in lengths:
        generator = torch.Generator().manual_seed(0)
        queries = torch.randn(1, 16, length, 128, generator=generator)
        keys = torch.randn(1, 8, length, 128, generator=generator)
        mask = torch.ones(length, length, dtype=torch.bool).tril()[None, None]
        scoring = ScoringInputs(
            keys=keys,
            values=keys,
            queries=queries,
            positions=torch.arange(length).expand(1, 8, -1),
            mask=mask,
            scaling=128**-0.5,
            layer_index=0,
            num_layers=1,
            sequence_length=length,
            phase=PREFILL,
        )
        framework_seconds = trimmed_seconds = float("inf")
        for _ in range(2):  # interleaved: the load of a shared machine drifts
            scoring._memo.clear()
            start = time.perf_counter()
            framework = scoring.accumulated_attention()
            framework_seconds = min(framework_seconds, time.perf_counter() - start)
            start = time.perf_counter()
            trimmed = causal_accumulated_attention(queries, keys, 128**-0.5)
            trimmed_seconds = min(trimmed_seconds, time.perf_counter() - start)
        speed_up = framework_seconds / trimmed_seconds
        difference = (framework - trimmed).abs().max().item()
        print(
            f"{length:>6} {framework_seconds:>9.2f} {trimmed_seconds:>8.2f} {speed_up:>8.2f} {difference:>9.1e}",
            flush=True,
        )


# ----------------------------------------------------------------------------------------------
# 2. greedy scaling
# ----------------------------------------------------------------------------------------------


def synthetic_problem(rows: int, n: int, dim: int = 128, seed: int = 0):
    """Anisotropic keys (a shared direction per row, like real RoPE'd keys: mean ReLU-cos ~0.5)
    and heavy-tailed accumulated attention summing to about n."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(rows, 1, dim, generator=generator) + 0.9 * torch.randn(rows, n, dim, generator=generator)
    weights = torch.rand(rows, n, generator=generator) ** 8
    weights = weights / weights.sum(-1, keepdim=True) * n
    return keys, weights, torch.ones(rows, n, dtype=torch.bool)


def bench_greedy(sizes: list[int], summaries: list[int], concave: str) -> None:
    print(f"\n== greedy time vs n and tau_s  (8 rows, d = 128, phi = {concave}, lambda = 0.3, seconds) ==")
    print(f"{'n':>6} {'tau_s':>6} {'sim':>7} {'stochastic':>10} {'lazy':>7} {'plain':>7}")
    for n in sizes:
        keys, weights, valid = synthetic_problem(8, n)
        start = time.perf_counter()
        sim = relu_cosine_similarity(keys, valid)
        similarity_seconds = time.perf_counter() - start
        objective = Mixture(sim, weights, valid, 0.3, Concave(concave))
        for tau in summaries:
            if tau >= n:
                continue
            row = {}
            for method in ("stochastic", "lazy", "plain"):
                if method == "lazy" and n * tau > 4096 * 1024:
                    continue
                if method == "plain" and n * tau > 1024 * 64:
                    continue
                start = time.perf_counter()
                greedy_maximize(objective, tau, method, 1e-5, torch.Generator().manual_seed(0))
                row[method] = time.perf_counter() - start
            cells = " ".join(
                f"{row[m]:>{w}.3f}" if m in row else f"{'-':>{w}}"
                for m, w in (("stochastic", 10), ("lazy", 7), ("plain", 7))
            )
            print(f"{n:>6} {tau:>6} {similarity_seconds:>7.3f} {cells}", flush=True)
        del sim, objective


# ----------------------------------------------------------------------------------------------
# 3. streaming overhead per decode step
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def decode_step_times(
    model, cache, input_ids, steps: int, totals: dict[str, float] | None = None, targets=None
) -> tuple[list[float], dict[str, list[float]]]:
    output = model(input_ids=input_ids, **{cache_kwarg(model): cache}, use_cache=True)
    token = output.logits[:, -1:].argmax(-1)
    times, parts = [], {}
    for _ in range(steps):
        step_totals: dict[str, float] = {}
        context = timing(step_totals, targets) if targets else contextlib.nullcontext()
        with context:
            start = time.perf_counter()
            output = model(input_ids=token, **{cache_kwarg(model): cache}, use_cache=True)
            times.append(time.perf_counter() - start)
        for label, seconds in step_totals.items():
            parts.setdefault(label, []).append(seconds)
        token = output.logits[:, -1:].argmax(-1)
    return times[2:], {label: values[2:] for label, values in parts.items()}


def bench_decode(lengths: list[int], ratio: float, steps: int, method: str) -> None:
    print(
        f"\n== decode step: {method} streaming (budget = {ratio:g} x prompt) vs full cache "
        f"(kv_heavy_model, median ms/step over {steps - 2} steps) =="
    )
    print(
        f"{'n':>6} {'sdpa full':>9} {'kvhive full':>11} {'bumblebee':>9} | {'policy':>7} {'keep':>6} | "
        f"{'policy/full':>11} {'step/full':>9}"
    )
    model = kv_heavy_model()
    for length in lengths:
        input_ids = random_prompt(length, model.config.vocab_size)
        with plain_attention(model):
            sdpa, _ = decode_step_times(model, DynamicCache(config=model.config), input_ids, steps)
        full, _ = decode_step_times(model, make_cache(model, "full"), input_ids, steps)
        targets = [
            (bumblebee.BumbleBee, "observe_decode", "policy"),
            (bumblebee.BumbleBee, "select_decode", "policy"),
            (LayerStore, "keep", "keep"),
        ]
        compressed, parts = decode_step_times(
            model, make_cache(model, method, ratio=ratio), input_ids, steps, targets=targets
        )
        median = lambda values: statistics.median(values) * 1e3  # noqa: E731
        reference = min(median(sdpa), median(full))
        policy = median(parts.get("policy", [0.0]))
        print(
            f"{length:>6} {median(sdpa):>9.1f} {median(full):>11.1f} {median(compressed):>9.1f} | {policy:>7.2f} "
            f"{median(parts.get('keep', [0.0])):>6.2f} | {policy / reference:>11.1%} "
            f"{median(compressed) / reference:>9.2f}",
            flush=True,
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="greedy,decode,prefill,accumulated")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--decode-lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--ratio", type=float, default=0.2)
    parser.add_argument("--steps", type=int, default=34)
    parser.add_argument("--method", default="bumblebee", choices=["bumblebee", "bumblebee-power"])
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    parts = set(args.parts.split(","))
    if "greedy" in parts:
        bench_greedy([1024, 2048, 4096, 8192], [64, 256, 1024], "log" if args.method == "bumblebee" else "power")
    if "decode" in parts:
        bench_decode(args.decode_lengths, args.ratio, args.steps, args.method)
    if "prefill" in parts:
        bench_prefill(args.lengths, args.ratio, args.method)
    if "accumulated" in parts:
        bench_accumulated(args.lengths)


if __name__ == "__main__":
    sys.exit(main())
