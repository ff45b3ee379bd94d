"""Step 1 (kvhive venv): save a tiny random GQA Llama and a fixed prompt for the cross-check.

The model is kvhive's tiny Llama made a little bigger (4 layers, 8 query heads sharing 2 KV
heads, head dim 32) and initialised with a larger weight scale than the default 0.02, so that
attention is peaked rather than almost uniform: with near-uniform attention most scores nearly
tie and the kept sets would be decided by float rounding instead of by the methods.

The prompt is 509 random byte ids by default: long enough for PyramidKV's pyramid not to fall back
to uniform SnapKV at either ratio, and odd so that the two libraries' ratio rounding shows.

Writes ``<out>/model`` (save_pretrained, safetensors, float32) and ``<out>/prompt.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvhive.models import tiny_model

MODEL_OVERRIDES = dict(
    num_hidden_layers=4,
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    initializer_range=0.08,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "artifacts")
    parser.add_argument(
        "--length",
        type=int,
        default=509,
        help="prompt tokens (odd, so that floor and round of ratio x N differ at one ratio)",
    )
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()

    model = tiny_model("llama", "gqa", seed=args.seed, **MODEL_OVERRIDES)
    model.config._attn_implementation = "sdpa"
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out / "model")

    generator = torch.Generator().manual_seed(args.seed)
    # Byte ids 0..255 (the tiny tokenizer's bytes); special ids are left out.
    prompt = torch.randint(0, 256, (args.length,), generator=generator).tolist()
    (args.out / "prompt.json").write_text(json.dumps({"seed": args.seed, "input_ids": prompt}))
    config = model.config
    print(
        f"saved {type(model).__name__} ({config.num_hidden_layers} layers, {config.num_attention_heads} query heads, "
        f"{config.num_key_value_heads} KV heads, head_dim {config.head_dim}) and a {len(prompt)}-token prompt "
        f"to {args.out}"
    )


if __name__ == "__main__":
    main()
