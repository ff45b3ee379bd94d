"""Decode step time of every method against SnapKV's, measured side by side in one process.

The CPU proxy of issue 23's decode target: kv-heavy shape, 2 layers, a 4k prompt, 10% budget,
one thread. Times are this process's CPU time (``process_time``: with one thread it leaves out
what other processes on the cores take, which wall time does not). Each method is prefilled once; then decode steps run in rounds, every method taking
``--steps`` steps per round in turn, so load from other processes falls on all methods alike.
Prints, per method, the best of the rounds' median ms/step and its ratio to SnapKV's; with
``--json PATH`` appends one JSON line per method.

    OMP_NUM_THREADS=1 python benchmarks/bench_decode_cpu.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import kvhive
from kvhive.api import make_cache
from kvhive.compat import cache_kwarg
from kvhive.methods.registry import method_names
from kvhive.models.shapes import kv_heavy_model

DECODE_EVICTING = ("tova", "streamingllm", "h2o", "ahakv", "buzz", "subgen", "subgen-attention", "bumblebee", "random")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=",".join(("snapkv", "full", *DECODE_EVICTING, "ada-snapkv")))
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--budget", type=float, default=0.1)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16, help="decode steps per method per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="append one JSON line per method to this file")
    args = parser.parse_args()
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in method_names()]
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; known: {', '.join(method_names())}")
    if "snapkv" not in methods:
        methods.insert(0, "snapkv")
    torch.manual_seed(0)
    model = kv_heavy_model(num_layers=args.layers)
    prompt = torch.randint(3, model.config.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0))
    key = cache_kwarg(model)  # `cache` where transformers has it, else `past_key_values`
    states = {}
    with torch.inference_mode():
        for method in methods:
            cache = make_cache(model, method, None if method == "full" else args.budget)
            logits = model(input_ids=prompt, **{key: cache}, use_cache=True, logits_to_keep=1).logits
            states[method] = [cache, logits[:, -1:].argmax(-1), args.context]
        times: dict[str, list[float]] = {m: [] for m in methods}
        for _ in range(args.rounds):
            for method in methods:
                cache, token, position = states[method]
                steps = []
                for _ in range(args.steps):
                    start = time.process_time()
                    logits = model(
                        input_ids=token,
                        position_ids=torch.tensor([[position]]),
                        **{key: cache},
                        use_cache=True,
                    ).logits
                    steps.append(time.process_time() - start)
                    token = logits[:, -1:].argmax(-1)
                    position += 1
                states[method] = [cache, token, position]
                times[method].append(statistics.median(steps))
    reference = min(times["snapkv"])
    print(
        f"kv-heavy, {args.layers} layers, {args.context} tokens, budget {args.budget}, "
        f"{torch.get_num_threads()} thread(s), best of {args.rounds} rounds' medians ({args.steps} steps)"
    )
    for method in methods:
        best = min(times[method])
        line = {
            "method": method,
            "ms_per_step": round(best * 1e3, 2),
            "x_snapkv": round(best / reference, 3),
            "round_medians_ms": [round(t * 1e3, 2) for t in times[method]],
            "context": args.context,
            "budget": args.budget,
            "layers": args.layers,
            "threads": torch.get_num_threads(),
            "kvhive_commit": kvhive.__dict__.get("__commit__"),
        }
        print(
            f"{method:18s} {best * 1e3:7.2f} ms/step  {best / reference:5.2f}x snapkv   rounds {line['round_medians_ms']}"
        )
        if args.json:
            with open(args.json, "a") as handle:
                handle.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
