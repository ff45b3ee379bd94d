"""Tests of the evaluation harness (kvhive/evaluation) with FakeBackend: metrics, tasks on the real
shared data, data errors, budget validation, the resumable runner (SIGKILL in a subprocess),
report, claims and CLI."""

from __future__ import annotations

import gzip
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_backend import FakeBackend, FakeTokenizer

from kvhive.evaluation import (
    CLAIMS,
    ResultsSummary,
    Setting,
    claims_grid,
    evaluate_claims,
    get_task,
    parse_budgets,
    read_results,
    run_eval,
    validate_budgets,
    write_report,
)
from kvhive.evaluation.backend import budget_key
from kvhive.evaluation.claims import outperforms, retains_full
from kvhive.evaluation.cli import default_data_dir
from kvhive.evaluation.cli import main as cli_main
from kvhive.evaluation.metrics import (
    aggregate_item_metrics,
    best_subspan_em,
    choice_accuracy,
    cut_at_stop,
    first_line,
    last_integer,
    normalize_answer,
    rouge_scores,
)
from kvhive.evaluation.results import repair_results_file, result_key
from kvhive.evaluation.runner import resolve_tasks, truncate_middle
from kvhive.evaluation.tasks import TASKS, TaskDataError, parse_task_spec
from kvhive.evaluation.tasks.needle import NEEDLE

REPO = Path(__file__).resolve().parents[2]
DATA_DIR = Path(os.environ.get("KVHIVE_DATA_DIR", REPO.parent / "shared" / "data"))


def needs_data(test):
    """Marks tests that read ../shared/data (present beside the checkout, in CI too)."""
    return test


REGISTRY = {
    "full",
    "local",
    "random",
    "streamingllm",
    "h2o",
    "snapkv",
    "pyramidkv",
    "tova",
    "knorm",
    "buzz",
    "buzz-logn",
    "bumblebee",
    "bumblebee-power",
    "ada-snapkv",
    "ada-pyramidkv",
    "ada-ahakv",
    "subgen",
    "subgen-attention",
    "ahakv",
}


# --------------------------------------------------------------------------- metrics


def test_squad_normalisation_and_best_subspan_em():
    assert normalize_answer("The  Quick, brown FOX!") == "quick brown fox"
    assert normalize_answer("an apple a day") == "apple day"
    assert best_subspan_em("It was Wilhelm Conrad Röntgen, in 1901.", ["Wilhelm Conrad Röntgen"]) == 1.0
    assert best_subspan_em("the Eiffel-Tower", ["Eiffel Tower", "x"]) == 0.0  # '-' removed, not spaced
    assert best_subspan_em("EiffelTower in Paris", ["Eiffel-Tower"]) == 1.0
    assert best_subspan_em("I do not know", ["Paris"]) == 0.0
    assert first_line("\n  Paris\nBerlin") == "Paris"
    assert cut_at_stop("A summary.\n###\nArticle: next", ["###"]) == "A summary.\n"
    assert cut_at_stop("no stop here", ["###"]) == "no stop here"
    assert last_integer("line 12 says <41869>. ok 7") == 7
    assert last_integer("none") is None


def test_rouge_library_matches_hand_computed_rouge1():
    prediction, reference = "the cat sat on the mat", "the cat is on the mat"
    # clipped unigram overlap: the x2, cat, on, mat = 5 of 6 tokens on each side
    precision = recall = 5 / 6
    f1 = 2 * precision * recall / (precision + recall)
    scores = rouge_scores(prediction, reference)
    assert scores["rouge1"] == pytest.approx(f1)
    # bigrams: "the cat", "on the", "the mat" shared of 5 each
    assert scores["rouge2"] == pytest.approx(3 / 5)
    assert scores["rougeL"] == pytest.approx(5 / 6)  # LCS: the cat on the mat
    assert rouge_scores("", reference)["rouge1"] == 0.0


def test_perplexity_aggregation_is_corpus_level():
    items = [{"ppl": math.exp(2), "nll_sum": 10.0, "n_tokens": 5}, {"ppl": math.exp(6), "nll_sum": 30.0, "n_tokens": 5}]
    aggregated = aggregate_item_metrics("perplexity", items)
    assert aggregated["ppl"] == pytest.approx(math.exp(4.0))  # not the mean of e^2 and e^6
    assert aggregated["n_tokens"] == 10
    # unequal lengths weigh by tokens
    aggregated = aggregate_item_metrics(
        "perplexity", [{"nll_sum": 1.0, "n_tokens": 1}, {"nll_sum": 0.0, "n_tokens": 3}]
    )
    assert aggregated["ppl"] == pytest.approx(math.exp(0.25))


def test_choice_argmax_and_length_normalisation():
    assert choice_accuracy([-5.0, -3.0], [" a", " b"], 1) == {"acc": 1.0, "acc_norm": 1.0}
    # long continuation has the lower total but the higher per-character log-likelihood
    result = choice_accuracy([-10.0, -6.0], [" " + "x" * 99, " y" * 5], 0)
    assert result == {"acc": 0.0, "acc_norm": 1.0}
    with pytest.raises(ValueError):
        choice_accuracy([-1.0], [" a", " b"], 0)


def test_mean_aggregation_with_standard_error_and_rouge_mean():
    aggregated = aggregate_item_metrics(
        "generate", [{"rougeL": 0.2, "rouge1": 0.3, "rouge2": 0.1}, {"rougeL": 0.4, "rouge1": 0.5, "rouge2": 0.1}]
    )
    assert aggregated["rougeL"] == pytest.approx(0.3)
    assert aggregated["rougeL_se"] == pytest.approx(0.1)
    assert aggregated["rouge_mean"] == pytest.approx((0.4 * 0.1 * 0.3) ** (1 / 3))


# --------------------------------------------------------------------------- budgets


@pytest.mark.parametrize("bad", [0, -3, 0.0, 1.5, 128.0, float("nan"), float("inf"), True, "0.5", None])
def test_budget_validation_rejects(bad):
    with pytest.raises(ValueError, match="budgets"):
        validate_budgets([0.5, bad])


