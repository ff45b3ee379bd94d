"""A left-padded row whose padding survives the prefill (its real tokens fit the budget, so the
padding fills the rest) decodes exactly as the row alone, for every method: its padding leaves first
as decoding evicts, and no new token takes over a padding token's state.

This is what a padding flag moved into a freed slot broke: SubGen (recent window) skipped the cache's
own padding flag when a new token took a dropped padding token's slot, and the new token was masked
as padding from then on (row logits off from the second decode step; tests/cache/test_unset_scores.py)."""

from __future__ import annotations

import pytest
import torch

import kvhive
from kvhive.compat import cache_kwarg
from kvhive.methods.registry import method_names
from kvhive.models import tiny_model

LENGTH, PADDING, BUDGET, STEPS = 40, 7, 36, 12
# BUZZ refuses rows of different real lengths (tests/methods/test_buzz.py).
METHODS = [name for name in method_names() if not name.startswith("buzz")]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_model("llama", "gqa")


def _logits(model, input_ids, attention_mask, method, forced):
    """Logits of the prompt's last position and of ``len(forced)`` decode steps fed ``forced``; each
    row's positions count its real tokens only, as ``generate`` gives them (a row and the same row
    left-padded then rotate their keys alike)."""
    cache = kvhive.make_cache(model, method, budget=BUDGET)
    key = cache_kwarg(model)
    positions = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    logits = []
    with torch.no_grad():
        output = model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, **{key: cache}, use_cache=True
        )
        logits.append(output.logits[:, -1])
        for token in forced:
            token = token.expand(input_ids.shape[0], 1)
            attention_mask = torch.cat([attention_mask, torch.ones_like(token)], dim=1)
            positions = positions[:, -1:] + 1
            output = model(
                input_ids=token, attention_mask=attention_mask, position_ids=positions, **{key: cache}, use_cache=True
            )
            logits.append(output.logits[:, -1])
    return torch.stack(logits, dim=1)


@pytest.mark.parametrize("method", METHODS)
def test_a_row_whose_padding_survives_prefill_decodes_as_alone(model, method):
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, model.config.vocab_size, (2, LENGTH), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    input_ids[1, :PADDING], attention_mask[1, :PADDING] = 0, 0
    forced = torch.randint(3, model.config.vocab_size, (STEPS,), generator=generator)
    # Row 1 holds 33 real tokens under a budget of 36: three padding tokens are kept through the
    # prefill and leave during the first decode steps; alone the row fills up to the budget instead.
    batch = _logits(model, input_ids, attention_mask, method, forced)
    alone = _logits(model, input_ids[1:, PADDING:], attention_mask[1:, PADDING:], method, forced)
    torch.testing.assert_close(batch[1], alone[0], rtol=1e-5, atol=1e-5)
