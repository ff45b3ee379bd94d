"""Report and claims compare settings on the items they share, and say n (issue 9 items 3, 12).

A run with ``--limit 8`` followed by another method at ``--limit 2`` leaves settings with
different items; a ratio or a verdict over unequal item sets compares item difficulty, not
methods. A NaN on one item must not blank a cell silently either.
"""

from __future__ import annotations

import json

import pytest

from kvhive.evaluation import write_report
from kvhive.evaluation.claims import outperforms, retains_full
from kvhive.evaluation.results import ResultsSummary

from helpers import result_record
from helpers import result_record as _record


def _write(tmp_path, records):
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_ratio_to_full_is_paired_and_states_n(tmp_path):
    # full on 8 items (easy i0, i1 right; the rest wrong), h2o later on the first 2 only
    records = [_record("full", 1.0, f"i{i}", float(i < 2)) for i in range(8)]
    records += [_record("h2o", 0.2, "i0", 1.0), _record("h2o", 0.2, "i1", 0.0)]
    _write(tmp_path, records)
    text = write_report(tmp_path)
    # unpaired: 0.5 / 0.25 = 2.00x; on the two shared items full scores 1.0, so 0.50x
    assert "| h2o | 0.2 | 0.500 ± 0.500 | 2 | 0.50× | 2 |" in text
    assert "| full | (all) | 0.250 ± 0.164 | 8 | 1.00× | 8 |" in text
    assert "n paired with full" in text and "computed on the items both ran" in text


def test_claim_verdict_uses_items_every_setting_ran():
    # snapkv on 24 items (the first 12 right); h2o only on the first 12, of which it misses 4.
    # Means over unequal items: h2o 0.667 > snapkv 0.5 ("holds"); on the shared 12: 0.667 < 1.0.
    records = [_record("full", 1.0, f"i{i}", 1.0) for i in range(24)]
    records += [_record("snapkv", 64, f"i{i}", float(i < 12)) for i in range(24)]
    records += [_record("h2o", 64, f"i{i}", float(i < 8)) for i in range(12)]
    holds, text = outperforms("needle", "h2o", ["snapkv"], (64,))(ResultsSummary(records))
    assert holds is False
    assert "h2o 0.6667, snapkv 1" in text
    assert (
        "n=12 items, the same in every compared setting; 12 item(s) not run in every compared setting left out" in text
    )


def test_claim_with_no_shared_item_is_not_judged():
    records = [_record("full", 1.0, f"i{i}", 1.0) for i in range(4)]
    records += [
        _record("snapkv", 64, "i0", 1.0),
        _record("snapkv", 64, "i1", 1.0),
        _record("h2o", 64, "i2", 0.0),
        _record("h2o", 64, "i3", 0.0),
    ]
    holds, text = outperforms("needle", "snapkv", ["h2o"], (64,))(ResultsSummary(records))
    assert holds is None and "no item was run in every compared setting" in text


def test_retains_full_is_paired():
    records = [_record("full", 1.0, f"i{i}", float(i < 2)) for i in range(8)]
    records += [_record("buzz", 0.4, "i0", 1.0), _record("buzz", 0.4, "i1", 0.9)]
    holds, text = retains_full("needle", "buzz", 0.4, 0.99)(ResultsSummary(records))
    # 0.95 of the full cache's 1.0 on the same two items (not of its 0.25 over 8); two items give
    # a ratio interval [0.9, 1] that includes 0.99: no verdict
    assert holds is None
    assert "= 0.95 of full (1)" in text and "n=2 items run by both; 6 item(s)" in text
    assert "buzz ÷ full 0.95 [0.9, 1]" in text and "includes 0.99" in text


def test_a_non_finite_item_is_named_not_silently_blanked(tmp_path):
    records = [_record("full", 1.0, f"i{i}", 1.0) for i in range(4)]
    records += [_record("snapkv", 0.2, f"i{i}", float("nan") if i == 2 else 1.0) for i in range(4)]
    _write(tmp_path, records)
    text = write_report(tmp_path)
    assert "| snapkv | 0.2 | – (1 of 4 items non-finite) | 4 |" in text
    assert "**Warning:** snapkv @ 0.2: `m` is NaN or infinite on 1 of 4 item(s) (i2)" in text


def test_rouge_mean_is_said_to_be_a_geometric_mean(tmp_path):
    records = [
        {
            **_record(method, budget, f"i{i}", 0.0, task="xsum"),
            "main_metric": "rougeL",
            "metrics": {"rougeL": 0.3, "rouge1": 0.4, "rouge2": 0.0},
        }
        for method, budget in (("full", 1.0), ("h2o", 0.2))
        for i in range(2)
    ]
    _write(tmp_path, records)
    text = write_report(tmp_path)
    assert "`rouge_mean` is the geometric mean" in text and "0 whenever ROUGE-2 is 0" in text
    assert "| h2o | 0.2 | 0.300 ± 0.000 | 0.400 ± 0.000 | 0.000 ± 0.000 | 0.000 | 2 |" in text


def _write_run(folder, records):
    folder.mkdir()
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_claims_across_runs_give_each_run_its_own_verdict(tmp_path):
    """``kvhive report A --compare B``: the same claim judged on each run, side by side."""
    from kvhive.evaluation.cli import main
    from kvhive.evaluation.report import claims_comparison

    methods = ("ahakv", "snapkv", "h2o", "tova", "streamingllm")

    def run(ahakv_wins: bool, model: str, dtype: str):
        records = []
        for item in range(12):
            records.append(result_record("full", 1.0, f"i{item}", 1.0, model=model, dtype=dtype))
            for budget in (128, 256):
                for method in methods:
                    if method == "ahakv":
                        value = 1.0 if ahakv_wins else 0.0
                    else:
                        value = 0.0 if ahakv_wins else 1.0
                    records.append(result_record(method, budget, f"i{item}", value, model=model, dtype=dtype))
        return records

    _write_run(tmp_path / "a", run(True, "model-a", "bfloat16"))
    _write_run(tmp_path / "b", run(False, "model-b", "float32"))
    text = claims_comparison([tmp_path / "a", tmp_path / "b"])
    header = next(line for line in text.splitlines() if line.startswith("| claim |"))
    assert header.endswith("| model-a (bfloat16) | model-b (float32) |")
    row = next(line for line in text.splitlines() if line.startswith("| ahakv-needle |"))
    cells = [cell.strip() for cell in row.strip("|").split(" | ")]
    assert cells[3].startswith("**holds**") and cells[4].startswith("**does not hold**")
    assert "n=12" in cells[3] and "n=12" in cells[4]
    with pytest.raises(ValueError, match="at least 2 runs"):
        claims_comparison([tmp_path / "a"])
    main(["report", str(tmp_path / "a"), "--compare", str(tmp_path / "b")])
    assert "## Paper claims across runs" in (tmp_path / "a" / "report.md").read_text()
    with pytest.raises(SystemExit, match="--compare .*missing: no results.jsonl"):
        main(["report", str(tmp_path / "a"), "--compare", str(tmp_path / "missing")])
