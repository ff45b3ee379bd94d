"""Issue 25: the GPU fast path of the prefill selections, proxied on the CPU.

BumbleBee's greedy (``greedy_maximize(fast=...)``) and SubGen's farthest-point order
(``farthest_point_order(fast=...)``) run each step as one pure function of fixed-shape tensors,
so that on CUDA the step compiles (inductor fuses it) and the whole loop is captured once as a
CUDA graph per shape bucket. Here, on the CPU:

(a) the step traces with ``torch.compile(fullgraph=True, dynamic=False, backend="aot_eager")``
    (no graph break: ``fullgraph`` raises on one) and the loop gives exactly the eager loop's
    result (the same kept positions), for both greedy variants, both concave functions, padded
    rows, and through the policies' ``select_prefill``;
(b) no recompilation across the steps of a run or across layers of the same shapes
    (``torch._dynamo.config.error_on_recompile``);
(c) the work per step: aten operations dispatched per step by the eager loop vs the operations
    of the traced step and the kernels inductor generates for it (numbers in docs/METHODS.md).

tests_gpu/test_cuda.py checks the CUDA path itself (compiled with inductor, captured).
"""

from __future__ import annotations

import functools
import re
import threading
import time

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

import kvhive.methods.bumblebee as bumblebee_module
import kvhive.methods.subgen as subgen_module
import kvhive.methods.submodular as submodular
import kvhive.methods.submodular_graph as submodular_graph
from kvhive.methods import make_policy
from kvhive.methods.subgen import farthest_point_order
from kvhive.methods.submodular import Concave, greedy_maximize
from kvhive.static_step import CapturedLoops

from helpers import random_objective, record_greedy_calls, run_in_threads, scoring_inputs


def _generators(rows: int, seed: int = 100) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + row) for row in range(rows)]


@pytest.fixture
def fresh_compiles():
    """Compiled steps cleared before and after (each test counts its own compiles)."""
    for cache in (submodular_graph._STEP_FUNCTIONS, subgen_module._STEP_FUNCTIONS):
        cache.clear()
    torch._dynamo.reset()
    counters.clear()
    yield
    for cache in (submodular_graph._STEP_FUNCTIONS, subgen_module._STEP_FUNCTIONS):
        cache.clear()
    torch._dynamo.reset()


# -- (a) the fixed-shape step, eager and traced, gives the eager loop's sets ----------------------


@pytest.mark.parametrize("method", ["stochastic", "lazy"])
@pytest.mark.parametrize("phi", [Concave("log"), Concave("power")], ids=["log", "power"])
def test_fixed_shape_greedy_step_gives_the_eager_sets(method, phi, fresh_compiles):
    for seed in range(2):
        objective = random_objective(rows=4, n=160, dim=12, phi=phi, seed=seed)  # row 1 padded
        for k in (3, 30, 157, 160):  # 157 and 160 pick padding in row 1; late steps evaluate everything
            reference = greedy_maximize(objective, k, method, 1e-5, _generators(4), fast=False)
            assert submodular.last_greedy_path == "eager loop"
            for fast in (True, "aot_eager"):
                chosen = greedy_maximize(objective, k, method, 1e-5, _generators(4), fast=fast)
                assert torch.equal(chosen, reference), (seed, k, fast)
            assert submodular.last_greedy_path == "fixed-shape step (aot_eager)"
    assert counters["graph_break"] == {}


def test_fixed_shape_greedy_step_reruns_like_the_eager_loop(monkeypatch, fresh_compiles):
    """A first run that evaluates too few gains (and a row that rejects every draw of a step)
    runs again on the fixed-shape path as on the eager one: the same sets."""
    monkeypatch.setattr(submodular, "_LAZY_EVALUATIONS", 1)
    monkeypatch.setattr(submodular_graph, "_BUCKET_FLOOR", 1)
    objective = random_objective(rows=3, n=120, dim=6, seed=3)
    runs = []
    original = submodular.fast_lazy_greedy

    def counted(*args, **kwargs):
        runs.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(submodular, "fast_lazy_greedy", counted)
    for k, epsilon in ((40, 1e-5), (100, 0.5)):
        reference = greedy_maximize(objective, k, "stochastic", epsilon, _generators(3), fast=False)
        runs.clear()
        chosen = greedy_maximize(objective, k, "stochastic", epsilon, _generators(3), fast="aot_eager")
        assert torch.equal(chosen, reference), k
        assert len(runs) > 1, "the case meant to rerun settled in one run"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("ordered", [True, False], ids=["stored-order", "positions"])
