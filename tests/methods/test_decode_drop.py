"""A steady decode step that names its one dropped token (``Policy.select_decode_drop``, issue 23).

Where a layer holds ``budget + 1`` tokens and the newest one may move into the freed slot, a method
can name the token it drops instead of handing the cache a keep mask (which the cache counts and
searches for its one False). The two must be the same decision: these tests run every method that
names its token both ways on the same stream and compare, at every step, the kept positions, the
per-token scores and the logits; they check the named path is taken at all, and
:func:`lowest_ranked` against its definition.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from golden_kept import snapshot

import kvhive
from kvhive.compat import cache_kwarg
from kvhive.methods.base import DECODE, Policy, keep_top_scores, lowest_ranked
from kvhive.methods.registry import method_names, policy_class
from kvhive.models import tiny_model

BUDGET = 48
PROMPT = 160
STEPS = 24
DECODE_METHODS = [m for m in method_names() if DECODE in policy_class(m).phases]
# The methods whose steady step may name its dropped token (the others always hand a keep mask).
NAMING_METHODS = [m for m in DECODE_METHODS if policy_class(m).select_decode_drop is not Policy.select_decode_drop]


def _model():
    torch.manual_seed(0)
    return tiny_model("llama", "gqa")


def _cache(model, method):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return kvhive.make_cache(model, method, budget=max(BUDGET, policy_class(method)().minimum_budget()))


def _counting(cache) -> list[int]:
    """Count the steps whose dropped token the method named (wraps the instance's method)."""
    named = [0]
    original = cache.policy.select_decode_drop

    def select_decode_drop(scoring, budget, state):
        hole = original(scoring, budget, state)
        named[0] += hole is not None
        return hole

    cache.policy.select_decode_drop = select_decode_drop
    return named


def _scores(cache) -> list[dict]:
    return [{name: score.clone() for name, score in layer.dense()[3].items()} for layer in cache.layers]


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("method", NAMING_METHODS)
def test_a_named_drop_is_the_decision_of_the_keep_mask(method, padded):
    model = _model()
    key = cache_kwarg(model)
    named_cache, masked_cache = _cache(model, method), _cache(model, method)
    named = _counting(named_cache)
    masked_cache.policy.select_decode_drop = lambda scoring, budget, state: None  # the keep mask, always
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, model.config.vocab_size, (2, PROMPT), generator=generator)
    mask = torch.ones_like(prompt)
    if padded:
        mask[1, :7] = 0
    tokens = torch.randint(3, model.config.vocab_size, (STEPS, 2, 1), generator=generator)
    with torch.no_grad():
        for cache in (named_cache, masked_cache):
            model(input_ids=prompt, attention_mask=mask, **{key: cache}, use_cache=True)
        for step in range(STEPS):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
            logits = [
                model(input_ids=tokens[step], attention_mask=mask, **{key: cache}, use_cache=True).logits
                for cache in (named_cache, masked_cache)
            ]
            assert torch.equal(logits[0], logits[1]), f"{method}: logits differ at step {step}"
            assert snapshot(named_cache) == snapshot(masked_cache), f"{method}: kept positions differ at step {step}"
            for mine, theirs in zip(_scores(named_cache), _scores(masked_cache), strict=True):
                assert mine.keys() == theirs.keys()
                for name in mine:
                    assert torch.equal(mine[name], theirs[name]), f"{method}: score {name} differs at step {step}"
    if named_cache.policy.reads_stored_order:
        # The newest token cannot move into a freed slot of a method that reads the stored order
        # (VNorm's window): the cache never asks.
        assert named[0] == 0, f"{method}: asked to name a drop"
    elif not (padded and method == "subgen"):  # (SubGen names it only where every stored token is real)
        assert named[0] > 0, f"{method}: no step named its dropped token"


def test_methods_that_name_their_drop():
    assert {"tova", "h2o", "streamingllm", "ahakv", "random", "subgen", "bumblebee"} <= set(NAMING_METHODS)


def test_a_drop_of_the_wrong_shape_is_refused():
    model = _model()
    cache = _cache(model, "tova")
    cache.policy.select_decode_drop = lambda scoring, budget, state: torch.zeros(
        scoring.keys.shape[:3], dtype=torch.long
    )
    with torch.no_grad():
        token = model(input_ids=torch.randint(3, 100, (1, PROMPT)), past_key_values=cache).logits[:, -1:].argmax(-1)
        with pytest.raises(TypeError, match="select_decode_drop must give one stored index per row and head"):
            model(input_ids=token, past_key_values=cache)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("with_positions", [False, True])
def test_lowest_ranked_is_the_token_keep_top_scores_leaves_out(seed, with_positions):
    generator = torch.Generator().manual_seed(seed)
    rows, tokens = 6, 17
    scores = torch.randint(0, 4, (rows, tokens), generator=generator).float()  # many ties
    valid = torch.rand(rows, tokens, generator=generator) > 0.2
    forced = torch.rand(rows, tokens, generator=generator) > 0.7
    positions = torch.stack([torch.randperm(tokens, generator=generator) for _ in range(rows)]).to(torch.int32)
    order = positions if with_positions else None
    dropped = lowest_ranked(scores, valid, forced, order).squeeze(-1)
    keep = keep_top_scores(scores, tokens - 1, valid, forced, order)
    assert torch.equal((~keep).float().argmax(-1), dropped)
    for row in range(rows):  # the definition: padding first (forced or not), then the lowest score of the
        # tokens not forced, a forced one last; among equals the oldest (smallest position, or stored index)
        age = positions[row] if with_positions else torch.arange(tokens)

        def rank(index, row=row, age=age):
            real = bool(valid[row, index])
            kept_anyway = real and bool(forced[row, index])
            score = float(scores[row, index]) if real and not kept_anyway else 0.0
            return (real, kept_anyway, score, int(age[index]))

        assert int(dropped[row]) == min(range(tokens), key=rank)
