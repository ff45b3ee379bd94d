"""No decode decision or logit may depend on a per-token score slot nothing wrote.

The cache leaves some per-token score slots unset: a new buffer's slots past the tokens copied into
it (``kvhive.cache.layers.buffers.new_score_buffer``), and, where the method does not read a new token's scores before
writing them (``Policy.reads_newest_token_scores`` False: SubGen with a recent window), a new token's
slot and the freed slot the newest token moves into (they keep what was there). These tests fill all
of those with NaN and require every step's logits and kept positions to be those of a plain run, and
the same of a run where the cache resets and moves every score (nothing left unset).

What they caught: the cache skipped its own padding flag (``PADDING_SCORE``) with SubGen's scores,
and a static decode step's attention masks by that flag for every stored token, the newest included.
A new token's flag was then a new buffer's unset slot (uninitialised memory before 07532c3: the
first decode step's logits varied from run to run) or, after a decode eviction of a prompt's padding
token, that token's 1.0: the new token was masked as padding in every later step.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from golden_kept import snapshot

import kvhive
from kvhive.cache.layers import CapacityLayout, GrowingLayout
from kvhive.cache.layers import buffers as token_buffers
from kvhive.cache.storage import PADDING_SCORE
from kvhive.compat import cache_kwarg
from kvhive.methods.base import DECODE
from kvhive.methods.registry import method_names, policy_class
from kvhive.models import tiny_model

PADDING = 7  # left padding of the batch's second row
UNPADDED_METHODS = frozenset({"buzz", "buzz-logn"})  # they refuse rows of different real lengths


def _poison_unreset(layout, value: float, slots: torch.Tensor) -> None:
    """Write ``value`` at ``slots [B, H, n]`` of the scores the cache does not reset for a new token."""
    buffers = layout.buffers
    reset = buffers.reset_score_names(layout.store.new_token_scores_read)
    for name, buffer in buffers.scores.items():
        if name not in reset:
            buffer.scatter_(2, slots, value)


@contextlib.contextmanager
def _unset_scores_hold(monkeypatch, value: float):
    """Every score slot the cache leaves unset holds ``value``: new buffers are filled with it, and a
    new token's (and a freed slot's) entries of the scores the cache does not reset are set to it."""
    with monkeypatch.context() as patch:
        make = token_buffers.new_score_buffer
        patch.setattr(token_buffers, "new_score_buffer", lambda shape, device: make(shape, device).fill_(value))
        append, at_index, fill_hole = GrowingLayout.append, CapacityLayout.append, GrowingLayout.fill_hole

        def _append(self, key_states, value_states, positions, new_tokens):
            views = append(self, key_states, value_states, positions, new_tokens)
            if self.buffers.scores:
                end = self.start + self.length
                slots = torch.arange(end - new_tokens, end, device=self.store.device)
                _poison_unreset(self, value, slots.expand(*key_states.shape[:2], new_tokens))
            return views

        def _append_at_device_index(self, key_states, value_states, positions, new_tokens):
            slots = torch.arange(new_tokens, device=self.store.device) + self.store.length_device
            views = at_index(self, key_states, value_states, positions, new_tokens)
            if self.store.layout is self:  # (not past the capacity: the growing layout took the tokens)
                _poison_unreset(self, value, slots.expand(*key_states.shape[:2], new_tokens))
            return views

        def _fill_hole(self, hole):
            fill_hole(self, hole)
            batch, heads = self.store.batch_size, self.store.num_heads
            _poison_unreset(self, value, hole.reshape(batch, heads, 1) + self.start)

        patch.setattr(GrowingLayout, "append", _append)
        patch.setattr(CapacityLayout, "append", _append_at_device_index)
        patch.setattr(GrowingLayout, "fill_hole", _fill_hole)
        yield


def _run(method, budget, prompt_length, steps, padded, reset_all=False, **options):
    """``[(logits of the last query, kept positions)]`` after the prefill and each decode step."""
    torch.manual_seed(0)
    model = tiny_model("llama", "gqa")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = kvhive.make_cache(model, method, budget=budget, **options)
    if reset_all:  # the cache resets a new token's scores and moves them with it: none is left unset
        for store in cache.layers:
            store.new_token_scores_read = True
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, model.config.vocab_size, (2, prompt_length), generator=generator)
    mask = torch.ones_like(prompt)
    if padded:
        mask[1, :PADDING] = 0
    tokens = torch.randint(3, model.config.vocab_size, (steps, 2, 1), generator=generator)
    key = cache_kwarg(model)
    results = []
    with torch.no_grad():
        logits = model(input_ids=prompt, attention_mask=mask, **{key: cache}, use_cache=True).logits
        results.append((logits[:, -1], snapshot(cache)))
        for step in range(steps):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
            logits = model(input_ids=tokens[step], attention_mask=mask, **{key: cache}, use_cache=True).logits
            results.append((logits[:, -1], snapshot(cache)))
            for store in cache.layers:  # a decode token is never padding
                _, _, positions, scores = store.dense()
                if PADDING_SCORE in scores:
                    flags = scores[PADDING_SCORE][positions >= prompt_length]
                    assert bool((flags == 0).all()), f"a decode token is flagged as padding at step {step}"
    return results


def _assert_same(label, expected, actual):
    assert len(expected) == len(actual)
    for step, ((logits, kept), (other_logits, other_kept)) in enumerate(zip(expected, actual, strict=True)):
        assert torch.equal(logits, other_logits), f"{label}: logits differ at step {step}"
        assert kept == other_kept, f"{label}: kept positions differ at step {step}"


# SubGen (the method that leaves a new token's scores unset): windows of 0 (every score reset),
# 1, 4, 8 and its default 32; padding kept by the prefill and evicted while decoding (a prompt a few
# tokens over the budget); a prompt far over it (new buffers after the prefill); a prompt under it
# (the layer grows to the budget); a fixed decode capacity; every step a decode eviction.
SUBGEN_CASES = {
    "padding-evicted": dict(budget=16, prompt_length=20, steps=30, padded=True, recent=4),
    "padding-evicted-capacity": dict(budget=16, prompt_length=20, steps=30, padded=True, recent=4, decode_capacity=48),
    "long-prompt": dict(budget=16, prompt_length=90, steps=40, padded=True, recent=4),
    "short-prompt": dict(budget=30, prompt_length=12, steps=40, padded=True, recent=8),
    "unpadded": dict(budget=20, prompt_length=70, steps=40, padded=False, recent=8),
    "window-1": dict(budget=12, prompt_length=16, steps=30, padded=True, recent=1),
    "window-0": dict(budget=12, prompt_length=30, steps=30, padded=True, recent=0),
    "default-window": dict(budget=40, prompt_length=60, steps=24, padded=True),
}


@pytest.mark.parametrize("case", list(SUBGEN_CASES))
def test_subgen_reads_no_unset_score(case, monkeypatch):
    options = SUBGEN_CASES[case]
    plain = _run("subgen", **options)
    with _unset_scores_hold(monkeypatch, float("nan")):
        _assert_same(f"subgen {case}, unset slots NaN", plain, _run("subgen", **options))
    _assert_same(f"subgen {case}, every score reset", plain, _run("subgen", reset_all=True, **options))


@pytest.mark.parametrize("method", [m for m in method_names() if m != "subgen"])
def test_no_method_reads_an_unset_score(method, monkeypatch):
    """Every other method, padded (but BUZZ), with a decode eviction every step where it decodes."""
    policy = policy_class(method)()
    options = dict(
        budget=max(24, policy.minimum_budget()),
        prompt_length=max(24, policy.minimum_budget()) + 12,
        steps=20 if DECODE in policy.phases else 4,
        padded=method not in UNPADDED_METHODS,
    )
    plain = _run(method, **options)
    with _unset_scores_hold(monkeypatch, float("nan")):
        _assert_same(f"{method}, unset slots NaN", plain, _run(method, **options))