def test_fixed_shape_farthest_point_step_gives_the_eager_order(dtype, ordered, fresh_compiles):
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(6, 150, 16, generator=generator).to(dtype)
    candidates = torch.rand(6, 150, generator=generator) > 0.2
    candidates[2] = False
    candidates[2, :5] = True  # runs out of candidates: -1 after its 5th center
    positions = None if ordered else torch.randperm(150, generator=generator).expand(6, 150).contiguous()
    for count in (1, 40, 150):
        reference = farthest_point_order(keys, candidates, count, positions, fast=False)
        assert subgen_module.last_farthest_path == "eager loop"
        for fast in (True, "aot_eager"):
            assert torch.equal(farthest_point_order(keys, candidates, count, positions, fast=fast), reference)
        assert subgen_module.last_farthest_path == "fixed-shape step (aot_eager)"
    assert counters["graph_break"] == {}


def _layer(method: str, tokens: int, seed: int, **config):
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(2, 2, tokens, 16, generator=generator)
    queries = torch.randn(2, 4, 8, 16, generator=generator)
    scoring = scoring_inputs(queries, keys, torch.randn_like(keys))
    return make_policy(method, **config), scoring


@pytest.mark.parametrize(
    "method, config",
    [
        ("bumblebee", {}),
        ("bumblebee", {"greedy": "lazy"}),
        ("bumblebee-power", {}),
        ("subgen", {}),
    ],
)
def test_policies_keep_the_same_positions_on_the_fast_path(monkeypatch, method, config, fresh_compiles):
    """select_prefill with the fast path forced (traced with aot_eager) keeps what it keeps today."""
    kept = {}
    for fast in (False, "aot_eager"):
        monkeypatch.setattr(bumblebee_module, "greedy_maximize", functools.partial(greedy_maximize, fast=fast))
        monkeypatch.setattr(subgen_module, "farthest_point_order", functools.partial(farthest_point_order, fast=fast))
        kept[fast] = []
        for layer in range(2):
            policy, scoring = _layer(method, 200, seed=layer, **config)
            kept[fast].append(policy.select_prefill(scoring, 60, {}))
    for eager, fast in zip(kept[False], kept["aot_eager"], strict=True):
        assert torch.equal(eager, fast)


# -- (b) one compile per shape bucket: no recompilation across steps or layers ----------------------


def test_greedy_step_compiles_once_per_bucket_and_never_recompiles(fresh_compiles):
    with torch._dynamo.config.patch(error_on_recompile=True):
        for layer in range(3):  # three layers of the same shapes, different keys and draws
            objective = random_objective(rows=4, n=200, dim=12, seed=10 + layer, padding=False)
            reference = greedy_maximize(objective, 40, "stochastic", 1e-5, _generators(4, 7 * layer), fast=False)
            chosen = greedy_maximize(objective, 40, "stochastic", 1e-5, _generators(4, 7 * layer), fast="aot_eager")
            assert torch.equal(chosen, reference)
    buckets = len(submodular_graph._STEP_FUNCTIONS)
    assert 1 <= buckets <= 4  # 64, 128, ... up to the pool's width
    assert counters["stats"]["unique_graphs"] == buckets  # one graph per bucket, over 3 x 40 steps
    assert counters["graph_break"] == {}


