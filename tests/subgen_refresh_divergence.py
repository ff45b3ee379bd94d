"""How many of SubGen's decode decisions an approximate stale refresh changes, on hub streams.

SubGen's decode drops the newer member of the closest pair among the candidates (the paper's rule,
the default). ``SubGen(stale_refresh_width=w)`` refreshes at most ``w`` stale candidates (nearest
neighbour dropped) per row and removal, an approximation. This script runs the method one token at a
time over streams of keys with hubs (Gaussian directions with random scales: small keys are the
nearest neighbour of many) and checks every decision against a brute-force closest pair computed
from the method's own candidates at that step; it prints, per width, the decisions that differ and
the most stale candidates any row held after a decision. Used by ``tests/methods/test_subgen.py`` and run
by hand to measure the figures stated in docs/METHODS.md::

    .venv/bin/python tests/subgen_refresh_divergence.py [--dims 16 64] [--seeds 0 1 2] [--steps 200]
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import torch

from kvhive.methods.base import DECODE, ScoringInputs
from kvhive.methods.subgen import SubGen
from kvhive.methods.subgen_candidates import NEAREST_POSITION


def hub_stream(length: int, dim: int, seed: int) -> torch.Tensor:
    """``[length, dim]`` keys with hubs: Gaussian directions scaled by a uniform [0, 3) each."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(length, dim, generator=generator) * torch.rand(length, 1, generator=generator) * 3