def test_budget_parsing():
    assert parse_budgets("0.1,0.5,128") == [0.1, 0.5, 128]
    assert parse_budgets("1") == [1] and isinstance(parse_budgets("1")[0], int)
    assert parse_budgets("1.0") == [1.0] and isinstance(parse_budgets("1.0")[0], float)
    assert parse_budgets("0.5,0.5,64") == [0.5, 64]
    for bad in ("nan", "0", "2.5", "abc", ""):
        with pytest.raises(ValueError, match="budgets"):
            parse_budgets(bad)
    assert budget_key(json.loads(json.dumps(1.0))) == budget_key(1.0) != budget_key(1)


def test_run_eval_validates_arguments(tmp_path):
    backend = FakeBackend()
    with pytest.raises(ValueError, match=r"budgets.*\(0, 1\]"):
        run_eval(backend, ["synthetic_recall"], ["local"], [0.5, 2.0], 2, None, tmp_path, progress=False)
    with pytest.raises(ValueError, match="budgets"):
        run_eval(backend, ["synthetic_recall"], ["local"], [float("nan")], 2, None, tmp_path, progress=False)
    with pytest.raises(ValueError, match="known tasks:.*needle.*mdqa"):
        run_eval(backend, ["no_such_task"], ["local"], [0.5], 2, None, tmp_path, progress=False)
    with pytest.raises(ValueError, match="unknown method 'bogus'"):
        run_eval(
            backend,
            ["synthetic_recall"],
            ["bogus"],
            [0.5],
            2,
            None,
            tmp_path,
            progress=False,
            method_validator=lambda m: m in REGISTRY,
        )

    def registry_lookup(name):
        if name not in REGISTRY:
            raise KeyError(f"no method {name!r}; known: {sorted(REGISTRY)}")
        return object

    with pytest.raises(ValueError, match="invalid method 'snap'.*known"):
        run_eval(
            backend,
            ["synthetic_recall"],
            ["snap"],
            [0.5],
            2,
            None,
            tmp_path,
            progress=False,
            method_validator=registry_lookup,
        )
    with pytest.raises(ValueError, match="unknown parameter"):
        run_eval(backend, ["needle:lenghts=64"], ["local"], [0.5], 2, None, tmp_path, progress=False)
    assert not (tmp_path / "results.jsonl").exists()


# --------------------------------------------------------------------------- tasks on the real data


def test_registry_and_chance_levels():
    assert set(TASKS) == {
        "needle",
        "needle_multikey",
        "mdqa",
        "kv_retrieval",
        "lines",
        "ppl",
        "xsum",
        "cnn_dailymail",
        "multi_news",
        "piqa",
        "openbookqa",
        "synthetic_recall",
    }
    assert get_task("piqa").chance == 0.5 and get_task("openbookqa").chance == 0.25
    for name, cls in TASKS.items():
        task = cls()
        assert task.kind in ("generate", "choice", "perplexity"), name
        assert task.main_metric and isinstance(task.chance, float), name
    assert parse_task_spec("needle:lengths=256+512:depths=50") == ("needle", {"lengths": [256, 512], "depths": 50})


@needs_data
@pytest.mark.parametrize("name", sorted(TASKS))
def test_every_task_loads_real_data_and_scores(name):
    tokenizer = FakeTokenizer()
    params = {"lengths": [300]} if name in ("needle", "needle_multikey") else {}
    params = {"num_tokens": 96, "window": 32} if name == "ppl" else params
    task = get_task(name, **params)
    items = task.load(DATA_DIR, 3, 0, tokenizer)
    again = task.load(DATA_DIR, 3, 0, tokenizer)
    assert len(items) == 3
    assert [i.id for i in items] == [i.id for i in again]  # deterministic from the seed
    assert len({i.id for i in items}) == 3
    for item in items:
        if task.kind == "generate":
            assert item.prompt and item.references and item.max_new_tokens > 0
            metrics = task.score(item, " " + item.references[0])
            assert list(metrics)[0] == task.main_metric
        elif task.kind == "choice":
            assert item.choices and 0 <= item.label < len(item.choices)
            metrics = task.score(item, [0.0 if i == item.label else -1.0 for i in range(len(item.choices))])
            assert metrics["acc"] == 1.0
        else:
            assert item.token_ids[0] == tokenizer.bos_token_id and len(item.token_ids) > 2
            metrics = task.score(item, (2.0 * (len(item.token_ids) - 1), len(item.token_ids) - 1))
            assert metrics["ppl"] == pytest.approx(math.exp(2.0))
    if task.kind == "generate" and name not in ("xsum", "cnn_dailymail", "multi_news"):
        assert task.score(items[0], "I have no idea")[task.main_metric] == 0.0
        assert task.score(items[0], " " + items[0].references[0])[task.main_metric] == 1.0


@needs_data
def test_mdqa_gold_position_and_prompt_format():
    items = get_task("mdqa").load(DATA_DIR, 6, 0, FakeTokenizer())
    assert [i.metadata["gold_position"] for i in items] == [0, 4, 9, 0, 4, 9]
    for item in items:
        assert item.prompt.startswith(
            "Write a high-quality answer for the given question using only the provided search results "
            "(some of which might be irrelevant).\n\nDocument [1](Title: "
        )
        assert item.prompt.endswith("\nAnswer:") and "\n\nQuestion: " in item.prompt
        documents = [line for line in item.prompt.split("\n") if line.startswith("Document [")]
        assert len(documents) == 10
        assert [d.split("]")[0] for d in documents] == [f"Document [{i}" for i in range(1, 11)]
        answers = [normalize_answer(a) for a in item.references]
        with_answer = [i for i, d in enumerate(documents) if any(a in normalize_answer(d) for a in answers)]
        assert with_answer == [item.metadata["gold_position"]]  # distractors never contain the answer

    # the same distractors at every position of one question
    def strip(item):
        return sorted(line.split(")", 1)[1] for line in item.prompt.split("\n") if line.startswith("Document ["))

    assert strip(items[0]) == strip(items[1]) == strip(items[2])
    other_seed = get_task("mdqa").load(DATA_DIR, 3, 1, FakeTokenizer())
    assert [i.id for i in other_seed] != [i.id for i in items[:3]]
    # Another document count (a longer context) is another item, so both can share one run.
    longer = get_task("mdqa", num_documents=30, gold_positions=[0, 14, 29]).load(DATA_DIR, 3, 0, FakeTokenizer())
    assert {i.id for i in longer}.isdisjoint(i.id for i in items)
    assert all(i.id.endswith(f"-docs30-gold{i.metadata['gold_position']}") for i in longer)
    assert [i.metadata["num_documents"] for i in longer] == [30, 30, 30]