def test_farthest_step_compiles_once_and_never_recompiles(fresh_compiles):
    with torch._dynamo.config.patch(error_on_recompile=True):
        for layer in range(3):
            generator = torch.Generator().manual_seed(layer)
            keys = torch.randn(4, 120, 16, generator=generator)
            candidates = torch.ones(4, 120, dtype=torch.bool)
            reference = farthest_point_order(keys, candidates, 50, fast=False)
            assert torch.equal(farthest_point_order(keys, candidates, 50, fast="aot_eager"), reference)
    assert counters["stats"]["unique_graphs"] == 1  # one graph for 3 layers x 50 steps
    assert counters["graph_break"] == {}


# -- (c) the work per step: eager dispatches vs the traced step vs inductor's kernels --------------


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _graphs_of(run) -> list[torch.fx.GraphModule]:
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module

    run(backend)
    return graphs


def _calls(graph_module) -> int:
    return sum(node.op == "call_function" for node in graph_module.graph.nodes)


def test_operations_per_step(fresh_compiles):
    """Aten operations per greedy step: the eager loop dispatches ~170 (8 rows x 1,024 elements,
    100 steps); the traced step is one graph of ~75 operations (what inductor fuses); SubGen's
    farthest-point step: ~16 dispatches eager, one graph of ~11 operations."""
    objective = random_objective(rows=8, n=1024, dim=32, seed=0, padding=False)
    k = 100
    counted = _CountOps()
    with counted:
        greedy_maximize(objective, k, "stochastic", 1e-5, _generators(8), fast=False)
    eager_per_step = counted.count / k
    graphs = _graphs_of(lambda backend: greedy_maximize(objective, k, "stochastic", 1e-5, _generators(8), fast=backend))
    traced = [_calls(graph) for graph in graphs]
    print(f"bumblebee: eager {eager_per_step:.1f} aten ops per step; traced step {traced} ops per graph")
    assert 100 < eager_per_step < 400
    assert len(graphs) == len(submodular_graph._STEP_FUNCTIONS) and max(traced) < eager_per_step

    keys = torch.randn(8, 1024, 32)
    candidates = torch.ones(8, 1024, dtype=torch.bool)
    counted = _CountOps()
    with counted:
        farthest_point_order(keys, candidates, 200, fast=False)
    eager_per_step = counted.count / 200
    graphs = _graphs_of(lambda backend: farthest_point_order(keys, candidates, 200, fast=backend))
    print(f"subgen: eager {eager_per_step:.1f} aten ops per step; traced step {_calls(graphs[0])} ops")
    assert len(graphs) == 1 and 5 < _calls(graphs[0]) <= eager_per_step < 40


def _launches(code: str) -> tuple[int, list[str]]:
    """Generated kernel calls and other operator calls (allocations aside) in inductor's code."""
    body = code[code.index("def call(") :]
    kernels = re.findall(r"^\s+(cpp_fused_\w+|triton_\w+)[\(\.]", body, re.M)
    others = re.findall(r"(extern_kernels\.\w+|(?:torch\.ops\.)?aten\.[\w.]+)\(", body)
    return len(kernels), [call for call in others if not re.search(r"empty|as_strided|reinterpret", call)]


def test_inductor_fuses_each_step_into_a_few_kernels(fresh_compiles):
    """Inductor (the CUDA path's compiler; C++ kernels here) makes each greedy step 3 generated
    kernels plus topk and scatter_reduce (5 calls, vs ~170 eager dispatches), and each
    farthest-point step 2 kernels plus the batched product (3 calls, vs ~16). On CUDA the
    split differs (triton fuses at fewer boundaries); tests_gpu/test_cuda.py runs the real one."""
    pytest.importorskip("torch._inductor")
    from torch._inductor.utils import run_and_get_code

    objective = random_objective(rows=4, n=256, dim=16, seed=0, padding=False)
    reference = greedy_maximize(objective, 30, "stochastic", 1e-5, _generators(4), fast=False)
    chosen, codes = run_and_get_code(
        lambda: greedy_maximize(objective, 30, "stochastic", 1e-5, _generators(4), fast="inductor")
    )
    assert torch.equal(chosen, reference)
    for code in codes:
        kernels, others = _launches(code)
        print(f"bumblebee step under inductor: {kernels} kernels + {others}")
        assert kernels + len(others) <= 12

    keys = torch.randn(4, 256, 16)
    candidates = torch.ones(4, 256, dtype=torch.bool)
    reference = farthest_point_order(keys, candidates, 40, fast=False)
    order, codes = run_and_get_code(lambda: farthest_point_order(keys, candidates, 40, fast="inductor"))
    assert torch.equal(order, reference)
    kernels, others = _launches(codes[0])
    print(f"subgen step under inductor: {kernels} kernels + {others}")
    assert kernels + len(others) <= 6


