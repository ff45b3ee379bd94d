"""BUZZ's decision over a fixed decode capacity (``Buzz._evict_in_capacity``, the device path a
compiled or captured step takes) against its host reference (``Buzz._evict``, Algorithm 1 with
Remark 2's rounds planned by ``eviction_plan``) on the same stored tokens, counters and scores,
wherever the layer's state may stand: any stored length, padding and old-sample count, including
the states where Remark 2 thins the samples again (which a steady decode rarely reaches)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhive.methods.base import DECODE
from kvhive.methods.buzz import (
    EVICTIONS,
    LAYOUT,
    OLD,
    PADDING,
    SCORE,
    SIZE_LAST,
    SIZE_SUM,
    Buzz,
    BuzzConfig,
    eviction_plan,
    minimum_buzz_budget,
    small_stride,
)


@st.composite
def layer_states(draw):
    stride = draw(st.integers(3, 7))
    sink = draw(st.integers(0, 4))
    form = draw(st.sampled_from(["mean", "peak"]))
    budget = draw(st.integers(minimum_buzz_budget(sink, stride, form), 90))
    policy = Buzz(BuzzConfig(sink=sink, stride=stride, budget_form=form))
    layout = policy.layout(budget)
    padding = draw(st.integers(0, 3))
    room = budget - layout.sink - layout.window
    old = draw(st.integers(0, room))
    # Any stored length past the budget, up to well past the peak (many samples: Remark 2's rounds).
    stored = draw(st.integers(budget + 1, 3 * layout.peak + padding + 8))
    capacity = stored + draw(st.integers(0, 6))
    heads = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**16))
    ties = draw(st.booleans())
    return policy, budget, padding, old, stored, capacity, heads, seed, ties


@settings(max_examples=300, deadline=None)
@given(layer_states())
def test_capacity_decision_keeps_what_the_host_plan_keeps(case):
    policy, budget, padding, old, stored, capacity, heads, seed, ties = case
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(2, heads, capacity, generator=generator)
    if ties:  # few distinct values: the first maximiser of a segment must win, as on the host
        scores = (scores * 3).floor()
    layout = policy.layout(budget)

    host_state = {LAYOUT: layout, PADDING: padding, OLD: old, EVICTIONS: 0}
    host = SimpleNamespace(num_tokens=stored, phase=DECODE, token_scores={SCORE: scores[..., :stored]})
    expected = policy._evict(host, budget, host_state)
    plan = eviction_plan(layout, stored, padding, old, budget)

    counter = lambda value: torch.tensor(value, dtype=torch.int64)  # noqa: E731
    state = {
        LAYOUT: layout,
        PADDING: counter(padding),
        OLD: counter(old),
        EVICTIONS: counter(0),
        SIZE_SUM: counter(1000),
        SIZE_LAST: counter(stored),
    }
    device = SimpleNamespace(filled=counter(stored), num_tokens=capacity, token_scores={SCORE: scores})
    keep = policy._evict_in_capacity(device, budget, state)

    assert keep.shape == scores.shape and keep.dtype == torch.bool
    assert not keep[..., stored:].any(), "an empty slot is kept"
    if expected is None:  # below the threshold: every stored token stays, no counter moves
        assert plan is None
        assert keep[..., :stored].all()
        assert (int(state[OLD]), int(state[PADDING]), int(state[EVICTIONS])) == (old, padding, 0)
        assert (int(state[SIZE_SUM]), int(state[SIZE_LAST])) == (1000, stored)
        return
    assert torch.equal(keep[..., :stored], expected.expand_as(keep[..., :stored]))
    assert int(state[OLD]) == plan.samples == host_state[OLD]
    assert (int(state[PADDING]), int(state[EVICTIONS])) == (0, 1)
    assert int(state[SIZE_LAST]) == plan.kept == int(keep[0, 0].sum())
    assert int(state[SIZE_SUM]) == 1000 - (stored - plan.kept)


def test_the_states_above_reach_remark_2_rounds_in_decode():
    """The property above covers thinning: a stored length far past the peak with many old samples
    takes at least one extra round (so a wrong round count would fail it)."""
    policy = Buzz(BuzzConfig(sink=4, stride=5))
    budget = 60
    layout = policy.layout(budget)
    room = budget - layout.sink - layout.window
    plan = eviction_plan(layout, 3 * layout.peak, 0, room, budget)
    assert plan is not None and plan.rounds >= 1 and plan.thinning == small_stride(5) ** plan.rounds
