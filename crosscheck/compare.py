"""Step 4 (either venv; plain Python): compare what kvpress and kvhive keep, explain the
differences, and write ``crosscheck/RESULTS.md``.

Per case and kvpress compression ratio, over every (layer, KV head):

* ``identical``: heads whose kept position sets are equal / all heads;
* ``overlap``: mean |A ∩ B| / max(|A|, |B|) (the fraction of kept indices both sides share);
* ``Jaccard``: mean |A ∩ B| / |A ∪ B| (and its minimum over heads).

Three kvhive runs are compared with the same kvpress run: ``native`` (kvhive's own budget from
the ratio), ``matched`` (kvhive forced to kvpress's per-layer counts, so only the *selection*
differs) and the ablations of ``cases.py`` (matched counts plus one kvpress rule emulated).
Every differing token of the matched runs is classified (see ``classify``), so that each
remaining difference has a named cause.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cases import CASES, COMPRESSION_RATIOS, case_key  # noqa: E402

# Relative score gap (to the range of the scores) under which a swap is a floating-point near-tie.
NEAR_TIE = 1e-4

EXPLANATIONS = {
    "snapkv": (
        "Same rule on both sides: scores = attention of the last `window` prompt queries to the earlier keys "
        "(kvpress averages over the window, kvhive sums: same ranking), averaged over the query heads of a KV "
        "group, 1-D pooling over the non-window prefix only, top-(n - window) plus the window itself (kvpress "
        "pads the window's score with max + 1, kvhive forces it): the window **is counted in the budget** on both "
        "sides, and both average-pool with the zero padding counted (torch's default `count_include_pad=True`, "
        "as the SnapKV/PyramidKV reference code; kvhive once excluded it, which this cross-check found). The sets "
        "are identical at equal counts; a native row differs only where ratio rounding gives one more token."
    ),
    "snapkv/max-pool": (
        "Deliberate (METHODS.md, *Observation window*): kvhive's default pooling is **max** (the Ada-KV paper), "
        "kvpress only implements average pooling. Rows show how much that choice changes the kept set; it is not "
        "a defect."
    ),
    "snapkv/w32-k7": (
        "kvhive's default window/kernel (32/7) run on both sides with average pooling: same rule as `snapkv`, "
        "identical at equal counts."
    ),
    "streamingllm": (
        "Same rule: the first `sink=4` tokens plus the most recent `n - 4` (kvpress scores the "
        "`n_pruned` tokens after the sinks 0, kvhive ranks by recency with the sinks forced). The sets only differ "
        "when the kept counts differ (ratio rounding)."
    ),
    "tova": (
        "Same scores: the last prompt query's softmax attention averaged over **all** query heads of the layer "
        "(one set shared by every KV head, on both sides). One deliberate difference: kvpress always keeps the "
        "last prompt token (it pads its score with max + 1; its docstring calls this 'a very slight difference "
        "from TOVA'); kvhive follows the TOVA paper and lets the last token compete on its attention weight. "
        "Where the last token's own averaged attention falls below the cut (see *last-token* below), kvpress "
        "keeps it and kvhive keeps the next-best token instead; the `force_last_token` ablation removes every "
        "difference. Tie-breaking: both sides take `torch.topk` of the same float32 scores and kvhive adds no "
        "tie rule of its own for TOVA; there are no exact score ties at the cut here (*ties* column)."
    ),
    "knorm": (
        "Same rule: keep the keys with the smallest L2 norm per KV head (kvpress: score = -||k|| in float32; "
        "kvhive: top-k of -||k|| in float32; keys after RoPE on both sides, which does not change norms). "
        "Exact norm ties at the cut do occur (*ties* column: in layer 0, repeated token ids give keys that differ "
        "only by the RoPE rotation, hence equal norms) and are broken identically: both sides call `torch.topk` on "
        "bitwise-equal float32 scores in the same order."
    ),
    "pyramidkv": (
        "Selection inside a layer is SnapKV's on both sides (identical at kvpress's per-layer counts). The "
        "**layer budgets differ by design**. With "
        "b = N(1 - c) the average kept count: kvpress (`PyramidKVPress.get_layer_budget`) keeps, *window "
        "included*, a line from `max_num = 2b - b/beta` (first layer) to `min_num = b/beta` (last); when "
        "`max_num > N - window` it caps `max_num = N - window` and sets `min_num = 2b - max_num`, and it falls "
        "back to uniform SnapKV when `min_num < window`. kvhive (`pyramid_budgets`, default "
        "`window_in_pyramid=False`, as the PyramidKV reference code) keeps `window + p_l` with the line `p_l` "
        "from `2(b - window) - (b - window)/beta` to `(b - window)/beta`, rounded to sum exactly to b·L; a layer "
        "target above N is capped at N and the excess goes to the other layers (as the reference code). Both keep "
        "b·L in total; kvhive's last layers keep more and its first fewer (see *Kept counts*)."
    ),
}


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def set_metrics(press_layers: list[dict], hive_layers: list[dict]) -> dict:
    identical = total = 0
    jaccards, overlaps = [], []
    for press_layer, hive_layer in zip(press_layers, hive_layers, strict=True):
        for a, b in zip(press_layer["kept"], hive_layer["kept"], strict=True):
            a, b = set(a), set(b)
            total += 1
            identical += a == b
            union = a | b
            jaccards.append(len(a & b) / len(union) if union else 1.0)
            overlaps.append(len(a & b) / max(len(a), len(b), 1))
    return {
        "identical": identical,
        "heads": total,
        "jaccard": sum(jaccards) / len(jaccards),
        "min_jaccard": min(jaccards),
        "overlap": sum(overlaps) / len(overlaps),
    }


def classify(case: dict, press_run: dict, hive_layers: list[dict], num_tokens: int) -> dict:
    """Count the differing tokens of a matched run by cause.

    ``edge-pooling``: a token kvhive keeps and kvpress drops lies within ``kernel // 2`` of either end
    of the pooled prefix (avg pooling with/without the zero padding counted); ``last-token``: kvpress
    keeps the last prompt token that kvhive does not; ``displaced``: the token the other side keeps
    instead of one of those (a matched run keeps equal counts, so every edge/last-token swap pushes
    one token across the cut); ``near-tie``: both tokens' kvpress scores are within NEAR_TIE of the
    cut; ``other``: anything else (would be a real difference).
    """
    params = case["method_kwargs"]
    window, kernel = params.get("window"), params.get("kernel")
    edges: set[int] = set()
    if window is not None and kernel is not None:
        prefix = num_tokens - window
        half = kernel // 2
        edges = set(range(0, half)) | set(range(prefix - half, prefix))
    counts = {"edge-pooling": 0, "last-token": 0, "displaced": 0, "near-tie": 0, "other": 0}
    ties = 0
    for press_layer, hive_layer in zip(press_run["layers"], hive_layers, strict=True):
        for head, (a, b) in enumerate(zip(press_layer["kept"], hive_layer["kept"], strict=True)):
            a, b = set(a), set(b)
            scores = press_layer.get("scores", [None])[head] if "scores" in press_layer else None
            if scores is not None:
                ties += exact_ties_at_cut(scores, len(a))
            press_only, hive_only = sorted(a - b), sorted(b - a)
            if not press_only and not hive_only:
                continue
            explained_press, explained_hive = [], []
            for token in hive_only:
                if token in edges:
                    counts["edge-pooling"] += 1
                    explained_hive.append(token)
            for token in press_only:
                if token == num_tokens - 1 and case["method"] == "tova":
                    counts["last-token"] += 1
                    explained_press.append(token)
            # Each explained token displaced one token on the other side (equal counts).
            displaced_press = len(explained_hive)
            displaced_hive = len(explained_press)
            rest_press = [t for t in press_only if t not in explained_press]
            rest_hive = [t for t in hive_only if t not in explained_hive]
            take = min(displaced_press, len(rest_press))
            counts["displaced"] += take
            rest_press = rest_press[take:]
            take = min(displaced_hive, len(rest_hive))
            counts["displaced"] += take
            rest_hive = rest_hive[take:]
            for token in rest_press + rest_hive:
                if scores is not None and near_tie(scores, len(a), token):
                    counts["near-tie"] += 1
                else:
                    counts["other"] += 1
    counts["exact-ties-at-cut"] = ties
    return counts


def _cut(scores: list[float], n_kept: int) -> tuple[float, float]:
    ordered = sorted(scores, reverse=True)
    finite = [s for s in ordered if s < ordered[0]] or ordered
    spread = (max(finite) - min(finite)) or 1.0
    return ordered[n_kept - 1], spread


def near_tie(scores: list[float], n_kept: int, token: int) -> bool:
    cut, spread = _cut(scores, n_kept)
    return abs(scores[token] - cut) / spread < NEAR_TIE


def exact_ties_at_cut(scores: list[float], n_kept: int) -> int:
    """Tokens beyond the first sharing the exact score at the kept/dropped boundary (0 = no tie)."""
    if n_kept >= len(scores):
        return 0
    ordered = sorted(scores, reverse=True)
    cut = ordered[n_kept - 1]
    if ordered[n_kept] != cut:
        return 0
    return sum(1 for s in scores if s == cut) - 1


def fmt_metrics(m: dict | None) -> str:
    if m is None:
        return "n/a"
    return f"{m['identical']}/{m['heads']} · {m['overlap']:.4f} · {m['jaccard']:.4f} (min {m['min_jaccard']:.3f})"


def counts_text(counts: list[int]) -> str:
    if len(set(counts)) == 1:
        return f"{counts[0]}×{len(counts)}"
    return "/".join(str(c) for c in counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    here = Path(__file__).resolve().parent
    parser.add_argument("--artifacts", type=Path, default=here / "artifacts")
    parser.add_argument("--results", type=Path, default=here / "RESULTS.md")
    args = parser.parse_args()
    press_data = load(args.artifacts / "kvpress.json")
    hive_data = load(args.artifacts / "kvhive.json")
    prompt = load(args.artifacts / "prompt.json")
    config = load(args.artifacts / "model" / "config.json")
    num_tokens = len(prompt["input_ids"])
    num_layers = config["num_hidden_layers"]

    rows, _diagnoses, pyramid_rows, unavailable = [], [], [], []
    for case in CASES:
        for ratio in COMPRESSION_RATIOS:
            key = case_key(case["case"], ratio)
            press_run = press_data["runs"].get(key)
            hive_run = hive_data["runs"].get(key)
            if press_run is None or hive_run is None:
                unavailable.append((key, "missing run"))
                continue
            if "error" in hive_run:
                unavailable.append((key, hive_run["error"]))
                continue
            press_counts = [layer["n_kept"] for layer in press_run["layers"]]
            hive_counts = [layer["n_kept"][0] for layer in hive_run["native"]]
            native = set_metrics(press_run["layers"], hive_run["native"])
            matched = set_metrics(press_run["layers"], hive_run["matched"]) if "matched" in hive_run else None
            ablations = {
                name: set_metrics(press_run["layers"], layers) for name, layers in hive_run.get("ablations", {}).items()
            }
            causes = classify(case, press_run, hive_run["matched"], num_tokens) if "matched" in hive_run else None
            rows.append(
                dict(
                    key=key,
                    case=case,
                    ratio=ratio,
                    press_counts=press_counts,
                    hive_counts=hive_counts,
                    native=native,
                    matched=matched,
                    ablations=ablations,
                    causes=causes,
                    variant=case.get("variant", False),
                )
            )
            if case["method"] == "pyramidkv":
                targets = [layer.get("budget") for layer in hive_run["native"]]
                pyramid_rows.append((ratio, press_counts, hive_counts, targets if None not in targets else None))

    lines = render(
        rows, pyramid_rows, unavailable, press_data["meta"], hive_data["meta"], num_tokens, num_layers, config
    )
    text = "\n".join(lines) + "\n"
    args.results.write_text(text)
    print(text)
    print(f"wrote {args.results}")


def render(rows, pyramid_rows, unavailable, press_meta, hive_meta, num_tokens, num_layers, config) -> list[str]:
    out = ["# kvhive vs kvpress: cross-check of the kept KV positions", ""]
    out += [
        "Generated by `crosscheck/compare.py` (run `bash crosscheck/run.sh`). Do not edit by hand.",
        "",
        f"- Model: random Llama saved by `crosscheck/make_model.py` — {num_layers} layers, "
        f"{config['num_attention_heads']} query heads sharing {config['num_key_value_heads']} KV heads (GQA group "
        f"{config['num_attention_heads'] // config['num_key_value_heads']}), head dim {config['head_dim']}, "
        f"initializer_range {config['initializer_range']} (peaked attention, few near-ties), float32, sdpa.",
        f"- Prompt: {num_tokens} random byte ids (fixed seed); prefill only, batch 1. {num_tokens} is odd on "
        "purpose, so that the two libraries' ratio rounding differs at one ratio.",
        f"- kvpress {press_meta['kvpress']} (transformers {press_meta['transformers']}, torch {press_meta['torch']}) "
        f"in `.venv-kvpress`; kvhive (transformers {hive_meta['kvhive_transformers']}, torch {hive_meta['torch']}) "
        "in `.venv`.",
        "- Ratios: kvpress `compression_ratio` c = fraction **removed**; kvhive `ratio` = fraction **kept** = 1 - c.",
        "- Cells: `identical heads · overlap · mean Jaccard (min)` over every (layer, KV head): identical = heads "
        "whose kept sets are equal; overlap = mean |A∩B| / max(|A|,|B|); Jaccard = mean |A∩B| / |A∪B|.",
        "- *native*: kvhive's own budget (`make_cache(model, method, ratio=1-c, ...)`); *matched*: kvhive forced to "
        "kvpress's kept count per layer (so only the selection is compared); *ablation*: matched plus the one "
        "kvpress rule named (emulated in the cross-check script; kvhive's files untouched).",
        "",
        "## Agreement",
        "",
        "| case | c | kept/layer kvpress | kept/layer kvhive | native | matched | ablation (matched + kvpress rule) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ablation = "; ".join(f"{name}: {fmt_metrics(m)}" for name, m in row["ablations"].items()) or "—"
        name = row["case"]["case"] + (" *(variant)*" if row["variant"] else "")
        out.append(
            f"| {name} | {row['ratio']:g} | {counts_text(row['press_counts'])} | "
            f"{counts_text(row['hive_counts'])} | {fmt_metrics(row['native'])} | {fmt_metrics(row['matched'])} "
            f"| {ablation} |"
        )
    out += [
        "",
        "## Differing tokens of the matched runs, by cause",
        "",
        "Cause of every token kept by one side only, at equal counts (see `compare.classify`): *edge-pooling* "
        "= a token within kernel//2 of either end of the pooled prefix that kvhive keeps; *last-token* = the "
        "last prompt token kvpress forces; *displaced* = the token the other side keeps instead of one of "
        f"those; *near-tie* = kvpress score within {NEAR_TIE:g} (relative) of the cut; *other* = unexplained. "
        "*ties* = exact score ties at the cut in kvpress's scores (where tie-breaking could matter). In the "
        "*variant* rows (max pooling) *other* is that METHODS.md choice itself.",
        "",
        "| case | c | edge-pooling | last-token | displaced | near-tie | other | ties |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        c = row["causes"]
        if c is None:
            continue
        out.append(
            f"| {row['case']['case']} | {row['ratio']:g} | {c['edge-pooling']} | {c['last-token']} | "
            f"{c['displaced']} | {c['near-tie']} | {c['other']} | {c['exact-ties-at-cut']} |"
        )

    out += ["", "## Kept counts (ratio rounding, layer budgets)", ""]
    out += [
        "- Uniform methods: kvpress keeps `int(N * (1 - c))` (floor; `kvpress.utils.compute_n_kept`), kvhive "
        "`round(ratio * N)` (`kvhive/cache/kv_cache.py` `Budget.resolve`, Python's round-half-to-even). "
        f"N = {num_tokens}: "
        + "; ".join(
            f"c={r:g}: kvpress {int(num_tokens * (1 - r))}, kvhive {max(1, round((1 - r) * num_tokens))}"
            for r in COMPRESSION_RATIOS
        )
        + ". A one-token difference in count, not in rule; the *matched* runs "
        "remove it.",
    ]
    for ratio, press_counts, hive_counts, hive_targets in pyramid_rows:
        requested = (1 - ratio) * num_tokens * num_layers
        out.append(
            f"- PyramidKV c={ratio:g}: kvpress {press_counts} (total {sum(press_counts)}), kvhive {hive_counts} "
            f"(total {sum(hive_counts)}; layer budgets before the cache's min(budget, N): {hive_targets}); requested ratio × N × layers = {requested:g}. kvhive keeps "
            f"{sum(hive_counts) / (num_tokens * num_layers):.1%} of the prompt, kvpress "
            f"{sum(press_counts) / (num_tokens * num_layers):.1%} (asked: {1 - ratio:.0%})."
        )

    out += ["", "## Why they differ, case by case", ""]
    seen = set()
    for row in rows:
        case = row["case"]["case"]
        if case in seen:
            continue
        seen.add(case)
        spec = row["case"]
        out.append(
            f"- **{case}** — kvpress `{spec['press']}({fmt_kwargs(spec['press_kwargs'])})` ↔ kvhive "
            f"`{spec['method']}({fmt_kwargs(spec['method_kwargs'])})`. {EXPLANATIONS.get(case, '')}"
        )

    out += ["", "## Discrepancies worth a look in kvhive", "", *discrepancies(pyramid_rows, num_tokens, num_layers)]
    if unavailable:
        out += ["", "## Not compared", ""]
        out += [f"- {key}: {why}" for key, why in unavailable]
    return out


def fmt_kwargs(kwargs: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def discrepancies(pyramid_rows, num_tokens, num_layers) -> list[str]:
    lost = [
        (ratio, hive_targets, hive_counts)
        for ratio, _, hive_counts, hive_targets in pyramid_rows
        if hive_targets and max(hive_targets) > num_tokens
    ]
    if lost:
        evidence = "; ".join(
            f"at c={ratio:g} kvhive's layer targets are {targets}, the first exceeds N={num_tokens}, so it keeps "
            f"{sum(counts)} of the {sum(targets)} budgeted tokens ({sum(counts) / (num_tokens * num_layers):.1%} of "
            f"the prompt instead of {1 - ratio:.0%})"
            for ratio, targets, counts in lost
        )
    else:
        evidence = "not triggered by this run's prompt length and ratios"
    deliberate = (
        "*Deliberate, not bugs* — TOVA keeps the last prompt token only on merit in kvhive (the paper), always "
        "in kvpress; ratio rounding (kvpress floor, kvhive round-half-even); max pooling by default (METHODS.md); "
        "the SnapKV window is counted inside the budget on both sides; for PyramidKV kvhive adds the window on top "
        "of the pyramid of `b - window` (the reference code's accounting) while kvpress puts it inside its line."
    )
    if lost:
        return [
            "1. **PyramidKV loses budget when a layer's target exceeds the prompt**: " + evidence + ". The PyramidKV "
            "reference code (`PyramidKVCluster.update_kv`) and kvpress cap that layer and give the excess to the others.",
            "2. " + deliberate,
        ]
    return [
        "Found by earlier runs of this cross-check and fixed in kvhive since (the rows above show the result): "
        "(a) average pooling now counts the zero padding like the reference code and kvpress "
        "(`F.avg_pool1d(..., count_include_pad=True)` in `kvhive/methods/snapkv.py`), which made the matched snapkv "
        "and pyramidkv sets identical; (b) a PyramidKV layer budget above the prompt length is capped and the excess "
        "redistributed to the other layers (`KVHiveCache._resolve_budgets`), so the total is kept at short prompts.",
        deliberate,
    ]


if __name__ == "__main__":
    main()