# -- the captured loops' bookkeeping (CUDA only), with the capture emulated on the CPU -------------


class _EmulatedCapture:
    """What ``_LoopGraph`` does, without CUDA: its input buffers made by ``capture_buffers`` (copies,
    shared with an earlier capture of these shapes, or donated), the inputs copied in at each call
    (unless they live there already), the loop run on them."""

    made = 0

    def __init__(self, inputs, steps, functions, buffers=None, donated=()):
        type(self).made += 1
        self.inputs = submodular_graph.capture_buffers(inputs, buffers, donated)
        self.steps, self.functions = steps, functions

    def __call__(self, inputs):
        for name, value in inputs.items():
            if self.inputs[name].data_ptr() != value.data_ptr():
                self.inputs[name].copy_(value)
        return submodular_graph._run_loop(self.inputs, self.steps, self.functions)


def test_layers_replay_a_capture_whose_buckets_cover_theirs(monkeypatch, fresh_compiles):
    """Layers of one shape replay a captured loop whose gain buckets are all at least their own; a
    layer needing more captures the larger bucket of each step of its own and the latest capture's,
    so the captures settle; every layer keeps the eager loop's set; similarity_buffer hands out the
    latest capture's matrix, and a layer computed into it is not copied."""
    monkeypatch.setattr(submodular, "captures_loops", lambda device: True)
    monkeypatch.setattr(submodular_graph, "_LoopGraph", _EmulatedCapture)
    monkeypatch.setattr(submodular_graph, "CAPTURED_LOOPS", CapturedLoops(held=2))
    _EmulatedCapture.made = 0
    assert submodular_graph.similarity_buffer(4, 300, "cpu") is None
    for layer in range(6):
        objective = random_objective(rows=4, n=300, dim=12, seed=20 + layer, padding=False)
        reference = greedy_maximize(objective, 60, "stochastic", 1e-5, _generators(4, 11 * layer), fast=False)
        chosen = greedy_maximize(objective, 60, "stochastic", 1e-5, _generators(4, 11 * layer), fast=True)
        assert torch.equal(chosen, reference), layer
        assert submodular.last_greedy_path == "fixed-shape step (eager), whole loop as one CUDA graph"
    assert 1 <= _EmulatedCapture.made <= 3 < 6
    assert len(submodular_graph.CAPTURED_LOOPS.graphs) <= submodular_graph.CAPTURED_LOOPS.held
    # The captures of one shape share their input buffers: one similarity matrix between them.
    assert len({graph.inputs["sim"].data_ptr() for graph in submodular_graph.CAPTURED_LOOPS.graphs.values()}) == 1
    buffer = submodular_graph.similarity_buffer(4, 300, "cpu")
    latest = list(submodular_graph.CAPTURED_LOOPS.graphs.values())[-1]
    assert buffer is not None and buffer.data_ptr() == latest.inputs["sim"].data_ptr()
    # A layer whose matrix was computed into the buffer: the same set, and the buffer is its matrix.
    objective = random_objective(rows=4, n=300, dim=12, seed=40, padding=False)
    buffer.copy_(objective.sim)
    in_buffer = submodular.Mixture(buffer, objective.weights, objective.valid, objective.lam, objective.phi)
    reference = greedy_maximize(objective, 60, "stochastic", 1e-5, _generators(4, 99), fast=False)
    assert torch.equal(greedy_maximize(in_buffer, 60, "stochastic", 1e-5, _generators(4, 99), fast=True), reference)


