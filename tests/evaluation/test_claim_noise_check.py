"""Every verdict has a noise check (issue 26): a paired bootstrap over items for every statistic
(corpus statistics included), Holm's correction over the comparisons a claim rests on, and no
verdict that does not follow from corrected intervals."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvhive.evaluation.claims import (
    CLAIMS,
    Claim,
    Verdict,
    evaluate_claims,
    model_size_note,
    outperforms,
    retains_full,
)
from kvhive.evaluation.results import ResultsSummary, read_results
from kvhive.evaluation.statistics import (
    Bootstrap,
    CorrectedComparison,
    holm_corrected,
    paired_bootstrap,
    statistic_of,
)

from helpers import result_record


def test_a_verdict_without_intervals_is_refused():
    for holds in (True, False):
        with pytest.raises(ValueError, match="needs the corrected intervals"):
            Verdict(holds, "buzz 0.5 vs h2o 0.4")
    assert Verdict(None, "not decided")[0] is None  # "not decided" needs nothing


def test_a_verdict_must_follow_from_its_intervals():
    undecided = CorrectedComparison("vs h2o", 0.1, 0.05, -0.01, 0.2, 0.95, 0.0, False, 40, 1)
    decided = CorrectedComparison("vs h2o", 0.1, 0.02, 0.05, 0.15, 0.95, 0.0, True, 40, 1)
    with pytest.raises(ValueError, match="does not follow"):
        Verdict(True, "x", [undecided], [True])
    with pytest.raises(ValueError, match="does not follow"):
        Verdict(False, "x", [decided], [True])
    assert Verdict(True, "x", [decided], [True])[0] is True
    assert Verdict(False, "x", [decided], [False]).evidence == (decided,)


def test_evaluate_claims_refuses_a_check_that_declares_a_verdict_from_point_estimates():
    point_estimate = Claim(
        id="x",
        paper="BUZZ",
        paper_says="x",
        task="needle",
        methods=("buzz",),
        budgets=(64,),
        check=lambda s: (True, "0.5 > 0.4"),
    )
    with pytest.raises(ValueError, match="needs the corrected intervals"):
        evaluate_claims(ResultsSummary([]), [point_estimate])
    undecided = Claim(
        id="y",
        paper="BUZZ",
        paper_says="x",
        task="needle",
        methods=("buzz",),
        budgets=(64,),
        check=lambda s: (None, "n=1"),
    )
    assert evaluate_claims(ResultsSummary([]), [undecided]) == [(None, "n=1")]


def _normal_bootstrap(mean: float) -> Bootstrap:
    noise = np.random.default_rng(1).standard_normal(5000)
    return Bootstrap(mean, mean + noise, 40)


def test_holm_decides_less_than_uncorrected_intervals_would():
    # p-values about 0.003, 0.028 and 0.036: each 95% interval alone excludes 0, but Holm's
    # step-down (levels 0.05/3, 0.05/2, 0.05) decides only the first, and stops there.
    family = [("vs a", _normal_bootstrap(2.2)), ("vs b", _normal_bootstrap(3.0)), ("vs c", _normal_bootstrap(2.1))]
    for _, boot in family:
        low, high = np.quantile(boot.resampled, [0.025, 0.975])
        assert low > 0  # uncorrected: all three would be decided
    corrected = holm_corrected(family)
    assert [c.decided for c in corrected] == [False, True, False]
    assert [round(c.level, 4) for c in corrected] == [0.975, round(1 - 0.05 / 3, 4), 0.95]
    assert all(c.family_size == 3 for c in corrected)
    assert corrected[2].low > 0  # its interval alone excludes 0, but the step-down stopped before it


def _perplexity_records(method, budget, nlls, tokens):
    return [
        {
            **result_record(method, budget, f"i{i}", 0.0, task="ppl"),
            "kind": "perplexity",
            "main_metric": "ppl",
            "higher_is_better": False,
            "chance": 1e6,
            "metrics": {"ppl": math.exp(nll / n), "nll_sum": nll, "n_tokens": n},
        }
        for i, (nll, n) in enumerate(zip(nlls, tokens, strict=True))
    ]


def test_perplexity_is_compared_as_the_corpus_statistic_with_a_paired_interval():
    # Per-item perplexities favour buzz on most items, but the corpus perplexity (total NLL over
    # total tokens) favours h2o: the long item decides. The verdict follows the corpus statistic.
    tokens = [10] * 11 + [400]
    h2o_nll = [30.0] * 11 + [800.0]
    buzz_nll = [29.0] * 11 + [900.0]
    records = _perplexity_records("full", 1.0, [20.0] * 11 + [700.0], tokens)
    records += _perplexity_records("h2o", 50, h2o_nll, tokens) + _perplexity_records("buzz", 50, buzz_nll, tokens)
    summary = ResultsSummary(records)
    verdict = outperforms("ppl", "buzz", ["h2o"], (50,))(summary)
    corpus = math.exp(sum(buzz_nll) / sum(tokens)) - math.exp(sum(h2o_nll) / sum(tokens))
    (comparison,) = verdict.evidence
    assert comparison.estimate == pytest.approx(corpus) and corpus > 0  # buzz's corpus perplexity is higher
    assert comparison.low < comparison.estimate < comparison.high and comparison.standard_error > 0
    assert verdict[0] in (False, None)  # never "holds" from the per-item majority


def test_the_pairing_sees_a_consistent_small_gain_under_a_large_item_spread():
    # Items range from 0.1 to 0.9; buzz is 0.02 above h2o on every item. Unpaired, the spread
    # (sd 0.26 over 12 items) would hide 0.02; paired, every resample shows the same +0.02.
    records = []
    for i in range(12):
        base = 0.1 + 0.8 * i / 11
        records += [
            {**result_record(m, 0.1, f"i{i}", 0.0, task="xsum"), "metrics": {"rouge1": v, "rouge2": v, "rougeL": v}}
            for m, v in (("full", base + 0.05), ("h2o", base), ("buzz", base + 0.02))
        ]
    verdict = outperforms("xsum", "buzz", ["h2o"], (0.1,), metric="rouge_mean")(ResultsSummary(records))
    assert verdict[0] is True
    (comparison,) = verdict.evidence
    assert comparison.estimate == pytest.approx(0.02) and comparison.low == pytest.approx(0.02)
    assert "vs h2o +0.02 [+0.02, +0.02]" in verdict[1]


def test_rouge_mean_is_bootstrapped_as_the_geometric_mean_of_resampled_means():
    statistic = statistic_of("generate", "rouge_mean")
    rng = np.random.default_rng(0)
    candidate = rng.uniform(0, 0.5, size=(1, 30, 3))
    candidate[0, :20, 1] = 0.0  # most items have ROUGE-2 = 0, as on XSUM: the per-item geometric mean would be 0
    baseline = rng.uniform(0, 0.5, size=(1, 30, 3))
    boot = paired_bootstrap(candidate, baseline, statistic)

    def geometric(x):
        return float(np.cbrt(np.prod(x[0].mean(axis=0))))

    assert boot.estimate == pytest.approx(geometric(candidate) - geometric(baseline))
    # the same draw of items for both sides: resample 0 recomputed by hand
    weights = np.random.default_rng(0).multinomial(30, np.full(30, 1 / 30), size=5000)[0] / 30
    by_hand = np.cbrt(np.prod(weights @ candidate[0])) - np.cbrt(np.prod(weights @ baseline[0]))
    assert boot.resampled[0] == pytest.approx(by_hand)


def test_the_bootstrap_is_deterministic():
    records = [result_record("full", 1.0, f"i{i}", 1.0) for i in range(20)]
    records += [result_record("snapkv", 64, f"i{i}", float(i % 3 == 0)) for i in range(20)]
    records += [result_record("ahakv", 64, f"i{i}", float(i % 2 == 0)) for i in range(20)]
    check = outperforms("needle", "ahakv", ["snapkv"], (64,))
    assert check(ResultsSummary(records))[1] == check(ResultsSummary(records))[1]


def test_retains_full_decides_from_the_interval_of_the_ratio():
    def summary(values, full_values):
        records = [result_record("full", 1.0, f"i{i}", v) for i, v in enumerate(full_values)]
        return ResultsSummary(records + [result_record("buzz", 0.4, f"i{i}", v) for i, v in enumerate(values)])

    keeps = retains_full("needle", "buzz", 0.4, 0.99)
    spread = [0.2, 0.4, 0.6, 0.8] * 5
    # 0.995 of full on every item: the ratio's interval is [0.995, 0.995]
    holds = keeps(summary([0.995 * v for v in spread], spread))
    assert holds[0] is True and "buzz ÷ full 0.995 [0.995, 0.995]" in holds[1]
    # a ratio of means of 0.95 whose interval spans 0.99: not decided
    noisy = keeps(summary([v * (0.8 if i % 2 else 1.1) for i, v in enumerate(spread)], spread))
    (ratio,) = noisy.evidence
    assert noisy[0] is None and ratio.low < 0.99 < ratio.high
    assert keeps(summary([0.5 * v for v in spread], spread))[0] is False


def test_held_memory_is_shown_and_unequal_memory_is_labelled():
    records = []
    for i in range(12):
        records.append(result_record("full", 1.0, f"i{i}", 1.0))
        for method, heads, value in (("ada-snapkv", 4, float(i < 8)), ("snapkv", 1, float(i < 2))):
            entries = 64 * heads * 3
            cache = {
                "kv_entries_mean": entries,
                "kv_entries_peak": entries,
                "kv_bytes_mean": entries * 1024,
                "kv_bytes_peak": entries * 1024,
                "stored_heads": heads,
                "layers_counted": 3,
            }
            records.append(result_record(method, 64, f"i{i}", value, cache=cache))
    holds, text = outperforms("needle", "ada-snapkv", ["snapkv"], (64,))(ResultsSummary(records))
    assert holds is True
    assert "ada-snapkv 768/768 (0.75/0.75 MiB) **×4 memory** of snapkv, snapkv 192/192 (0.19/0.19 MiB)" in text


def test_a_claim_tested_on_a_much_smaller_model_says_so():
    claim = next(c for c in CLAIMS if c.id == "buzz-ppl")
    assert model_size_note(claim, ["gemma-3-270m"]).startswith("**25× smaller model than the paper's**")
    assert "paper: Llama-2-7B (6.7B)" in model_size_note(claim, ["gemma-3-270m"])
    assert "size unknown" in model_size_note(claim, ["my-model"])
    assert all(c.tested_model[1] >= 6 for c in CLAIMS)  # every claim names its paper's model


@pytest.mark.parametrize("run", ["claims_gemma", "claims_qwen"])
def test_no_committed_verdict_rests_on_a_point_estimate(run):
    from pathlib import Path

    summary = ResultsSummary(read_results(Path(__file__).resolve().parents[2] / "results" / run))
    verdicts = evaluate_claims(summary)
    decided = [v for v in verdicts if v[0] is not None]
    assert decided  # the committed runs decide some claims
    for verdict in decided:
        assert verdict.evidence and all(c.standard_error >= 0 for c in verdict.evidence)
        against = [c for c, f in zip(verdict.evidence, verdict.favourable, strict=True) if c.decided and not f]
        if verdict[0] is True:
            assert all(c.decided and (c.low > c.null or c.high < c.null) for c in verdict.evidence)
        else:
            assert against and all(c.low > c.null or c.high < c.null for c in against)
        assert "interval" in verdict[1]


def test_a_handful_of_items_decides_nothing_however_consistent():
    # 4 items, the candidate ahead on every one: the percentile interval excludes 0 but 4 items
    # have 35 distinct resamples, too few to trust it
    records = [result_record("full", 1.0, f"i{i}", 1.0) for i in range(4)]
    records += [result_record("snapkv", 64, f"i{i}", 0.2 * i) for i in range(4)]
    records += [result_record("ahakv", 64, f"i{i}", 0.2 * i + 0.3) for i in range(4)]
    verdict = outperforms("needle", "ahakv", ["snapkv"], (64,))(ResultsSummary(records))
    (comparison,) = verdict.evidence
    assert comparison.low > 0 and not comparison.decided and verdict[0] is None
    assert "n=4 < 10 items: too few to decide" in verdict[1]