@needs_data
def test_kv_retrieval_prompt_and_positions():
    items = get_task("kv_retrieval").load(DATA_DIR, 3, 0, FakeTokenizer())
    assert [i.metadata["gold_position"] for i in items] == [0, 37, 74]
    item = items[1]
    assert item.prompt.startswith(
        'Extract the value corresponding to the specified key in the JSON object below.\n\nJSON data:\n{"'
    )
    assert item.prompt.endswith('"\nCorresponding value:')
    records = item.prompt.split("JSON data:\n")[1].split("\n\nKey:")[0]
    assert json.loads(records)  # the upstream formatting is valid JSON
    key = item.prompt.split('Key: "')[1].split('"')[0]
    assert list(json.loads(records))[37] == key and json.loads(records)[key] == item.references[0]


@needs_data
@pytest.mark.parametrize("depth", [0, 25, 50, 75, 100])
def test_needle_depth_is_honoured(depth):
    task = get_task("needle", lengths=[600], depths=[depth])
    (item,) = task.load(DATA_DIR, 1, 0, FakeTokenizer())
    context = item.prompt.split("\n\nQuestion: ")[0]
    position = context.index(NEEDLE.strip())
    haystack_length = len(context) - len(NEEDLE)
    assert abs(position / haystack_length - depth / 100) < 0.05
    assert item.metadata["depth"] == depth and item.metadata["length"] == 600
    assert item.prompt.endswith("Answer: The best thing to do in San Francisco is")


@needs_data
def test_needle_lengths_in_tokens_and_seeded_repetitions():
    tokenizer = FakeTokenizer()
    items = get_task("needle", lengths=[200, 400], depths=[50]).load(DATA_DIR, 4, 0, tokenizer)
    assert [i.metadata["length"] for i in items] == [200, 400, 200, 400]
    for item in items:
        context = item.prompt.split("\n\nQuestion: ")[0].replace(NEEDLE, "")
        assert abs(len(tokenizer.encode(context, add_special_tokens=False)) - item.metadata["length"]) <= 2
    assert items[0].prompt != items[2].prompt  # another repetition starts at another essay
    multikey = get_task("needle_multikey", lengths=[300], depths=[50]).load(DATA_DIR, 1, 0, tokenizer)[0]
    assert multikey.prompt.count("The special magic number for") == 4 + 1  # 4 needles + the answer prefix
    assert f"The special magic number for {multikey.metadata['key']} is {multikey.references[0]}." in multikey.prompt


@needs_data
def test_needle_lengths_with_the_real_tokenizer():
    from kvhive.models import load_model

    _, tokenizer = load_model()
    (item,) = get_task("needle", lengths=[1000], depths=[50]).load(DATA_DIR, 1, 0, tokenizer)
    context = item.prompt.split("\n\nQuestion: ")[0].replace(NEEDLE, "")
    assert abs(len(tokenizer.encode(context, add_special_tokens=False)) - 1000) <= 3
    (window, *_) = get_task("ppl").load(DATA_DIR, 1, 0, tokenizer)
    assert window.token_ids[0] == tokenizer.bos_token_id and len(window.token_ids) == 513


@needs_data
def test_few_shot_choice_prompts():
    for name, n_choices in (("piqa", 2), ("openbookqa", 4)):
        items = get_task(name).load(DATA_DIR, 4, 0, FakeTokenizer())
        for item in items:
            blocks = item.prompt.split("\n\n")
            assert len(blocks) >= 6 and item.metadata["num_shots"] == 5
            assert len(item.choices) == n_choices and all(c.startswith(" ") for c in item.choices)
            assert blocks[-1] not in blocks[:-1]  # the query is not one of its own shots
    piqa = get_task("piqa").load(DATA_DIR, 1, 0, FakeTokenizer())[0]
    assert piqa.prompt.split("\n\n")[-1].startswith("Question: ") and piqa.prompt.endswith("\nAnswer:")


@needs_data
def test_lines_and_summarisation_prompts():
    lines = get_task("lines").load(DATA_DIR, 4, 0, FakeTokenizer())
    assert sorted({i.metadata["num_lines"] for i in lines}) == [200, 300]
    assert all("I need the number." in i.prompt for i in lines)
    assert get_task("lines").score(lines[0], f"The number is <{lines[0].references[0]}>.")["accuracy"] == 1.0
    assert get_task("lines").score(lines[0], f"{lines[0].references[0]} or maybe 3")["accuracy"] == 0.0
    xsum = get_task("xsum").load(DATA_DIR, 2, 0, FakeTokenizer())
    assert xsum[0].prompt.startswith("###\nArticle: ") and xsum[0].max_new_tokens == 64
    scores = get_task("xsum").score(xsum[0], " " + xsum[0].references[0] + "\n###\nArticle: unrelated words here")
    assert scores["rougeL"] == pytest.approx(1.0)
    xsum_task = get_task("xsum")
    xsum_task.load(DATA_DIR, 1, 0, FakeTokenizer())
    assert 0.02 < xsum_task.chance < 0.2  # ROUGE-L of an unrelated reference summary
    assert get_task("cnn_dailymail").load(DATA_DIR, 1, 0, FakeTokenizer())[0].max_new_tokens == 128
    news = get_task("multi_news").load(DATA_DIR, 1, 0, FakeTokenizer())[0]
    assert news.prompt.startswith("You are given several news passages.") and news.prompt.endswith("\n\nSummary:")


def test_synthetic_recall_needs_no_data():
    items = get_task("synthetic_recall").load(None, 5, 0, FakeTokenizer())
    assert len(items) == 5 and all("Question: What is the value of key" in i.prompt for i in items)
    assert items[0].prompt != get_task("synthetic_recall").load(None, 5, 1, FakeTokenizer())[0].prompt


# --------------------------------------------------------------------------- data errors