class _SlowEmulatedCapture(_EmulatedCapture):
    """An emulated capture that waits between copying a call's inputs in and running on them: a
    second thread using the shared buffers meanwhile would overwrite them (a real replay is
    asynchronous, so the window is the whole replay)."""

    def __call__(self, inputs):
        for name, value in inputs.items():
            if self.inputs[name].data_ptr() != value.data_ptr():
                self.inputs[name].copy_(value)
        time.sleep(0.02)
        return submodular_graph._run_loop(self.inputs, self.steps, self.functions)


def test_threads_replaying_the_shared_captures_get_their_own_sets(monkeypatch, fresh_compiles):
    """Four threads select at once with objectives of one shape (one capture bucket between them),
    two of them as BumbleBee does on CUDA: the matrix computed into the captured loop's own buffer
    (similarity_buffer), then the greedy replaying it. Each gets its eager set: the captures and their
    buffers are used one thread at a time (static_step.CapturedLoops)."""
    monkeypatch.setattr(submodular, "captures_loops", lambda device: True)
    monkeypatch.setattr(submodular_graph, "_LoopGraph", _SlowEmulatedCapture)
    monkeypatch.setattr(submodular_graph, "CAPTURED_LOOPS", CapturedLoops(held=2))
    objectives = [random_objective(rows=4, n=200, dim=12, seed=70 + index, padding=False) for index in range(4)]
    references = [
        greedy_maximize(objective, 40, "stochastic", 1e-5, _generators(4, index), fast=False)
        for index, objective in enumerate(objectives)
    ]
    # Sets that differ from thread to thread, or a mix-up would go unseen.
    assert len({tuple(reference.flatten().tolist()) for reference in references}) == 4

    def select(index):
        chosen = []
        for _ in range(3):
            objective = objectives[index]
            if index % 2:  # BumbleBee's flow: the matrix written into the shared buffer first
                with submodular_graph.CAPTURED_LOOPS.using("cpu"):
                    buffer = submodular_graph.similarity_buffer(4, 200, "cpu")
                    if buffer is not None:
                        buffer.copy_(objective.sim)
                        time.sleep(0.01)
                        objective = submodular.Mixture(
                            buffer, objective.weights, objective.valid, objective.lam, objective.phi
                        )
                    chosen.append(greedy_maximize(objective, 40, "stochastic", 1e-5, _generators(4, index), fast=True))
            else:
                chosen.append(greedy_maximize(objective, 40, "stochastic", 1e-5, _generators(4, index), fast=True))
        return chosen

    for index, chosen in run_in_threads(select, 4).items():
        assert all(torch.equal(one, references[index]) for one in chosen), index


def test_threads_running_bumblebee_on_the_shared_captures_keep_their_own_tokens(monkeypatch, fresh_compiles):
    """BumbleBee's prefill on the (emulated) CUDA path in four threads at once, layers of one shape:
    each computes its matrix into the captured loop's buffer and replays; each keeps what it keeps
    alone on the eager path. (A pause after computing the matrix widens the window in which another
    thread could overwrite it before the replay reads it: select_prefill holds the captures over it.)"""

    layers = [_layer("bumblebee", 200, seed=30 + index) for index in range(4)]
    references = [policy.select_prefill(scoring, 60, {}) for policy, scoring in layers]
    assert len({tuple(reference.flatten().tolist()) for reference in references}) == 4
    _emulate_bumblebee_captures(monkeypatch, _SlowEmulatedCapture)
    similarity = bumblebee_module.relu_cosine_similarity_rows

    def similarity_then_pause(*args, **kwargs):
        result = similarity(*args, **kwargs)
        time.sleep(0.02)
        return result

    monkeypatch.setattr(bumblebee_module, "relu_cosine_similarity_rows", similarity_then_pause)

    def select(index):
        policy, scoring = layers[index]
        return [policy.select_prefill(scoring, 60, {}) for _ in range(3)], submodular.last_greedy_path

    for index, (kept, path) in run_in_threads(select, 4).items():
        assert all(torch.equal(one, references[index]) for one in kept), index
        assert path == "fixed-shape step (eager), whole loop as one CUDA graph"  # the thread's own


