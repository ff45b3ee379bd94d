"""Host reads of the methods' own hooks (issue 25 item 3, issue 23 item 2): the CPU proxy for GPU
synchronisations, counted with ``kvhive.diagnostics.HostReadCounter`` around every policy hook
(``initialize_decode``, ``observe_decode``, ``select_prefill``, ``select_decode``), so the cache's
own reads (the lead's part of issue 23) are not counted here.

* Prefill on tiny Llama-GQA at 25% of the prompt: a method that is done reads the same number of
  times at 256 and 2,048 tokens and at most 4 times per layer; every other method is held to
  the count it had when this test was written (a ratchet: the test fails if a count grows).
* A steady decode step (budget 48, prompt 160, after 6 warm-up steps, as issue 23 measures it):
  a method that is done reads nothing; the others are held to their count.
* ``kept_per_row`` of BUZZ and BumbleBee equals what their decisions keep, so the cache can
  trust it instead of reading the counts back.
"""

from __future__ import annotations

import pytest
import torch

import kvhive
from kvhive.diagnostics import HostReadCounter
from kvhive.models import tiny_model

HOOKS = ("initialize_decode", "observe_decode", "select_prefill", "select_decode")
PROMPT_LENGTHS = (256, 2048)
MAX_READS_PER_LAYER = 4

# Methods whose prefill hooks read a constant number of times (<= 4 per layer).
PREFILL_DONE = frozenset(
    {
        "full",
        "local",
        "streamingllm",
        "h2o",
        "snapkv",
        "pyramidkv",
        "tova",
        "knorm",
        "vnorm",
        "ahakv",
        "buzz",
        "buzz-logn",
        "bumblebee",
        "bumblebee-power",
    }
)
# The others' prefill reads at (256, 2048) tokens when this test was written: upper bounds.
PREFILL_RATCHET = {
    "random": (4, 4),
    "ada-snapkv": (8, 8),
    "ada-pyramidkv": (8, 8),
    "ada-ahakv": (8, 8),
    "subgen": (64, 934),
    "subgen-attention": (62, 380),
}
# Methods whose steady decode step reads nothing in their hooks.
DECODE_DONE = PREFILL_DONE | {"ada-snapkv", "ada-pyramidkv", "ada-ahakv"}
DECODE_RATCHET = {"random": 4, "subgen": 16, "subgen-attention": 22}


def instrument(policy, counter: HostReadCounter) -> None:
    """Run every hook of ``policy`` inside ``counter`` (instance attributes shadow the methods)."""
    for name in HOOKS:
        original = getattr(policy, name)

        def counted(*args, _original=original, **kwargs):
            with counter:
                return _original(*args, **kwargs)

        setattr(policy, name, counted)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", "gqa")


def prompt(model, length: int) -> torch.Tensor:
    return torch.randint(3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))


def prefill_reads(model, method: str, length: int) -> HostReadCounter:
    cache = kvhive.make_cache(model, method, ratio=0.25)
    counter = HostReadCounter()
    instrument(cache.policy, counter)
    with torch.no_grad():
        model(input_ids=prompt(model, length), past_key_values=cache, use_cache=True)
    return counter


@pytest.mark.parametrize("method", kvhive.method_names())
def test_prefill_host_reads_do_not_grow_with_the_prompt(model, method):
    counts = [prefill_reads(model, method, length) for length in PROMPT_LENGTHS]
    totals = tuple(counter.total for counter in counts)
    if method in PREFILL_DONE:
        assert totals[0] == totals[1], counts
        assert totals[1] <= MAX_READS_PER_LAYER * model.config.num_hidden_layers, counts
    else:
        assert method in PREFILL_RATCHET, f"{method}: a new method joins PREFILL_DONE or the ratchet"
        bound = PREFILL_RATCHET[method]
        assert totals[0] <= bound[0] and totals[1] <= bound[1], counts


@pytest.mark.parametrize("method", kvhive.method_names())
def test_steady_decode_step_host_reads(model, method):
    cache = kvhive.make_cache(model, method, budget=48)
    counter = HostReadCounter()
    with torch.no_grad():
        token = model(input_ids=prompt(model, 160), past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        for _ in range(6):
            token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        instrument(cache.policy, counter)
        model(input_ids=token, past_key_values=cache, use_cache=True)
    if method in DECODE_DONE:
        assert counter.total == 0, counter
    else:
        assert method in DECODE_RATCHET, f"{method}: a new method joins DECODE_DONE or the ratchet"
        assert counter.total <= DECODE_RATCHET[method], counter


@pytest.mark.parametrize("method", ["buzz", "buzz-logn", "bumblebee", "bumblebee-power"])
def test_kept_per_row_is_what_the_decisions_keep(model, method):
    """Prefill and 40 decode steps (BUZZ's eviction rounds and its below-threshold steps): before
    every decision, kept_per_row (asked with the state the decision sees) is each row's count."""
    cache = kvhive.make_cache(model, method, budget=24)
    policy = cache.policy
    # kept_per_row lays out the growing layout's decisions; a layer in the fixed decode capacity these
    # methods declare counts its kept tokens on the device (tests/test_compiled_decode.py), so it is off.
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
