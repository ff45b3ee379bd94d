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
    assert evictions >= 5


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