def test_threads_replaying_the_shared_farthest_point_captures_get_their_own_orders(monkeypatch, fresh_compiles):
    """SubGen's captured farthest-point loops, shared likewise: four threads, keys of one shape."""

    class SlowCapture:  # subgen._FarthestGraph without CUDA, waiting between copy-in and run
        def __init__(self, run, inputs):
            self.inputs = tuple(value.clone() for value in inputs)
            self.run = run

        def __call__(self, inputs):
            for mine, value in zip(self.inputs, inputs, strict=True):
                mine.copy_(value)
            time.sleep(0.02)
            return self.run(*self.inputs).clone()

    monkeypatch.setattr(subgen_module, "_FarthestGraph", SlowCapture)
    monkeypatch.setattr(subgen_module, "CAPTURED_LOOPS", CapturedLoops(held=2))
    generator = torch.Generator().manual_seed(5)
    keys = [torch.randn(4, 128, 16, generator=generator) for _ in range(4)]
    candidates = torch.ones(4, 128, dtype=torch.bool)
    references = [farthest_point_order(key, candidates, 30, fast=False) for key in keys]
    assert len({tuple(reference.flatten().tolist()) for reference in references}) == 4

    def order(index):
        orders = []
        for _ in range(3):  # farthest_point_order's fast path with capture=True (CUDA's), step eager
            key = keys[index]
            start = torch.full((4, 30), -1, dtype=torch.long)
            nearest = torch.where(candidates, float("inf"), float("-inf"))
            first = candidates.to(torch.int8).argmax(-1)
            squares = (key * key).sum(-1)
            orders.append(subgen_module._farthest_loop(key, squares, start, nearest, first, 30, None, True))
        return orders

    for index, orders in run_in_threads(order, 4).items():
        assert all(torch.equal(one, references[index]) for one in orders), index


def test_each_thread_reads_the_path_its_own_last_call_took():
    """``last_greedy_path`` / ``last_farthest_path`` answer for the calling thread: two threads
    take different paths, both finish before either reads, and each reads its own (one module-wide
    value would give both the later writer's)."""
    objective = random_objective(rows=2, n=40, dim=8, seed=3)
    keys = torch.randn(2, 40, 8, generator=torch.Generator().manual_seed(4))
    candidates = torch.ones(2, 40, dtype=torch.bool)
    both_ran = threading.Barrier(2, timeout=120)  # a thread that fails breaks it instead of hanging the other

    def work(index):
        fast = index == 1  # thread 1: the fixed-shape step (eager on the CPU); thread 0: the eager loop
        greedy_maximize(objective, 5, "lazy", 1e-5, _generators(2), fast=fast)
        farthest_point_order(keys, candidates, 5, fast=fast)
        both_ran.wait()
        return submodular.last_greedy_path, subgen_module.last_farthest_path

    paths = run_in_threads(work, 2)
    assert paths[0] == ("eager loop", "eager loop")
    assert paths[1] == ("fixed-shape step (eager)", "fixed-shape step (eager)")
    # The module attribute is still settable (a benchmark clears it) and reads back in this thread.
    submodular.last_greedy_path = None
    assert submodular.last_greedy_path is None


def test_a_second_call_adds_per_thread_attributes_and_keeps_the_first():
    """``per_thread_attributes`` called twice on one module: both names stay per thread (a second
    call that replaced the module's class would turn the first name back into nothing)."""
    import sys
    import types

    from kvhive.static_step import per_thread_attributes

    module = types.ModuleType("kvhive_per_thread_probe")
    sys.modules[module.__name__] = module
    try:
        per_thread_attributes(module.__name__, "first")
        per_thread_attributes(module.__name__, "second")
        module.first, module.second = "main first", "main second"
        both_set = threading.Barrier(2)

        def work(index):
            module.first, module.second = f"first {index}", f"second {index}"
            both_set.wait()
            return module.first, module.second

        assert run_in_threads(work, 2) == {0: ("first 0", "second 0"), 1: ("first 1", "second 1")}
        assert (module.first, module.second) == ("main first", "main second")
    finally:
        del sys.modules[module.__name__]


