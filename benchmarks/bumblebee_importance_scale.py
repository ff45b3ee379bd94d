"""BumbleBee's importance term: phi on the raw accumulated attention vs on its normalised mass.

Two measurements on the embedded Gemma-3-270M (CPU, fp32), on WikiText-2 test text:

1. **Share of the feature term** in the prefill's first greedy gains: for each compressed layer
   and KV head, the mean over candidates of ``(1 - lam) c(e | {})`` divided by the whole gain
   ``g(e | {})`` (Eq. 4), for phi = log and phi = power, raw vs normalised weights.
2. **Effect on the model**: teacher-forced NLL of a continuation after a compressed prompt
   (prefill selection, then Algorithm 2 at every decode step), against the full cache.

    .venv/bin/python benchmarks/bumblebee_importance_scale.py --texts 4 --prompt 384 --continuation 64 --budget 64
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import torch

from kvhive.api import make_cache
from kvhive.compat import cache_kwarg
from kvhive.methods.base import PREFILL
from kvhive.methods.submodular import Concave, Mixture, relu_cosine_similarity
from kvhive.models import load_model

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "wikitext2" / "wiki.test.raw"


def texts(tokenizer, count: int, length: int) -> list[torch.Tensor]:
    """The first ``count`` articles with at least ``length`` tokens (article = text between
    top-level `` = Title = `` headings)."""
    articles, current = [], []
    for line in DATA.read_text().splitlines():
        if line.startswith(" = ") and not line.startswith(" = = ") and current:
            articles.append("".join(current))
            current = []
        current.append(line + "\n")
    out = []
    for article in articles:
        ids = tokenizer(article, return_tensors="pt")["input_ids"]
        if ids.shape[1] >= length:
            out.append(ids[:, :length])
        if len(out) == count:
            break
    return out


class _Capture:
    """Records the first greedy gains' feature share of every layer's prefill selection."""

    def __init__(self):
        self.shares: dict[tuple[str, str], list[float]] = {}

    def measure(self, scoring, budget, local, lam):
        keys = scoring.keys
        batch, heads, tokens, dim = keys.shape
        candidates = tokens - local
        weights = scoring.to_kv_heads(scoring.accumulated_attention()).float()[:, :, :candidates]
        weights = weights.reshape(-1, candidates)
        valid = torch.ones_like(weights, dtype=torch.bool)
        sim = relu_cosine_similarity(keys[:, :, :candidates].reshape(-1, candidates, dim), valid)
        for kind in ("log", "power"):
            for scale in ("raw", "normalised"):
                w = weights if scale == "raw" else weights / weights.sum(-1, keepdim=True)
                objective = Mixture(sim, w, valid, lam, Concave(kind))
                facility = sim.sum(-1).double() * objective.facility_scale[:, None]
                feature = (
                    objective.phi.gain(torch.zeros_like(objective.weights), objective.weights)
                    * objective.feature_scale[:, None]
                )
                share = (feature / (feature + facility)).mean().item()
                self.shares.setdefault((kind, scale), []).append(share)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--texts", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=384)
    parser.add_argument("--continuation", type=int, default=64)
    parser.add_argument("--budget", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_model()
    items = texts(tokenizer, args.texts, args.prompt + args.continuation)
    capture = _Capture()
    settings = [
        ("full", {}),
        ("bumblebee", {"importance_scale": "raw"}),
        ("bumblebee", {"importance_scale": "normalised"}),
        ("bumblebee-power", {"importance_scale": "raw"}),
        ("bumblebee-power", {"importance_scale": "normalised"}),
    ]
    nll = {i: [] for i in range(len(settings))}
    agree = {i: [] for i in range(len(settings))}
    started = time.time()
    for item in items:
        prompt, continuation = item[:, : args.prompt], item[:, args.prompt :]
        full_top = None
        for index, (method, parameters) in enumerate(settings):
            cache = make_cache(model, method, budget=args.budget if method != "full" else None, **parameters)
            if index == 1:  # measure the shares once per text, on the first BumbleBee cache's prefill
                policy = cache.policy
                original = policy.select_prefill

                def select(scoring, budget, state, _original=original, _policy=policy):
                    if scoring.phase == PREFILL:
                        summary, local = _policy.split(budget)
                        capture.measure(scoring, budget, local, _policy.config.mixture_weight)
                    return _original(scoring, budget, state)

                policy.select_prefill = select
            with torch.no_grad():
                output = model(input_ids=prompt, **{cache_kwarg(model): cache}, use_cache=True, logits_to_keep=1)
                logits = [output.logits[:, -1]]
                for position in range(continuation.shape[1] - 1):
                    output = model(
                        input_ids=continuation[:, position : position + 1],
                        **{cache_kwarg(model): cache},
                        use_cache=True,
                    )
                    logits.append(output.logits[:, -1])
            logits = torch.cat(logits).float()
            log_probs = torch.log_softmax(logits, dim=-1)
            nll[index].append(-log_probs.gather(1, continuation[0, :, None]).mean().item())
            top = logits.argmax(-1)
            if full_top is None:
                full_top = top
            agree[index].append((top == full_top).float().mean().item())
    print(
        f"{len(items)} texts, prompt {args.prompt}, continuation {args.continuation}, budget {args.budget}, "
        f"{time.time() - started:.0f} s"
    )
    print("feature-term share of the first greedy gains (mean over layers, heads, candidates):")
    for (kind, scale), values in sorted(capture.shares.items()):
        print(
            f"  phi={kind:5s} {scale:10s} {statistics.mean(values):.3f} (min {min(values):.3f}, max {max(values):.3f})"
        )
    print("continuation NLL (mean over texts) and top-1 agreement with full:")
    for index, (method, parameters) in enumerate(settings):
        label = method + (f" {parameters['importance_scale']}" if parameters else "")
        print(
            f"  {label:28s} nll {statistics.mean(nll[index]):.4f}  ppl {math.exp(statistics.mean(nll[index])):.2f}"
            f"  agree {statistics.mean(agree[index]):.3f}"
        )


if __name__ == "__main__":
    main()
