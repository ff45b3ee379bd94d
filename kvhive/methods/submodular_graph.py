"""The GPU fast path of lazy / stochastic greedy: one fixed-shape step, compiled and captured.

The eager loop (``kvhive.methods.submodular._lazy_greedy``) is the reference: on the CPU it runs
as it is. On a GPU it is launch-bound (a greedy step is a few hundred small dispatches, a layer
hundreds of steps). The fast path runs the same greedy as ``k`` calls of one pure
step function of fixed-shape tensors (state in, state out): no host read, no Python branch on a
value, no shape that depends on the step. The step's varying inputs (the step's draws, their
population and offset, whether a row evaluates everything) are rows of ``[k, R]`` tables picked
by a 0-d step tensor, and every step's pool has the run's widest width ``W`` (draws beyond a
row's own ``d`` are ineligible, as the columns beyond a row's draws already are in the eager
loop). The exact gains a step evaluates are bucketed to a power of two (at least the eager
loop's count, at most ``W``): evaluating more than needed changes only the stale bounds left
behind, which stay upper bounds, and a settled step picks the exact argmax (lowest index among
ties) whatever was evaluated, so the kept sets are the eager loop's (tests/methods/test_greedy_graph.py).
On CUDA the step is compiled with inductor (``fullgraph=True, dynamic=False``: its kernels fuse
into a few) when torch compiles kvhive, and the whole loop of ``k`` steps is captured once
as a CUDA graph per shape bucket and replayed for every later layer of the same shapes.
"""

from __future__ import annotations

import itertools
import types
from typing import TYPE_CHECKING

import torch

from kvhive import static_step
from kvhive.methods import greedy_kernel
from kvhive.methods.submodular_objective import PADDING_GAIN, Concave, Mixture
from kvhive.static_step import BoundedCache, CapturedLoops, capture_stream

if TYPE_CHECKING:
    from kvhive.methods.submodular import StochasticSampler

# Exact gains a greedy step evaluates beyond its fresh draws, on the eager loop and here
# (``kvhive.methods.submodular`` starts its runs from it).
LAZY_EVALUATIONS = 64
# Smallest bucket of exact gains per step (the eager loop's margin).
_BUCKET_FLOOR = LAZY_EVALUATIONS
# Compiled step functions: one per (backend, input shapes, bucket of exact gains per step, static
# flags), the oldest dropped past 64; each has its own code object, so a second bucket or shape is a
# first compile of its own, not a recompile of another (dynamo caches per code object;
# tests/methods/test_greedy_graph.py runs under error_on_recompile).
_STEP_FUNCTIONS = BoundedCache(held=64)
# Captured whole loops on CUDA, by shape bucket (few entries: a model's layers share their shapes),
# shared by the process's threads one at a time (their input buffers are shared).
CAPTURED_LOOPS = CapturedLoops(held=2)


def _bucket(count: int, width: int) -> int:
    """Exact gains a fast step evaluates: the power of two at or above ``count`` (at least
    ``_BUCKET_FLOOR``), at most the pool's width."""
    return min(width, max(_BUCKET_FLOOR, 1 << max(0, int(count) - 1).bit_length()))