def test_released_captures_free_their_buffers_and_capture_again(monkeypatch, fresh_compiles):
    """static_step.release_captured_loops() drops the captured loops (their similarity matrix
    with them); the next selection of that shape captures again and keeps the same set."""
    from kvhive import static_step

    monkeypatch.setattr(submodular, "captures_loops", lambda device: True)
    monkeypatch.setattr(submodular_graph, "_LoopGraph", _EmulatedCapture)
    monkeypatch.setattr(submodular_graph, "CAPTURED_LOOPS", CapturedLoops(held=2))
    _EmulatedCapture.made = 0
    objective = random_objective(rows=4, n=300, dim=12, seed=50, padding=False)
    reference = greedy_maximize(objective, 60, "stochastic", 1e-5, _generators(4, 5), fast=False)
    assert torch.equal(greedy_maximize(objective, 60, "stochastic", 1e-5, _generators(4, 5), fast=True), reference)
    assert _EmulatedCapture.made == 1 and submodular_graph.similarity_buffer(4, 300, "cpu") is not None
    assert static_step.release_captured_loops() >= 1
    assert not submodular_graph.CAPTURED_LOOPS.graphs and submodular_graph.similarity_buffer(4, 300, "cpu") is None
    assert torch.equal(greedy_maximize(objective, 60, "stochastic", 1e-5, _generators(4, 5), fast=True), reference)
    assert _EmulatedCapture.made == 2


def test_similarity_written_into_a_buffer_is_the_same_matrix():
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(3, 100, 16, generator=generator)
    valid = torch.rand(3, 100, generator=generator) > 0.1
    out = torch.empty(3, 100, 100)
    sim = submodular.relu_cosine_similarity(keys, valid, out=out)
    assert sim.data_ptr() == out.data_ptr()
    assert torch.equal(out, submodular.relu_cosine_similarity(keys, valid))


def _emulate_bumblebee_captures(monkeypatch, capture=None):
    """BumbleBee's prefill on the CUDA fast path, its captures emulated on the CPU (``capture``: the
    emulating class, _EmulatedCapture by default)."""
    from kvhive import static_step

    capture = capture or _EmulatedCapture
    monkeypatch.setattr(static_step.config, "prefill_fast_path", True)
    monkeypatch.setattr(submodular, "captures_loops", lambda device: True)
    monkeypatch.setattr(bumblebee_module, "captures_loops", lambda device: True)
    monkeypatch.setattr(submodular_graph, "_LoopGraph", capture)
    monkeypatch.setattr(submodular_graph, "CAPTURED_LOOPS", CapturedLoops(held=2))
    monkeypatch.setattr(bumblebee_module, "CAPTURED_LOOPS", submodular_graph.CAPTURED_LOOPS)
    capture.made = 0


def test_a_new_capture_keeps_the_matrix_bumblebee_computed_instead_of_a_copy(monkeypatch, fresh_compiles):
    """The first layer of a shape computes its similarity matrix into a tensor of its own and donates it:
    the capture keeps that tensor as its input buffer (one R x n x n matrix held, not two), and the next
    layer computes its matrix into it. Both keep the eager path's tokens."""
    layers = [_layer("bumblebee", 200, seed=60 + index) for index in range(2)]
    references = [policy.select_prefill(scoring, 60, {}) for policy, scoring in layers]
    _emulate_bumblebee_captures(monkeypatch)
    computed = []  # (written into a given buffer, the matrix's address) per call
    similarity = bumblebee_module.relu_cosine_similarity_rows

    def recorded(keys, valid, out=None):
        result = similarity(keys, valid, out)
        computed.append((out is not None, result[0].data_ptr()))
        return result

    monkeypatch.setattr(bumblebee_module, "relu_cosine_similarity_rows", recorded)
    for (policy, scoring), reference in zip(layers, references, strict=True):
        assert torch.equal(policy.select_prefill(scoring, 60, {}), reference)
    assert _EmulatedCapture.made >= 1
    held = {graph.inputs["sim"].data_ptr() for graph in submodular_graph.CAPTURED_LOOPS.graphs.values()}
    assert computed == [(False, computed[0][1]), (True, computed[0][1])]
    assert held == {computed[0][1]}


