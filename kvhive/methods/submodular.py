"""BumbleBee's greedy maximiser (Algorithm 1), model-agnostic and batched over rows.

A *row* is one independent problem (one (batch, KV head) pair of one layer); every function
works on ``R`` rows at once with tensor ops, so only the ``k`` greedy iterations (and the
tokens joining a streaming summary) are Python loops.

The objective and the similarity live in :mod:`kvhive.methods.submodular_objective`, the
streaming summary (Algorithm 2) in :mod:`kvhive.methods.submodular_streaming`, the fixed-shape
GPU step in :mod:`kvhive.methods.submodular_graph`; this module re-exports their public names.

Objective (BumbleBee Eq. 2-4, normalised as docs/METHODS.md asks, ``f(empty) = 0``, ``f(V) = 1``)::

    g(S) = lam * f_FL(S) / f_FL(V) + (1 - lam) * phi(sum_{u in S} a_u) / phi(sum_{u in V} a_u)
    f_FL(S) = sum_{v in V} max_{u in S} sim(v, u),   sim = ReLU(cos(k_v, k_u))

Invalid elements (left padding) have zero similarity and zero weight; the maximisers never
pick one while a valid element is still available, and the streaming step drops them first.
"""

from __future__ import annotations

import math
import sys

import torch

from kvhive import static_step
from kvhive.methods.submodular_graph import (
    CAPTURED_LOOPS,
    LAZY_EVALUATIONS,
    capture_buffers,
    captures_loops,
    fast_backend,
    fast_lazy_greedy,
    held_similarity_bytes,
    kernel_greedy,
    similarity_buffer,
    uses_kernel,
)
from kvhive.methods.submodular_objective import (
    PADDING_GAIN,
    Concave,
    Mixture,
    key_norms,
    power_concave,
    relu_cosine_similarity,
    relu_cosine_similarity_rows,
)
from kvhive.methods.submodular_streaming import StreamingSummary
from kvhive.static_step import per_thread_attributes

__all__ = [
    "CAPTURED_LOOPS",
    "PADDING_GAIN",
    "Concave",
    "Mixture",
    "StochasticSampler",
    "StreamingSummary",
    "capture_buffers",
    "captures_loops",
    "greedy_maximize",
    "held_similarity_bytes",
    "key_norms",
    "power_concave",
    "relu_cosine_similarity",
    "relu_cosine_similarity_rows",
    "similarity_buffer",
    "stochastic_sample_size",
]

# Lazy evaluation: exact gains a greedy step computes beyond its fresh draws (a run where that is
# not enough for some step runs again with what it needed); the value and its tuning are in
# docs/METHODS.md (BumbleBee, "Greedy margins").
_LAZY_EVALUATIONS = LAZY_EVALUATIONS
# The eager loop on the CPU evaluates 3/2 of that margin: a row stops reading the matrix once its
# step has settled (_GreedyState.settling_gains), so the part of the margin it does not need costs
# arithmetic on a row in cache, not a read from memory, while the larger margin settles more steps
# in the first run (the rows it skipped keep staler bounds).
_EAGER_CPU_MARGIN, _EAGER_CPU_MARGIN_OF = 3, 2
# Runs of lazy/stochastic greedy before the one that evaluates every element drawn, included.
_LAZY_RUNS = 3
# Plain greedy: elements of the temporary [rows, candidates, n] tensor per chunk.
_PLAIN_CHUNK = 1 << 24
# Exact gains on the CPU: elements of the gathered [rows, candidates, n] similarity rows per piece,
# sized so that the candidates' rows stay in cache between the subtraction, the clamp and the sum.
_GAIN_CHUNK = 1 << 20
# Which path the calling thread's last greedy_maximize call took (benchmarks/bench_gpu.py records it):
# `last_greedy_path`, each thread its own.
per_thread_attributes(__name__, "last_greedy_path")
_THIS_MODULE = sys.modules[__name__]


# ---------------------------------------------------------------------------------------------
# Greedy maximisation under a cardinality constraint (Algorithm 1)
# ---------------------------------------------------------------------------------------------


