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
from pathlib import Path

import pytest
from fake_backend import FakeBackend, FakeTokenizer

from kvhive.evaluation import run_eval, write_report
from kvhive.evaluation.claims import outperforms, retains_full
from kvhive.evaluation.distributed import failed_records
from kvhive.evaluation.results import TRANSIENT_STATUS, ResultsSummary, ResultsWriter, read_results, result_key
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
        from kvhive.evaluation.runner import _run_item

        written = 0
        for entry in work:
            if entry.item.id == dead_item:
                reason = "worker died (ActorDiedError) (after 3 attempts; a rerun retries it)"
                for record in failed_records(entry, fields, reason, 3):
                    writer.append(record)
                    written += 1
                continue
            written += _run_item(
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
