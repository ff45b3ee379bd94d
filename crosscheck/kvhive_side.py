"""Step 3 (kvhive venv): run the kvhive methods on the same model/prompt and record what they keep.

Two runs per case and ratio:

* ``native``: ``make_cache(model, method, ratio=1 - compression_ratio, **params)`` — kvhive's
  own budget arithmetic (``round(ratio * N)`` per head; PyramidKV's own layer budgets).
* ``matched``: the same method forced to keep exactly as many tokens per layer as kvpress did
  (read from kvpress.json), so that the kept *sets* are compared with the counts removed as a
  source of difference: a plain integer ``budget`` for uniform methods, and for PyramidKV a
  subclass (here, not in kvhive) whose ``layer_budgets`` returns kvpress's per-layer counts.

Kept original positions per (layer, KV head) are read through the layer store's public API:
``stored_flat_positions()`` (the stored tokens' original positions, flat in (batch, head) segment
order, for the dense and the packed layout alike) cut by ``segment_offsets()``.

Any case that fails here is recorded with its error and makes the script exit non-zero (after
writing the JSON, so the error can be read): a cross-check with a case missing is not a result.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import traceback
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cases import CASES, COMPRESSION_RATIOS, case_key  # noqa: E402

import kvhive  # noqa: E402
from kvhive.api import make_cache  # noqa: E402
from kvhive.methods import policy_class  # noqa: E402


def kept_positions(cache) -> list[dict]:
    layers = []
    for index, store in enumerate(cache.layers):
        lengths = store.lengths
        assert lengths.shape[0] == 1, "batch size 1 only"
        offsets = store.segment_offsets().tolist()
        positions = store.stored_flat_positions().tolist()
        heads = [
            sorted(int(p) for p in positions[offsets[head] : offsets[head + 1]]) for head in range(lengths.shape[1])
        ]
        layers.append(
            {"layer": index, "kept": heads, "n_kept": [len(h) for h in heads], "budget": cache.layer_budgets.get(index)}
        )
    return layers


def with_fixed_layer_budgets(method: str, layer_budgets: list[int], params: dict):
    """An instance of ``method``'s policy whose ``layer_budgets`` returns ``layer_budgets``."""
    base = policy_class(method)

    class FixedLayerBudgets(base):  # type: ignore[misc, valid-type]
        def layer_budgets(self, budget: int, num_layers: int, context_length: int | None = None) -> list[int]:
            assert num_layers == len(layer_budgets)
            return list(layer_budgets)

        def minimum_budget(self) -> int:
            return 1

    FixedLayerBudgets.__name__ = f"{base.__name__}FixedLayerBudgets"
    return FixedLayerBudgets(**params)


@contextlib.contextmanager
def avg_pool_count_include_pad():
    """Inside the block, kvhive's SnapKV/PyramidKV average pooling counts the zero padding
    (torch's default, kvpress's and the reference code's), by swapping the ``F`` that
    ``kvhive.methods.snapkv`` looks up; the file itself is not changed."""
    import kvhive.methods.snapkv as snapkv_module

    functional = torch.nn.functional

    class Functional:
        def __getattr__(self, name):
            return getattr(functional, name)

        @staticmethod
        def avg_pool1d(*args, **kwargs):
            kwargs["count_include_pad"] = True
            return functional.avg_pool1d(*args, **kwargs)

    original = snapkv_module.F
    snapkv_module.F = Functional()
    try:
        yield
    finally:
        snapkv_module.F = original


def with_forced_last_token(method: str, params: dict):
    """``method``'s policy (TOVA) with the last prompt token always kept, as kvpress does: the
    scorer's protected tokens (``ScorerPolicy.protected``, kept whatever their score) are the last
    token. The scores and the selection are kvhive's own (``ScorerPolicy.keep``)."""
    from kvhive.methods.base import ScorerPolicy

    base = policy_class(method)
    assert base.protected is ScorerPolicy.protected, f"{method} protects tokens of its own"

    class ForcedLastToken(base):  # type: ignore[misc, valid-type]
        def protected(self, scoring, budget):
            return scoring.recent_tokens(1)

    return ForcedLastToken(**params)


def kvpress_safeguard_alpha(n_kept: int, window: int, alpha: float) -> float:
    """The kvhive Ada-KV ``alpha`` that reproduces ``AdaKVPress``'s safeguard at ``n_kept`` tokens
    per head: kvpress safeguards each head's top ``int(alpha * n_kept)`` (at least 1) over all its
    tokens, the observation window first (scored ``max + 1``); kvhive safeguards the window and
    then ``floor(alpha' * (n_kept - window))`` selected tokens, so ``alpha'`` gives the rest."""
    safe = max(1, int(n_kept * alpha)) if alpha > 0 and n_kept > 0 else 0
    return max(0, safe - window) / (n_kept - window)