def stochastic_sample_size(n: int, k: int, epsilon: float) -> int:
    """Mirzasoleiman et al. (2015): ``s = ceil((n / k) * ln(1 / epsilon))`` per step, at most ``n``."""
    return max(1, min(n, math.ceil(n / max(1, k) * math.log(1.0 / epsilon))))


class _GreedyState:
    """Coverage, attention mass and picks of the rows while a greedy run builds ``S``."""

    def __init__(self, objective: Mixture):
        self.objective = objective
        rows, n = objective.rows, objective.size
        self.rows = torch.arange(rows, device=objective.sim.device)
        self.chosen = torch.zeros(rows, n, dtype=torch.bool, device=objective.sim.device)
        self.coverage = objective.sim.new_zeros(rows, n)  # max_{u in S} sim(v, u)
        self.mass = objective.weights.new_zeros(rows)  # a(S)
        self.phi_mass = objective.weights.new_zeros(rows)  # phi(a(S))

    def facility_gains(self, rows: torch.Tensor, elements: torch.Tensor) -> torch.Tensor:
        """``lam [f_FL(S + e) - f_FL(S)] / f_FL(V)`` ``[len(rows), m]`` (float64) of ``elements``."""
        objective = self.objective
        n = objective.size
        count, m = elements.shape
        # Rows of the symmetric matrix (contiguous, unlike its columns): [r, m, n].
        flat = objective.sim.view(-1, n)
        index = rows[:, None] * n + elements
        coverage = self.coverage[rows][:, None, :]
        chunk = max(1, _GAIN_CHUNK // max(1, count * n)) if flat.device.type == "cpu" else m
        if chunk >= m:
            similarity = flat.index_select(0, index.reshape(-1)).view(count, m, n)
            similarity.sub_(coverage).clamp_(min=0)
            return similarity.sum(dim=-1).double() * objective.facility_scale[rows][:, None]
        # On the CPU, a few elements per row at a time, so that the rows gathered stay in cache
        # for the three passes over them (each row's sum is the same reduction as in one piece).
        sums = flat.new_empty(count, m)
        buffer = flat.new_empty(count * chunk * n)
        for start in range(0, m, chunk):
            width = min(chunk, m - start)
            similarity = buffer[: count * width * n].view(count, width, n)
            torch.index_select(flat, 0, index[:, start : start + width].reshape(-1), out=similarity.view(-1, n))
            similarity.sub_(coverage).clamp_(min=0)
            torch.sum(similarity, dim=-1, out=sums[:, start : start + width])
        return sums.double() * objective.facility_scale[rows][:, None]

    def settling_gains(
        self,
        elements: torch.Tensor,
        feature: torch.Tensor,
        elements_valid: torch.Tensor,
        top_values: torch.Tensor,
        facility_bounds: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact gains ``g(e | S)`` ``[R, m]`` (float64) of ``elements[R, m]`` (every row), taken in
        the order of their bounds ``top_values[R, >= m]`` (descending), and each row's best one
        ``[R]``; ``feature`` and ``elements_valid`` are the elements' feature gains and validity.
        The facility parts go into ``facility_bounds`` (the stale gains, in place). Elements whose
        bound is ``-inf`` (not eligible) get ``-inf``.

        On the CPU, a few elements per row at a time (as :meth:`facility_gains`), and a row whose
        best exact gain so far beats the next bound (settled, as the greedy step asks at the end)
        stops evaluating: its later pieces gather one row already in cache instead of its elements'
        (a random row of the matrix is a read from memory: ~70% of an exact gain's time on the
        kv-heavy shape), their values are discarded (gain ``-inf``, bounds left as they were). Every
        element left out has a bound below that best gain, so the best gain, the elements attaining
        it and whether the step settles are the ones evaluating all ``m`` gives; only bounds of
        elements that cannot be picked at this step stay staler."""
        objective = self.objective
        rows, n = objective.rows, objective.size
        m = elements.shape[1]
        flat = objective.sim.view(-1, n)
        unbounded = top_values[:, :m] == float("-inf")
        chunk = max(1, _GAIN_CHUNK // max(1, rows * n)) if flat.device.type == "cpu" else m
        if chunk >= m:
            facility = self.facility_gains(self.rows, elements)
            facility_bounds.scatter_(1, elements, facility)
            exact = self.combine(facility, feature, elements_valid).masked_fill_(unbounded, float("-inf"))
            return exact, exact.amax(dim=-1)
        index = self.rows[:, None] * n + elements
        coverage = self.coverage[:, None, :]
        scale = objective.facility_scale[:, None]
        exact = feature.new_empty(rows, m)
        best = None
        evaluating = None  # rows not settled yet
        buffer = flat.new_empty(rows * chunk * n)
        for start in range(0, m, chunk):
            end = min(m, start + chunk)
            width = end - start
            piece = index[:, start:end]
            if evaluating is not None:
                piece = torch.where(evaluating, piece, 0)  # settled rows: the matrix's first row, in cache
            similarity = buffer[: rows * width * n].view(rows, width, n)
            torch.index_select(flat, 0, piece.reshape(-1), out=similarity.view(-1, n))
            similarity.sub_(coverage).clamp_(min=0)
            facility = similarity.sum(dim=-1).double().mul_(scale)
            part = elements[:, start:end]
            if evaluating is not None:
                facility = torch.where(evaluating, facility, facility_bounds.gather(1, part))
            facility_bounds.scatter_(1, part, facility)
            gains = self.combine(facility, feature[:, start:end], elements_valid[:, start:end])
            gains.masked_fill_(unbounded[:, start:end], float("-inf"))
            if evaluating is not None:
                gains.masked_fill_(~evaluating, float("-inf"))
            exact[:, start:end] = gains
            piece_best = gains.amax(dim=-1, keepdim=True)
            best = piece_best if best is None else torch.maximum(best, piece_best)
            if end < m:
                settled = best > top_values[:, end : end + 1]
                evaluating = ~settled if evaluating is None else evaluating & ~settled
        return exact, best.squeeze(1)

    def feature_gains(self, elements: torch.Tensor) -> torch.Tensor:
        """``(1 - lam) [c(S + e) - c(S)]`` ``[R, m]`` (float64) of ``elements[R, m]`` (every row)."""
        objective = self.objective
        added = objective.weights.gather(1, elements)
        gain = objective.phi.gain(self.mass[:, None], added, self.phi_mass[:, None])
        return gain * objective.feature_scale[:, None]

    @staticmethod
    def combine(facility: torch.Tensor, feature: torch.Tensor, elements_valid: torch.Tensor) -> torch.Tensor:
        """``g(e | S)`` from the two weighted terms; padding gets ``PADDING_GAIN``."""
        return (facility + feature).masked_fill_(~elements_valid, PADDING_GAIN)

    def add(self, picks: torch.Tensor) -> None:
        """Add ``picks[R]`` (one element per row) to ``S``."""
        objective = self.objective
        self.chosen[self.rows, picks] = True
        torch.maximum(self.coverage, objective.sim[self.rows, picks], out=self.coverage)
        self.mass = self.mass + objective.weights[self.rows, picks]
        self.phi_mass = objective.phi(self.mass)


def greedy_maximize(
    objective: Mixture,
    k: int,
    method: str = "stochastic",
    epsilon: float = 1e-5,
    generator: torch.Generator | list[torch.Generator] | None = None,
    fast: bool | str | None = None,
    donate_similarity: bool = False,
) -> torch.Tensor:
    """``chosen[R, n]`` with exactly ``min(k, n)`` elements per row maximising ``g`` greedily.

    ``method``:
      * ``"plain"``: Nemhauser et al. — every step evaluates every remaining element.
      * ``"lazy"``: Minoux's accelerated greedy — stale gains are upper bounds (submodularity);
        each step evaluates the elements with the highest bounds and keeps the best exact gain
        once it beats every bound left unevaluated. Same set as plain (ties go to the lowest
        index in both).
      * ``"stochastic"``: stochastic greedy (Mirzasoleiman et al. 2015, the paper's fast path)
        — each step takes the best element of ``s = (n / k) ln(1 / epsilon)`` uniform draws
        from the remaining elements (independent draws, the form of their Lemma 2; when
        ``s`` covers what remains, all of it); the argmax over the sample is found lazily, so
        the result is exactly stochastic greedy's, at lazy-greedy cost.

    Each row is its own problem: the sample size uses the row's own number of valid elements
    and its draws come from ``generator[row]`` (a list, one per row), consumed as one call per
    draw of ``s`` values would (on the CPU a generator's stream does not depend on how it is cut
    into calls, so this is the stream of the per-step calls); given one generator (or None, the
    default one), each row's generator is seeded from it. So a row padded on the left draws
    exactly what it draws alone.

    On the device, without host round trips: the ``k`` steps are a fixed number of
    tensor operations over all rows; step ``j`` evaluates the exact gains of the
    ``evaluations[j]`` elements with the highest bounds (stochastic greedy: twice the elements
    the step draws for the first time, plus 48; lazy greedy: 48) and records, on the device,
    whether that was enough (the best exact gain beats every bound left unevaluated) and
    whether every row's draws held an element it may pick (else it draws again, up to
    ``attempts`` times, as rejection sampling does). One host read per run checks both; a run
    that fell short runs again with the evaluations its steps showed they needed (then with
    everything drawn) or 4x the attempts, so the result is always the one evaluating
    everything. Host reads per call: the sampler's 2 plus 1 per run (one run on the tiny and
    kv-heavy models measured). Only the facility-location part of a bound is stale: the
    feature part ``c(e | S)`` costs ``O(1)`` per element and is recomputed exactly at every
    step, which keeps the bounds tight. Padding is picked only once a row has no valid element
    left (then its lowest-index remaining padding element, or the lowest-index one drawn).

    ``fast`` (lazy and stochastic greedy): run each step as one fixed-shape pure function (the
    GPU fast path, :mod:`kvhive.methods.submodular_graph`; same kept sets, same host reads). None
    (the default): ``kvhive.static_step.prefill_fast_path`` decides, i.e. on CUDA only: the step
    compiled with inductor, the whole loop captured as one CUDA graph
    per shape bucket; the CPU runs the eager loop, the reference. True: the fixed-shape step
    (compiled and captured as on CUDA; eager on the CPU); a dynamo backend (e.g. ``"aot_eager"``,
    the tests' CPU proxy): the step compiled with it, not captured; False: the eager loop.
    On CUDA, stochastic greedy's fast path is :mod:`kvhive.methods.greedy_kernel`'s Triton step
    where ``static_step.config.prefill_kernels`` (two launches a step for all rows, every drawn
    element evaluated: the same picks up to float32 summation order), captured likewise;
    ``"triton"``: that step, not captured (on the CPU under ``TRITON_INTERPRET=1``, the tests' proxy).

    ``donate_similarity``: the caller gives ``objective.sim`` up (it computed the matrix for this call
    and writes nothing into it after): a capture of new shapes keeps it as its input buffer instead of
    a copy (:func:`capture_buffers`), which :func:`similarity_buffer` then hands to the next caller.
    """

    n = objective.size
    k = min(k, n)
    if k <= 0:
        return _GreedyState(objective).chosen
    if method == "plain":
        return _plain_greedy(objective, k)
    if method not in ("lazy", "stochastic"):
        raise ValueError(f"invalid greedy={method!r}: expected 'stochastic', 'lazy' or 'plain'")
    sampler = StochasticSampler(objective.valid, k, epsilon, generator) if method == "stochastic" else None
    cuda = objective.sim.device.type == "cuda"
    if fast is None:
        fast = static_step.prefill_fast_path(objective.sim.device)
    margin = _LAZY_EVALUATIONS
    if fast is False and objective.sim.device.type == "cpu":
        margin = _LAZY_EVALUATIONS * _EAGER_CPU_MARGIN // _EAGER_CPU_MARGIN_OF
    kernel = fast is not False and uses_kernel(fast, objective, sampler is not None)
    if sampler is None:
        widths = [n] * k
        evaluations = [min(margin, n)] * k
    elif kernel:  # every drawn element evaluated: no evaluation counts to plan
        widths, evaluations = sampler.width, None
    else:
        widths = sampler.width
        evaluations = sampler.first_evaluations(margin)
    if fast is False:
        _THIS_MODULE.last_greedy_path = "eager loop"
    donated = ("sim",) if donate_similarity else ()
    attempts, runs = 1, 1
    while True:
        if fast is False:
            chosen, enough, needed = _lazy_greedy(objective, k, evaluations, sampler, attempts)
        elif kernel:
            capture = captures_loops(objective.sim.device) and fast is True
            chosen, enough, needed, path = kernel_greedy(objective, k, sampler, attempts, capture, donated)
            _THIS_MODULE.last_greedy_path = path
        else:
            named = fast is not True  # a backend (a name or a dynamo backend callable)
            backend = fast_backend(fast) if cuda or named else None
            # Inside a capture or a trace of the caller's (in_static_step), the steps are recorded
            # into the caller's graph: no capture (nor compile) of our own.
            capture = captures_loops(objective.sim.device) and not named and not static_step.in_static_step()
            if static_step.in_static_step():
                backend = None
            chosen, enough, needed, path = fast_lazy_greedy(
                objective, k, evaluations, sampler, attempts, backend, capture, donated
            )
            _THIS_MODULE.last_greedy_path = path
        report = torch.cat([enough.long(), needed]).tolist()  # the run's one host read
        evaluated_enough, drew_enough = report[0], report[1]
        if evaluated_enough and drew_enough:
            return chosen
        if not drew_enough:  # some row rejected all its draws more than `attempts` times
            attempts *= 4
        if not evaluated_enough:
            # Enough for this run's steps (exactly so up to its first unsettled step, whose
            # state the next run reproduces); the last run evaluates everything drawn.
            runs += 1
            evaluations = [
                width if runs >= _LAZY_RUNS else min(width, max(count, need + margin))
                for width, count, need in zip(widths, evaluations, report[2:], strict=True)
            ]


def _plain_greedy(objective: Mixture, k: int) -> torch.Tensor:
    state = _GreedyState(objective)
    rows, n = objective.rows, objective.size
    chunk = max(1, _PLAIN_CHUNK // max(1, rows * n))
    everything = torch.arange(n, device=objective.sim.device).expand(rows, n)
    for _ in range(k):
        facility = torch.cat(
            [state.facility_gains(state.rows, everything[:, start : start + chunk]) for start in range(0, n, chunk)],
            dim=1,
        )
        gains = state.combine(facility, state.feature_gains(everything), objective.valid)
        state.add(gains.masked_fill(state.chosen, float("-inf")).argmax(dim=-1))
    return state.chosen


class StochasticSampler:
    """Stochastic greedy's draws for all rows and steps, sized on the host once.

    Step ``j`` of row ``r`` draws ``d[j, r] = ceil(s_r * p / q)`` uniform elements of its
    population (the row's valid elements while any is left, else its padding; ``p`` of them,
    ``q`` not yet chosen) from a static valid-first index list; ``full[j, r]``: the draws would
    cover the population, so the row evaluates all of it. Because padding is picked only once
    no valid element is left, the number of valid elements left after ``j`` steps is
    ``max(0, valid - j)``: every count is known from the valid counts alone, so the table is
    built on the device and one host read brings the per-step widths and stream lengths back.
    """

    def __init__(self, valid: torch.Tensor, k: int, epsilon: float, generator) -> None:
        rows, n = valid.shape
        device = valid.device
        self.valid_first = torch.sort((~valid).long(), dim=-1, stable=True).indices
        count = valid.sum(dim=-1)
        step = torch.arange(k, device=device)[:, None]
        valid_left = (count - step).clamp_min(0)
        self.from_valid = valid_left > 0  # [k, R]
        population = torch.where(self.from_valid, count, n - count)
        left = torch.where(self.from_valid, valid_left, n - step)
        # stochastic_sample_size per row, in float64 exactly as in Python (same IEEE operations).
        real = count.clamp_min(1)
        samples = torch.minimum(real, torch.ceil(real.double() / max(1, k) * math.log(1.0 / epsilon)).long())
        samples = samples.clamp_min(1)
        draws = torch.ceil((samples * population).double() / left.clamp_min(1).double()).long()
        self.full = draws >= population
        self.draws = torch.where(self.full, 0, draws)
        self.population = population
        self.offset = torch.where(self.from_valid, 0, count)  # start of the population in valid_first
        width = torch.where(self.full, n, draws).amax(dim=-1)
        total = self.draws.sum(dim=0)  # draws per row over all steps (without repeats)
        plan = torch.cat([width, self.full.all(dim=-1).long(), total]).tolist()  # the sampler's one host read
        self.width = plan[:k]
        self.all_full = [bool(flag) for flag in plan[k : 2 * k]]
        self.total = plan[2 * k :]
        if isinstance(generator, (list, tuple)):
            if len(generator) != rows:
                raise ValueError(f"invalid generator: expected one per row ({rows}), got {len(generator)}")
            self.generators = list(generator)
        else:
            source = "cpu" if generator is None else generator.device
            seeds = torch.randint(0, 2**62, (rows,), generator=generator, device=source).tolist()
            self.generators = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]
        self.states = [g.get_state() for g in self.generators]

    def first_evaluations(self, margin: int) -> list[int]:
        """Evaluations per step for a first run: twice the elements drawn for the first time at
        that step (never evaluated, so their bounds are the loose gains over the empty set and
        lazy evaluation reaches them all) plus ``margin``, at most the step's width;
        steps that evaluate everything start from ``margin``. One host read."""
        stream = self.streams(1)
        rows, n = self.valid_first.shape
        k = len(self.width)
        device = stream.device
        end = self.draws.t().cumsum(dim=-1)  # [R, k]: where each step's draws end in the stream
        position = torch.arange(stream.shape[1], device=device).expand(rows, -1)
        step = torch.searchsorted(end, position.contiguous(), right=True).clamp_(max=k - 1)  # [R, L]
        population = self.population.t().gather(1, step)
        offset = self.offset.t().gather(1, step)
        element = self.valid_first.gather(1, (stream * population).long().clamp_(max=n - 1) + offset)
        drawn = position < end[:, -1:]
        first = torch.full((rows, n), k, dtype=torch.long, device=device)
        first.scatter_reduce_(1, element, torch.where(drawn, step, k), "amin")
        fresh = torch.zeros(rows, k + 1, dtype=torch.long, device=device).scatter_add_(1, first, torch.ones_like(first))
        counts = torch.where(self.full.all(dim=-1), 0, fresh[:, :k].amax(dim=0)).tolist()
        # Twice the fresh elements: a row's earlier draws it did not evaluate come back with stale
        # bounds too (results/tuning_notes.md, "Greedy margins").
        return [min(width, 2 * count + margin) for width, count in zip(self.width, counts, strict=True)]

    def streams(self, attempts: int) -> torch.Tensor:
        """``[R, L]`` uniform draws: each row's generator from its initial state, ``attempts``
        times the row's draws (a step whose draws are all rejected draws again)."""
        length = max(1, attempts * max(self.total))
        device = self.valid_first.device
        out = torch.zeros(len(self.generators), length, device=device)
        for row, (generator, state) in enumerate(zip(self.generators, self.states, strict=True)):
            generator.set_state(state)
            size = attempts * self.total[row]
            if size:
                out[row, :size] = torch.rand(size, generator=generator, device=device)
        return out


def _lazy_greedy(
    objective: Mixture, k: int, evaluations: list[int], sampler: StochasticSampler | None, attempts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One run of lazy (``sampler`` None) or stochastic greedy evaluating ``evaluations[j]``
    exact gains at step ``j``: ``(chosen, enough, needed)`` — ``enough`` ``[2]`` device bools
    (every step settled; every row's draws held an element it may pick), ``needed[k]`` the
    evaluations that settle each step (the elements whose bound reaches its best exact gain,
    an upper bound when the step was not settled)."""
    state = _GreedyState(objective)
    rows, n = objective.rows, objective.size
    device = objective.sim.device
    valid = objective.valid
    # Stale facility-location gains: upper bounds of the current ones (submodularity).
    facility_bounds = objective.row_sums.double() * objective.facility_scale[:, None]
    everything = torch.arange(n, device=device).expand(rows, n)
    valid_count = valid.sum(dim=-1)
    evaluated_enough = torch.ones((), dtype=torch.bool, device=device)
    drew_enough = torch.ones((), dtype=torch.bool, device=device)
    needed = torch.zeros(k, dtype=torch.long, device=device)
    if sampler is not None:
        stream = sampler.streams(attempts)
        consumed = torch.zeros(rows, dtype=torch.long, device=device)
        tries = torch.arange(attempts, device=device)
    for step in range(k):
        from_valid = valid_count > step  # padding only once no valid element is left
        if sampler is None or sampler.all_full[step]:
            pool = everything
            eligible = ~state.chosen & (valid == from_valid[:, None])
        else:
            pool, eligible, used = _sampled_pool(sampler, step, stream, consumed, tries, state.chosen)
            consumed += used
            if sampler.width[step] == n:  # some rows evaluate everything
                full = sampler.full[step][:, None]
                pool = torch.where(full, everything, pool)
                eligible = torch.where(full, ~state.chosen & (valid == from_valid[:, None]), eligible)
            drew_enough &= eligible.any(dim=-1).all()
            # Each element once (independent draws repeat some): a repeat's bound would tie
            # with its own exact gain and look unsettled.
            column = torch.arange(pool.shape[1], device=device).expand_as(pool)
            first = torch.full((rows, n), pool.shape[1], dtype=torch.long, device=device)
            first.scatter_reduce_(1, pool, torch.where(eligible, column, pool.shape[1]), "amin")
            eligible = eligible & (first.gather(1, pool) == column)
        width = pool.shape[1]
        pool_feature = state.feature_gains(pool)
        bounds = state.combine(facility_bounds.gather(1, pool), pool_feature, valid.gather(1, pool))
        bounds = bounds.masked_fill(~eligible, float("-inf"))
        # The highest bounds are evaluated exactly; nothing unevaluated can beat the best exact
        # gain when that gain is above the next bound (Minoux). A bound equal to the best gain
        # leaves the step unsettled, so a tie with a lower index is never missed.
        count = evaluations[step]
        top = bounds.topk(min(count + 1, width), dim=-1)
        candidates = top.indices[:, :count]
        elements = pool.gather(1, candidates)
        exact, best = state.settling_gains(
            elements, pool_feature.gather(1, candidates), valid.gather(1, elements), top.values, facility_bounds
        )
        picks = torch.where(exact == best[:, None], elements, n).amin(dim=-1)
        if width > count:
            following = top.values[:, count]
            settled = (best > following) | (following == float("-inf")) | ~from_valid
            evaluated_enough &= settled.all()
            needed[step] = ((bounds >= best[:, None]) & from_valid[:, None]).sum(dim=-1).amax()
        # Padding ties at PADDING_GAIN: the lowest-index eligible one.
        padding_pick = torch.where(eligible, pool, n).amin(dim=-1)
        picks = torch.where(from_valid, picks, padding_pick).clamp_(max=n - 1)
        state.add(picks)
    return state.chosen, torch.stack([evaluated_enough, drew_enough]), needed


def _sampled_pool(
    sampler: StochasticSampler,
    step: int,
    stream: torch.Tensor,
    consumed: torch.Tensor,
    tries: torch.Tensor,
    chosen: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step ``step``'s draws ``[R, width]`` (pool, eligible) and the stream values each row used.

    A row takes its first attempt of ``d`` draws holding an element it may pick (rejection
    sampling: today's loop draws again while none is eligible); rows that evaluate everything
    draw nothing."""
    rows, n = chosen.shape
    width = sampler.width[step]
    draws = sampler.draws[step]
    column = torch.arange(width, device=chosen.device)
    index = consumed[:, None, None] + tries[None, :, None] * draws[:, None, None] + column
    values = stream.gather(1, index.clamp_(max=stream.shape[1] - 1).view(rows, -1)).view(rows, -1, width)
    drawn = (values * sampler.population[step][:, None, None]).long().clamp_(max=n - 1)
    drawn += sampler.offset[step][:, None, None]
    pool = sampler.valid_first.gather(1, drawn.view(rows, -1)).view(rows, -1, width)
    eligible = ~chosen.gather(1, pool.view(rows, -1)).view(rows, -1, width) & (column < draws[:, None])[:, None]
    holds = eligible.any(dim=-1)  # [R, attempts]
    attempt = holds.int().argmax(dim=-1)  # the first attempt holding an eligible element
    pick = attempt[:, None, None].expand(rows, 1, width)
    used = torch.where(sampler.full[step], 0, (attempt + 1) * draws)
    return pool.gather(1, pick).squeeze(1), eligible.gather(1, pick).squeeze(1), used
