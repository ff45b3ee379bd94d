"""Golden kept positions of every registered method, recorded from the code and compared by
``tests/methods/test_golden_kept_positions.py``.

A refactoring must not change which tokens a method keeps. This module runs every method on
fixed inputs (tiny MHA and GQA models with a left-padded batch, a tiny Gemma 3 with sliding
layers, and the embedded Gemma-3-270M on one short real text) and records, after the prefill
and after some decode steps, the original positions kept in every (row, head) of every
compressed layer, plus Ada-KV's head budgets.

A change that is *meant* to change kept positions (a fidelity fix) re-records only the
affected entries, in its own commit saying why::

    .venv/bin/python tests/golden_kept.py --methods pyramidkv ada-pyramidkv

(``--gemma`` also re-records the embedded-model entries; it needs the converted model.)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

FIXTURE = Path(__file__).parent / "fixtures" / "golden_kept_positions.json"

TINY_MODELS = ("llama-mha", "llama-gqa", "gemma3-gqa")
PREFILL_PAD = 5  # the second row of every tiny batch is left-padded by this many tokens
DECODE_STEPS = 6
SNAPSHOT_STEPS = (0, 3, 6)  # 0 = right after the prefill

# BUZZ refuses a batch whose rows hold different numbers of real tokens (each row would need its
# own eviction schedule): its cases run the same batch without the padding.
UNPADDED_METHODS = frozenset({"buzz", "buzz-logn"})

# Extra parameter sets beyond the defaults: the options whose kept positions differ.
EXTRA_PARAMETERS = {
    "ada-snapkv": [{"head_granularity": "query"}],
    "ada-pyramidkv": [{"head_granularity": "query"}],
    "ada-ahakv": [{"head_granularity": "query"}],
    "pyramidkv": [{"window": 4}],
    "random": [{"seed": 7}],
}

# One short real text for the embedded model (Paul Graham, "How to Do Great Work", first lines).
GEMMA_TEXT = (
    "If you collected lists of techniques for doing great work in a lot of different fields, what would "
    "the intersection look like? I decided to find out by making it. Partly my goal was to create a guide "
    "that could be used by someone working in any field. But I was also curious about the shape of the "
    "intersection. And one thing this exercise shows is that it does have a definite shape; it's not "
    "just a point labelled work hard. The following recipe assumes you're very ambitious. The first step "
    "is to decide what to work on."
)
GEMMA_BUDGET = 48
GEMMA_DECODE_STEPS = 3


def kept_positions(layer) -> list[list[list[int]]]:
    """Sorted original positions kept in every ``[row][head]`` of one layer store."""
    lengths = layer.lengths_host
    if layer.is_uniform:
        positions = layer.dense()[2]
        return [[sorted(positions[b, h].tolist()) for h in range(lengths.shape[1])] for b in range(lengths.shape[0])]
    flat = layer.stored_flat_positions().tolist()
    offsets = layer.segment_offsets().tolist()
    heads = lengths.shape[1]
    return [
        [sorted(flat[offsets[b * heads + h] : offsets[b * heads + h + 1]]) for h in range(heads)]
        for b in range(lengths.shape[0])
    ]


def snapshot(cache) -> dict:
    layers = {str(index): kept_positions(cache.layers[index]) for index in cache.compressed_layers}
    return {"layer_budgets": {str(k): v for k, v in cache.layer_budgets.items()}, "kept": layers}


def _case_key(model: str, method: str, parameters: dict, budget) -> str:
    options = ",".join(f"{k}={v}" for k, v in sorted(parameters.items()))
    return f"{model}|{method}|{options}|{budget}"


@torch.no_grad()
def run_case(
    model, method: str, parameters: dict, budget, input_ids, attention_mask, steps: int, snapshot_steps
) -> dict:
    import kvhive

    cache = kvhive.make_cache(model, method, budget=budget, **parameters)
    snapshots = {}
    output = model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
    snapshots["0"] = snapshot(cache)
    mask = attention_mask
    for step in range(1, steps + 1):
        next_token = output.logits[:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(next_token)], dim=1)
        output = model(input_ids=next_token, attention_mask=mask, past_key_values=cache, use_cache=True)
        if step in snapshot_steps:
            snapshots[str(step)] = snapshot(cache)
    return snapshots


def _tiny(name: str):
    from kvhive.models import tiny_model

    architecture, attention = name.split("-")
    return tiny_model(architecture, attention)


def tiny_cases(methods):
    """``(key, thunk)`` for every tiny case of ``methods``."""
    from kvhive.methods.registry import policy_class

    from helpers import left_padded_batch

    models = {}
    for model_name in TINY_MODELS:
        for method in methods:
            for parameters in [{}] + EXTRA_PARAMETERS.get(method, []):
                minimum = policy_class(method)(**parameters).minimum_budget()
                first = max(minimum, 8)
                length = first + 24
                for budget in (first, first + 7, 0.75):
                    key = _case_key(model_name, method, parameters, budget)

                    def thunk(
                        model_name=model_name, method=method, parameters=parameters, budget=budget, length=length
                    ):
                        if model_name not in models:
                            models[model_name] = _tiny(model_name)
                        model = models[model_name]
                        # A ratio resolves on each row's real length: rows of different lengths would get
                        # different budgets, which decode-phase methods refuse; the ratio case is unpadded.
                        pad = 0 if method in UNPADDED_METHODS or isinstance(budget, float) else PREFILL_PAD
                        input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=length, pad=pad)
                        return run_case(
                            model, method, parameters, budget, input_ids, attention_mask, DECODE_STEPS, SNAPSHOT_STEPS
                        )

                    yield key, thunk


def gemma_cases(methods):
    from kvhive.methods.registry import policy_class

    state = {}
    for method in methods:
        for parameters in [{}] + EXTRA_PARAMETERS.get(method, []):
            budget = max(GEMMA_BUDGET, policy_class(method)(**parameters).minimum_budget())
            key = _case_key("gemma-3-270m", method, parameters, budget)

            def thunk(method=method, parameters=parameters, budget=budget):
                if "model" not in state:
                    from kvhive.models import load_model

                    model, tokenizer = load_model()
                    ids = tokenizer(GEMMA_TEXT, return_tensors="pt").input_ids
                    state["model"], state["ids"] = model, ids
                model, ids = state["model"], state["ids"]
                return run_case(
                    model,
                    method,
                    parameters,
                    budget,
                    ids,
                    torch.ones_like(ids),
                    GEMMA_DECODE_STEPS,
                    (GEMMA_DECODE_STEPS,),
                )

            yield key, thunk


def load() -> dict:
    return json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}


def main(argv=None) -> None:
    from kvhive.methods.registry import method_names

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="*", default=None, help="re-record only these methods (default: all)")
    parser.add_argument("--gemma", action="store_true", help="also record the embedded-model entries")
    args = parser.parse_args(argv)
    methods = args.methods or method_names()
    torch.set_num_threads(1)
    golden = load()
    if args.methods:  # re-recorded methods lose their old entries (budgets or options may have changed)
        golden = {key: value for key, value in golden.items() if key.split("|")[1] not in methods}
    cases = list(tiny_cases(methods)) + (list(gemma_cases(methods)) if args.gemma else [])
    for key, thunk in cases:
        golden[key] = thunk()
        print(key, file=sys.stderr)
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(json.dumps(dict(sorted(golden.items())), separators=(",", ":")) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent.parent))
    sys.path.insert(0, str(Path(__file__).parent))
    main()