def run_one(model, input_ids, method_or_policy, reference_logits, **cache_kwargs):
    cache = make_cache(model, method_or_policy, **cache_kwargs)
    with torch.no_grad():
        logits = model(input_ids, past_key_values=cache, use_cache=True).logits[0, -1]
    if not torch.allclose(logits, reference_logits, atol=1e-5):
        raise RuntimeError("prefill logits changed under compression")
    return kept_positions(cache)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    here = Path(__file__).resolve().parent
    parser.add_argument("--artifacts", type=Path, default=here / "artifacts")
    parser.add_argument("--kvpress-json", type=Path, default=None, help="default: <artifacts>/kvpress.json")
    parser.add_argument("--out", type=Path, default=None, help="default: <artifacts>/kvhive.json")
    args = parser.parse_args()
    kvpress_json = args.kvpress_json or args.artifacts / "kvpress.json"
    out = args.out or args.artifacts / "kvhive.json"
    kvpress_runs = json.loads(kvpress_json.read_text())["runs"] if kvpress_json.exists() else {}

    model = AutoModelForCausalLM.from_pretrained(
        args.artifacts / "model", dtype=torch.float32, attn_implementation="sdpa", local_files_only=True
    ).eval()
    input_ids = torch.tensor([json.loads((args.artifacts / "prompt.json").read_text())["input_ids"]])
    with torch.no_grad():
        reference_logits = model(input_ids).logits[0, -1]

    runs = {}
    for spec in CASES:
        for ratio in COMPRESSION_RATIOS:
            key = case_key(spec["case"], ratio)
            method, params = spec["method"], spec["method_kwargs"]
            entry = {
                "case": spec["case"],
                "compression_ratio": ratio,
                "method": method,
                "params": params,
                "kvhive_ratio": 1 - ratio,
            }
            try:
                policy = policy_class(method)(**params)
                entry["config"] = repr(policy)
                entry["native"] = run_one(model, input_ids, policy, reference_logits, ratio=1 - ratio)
                press = kvpress_runs.get(key)
                if press is not None:
                    counts = [layer["n_kept"] for layer in press["layers"]]
                    if len(set(counts)) == 1:
                        entry["matched"] = run_one(
                            model, input_ids, policy_class(method)(**params), reference_logits, budget=counts[0]
                        )
                    else:
                        fixed = with_fixed_layer_budgets(method, counts, params)
                        entry["matched"] = run_one(model, input_ids, fixed, reference_logits, budget=max(counts))
                for ablation in spec.get("ablations", []):
                    if press is None:
                        break
                    counts = [layer["n_kept"] for layer in press["layers"]]
                    uniform = len(set(counts)) == 1
                    make = (
                        (lambda method=method, params=params: policy_class(method)(**params))
                        if uniform
                        else (
                            lambda method=method, counts=counts, params=params: with_fixed_layer_budgets(
                                method, counts, params
                            )
                        )
                    )
                    budget = counts[0] if uniform else max(counts)
                    if ablation == "count_include_pad":
                        with avg_pool_count_include_pad():
                            kept = run_one(model, input_ids, make(), reference_logits, budget=budget)
                    elif ablation == "safeguard_counts_window":
                        assert uniform
                        alpha = kvpress_safeguard_alpha(budget, params["window"], params["alpha"])
                        policy = policy_class(method)(**{**params, "alpha": alpha})
                        kept = run_one(model, input_ids, policy, reference_logits, budget=budget)
                    elif ablation == "force_last_token":
                        assert uniform
                        kept = run_one(
                            model, input_ids, with_forced_last_token(method, params), reference_logits, budget=budget
                        )
                    else:
                        raise ValueError(f"unknown ablation {ablation!r}")
                    entry.setdefault("ablations", {})[ablation] = kept
                native_counts = ", ".join(
                    f"{sum(layer['n_kept']) / len(layer['n_kept']):g}" for layer in entry["native"]
                )
                print(f"kvhive  {key:24s} kept per layer [{native_counts}]  ({entry['config']})")
            except Exception as error:  # noqa: BLE001 - a method still being written is reported, not fatal
                entry["error"] = f"{type(error).__name__}: {error}"
                entry["traceback"] = traceback.format_exc()
                print(f"kvhive  {key:24s} UNAVAILABLE: {entry['error']}")
            runs[key] = entry

    meta = {
        "kvhive_transformers": transformers.__version__,
        "torch": torch.__version__,
        "kvhive": getattr(kvhive, "__version__", "dev"),
        "prompt_tokens": int(input_ids.shape[1]),
    }
    out.write_text(json.dumps({"meta": meta, "runs": runs}))
    print(f"wrote {out}")
    failed = [key for key, entry in runs.items() if "error" in entry]
    if failed:
        sys.exit(f"kvhive side: {len(failed)} of {len(runs)} cases failed ({', '.join(failed)}); see the errors above")


if __name__ == "__main__":
    main()
