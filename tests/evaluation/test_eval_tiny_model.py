"""The harness end to end on a real (tiny, random) model through the ``kvhive`` command: every
method given a budget that covers the whole sequence reproduces the full cache's scores, and the
report is written. This is CI's tiny version of the README's main job."""

from __future__ import annotations

import math

from kvhive.cli import main as kvhive_main
from kvhive.evaluation import read_results
from kvhive.evaluation.cli import default_data_dir
from kvhive.methods.registry import make_policy, method_names

DATA_DIR = default_data_dir()  # $KVHIVE_DATA_DIR, else <repo>/../shared/data

# BUZZ with log n rescales attention logits by design, so even an uncompressed cache changes the
# model's outputs (tests/methods/test_all_methods.py checks that rescale on its own).
CHANGES_ATTENTION = {"buzz-logn"}
# Longer than any prompt plus its generated tokens: nothing is ever evicted, in either phase.
COVERING_BUDGET = 4000


def test_every_method_at_a_covering_budget_reproduces_full_scores(tmp_path):
    assert DATA_DIR.exists(), f"shared data not found at {DATA_DIR}"
    methods = [m for m in method_names() if m != "full" and m not in CHANGES_ATTENTION]
    out = tmp_path / "run"
    code = kvhive_main(
        [
            "eval",
            "--model",
            "tiny-qwen2-gqa",
            "--tasks",
            "synthetic_recall:num_pairs=6,needle:lengths=300:depths=50:max_new_tokens=6,"
            "ppl:num_tokens=64:window=32,piqa",
            "--methods",
            ",".join(methods),
            "--budgets",
            str(COVERING_BUDGET),
            "--limit",
            "2",
            "--data-dir",
            str(DATA_DIR),
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0
    records = read_results(out)
    full = {(r["task"], r["item_id"]): r for r in records if r["method"] == "full"}
    assert {task for task, _ in full} == {"synthetic_recall", "needle", "ppl", "piqa"}
    compressed = [r for r in records if r["method"] != "full"]
    assert len(compressed) == len(full) * len(methods)
    assert all(r.get("status") == "ok" for r in records)
    for record in compressed:
        reference = full[(record["task"], record["item_id"])]
        if record["kind"] == "generate":
            assert record["output"] == reference["output"], record["setting"]
            assert record["metrics"] == reference["metrics"], record["setting"]
        else:  # log-likelihoods: the same computation, summed in the same order
            # ... except subgen-attention, whose decode step always merges its estimator (a fixed
            # shape, no host check of whether anything was evicted), so its exact part is its own
            # float32 softmax rather than sdpa's: equal to ~1e-5 relative, not bit for bit.
            tolerance = 5e-5 if record["method"] == "subgen-attention" else 1e-5
            for mine, theirs in zip(record["output"], reference["output"], strict=True):
                assert math.isclose(mine, theirs, rel_tol=tolerance, abs_tol=1e-4), record["setting"]
            if record["kind"] == "choice":
                assert record["metrics"] == reference["metrics"], record["setting"]
    assert (out / "report.md").exists() and list(out.glob("quality_*.png"))


def test_eval_refuses_an_unknown_method_before_loading_anything(tmp_path, capsys):
    code = kvhive_main(
        [
            "eval",
            "--model",
            "tiny-llama-gqa",
            "--tasks",
            "synthetic_recall",
            "--methods",
            "snapkv,nosuch",
            "--budgets",
            "0.5",
            "--out",
            str(tmp_path / "x"),
            "--no-progress",
        ]
    )
    assert code == 2 and "invalid method 'nosuch' (unknown method='nosuch'" in capsys.readouterr().err
    assert not (tmp_path / "x" / "results.jsonl").exists()


def test_results_record_the_cache_size_each_setting_held(tmp_path):
    # BUZZ's budget is the mean size it holds (its beehive peaks above it between samplings); H2O
    # is pinned at its budget. Both must appear as measured, next to the score.
    out = tmp_path / "sizes"
    code = kvhive_main(
        [
            "eval",
            "--model",
            "tiny-llama-gqa",
            "--tasks",
            "ppl:num_tokens=96:window=96,synthetic_recall:num_pairs=4",
            "--methods",
            "buzz,h2o",
            "--budgets",
            "24",
            "--limit",
            "1",
            "--data-dir",
            str(DATA_DIR),
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0
    records = {(r["task"], r["method"]): r for r in read_results(out)}
    h2o = records[("ppl", "h2o")]["cache"]
    buzz = records[("ppl", "buzz")]["cache"]
    full = records[("ppl", "full")]["cache"]
    assert h2o["final_kept_per_head"] == 24 and 12 < h2o["mean_kept_per_head"] < 24  # grows to 24, then stays
    peak = make_policy("buzz").layout(24).peak
    assert buzz["final_kept_per_head"] <= peak and buzz["mean_kept_per_head"] <= 24
    # Both sizes recorded: BUZZ's mean form moves between its floor and a peak above the budget.
    assert buzz["mean_kept_per_head"] < buzz["peak_kept_per_head"] <= peak and buzz["peak_kept_per_head"] > 24
    assert h2o["peak_kept_per_head"] == 24
    assert full["final_kept_per_head"] == 96  # BOS + 96 text tokens, all fed but the last (only predicted)
    recall = records[("synthetic_recall", "h2o")]["cache"]
    assert recall["final_kept_per_head"] <= 24 and recall["mean_kept_per_head"] <= 24
    report = (out / "report.md").read_text()
    assert "mean kept / head" in report


def _eval(out, tasks: str, methods: str, budgets: str, model: str = "tiny-llama-gqa") -> int:
    return kvhive_main(
        [
            "eval",
            "--model",
            model,
            "--tasks",
            tasks,
            "--methods",
            methods,
            "--budgets",
            budgets,
            "--limit",
            "1",
            "--data-dir",
            str(DATA_DIR),
            "--out",
            str(out),
            "--no-progress",
        ]
    )


def test_prefill_only_method_on_streaming_perplexity_is_not_scored(tmp_path):
    # Fed one token at a time, SnapKV (prefill only) never compresses: its "40 tok" perplexity
    # would be the full cache's. Decided from the policy's phases, not from method names.
    out = tmp_path / "stream"
    assert _eval(out, "ppl:num_tokens=128:window=128", "snapkv,knorm,h2o", "40") == 0
    records = {r["method"]: r for r in read_results(out)}
    for method in ("snapkv", "knorm"):
        assert records[method]["status"] == "not_applicable"
        assert records[method]["metrics"] == {} and "prefill" in records[method]["reason"]
    assert records["h2o"]["status"] == "ok" and records["full"]["status"] == "ok"
    assert records["h2o"]["cache"]["final_kept_per_head"] == 40


def test_ratio_below_the_minimum_on_perplexity_is_infeasible_not_an_abort(tmp_path):
    # 0.02 x 129 tokens = 3 < StreamingLLM's minimum of 5 (4 sinks + 1): recorded, the grid goes on.
    out = tmp_path / "ratio"
    assert _eval(out, "ppl:num_tokens=128:window=128,synthetic_recall:num_pairs=4", "streamingllm", "0.02") == 0
    records = {(r["task"], r["method"]): r for r in read_results(out)}
    assert records[("ppl", "streamingllm")]["status"] == "infeasible"
    assert "minimum" in records[("ppl", "streamingllm")]["reason"]
    assert records[("synthetic_recall", "full")]["status"] == "ok"  # the later task still ran
    assert ("synthetic_recall", "streamingllm") in records


def test_non_finite_model_outputs_are_recorded_as_failed(tmp_path):
    import json

    import torch

    from kvhive.evaluation import run_eval
    from kvhive.evaluation.kvhive_backend import KVHiveBackend
    from kvhive.models import load_model

    model, tokenizer = load_model("tiny-llama-gqa")
    with torch.no_grad():
        model.lm_head.weight.fill_(float("nan"))
    backend = KVHiveBackend(model, tokenizer, model_name="tiny-llama-gqa-nan")
    out = tmp_path / "nan"
    run_eval(
        backend,
        ["piqa", "synthetic_recall:num_pairs=4", "ppl:num_tokens=32:window=32"],
        ["h2o"],
        [16],
        1,
        DATA_DIR,
        out,
        progress=False,
    )
    lines = (out / "results.jsonl").read_text().splitlines()

    def refuse(constant):
        raise AssertionError(f"bare {constant} in results.jsonl")

    records = [json.loads(line, parse_constant=refuse) for line in lines]
    assert len(records) == 6
    for record in records:
        assert record["status"] == "failed", record
        assert record["metrics"] == {} and "non-finite" in record["reason"]


def test_a_chunked_prefill_setting_runs_is_labelled_and_resumes(tmp_path, capsys):
    # ``METHOD:prefill_chunk=N`` feeds the prompt in chunks of N tokens (its own prefill, not the
    # shared one-shot one); the chunk size is in the setting's name and in every record, so the
    # chunked and one-shot results are separate rows. A chunk covering the prompt is the one-shot.
    from kvhive.evaluation.backend import split_cache_options

    assert split_cache_options("snapkv:window=4:prefill_chunk=64") == ("snapkv:window=4", {"prefill_chunk": 64})
    out = tmp_path / "chunked"
    methods = (
        "snapkv,snapkv:prefill_chunk=100000,snapkv:prefill_chunk=64,h2o,h2o:prefill_chunk=100000,h2o:prefill_chunk=64"
    )
    tasks = "needle:lengths=300:depths=50:max_new_tokens=6,synthetic_recall:num_pairs=6"
    assert _eval(out, tasks, methods, "0.3") == 0
    records = read_results(out)
    by_key = {(r["task"], r["setting"]): r for r in records}
    assert all(r["status"] == "ok" for r in records)
    for task in ("needle", "synthetic_recall"):
        for method in ("snapkv", "h2o"):
            one_shot = by_key[(task, f"{method}@0.3")]
            whole = by_key[(task, f"{method}:prefill_chunk=100000@0.3")]
            chunked = by_key[(task, f"{method}:prefill_chunk=64@0.3")]
            assert "prefill_chunk" not in one_shot
            assert whole["prefill_chunk"] == 100000 and chunked["prefill_chunk"] == 64
            assert whole["method"] == f"{method}:prefill_chunk=100000"
            assert whole["output"] == one_shot["output"] and whole["metrics"] == one_shot["metrics"]
            assert whole["cache"] == one_shot["cache"]
            # Fed in chunks, the cache still ends at the budget of the whole prompt (plus what was generated).
            assert chunked["cache"]["final_kept_per_head"] <= one_shot["cache"]["final_kept_per_head"]
    report = (out / "report.md").read_text()
    assert "snapkv:prefill_chunk=64" in report
    capsys.readouterr()
    assert _eval(out, tasks, methods, "0.3") == 0  # a rerun resumes: nothing left to compute
    assert "0 new results" in capsys.readouterr().out
    assert len(read_results(out)) == len(records)
