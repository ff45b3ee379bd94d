"""Why AhaKV trails SnapKV on the single needle (results/claims): an ablation on the embedded model.

Needle at 1,000 tokens, the claims run's needle items 3-12 (depths 50, 75, 100, then the second
and third repetitions of depths 0-100), budget 128 tokens per head, greedy 12 tokens. Variants: AhaKV as is; AhaKV without decode-phase eviction (``decode_every`` larger
than the generation); SnapKV as is (pooling kernel 7); SnapKV with ``kernel=1`` (no pooling);
AhaKV with a 1-tap value-prior filter. Prints exact-match counts.

    python benchmarks/ablation_needle_pooling.py [--budget 128] [--items 10]
"""

from __future__ import annotations

import argparse
import json

import torch

import kvhive
from kvhive.compat import cache_kwarg
from kvhive.evaluation.cli import default_data_dir
from kvhive.evaluation.runner import resolve_tasks
from kvhive.models import load_model

VARIANTS = {
    "ahakv": dict(method="ahakv"),
    "ahakv, no decode eviction": dict(method="ahakv", decode_every=1000),
    "ahakv, value-prior kernel=1": dict(method="ahakv", kernel=1),
    "snapkv": dict(method="snapkv"),
    "snapkv, no pooling (kernel=1)": dict(method="snapkv", kernel=1),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--items", type=int, default=10)
    args = parser.parse_args()
    model, tokenizer = load_model()
    [task] = resolve_tasks(["needle:lengths=1000:max_new_tokens=12"])
    items = task.load(default_data_dir(), args.items + 2, 0, tokenizer)[2:]
    found = {name: 0 for name in VARIANTS}
    for item in items:
        input_ids = tokenizer(item.prompt, return_tensors="pt")["input_ids"]
        for name, variant in VARIANTS.items():
            options = dict(variant)
            cache = kvhive.make_cache(model, options.pop("method"), args.budget, **options)
            with torch.no_grad():
                output = model.generate(input_ids, **{cache_kwarg(model): cache}, max_new_tokens=12, do_sample=False)
            text = tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)
            found[name] += int(task.score(item, text)["exact_match"])
    print(json.dumps({"budget": args.budget, "items": len(items), "found": found}, indent=2))


if __name__ == "__main__":
    main()