def test_missing_file_error_names_task_dir_and_path(tmp_path):
    with pytest.raises(FileNotFoundError) as error:
        get_task("xsum").load(tmp_path, 2, 0, FakeTokenizer())
    message = str(error.value)
    assert "'xsum'" in message and str(tmp_path) in message and "xsum/xsum_0shot.jsonl.gz" in message
    with pytest.raises(FileNotFoundError, match="lines.*longeval_lines/300_lines.jsonl.gz"):
        (tmp_path / "longeval_lines").mkdir()
        with gzip.open(tmp_path / "longeval_lines" / "200_lines.jsonl.gz", "wt") as handle:
            handle.write("{}\n")
        get_task("lines").load(tmp_path, 2, 0, FakeTokenizer())
    with pytest.raises(FileNotFoundError, match="'ppl'.*no data dir"):
        get_task("ppl").load(None, 2, 0, FakeTokenizer())


def test_malformed_line_error_names_file_and_line(tmp_path):
    path = tmp_path / "xsum" / "xsum_0shot.jsonl.gz"
    path.parent.mkdir()
    good = json.dumps({"article": "###\nArticle: a\n\nSummarize.", "summary_gt": "s", "max_tokens": 8})
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.write(good + "\n" + "\n" + '{"article": "broken\n' + good + "\n")
    with pytest.raises(TaskDataError, match=r"xsum_0shot\.jsonl\.gz: line 3: malformed JSON"):
        get_task("xsum").load(tmp_path, None, 0, FakeTokenizer())
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.write(good + "\n" + json.dumps({"article": "x"}) + "\n")
    with pytest.raises(TaskDataError, match=r"line 2: missing field\(s\) \['summary_gt'\]"):
        get_task("xsum").load(tmp_path, None, 0, FakeTokenizer())


# --------------------------------------------------------------------------- runner


def _keys(records):
    return [result_key(r) for r in records]


def test_runner_groups_settings_into_one_call_and_resumes(tmp_path):
    backend = FakeBackend()
    run = run_eval(
        backend, ["synthetic_recall"], ["local", "snapkv"], [0.25, 16], 3, None, tmp_path, seed=1, progress=False
    )
    assert run.total == run.written == 3 * 5 and run.skipped == 0
    assert len(backend.calls) == 3 and all(len(settings) == 5 for _, settings in backend.calls)
    assert backend.calls[0][1][0] == Setting("full", 1.0)
    records = read_results(tmp_path)
    assert len(records) == 15 and len(set(_keys(records))) == 15
    record = records[0]
    for field in ("model", "seed", "wall_s", "setting", "metrics", "output", "budget", "method", "item_id", "task"):
        assert field in record
    assert record["model"] == "fake" and record["seed"] == 1
    # the fake model's scripted quality: full and query-aware keep the answer, local at 16 tokens cannot
    summary = ResultsSummary(records)
    assert summary.full("synthetic_recall") == 1.0
    assert summary.value("synthetic_recall", "snapkv", 0.25) == 1.0
    assert summary.value("synthetic_recall", "local", 16) == 0.0
    # rerun: nothing to do, no backend call; adding a method runs only the new settings, one call per item
    backend = FakeBackend()
    run = run_eval(
        backend, ["synthetic_recall"], ["local", "snapkv"], [0.25, 16], 3, None, tmp_path, seed=1, progress=False
    )
    assert run.written == 0 and run.skipped == 15 and backend.calls == []
    run = run_eval(
        backend, ["synthetic_recall"], ["local", "snapkv", "h2o"], [0.25, 16], 3, None, tmp_path, seed=1, progress=False
    )
    assert run.written == 6 and [len(s) for _, s in backend.calls] == [2, 2, 2]
    assert len(read_results(tmp_path)) == 21
    with pytest.raises(ValueError, match="seed"):
        run_eval(backend, ["synthetic_recall"], ["local"], [0.25], 3, None, tmp_path, seed=2, progress=False)
    # same item ids, different content (a task parameter changed): refused rather than mixed
    with pytest.raises(ValueError, match="now different.*synthetic_recall/item0"):
        run_eval(
            backend, ["synthetic_recall:num_pairs=5"], ["local"], [0.25], 3, None, tmp_path, seed=1, progress=False
        )


def test_runner_all_kinds_and_token_budget_conversion(tmp_path):
    assert DATA_DIR.exists(), f"shared data not found at {DATA_DIR}"
    data = DATA_DIR
    backend = FakeBackend()
    run_eval(
        backend,
        ["ppl:num_tokens=64:window=32", "openbookqa"],
        ["local", "h2o"],
        {"ppl": [8, 0.5], "openbookqa": [0.1]},
        2,
        data,
        tmp_path,
        progress=False,
    )
    records = read_results(tmp_path)
    streaming = [s for kind, s in backend.calls if kind == "streaming"]
    assert streaming and {s.budget for s in streaming[0] if s.method != "full"} == {8, 16}  # 0.5 of 32 tokens + BOS
    ppl = [r for r in records if r["task"] == "ppl" and r["method"] == "local" and r["budget"] == 0.5]
    assert ppl and ppl[0]["budget_tokens"] == 16 and ppl[0]["metrics"]["n_tokens"] == 32
    assert any(r["task"] == "openbookqa" and len(r["output"]) == 4 for r in records)


def test_runner_records_settings_below_a_methods_minimum_as_infeasible(tmp_path):
    # synthetic_recall prompts are 132 tokens: 0.1 of them is below a 20-token minimum, 0.9 is not; token budgets are checked as given. The backend refuses infeasible settings, so
    # the run completes only if the runner keeps them away from it.
    backend = FakeBackend(minimum_budgets={"snapkv": 20})
    run = run_eval(
        backend, ["synthetic_recall"], ["snapkv", "local"], [0.1, 0.9, 24], 2, None, tmp_path, progress=False
    )
    assert run.written == 2 * 7
    records = read_results(tmp_path)
    infeasible = [r for r in records if r.get("status") == "infeasible"]
    assert {(r["method"], r["budget"]) for r in infeasible} == {("snapkv", 0.1)}
    assert len(infeasible) == 2 and all("minimum 20" in r["reason"] and r["metrics"] == {} for r in infeasible)
    assert all(Setting("snapkv", 0.1) not in settings for _, settings in backend.calls)
    summary = ResultsSummary(records)
    assert (
        summary.value("synthetic_recall", "snapkv", 0.1) is None
        and summary.count("synthetic_recall", "snapkv", 0.1) == 0
    )
    assert summary.value("synthetic_recall", "snapkv", 0.9) is not None
    assert summary.infeasible_settings("synthetic_recall")[0][:3] == ("snapkv", 0.1, 2)
    # resume: infeasible settings count as done
    again = run_eval(
        FakeBackend(minimum_budgets={"snapkv": 20}),
        ["synthetic_recall"],
        ["snapkv", "local"],
        [0.1, 0.9, 24],
        2,
        None,
        tmp_path,
        progress=False,
    )
    assert again.written == 0 and again.skipped == 14
    report = write_report(tmp_path)
    assert "Could not run" in report and "snapkv @ 0.1: 2 item(s)" in report
    # claims name the infeasible setting instead of silently treating it as missing
    holds, measured = outperforms("synthetic_recall", "snapkv", ["local"], [0.1])(summary)
    assert holds is None and "snapkv@0.1 (infeasible" in measured