def _greedy_step(
    inputs: dict[str, torch.Tensor],
    state: tuple[torch.Tensor, ...],
    step: torch.Tensor,
    *,
    width: int,
    count: int,
    sampled: bool,
    any_full: bool,
    lam: float,
    phi: Concave,
) -> tuple[torch.Tensor, ...]:
    """One greedy step of the eager loop (``kvhive.methods.submodular._lazy_greedy``) as a pure function of fixed-shape tensors.

    ``state`` = ``(chosen, coverage, mass, phi_mass, facility_bounds, consumed, evaluated_enough,
    drew_enough, needed)``; ``step`` a 0-d long tensor; ``width`` the pool's width (``n`` where a
    row may evaluate everything), ``count`` the exact gains evaluated (``<= width``). Every
    branch is on these static values only."""
    del lam  # the two terms' weights are in facility_scale / feature_scale
    chosen, coverage, mass, phi_mass, facility_bounds, consumed, evaluated_enough, drew_enough, needed = state
    sim_flat, weights, valid = inputs["sim"], inputs["weights"], inputs["valid"]
    rows, n = valid.shape
    device = valid.device
    row_index = torch.arange(rows, device=device)
    everything = torch.arange(n, device=device).expand(rows, n)
    from_valid = inputs["valid_count"] > step  # padding only once no valid element is left
    if sampled:
        pick_step = step.view(1)
        draws = inputs["draws"].index_select(0, pick_step).squeeze(0)
        population = inputs["population"].index_select(0, pick_step).squeeze(0)
        offset = inputs["offset"].index_select(0, pick_step).squeeze(0)
        full = inputs["full"].index_select(0, pick_step).squeeze(0)
        stream, tries = inputs["stream"], inputs["tries"]
        column = torch.arange(width, device=device)
        index = consumed[:, None, None] + tries[None, :, None] * draws[:, None, None] + column
        values = stream.gather(1, index.clamp(max=stream.shape[1] - 1).view(rows, -1)).view(rows, -1, width)
        drawn = (values * population[:, None, None]).long().clamp(max=n - 1) + offset[:, None, None]
        pool = inputs["valid_first"].gather(1, drawn.view(rows, -1)).view(rows, -1, width)
        eligible = ~chosen.gather(1, pool.view(rows, -1)).view(rows, -1, width) & (column < draws[:, None])[:, None]
        attempt = eligible.any(dim=-1).int().argmax(dim=-1)  # the first attempt holding an eligible element
        pick = attempt[:, None, None].expand(rows, 1, width)
        consumed = consumed + torch.where(full, 0, (attempt + 1) * draws)
        pool, eligible = pool.gather(1, pick).squeeze(1), eligible.gather(1, pick).squeeze(1)
        if any_full:  # width == n: the rows that evaluate everything take every element
            everyone = ~chosen & (valid == from_valid[:, None])
            pool = torch.where(full[:, None], everything, pool)
            eligible = torch.where(full[:, None], everyone, eligible)
        drew_enough = drew_enough & eligible.any(dim=-1).all()
        # Each element once (a repeat's bound would tie with its own exact gain).
        first = torch.full((rows, n), width, dtype=torch.long, device=device)
        first = first.scatter_reduce(1, pool, torch.where(eligible, column, width), "amin")
        eligible = eligible & (first.gather(1, pool) == column)
    else:
        pool = everything
        eligible = ~chosen & (valid == from_valid[:, None])
    facility_scale, feature_scale = inputs["facility_scale"], inputs["feature_scale"]
    phi_mass_now = phi_mass[:, None]

    def feature_gains(elements: torch.Tensor) -> torch.Tensor:
        added = weights.gather(1, elements)
        return phi.gain(mass[:, None], added, phi_mass_now) * feature_scale[:, None]

    pool_feature = feature_gains(pool)
    bounds = (facility_bounds.gather(1, pool) + pool_feature).masked_fill(~valid.gather(1, pool), PADDING_GAIN)
    bounds = bounds.masked_fill(~eligible, float("-inf"))
    top = bounds.topk(min(count + 1, width), dim=-1)
    candidates = top.indices[:, :count]
    elements = pool.gather(1, candidates)
    similarity = sim_flat.index_select(0, (row_index[:, None] * n + elements).reshape(-1)).view(rows, count, n)
    facility = (similarity - coverage[:, None, :]).clamp(min=0).sum(dim=-1).double() * facility_scale[:, None]
    facility_bounds = facility_bounds.scatter(1, elements, facility)
    exact = (facility + pool_feature.gather(1, candidates)).masked_fill(~valid.gather(1, elements), PADDING_GAIN)
    exact = exact.masked_fill(top.values[:, :count] == float("-inf"), float("-inf"))
    best = exact.amax(dim=-1)
    picks = torch.where(exact == best[:, None], elements, n).amin(dim=-1)
    if width > count:
        following = top.values[:, count]
        settled = (best > following) | (following == float("-inf")) | ~from_valid
        evaluated_enough = evaluated_enough & settled.all()
        need = ((bounds >= best[:, None]) & from_valid[:, None]).sum(dim=-1).amax()
        needed = needed.index_copy(0, step.view(1), need.view(1))
    padding_pick = torch.where(eligible, pool, n).amin(dim=-1)
    picks = torch.where(from_valid, picks, padding_pick).clamp(max=n - 1)
    # Add the picks to S.
    chosen = chosen.scatter(1, picks[:, None], True)
    coverage = torch.maximum(coverage, sim_flat.index_select(0, row_index * n + picks))
    mass = mass + weights.gather(1, picks[:, None]).squeeze(1)
    phi_mass = phi(mass)
    return chosen, coverage, mass, phi_mass, facility_bounds, consumed, evaluated_enough, drew_enough, needed


