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
from transformers import LlamaConfig

from kvhive import static_step
from kvhive.cache import KVHiveCache
from kvhive.methods.base import DECODE, PREFILL, ScoringInputs
from kvhive.methods.buzz import OLD, PREFILL_ROUNDS, SCORE, Buzz, layout_for_budget, small_stride

FIXTURE = Path(__file__).parents[1] / "fixtures" / "buzz_authors_reference.json"
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

MEAN_FIXTURE = Path(__file__).parents[1] / "fixtures" / "buzz_authors_mean_form.json"
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


# ----------------------------------------------------------------------------------------------
# The cache's own decode path. A real KVHiveCache holds a BUZZ layer in the fixed decode capacity
# the method declares (``Buzz.fixed_decode_capacity``: the peak, or the budget after an eviction)
# and runs every decode step through ``KVHiveCache.after_decode``: the method observes and decides
# over the whole capacity (``ScoringInputs.filled`` set: ``Buzz._evict_in_capacity``, the device
# decision a compiled step takes) and the cache compacts the kept slots in place. The cases above
# call the policy's host decision directly; here the attention the case gives (the prefill column
# sums and one row per decode step) is handed to the cache as its attention hands it over
# (``ScoringInputs.accumulated_weights`` / ``last_query_weights``), everything else is the cache's.
# ----------------------------------------------------------------------------------------------

HEAD_DIM = 4


def one_layer_cache(policy: Buzz, budget: int, heads: int) -> KVHiveCache:
    config = LlamaConfig(
        hidden_size=heads * HEAD_DIM,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=HEAD_DIM,
        vocab_size=16,
    )
    cache = KVHiveCache(config, policy, budget)
    assert cache.static_decode  # BUZZ decodes in a fixed capacity
    return cache


def cache_scoring(cache: KVHiveCache, phase: str, prefill_sums=None, row=None):
    """The ScoringInputs the cache's attention builds for layer 0 (kvhive.attention.integration):
    the prefill's dense view with the attention's column sums, or a decode step's view of the whole
    capacity (empty slots masked) with the new query's weights over its slots (0 on empty ones)."""
    store = cache.layers[0]
    if phase == PREFILL:
        keys, values, positions, token_scores = store.dense()
        filled = mask = None
    else:
        keys, values, positions, token_scores, slots = store.decode_view()
        mask = None if slots is None else slots.view(1, 1, 1, -1)
        filled = store.length_device if store.fixed_capacity else None
    heads = keys.shape[1]
    last = None
    if row is not None:
        last = torch.zeros(1, heads, keys.shape[2])
        last[..., : row.shape[-1]] = row
    return ScoringInputs(
        keys=keys,
        values=values,
        queries=torch.zeros(1, heads, 1, HEAD_DIM),
        positions=positions,
        mask=mask,
        scaling=1.0,
        layer_index=0,
        num_layers=1,
        sequence_length=store.tokens_seen,
        phase=phase,
        token_scores=dict(token_scores),
        last_query_weights=last,
        accumulated_weights=prefill_sums,
        filled=filled,
        known_filled=store.known_length,
        stored_in_order=store.stored_in_order,
    )


def stored_positions(cache: KVHiveCache) -> list[list[int]]:
    """The positions layer 0 holds, oldest first (the filled slots of its capacity)."""
    store = cache.layers[0]
    positions = store.dense()[2]
    return positions[0].tolist()


def decode_through_the_cache(policy: Buzz, budget: int, case: dict) -> int:
    """Prefill and every decode step of ``case`` through a KVHiveCache; the kept positions compared
    with the authors' after each call. Returns the number of decode evictions."""
    sums = torch.tensor(case["prefill_column_sums"], dtype=torch.float32)[None]
    heads, prompt = sums.shape[1], sums.shape[2]
    cache = one_layer_cache(policy, budget, heads)
    store = cache.layers[0]
    store.update(torch.randn(1, heads, prompt, HEAD_DIM), torch.randn(1, heads, prompt, HEAD_DIM))
    cache.after_prefill(0, lambda phase: cache_scoring(cache, phase, prefill_sums=sums))
    assert stored_positions(cache) == case["kept_positions"][0]
    assert store.bounded_capacity, "the layer decodes in the fixed capacity BUZZ declares"
    capacity = store.buffers()[0].shape[2]  # slots per row and head
    assert capacity == max(budget, policy.layout(budget).peak) + 1  # the bound plus the new token
    evictions = 0
    for step, row in enumerate(case["decode_attention_rows"]):
        before = store.dense_length + 1
        store.update(torch.randn(1, heads, 1, HEAD_DIM), torch.randn(1, heads, 1, HEAD_DIM))
        row = torch.tensor(row, dtype=torch.float32)[None]
        assert row.shape[-1] == before  # the row covers the stored tokens and the new one
        cache.after_decode(0, lambda phase, row=row: cache_scoring(cache, phase, row=row))
        assert store.buffers()[0].shape[2] == capacity, "the capacity keeps its shape"
        evictions += store.dense_length < before
        assert stored_positions(cache) == case["kept_positions"][step + 1], f"decode step {step}"
    return evictions


@pytest.mark.parametrize("recorded_step", [False, True], ids=["eager", "compiled-step-decision"])
@pytest.mark.parametrize("name", ["fits", "stride3"])
def test_the_cache_s_fixed_capacity_decode_keeps_the_authors_positions(name, recorded_step, monkeypatch):
    """Eager: the host schedule skips the steps that evict nothing and runs the device decision at
    each eviction. Compiled-step decision: the device decision at every step, as a traced or captured
    step runs it (``in_static_step``), keeping every filled slot where it evicts nothing."""
    if recorded_step:
        monkeypatch.setattr(static_step, "in_static_step", lambda: True)
    case = CASES[name]
    policy, budget = policy_and_budget(case)
    assert decode_through_the_cache(policy, budget, case) >= 5


@pytest.mark.parametrize("name", ["mean_fits", "mean_fits_stride3"])
def test_the_cache_s_fixed_capacity_decode_keeps_the_authors_positions_in_the_mean_form(name):
    """Mean form: the capacity is the peak k + w + T (above the budget C); the cache asks for a
    decision at every step past C and BUZZ evicts only past T."""
    case = MEAN_CASES[name]
    policy, budget = mean_policy(case, "budget")
    assert decode_through_the_cache(policy, budget, case) >= 5