def test_large_captured_loops_are_dropped_at_the_end_of_the_forward(monkeypatch, fresh_compiles):
    """A model forward whose BumbleBee prefill captured its greedy: captures whose buffers hold more
    than HELD_LOOP_BYTES are dropped when the forward ends (not held through the decode), smaller
    ones kept for the next prompt; a thread using the captures is never waited for."""
    import threading

    import kvhive
    from kvhive import static_step
    from kvhive.compat import cache_kwarg
    from kvhive.models import tiny_model

    _emulate_bumblebee_captures(monkeypatch)
    model = tiny_model("llama", "gqa")
    ids = torch.randint(3, model.config.vocab_size, (1, 160), generator=torch.Generator().manual_seed(0))

    def prefill():
        with torch.no_grad():
            model(input_ids=ids, **{cache_kwarg(model): kvhive.make_cache(model, "bumblebee", budget=48)})

    prefill()
    assert _EmulatedCapture.made >= 1 and submodular_graph.CAPTURED_LOOPS.graphs  # small: kept
    held = max(static_step._held_bytes(graph) for graph in submodular_graph.CAPTURED_LOOPS.graphs.values())
    assert held >= 4 * 160 * 160 // 2  # the R x n x n float32 matrix among them
    monkeypatch.setattr(static_step, "HELD_LOOP_BYTES", held - 1)
    inside, leave = threading.Event(), threading.Event()

    def hold():
        with submodular_graph.CAPTURED_LOOPS.using("cpu"):
            inside.set()
            leave.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    inside.wait(10)
    try:
        assert static_step.release_captured_loops(larger_than=held - 1, wait=False) == 0
        assert submodular_graph.CAPTURED_LOOPS.graphs
    finally:
        leave.set()
        holder.join()
    prefill()
    assert not submodular_graph.CAPTURED_LOOPS.graphs


def test_every_layer_chunks_its_rows_as_the_first_beside_the_matrix_a_capture_holds(monkeypatch, fresh_compiles):
    """On CUDA the rows per chunk come from the device's room, which no longer counts the matrix the
    first layer's capture holds: that matrix is counted back (held_similarity_bytes), so every layer of
    the prompt takes all 4 rows at once as the first did (without it the second would take 2, a new
    shape, a new capture and matrix), and keeps the eager path's tokens."""
    layers = [_layer("bumblebee", 200, seed=70 + index) for index in range(3)]
    references = [policy.select_prefill(scoring, 60, {}) for policy, scoring in layers]
    _emulate_bumblebee_captures(monkeypatch)
    candidates = 200 - make_policy("bumblebee").split(60)[1]
    whole = 2 * 4 * 4 * candidates * candidates + 1  # room for 4 rows' float32 matrices, twice over

    def device_room(device):  # the driver's view: what the captures hold is not free
        held = {
            graph.inputs["sim"].untyped_storage().data_ptr(): graph.inputs["sim"].untyped_storage().nbytes()
            for graph in submodular_graph.CAPTURED_LOOPS.graphs.values()
        }
        return whole - sum(held.values())

    monkeypatch.setattr(bumblebee_module, "_device_room", device_room)
    rows = []
    record_greedy_calls(monkeypatch, bumblebee_module, lambda objective: rows.append(objective.rows))
    for (policy, scoring), reference in zip(layers, references, strict=True):
        assert torch.equal(policy.select_prefill(scoring, 60, {}), reference)
    assert rows == [4, 4, 4]
