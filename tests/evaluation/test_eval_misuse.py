"""The evaluation harness under misuse and faults (issue 27, evaluation half): nothing recorded
as valid that is not, nothing lost, and errors that say what to do.

Each test here fails on the code before issue 27: a transient failure was recorded as done and
never retried, the report did not count items without a score, names from results.jsonl went
raw into markdown, and so on (each test says what it guards).
"""

from __future__ import annotations

import gzip
import json
import os
import shlex
from pathlib import Path

import pytest
from fake_backend import FakeBackend, FakeTokenizer

from kvhive.evaluation import run_eval, write_report
from kvhive.evaluation.claims import outperforms, retains_full
from kvhive.evaluation.distributed import failed_records
from kvhive.evaluation.results import TRANSIENT_STATUS, ResultsSummary, ResultsWriter, read_results, result_key
from kvhive.evaluation.runner import resolve_tasks
from kvhive.evaluation.tasks import TaskDataError, get_task

from helpers import result_record

RECALL = "synthetic_recall:num_pairs=6"
DATA_DIR = Path(os.environ.get("KVHIVE_DATA_DIR") or "/work/shared/data")


def _write(tmp_path, records):
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _dying_executor(dead_item: str):
    """An executor like the Ray pool's whose worker dies for good on ``dead_item``: that item's
    settings get the records the pool writes once its attempts are spent."""

    def executor(work, writer, bar, fields):
        backend = FakeBackend()
        from kvhive.evaluation.runner import run_item

        written = 0
        for entry in work:
            if entry.item.id == dead_item:
                reason = "worker died (ActorDiedError) (after 3 attempts; a rerun retries it)"
                for record in failed_records(entry, fields, reason, 3):
                    writer.append(record)
                    written += 1
                continue
            written += run_item(
                backend, entry.task, entry.item, entry.settings, writer, fields["model"], fields["seed"],
                fields["limit"], fields["suite"], fields["dtype"],
            )  # fmt: skip
        return written

    return executor


# --------------------------------------------------------------------------- item 1: transient failures


def test_a_dead_worker_is_recorded_transient_and_a_rerun_retries_it(tmp_path):
    grid = dict(tasks=[RECALL], methods=["local"], budgets=[0.5], limit=3, data_dir=None, out_dir=tmp_path)
    first = run_eval(FakeBackend(), **grid, progress=False, model_name="fake", executor=_dying_executor("item1"))
    records = read_results(tmp_path)
    dead = [r for r in records if r["item_id"] == "item1"]
    assert len(dead) == 2 and all(r["status"] == TRANSIENT_STATUS and r["metrics"] == {} for r in dead)
    assert first.transient == 2 and first.written == first.total == 6

    again = run_eval(FakeBackend(), **grid, progress=False, model_name="fake")
    assert (again.written, again.skipped, again.transient) == (2, 4, 0)  # only the dead item's settings rerun
    records = read_results(tmp_path)
    assert len(records) == 6 and all(r["status"] == "ok" for r in records)  # the latest record of a key wins
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert len(lines) == 8  # nothing rewritten in place: the transient lines stay, superseded

    third = run_eval(FakeBackend(), **grid, progress=False, model_name="fake")
    assert (third.written, third.skipped) == (0, 6)  # and nothing is computed twice


def test_the_writer_replaces_a_transient_record_but_never_a_settled_one(tmp_path):
    ok = result_record("h2o", 0.5, "i0", 1.0, status="ok")
    transient = result_record("snapkv", 0.5, "i0", None, status=TRANSIENT_STATUS, reason="worker died")
    transient["metrics"] = {}
    failed = result_record("tova", 0.5, "i0", None, status="failed", reason="non-finite model output")
    failed["metrics"] = {}
    with ResultsWriter(tmp_path) as writer:
        for record in (ok, transient, failed):
            writer.append(record)
        assert result_key(transient) not in writer.done and result_key(failed) in writer.done
        writer.append({**ok, "metrics": {"m": 0.0}})  # a settled key is never written twice
        writer.append({**failed, "status": "ok", "metrics": {"m": 1.0}})
        writer.append({**transient, "status": "ok", "metrics": {"m": 0.25}})
        assert [r["method"] for r in writer.records] == ["h2o", "tova", "snapkv"]
    by_method = {r["method"]: r for r in read_results(tmp_path)}
    assert by_method["h2o"]["metrics"] == {"m": 1.0}
    assert by_method["tova"]["status"] == "failed"  # deterministic: kept
    assert by_method["snapkv"]["status"] == "ok" and by_method["snapkv"]["metrics"] == {"m": 0.25}


