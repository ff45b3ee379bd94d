"""Sanity check of an embedded model's converted fp32 cache against its GGUF source.

    .venv/bin/python scripts/check_embedded_model.py qwen2.5-0.5b

1. Assembles the GGUF file from the installed chunk packages into a temporary directory (size and
   sha256 checked) and loads it directly with transformers (``gguf_file=``).
2. Loads the converted cache with ``kvhive.load_model`` (converting it first if needed).
3. Compares the logits of both on a short input (max absolute difference, argmax agreement) and
   checks that the tokenizers encode it identically.
4. Asks a chat question through the chat template (when the tokenizer has one) and prints the
   greedy answer.

Exits non-zero when the logits differ by more than ``--tolerance`` or the tokenizers disagree.
Needs the model's extra (``pip install 'kvhive[qwen]'``) and ~3x the fp32 model size in memory.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvhive.models import EMBEDDED_MODELS, assemble_gguf, load_gguf, load_model

TEXT = "def fibonacci(n):\n    # return the n-th Fibonacci number\n    The capital of France is"
QUESTION = "What is the capital of France? Answer with one word."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", choices=sorted(EMBEDDED_MODELS))
    parser.add_argument("--tolerance", type=float, default=1e-3, help="max |logit difference| accepted")
    args = parser.parse_args(argv)
    entry = EMBEDDED_MODELS[args.model]
    report: dict[str, object] = {"model": entry.name}

    start = time.perf_counter()
    converted, converted_tokenizer = load_model(entry.name)
    report["load_converted_s"] = round(time.perf_counter() - start, 1)

    with tempfile.TemporaryDirectory(prefix="kvhive-gguf-check-") as directory:
        start = time.perf_counter()
        gguf_path = assemble_gguf(entry, Path(directory) / entry.gguf_file_name)
        report["assemble_s"] = round(time.perf_counter() - start, 1)
        report["gguf_bytes"] = gguf_path.stat().st_size
        start = time.perf_counter()
        direct, direct_tokenizer = load_gguf(gguf_path)
        report["load_gguf_s"] = round(time.perf_counter() - start, 1)

    ids = converted_tokenizer(TEXT, return_tensors="pt")["input_ids"]
    report["tokens"] = ids.shape[1]
    report["tokenizers_agree"] = ids[0].tolist() == direct_tokenizer(TEXT)["input_ids"]
    with torch.no_grad():
        converted_logits = converted(ids).logits
        direct_logits = direct.eval()(ids).logits
    difference = (converted_logits - direct_logits).abs()
    report["max_abs_logit_difference"] = float(difference.max())
    report["logit_scale"] = float(direct_logits.abs().max())
    report["argmax_agreement"] = float((converted_logits.argmax(-1) == direct_logits.argmax(-1)).float().mean())
    del direct

    if converted_tokenizer.chat_template:
        prompt = converted_tokenizer.apply_chat_template(
            [{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True
        )
    else:
        prompt = "Question: " + QUESTION + "\nAnswer:"
    inputs = converted_tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        generated = converted.generate(**inputs, max_new_tokens=8, do_sample=False)
    report["chat_template"] = bool(converted_tokenizer.chat_template)
    report["answer"] = converted_tokenizer.decode(
        generated[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True
    )

    print(json.dumps(report, indent=2))
    ok = report["tokenizers_agree"] and report["max_abs_logit_difference"] <= args.tolerance
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
