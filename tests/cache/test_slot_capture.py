"""A captured decode step of fixed batch slots, replayed across leaves and joins: CPU proxies of
tests_gpu/test_cuda.py::test_cuda_graph_of_a_slotted_step_replays_across_joins_and_leaves.

A CUDA graph captures one eager decode step (``in_static_step()`` True while the stream captures)
and replays it: the captured step may read nothing back (a host read while capturing is refused),
and a replay runs no Python, so it reads no host value and changes no host value. The CPU
proxies here:

* a *captured* step is an eager step with ``in_static_step()`` forced True, under a host-read
  counter: it must read nothing, the steps right after a leave or a join included;
* a *replay* is such a step whose Python side effects are undone afterwards (every attribute of the
  cache and of its layers, policy states included, put back as it was before the step; the
  tensors, updated in place, keep what the step wrote): the host mirrors of the device counters
  then fall behind without being told, as after real replays, and a leave or a join must still
  give what the same leave or join gives a batch decoded eagerly.

The GPU run of 979327d found both: the decode-evicting methods' slotted step read the rows' token
counts back while capturing, and the growing layers (full, prefill-only methods) wrote stale
host row lengths back to the device at the join after a leave.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from test_batch_slots import LENGTHS as SLOT_LENGTHS  # prompts 0 and 1 start in 3 slots; 2 and 3 join
from test_batch_slots import _prefilled, _prompts
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from kvhive.cache import KVHiveCache
from kvhive.cache.layers import Layout
from kvhive.cache.layers.buffers import TokenBuffers
from kvhive.cache.layers.counters import Count
from kvhive.compat import cache_kwarg
from kvhive.diagnostics import HostReadCounter
from kvhive.methods.registry import method_names
from kvhive.models import tiny_model

SLOTTED_METHODS = [m for m in method_names() if not m.startswith("ada-")]
WARM_UP_STEPS = 4
REPLAYS = 20
LEAVE = {8: 0}  # replay -> the slot whose row leaves before it
JOIN = {10: (0, 2), 14: (2, 3)}  # replay -> (slot, prompt) joining before it
# Where a step asks whether it is recorded once and replayed: every kvhive module reads
# kvhive.static_step.in_static_step through the module, so one patch covers them all.
STATIC_STEP_USERS = ("kvhive.static_step",)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", "gqa")


def _slotted(model, method, prompts):
    started = [_prefilled(model, method, prompts[index]) for index in (0, 1)]
    cache = KVHiveCache.stack(
        [cache for cache, _ in started],
        decode_capacity=REPLAYS + 8,
        batch_slots=3,
        slot_capacity=max(SLOT_LENGTHS) + REPLAYS + 8,
    )
    tokens = torch.zeros(3, 1, dtype=torch.long)
    tokens[:2, 0] = torch.cat([token for _, token in started])
    return cache, tokens


def _step(model, cache, tokens):
    positions = cache.layers[0].row_tokens_seen_device[:, None].clone()
    with torch.no_grad():
        return model(input_ids=tokens, position_ids=positions, **{cache_kwarg(model): cache}, use_cache=True).logits


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (Layout, TokenBuffers, Count)):  # a layer's layout, its buffers and counters
        yield from _tensors({name: item for name, item in vars(value).items() if name != "store"})
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


class _Trace(TorchDispatchMode):
    """The ops a step runs, as a CUDA graph records them: each op with its Python arguments (baked
    into the graph) and, for every tensor of the cache it reads or writes (a layer's buffers and
    counters, a method's state), the address, shape and strides it is used at (the graph reads
    and writes those addresses at every replay); other tensors (the step's own) by shape."""

    def __init__(self, cache):
        super().__init__()
        self.cached = {
            tensor.untyped_storage().data_ptr() for layer in cache.layers for tensor in _tensors(dict(layer.__dict__))
        }
        self.ops = []

    def _describe(self, value):
        if isinstance(value, torch.Tensor):
            if value.untyped_storage().data_ptr() in self.cached:
                return ("cache", value.data_ptr(), tuple(value.shape), value.stride(), value.dtype)
            return ("step", tuple(value.shape), value.dtype)
        return value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        self.ops.append((str(func), tuple(self._describe(value) for value in flat)))
        return func(*args, **kwargs)


def _captured(model, cache, tokens, monkeypatch):
    """One step as a CUDA graph's capture takes it: ``in_static_step()`` True; ``(logits, reads,
    the ops it ran)``."""
    with monkeypatch.context() as patch:
        for name in STATIC_STEP_USERS:
            patch.setattr(importlib.import_module(name), "in_static_step", lambda: True)
        trace = _Trace(cache)
        with HostReadCounter() as reads, trace:
            logits = _step(model, cache, tokens)
    return logits, reads, trace.ops


def _copy_host(value):
    """A copy of the Python containers in ``value``; tensors (updated in place by a step, as a graph
    replay updates its buffers) and other objects are kept as they are."""
    if isinstance(value, dict):
        return type(value)((key, _copy_host(item)) for key, item in value.items())
    if isinstance(value, list):
        return [_copy_host(item) for item in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_copy_host(item) for item in value)
    if isinstance(value, set):
        return set(value)
    return value


def _replayed(model, cache, tokens, monkeypatch):
    """One step as a replay of the captured step runs it: the device work of a captured step, and
    no change to any host value (every attribute of the cache and its layers put back)."""
    objects = [cache, *cache.layers]
    saved = [(obj, obj.__class__, _copy_host(dict(obj.__dict__))) for obj in objects]
    try:
        return _captured(model, cache, tokens, monkeypatch)
    finally:
        for obj, cls, state in saved:
            obj.__class__ = cls
            obj.__dict__.clear()
            obj.__dict__.update(state)


def _run(model, method, monkeypatch, replay):
    """Two identical slotted batches: the first takes its steps after the capture by ``replay``, the
    second eagerly; rows leave and join both alike. Yields ``(replay number, logits, eager logits,
    reads, running slots)``."""
    prompts = _prompts(model)
    graphed, tokens = _slotted(model, method, prompts)
    eager, eager_tokens = _slotted(model, method, prompts)
    assert graphed.static_decode, f"{method}: a slotted cache does not declare a static decode step"
    for _ in range(WARM_UP_STEPS):
        tokens = _step(model, graphed, tokens)[:, -1:].argmax(-1)
        eager_tokens = _step(model, eager, eager_tokens)[:, -1:].argmax(-1)
    assert torch.equal(tokens, eager_tokens)
    logits, reads, captured_ops = _captured(model, graphed, tokens, monkeypatch)  # the capture
    expected = _step(model, eager, tokens)
    yield -1, logits, expected, reads, graphed.active_slots, True
    tokens = expected[:, -1:].argmax(-1)
    for number in range(REPLAYS):
        if number in LEAVE:
            graphed.free_slots([LEAVE[number]])
            eager.free_slots([LEAVE[number]])
        if number in JOIN:
            slot, prompt = JOIN[number]
            joiner, token = _prefilled(model, method, prompts[prompt])
            graphed.fill_slots([slot], [joiner])
            eager.fill_slots([slot], [_prefilled(model, method, prompts[prompt])[0]])
            tokens[slot] = token
        if number in LEAVE or number in JOIN:
            # What the host says of the rows after a leave or a join is what the device holds.
            assert graphed.row_tokens_seen() == eager.row_tokens_seen(), f"{method}: before replay {number}"
            kept, expected_kept = graphed.kept_tokens(), eager.kept_tokens()
            assert all(torch.equal(kept[i], expected_kept[i]) for i in kept), f"{method}: before replay {number}"
        logits, reads, ops = replay(model, graphed, tokens, monkeypatch)
        with HostReadCounter() as eager_reads:
            expected = _step(model, eager, tokens.clone())
        # An eager step reads nothing back either, the one right after a leave or a join included.
        assert eager_reads.total == 0, f"{method}: eager step {number} read the host: {dict(eager_reads.reads)}"
        yield number, logits, expected, reads, graphed.active_slots, ops == captured_ops
        tokens = expected[:, -1:].argmax(-1)
    assert graphed.active_slots == [True, True, True]


@pytest.mark.parametrize("method", SLOTTED_METHODS)
def test_captured_slotted_steps_read_nothing_across_leaves_and_joins(model, method, monkeypatch):
    # Every step after the warm-up taken as a capture takes it, the steps right after a leave and
    # after each join included (the leave or join itself may read the host; the step may not).
    for number, logits, expected, reads, running, _ in _run(model, method, monkeypatch, _captured):
        assert reads.total == 0, f"{method}: step {number} read the host: {dict(reads.reads)}"
        torch.testing.assert_close(
            logits[running], expected[running], atol=1e-5, rtol=1e-5, msg=f"{method}: step {number}"
        )


@pytest.mark.parametrize("method", SLOTTED_METHODS)
def test_replays_of_a_captured_slotted_step_equal_eager_steps_across_leaves_and_joins(model, method, monkeypatch):
    # The capture, then replays that leave every host value as it was (a replay runs no Python): a
    # leave or a join after replays must act on what the device holds, not on host mirrors the
    # replays left behind, and every running row's logits equal the eager batch's.
    for number, logits, expected, reads, running, as_captured in _run(model, method, monkeypatch, _replayed):
        assert reads.total == 0, f"{method}: step {number} read the host: {dict(reads.reads)}"
        # What a replay runs is what was captured: the same ops on the same addresses of the cache's
        # tensors (none replaced by a leave or a join), with the same Python arguments (no host value
        # of the capture changed since). Else the step below is not what the graph would replay.
        assert as_captured, f"{method}: replay {number} runs other ops or addresses than the capture"
        torch.testing.assert_close(
            logits[running], expected[running], atol=1e-5, rtol=1e-5, msg=f"{method}: replay {number} differs"
        )