def test_the_report_counts_items_without_a_score_per_cell_and_says_why(tmp_path):
    records = [result_record("full", 1.0, f"i{i}", 1.0) for i in range(8)]
    records += [result_record("h2o", 0.5, f"i{i}", 1.0) for i in range(7)]
    records.append({**result_record("h2o", 0.5, "i7", None), "metrics": {}, "status": TRANSIENT_STATUS,
                    "reason": "worker died (ActorDiedError) (after 3 attempts)"})  # fmt: skip
    records += [result_record("snapkv", 0.5, f"i{i}", 1.0) for i in range(5)]  # 3 items never recorded
    records.append({**result_record("snapkv", 0.5, "i5", None), "metrics": {}, "status": "failed",
                    "reason": "non-finite model output: NLL nan"})  # fmt: skip
    _write(tmp_path, records)
    text = write_report(tmp_path)
    assert "| h2o | 0.5 | 1.000 ± 0.000 | 7 |" in text and "| 1 transient |" in text
    assert "| snapkv | 0.5 | 1.000 ± 0.000 | 5 |" in text and "| 1 failed, 2 missing |" in text
    assert "- h2o @ 0.5: 1 item(s) transient (rerun the same `kvhive eval` command to retry them) — worker died" in text
    assert "- snapkv @ 0.5: 1 item(s) failed — non-finite model output" in text
    assert "- snapkv @ 0.5: 2 item(s) missing — no record for item(s) i6, i7" in text
    assert "| full | (all) | 1.000 ± 0.000 | 8 | 1.00× | 8 | – |" in text  # a complete cell says so


def test_a_claim_verdict_names_compared_cells_with_items_without_a_score():
    records = []
    for i in range(12):
        records += [result_record("full", 1.0, f"i{i}", 1.0), result_record("h2o", 0.5, f"i{i}", 0.0)]
        if i != 3:
            records.append(result_record("snapkv", 0.5, f"i{i}", 1.0))
    records.append({**result_record("snapkv", 0.5, "i3", None), "metrics": {}, "status": TRANSIENT_STATUS,
                    "reason": "worker died"})  # fmt: skip
    summary = ResultsSummary(records)
    holds, text = outperforms("needle", "snapkv", ["h2o"], (0.5,))(summary)
    assert holds is True and "items without a score, left out: snapkv@0.5 1 transient" in text
    holds, text = retains_full("needle", "snapkv", 0.5, 0.9)(summary)
    assert holds is True and "snapkv@0.5 1 transient" in text
    complete = ResultsSummary([r for r in records if r["item_id"] != "i3"])
    assert "without a score" not in outperforms("needle", "snapkv", ["h2o"], (0.5,))(complete)[1]


# --------------------------------------------------------------------------- item 6: escaping


def test_names_from_results_go_escaped_into_the_report(tmp_path):
    hostile_method = "evil|col\n## heading <img src=x onerror=alert(1)> [link](http://x) *b*"
    hostile_task = "task|x\n<script>alert(1)</script>"
    records = [result_record("full", 1.0, f"i{i}", 1.0, task=hostile_task) for i in range(2)]
    records += [result_record(hostile_method, 0.5, f"i{i}", 0.5, task=hostile_task) for i in range(2)]
    records.append({**result_record(hostile_method, 16, "i0", None, task=hostile_task), "metrics": {},
                    "status": "infeasible", "reason": "<b>bold</b>|x"})  # fmt: skip
    _write(tmp_path, records)
    text = write_report(tmp_path)
    assert "<img" not in text and "<script>" not in text and "<b>" not in text
    assert "\n## heading" not in text and "[link](" not in text
    table = [line for line in text.splitlines() if line.startswith("| ") and "0.500" in line]
    assert len(table) == 1
    # the row has exactly the header's columns: no pipe of the name split it
    header = next(line for line in text.splitlines() if line.startswith("| method"))
    unescaped_pipes = lambda line: line.replace("\\|", "").count("|")  # noqa: E731
    assert unescaped_pipes(table[0]) == unescaped_pipes(header)
    assert "evil\\|col ## heading &lt;img src=x onerror=alert(1)&gt; \\[link\\](http://x) \\*b\\*" in table[0]
    assert "## task\\|x &lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "&lt;b&gt;bold&lt;/b&gt;\\|x" in text


# --------------------------------------------------------------------------- items 3 and 5: data files