def _step_function(backend, shape: tuple, **static):
    """The step with its static arguments bound, compiled with ``backend`` (None: eager); cached
    per (backend, input shapes, static arguments), each compiled entry on a code object of its
    own: a new bucket or shape (another prompt length) is a first compile of its own, not a
    recompile of another (dynamo caches per code object; ``dynamic=False`` compiles every shape)."""
    key = (backend, shape, tuple(sorted(static.items())))
    return _STEP_FUNCTIONS.get(key, lambda number: _new_step_function(number, backend, static))


def _new_step_function(number: int, backend, static: dict):
    if backend is None:

        def function(inputs, state, step):
            return _greedy_step(inputs, state, step, **static)

        return function
    code = _greedy_step.__code__.replace(co_name=f"_greedy_step_{number}")
    body = types.FunctionType(code, _greedy_step.__globals__, code.co_name, None, None)
    body.__kwdefaults__ = dict(static)
    return torch.compile(body, backend=backend, fullgraph=True, dynamic=False)


def _static_inputs(objective: Mixture, sampler: StochasticSampler | None, attempts: int) -> dict[str, torch.Tensor]:
    """The loop's fixed inputs (the objective, the sampler's tables and stream), by name."""
    valid = objective.valid
    inputs = {
        "sim": objective.sim.view(-1, objective.size),
        "weights": objective.weights,
        "valid": valid,
        "valid_count": valid.sum(dim=-1),
        "facility_scale": objective.facility_scale,
        "feature_scale": objective.feature_scale,
        "facility_bounds": objective.row_sums.double() * objective.facility_scale[:, None],
    }
    if sampler is not None:
        inputs.update(
            draws=sampler.draws,
            population=sampler.population,
            offset=sampler.offset,
            full=sampler.full,
            valid_first=sampler.valid_first,
            stream=sampler.streams(attempts),
            tries=torch.arange(attempts, device=valid.device),
        )
    return inputs


def _initial_state(inputs: dict[str, torch.Tensor], k: int) -> tuple[torch.Tensor, ...]:
    valid = inputs["valid"]
    rows, n = valid.shape
    device = valid.device
    true = torch.ones((), dtype=torch.bool, device=device)
    return (
        torch.zeros(rows, n, dtype=torch.bool, device=device),  # chosen
        inputs["sim"].new_zeros(rows, n),  # coverage
        inputs["weights"].new_zeros(rows),  # mass
        inputs["weights"].new_zeros(rows),  # phi_mass
        inputs["facility_bounds"].clone(),  # stale facility gains
        torch.zeros(rows, dtype=torch.long, device=device),  # stream values consumed
        true.clone(),  # evaluated enough
        true.clone(),  # drew enough
        torch.zeros(k, dtype=torch.long, device=device),  # needed
    )


def _run_loop(inputs, steps: list[torch.Tensor], functions: list) -> tuple[torch.Tensor, ...]:
    state = _initial_state(inputs, len(functions))
    for function, step in zip(functions, steps, strict=True):
        state = function(inputs, state, step)
    return state


