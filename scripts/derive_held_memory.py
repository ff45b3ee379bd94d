"""Add the held KV memory to results recorded before the backend measured it (issue 26).

    python scripts/derive_held_memory.py results/claims_gemma results/claims_qwen results/claims

Each scored record with tokens-per-head sizes but no ``kv_entries_mean`` gets the fields
:func:`kvhive.evaluation.memory.derive_held_memory` derives (marked ``held_memory: "derived: ..."``);
records that already have them, or have no sizes, are left as they are. The file is rewritten
through a temporary file and ``os.replace``, so an interrupted run leaves the old file; a second
run changes nothing.

The embedded models' shapes are written out here (from their converted ``config.json``), so
that deriving needs neither model's weights.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from transformers import Gemma3TextConfig, Qwen2Config

from kvhive.evaluation.memory import derive_held_memory
from kvhive.evaluation.results import results_path

_GEMMA_LAYER_TYPES = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)]
MODEL_CONFIGS = {
    # gemma-3-270m: 18 layers (every sixth full attention, the others a 512-token window), 4 query
    # heads sharing 1 KV head of dim 256.
    "gemma-3-270m": Gemma3TextConfig(
        num_hidden_layers=18,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        hidden_size=640,
        layer_types=_GEMMA_LAYER_TYPES,
        sliding_window=512,
    ),
    # qwen2.5-0.5b (Qwen2.5-Coder-0.5B-Instruct): 24 full-attention layers, 14 query heads sharing
    # 2 KV heads of dim 896 / 14 = 64.
    "qwen2.5-0.5b": Qwen2Config(
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, hidden_size=896, use_sliding_window=False
    ),
}


def derive_file(out_dir: str) -> tuple[int, int]:
    """(records given held memory, records in the file)."""
    path = results_path(out_dir)
    lines = path.read_text(encoding="utf-8").splitlines()
    changed = 0
    out = []
    for line in lines:
        record = json.loads(line)
        cache_sizes = record.get("cache")
        if isinstance(cache_sizes, dict) and "kv_entries_mean" not in cache_sizes:
            derived = derive_held_memory(record, MODEL_CONFIGS[record["model"]])
            if derived is not None:
                record["cache"] = {**cache_sizes, **derived}
                changed += 1
                line = json.dumps(record, ensure_ascii=False, allow_nan=False)
        out.append(line)
    temporary = path.with_suffix(".jsonl.tmp")
    temporary.write_text("".join(line + "\n" for line in out), encoding="utf-8")
    os.replace(temporary, path)
    return changed, len(lines)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    for out_dir in argv:
        changed, total = derive_file(out_dir)
        print(f"{Path(out_dir)}: held memory derived for {changed} of {total} records")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