def _data_dir_with(tmp_path, relative: str, payload: bytes):
    path = tmp_path / "data" / relative
    path.parent.mkdir(parents=True)
    path.write_bytes(payload)
    return tmp_path / "data", path


def test_an_empty_data_file_is_an_error_naming_it_not_an_empty_task(tmp_path):
    data_dir, path = _data_dir_with(tmp_path, "piqa/valid.jsonl.gz", gzip.compress(b""))
    with pytest.raises(TaskDataError, match=f"{path}: holds no records"):
        run_eval(FakeBackend(), ["piqa"], ["local"], [0.5], 2, data_dir, tmp_path / "out", progress=False)
    data_dir, path = _data_dir_with(tmp_path / "b", "wikitext2/wiki.test.raw", b"")
    with pytest.raises(TaskDataError, match=f"{path}: is empty"):
        get_task("ppl").load(data_dir, 1, 0, FakeTokenizer())
    data_dir, path = _data_dir_with(tmp_path / "c", "paul_graham_essays/essays/a.txt", b"")
    with pytest.raises(TaskDataError, match="every essay"):  # the haystack loop never ended
        get_task("needle", lengths=[50], depths=[50]).load(data_dir, 1, 0, FakeTokenizer())


def test_a_truncated_gz_is_an_error_naming_the_file(tmp_path):
    source = (DATA_DIR / "piqa/valid.jsonl.gz").read_bytes()
    data_dir, path = _data_dir_with(tmp_path, "piqa/valid.jsonl.gz", source[: len(source) // 2])
    with pytest.raises(TaskDataError, match=rf"{path}: cannot be read past line \d+ \(EOFError"):
        get_task("piqa").load(data_dir, 2, 0, FakeTokenizer())


# --------------------------------------------------------------------------- item 2: prompts longer than the context


def test_a_needle_prompt_too_long_for_the_model_keeps_its_needle_at_its_depth(tmp_path):
    # Before issue 27 the runner cut the middle of the prompt: the needle at depth 50 went with it
    # and the item was recorded ok (scored 0 for every setting, the full cache included).
    backend = FakeBackend(max_context=400)
    grid = (["needle:lengths=600:depths=50+100:max_new_tokens=12"], ["local"], [0.5], 2, DATA_DIR, tmp_path)
    run_eval(backend, *grid, progress=False)
    records = read_results(tmp_path)
    assert {r["status"] for r in records} == {"ok"}
    for record in records:
        metadata = record["metadata"]
        assert metadata["truncated_from_tokens"] > 400 and metadata["length"] == 600
        assert metadata["haystack_tokens"] < 600 and "haystack" in metadata["truncated"]
        assert abs(metadata["needle_offset_fraction"] - metadata["depth"] / 100) < 0.05  # the same depth
    full = [r for r in records if r["method"] == "full"]
    assert [r["metrics"]["exact_match"] for r in full] == [1.0, 1.0]  # the needle is still there to find
    for task, items, _ in [(t, t.load(DATA_DIR, 2, 0, backend.tokenizer), None) for t in resolve_tasks(grid[0])]:
        for item in items:
            short = task.shorten(item, backend.tokenizer, 400 - 12 - 8)
            assert (
                "Dolores Park on a sunny day" in short.prompt
                and len(backend.tokenizer.encode(short.prompt, add_special_tokens=False)) <= 380
            )
    text = write_report(tmp_path)
    assert "2 of 2 item(s) had a prompt longer than the model's context (up to" in text and "haystack" in text


def test_a_prompt_that_may_not_be_cut_is_recorded_too_long_and_counted(tmp_path):
    backend = FakeBackend(max_context=60)
    run_eval(backend, ["synthetic_recall:num_pairs=20"], ["local"], [0.5], 2, None, tmp_path, progress=False)
    records = read_results(tmp_path)
    assert len(records) == 4 and all(r["status"] == "too_long" and r["metrics"] == {} for r in records)
    assert "does not fit the model's context of 60 tokens" in records[0]["reason"]
    assert "'synthetic_recall' allows no cut" in records[0]["reason"]
    assert backend.calls == []  # the model never saw a cut prompt
    text = write_report(tmp_path)
    assert "- local @ 0.5: 2 item(s) too_long — prompt of" in text


def test_a_summary_prompt_is_cut_in_the_middle_and_the_report_says_so(tmp_path):
    backend = FakeBackend(max_context=200)
    run_eval(backend, ["xsum"], ["local"], [0.5], 2, DATA_DIR, tmp_path, progress=False)
    records = read_results(tmp_path)
    assert {r["status"] for r in records} == {"ok"}
    assert all("middle of the article" in r["metadata"]["truncated"] for r in records)
    assert "had a prompt longer than the model's context" in write_report(tmp_path)


# --------------------------------------------------------------------------- item 5: errors that say what to do


def test_report_on_a_non_numeric_metric_names_the_file_and_line(tmp_path, capsys):
    from kvhive.cli import main

    records = [result_record("full", 1.0, "i0", 1.0), result_record("h2o", 0.5, "i0", "abc")]
    _write(tmp_path, records)
    assert main(["report", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert f"{tmp_path / 'results.jsonl'}: line 2: metric 'm' is 'abc', not a number" in error
    assert "Traceback" not in error


def _never_called(model_name):
    raise AssertionError("the model was loaded although --out was refusable up front")


def test_out_naming_a_jsonl_file_or_a_file_is_refused_before_anything_runs(tmp_path, capsys):
    from kvhive.cli import main
    from kvhive.evaluation.cli import main as evaluation_main

    for out in (tmp_path / "x.jsonl", tmp_path / "made" / "y.jsonl"):
        (tmp_path / "made" / "y.jsonl").mkdir(parents=True, exist_ok=True)  # an existing folder with that name
        argv = ["eval", "--tasks", RECALL, "--methods", "local", "--out", str(out), "--no-progress"]
        with pytest.raises(ValueError, match=r"out_dir \(--out\): .*ends in \.jsonl; give the output folder"):
            evaluation_main(argv, backend_factory=_never_called)
        assert main([*argv, "--model", "no-such-model"]) == 2  # refused before the model is looked up
        assert "ends in .jsonl" in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists() and not list((tmp_path / "made" / "y.jsonl").iterdir())
    a_file = tmp_path / "plain"
    a_file.write_text("")
    with pytest.raises(ValueError, match="exists and is not a folder"):
        evaluation_main(["eval", "--tasks", RECALL, "--methods", "local", "--out", str(a_file)], _never_called)


class _InterruptedBackend(FakeBackend):
    """Ctrl-C arrives during the third item."""

    def generate(self, prompt, max_new_tokens, settings):
        if sum(kind == "generate" for kind, _ in self.calls) == 2:
            raise KeyboardInterrupt
        return super().generate(prompt, max_new_tokens, settings)


def test_ctrl_c_during_eval_says_what_is_saved_and_how_to_resume(tmp_path, capsys):
    from kvhive.evaluation.cli import main as evaluation_main

    out = tmp_path / "out"
    argv = ["eval", "--tasks", RECALL, "--methods", "local", "--budgets", "0.5", "--limit", "4", "--out", str(out)]
    argv += ["--no-progress", "--no-report"]
    assert evaluation_main(argv, backend_factory=lambda name: _InterruptedBackend()) == 130
    error = capsys.readouterr().err
    assert "Traceback" not in error and error.count("\n") == 1
    saved = f"4 results are saved in {out / 'results.jsonl'}"
    assert error == f"kvhive eval: interrupted; {saved}; resume with: {shlex.join(['kvhive', *argv])}\n"
    assert len(read_results(out)) == 4
    assert evaluation_main(argv, backend_factory=lambda name: FakeBackend()) == 0
    assert len(read_results(out)) == 8


class _OutOfMemoryOnce(FakeBackend):
    """The device runs out of memory on the second item, once."""

    failed = False

    def generate(self, prompt, max_new_tokens, settings):
        if not _OutOfMemoryOnce.failed and sum(kind == "generate" for kind, _ in self.calls) == 1:
            _OutOfMemoryOnce.failed = True
            self.calls.append(("generate", list(settings)))
            raise MemoryError("cannot allocate 2 GiB")
        return super().generate(prompt, max_new_tokens, settings)


def test_out_of_memory_in_one_process_is_transient_and_retried_on_rerun(tmp_path):
    # Before issue 27 the error ended the run with a traceback; now the grid goes on.
    grid = ([RECALL], ["local"], [0.5], 3, None, tmp_path)
    first = run_eval(_OutOfMemoryOnce(), *grid, progress=False)
    lost = [r for r in read_results(tmp_path) if r["status"] == TRANSIENT_STATUS]
    assert first.transient == 2 and {r["item_id"] for r in lost} == {"item1"}
    assert "out of memory (MemoryError: cannot allocate 2 GiB); a rerun retries it" in lost[0]["reason"]
    again = run_eval(_OutOfMemoryOnce(), *grid, progress=False)
    assert (again.written, again.transient) == (2, 0)
    assert all(r["status"] == "ok" for r in read_results(tmp_path))
