"""Step 2 (kvpress venv): run kvpress presses on the saved model/prompt and record what they keep.

kvpress prunes the cache in a forward hook after each attention layer's prefill
(``BasePress.forward_hook`` -> ``compress``); ``ScorerPress.compress`` keeps
``scores.topk(n_kept)`` in top-k order (not position order). Nothing in kvpress is edited: the
press *instance* gets a wrapped ``compress`` (and ``score``) that records the layer's keys
before and after compression and the scores. The kept original positions per (layer, KV head)
are recovered by matching every kept key row to the full prefill's key rows (keys carry RoPE,
so every position's key is distinct; the match is exact and unique or the script fails).

``AdaKVPress`` keeps every key in the cache and masks the pruned ones in later attention
(``module.masked_key_indices``, read after its ``compress``): its kept positions per head are the
positions not masked, and its ``n_kept`` is the mean per head (the layer keeps exactly
``H * n_kept``), with the per-head counts in ``n_kept_per_head``.

Output JSON: {"meta": ..., "runs": {"<case>@<ratio>": {"layers": [{"kept": [[pos...] per KV head],
"scores": [[float...] per KV head], "n_kept": int}, ...], "press": {...}}}}
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvpress  # noqa: E402
import transformers  # noqa: E402
from cases import CASES, COMPRESSION_RATIOS, case_key  # noqa: E402
from transformers import AutoModelForCausalLM, DynamicCache  # noqa: E402


def recover_positions(full_keys: torch.Tensor, kept_keys: torch.Tensor) -> list[list[int]]:
    """Original positions of ``kept_keys[0, h]`` rows inside ``full_keys[0, h]``, per head, sorted."""
    assert full_keys.shape[0] == 1, "batch size 1 only"
    positions = []
    for head in range(full_keys.shape[1]):
        full, kept = full_keys[0, head], kept_keys[0, head]
        equal = (kept[:, None, :] == full[None, :, :]).all(dim=-1)  # [n_kept, N]
        matches = equal.sum(dim=-1)
        if not bool((matches == 1).all()):
            raise RuntimeError(
                f"head {head}: {int((matches != 1).sum())} kept keys do not match exactly one prefill key"
            )
        found = equal.float().argmax(dim=-1).tolist()
        if len(set(found)) != len(found):
            raise RuntimeError(f"head {head}: a prefill key was kept twice")
        positions.append(sorted(found))
    return positions


def masked_positions(module, num_heads: int, num_tokens: int) -> list[list[int]]:
    """Positions ``AdaKVPress`` kept per head: those not in ``module.masked_key_indices``."""
    batch, head, position = (index.tolist() for index in module.masked_key_indices)
    assert set(batch) <= {0}, "batch size 1 only"
    masked = [set() for _ in range(num_heads)]
    for h, p in zip(head, position, strict=True):
        masked[h].add(p)
    return [[p for p in range(num_tokens) if p not in masked[h]] for h in range(num_heads)]


def instrument(press) -> list[dict]:
    """Wrap the press instance's ``compress``/``score`` (the inner scorer's for a wrapper such as
    ``AdaKVPress``); returns the per-layer records list."""
    records: list[dict] = []
    original_compress = press.compress
    scorer = getattr(press, "press", press)
    original_score = scorer.score if hasattr(scorer, "score") else None
    pending: dict = {}

    if original_score is not None:

        def score(module, hidden_states, keys, values, attentions, kwargs):
            scores = original_score(module, hidden_states, keys, values, attentions, kwargs)
            pending["scores"] = scores.detach().float().clone()
            return scores

        scorer.score = score

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        full_keys = keys.detach().clone()
        pending.clear()
        if hasattr(module, "masked_key_indices"):
            del module.masked_key_indices  # (left by an earlier run on this module)
        new_keys, new_values = original_compress(module, hidden_states, keys, values, attentions, kwargs)
        record = {"layer": module.layer_idx, "num_tokens": keys.shape[2]}
        if getattr(module, "masked_key_indices", None) is not None:  # AdaKVPress: masked, not removed
            kept = masked_positions(module, keys.shape[1], keys.shape[2])
            counts = [len(head) for head in kept]
            if sum(counts) % len(counts):
                raise RuntimeError(f"layer {module.layer_idx}: {sum(counts)} kept over {len(counts)} heads")
            record.update(n_kept=sum(counts) // len(counts), n_kept_per_head=counts, masked=True)
        else:
            kept = recover_positions(full_keys, new_keys.detach())
            record["n_kept"] = len(kept[0])
        record["kept"] = kept
        if "scores" in pending:
            record["scores"] = pending["scores"][0].tolist()
        records.append(record)
        return new_keys, new_values

    press.compress = compress
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    here = Path(__file__).resolve().parent
    parser.add_argument("--artifacts", type=Path, default=here / "artifacts")
    parser.add_argument("--out", type=Path, default=None, help="default: <artifacts>/kvpress.json")
    args = parser.parse_args()
    out = args.out or args.artifacts / "kvpress.json"

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        args.artifacts / "model", dtype=torch.float32, attn_implementation="sdpa", local_files_only=True
    ).eval()
    input_ids = torch.tensor([json.loads((args.artifacts / "prompt.json").read_text())["input_ids"]])
    num_layers = model.config.num_hidden_layers

    # Reference: the uncompressed prefill's logits (compression happens after each layer's
    # attention, so the prefill output must be identical with any press).
    with torch.no_grad():
        reference_logits = model(input_ids, past_key_values=DynamicCache(config=model.config)).logits[0, -1]

    runs = {}
    for spec in CASES:
        for ratio in COMPRESSION_RATIOS:
            press_class = getattr(kvpress, spec["press"])
            if "inner_press" in spec:  # a wrapper (AdaKVPress): the ratio is its scorer's
                inner = getattr(kvpress, spec["inner_press"])(compression_ratio=ratio, **spec["inner_press_kwargs"])
                press = press_class(press=inner, **spec["press_kwargs"])
            else:
                press = press_class(compression_ratio=ratio, **spec["press_kwargs"])
            records = instrument(press)
            cache = DynamicCache(config=model.config)
            with torch.no_grad(), press(model):
                logits = model(input_ids, past_key_values=cache).logits[0, -1]
            if not torch.allclose(logits, reference_logits, atol=1e-5):
                raise RuntimeError(f"{spec['case']}: prefill logits changed under the press")
            if len(records) != num_layers:
                raise RuntimeError(f"{spec['case']}: {len(records)} layers compressed, expected {num_layers}")
            records.sort(key=lambda record: record["layer"])
            # The cache really holds what was recorded.
            for record in records:
                held = cache.layers[record["layer"]].keys.shape[2]
                if held != (record["num_tokens"] if record.get("masked") else record["n_kept"]):
                    raise RuntimeError(
                        f"{spec['case']} layer {record['layer']}: cache holds {held}, recorded {record['n_kept']}"
                    )
            fields = {f.name: _plain(getattr(press, f.name)) for f in dataclasses.fields(press)}
            runs[case_key(spec["case"], ratio)] = {
                "case": spec["case"],
                "compression_ratio": ratio,
                "press": spec["press"],
                "press_fields": fields,
                "layers": records,
            }
            print(f"kvpress {case_key(spec['case'], ratio):24s} kept per layer {[r['n_kept'] for r in records]}")

    meta = {
        "kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else _dist_version("kvpress"),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "prompt_tokens": int(input_ids.shape[1]),
        "num_layers": num_layers,
        "num_kv_heads": model.config.num_key_value_heads,
        "num_query_heads": model.config.num_attention_heads,
    }
    out.write_text(json.dumps({"meta": meta, "runs": runs}))
    print(f"wrote {out}")


def _plain(value):
    """A press field as JSON: a nested press (AdaKVPress's scorer) as its class name and fields."""
    if dataclasses.is_dataclass(value):
        fields = {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"press": type(value).__name__, **fields}
    return value


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    main()