class _LoopGraph:
    """The whole loop of one shape bucket captured as one CUDA graph: fixed input buffers (each
    call copies the layer's inputs in, unless they already live there) and the final state.
    ``buffers``: the input buffers of an earlier capture of the same shapes, shared (replays run
    one at a time), so that the captures of one shape hold one similarity matrix between them."""

    def __init__(self, inputs, steps, functions, buffers=None, donated=()):
        self.inputs = capture_buffers(inputs, buffers, donated)  # the warm-up runs on this layer's inputs
        self.steps = steps
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up on a side stream, as torch.cuda.graph asks
            _run_loop(self.inputs, steps, functions)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=capture_stream(), capture_error_mode="thread_local"):
            self.state = _run_loop(self.inputs, steps, functions)

    def __call__(self, inputs) -> tuple[torch.Tensor, ...]:
        for name, value in inputs.items():
            mine = self.inputs[name]
            if mine.data_ptr() != value.data_ptr():
                mine.copy_(value)
        self.graph.replay()
        return tuple(value.clone() for value in self.state)


def capture_buffers(
    inputs: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor] | None, donated: tuple[str, ...] = ()
) -> dict[str, torch.Tensor]:
    """The input buffers of a new capture, holding ``inputs``: ``buffers`` (an earlier capture's of
    the same shapes, shared) with the inputs copied in where they do not live there already; else
    copies of the inputs, except those named in ``donated``, which the caller gives up and the
    capture keeps as they are (BumbleBee's freshly computed similarity matrix: one ``R x n x n``
    matrix held instead of two, each ``4 R n^2`` bytes)."""
    if buffers is None:
        return {name: value if name in donated else value.clone() for name, value in inputs.items()}
    for name, value in inputs.items():
        if buffers[name].data_ptr() != value.data_ptr():
            buffers[name].copy_(value)
    return buffers


def captures_loops(device: torch.device) -> bool:
    """Whether the fast path captures its loop as a CUDA graph on ``device`` (on CUDA)."""
    return device.type == "cuda"


def similarity_buffer(rows: int, n: int, device) -> torch.Tensor | None:
    """The ``[rows, n, n]`` similarity matrix a captured greedy loop of these shapes reads (the
    latest such capture; None when there is none): a caller that computes the next layer's matrix
    into it (:func:`relu_cosine_similarity_rows`'s ``out``) saves the replay its copy of the
    matrix (``R n^2`` float32) and holds one matrix, not two. The
    matrix is overwritten by the next layer that does so: use it before computing the next, and
    inside ``CAPTURED_LOOPS.using(device)``, held from this call until the last read of the matrix
    (the greedy's replay included), so that no other thread writes or replays it meanwhile."""
    device = torch.device(device)
    with CAPTURED_LOOPS.using(device) as graphs:
        for key in reversed(list(graphs)):
            sim = graphs[key].inputs["sim"]
            if sim.device == device and tuple(sim.shape) == (rows * n, n):
                return sim.view(rows, n, n)
    return None


def held_similarity_bytes(n: int, device) -> int:
    """Bytes of the similarity matrices of ``n`` elements that captured greedy loops hold on ``device``
    (each shared buffer once): memory a layer of those shapes reuses (:func:`similarity_buffer`),
    which the device no longer counts as free."""
    device = torch.device(device)
    held = {}
    with CAPTURED_LOOPS.using(device) as graphs:
        for graph in graphs.values():
            sim = graph.inputs["sim"]
            if sim.device == device and sim.shape[-1] == n:
                storage = sim.untyped_storage()
                held[storage.data_ptr()] = storage.nbytes()
    return sum(held.values())


