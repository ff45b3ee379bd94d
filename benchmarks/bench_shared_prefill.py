"""Speed-up of one shared prefill per item over one prefill per (method, budget) setting.

Runs KVHiveBackend.generate on the embedded Gemma-3-270M with an essay prompt of about
``--tokens`` tokens and a grid of prefill-phase settings, once with ``share_prefill=True`` and
once with ``share_prefill=False``, checks the outputs are identical and prints the times.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kvhive.evaluation.backend import Setting
from kvhive.evaluation.kvhive_backend import KVHiveBackend
from kvhive.models import load_model

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parser.parse_args()
    model, tokenizer = load_model()
    essays = sorted((ROOT.parent / "shared" / "data" / "paul_graham_essays" / "essays").glob("*.txt"))
    text = "\n\n".join(path.read_text() for path in essays[:3])
    ids = tokenizer(text)["input_ids"][: args.tokens]
    prompt = tokenizer.decode(ids, skip_special_tokens=True) + "\n\nSummary:"
    settings = [
        Setting(method, budget) for method in ("snapkv", "h2o", "streamingllm", "ada-snapkv") for budget in (0.1, 0.3)
    ] + [Setting("full", 1.0)]
    timings, outputs = {}, {}
    for shared in (True, False):
        backend = KVHiveBackend(model, tokenizer, share_prefill=shared)
        start = time.perf_counter()
        outputs[shared] = backend.generate(prompt, args.new_tokens, settings)
        timings[shared] = time.perf_counter() - start
    result = {
        "prompt_tokens": len(tokenizer(prompt)["input_ids"]),
        "settings": len(settings),
        "new_tokens": args.new_tokens,
        "shared_seconds": timings[True],
        "separate_seconds": timings[False],
        "speedup": timings[False] / timings[True],
        "identical_outputs": outputs[True] == outputs[False],
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
