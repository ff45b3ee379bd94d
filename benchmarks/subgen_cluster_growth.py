"""SubGen's premise on real keys: how many δ-clusters does the stream of keys need as n grows?

SubGen (Zandieh et al. 2024) is sublinear only if the keys of a head are covered by
``m = n^{1-Ω(1)}`` clusters of bounded radius. This script runs the embedded Gemma-3-270M
(``kvhive.load_model()``) over a long WikiText-2 text, takes the keys (after RoPE, as cached) of
every full-attention layer, feeds them in order into the streaming clustering of Algorithm 1
(UPDATESOFTMAXNORMALIZER, ``kvhive.methods.subgen_attention.StreamingStructures``) and reports
the number of clusters at several prefix lengths ``n`` for several radii.

The radius is relative: ``δ = delta_rel × mean ‖k‖`` of the layer's keys (the same scale the
``subgen-attention`` default uses), printed with typical nearest-neighbour and pairwise
distances so the choice can be judged. The growth exponent is the least-squares slope of
``log(clusters)`` against ``log(n)`` (1 = linear, no compression from clustering); the
last-doubling slope is the same over the last two checkpoints only (sublinear growth should
flatten as n grows). The memory column compares ``D`` at ``t`` samples per cluster (plus the
representative) with the full keys + values of those tokens.

    python benchmarks/subgen_cluster_growth.py [--tokens 4096] [--deltas 0.25 0.5 0.75 1.0]

Writes ``results/subgen_cluster_growth.csv``.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

import kvhive
from kvhive.compat import cache_kwarg
from kvhive.methods.subgen_attention import StreamingStructures

ROOT = Path(__file__).resolve().parents[1]
WIKITEXT = Path("/work/shared/data/wikitext2/wiki.test.raw")


def long_text(tokenizer, tokens: int) -> torch.Tensor:
    """The first ``tokens`` tokens of WikiText-2 test (one contiguous text of many articles)."""
    text = WIKITEXT.read_text(encoding="utf-8")
    ids = tokenizer(text[: tokens * 8], return_tensors="pt")["input_ids"]
    if ids.shape[1] < tokens:
        raise ValueError(f"the text gave only {ids.shape[1]} tokens")
    return ids[:, :tokens]


@torch.no_grad()
def full_attention_keys(model, input_ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """Keys ``[H, n, d]`` of every full-attention layer after a prefill with an uncompressed cache."""
    cache = kvhive.make_cache(model, "full")
    model(input_ids=input_ids, **{cache_kwarg(model): cache}, use_cache=True)
    keys = {}
    for index, layer in enumerate(cache.layers):
        if layer.is_sliding:
            continue
        dense = layer.dense()[0]  # [B, H, n, d]
        keys[index] = dense[0].float().clone()
    return keys


def cluster_counts(keys: torch.Tensor, radius: float, checkpoints: list[int]) -> list[int]:
    """Clusters (summed over heads) after each prefix length in ``checkpoints``."""
    heads, n, d = keys.shape
    structures = StreamingStructures(
        heads,
        d,
        t=1,
        s=1,
        dtype=torch.float32,
        device=keys.device,
        generator=torch.Generator().manual_seed(0),
        delta=radius,
        relative_delta=False,
    )
    counts, start = [], 0
    for stop in checkpoints:
        mask = torch.ones(heads, stop - start, dtype=torch.bool)
        structures.insert(keys[:, start:stop], keys[:, start:stop], mask)
        counts.append(int(structures.num_clusters.sum()))
        start = stop
    return counts


def slope(xs: list[int], ys: list[int]) -> float:
    lx = [math.log(x) for x in xs]
    ly = [math.log(max(y, 1)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / sum((a - mx) ** 2 for a in lx)


def distance_profile(keys: torch.Tensor) -> tuple[float, float, float]:
    """Mean ‖k‖, median nearest-neighbour and median pairwise distance (first 2048 keys, head 0)."""
    sample = keys[0, :2048]
    distances = torch.cdist(sample, sample)
    pairwise = distances[torch.triu(torch.ones_like(distances, dtype=torch.bool), diagonal=1)]
    nearest = (distances + torch.eye(sample.shape[0]) * 1e9).min(-1).values
    return float(keys.norm(dim=-1).mean()), float(nearest.median()), float(pairwise.median())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--deltas", type=float, nargs="+", default=[0.25, 0.5, 0.75, 1.0])
    parser.add_argument("--t", type=int, default=16, help="reservoir size for the memory column")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "subgen_cluster_growth.csv")
    args = parser.parse_args()

    started = time.perf_counter()
    model, tokenizer = kvhive.load_model()
    input_ids = long_text(tokenizer, args.tokens)
    keys_by_layer = full_attention_keys(model, input_ids)
    print(
        f"Gemma-3-270M, WikiText-2 test, n = {args.tokens} tokens, full-attention layers "
        f"{sorted(keys_by_layer)} (prefill {time.perf_counter() - started:.1f} s)"
    )

    checkpoints = [c for c in (128, 256, 512, 1024, 2048, 4096, 8192) if c < args.tokens] + [args.tokens]
    rows = []
    for layer, keys in keys_by_layer.items():
        heads, n, d = keys.shape
        mean_norm, nearest, pairwise = distance_profile(keys)
        print(
            f"\nlayer {layer}: {heads} KV head(s), d = {d}, mean ‖k‖ = {mean_norm:.2f}, median nearest-neighbour "
            f"distance = {nearest:.2f} ({nearest / mean_norm:.2f}·‖k‖), median pairwise = {pairwise:.2f} "
            f"({pairwise / mean_norm:.2f}·‖k‖)"
        )
        header = (
            "  δ/‖k‖      δ "
            + "".join(f"{c:>8}" for c in checkpoints)
            + "   slope  last-doubling slope  m/n@max  D bytes/KV bytes"
        )
        print(header)
        for relative in args.deltas:
            radius = relative * mean_norm
            counts = cluster_counts(keys, radius, checkpoints)
            exponent = slope(checkpoints, counts)
            # Local exponent over the last step (e.g. 2048 -> 4096): does growth slow down with n?
            tail = slope(checkpoints[-2:], counts[-2:])
            # Bytes of D at t samples (+ representative) per cluster vs the full keys+values.
            memory_ratio = counts[-1] * (args.t + 1) * d / (2 * heads * n * d)
            print(
                f"  {relative:6.2f} {radius:6.2f} "
                + "".join(f"{c:>8}" for c in counts)
                + f"   {exponent:5.2f}  {tail:19.2f}  {counts[-1] / (heads * n):7.3f}  {memory_ratio:8.2f}"
            )
            for tokens, clusters in zip(checkpoints, counts, strict=True):
                rows.append(
                    {
                        "layer": layer,
                        "heads": heads,
                        "delta_relative": relative,
                        "delta": round(radius, 4),
                        "mean_key_norm": round(mean_norm, 4),
                        "n": tokens,
                        "clusters": clusters,
                        "clusters_per_token": round(clusters / (heads * tokens), 4),
                        "slope": round(exponent, 4),
                        "last_doubling_slope": round(tail, 4),
                        "d_bytes_over_kv_bytes_t16": round(memory_ratio, 4),
                    }
                )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"\nwrote {args.out} ({time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