def fast_backend(fast) -> str | None:
    """The backend compiling the step: ``fast`` when it names one; on CUDA inductor where
    ``kvhive.static_step.config.prefill_compile``; else None (the step runs eagerly, still captured on
    CUDA). The step is a pure tensor function: no attention switch to trace, so it compiles on every
    torch kvhive runs on (the decode step's gate, ``TORCH_COMPILES_KVHIVE``, plays no part; torch 2.11
    checked by hand with tests/methods/test_greedy_graph.py)."""
    if fast is not True:
        return fast
    return prefill_compile_backend()


def prefill_compile_backend() -> str | None:
    """The backend of the prefill selections' fixed-shape steps (BumbleBee's greedy step, SubGen's
    farthest-point step) on the fast path: inductor where ``static_step.config.prefill_compile``, else
    None (eager). On every torch kvhive runs on: the steps are pure functions of fixed-shape tensors
    with no attention switch to trace, so the decode step's gate (``static_step.TORCH_COMPILES_KVHIVE``,
    torch >= ``static_step.COMPILE_MIN_TORCH``) is deliberately not consulted
    (tests/methods/test_prefill_compile_gate.py runs this under a patched older torch)."""
    return "inductor" if static_step.config.prefill_compile else None


# The fast path's name for BumbleBee's Triton step (``fast="triton"``; on CUDA by default).
KERNEL_BACKEND = "triton"


def uses_kernel(fast, objective: Mixture, sampled: bool) -> bool:
    """Whether the fast path runs the greedy on :mod:`kvhive.methods.greedy_kernel`: asked by name
    (``fast="triton"``), or by default (``fast`` True) on CUDA where ``static_step.config.prefill_kernels``,
    for stochastic greedy (every drawn element evaluated: a lazy greedy's pool is every element) and
    where Triton runs; never inside a caller's trace or capture (there the steps join the caller's graph)."""
    if fast == KERNEL_BACKEND:
        if not greedy_kernel.kernel_supports(objective.sim):
            raise ValueError(
                f"fast={KERNEL_BACKEND!r}: the Triton greedy step needs Triton on a CUDA device (or TRITON_INTERPRET=1) "
                f"and a contiguous float32 similarity; got {objective.sim.dtype} on {objective.sim.device}"
            )
        return True
    return (
        fast is True
        and sampled
        and objective.sim.device.type == "cuda"
        and static_step.config.prefill_kernels
        and not static_step.in_static_step()
        and greedy_kernel.kernel_supports(objective.sim)
    )


