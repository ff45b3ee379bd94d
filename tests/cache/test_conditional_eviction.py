"""A captured decode step whose eviction is an if-node (``kvhive.static_step.run_if``): where a CUDA
graph records conditional nodes, the cache asks the method whether a step may evict
(``Policy.decode_eviction_due``) and the replay runs the decision and the compaction only where it
may. The CPU proxy of that replay: captured steps (``in_static_step()`` forced True, as in
tests/cache/test_slot_capture.py) whose ``run_if`` skips the work wherever the predicate is False, against
eager steps of a twin cache: the same logits at every step and the same cache at the end, over steps
that evict and steps that do not, for one row in a fixed capacity and for stacked rows of different
lengths (the slotted server's layout)."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
from test_slot_capture import STATIC_STEP_USERS

import kvhive
from kvhive.cache import KVHiveCache
from kvhive.compat import cache_kwarg
from kvhive.methods.base import Policy
from kvhive.methods.registry import method_names, policy_class
from kvhive.models import tiny_model

FLAGGING = [name for name in method_names() if policy_class(name).decode_eviction_due is not Policy.decode_eviction_due]
STEPS = 40


def test_the_decode_evicting_methods_on_a_schedule_flag_their_eviction_steps():
    assert {"buzz", "buzz-logn"} <= set(FLAGGING)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", "gqa")


class _SkippingIfNode:
    """``run_if`` as a replay runs an if-node: the work only where the predicate holds."""

    def __init__(self):
        self.predicates = []

    def __call__(self, predicate, work):
        if predicate is None:
            work()
            return
        assert isinstance(predicate, torch.Tensor) and predicate.dtype == torch.bool and predicate.dim() == 0
        self.predicates.append(bool(predicate))
        if self.predicates[-1]:
            work()


def _captured_step(monkeypatch, if_node, step):
    compressor = importlib.import_module("kvhive.cache.compressor")
    with monkeypatch.context() as patch:
        for name in STATIC_STEP_USERS:
            patch.setattr(importlib.import_module(name), "in_static_step", lambda: True)
        patch.setattr(compressor, "captures_conditional_nodes", lambda: True)
        patch.setattr(compressor, "run_if", if_node)
        return step()


def _cache_contents(cache):
    return [
        (layer.tokens_seen, [tensor.clone() for tensor in layer.buffers()], dict(layer.policy_state))
        for layer in cache.layers
    ]


def _assert_same_caches(first, second, method):
    for index, ((seen, buffers, state), (other_seen, other_buffers, other_state)) in enumerate(
        zip(_cache_contents(first), _cache_contents(second), strict=True)
    ):
        assert seen == other_seen, f"{method}, layer {index}"
        for buffer, other in zip(buffers, other_buffers, strict=True):
            assert torch.equal(buffer, other), f"{method}, layer {index}"
        for key in state:
            value, other = state[key], other_state[key]
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other), f"{method}, layer {index}, {key}"


@pytest.mark.parametrize("method", FLAGGING)
def test_a_captured_step_that_skips_its_eviction_where_not_due_decodes_like_eager(model, method, monkeypatch):
    prompt = torch.randint(3, model.config.vocab_size, (1, 70), generator=torch.Generator().manual_seed(1))
    caches = []
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            caches.append(kvhive.make_cache(model, method, budget=24, decode_capacity=STEPS + 8))
    if_node = _SkippingIfNode()
    with torch.no_grad():
        tokens = [model(input_ids=prompt, past_key_values=c, use_cache=True).logits[:, -1:].argmax(-1) for c in caches]
        token = tokens[0]
        for step in range(STEPS):
            captured = _captured_step(
                monkeypatch,
                if_node,
                lambda token=token: model(input_ids=token, past_key_values=caches[0], use_cache=True).logits,
            )
            eager = model(input_ids=token, past_key_values=caches[1], use_cache=True).logits
            torch.testing.assert_close(captured, eager, rtol=1e-5, atol=1e-5, msg=f"{method}, step {step}")
            token = eager[:, -1:].argmax(-1)
    # Both kinds of step ran: the skipped ones (most) and the evicting ones.
    assert True in if_node.predicates and if_node.predicates.count(False) > if_node.predicates.count(True)
    _assert_same_caches(caches[0], caches[1], method)


@pytest.mark.parametrize("method", FLAGGING)
def test_stacked_rows_skip_their_eviction_only_where_no_row_evicts(model, method, monkeypatch):
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, model.config.vocab_size, (1, n), generator=generator) for n in (70, 53)]
    stacked, first = [], None
    for _ in range(2):
        started = []
        for prompt in prompts:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cache = kvhive.make_cache(model, method, budget=24)
            with torch.no_grad():
                logits = model(input_ids=prompt, **{cache_kwarg(model): cache}, use_cache=True).logits[:, -1]
            started.append((cache, logits.argmax(-1)))
        stacked.append(KVHiveCache.stack([cache for cache, _ in started], decode_capacity=STEPS + 8))
        first = torch.cat([token for _, token in started])[:, None]
    assert stacked[0].layers[-1].has_row_lengths, "the rows were meant to decode with lengths of their own"
    if_node = _SkippingIfNode()

    def step(cache, tokens):
        positions = cache.layers[0].row_tokens_seen_device[:, None].clone()
        return model(input_ids=tokens, position_ids=positions, **{cache_kwarg(model): cache}, use_cache=True).logits

    tokens = first
    with torch.no_grad():
        for number in range(STEPS):
            captured = _captured_step(monkeypatch, if_node, lambda tokens=tokens: step(stacked[0], tokens))
            eager = step(stacked[1], tokens)
            torch.testing.assert_close(captured, eager, rtol=1e-5, atol=1e-5, msg=f"{method}, step {number}")
            tokens = eager[:, -1:].argmax(-1)
    assert True in if_node.predicates and False in if_node.predicates
    _assert_same_caches(stacked[0], stacked[1], method)


class _FakeCapturingGraph:
    """The capturing graph's if-node calls, recorded (``refuse``: begin refuses, as torch's checks do)."""

    def __init__(self, refuse: bool):
        self.refuse = refuse
        self.calls = []

    def begin_capture_to_if_node(self, predicate):
        if self.refuse:
            raise RuntimeError("'graph_capture_record_stream_reuse:True' allocator config does not work")
        self.calls.append(("begin", predicate))

    def end_capture_to_conditional_node(self):
        self.calls.append(("end",))


@pytest.mark.parametrize("refuse", [False, True])
def test_run_if_records_the_work_inside_an_if_node_or_unconditionally_with_a_warning(monkeypatch, refuse):
    from kvhive import static_step

    graph = _FakeCapturingGraph(refuse)
    monkeypatch.setattr(torch.cuda.CUDAGraph, "get_currently_capturing_graph", lambda: graph, raising=False)
    predicate = torch.tensor(True)
    if refuse:
        with pytest.warns(UserWarning, match="if-node was refused"):
            static_step.run_if(predicate, lambda: graph.calls.append(("work",)))
        assert graph.calls == [("work",)]
    else:
        static_step.run_if(predicate, lambda: graph.calls.append(("work",)))
        assert graph.calls == [("begin", predicate), ("work",), ("end",)]
