"""Record BUZZ fixtures from the authors' code for mean-form layouts (issue 26).

The authors' ``BuzzKVCacheWithAccumulation`` (danielfang001/buzz-llm @ 9d952bd,
``entry_function/eval_inside_forward/cache/cache_entity_collection.py``) takes the sink ``k``, window
``w``, stride ``s`` and threshold ``T`` as its arguments and has no notion of a budget, so it has no
"mean form" of its own; the mean form is kvhive's way of choosing ``(w, T)`` from a budget ``C``.
This script gives their class the layout ``kvhive.methods.buzz.mean_layout(C, k, s)`` chooses and
records the positions it keeps, prefill and every decode step, on fixed random inputs:
``tests/fixtures/buzz_authors_mean_form.json``, read by ``tests/methods/test_buzz_authors_fixtures.py``.

Their code is not part of kvhive: point ``--authors`` at a checkout (or ``git archive`` of
``entry_function``) of their repository::

    python crosscheck/buzz_authors_mean_form.py --authors /path/to/buzz-llm \
        --out tests/fixtures/buzz_authors_mean_form.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from kvhive.methods.buzz import mean_layout

# name, seed, heads, prompt, decode steps, sink, stride, budget C (the layout is mean_layout's)
CASES = [
    # The single pass fits C: both readings of Remark 2 keep it; then the mean-form decode schedule
    # (the cache asks at every step past C, BUZZ evicts only past T) for 160 steps.
    ("mean_fits", 11, 2, 100, 160, 4, 5, 30),
    ("mean_fits_stride3", 12, 2, 60, 160, 4, 3, 30),
    # The single pass (28 samples) is between C - k - w = 20 and T = 31: the authors keep it, which
    # prefill_fit="peak" reproduces at every step; prefill_fit="budget" thins it once with ŝ = 3.
    ("mean_between", 13, 2, 150, 160, 4, 5, 30),
    # The single pass (78 samples) exceeds T = 31: the authors keep it all (over their own peak);
    # kvhive thins it once (peak reading, 26 <= 31) or twice (budget reading, 9 <= 20).
    ("mean_beyond", 14, 2, 400, 0, 4, 5, 30),
]


def authors_class(root: Path):
    sys.path.insert(0, str(root))
    from entry_function.eval_inside_forward.cache.cache_entity_collection import (  # noqa: PLC0415
        BuzzKVCacheWithAccumulation,
    )

    return BuzzKVCacheWithAccumulation


def _rounded(values: torch.Tensor) -> torch.Tensor:
    return torch.round(values * 10_000) / 10_000


def _as_json(rows: list[list[float]]) -> list[list[float]]:
    return [[round(x, 4) for x in row] for row in rows]


def record(cls, name, seed, heads, prompt, steps, sink, stride, budget) -> dict:
    layout = mean_layout(budget, sink, stride)
    generator = torch.Generator().manual_seed(seed)
    theirs = cls(sink_size=sink, window_size=layout.window, stride_size=stride, sample_threshold=layout.threshold)
    # Keys and values carry each token's position, so what their class keeps can be read back.
    positions = torch.arange(prompt, dtype=torch.float32).expand(1, heads, prompt)[..., None]
    # Inputs rounded to 4 decimals, so the JSON file holds exactly what their class was given.
    column_sums = _rounded(torch.rand(heads, prompt, generator=generator) * 4)
    past = theirs((positions.clone(), positions.clone()), column_sums[None, :, None, :])
    kept = [[int(p) for p in past[0][0, h, :, 0].tolist()] for h in range(heads)]
    rows, history = [], [kept]
    for step in range(steps):
        new = torch.full((1, heads, 1, 1), float(prompt + step))
        past = (torch.cat([past[0], new], dim=2), torch.cat([past[1], new], dim=2))
        n = past[0].shape[2]
        row = torch.rand(heads, n, generator=generator)
        row = _rounded(row / row.sum(dim=-1, keepdim=True))
        past = theirs(past, row[None, :, None, :])
        rows.append(row.tolist())
        history.append([[int(p) for p in past[0][0, h, :, 0].tolist()] for h in range(heads)])
    spec = {
        "name": name,
        "seed": seed,
        "heads": heads,
        "prompt": prompt,
        "steps": steps,
        "sink": sink,
        "window": layout.window,
        "threshold": layout.threshold,
        "stride": stride,
        "budget": budget,
        "budget_form": "mean",
    }
    return {
        "case": spec,
        "prefill_column_sums": _as_json(column_sums.tolist()),
        "decode_attention_rows": [_as_json(row) for row in rows],
        "kept_positions": history,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--authors", type=Path, required=True, help="a checkout of danielfang001/buzz-llm")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    cls = authors_class(args.authors)
    cases = [record(cls, *case) for case in CASES]
    args.out.write_text(json.dumps(cases) + "\n")
    for case in cases:
        print(case["case"]["name"], [len(k[0]) for k in case["kept_positions"][:3]], "...")


if __name__ == "__main__":
    main()