def test_generate_prompts_are_middle_truncated_to_the_context(tmp_path):
    tokenizer = FakeTokenizer()
    prompt = " ".join(f"w{i}" for i in range(100))
    short, original = truncate_middle(prompt, tokenizer, 10)
    assert original == 100 and short.split() == [f"w{i}" for i in range(5)] + [f"w{i}" for i in range(95, 100)]
    # A task whose records could all be asked about is never cut (issue 27): too_long instead.
    backend = FakeBackend(max_context=60)
    run_eval(backend, ["synthetic_recall:num_pairs=20"], ["local"], [0.5], 1, None, tmp_path, progress=False)
    record = read_results(tmp_path)[0]
    assert record["status"] == "too_long" and "truncated_from_tokens" not in record["metadata"]


# The subprocess imports kvhive.evaluation without running kvhive/__init__.py (which loads torch and
# transformers, ~10 s): the harness must not depend on the model code, and the test stays fast.
RUNNER_SCRIPT = """
import sys, types
package = types.ModuleType("kvhive")
package.__path__ = [sys.argv[4]]
sys.modules["kvhive"] = package
from kvhive.evaluation import run_eval
sys.path.insert(0, sys.argv[5])
from fake_backend import FakeBackend
run_eval(FakeBackend(delay=float(sys.argv[2])), ["synthetic_recall:num_pairs=8", "ppl:num_tokens=48:window=16"],
         ["local", "snapkv", "streamingllm"], {"synthetic_recall": [0.25, 0.5], "ppl": [4, 8]}, 12, sys.argv[3],
         sys.argv[1], seed=0, progress=False)
"""


def _run_script(out_dir, delay, data_dir):
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    arguments = [str(out_dir), str(delay), str(data_dir), str(REPO / "kvhive"), str(REPO / "tests")]
    return subprocess.Popen([sys.executable, "-c", RUNNER_SCRIPT, *arguments], cwd=REPO, env=env)


@needs_data
def test_runner_survives_sigkill_mid_grid(tmp_path):
    results = tmp_path / "results.jsonl"
    expected = 12 * 7 + 3 * 7  # synthetic: 12 items x (full + 3 x 2); ppl: 3 windows x 7
    process = _run_script(tmp_path, 0.1, DATA_DIR)
    deadline = time.time() + 30
    while time.time() < deadline:
        if results.exists() and results.read_bytes().count(b"\n") >= 3 * 7:
            break
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    lines_before = results.read_bytes().count(b"\n")
    assert 0 < lines_before < expected, "the kill should land mid-grid"
    # simulate a kill in the middle of a write: a half record without its newline
    with open(results, "ab") as handle:
        handle.write(b'{"task": "synthetic_recall", "item_id": "item11", "method": "lo')
    process = _run_script(tmp_path, 0.0, DATA_DIR)
    assert process.wait(timeout=60) == 0
    raw = results.read_bytes()
    assert raw.endswith(b"\n")
    records = [json.loads(line) for line in raw.splitlines()]  # every line is whole JSON
    keys = _keys(records)
    assert len(keys) == len(set(keys)) == expected
    tasks = {k[0] for k in keys}
    assert tasks == {"synthetic_recall", "ppl"}
    items = {(k[0], k[1]) for k in keys}
    for task, item in items:  # every item has every setting exactly once
        assert sorted((k[2], k[3]) for k in keys if k[:2] == (task, item)) == sorted(
            [("full", "1.0")]
            + [
                (m, b)
                for m in ("local", "snapkv", "streamingllm")
                for b in (("0.25", "0.5") if task == "synthetic_recall" else ("4", "8"))
            ]
        )


def test_partial_last_line_is_truncated_and_redone(tmp_path):
    run_eval(FakeBackend(), ["synthetic_recall"], ["local"], [0.5], 2, None, tmp_path, progress=False)
    results = tmp_path / "results.jsonl"
    raw = results.read_bytes()
    last_start = raw[:-1].rfind(b"\n") + 1
    results.write_bytes(raw[: last_start + 25])  # corrupt: cut the last record mid-line
    assert len(read_results(tmp_path)) == 3  # readers ignore the partial line
    assert repair_results_file(results) == 25 and results.read_bytes() == raw[:last_start]
    results.write_bytes(raw[: last_start + 25])
    run = run_eval(FakeBackend(), ["synthetic_recall"], ["local"], [0.5], 2, None, tmp_path, progress=False)
    assert run.written == 1
    records = read_results(tmp_path)
    assert len(records) == 4 and len(set(_keys(records))) == 4
    assert all(json.loads(line) for line in results.read_bytes().splitlines())


def test_a_second_writer_is_refused(tmp_path):
    from kvhive.evaluation.results import ResultsWriter

    with ResultsWriter(tmp_path):
        with pytest.raises(RuntimeError, match="another evaluation run"):
            run_eval(FakeBackend(), ["synthetic_recall"], ["local"], [0.5], 1, None, tmp_path, progress=False)


# --------------------------------------------------------------------------- report and claims


