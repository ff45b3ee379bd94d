"""Host reads of the methods' own hooks (issue 25 item 3, issue 23 item 2): the CPU proxy for GPU
synchronisations, counted with ``kvhive.diagnostics.HostReadCounter`` around every policy hook
(``tests/host_read_hooks.py``), so the cache's own reads are not counted here (the whole step's
are, in ``tests/cache/test_decode_host_reads.py``).

* Prefill on tiny Llama-GQA at 25% of the prompt: every method reads the same number of times at
  256 and 2,048 tokens and at most 4 times per layer.
* A steady decode step (budget 48, prompt 160, after 6 warm-up steps, as issue 23 measures it):
  every method's hooks read nothing.
* ``kept_per_row`` of BUZZ and BumbleBee equals what their decisions keep, so the cache can
  trust it instead of reading the counts back.
"""

from __future__ import annotations

import collections

import pytest
import torch
from host_read_hooks import count_policy_reads

import kvhive
from kvhive.models import tiny_model

PROMPT_LENGTHS = (256, 2048)
MAX_READS_PER_LAYER = 4


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", "gqa")


def prompt(model, length: int) -> torch.Tensor:
    return torch.randint(3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))


def prefill_reads(model, method: str, length: int) -> collections.Counter:
    cache = kvhive.make_cache(model, method, ratio=0.25)
    reads, _ = count_policy_reads(cache.policy)
    with torch.no_grad():
        model(input_ids=prompt(model, length), past_key_values=cache, use_cache=True)
    return reads


@pytest.mark.parametrize("method", kvhive.method_names())
def test_prefill_host_reads_do_not_grow_with_the_prompt(model, method):
    # Every method: the same count at 256 and 2,048 tokens, at most 4 per layer (issue 25 item 3).
    counts = [prefill_reads(model, method, length) for length in PROMPT_LENGTHS]
    totals = tuple(counter.total() for counter in counts)
    assert totals[0] == totals[1], counts
    assert totals[1] <= MAX_READS_PER_LAYER * model.config.num_hidden_layers, counts


@pytest.mark.parametrize("method", kvhive.method_names())
def test_steady_decode_step_host_reads(model, method):
    cache = kvhive.make_cache(model, method, budget=48)
    with torch.no_grad():
        token = model(input_ids=prompt(model, 160), past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        for _ in range(6):
            token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        reads, calls = count_policy_reads(cache.policy)
        model(input_ids=token, past_key_values=cache, use_cache=True)
    if not calls:
        # The count is vacuous only if the method could run in a decode step: one with no decode
        # phase, no observe_decode and no estimate outside the cache is not consulted at all.
        traits = cache.traits
        consulted = traits.has_decode or traits.observes_decode or traits.attends_outside_cache
        assert not consulted, f"{method}: no hook ran in the decode step: the count would be vacuous"
    assert reads.total() == 0, reads  # every method (issue 23 item 2)


@pytest.mark.parametrize("method", ["buzz", "buzz-logn", "bumblebee", "bumblebee-power"])
def test_kept_per_row_is_what_the_decisions_keep(model, method):
    """Prefill and 40 decode steps (BUZZ's eviction rounds and its below-threshold steps): before
    every decision, kept_per_row (asked with the state the decision sees) is each row's count."""
    cache = kvhive.make_cache(model, method, budget=24)
    policy = cache.policy
    # kept_per_row lays out the growing layout's decisions; a layer in the fixed decode capacity these
    # methods declare counts its kept tokens on the device (tests/cache/test_compiled_decode.py), so it is off.
    policy.fixed_decode_capacity = lambda keys, budget, state: None
    checked = []

    def checking(phase, original):
        def decide(scoring, budget, state):
            expected = policy.kept_per_row(phase, scoring.num_tokens, budget, state)
            keep = original(scoring, budget, state)
            kept = scoring.num_tokens if keep is None else keep.sum(dim=-1)
            assert expected is not None, phase
            assert (torch.as_tensor(kept) == expected).all(), (phase, expected, kept)
            checked.append(phase)
            return keep

        return decide

    policy.select_prefill = checking("prefill", policy.select_prefill)
    policy.select_decode = checking("decode", policy.select_decode)
    with torch.no_grad():
        token = model(input_ids=prompt(model, 96), past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        for _ in range(40):
            token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    assert checked.count("prefill") == 2 and checked.count("decode") >= 40
