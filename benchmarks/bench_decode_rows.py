"""Settings decoded as the rows of one batch (``CacheRows``) vs one setting after another.

Runs ``KVHiveBackend.generate`` on an embedded model with a needle-sized prompt and the claims
suite's needle settings (25: full + 8 methods x 64/128/256 tokens), once with
``share_decode=True`` and once with ``share_decode=False`` (both share the prefill), checks the
texts are the same, and prints wall times (``--profile``: also the top operators of
``torch.profiler`` for each).

    python benchmarks/bench_decode_rows.py --model qwen2.5-0.5b --dtype bfloat16 --tokens 2000
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kvhive.evaluation.backend import Setting
from kvhive.evaluation.claims import claims_grid
from kvhive.evaluation.kvhive_backend import KVHiveBackend
from kvhive.models import load_model

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--question",
        default="Summarize the text above in five detailed sentences.",
        help="asked after the text; a long answer keeps every setting decoding for --new-tokens steps",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also run each path under torch.profiler (its event records took 18 GB with 25 settings x 32 steps "
        "on Qwen: use a smaller --new-tokens)",
    )
    parser.add_argument("--profile-rows", type=int, default=12, help="operators listed per profile")
    parser.add_argument("--json", type=Path, help="write the numbers here")
    args = parser.parse_args()
    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype))
    essays = sorted((ROOT.parent / "shared" / "data" / "paul_graham_essays" / "essays").glob("*.txt"))
    text = "\n\n".join(path.read_text() for path in essays[:4])
    ids = tokenizer(text)["input_ids"][: args.tokens]
    prompt = tokenizer.decode(ids, skip_special_tokens=True) + "\n\n" + args.question
    if getattr(tokenizer, "chat_template", None):  # an instruction model answers inside its template
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    _, methods, budgets = claims_grid()
    settings = [Setting("full", 1.0)] + [
        Setting(method, budget) for method in methods["needle"] for budget in budgets["needle"]
    ]
    timings, outputs, tables = {}, {}, {}
    for shared in (True, False):
        backend = KVHiveBackend(model, tokenizer, share_decode=shared)
        backend.generate(prompt[:200], 2, settings[:2])  # warm-up: first-call allocations
        start = time.perf_counter()
        outputs[shared] = backend.generate(prompt, args.new_tokens, settings)
        timings[shared] = time.perf_counter() - start
        tables[shared] = ""
        if args.profile:
            with profile(activities=[ProfilerActivity.CPU]) as profiler:
                backend.generate(prompt, args.new_tokens, settings)
            tables[shared] = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile_rows)
    same = sum(a == b for a, b in zip(outputs[True], outputs[False], strict=True))
    for shared in (True, False):
        print(f"== share_decode={shared}: {timings[shared]:.1f} s")
        print(tables[shared])
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "prompt_tokens": len(tokenizer(prompt)["input_ids"]),
        "new_tokens": args.new_tokens,
        "generated_tokens": [len(tokenizer(text)["input_ids"]) for text in outputs[True]],
        "settings": len(settings),
        "rows_s": round(timings[True], 2),
        "one_by_one_s": round(timings[False], 2),
        "speedup": round(timings[False] / timings[True], 2),
        "same_texts": f"{same}/{len(settings)}",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
