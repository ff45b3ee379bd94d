"""BumbleBee's long prompts the streaming way (``BumbleBee(streaming_above_tokens=...)``): above the
threshold, Algorithm 1 over the prompt's first candidates and Algorithm 2 over the rest, with no
``n x n`` similarity matrix; at or below it, the one-shot greedy unchanged."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kvhive.methods.bumblebee_streaming as bumblebee_streaming
from kvhive.methods.bumblebee import SCORE, SUMMARY, BumbleBee
from kvhive.methods.submodular import StreamingSummary

from helpers import scoring_inputs


def _inputs(tokens: int, seed: int = 0, heads: int = 2, dim: int = 8):
    """A layer's prefill inputs with the prompt's accumulated attention already stored (as the
    attention's column sums are in a real prefill: the selection does not form the weights)."""
    generator = torch.Generator().manual_seed(seed)
    queries = torch.randn(1, 2 * heads, tokens, dim, generator=generator)
    keys = torch.randn(1, heads, tokens, dim, generator=generator)
    inputs = scoring_inputs(queries, keys, keys.clone())
    inputs.token_scores[SCORE] = inputs.to_kv_heads(inputs.accumulated_attention()).float()
    return inputs


class _LargestOutput(TorchDispatchMode):
    """The most elements any operation's output held (the largest tensor the selection built)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(value, torch.Tensor):
                self.largest = max(self.largest, value.numel())
        return out


def test_the_default_threshold_is_stated_and_checked():
    assert BumbleBee().config.streaming_above_tokens == 8192
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="streaming_above_tokens"):
            BumbleBee(streaming_above_tokens=bad)
    BumbleBee(streaming_above_tokens=None)  # never streams


@pytest.mark.parametrize("greedy", ["stochastic", "plain"])
def test_at_or_below_the_threshold_the_one_shot_result_is_unchanged(greedy):
    tokens, budget = 120, 30  # 105 candidates (local window of 15)
    one_shot = BumbleBee(greedy=greedy, streaming_above_tokens=None)
    expected_state: dict = {}
    expected = one_shot.select_prefill(_inputs(tokens), budget, expected_state)
    for threshold in (105, 106, 8192):
        state: dict = {}
        kept = BumbleBee(greedy=greedy, streaming_above_tokens=threshold).select_prefill(_inputs(tokens), budget, state)
        assert torch.equal(kept, expected), threshold
        assert torch.equal(state[SUMMARY].positions, expected_state[SUMMARY].positions)


def test_above_the_threshold_no_matrix_of_the_whole_prompt_is_built():
    tokens, budget, threshold = 400, 40, 48  # 380 candidates: 48 by the greedy, 332 join one at a time
    rows = 2
    mode = _LargestOutput()
    state: dict = {}
    inputs, again = _inputs(tokens), _inputs(tokens)
    with mode:
        kept = BumbleBee(streaming_above_tokens=threshold).select_prefill(inputs, budget, state)
    assert kept.sum(dim=-1).eq(budget).all()
    assert kept[..., -20:].all()  # the local window
    # The largest tensor is the first chunk's similarity matrix (rows x 48 x 48) or the prompt's
    # keys (rows x 400 x 8), far from the one-shot's rows x 380 x 380 matrix.
    assert mode.largest <= max(rows * threshold * threshold, rows * tokens * 8) < rows * 380 * 380 // 40
    one_shot_mode = _LargestOutput()
    with one_shot_mode:
        one_shot = BumbleBee(streaming_above_tokens=None).select_prefill(again, budget, {})
    assert one_shot_mode.largest >= rows * 380 * 380  # the proxy sees the one-shot's matrix
    assert not torch.equal(kept, one_shot)  # a streamed summary holds later tokens the greedy never saw
    summary: StreamingSummary = state[SUMMARY]
    members = kept[0, :, : tokens - 20].nonzero()[:, 1].view(rows, 20)
    assert torch.equal(summary.positions, members)  # the summary holds the kept members, oldest first
    assert (members >= threshold).any()  # joiners made it in


def test_the_streamed_summary_does_not_depend_on_the_joiner_blocks(monkeypatch):
    """Joiners in blocks beside the members (every block re-gathered) are Algorithm 2 one joiner at a
    time over the whole prompt (the summary's by-rank step over the full keys, one call)."""
    tokens, budget, threshold = 300, 40, 64
    inputs = _inputs(tokens, seed=3)
    results = []
    for block in (1, 7, 256):
        monkeypatch.setattr(bumblebee_streaming, "STREAMING_JOINERS", block)
        state: dict = {}
        kept = BumbleBee(streaming_above_tokens=threshold).select_prefill(_inputs(tokens, seed=3), budget, state)
        results.append((kept, state[SUMMARY].positions.clone()))
    for kept, positions in results[1:]:
        assert torch.equal(kept, results[0][0]) and torch.equal(positions, results[0][1])
    # Reference: the first greedy's summary, then every later candidate joins in one by-rank step.
    policy = BumbleBee(streaming_above_tokens=None)
    first_state: dict = {}
    first = _inputs(threshold + 20, seed=3)  # the first 64 candidates plus a local window of 20
    first.keys, first.values = inputs.keys[:, :, : threshold + 20], inputs.values[:, :, : threshold + 20]
    first.token_scores[SCORE] = policy._accumulated(inputs)[:, :, : threshold + 20].clone()
    policy.select_prefill(first, budget, first_state)
    summary: StreamingSummary = first_state[SUMMARY]
    rows, candidates = 2, tokens - 20
    keys = inputs.keys[:, :, :candidates].reshape(rows, candidates, -1)
    weights = policy._accumulated(inputs)[:, :, :candidates].reshape(rows, candidates)
    positions = inputs.positions[:, :, :candidates].reshape(rows, candidates)
    members = summary.positions.clone()
    ranks = torch.cat([members, torch.arange(threshold, candidates).expand(rows, -1)], dim=1)
    summary.step(
        keys,
        torch.ones(rows, candidates, dtype=torch.bool),
        weights,
        positions,
        20,
        candidates - threshold,
        0.3,
        policy.concave,
        stored_of_rank=ranks,
    )
    assert torch.equal(summary.positions, results[0][1])
