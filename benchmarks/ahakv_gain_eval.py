"""AhaKV's two readings of the SG-softmax gain on evaluation tasks (needle, mdqa, ...).

``kvhive eval`` takes registry names only, and both readings are the one method ``ahakv`` with a
different ``gain_input`` (:class:`kvhive.methods.ahakv.AhaKVConfig`). This script runs the same
runner (:func:`kvhive.evaluation.runner.run_eval`, same tasks, items, metrics, results file and
report) with a backend that understands ``ahakv-raw_qk`` and ``ahakv-scaled_qk`` as ``ahakv`` with
that option; any other name is the registry's method with its defaults.

    python benchmarks/ahakv_gain_eval.py --tasks needle,mdqa --budgets 128,256 --limit 8 \\
        --methods ahakv-raw_qk,ahakv-scaled_qk,snapkv --out results/ahakv_gain/eval-gemma-3-270m

Writes ``OUT/results.jsonl`` and ``OUT/report.md`` like ``kvhive eval``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvhive.api import make_cache
from kvhive.evaluation.backend import FULL_METHOD
from kvhive.evaluation.cli import default_data_dir
from kvhive.evaluation.kvhive_backend import KVHiveBackend
from kvhive.evaluation.report import write_report
from kvhive.evaluation.runner import run_eval
from kvhive.methods.ahakv import GAIN_INPUTS
from kvhive.methods.registry import policy_class
from kvhive.models import load_model

VARIANTS = {f"ahakv-{gain_input}": ("ahakv", {"gain_input": gain_input}) for gain_input in GAIN_INPUTS}


def method_and_parameters(name: str) -> tuple[str, dict]:
    return VARIANTS.get(name, (name, {}))


def validate_method(name: str) -> bool:
    policy_class(method_and_parameters(name)[0])  # raises ValueError naming the unknown method
    return True


class GainVariantBackend(KVHiveBackend):
    """The kvhive backend, with ``ahakv-<gain_input>`` names resolved to ``ahakv`` + that option."""

    def _caches(self, settings):
        caches = []
        for setting in settings:
            method, parameters = method_and_parameters(setting.method)
            caches.append(make_cache(self.model, method, setting.budget, **parameters))
        return caches

    def infeasible(self, setting, context_tokens):
        if setting.method == FULL_METHOD:
            return None
        method, parameters = method_and_parameters(setting.method)
        return make_cache(self.model, method, setting.budget, **parameters).budget_problem(context_tokens)

    def streaming_nll(self, token_ids, settings):
        if any(setting.method in VARIANTS for setting in settings):
            raise ValueError(
                "perplexity tasks are not wired for the ahakv-<gain_input> names; use generate/choice tasks"
            )
        return super().streaming_nll(token_ids, settings)


def _budget(text: str) -> float | int:
    return float(text) if "." in text else int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", default="needle,mdqa")
    parser.add_argument("--methods", default=",".join(VARIANTS))
    parser.add_argument("--budgets", default="128,256")
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    model, tokenizer = load_model(args.model)
    backend = GainVariantBackend(model, tokenizer, model_name=args.model)
    run = run_eval(
        backend,
        args.tasks.split(","),
        args.methods.split(","),
        [_budget(b) for b in args.budgets.split(",")],
        args.limit,
        args.data_dir or default_data_dir(),
        args.out,
        seed=args.seed,
        progress=not args.no_progress,
        method_validator=validate_method,
        model_name=args.model,
    )
    print(f"{run.written} new results ({run.skipped} already done, {run.total} in the grid) -> {run.results_path}")
    write_report(args.out)
    print(f"report: {args.out / 'report.md'}")


if __name__ == "__main__":
    main()
