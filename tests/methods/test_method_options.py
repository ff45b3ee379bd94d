"""Method options in ``kvhive eval --methods`` (``buzz:budget_form=peak``): parsed and validated by the
method's config before anything runs, one canonical name per setting in the results, and the option
really reaches the method (issue 10: the BUZZ budget forms and AhaKV gain readings side by side)."""

from __future__ import annotations

import pytest

from kvhive.cli import main as kvhive_main
from kvhive.evaluation import read_results
from kvhive.evaluation.cli import default_data_dir
from kvhive.methods.registry import canonical_method_spec, make_policy_from_spec, method_spec, parse_method_spec

DATA_DIR = default_data_dir()


def test_parse_reads_numbers_and_booleans_as_json_and_the_rest_as_text():
    assert parse_method_spec("buzz") == ("buzz", {})
    assert parse_method_spec(" buzz:budget_form=peak:stride=4 ") == ("buzz", {"budget_form": "peak", "stride": 4})
    assert parse_method_spec("snapkv:window=8:pooling=max")[1] == {"window": 8, "pooling": "max"}


def test_canonical_spelling_sorts_options():
    assert canonical_method_spec("buzz:stride=4:budget_form=peak") == "buzz:budget_form=peak:stride=4"
    assert canonical_method_spec("buzz:budget_form=peak:stride=4") == "buzz:budget_form=peak:stride=4"
    assert method_spec("h2o", {}) == "h2o"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("buzz:budget_form", "not NAME=VALUE"),
        ("buzz:=peak", "not NAME=VALUE"),
        ("buzz:budget_form=peak:budget_form=mean", "given twice"),
        ("buzz:no_such_option=1", "no_such_option"),
        ("buzz:budget_form=median", "budget_form"),
        ("nosuchmethod:x=1", "unknown method"),
        ("", "invalid method"),
    ],
)
def test_bad_specs_name_the_option(spec, message):
    with pytest.raises(ValueError, match=message):
        make_policy_from_spec(spec)


def test_option_reaches_the_method():
    assert make_policy_from_spec("buzz:budget_form=peak").config.budget_form == "peak"
    assert make_policy_from_spec("buzz").config.budget_form == "mean"


def _eval(out, methods):
    return kvhive_main(
        [
            "eval",
            "--model",
            "tiny-llama-gqa",
            "--tasks",
            "ppl:num_tokens=96:window=96",
            "--methods",
            methods,
            "--budgets",
            "24",
            "--limit",
            "1",
            "--data-dir",
            str(DATA_DIR),
            "--out",
            str(out),
            "--no-progress",
            "--no-report",
        ]
    )


def test_eval_runs_a_method_with_options_under_its_canonical_name_and_resumes(tmp_path, capsys):
    out = tmp_path / "run"
    assert _eval(out, "buzz,buzz:stride=3:budget_form=peak") == 0
    records = {r["method"]: r for r in read_results(out)}
    assert set(records) == {"full", "buzz", "buzz:budget_form=peak:stride=3"}
    mean_form, peak_form = records["buzz"], records["buzz:budget_form=peak:stride=3"]
    assert mean_form["status"] == peak_form["status"] == "ok"
    # The peak form holds fewer tokens on average at the same nominal budget, so it scores differently.
    assert peak_form["cache"]["mean_kept_per_head"] < mean_form["cache"]["mean_kept_per_head"]
    assert peak_form["metrics"] != mean_form["metrics"]
    capsys.readouterr()
    # The same options typed in another order are the same setting: nothing new to run.
    assert _eval(out, "buzz:budget_form=peak:stride=3") == 0
    assert "0 new results" in capsys.readouterr().out
    assert len(read_results(out)) == 3


def test_eval_refuses_a_bad_option_before_running(tmp_path, capsys):
    out = tmp_path / "run"
    assert _eval(out, "buzz:budget_form=median") != 0
    assert "budget_form" in capsys.readouterr().err
    assert not (out / "results.jsonl").exists()
