"""Each report states the kvhive commit and package versions of the run and of the rendering, the
model and its size, and the number of items (issue 26)."""

from __future__ import annotations

import json

from fake_backend import FakeBackend

from kvhive.evaluation import run_eval, write_report
from kvhive.evaluation.environment import package_versions

from helpers import result_record


def test_a_run_records_its_commit_and_versions_and_the_report_states_them(tmp_path):
    run_eval(FakeBackend(), ["synthetic_recall"], ["local"], [0.5], 3, None, tmp_path, progress=False)
    config = json.loads((tmp_path / "run_config.json").read_text())
    assert config["kvhive_commit"] and config["versions"] == package_versions()
    assert {"torch", "transformers", "numpy"} <= config["versions"].keys()
    text = write_report(tmp_path)
    assert f"- run at kvhive commit {config['kvhive_commit']} with python " in text
    assert "- rendered at kvhive commit " in text and f"torch {config['versions']['torch']}" in text
    assert "- items per task: synthetic_recall 3" in text


def test_a_report_of_an_earlier_run_says_what_was_not_recorded_and_the_model_size(tmp_path):
    records = [
        result_record(m, b, f"i{i}", 1.0, model="gemma-3-270m")
        for m, b in (("full", 1.0), ("h2o", 0.2))
        for i in range(4)
    ]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text = write_report(tmp_path)
    assert "kvhive commit and package versions of the run: not recorded" in text
    assert "- model: gemma-3-270m (0.27B parameters)" in text and "- items per task: needle 4" in text


def test_the_commit_is_the_checkout_s_and_only_package_changes_make_it_dirty():
    import subprocess
    from pathlib import Path

    from kvhive.evaluation.environment import kvhive_commit

    repository = Path(__file__).resolve().parents[2]
    head = subprocess.run(
        ["git", "-C", str(repository), "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    package_changed = subprocess.run(
        ["git", "-C", str(repository), "status", "--porcelain", "--", "kvhive"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert kvhive_commit() == head + ("-dirty" if package_changed else "")
