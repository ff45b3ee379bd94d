"""AhaKV's step-gain softmax on real activations: which reading of the gain does what the paper says?

AhaKV (Gu et al. 2025, Sec. 4.2) scales the softmax of the eviction scores by
``lambda = sqrt(2 ln(n/k) / d)`` (Eq. 12) so that "the expected information entropy [of an
attention row] equals the maximum information entropy" of ``k`` tokens, ``log k`` (Eq. 11),
"regardless of the number of total tokens"; the derivation (Eq. 8-12, appendix A) applies
``lambda`` to raw ``q.k`` (Gaussian with variance ``d``), while Algorithm 1 line 6 applies it to
``A = QK^T / sqrt(d)``. kvhive offers both (``AhaKVConfig.gain_input``: ``raw_qk`` /
``scaled_qk``). This script measures, on the queries and keys of a real model's compressed
(full-attention) layers over real texts:

* the entropy (nats) of the SG-softmax rows AhaKV sums (the last ``recent`` query rows before
  position ``n``, every query head) for each reading, against the paper's target ``log k`` and
  against the model's own softmax (``q.k * scaling``, no gain), at several prefix lengths ``n``
  (the property should hold "regardless of" ``n``);
* the logit multiplier that would hit ``log k`` exactly (bisection per row; median over rows),
  as a factor of each reading's multiplier (1 = the reading achieves the property);
* the overlap (Jaccard) of the tokens AhaKV keeps under the two readings (and each against the
  plain softmax), counting only the ``B_s`` selected tokens (the ``B_r`` recent ones are kept by
  both) and all kept tokens.

    python benchmarks/ahakv_gain_entropy.py [--model gemma-3-270m] [--tokens 2048]
        [--lengths 512 1024 2048] [--budgets 64 128 256] [--texts 3]

Writes ``results/ahakv_gain/<model>.jsonl`` (one line per text x layer x n x k x reading) and
``results/ahakv_gain/<model>.md`` (means over texts, layers, query heads and rows).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import math
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

import kvhive
from kvhive.compat import cache_kwarg
from kvhive.methods.ahakv import GAIN_INPUTS, AhaKV, sg_logit_multiplier, value_prior
from kvhive.methods.base import ScoringInputs, keep_top_scores, recent_mask

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" if (ROOT.parent / "shared" / "data").is_dir() else Path("/work/shared/data")
PLAIN = "plain"  # the model's own softmax, no gain (reference)
PRIOR = "value_prior"  # the value prior alone (what the scores reduce to when the rows are uniform)


def texts(count: int) -> list[tuple[str, str]]:
    """``count`` real texts of different kinds: essays, encyclopaedia, news (each long enough)."""
    essays = sorted((DATA / "paul_graham_essays" / "essays").glob("*.txt"))
    candidates = [("paul_graham_essays", "\n\n".join(p.read_text(encoding="utf-8") for p in essays[:6]))]
    candidates.append(("wikitext2", (DATA / "wikitext2" / "wiki.test.raw").read_text(encoding="utf-8")[:40000]))
    with gzip.open(DATA / "longbench" / "multi_news.jsonl.gz", "rt", encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            if len(record["context"]) > 16000:
                candidates.append(("longbench_multi_news", record["context"].replace("NEWLINE_CHAR", "\n")))
                break
    candidates.append(("paul_graham_essays_b", "\n\n".join(p.read_text(encoding="utf-8") for p in essays[6:12])))
    if count > len(candidates):
        raise ValueError(f"invalid texts={count}: expected at most {len(candidates)}")
    return candidates[:count]


class _Recorder(AhaKV):
    """AhaKV that keeps a copy of each compressed layer's prefill inputs (the forward pass itself
    is the model's own: a layer's cache is cut only after its attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.recorded: dict[int, ScoringInputs] = {}

    def select_prefill(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor:
        self.recorded[scoring.layer_index] = ScoringInputs(
            keys=scoring.keys.clone(),
            values=scoring.values.clone(),
            queries=scoring.queries.clone(),
            positions=scoring.positions.clone(),
            mask=None if scoring.mask is None else scoring.mask.clone(),
            scaling=scoring.scaling,
            layer_index=scoring.layer_index,
            num_layers=scoring.num_layers,
            sequence_length=scoring.sequence_length,
            phase=scoring.phase,
        )
        return super().select_prefill(scoring, budget, state)


@torch.no_grad()
def record_layers(model, input_ids: torch.Tensor) -> dict[int, ScoringInputs]:
    recorder = _Recorder()
    cache = kvhive.make_cache(model, recorder, budget=recorder.config.recent)
    model(input_ids=input_ids, **{cache_kwarg(model): cache}, use_cache=True, logits_to_keep=1)
    if not recorder.recorded:
        raise RuntimeError("no compressed layer was recorded")
    return recorder.recorded


def prefix(scoring: ScoringInputs, n: int) -> ScoringInputs:
    """The layer as it was when the first ``n`` tokens had been read (a causal prefix)."""
    mask = None if scoring.mask is None else scoring.mask[:, :, :n, :n]
    return dataclasses.replace(
        scoring,
        keys=scoring.keys[:, :, :n],
        values=scoring.values[:, :, :n],
        queries=scoring.queries[:, :, :n],
        positions=scoring.positions[..., :n],
        mask=mask,
        sequence_length=n,
        token_scores={},
        _memo={},
    )


def entropy(weights: torch.Tensor) -> torch.Tensor:
    return -(weights * weights.clamp_min(1e-45).log()).sum(-1)


def raw_logits(scoring: ScoringInputs, rows: int) -> torch.Tensor:
    """Raw ``q.k`` ``[Hq, rows, n]`` of the last ``rows`` queries, future keys at -inf."""
    keys = scoring.keys[0].float().repeat_interleave(scoring.group_size, dim=0)
    logits = scoring.queries[0, :, -rows:].float() @ keys.transpose(-1, -2)
    allowed = scoring.mask_rows(slice(scoring.num_queries - rows, scoring.num_queries))[0]  # [1|H, rows, n]
    if allowed.shape[0] > 1:  # one mask per stored head: repeat it for each query head of the group
        allowed = allowed.repeat_interleave(scoring.group_size, dim=0)
    return logits.masked_fill(~allowed, float("-inf"))


def row_std(logits: torch.Tensor) -> torch.Tensor:
    """Standard deviation of each row's finite logits (the paper's Gaussian assumes ``sqrt(d)``
    for raw ``q.k``, i.e. 1 for the model's scaled logits)."""
    finite = torch.isfinite(logits)
    values = torch.where(finite, logits, torch.zeros_like(logits))
    count = finite.sum(-1)
    mean = values.sum(-1) / count
    deviation = torch.where(finite, logits - mean[..., None], torch.zeros_like(logits))
    return (deviation.pow(2).sum(-1) / (count - 1)).sqrt()


def multiplier_for_entropy(logits: torch.Tensor, target: float, iterations: int = 60) -> torch.Tensor:
    """Per row, the factor ``t`` on ``logits`` with ``H(softmax(t * logits)) = target`` (bisection
    on log t; the entropy falls monotonically as t grows)."""
    low = torch.full(logits.shape[:-1], -12.0)
    high = torch.full(logits.shape[:-1], 6.0)
    for _ in range(iterations):
        middle = (low + high) / 2
        too_flat = entropy(torch.softmax(logits * middle.exp()[..., None], dim=-1)) > target
        low = torch.where(too_flat, middle, low)
        high = torch.where(too_flat, high, middle)
    return ((low + high) / 2).exp()


def kept(scoring: ScoringInputs, budget: int, recent: int, reading: str) -> torch.Tensor:
    """AhaKV's prefill keep mask ``[H, n]`` under ``reading`` (or the plain softmax)."""
    if reading in (PLAIN, PRIOR):
        scores = value_prior(scoring.values, scoring.valid, 7)
        if reading == PLAIN:
            scores = scores * scoring.to_kv_heads(scoring.recent_accumulated_attention(recent, logit_multiplier=1.0))
        forced = recent_mask(scoring.num_tokens, recent, scores)
        return keep_top_scores(scores, budget, scoring.valid, forced=forced)[0]
    return AhaKV(recent=recent, gain_input=reading).select_prefill(scoring, budget, {})[0]


def jaccard(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over heads of |a & b| / |a | b|."""
    return ((a & b).sum(-1).float() / (a | b).sum(-1).float()).mean().item()


def measure(
    model_name: str, tokens: int, lengths: list[int], budgets: list[int], count: int, recent: int
) -> list[dict]:
    model, tokenizer = kvhive.load_model(model_name)
    rows = []
    for text_name, text in texts(count):
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        if ids.shape[1] < tokens:
            raise ValueError(f"text {text_name} has only {ids.shape[1]} tokens (< --tokens {tokens})")
        ids = ids[:, :tokens]
        start = time.perf_counter()
        layers = record_layers(model, ids)
        print(
            f"{text_name}: {tokens} tokens, {len(layers)} compressed layers recorded in {time.perf_counter() - start:.1f}s"
        )
        for layer_index, whole in sorted(layers.items()):
            for n in lengths:
                scoring = prefix(whole, n)
                logits = raw_logits(scoring, recent)  # [Hq, r, n]
                plain = torch.softmax(logits * scoring.scaling, dim=-1)
                head_dim = scoring.keys.shape[-1]
                for k in budgets:
                    if k >= n:
                        continue
                    target = math.log(k)
                    needed = multiplier_for_entropy(logits, target)  # factor on raw q.k
                    keep = {reading: kept(scoring, k, recent, reading) for reading in (*GAIN_INPUTS, PLAIN, PRIOR)}
                    selected = {reading: mask & ~recent_mask(n, recent, mask) for reading, mask in keep.items()}
                    base = {
                        "model": model_name,
                        "text": text_name,
                        "layer": layer_index,
                        "n": n,
                        "k": k,
                        "recent": recent,
                        "target_entropy": target,
                        "plain_entropy": entropy(plain).mean().item(),
                        "plain_logit_std": row_std(logits * scoring.scaling).mean().item(),
                    }
                    for reading in GAIN_INPUTS:
                        factor = sg_logit_multiplier(n, k, head_dim, scoring.scaling, reading) * scoring.scaling
                        weights = torch.softmax(logits * factor, dim=-1)
                        row_entropy = entropy(weights)
                        other = next(r for r in GAIN_INPUTS if r != reading)
                        rows.append(
                            dict(
                                base,
                                reading=reading,
                                multiplier_on_raw_qk=factor,
                                entropy_mean=row_entropy.mean().item(),
                                entropy_median=row_entropy.median().item(),
                                entropy_abs_error=(row_entropy - target).abs().mean().item(),
                                needed_over_reading_median=(needed / factor).median().item(),
                                top1_mass_mean=weights.amax(-1).mean().item(),
                                jaccard_selected_vs_other=jaccard(selected[reading], selected[other]),
                                jaccard_kept_vs_other=jaccard(keep[reading], keep[other]),
                                jaccard_selected_vs_plain=jaccard(selected[reading], selected[PLAIN]),
                                jaccard_selected_vs_value_prior=jaccard(selected[reading], selected[PRIOR]),
                            )
                        )
    return rows


def summarise(rows: list[dict], model_name: str, args: argparse.Namespace, seconds: float) -> str:
    lines = [
        f"# AhaKV SG-softmax gain: the two readings on {model_name}",
        "",
        (
            f"`python benchmarks/ahakv_gain_entropy.py --model {model_name} --tokens {args.tokens} "
            f"--lengths {' '.join(map(str, args.lengths))} --budgets {' '.join(map(str, args.budgets))} --texts {args.texts}` "
            f"({seconds:.0f} s wall on the shared CPU). Texts: {', '.join(sorted({r['text'] for r in rows}))}; "
            f"compressed layers: {', '.join(map(str, sorted({r['layer'] for r in rows})))}; the last {args.recent} query "
            "rows before n, every query head. Means over texts x layers (x heads x rows inside each)."
        ),
        "",
        (
            "Entropy in nats. Target = log k (Eq. 11). `needed/used` = median over rows of the logit factor that gives "
            "exactly log k divided by the reading's factor (1 = the reading meets the target; < 1 = it is too sharp, "
            "> 1 too flat). Jaccard of the B_s selected tokens (recent window excluded) between the readings, and of "
            "each reading with the plain (no-gain) softmax and with the value prior alone (no attention)."
        ),
        "",
        (
            "| n | k | log k | plain H | raw_qk H | scaled_qk H | raw needed/used | scaled needed/used "
            "| raw top-1 mass | J(raw, scaled) sel. | J(raw, scaled) all kept | J(raw, plain) | J(scaled, plain) "
            "| J(raw, prior) | J(scaled, prior) |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted({(r["n"], r["k"]) for r in rows})
    for n, k in keys:
        group = {
            reading: [r for r in rows if r["n"] == n and r["k"] == k and r["reading"] == reading]
            for reading in GAIN_INPUTS
        }
        raw, scaled = group["raw_qk"], group["scaled_qk"]

        def mean(items, field):
            return statistics.fmean(item[field] for item in items)

        lines.append(
            f"| {n} | {k} | {math.log(k):.2f} | {mean(raw, 'plain_entropy'):.2f} | {mean(raw, 'entropy_mean'):.2f} "
            f"| {mean(scaled, 'entropy_mean'):.2f} | {mean(raw, 'needed_over_reading_median'):.3f} "
            f"| {mean(scaled, 'needed_over_reading_median'):.2f} | {mean(raw, 'top1_mass_mean'):.2f} "
            f"| {mean(raw, 'jaccard_selected_vs_other'):.2f} | {mean(raw, 'jaccard_kept_vs_other'):.2f} "
            f"| {mean(raw, 'jaccard_selected_vs_plain'):.2f} | {mean(scaled, 'jaccard_selected_vs_plain'):.2f} "
            f"| {mean(raw, 'jaccard_selected_vs_value_prior'):.2f} | {mean(scaled, 'jaccard_selected_vs_value_prior'):.2f} |"
        )
    lines += [
        "",
        "Per layer (all n, k):",
        "",
        "| layer | plain H | raw_qk H | scaled_qk H | mean log k | plain logit std |",
        "|---|---|---|---|---|---|",
    ]
    for layer in sorted({r["layer"] for r in rows}):
        raw = [r for r in rows if r["layer"] == layer and r["reading"] == "raw_qk"]
        scaled = [r for r in rows if r["layer"] == layer and r["reading"] == "scaled_qk"]
        lines.append(
            f"| {layer} | {statistics.fmean(r['plain_entropy'] for r in raw):.2f} "
            f"| {statistics.fmean(r['entropy_mean'] for r in raw):.2f} | {statistics.fmean(r['entropy_mean'] for r in scaled):.2f} "
            f"| {statistics.fmean(r['target_entropy'] for r in raw):.2f} | {statistics.fmean(r['plain_logit_std'] for r in raw):.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--texts", type=int, default=3)
    parser.add_argument("--recent", type=int, default=32)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "ahakv_gain")
    args = parser.parse_args()
    if max(args.lengths) > args.tokens:
        parser.error(f"invalid --lengths: each must be <= --tokens {args.tokens}")
    if min(args.budgets) <= args.recent:
        parser.error(f"invalid --budgets: each must be > --recent {args.recent} (AhaKV keeps B_r inside the budget)")
    torch.set_grad_enabled(False)
    start = time.perf_counter()
    rows = measure(args.model, args.tokens, args.lengths, args.budgets, args.texts, args.recent)
    seconds = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    stem = Path(args.model).name  # a registry name, or a local model directory's name
    with open(args.out / f"{stem}.jsonl", "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows)
    summary = summarise(rows, args.model, args, seconds)
    (args.out / f"{stem}.md").write_text(summary, encoding="utf-8")
    print(summary)


if __name__ == "__main__":
    main()