def kernel_greedy(
    objective: Mixture,
    k: int,
    sampler: StochasticSampler | None,
    attempts: int,
    capture: bool,
    donated: tuple[str, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
    """The eager loop's run on :func:`greedy_kernel.greedy_kernel_step` (two launches a step, all rows
    at once): its ``(chosen, enough, needed)`` and the path taken. Every drawn element is evaluated,
    so every step settles (``needed`` zeros). ``capture``: the loop captured as one CUDA graph per
    shape, replayed by later layers of those shapes (as :func:`fast_lazy_greedy`'s)."""
    n = objective.size
    sampled = sampler is not None and not all(sampler.all_full)
    widths = list(sampler.width) if sampled else [n] * k
    inputs = _static_inputs(objective, sampler if sampled else None, attempts)
    inputs["constants"] = greedy_kernel.kernel_constants(objective.phi, objective.sim.device)
    functions = [
        _kernel_step(width=width, sampled=sampled, any_full=sampled and width == n, phi=objective.phi)
        for width in widths
    ]
    steps = list(range(k))
    label = "greedy kernel (triton)"
    if not capture:
        state = _run_loop(inputs, steps, functions)
    else:
        device = objective.sim.device
        shape = tuple((name, tuple(value.shape), value.dtype) for name, value in inputs.items())
        key = ((device, KERNEL_BACKEND, k, shape, tuple(widths), sampled, objective.phi), ())
        with CAPTURED_LOOPS.using(device) as graphs:
            graph = CAPTURED_LOOPS.take(key)
            if graph is None:
                same = [other for other in graphs if other[0][:4] == key[0][:4]]
                buffers = graphs[same[-1]].inputs if same else None
                CAPTURED_LOOPS.make_room()
                graph = _LoopGraph(inputs, steps, functions, buffers, donated)
            CAPTURED_LOOPS.put(key, graph)
            state = graph(inputs)
        label += ", whole loop as one CUDA graph"
    chosen, *_, evaluated_enough, drew_enough, needed = state
    return chosen, torch.stack([evaluated_enough, drew_enough]), needed, label


def _kernel_step(**static):
    def function(inputs, state, step):
        return greedy_kernel.greedy_kernel_step(inputs, state, step, **static)

    return function


def fast_lazy_greedy(
    objective: Mixture,
    k: int,
    evaluations: list[int],
    sampler: StochasticSampler | None,
    attempts: int,
    backend,
    capture: bool,
    donated: tuple[str, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
    """The eager loop's run (``kvhive.methods.submodular._lazy_greedy``) on the fixed-shape step: its
    ``(chosen, enough, needed)`` (``needed`` counts what the bucketed run needed) and the path taken
    (``kvhive.methods.submodular.last_greedy_path``); ``donated``: inputs a new capture may keep
    (:func:`capture_buffers`)."""
    label = backend if backend is None or isinstance(backend, str) else getattr(backend, "__name__", "backend")
    n = objective.size
    sampled = sampler is not None and not all(sampler.all_full)
    if sampled:
        width = max(sampler.width)
        any_full = width == n
    else:
        width, any_full = n, False
    counts = [_bucket(count, width) for count in evaluations]
    static = dict(width=width, sampled=sampled, any_full=any_full, lam=objective.lam, phi=objective.phi)
    inputs = _static_inputs(objective, sampler if sampled else None, attempts)
    shape = tuple((name, tuple(value.shape), value.dtype) for name, value in inputs.items())
    device = objective.sim.device
    if capture:
        # A layer replays a captured loop whose buckets are all at least its own (evaluating more
        # changes no kept set). Its buckets are first made non-increasing over the steps (each
        # step's is the largest of the steps from it on: fresh draws, hence the evaluations needed,
        # fall over the steps, so this costs little), so that which steps need the next bucket up
        # is a prefix, not a scatter that differs from layer to layer; a new capture takes the
        # larger bucket of each step of its own and of the latest capture of these shapes, so the
        # captures of a model's layers settle in a few.
        counts = list(itertools.accumulate(reversed(counts), max))[::-1]
        base = (device, backend, k, shape, tuple(sorted(static.items())))
        with CAPTURED_LOOPS.using(device) as graphs:
            graph = None
            for key in reversed(list(graphs)):
                if key[0] == base and all(mine >= need for mine, need in zip(key[1], counts, strict=True)):
                    graph = CAPTURED_LOOPS.take(key)
                    counts = list(key[1])
                    break
            if graph is None:
                latest = [key for key in graphs if key[0] == base]
                buffers = None
                if latest:
                    counts = [max(mine, need) for mine, need in zip(latest[-1][1], counts, strict=True)]
                    buffers = graphs[latest[-1]].inputs
                CAPTURED_LOOPS.make_room()
                functions = [_step_function(backend, shape, count=count, **static) for count in counts]
                graph = _LoopGraph(inputs, list(torch.arange(k, device=device).unbind()), functions, buffers, donated)
            CAPTURED_LOOPS.put((base, tuple(counts)), graph)
            state = graph(inputs)  # the results are copies: the next holder may replay at once
        path = f"fixed-shape step ({label or 'eager'}), whole loop as one CUDA graph"
    else:
        functions = [_step_function(backend, shape, count=count, **static) for count in counts]
        state = _run_loop(inputs, list(torch.arange(k, device=device).unbind()), functions)
        path = f"fixed-shape step ({label or 'eager'})"
    chosen, *_, evaluated_enough, drew_enough, needed = state
    return chosen, torch.stack([evaluated_enough, drew_enough]), needed, path
