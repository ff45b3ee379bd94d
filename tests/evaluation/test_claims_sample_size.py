"""Each claim states how many items the paper's reported gap would need here (issue 12 item 3:
"enough items that a real difference of the size the paper reports would exceed two paired
standard errors — estimate that n from the first items and state it")."""

from __future__ import annotations

import math

import pytest

from kvhive.evaluation.claims import (
    CLAIMS,
    NOISE_STANDARD_ERRORS,
    items_to_detect,
    outperforms,
    relative_gap,
)
from kvhive.evaluation.results import ResultsSummary

from helpers import result_record as _record


def test_relative_gap_reads_the_direction_of_the_metric():
    assert relative_gap(12.3, 11.6) == pytest.approx(0.7 / 11.6)
    assert relative_gap(9.394, 9.987, higher_is_better=False) == pytest.approx((9.987 - 9.394) / 9.987)
    with pytest.raises(ValueError, match="baseline"):
        relative_gap(1.0, 0.0)


def test_items_to_detect_makes_the_gap_exceed_the_noise_threshold():
    for gap, deviation in [(0.05, 0.4), (0.3, 0.5), (1.0, 10.0), (0.01, 0.5)]:
        n = items_to_detect(gap, deviation)
        assert gap > NOISE_STANDARD_ERRORS * deviation / math.sqrt(n) - 1e-12
        if n > 2:  # one item fewer would not do
            assert gap <= NOISE_STANDARD_ERRORS * deviation / math.sqrt(n - 1)
    assert items_to_detect(0.0, 1.0) is None


def test_verdict_text_states_the_items_the_papers_gap_needs():
    # Per-item differences +1, 0, 0, 0 (sd 0.5); snapkv scores 0.5, a 10% gap is 0.05 -> n = (2*0.5/0.05)^2 = 400.
    records = [_record("full", 1.0, f"i{i}", 1.0) for i in range(4)]
    records += [_record("snapkv", 64, f"i{i}", float(i % 2)) for i in range(4)]
    records += [_record("ahakv", 64, f"i{i}", float(i % 2 or i == 0)) for i in range(4)]
    check = outperforms("needle", "ahakv", ["snapkv"], (64,), paper_gaps={"snapkv": 0.1})
    verdict = check(ResultsSummary(records))
    holds, text = verdict
    assert holds is None
    # the per-item spread is the bootstrap standard error times sqrt(n) (0.5 * sqrt(3/4) here: the
    # bootstrap's plug-in variance), so n = (2 * 0.433 / 0.05)^2 = 300
    (comparison,) = verdict.evidence
    assert comparison.standard_error == pytest.approx(0.25 * math.sqrt(3 / 4), rel=0.05)
    needed = items_to_detect(0.05, comparison.standard_error * 2)
    assert 270 < needed < 330
    assert "vs snapkv +0.25 [+0, +0.75]" in text and f"(paper's gap 10.0% = 0.05 needs n≈{needed})" in text


def test_paper_gaps_must_name_compared_baselines():
    with pytest.raises(ValueError, match="paper_gaps"):
        outperforms("needle", "ahakv", ["snapkv"], (64,), paper_gaps={"h2o": 0.1})
    with pytest.raises(ValueError, match="paper_gaps"):
        outperforms("needle", "ahakv", ["snapkv"], (64,), paper_gaps={"snapkv": -0.1})


def test_every_comparison_claim_whose_paper_gives_numbers_states_its_gap():
    # The one comparison without numbers in its paper (AhaKV's Figure 4) and the retains-full claim are the exceptions.
    without = {claim.id for claim in CLAIMS if "paper's gap" not in _verdict_on_fake_data(claim)}
    assert without == {"ahakv-openbookqa-4pct", "buzz-xsum-99pct"}


def _verdict_on_fake_data(claim):
    """The claim's measured text on fake records where the candidate is ahead on one item of three."""
    records = []
    for method in ("full", *claim.methods):
        for budget in claim.budgets:
            for item in range(3):
                value = 0.5 + 0.1 * item + (0.2 if method == claim.methods[0] and item == 0 else 0.0)
                budget_run = 1.0 if method == "full" else budget
                record = _record(
                    method, budget_run, f"i{item}", value, task=claim.task, metric=claim.metric or "m", chance=-1.0
                )
                if claim.metric == "rouge_mean":  # a corpus statistic: its per-item components
                    record["metrics"] = {"rouge1": value, "rouge2": value, "rougeL": value}
                records.append(record)
    return claim.check(ResultsSummary(records))[1]
