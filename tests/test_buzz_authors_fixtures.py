"""BUZZ against the authors' code (danielfang001/buzz-llm, ``BuzzKVCacheWithAccumulation`` in
``entry_function/eval_inside_forward/cache/cache_entity_collection.py``, commit 9d952bd).

``tests/fixtures/buzz_authors_reference.json`` holds fixed inputs (per-head prefill column sums
of the attention and one attention row per decode step) and the positions the authors' class
kept after each call, produced by running their code outside this repository on those inputs
(their code is not part of kvhive). kvhive's policy, fed the same attention through its own
``observe_decode``, must keep the same positions at every step.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kvhive.methods.base import DECODE, PREFILL, ScoringInputs
from kvhive.methods.buzz import OLD, PREFILL_ROUNDS, SCORE, Buzz, layout_for_budget, small_stride

FIXTURE = Path(__file__).parent / "fixtures" / "buzz_authors_reference.json"
CASES = {case["case"]["name"]: case for case in json.loads(FIXTURE.read_text())}


def scoring(positions: torch.Tensor, scores: torch.Tensor, phase: str, last_row: torch.Tensor | None = None):
    _, h, n = positions.shape
    keys = torch.zeros(1, h, n, 2)
    return ScoringInputs(
        keys=keys,
        values=keys.clone(),
        queries=torch.zeros(1, h, 1, 2),
        positions=positions,
        mask=None,
        scaling=1.0,
        layer_index=0,
        num_layers=1,
        sequence_length=n,
        phase=phase,
        token_scores={SCORE: scores.clone()},
        last_query_weights=last_row,
    )


def policy_and_budget(case: dict) -> tuple[Buzz, int]:
    spec = case["case"]
    budget = spec["sink"] + spec["window"] + spec["threshold"]
    policy = Buzz(sink=spec["sink"], stride=spec["stride"], budget_form="peak")
    layout = layout_for_budget(budget, spec["sink"], spec["stride"], "peak")
    assert (layout.window, layout.threshold) == (spec["window"], spec["threshold"])
    return policy, budget


def prefill(policy: Buzz, budget: int, case: dict, state: dict):
    sums = torch.tensor(case["prefill_column_sums"], dtype=torch.float32)[None]
    n = sums.shape[-1]
    positions = torch.arange(n).expand(1, sums.shape[1], n)
    keep = policy.select_prefill(scoring(positions, sums, PREFILL), budget, state)
    if keep is None:
        return positions, sums
    heads = sums.shape[1]
    return positions[keep].view(1, heads, -1), sums[keep].view(1, heads, -1)


@pytest.mark.parametrize("name", ["fits", "stride3"])
def test_prefill_and_every_decode_step_keep_the_authors_positions(name):
    case = CASES[name]
    policy, budget = policy_and_budget(case)
    state: dict = {}
    positions, scores = prefill(policy, budget, case, state)
    assert positions[0].tolist() == case["kept_positions"][0]
    assert state[PREFILL_ROUNDS] == 0  # the single pass fits: exactly the authors' prefill
    assert decode_and_compare(policy, budget, case, state, positions, scores) >= 5


def decode_and_compare(policy: Buzz, budget: int, case: dict, state: dict, positions, scores) -> int:
    """Feed the case's decode attention rows as the cache does (a decision asked for whenever the
    layer holds more than ``budget``) and compare the kept positions with the authors' at every
    step; returns the number of evictions."""
    heads = positions.shape[1]
    evictions = 0
    for step, row in enumerate(case["decode_attention_rows"]):
        new = torch.full((1, heads, 1), case["case"]["prompt"] + step)
        positions = torch.cat([positions, new], dim=-1)
        scores = torch.cat([scores, torch.zeros(1, heads, 1)], dim=-1)
        inputs = scoring(positions, scores, DECODE, torch.tensor(row, dtype=torch.float32)[None])
        policy.observe_decode(inputs, state)
        scores = inputs.token_scores[SCORE]
        if positions.shape[-1] > budget:
            keep = policy.select_decode(inputs, budget, state)
            if keep is not None:
                evictions += 1
                positions = positions[keep].view(1, heads, -1)
                scores = inputs.token_scores[SCORE][keep].view(1, heads, -1)
        assert positions[0].tolist() == case["kept_positions"][step + 1], f"decode step {step}"
    return evictions


def test_a_prompt_too_long_for_the_budget_is_the_authors_pass_thinned_by_remark_2():
    """The authors hold k + w + ceil(m/s) after prefill (over their own peak k + w + T); kvhive
    never holds more than its budget after an eviction, so it interval-samples the authors'
    samples again with ŝ (Remark 2) until they fit."""
    case = CASES["long_prompt"]
    spec = case["case"]
    policy, budget = policy_and_budget(case)
    theirs = case["kept_positions"][0]
    sink, window = spec["sink"], spec["window"]
    their_samples = [row[sink : len(row) - window] for row in theirs]
    assert len(theirs[0]) == sink + window + math.ceil((spec["prompt"] - sink - window) / spec["stride"])
    assert len(theirs[0]) > budget
    state: dict = {}
    positions, _ = prefill(policy, budget, case, state)
    step = small_stride(spec["stride"]) ** state[PREFILL_ROUNDS]
    assert state[PREFILL_ROUNDS] >= 1 and positions.shape[-1] <= budget
    for head, samples in enumerate(their_samples):
        expected = theirs[head][:sink] + samples[::step] + theirs[head][-window:]
        assert positions[0, head].tolist() == expected
    assert state[OLD] == len(their_samples[0][::step])


# ----------------------------------------------------------------------------------------------
# Mean-form layouts (issue 26). The authors' class takes (k, w, s, T) as arguments and has no
# budget; tests/fixtures/buzz_authors_mean_form.json gives it the (w, T) kvhive's mean_layout(C)
# chooses and records what it keeps (crosscheck/buzz_authors_mean_form.py). In the mean form C is
# below the peak k + w + T, so the cache asks for a decision at every step past C and BUZZ evicts
# only past T; and Remark 2's two readings (prefill_fit) differ where the single pass falls
# between C and the peak.
# ----------------------------------------------------------------------------------------------

MEAN_FIXTURE = Path(__file__).parent / "fixtures" / "buzz_authors_mean_form.json"
MEAN_CASES = {case["case"]["name"]: case for case in json.loads(MEAN_FIXTURE.read_text())}


def mean_policy(case: dict, prefill_fit: str) -> tuple[Buzz, int]:
    spec = case["case"]
    policy = Buzz(sink=spec["sink"], stride=spec["stride"], budget_form="mean", prefill_fit=prefill_fit)
    layout = policy.layout(spec["budget"])
    assert (layout.window, layout.threshold) == (spec["window"], spec["threshold"])
    assert layout.peak > spec["budget"]
    return policy, spec["budget"]


def their_samples(case: dict) -> list[list[int]]:
    spec = case["case"]
    return [row[spec["sink"] : len(row) - spec["window"]] for row in case["kept_positions"][0]]


@pytest.mark.parametrize("prefill_fit", ["budget", "peak"])
@pytest.mark.parametrize("name", ["mean_fits", "mean_fits_stride3"])
def test_mean_form_keeps_the_authors_positions_at_every_step(name, prefill_fit):
    """A prompt whose single pass fits the budget: both readings keep the authors' pass, and the
    mean-form schedule (asked at every step past C, evicting past T) keeps their positions."""
    case = MEAN_CASES[name]
    policy, budget = mean_policy(case, prefill_fit)
    state: dict = {}
    positions, scores = prefill(policy, budget, case, state)
    assert positions[0].tolist() == case["kept_positions"][0]
    assert state[PREFILL_ROUNDS] == 0 and positions.shape[-1] <= budget
    assert decode_and_compare(policy, budget, case, state, positions, scores) >= 5


def test_mean_form_literal_remark_2_is_the_authors_prefill_and_decode_between_the_budget_and_the_peak():
    """The single pass (28 samples) lies between C - k - w = 20 and T = 31: prefill_fit="peak"
    keeps it as the authors do (38 tokens, over C = 30, within the peak 41) and then keeps their
    positions at every decode step."""
    case = MEAN_CASES["mean_between"]
    policy, budget = mean_policy(case, "peak")
    state: dict = {}
    positions, scores = prefill(policy, budget, case, state)
    assert positions[0].tolist() == case["kept_positions"][0]
    assert state[PREFILL_ROUNDS] == 0 and budget < positions.shape[-1] <= policy.layout(budget).peak
    assert decode_and_compare(policy, budget, case, state, positions, scores) >= 5


@pytest.mark.parametrize(
    "name,prefill_fit,rounds",
    # mean_between: 28 samples; C - k - w = 20, T = 31. mean_beyond: 78 samples.
    [("mean_between", "budget", 1), ("mean_beyond", "budget", 2), ("mean_beyond", "peak", 1)],
)
def test_mean_form_prefill_is_the_authors_pass_thinned_by_remark_2(name, prefill_fit, rounds):
    """Where the authors' single pass does not fit the reading's target (C for "budget", the peak
    k + w + T for "peak"), kvhive keeps every ŝ**r-th of their samples, with the fewest rounds r
    that fit."""
    case = MEAN_CASES[name]
    spec = case["case"]
    policy, budget = mean_policy(case, prefill_fit)
    theirs = case["kept_positions"][0]
    state: dict = {}
    positions, _ = prefill(policy, budget, case, state)
    assert state[PREFILL_ROUNDS] == rounds
    step = small_stride(spec["stride"]) ** rounds
    sink, window = spec["sink"], spec["window"]
    for head, samples in enumerate(their_samples(case)):
        assert positions[0, head].tolist() == theirs[head][:sink] + samples[::step] + theirs[head][-window:]
    limit = policy.prefill_limit(budget)
    assert limit == (budget if prefill_fit == "budget" else policy.layout(budget).peak)
    assert positions.shape[-1] <= limit
    # The fewest rounds: one round fewer would not fit.
    fewer = their_samples(case)[0][:: step // small_stride(spec["stride"])]
    assert sink + len(fewer) + window > limit
