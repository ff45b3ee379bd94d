"""Does AhaKV keep the needle? Both readings of the SG-softmax gain, prefill only (no decoding).

For the needle-in-a-haystack items of ``kvhive.evaluation`` (same prompts as ``kvhive eval
--tasks needle``), one prefill per item records every compressed layer's queries, keys and values
(``ahakv_gain_entropy._Recorder``); AhaKV's prefill keep mask is then computed for each reading
of the gain (``gain_input`` = ``raw_qk`` / ``scaled_qk``), for the plain softmax (no gain) and
for the value prior alone, and the fraction of the needle sentence's tokens that is kept is
reported (mean over heads and compressed layers). This isolates the eviction decision from
decoding, at a fraction of the cost of a generation run.

    python benchmarks/ahakv_gain_needle_retention.py [--model gemma-3-270m] [--limit 10] [--budgets 128 256]

Writes ``results/ahakv_gain/needle_retention-<model>.jsonl`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from ahakv_gain_entropy import DATA, PLAIN, PRIOR, kept, record_layers

import kvhive
from kvhive.evaluation.runner import resolve_tasks
from kvhive.evaluation.tasks.needle import NEEDLE
from kvhive.methods.ahakv import GAIN_INPUTS

ROOT = Path(__file__).resolve().parents[1]
READINGS = (*GAIN_INPUTS, PLAIN, PRIOR)


def needle_span(tokenizer, prompt: str) -> tuple[torch.Tensor, list[int]]:
    """Token ids of ``prompt`` and the positions of the tokens overlapping the needle sentence."""
    start = prompt.index(NEEDLE.strip())
    stop = start + len(NEEDLE.strip())
    encoded = tokenizer(prompt, return_offsets_mapping=True, return_tensors="pt")
    offsets = encoded["offset_mapping"][0].tolist()
    positions = [i for i, (a, b) in enumerate(offsets) if b > start and a < stop and b > a]
    if not positions:
        raise ValueError("needle not found in the tokenised prompt")
    return encoded["input_ids"], positions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--task", default="needle", help="a needle task spec, e.g. needle:lengths=1000+2000")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--budgets", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--recent", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "ahakv_gain")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model, tokenizer = kvhive.load_model(args.model)
    task = resolve_tasks([args.task])[0]
    items = task.load(DATA, args.limit, args.seed, tokenizer)
    rows = []
    start = time.perf_counter()
    for item in items:
        ids, positions = needle_span(tokenizer, item.prompt)
        layers = record_layers(model, ids)
        for layer_index, scoring in sorted(layers.items()):
            for budget in args.budgets:
                for reading in READINGS:
                    keep = kept(scoring, budget, args.recent, reading)  # [H, n]
                    fraction = keep[:, positions].float().mean().item()
                    rows.append(
                        {
                            "model": args.model,
                            "item": item.id,
                            "tokens": ids.shape[1],
                            "layer": layer_index,
                            "budget": budget,
                            "reading": reading,
                            "needle_tokens": len(positions),
                            "needle_kept_fraction": fraction,
                        }
                    )
        print(f"{item.id}: {ids.shape[1]} tokens, needle {len(positions)} tokens, {time.perf_counter() - start:.0f}s")
    seconds = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"needle_retention-{Path(args.model).name}"
    with open(args.out / f"{stem}.jsonl", "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows)
    lines = [
        f"# AhaKV needle retention by gain reading on {args.model}",
        "",
        (
            f"`python benchmarks/ahakv_gain_needle_retention.py --model {args.model} --task {args.task} --limit {args.limit} "
            f"--budgets {' '.join(map(str, args.budgets))}` ({seconds:.0f} s wall on the shared CPU), items: {', '.join(i.id for i in items)}. "
            "Fraction of the needle sentence's tokens kept by AhaKV's prefill eviction, mean over items x compressed "
            "layers x heads (in brackets: items whose needle is fully kept in every compressed layer)."
        ),
        "",
        "| budget | " + " | ".join(READINGS) + " |",
        "|---|" + "---|" * len(READINGS),
    ]
    for budget in args.budgets:
        cells = []
        for reading in READINGS:
            group = [r for r in rows if r["budget"] == budget and r["reading"] == reading]
            whole = sum(all(r["needle_kept_fraction"] == 1.0 for r in group if r["item"] == item.id) for item in items)
            cells.append(f"{statistics.fmean(r['needle_kept_fraction'] for r in group):.2f} ({whole}/{len(items)})")
        lines.append(f"| {budget} | " + " | ".join(cells) + " |")
    summary = "\n".join(lines) + "\n"
    (args.out / f"{stem}.md").write_text(summary, encoding="utf-8")
    print(summary)


if __name__ == "__main__":
    main()