def closest_pair_rule(keys: torch.Tensor, positions: list[int], target: int) -> set[int]:
    """Reference: while more than ``target`` candidates, drop the newer member of the closest pair
    (every pair's distance computed from scratch, in float64)."""
    keys = keys.double()
    alive = list(range(keys.shape[0]))
    while len(alive) > target:
        chosen = keys[alive]
        distances = torch.cdist(chosen, chosen).fill_diagonal_(float("inf"))
        flat = int(distances.argmin())
        a, b = alive[flat // len(alive)], alive[flat % len(alive)]
        alive.remove(a if positions[a] > positions[b] else b)
    return {positions[i] for i in alive}


def _scoring(keys: torch.Tensor, positions: torch.Tensor, token_scores: dict, masked: bool) -> ScoringInputs:
    """One row's keys ``[1, 1, N, d]`` as a layer's scoring inputs; ``masked``: with the model mask
    of all-real tokens (SubGen's row-masked steady step), else none (every row full)."""
    b, h, n, d = keys.shape
    return ScoringInputs(
        keys=keys,
        values=keys,
        queries=torch.zeros(b, h, 1, d),
        positions=positions,
        mask=torch.ones(b, 1, 1, n, dtype=torch.bool) if masked else None,
        scaling=1.0,
        layer_index=0,
        num_layers=1,
        sequence_length=n,
        phase=DECODE,
        token_scores=token_scores,
    )


@dataclass
class Divergence:
    decisions: int  # decode decisions checked (one per step and row)
    differing: list[int]  # the steps whose kept set differs from the closest-pair rule's
    most_stale: int  # the most candidates recorded stale after a decision


def decode_against_closest_pair(
    stream: torch.Tensor, policy: SubGen, budget: int, prompt: int, *, masked: bool = False, fail_fast: bool = False
) -> Divergence:
    """Prefill ``prompt`` keys of ``stream`` (the first ``budget`` kept), then decode the rest one token a step as the cache
    does (the kept tokens and their per-token scores compacted by the keep mask); check every
    decision against :func:`closest_pair_rule` over the same candidates."""
    recent, d = policy.config.recent, stream.shape[-1]
    keys = stream[:prompt][None, None]
    positions = torch.arange(prompt, dtype=torch.int32)[None, None]
    prefill_scoring = _scoring(keys, positions, {}, masked)
    keep = policy.select_prefill(prefill_scoring, budget, {})
    scores = {name: value[keep].reshape(1, 1, -1) for name, value in prefill_scoring.token_scores.items()}
    keys, positions = keys[keep].reshape(1, 1, -1, d), positions[keep].reshape(1, 1, -1)
    differing, most_stale = [], 0
    for step in range(prompt, stream.shape[0]):
        keys = torch.cat([keys, stream[step][None, None, None]], dim=2)
        positions = torch.cat([positions, torch.tensor([[[step]]], dtype=torch.int32)], dim=2)
        scores = {name: torch.cat([value, value.new_zeros(1, 1, 1)], dim=2) for name, value in scores.items()}
        before = positions[0, 0, :-recent].tolist() if recent else positions[0, 0].tolist()
        scoring = _scoring(keys, positions, scores, masked)
        keep = policy.select_decode(scoring, budget, {})
        expected = closest_pair_rule(stream[before], before, budget - recent)
        recent_positions = set(positions[0, 0, -recent:].tolist()) if recent else set()
        if set(positions[keep].tolist()) != expected | recent_positions:
            if fail_fast:
                raise AssertionError(f"step {step}: the kept set differs from the closest-pair rule's")
            differing.append(step)
        keys, positions = keys[keep].reshape(1, 1, -1, d), positions[keep].reshape(1, 1, -1)
        scores = {name: value[keep].reshape(1, 1, -1) for name, value in scoring.token_scores.items()}
        nearest = scores[NEAREST_POSITION][0, 0]
        candidates = nearest.new_ones(nearest.shape, dtype=torch.bool)
        if recent:
            candidates[-recent:] = False  # kept in order here: the last ones are the recent window
        most_stale = max(most_stale, int((candidates & (nearest < 0)).sum()))
    return Divergence(stream.shape[0] - prompt, differing, most_stale)


def model_decisions(width: int, prompt: int, steps: int, layers: int, ratio: float) -> tuple[int, int]:
    """``(differing, decisions)`` on the kv-heavy random model generating greedy tokens with the
    default (exact) SubGen: at every decode decision of every (layer, KV head) row, whether a
    ``stale_refresh_width=width`` decision from the same state keeps a different set."""
    import kvhive
    from kvhive.models import kv_heavy_model

    model = kv_heavy_model(layers)
    approximate = SubGen(stale_refresh_width=width)
    counts = {"differing": 0, "decisions": 0}
    originals = {name: getattr(SubGen, name) for name in ("select_decode", "select_decode_drop")}

    def checked(name):
        def select(self, scoring, budget, state):
            if self is approximate:
                return originals[name](self, scoring, budget, state)
            scores = {key: value.clone() for key, value in scoring.token_scores.items()}
            copy = dataclasses.replace(scoring, token_scores=scores, key_probes=None)
            other = getattr(approximate, name)(copy, budget, {})
            chosen = originals[name](self, scoring, budget, state)
            if chosen is not None:
                differ = chosen != other
                rows = differ.shape[0] * differ.shape[1]
                counts["differing"] += int(differ.reshape(rows, -1).any(-1).sum())
                counts["decisions"] += rows
            return chosen

        return select

    for name in originals:
        setattr(SubGen, name, checked(name))
    try:
        cache = kvhive.make_cache(model, "subgen", ratio=ratio)
        ids = torch.randint(3, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            token = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            for _ in range(steps):
                token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    finally:
        for name, original in originals.items():
            setattr(SubGen, name, original)
    return counts["differing"], counts["decisions"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="*", default=[16, 64])
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    parser.add_argument("--widths", type=int, nargs="*", default=[1, 4, 8, 16])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--budget", type=int, default=40)
    parser.add_argument("--recent", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=48)
    parser.add_argument(
        "--kv-heavy", type=int, default=0, metavar="PROMPT", help="also the kv-heavy model at this prompt"
    )
    parser.add_argument("--layers", type=int, default=2, help="kv-heavy layers")
    parser.add_argument("--ratio", type=float, default=0.1, help="kv-heavy budget as a ratio of the prompt")
    args = parser.parse_args()
    if args.kv_heavy:
        for width in args.widths:
            differing, decisions = model_decisions(width, args.kv_heavy, args.steps, args.layers, args.ratio)
            print(
                f"kv-heavy {args.layers} layers, {args.kv_heavy}-token prompt, {args.steps} greedy steps, "
                f"ratio {args.ratio}: stale_refresh_width={width} differs from the exact rule on "
                f"{differing} of {decisions} decisions (same state)"
            )
    for dim in args.dims:
        for width in [None, *args.widths]:
            decisions = differing = most_stale = 0
            for seed in args.seeds:
                stream = hub_stream(args.prompt + args.steps, dim, seed)
                policy = SubGen(recent=args.recent, stale_refresh_width=width)
                result = decode_against_closest_pair(stream, policy, args.budget, args.prompt)
                decisions += result.decisions
                differing += len(result.differing)
                most_stale = max(most_stale, result.most_stale)
            name = "exact (None)" if width is None else str(width)
            print(
                f"d={dim} stale_refresh_width={name}: {differing} of {decisions} decisions differ "
                f"from the closest pair; most stale candidates after a decision: {most_stale}"
            )


if __name__ == "__main__":
    main()
