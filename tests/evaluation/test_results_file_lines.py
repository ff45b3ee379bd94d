"""Nothing lost in ``results.jsonl``: a complete last record without a trailing newline is kept (a
rerun neither drops nor recomputes it); only a last line that does not parse is dropped, and the
run and the report say which line they dropped or skipped."""

from __future__ import annotations

import json

import pytest
from fake_backend import FakeBackend

from kvhive.evaluation import read_results, run_eval, write_report
from kvhive.evaluation.cli import main as cli_main
from kvhive.evaluation.results import ResultsLineSkipped, repair_results_file, scan_results


def _run(out, **options):
    return run_eval(FakeBackend(), ["synthetic_recall"], ["local"], [0.5], 2, None, out, progress=False, **options)


def test_a_complete_last_record_without_a_newline_is_read_kept_and_not_recomputed(tmp_path):
    _run(tmp_path)
    results = tmp_path / "results.jsonl"
    raw = results.read_bytes()
    results.write_bytes(raw[:-1])  # e.g. written by another tool, or a newline lost
    assert len(read_results(tmp_path)) == 4  # the last record counts for readers
    assert repair_results_file(results) == 0  # nothing cut: the line is completed
    assert results.read_bytes() == raw
    results.write_bytes(raw[:-1])
    run = _run(tmp_path)
    assert run.written == 0 and run.skipped == 4 and run.dropped == []
    assert results.read_bytes() == raw  # the record is still there, once, and the file ends whole


def test_a_last_line_that_does_not_parse_is_dropped_and_the_run_names_it(tmp_path):
    _run(tmp_path)
    results = tmp_path / "results.jsonl"
    raw = results.read_bytes()
    last_start = raw[:-1].rfind(b"\n") + 1
    results.write_bytes(raw[: last_start + 25])  # a writer killed mid-line
    with pytest.warns(ResultsLineSkipped, match=r"results\.jsonl: line 4: .*incomplete"):
        assert len(read_results(tmp_path)) == 3
    with pytest.warns(ResultsLineSkipped, match=r"results\.jsonl: line 4: dropped 25 bytes"):
        run = _run(tmp_path)
    assert run.written == 1
    assert len(run.dropped) == 1 and "line 4" in run.dropped[0] and str(results) in run.dropped[0]
    assert [json.loads(line) for line in results.read_bytes().splitlines()]


def test_scan_names_every_skipped_line(tmp_path):
    _run(tmp_path)
    results = tmp_path / "results.jsonl"
    lines = results.read_bytes().splitlines()
    results.write_bytes(b"\n".join([lines[0], b"{not json", *lines[1:], b'{"task": "cut']))
    records, skipped = scan_results(tmp_path)
    assert len(records) == 4
    assert [line.number for line in skipped] == [2, 6]
    assert "malformed" in skipped[0].reason and "incomplete" in skipped[1].reason


def test_report_says_which_lines_it_skipped(tmp_path, capsys):
    _run(tmp_path)
    results = tmp_path / "results.jsonl"
    lines = results.read_bytes().splitlines(keepends=True)
    results.write_bytes(b"".join([lines[0], b"{not json\n", *lines[1:]]))
    with pytest.warns(ResultsLineSkipped):
        text = write_report(tmp_path)
    assert "skipped line 2 of" in text and "malformed" in text
    assert cli_main(["report", str(tmp_path)]) == 0  # said once on stderr, not as a Python warning
    assert capsys.readouterr().err.splitlines() == [f"kvhive report: {results}: line 2: malformed record: skipped"]
