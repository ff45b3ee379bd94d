"""A steady decode step of every method: no host read, no re-allocation of the cache (issue 23).

Host reads are the CPU proxy of a GPU step's synchronisations (``kvhive.diagnostics``). Every
registered method is measured; a method listed in ``REMAINING_HOST_READS`` has not been made
sync-free yet and may not read more than its listed count (a ratchet: lower it as work lands, the
test fails when a listed method reaches zero so the list stays honest).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from golden_kept import snapshot

import kvhive
from kvhive.diagnostics import HostReadCounter
from kvhive.methods.base import DECODE
from kvhive.methods.registry import method_names, policy_class
from kvhive.models import tiny_model

from helpers import run_in_threads

BUDGET = 48
PROMPT = 160
# Host reads per steady decode step (tiny Llama-GQA, 2 layers) of methods whose selection still
# reads the device; the cache side reads nothing.
REMAINING_HOST_READS: dict[str, int] = {}


def _model():
    torch.manual_seed(0)
    return tiny_model("llama", "gqa")


def _prompt(model, batch=1, length=PROMPT, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (batch, length), generator=generator)


def _cache(model, method):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if method == "full":
            return kvhive.make_cache(model, method)
        return kvhive.make_cache(model, method, budget=BUDGET)


def _decode(model, cache, token, steps):
    for _ in range(steps):
        token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    return token


@pytest.mark.parametrize("method", method_names())
def test_steady_decode_step_makes_no_host_read(method):
    model = _model()
    cache = _cache(model, method)
    with torch.no_grad():
        token = model(input_ids=_prompt(model), past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        token = _decode(model, cache, token, 6)
        with HostReadCounter() as reads:
            model(input_ids=token, past_key_values=cache, use_cache=True)
    allowed = REMAINING_HOST_READS.get(method, 0)
    assert reads.total <= allowed, f"{method}: {reads}"
    if method in REMAINING_HOST_READS:
        assert reads.total > 0, f"{method} is sync-free now: remove it from REMAINING_HOST_READS"


@pytest.mark.parametrize("method", ["ada-snapkv", "ada-pyramidkv", "ada-ahakv"])
def test_steady_packed_decode_step_with_a_decode_capacity_makes_no_host_read(method):
    # Head-wise budgets with decode_capacity (the compileable layout): each packed segment got its
    # room once after the prefill; a steady step appends at the device lengths and attends over the
    # fixed pages, reading nothing back and moving no buffer.
    model = _model()
    window = {"recent": 4} if method == "ada-ahakv" else {"window": 4}
    cache = kvhive.make_cache(model, method, budget=BUDGET, decode_capacity=16, **window)
    assert cache.is_compileable
    with torch.no_grad():
        token = model(input_ids=_prompt(model), past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        token = _decode(model, cache, token, 6)
        packed = [layer for layer in cache.layers if not layer.is_uniform]
        assert packed and all(layer.fixed_capacity for layer in packed)
        pointers = [(layer.buffers()[0].data_ptr(), layer.buffers()[1].data_ptr()) for layer in cache.layers]
        with HostReadCounter() as reads:
            model(input_ids=token, past_key_values=cache, use_cache=True)
    assert reads.total == 0, f"{method}: {reads}"
    assert [(layer.buffers()[0].data_ptr(), layer.buffers()[1].data_ptr()) for layer in cache.layers] == pointers


def test_counter_sees_the_reads_of_a_method_that_reads():
    # The zero above is not blindness: a selection that reads the device is counted.
    model = _model()
    cache = _cache(model, "tova")
    original = cache.policy.select_decode

    def reading_select(scoring, budget, state):
        keep = original(scoring, budget, state)
        bool(keep.any())
        return keep

    cache.policy.select_decode = reading_select
    with torch.no_grad():
        token = model(input_ids=_prompt(model), past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        with HostReadCounter() as reads:
            model(input_ids=token, past_key_values=cache, use_cache=True)
    assert reads.reads["__bool__"] == len(cache.compressed_layers)


DECODE_METHODS = [m for m in method_names() if DECODE in policy_class(m).phases and m not in REMAINING_HOST_READS]


@pytest.mark.parametrize("method", DECODE_METHODS)
def test_buffers_keep_their_address_over_64_evicting_steps(method):
    # Static storage: after the prefill, appends and evictions write into the same buffers, so a
    # captured decode step (CUDA graph) keeps reading and writing the right memory.
    model = _model()
    cache = _cache(model, method)
    with torch.no_grad():
        token = model(input_ids=_prompt(model), past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        token = _decode(model, cache, token, 1)
        layers = [cache.layers[i] for i in cache.compressed_layers]
        pointers = [(layer.buffers()[0].data_ptr(), layer.buffers()[1].data_ptr()) for layer in layers]
        seen = cache.get_seq_length()
        _decode(model, cache, token, 64)
    assert cache.get_seq_length() == seen + 64
    assert [(layer.buffers()[0].data_ptr(), layer.buffers()[1].data_ptr()) for layer in layers] == pointers
    # ... and the budget was kept all along: these were evicting steps.
    assert all(layer.max_length <= BUDGET for layer in layers)


def test_caches_of_different_threads_do_not_mix():
    # Issue 27 item 8: four threads, each with its own model and cache, generating at once.
    def work(index):
        model = _model()
        prompt = _prompt(model, length=40, seed=index)
        outputs = []
        for _ in range(10):
            cache = _cache(model, "h2o")
            with torch.no_grad():
                token = model(input_ids=prompt, past_key_values=cache).logits[:, -1:].argmax(-1)
                outputs.append(_decode(model, cache, token, 3))
        return outputs

    for outputs in run_in_threads(work, 4).values():  # each thread's ten runs agree with each other
        assert all(torch.equal(outputs[0], other) for other in outputs)


# Where a step asks whether it is recorded once and replayed: every kvhive module reads
# kvhive.static_step.in_static_step through the module, so one patch covers them all.
STATIC_STEP_USERS = ("kvhive.static_step",)


@pytest.mark.parametrize("method", method_names())
def test_a_captured_decode_step_reads_nothing_and_decodes_like_eager(method, monkeypatch):
    # A CUDA graph captures an eager step (no dynamo): the step takes the device path because
    # in_static_step() says so, and any host read there is fatal (reading a device value while the
    # stream captures is refused), any host decision is replayed as it was. The CPU proxy: steps run
    # with in_static_step() forced True read nothing and give the logits and kept tokens of eager
    # steps. (The GPU run of 6be3f33 found TOVA's step reading the stale host token count there.)
    import importlib

    model = _model()
    options = {} if DECODE in policy_class(method).phases else {"decode_capacity": 16}
    caches = []
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            budget = None if method == "full" else BUDGET
            caches.append(kvhive.make_cache(model, method, budget=budget, **options))
    assert caches[0].static_decode
    with torch.no_grad():
        tokens = []
        for cache in caches:
            token = model(input_ids=_prompt(model), past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            tokens.append(_decode(model, cache, token, 2))
        assert torch.equal(tokens[0], tokens[1])
        token = tokens[0]
        for step in range(8):
            with monkeypatch.context() as patch:
                for name in STATIC_STEP_USERS:
                    patch.setattr(importlib.import_module(name), "in_static_step", lambda: True)
                with HostReadCounter() as reads:
                    captured = model(input_ids=token, past_key_values=caches[0], use_cache=True).logits
            eager = model(input_ids=token, past_key_values=caches[1], use_cache=True).logits
            assert reads.total == 0, f"{method}, step {step}: {reads}"
            torch.testing.assert_close(captured, eager, rtol=1e-5, atol=1e-5, msg=f"{method}, step {step}")
            token = eager[:, -1:].argmax(-1)
    assert snapshot(caches[0]) == snapshot(caches[1])