def test_report_writes_markdown_and_plots(tmp_path):
    run_eval(
        FakeBackend(), ["synthetic_recall"], ["local", "snapkv"], [0.25, 0.5, 16], 4, None, tmp_path, progress=False
    )
    text = write_report(tmp_path)
    assert (tmp_path / "report.md").read_text() == text
    assert "## synthetic_recall" in text and "| full | (all) |" in text and "| local | 16 tok |" in text
    assert "accuracy / full" in text and "Paper claims" not in text
    for png in ("quality_synthetic_recall_ratio.png", "quality_synthetic_recall_tokens.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({png})" in text


def _record(task, method, budget, item, metrics, **extra):
    return {
        "task": task,
        "item_id": item,
        "method": method,
        "budget": budget,
        "metrics": metrics,
        "kind": extra.get("kind", "generate"),
        "main_metric": extra.get("main_metric", "accuracy"),
        "higher_is_better": extra.get("higher_is_better", True),
        "chance": extra.get("chance", 0.0),
        "model": "fake",
        "seed": 0,
        "suite": "claims",
    }


def test_report_flags_near_chance_and_aggregates_perplexity(tmp_path):
    records = [
        _record("piqa", "full", 1.0, f"i{i}", {"acc": float(i % 2)}, main_metric="acc", chance=0.5) for i in range(4)
    ]
    records += [
        _record(
            "ppl",
            m,
            50,
            f"w{i}",
            {"ppl": 1.0, "nll_sum": nll, "n_tokens": 10},
            kind="perplexity",
            main_metric="ppl",
            higher_is_better=False,
            chance=1000.0,
        )
        for m in ("full", "buzz")
        for i, nll in enumerate((10.0, 30.0))
    ]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text = write_report(tmp_path)
    piqa_section = text.split("## piqa")[1].split("## ")[0]
    assert "Warning" in piqa_section
    assert "Warning" not in text.split("## ppl")[1].split("## ")[0]
    assert f"| buzz | 50 tok | {math.exp(2.0):.3f} | 2 | 1.00× |" in text
    assert "## Paper claims" in text and "buzz-ppl" in text


def test_claim_checks():
    def summary(values, task="needle", higher=True, chance=0.0, full=1.0, items=12):
        # Every setting scores its value plus the same item offset on each item: the paired
        # differences are exact, so their interval is a point and decides.
        def record(method, budget, item, value):
            offset = 0.01 * (item % 3)
            return _record(
                task,
                method,
                budget,
                f"i{item}",
                {"m": value + offset},
                main_metric="m",
                higher_is_better=higher,
                chance=chance,
            )

        records = [record("full", 1.0, item, full) for item in range(items)]
        records += [
            record(method, budget, item, value) for (method, budget), value in values.items() for item in range(items)
        ]
        return ResultsSummary(records)

    check = outperforms("needle", "ada-snapkv", ["snapkv"], (64, 128), mode="mean")
    assert (
        check(summary({("ada-snapkv", 64): 0.6, ("ada-snapkv", 128): 0.9, ("snapkv", 64): 0.5, ("snapkv", 128): 0.9}))[
            0
        ]
        is True
    )
    assert (
        check(summary({("ada-snapkv", 64): 0.4, ("ada-snapkv", 128): 0.9, ("snapkv", 64): 0.5, ("snapkv", 128): 0.9}))[
            0
        ]
        is False
    )
    tie = check(summary({("ada-snapkv", 64): 0.5, ("ada-snapkv", 128): 0.9, ("snapkv", 64): 0.5, ("snapkv", 128): 0.9}))
    assert tie[0] is None and "tie" in tie[1]
    missing = check(summary({("ada-snapkv", 64): 0.6, ("snapkv", 64): 0.5, ("snapkv", 128): 0.9}))
    assert missing[0] is None and "ada-snapkv@128 tok" in missing[1]
    near_chance = check(
        summary(
            {("ada-snapkv", 64): 0.6, ("ada-snapkv", 128): 0.9, ("snapkv", 64): 0.5, ("snapkv", 128): 0.9}, full=0.02
        )
    )
    assert near_chance[0] is None and "near chance" in near_chance[1]
    # only the full cache run (the compressed settings skipped because it is at chance): both said
    skipped = check(summary({}, full=0.02))
    assert skipped[0] is None and "near chance" in skipped[1] and "missing: ada-snapkv@64 tok" in skipped[1]
    full_only = retains_full("needle", "ada-snapkv", 64, 0.9)(summary({}, full=0.02))
    assert full_only[0] is None and "missing data" in full_only[1] and "near chance" in full_only[1]
    each = outperforms("ppl", "buzz", ["h2o"], (50, 100))  # lower is better

    def ppl(b50, b100):
        return summary(
            {("buzz", 50): b50, ("buzz", 100): b100, ("h2o", 50): 10.0, ("h2o", 100): 9.0},
            task="ppl",
            higher=False,
            chance=1e5,
            full=7.0,
        )

    assert each(ppl(9.4, 8.0))[0] is True and each(ppl(9.4, 9.5))[0] is False
    keeps = retains_full("needle", "buzz", 0.4, 0.99)
    assert keeps(summary({("buzz", 0.4): 0.995}))[0] is True and keeps(summary({("buzz", 0.4): 0.9}))[0] is False
    # one item: no interval, so no verdict however large the difference
    assert (
        check(
            summary(
                {("ada-snapkv", 64): 0.9, ("ada-snapkv", 128): 0.9, ("snapkv", 64): 0.1, ("snapkv", 128): 0.1}, items=1
            )
        )[0]
        is None
    )
    assert keeps(summary({("buzz", 0.4): 0.5}, items=1))[0] is None


def test_claim_differences_within_paired_noise_are_not_verdicts():
    def summary(candidate_hits, baseline_hits, n=12):
        records = [_record("needle", "full", 1.0, f"i{i}", {"m": 1.0}, main_metric="m", chance=0.0) for i in range(n)]
        for method, hits in (("ada-snapkv", candidate_hits), ("snapkv", baseline_hits)):
            records += [
                _record("needle", method, 64, f"i{i}", {"m": float(i in hits)}, main_metric="m", chance=0.0)
                for i in range(n)
            ]
        return ResultsSummary(records)

    check = outperforms("needle", "ada-snapkv", ["snapkv"], (64,))
    one_item = check(summary({0, 1, 2}, {0, 1}))  # one more item of 12: a bootstrap interval from 0 to 0.25
    assert one_item[0] is None and "1 comparison(s) not decided" in one_item[1]
    assert "vs snapkv +0.0833 [+0, +0.25]" in one_item[1] and "95.0% interval, includes 0" in one_item[1]
    one_item_loss = check(summary({0, 1}, {0, 1, 2}))
    assert one_item_loss[0] is None
    assert check(summary(set(range(8)), set()))[0] is True  # 8 of 12 items, none the other way
    assert check(summary(set(), set(range(8))))[0] is False
    # the paired test sees what unpaired standard errors would hide: same items, consistent gain
    assert check(summary(set(range(6)), set(range(2))))[0] is True


def test_claims_are_well_formed_and_grid_covers_them():
    assert len({c.id for c in CLAIMS}) == len(CLAIMS)
    assert {c.paper for c in CLAIMS} == {"BUZZ", "Ada-KV", "BumbleBee", "SubGen", "AhaKV"}
    tasks, methods, budgets = claims_grid()
    for claim in CLAIMS:
        assert claim.task in TASKS and claim.paper_says.strip()
        assert set(claim.methods) <= REGISTRY, claim.id
        validate_budgets(list(claim.budgets))
        assert set(claim.methods) <= set(methods[claim.task])
        assert {budget_key(b) for b in claim.budgets} <= {budget_key(b) for b in budgets[claim.task]}
    assert all(holds is None for holds, _ in evaluate_claims(ResultsSummary([])))


# --------------------------------------------------------------------------- CLI


def test_cli_eval_and_report(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    factory_calls = []

    def factory(model_name):
        factory_calls.append(model_name)
        return FakeBackend()

    code = cli_main(
        [
            "eval",
            "--tasks",
            "synthetic_recall:num_pairs=10",
            "--methods",
            "local,snapkv",
            "--budgets",
            "0.5,16",
            "--limit",
            "2",
            "--out",
            str(out),
            "--no-progress",
            "--model",
            "tiny",
        ],
        backend_factory=factory,
    )
    assert code == 0 and factory_calls == ["tiny"]
    assert len(read_results(out)) == 2 * 5 and (out / "report.md").exists()
    assert read_results(out)[0]["model"] == "tiny"
    assert cli_main(["report", str(out)]) == 0
    with pytest.raises(SystemExit):
        cli_main(
            ["eval", "--tasks", "synthetic_recall", "--methods", "local", "--budgets", "0.5,nan"],
            backend_factory=factory,
        )
    assert "budgets" in capsys.readouterr().err
    monkeypatch.setenv("KVHIVE_DATA_DIR", str(tmp_path))
    assert default_data_dir() == tmp_path
    monkeypatch.delenv("KVHIVE_DATA_DIR")
    assert default_data_dir() == (REPO.parent / "shared" / "data").resolve()


def test_cli_suites_resolve():
    import argparse

    from kvhive.evaluation.cli import add_eval_arguments, resolve_eval_grid

    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers()
    add_eval_arguments(subparsers, backend_factory=lambda m: FakeBackend())
    quick = resolve_eval_grid(parser.parse_args(["eval", "--suite", "quick"]))
    assert quick["limit"] and len(quick["tasks"]) >= 3
    # every quick task has its budgets, each a valid ratio
    assert set(quick["budgets"]) == {task.split(":")[0] for task in quick["tasks"]}
    assert all(0 < b <= 1 for budgets in quick["budgets"].values() for b in budgets)
    claims = resolve_eval_grid(parser.parse_args(["eval", "--suite", "claims", "--tasks", "xsum", "--limit", "3"]))
    assert claims["tasks"] == ["xsum"] and set(claims["methods"]) == {"xsum"} and claims["limit"] == 3
    assert "buzz" in claims["methods"]["xsum"] and 0.4 in claims["budgets"]["xsum"]
    # the bare suite command is the committed run: 40 items a task, bf16; explicit options override
    bare = resolve_eval_grid(parser.parse_args(["eval", "--suite", "claims"]))
    assert bare["limit"] == 40 and bare["dtype"] == "bfloat16"
    assert (
        resolve_eval_grid(parser.parse_args(["eval", "--suite", "claims", "--dtype", "float32"]))["dtype"] == "float32"
    )
    assert quick["dtype"] == "float32"
    assert resolve_eval_grid(parser.parse_args(["eval", "--tasks", "xsum", "--methods", "h2o"]))["dtype"] == "float32"


def test_results_writer_refuses_non_finite_numbers(tmp_path):
    from kvhive.evaluation.results import ResultsWriter

    record = {"task": "t", "item_id": "0", "method": "h2o", "budget": 8, "metrics": {"acc": float("nan")}}
    with ResultsWriter(tmp_path) as writer, pytest.raises(ValueError):
        writer.append(record)
    assert read_results(tmp_path) == []


def test_choice_accuracy_refuses_nan_instead_of_taking_max_over_it():
    # max() over [nan, -1.0] keeps index 0: accuracy 1.0 for label 0 from a NaN model.
    with pytest.raises(ValueError, match="non-finite"):
        choice_accuracy([float("nan"), -1.0], ["a", "b"], 0)


class _NonFiniteBackend(FakeBackend):
    """Scores NaN for one method: the runner must record it as failed, not as a score."""

    def choice_loglikelihoods(self, context, continuations, settings):
        out = super().choice_loglikelihoods(context, continuations, settings)
        return [[float("nan")] * len(row) if s.method == "h2o" else row for s, row in zip(settings, out, strict=True)]

    def streaming_nll(self, token_ids, settings):
        out = super().streaming_nll(token_ids, settings)
        return [(float("inf"), n) if s.method == "h2o" else (nll, n) for s, (nll, n) in zip(settings, out, strict=True)]


def test_runner_records_non_finite_outputs_as_failed_and_the_summary_skips_them(tmp_path):
    run_eval(
        _NonFiniteBackend(),
        ["piqa", "ppl:num_tokens=48:window=16"],
        ["h2o", "local"],
        [8],
        2,
        DATA_DIR,
        tmp_path,
        progress=False,
    )
    text = (tmp_path / "results.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    records = read_results(tmp_path)
    failed = [r for r in records if r["method"] == "h2o"]
    assert len(failed) == 4 and all(r["status"] == "failed" and r["metrics"] == {} for r in failed)
    assert all("non-finite" in r["reason"] for r in failed)
    assert all(r["status"] == "ok" for r in records if r["method"] != "h2o")
    summary = ResultsSummary(records)
    assert summary.count("piqa", "h2o", 8) == 0 and summary.value("piqa", "h2o", 8) is None
    assert summary.value("piqa", "local", 8) is not None
    assert [(m, b, st, n) for m, b, st, n, _ in summary.unscored_settings("piqa")] == [("h2o", 8, "failed", 2)]
    assert summary.item_ids("piqa", "local", 8) == summary.item_ids("piqa", "full")


def test_a_ratio_resolving_to_zero_tokens_on_perplexity_is_infeasible(tmp_path):
    # 1e-9 of the text used to be raised silently to a 1-token budget.
    run_eval(
        FakeBackend(), ["ppl:num_tokens=48:window=16"], ["local"], [1e-9, 0.5], 1, DATA_DIR, tmp_path, progress=False
    )
    records = {r["budget"]: r for r in read_results(tmp_path) if r["method"] == "local"}
    assert records[1e-9]["status"] == "infeasible" and "0 tokens" in records[1e-9]["reason"]
    assert records[0.5]["status"] == "ok"


def test_claims_suite_decides_on_40_perplexity_windows_2k_4k_needles_and_kv_retrieval():
    # issue 12: streaming perplexity over >= 8 windows (40: as many as the suite's items, since
    # BUZZ - H2O on Qwen2.5-0.5B is undecided at 8), needles at 2k and 4k tokens, kv-retrieval
    # (Qwen's full cache 8/10)
    from kvhive.evaluation.suites import get_suite
    from kvhive.evaluation.tasks import get_task, parse_task_spec

    suite = get_suite("claims")
    specs = {parse_task_spec(spec)[0]: parse_task_spec(spec)[1] for spec in suite.tasks}
    ppl = get_task("ppl", **specs["ppl"])
    assert ppl.params["num_tokens"] // ppl.params["window"] == suite.limit == 40
    assert set(suite.methods["kv_retrieval"]) >= {"ahakv", "ada-snapkv", "snapkv", "tova", "h2o", "streamingllm"}
    for needle in ("needle", "needle_multikey"):
        assert specs[needle]["lengths"] == [2000, 4000]
    # mdqa at ~2.4k and ~4k tokens: 20 and 33 documents, the gold first, in the middle, last
    assert specs["mdqa"] == {"num_documents": [20, 33], "gold_positions": [0, "middle", -1]}
    assert set(specs) == set(suite.methods)  # every claim task has its methods under its name


def test_runner_records_the_dtype_and_refuses_to_mix_dtypes(tmp_path):
    backend = FakeBackend()
    run_eval(backend, ["synthetic_recall"], ["local"], [0.25], 2, None, tmp_path, progress=False, dtype="bfloat16")
    records = read_results(tmp_path)
    assert records and {r["dtype"] for r in records} == {"bfloat16"}
    assert json.loads((tmp_path / "run_config.json").read_text())["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="dtype='float32'"):
        run_eval(backend, ["synthetic_recall"], ["local"], [0.25], 2, None, tmp_path, progress=False)
    with pytest.raises(ValueError, match="invalid dtype='fp8'.*float32, bfloat16, float16"):
        run_eval(backend, ["synthetic_recall"], ["local"], [0.25], 2, None, tmp_path, progress=False, dtype="fp8")
    # records written before the field existed read as float32
    legacy = tmp_path / "legacy"
    run_eval(backend, ["synthetic_recall"], ["local"], [0.25], 2, None, legacy, progress=False)
    lines = [json.loads(line) for line in (legacy / "results.jsonl").read_text().splitlines()]
    (legacy / "results.jsonl").write_text(
        "".join(json.dumps({k: v for k, v in r.items() if k != "dtype"}) + "\n" for r in lines)
    )
    assert run_eval(backend, ["synthetic_recall"], ["local"], [0.25], 2, None, legacy, progress=False).written == 0


def test_eval_cli_loads_the_model_in_the_dtype_asked(tmp_path):
    from kvhive.evaluation.cli import main

    asked = []

    def factory(model_name, dtype="float32"):
        asked.append((model_name, dtype))
        return FakeBackend()

    argv = ["eval", "--tasks", "synthetic_recall", "--methods", "local", "--budgets", "0.5", "--limit", "1"]
    main([*argv, "--out", str(tmp_path / "bf16"), "--dtype", "bfloat16", "--no-progress"], backend_factory=factory)
    main([*argv, "--out", str(tmp_path / "fp32"), "--no-progress"], backend_factory=factory)
    assert [dtype for _, dtype in asked] == ["bfloat16", "float32"]
    assert {r["dtype"] for r in read_results(tmp_path / "bf16")} == {"bfloat16"}
    with pytest.raises(SystemExit):
        main([*argv, "--out", str(tmp_path / "x"), "--dtype", "int8"], backend_factory=factory)


@needs_data
def test_mdqa_at_two_document_counts_pairs_each_question_across_lengths():
    [task] = resolve_tasks(["mdqa:num_documents=20+33:gold_positions=0+middle+-1"])
    items = task.load(DATA_DIR, 12, 0, FakeTokenizer())
    assert len(items) == 12
    assert [(i.metadata["num_documents"], i.metadata["gold_position"]) for i in items[:6]] == [
        (20, 0),
        (20, 10),
        (20, 19),
        (33, 0),
        (33, 16),
        (33, 32),
    ]
    assert len({i.metadata["line"] for i in items[:6]}) == 1  # one question at both lengths
    assert items[0].id.endswith("-docs20-gold0") and items[5].id.endswith("-docs33-gold32")
    for item in items:
        documents = [line for line in item.prompt.split("\n") if line.startswith("Document [")]
        assert len(documents) == item.metadata["num_documents"]
    # Each count's items are those of a run at that count alone.
    [alone_task] = resolve_tasks(["mdqa:num_documents=33:gold_positions=0+16+32"])
    alone = alone_task.load(DATA_DIR, 6, 0, FakeTokenizer())
    assert [(i.id, i.prompt) for i in alone[:3]] == [(i.id, i.prompt) for i in items[3:6]]
    with pytest.raises(ValueError, match="gold_positions.*outside 0..19"):
        resolve_tasks(["mdqa:num_documents=20:gold_positions=0+25"])[0].load(DATA_DIR, 3, 0, FakeTokenizer())
    with pytest.raises(
        ValueError, match="'gold_positions': 'first' is not a number; expected an integer .* or 'middle'"
    ):
        resolve_tasks(["mdqa:gold_positions=first"])[0].load(DATA_DIR, 3, 0, FakeTokenizer())
