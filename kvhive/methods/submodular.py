"""Submodular machinery for BumbleBee, model-agnostic and batched over rows.

A *row* is one independent problem (one (batch, KV head) pair of one layer); every function
works on ``R`` rows at once with tensor ops, so only the ``k`` greedy iterations (and the
tokens joining a streaming summary) are Python loops.

Objective (BumbleBee Eq. 2-4, normalised as docs/METHODS.md asks, ``f(empty) = 0``, ``f(V) = 1``)::

    g(S) = lam * f_FL(S) / f_FL(V) + (1 - lam) * phi(sum_{u in S} a_u) / phi(sum_{u in V} a_u)
    f_FL(S) = sum_{v in V} max_{u in S} sim(v, u),   sim = ReLU(cos(k_v, k_u))

Invalid elements (left padding) have zero similarity and zero weight; the maximisers never
pick one while a valid element is still available, and the streaming step drops them first.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
import types
from dataclasses import dataclass

import torch

from kvhive import static_step
from kvhive.static_step import BoundedCache, CapturedLoops, capture_stream, per_thread_attributes

# Rank given to invalid (padding) elements: below every real gain, above "not selectable".
PADDING_GAIN = -1e30
# Lazy evaluation: exact gains a greedy step computes beyond its fresh draws (a run where that
# was not enough for some step runs again with what it needed). 32 left one run of
# bumblebee-power on tiny Llama short; 48 settled every tiny model at 256-2,048 tokens in one run
# but not the second layer of the kv-heavy shape at 4k (a second run: 38.8k exact gains per row
# in all), 64 settles both of its layers in one (19.6k each).
_LAZY_EVALUATIONS = 64
# The eager loop on the CPU evaluates 3/2 of that margin: a row stops reading the matrix once its
# step has settled (_GreedyState.settling_gains), so the part of the margin it does not need costs the
# arithmetic on a row in cache, not a read from memory; but the rows it skipped keep staler bounds,
# and with 64 (and 72, 80) the second layer of the kv-heavy shape at 4k left one step unsettled (step
# 52 needed 85) and ran again; with 96 both layers settle in one run (exact gains read per row:
# 9.9k and 12.9k of 25.4k evaluated, against 19.6k of 19.6k with 64 and no early stop).
_EAGER_CPU_MARGIN, _EAGER_CPU_MARGIN_OF = 3, 2
# Runs of lazy/stochastic greedy before the one that evaluates every element drawn, included.
_LAZY_RUNS = 3
# Plain greedy: elements of the temporary [rows, candidates, n] tensor per chunk.
_PLAIN_CHUNK = 1 << 24
# Exact gains on the CPU: elements of the gathered [rows, candidates, n] similarity rows per piece
# (4 MiB: the candidates' rows stay in cache between the subtraction, the clamp and the sum; on the
# kv-heavy shape at 4k, 16 candidates of 8 heads a piece, the greedy of 2 layers took 1.37 s at
# 1 MiB, 1.33 s at 2 MiB, 1.30 s at 4 MiB, 1.50 s at 8 MiB: fewer, larger ops until the pieces
# leave the cache; medians of 5, same kept sets).
_GAIN_CHUNK = 1 << 20


# ---------------------------------------------------------------------------------------------
# Similarity
# ---------------------------------------------------------------------------------------------


def key_norms(keys: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """``||k||`` clamped at ``eps`` (float32), so ``cos = k_v . k_u / (norm_v * norm_u)``."""
    return keys.float().norm(dim=-1).clamp_min(eps)


def relu_cosine_similarity(
    keys: torch.Tensor, valid: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``[R, n, n]`` ReLU of the pairwise cosine similarity of ``keys[R, n, d]`` (float32).

    Rows and columns of invalid elements are zero. One batched matrix product: computing only
    the upper block triangle and mirroring it halves the flops but was slower on CPU because of
    the transposed copy (1.17 s vs 0.76 s for 8 x 4096 x 4096, d = 128, one thread). ``out``: a
    contiguous ``[R, n, n]`` float32 tensor to write it into (the same product, the same values).
    """
    units = _unit_keys(keys, valid)
    sim = torch.bmm(units, units.transpose(1, 2), out=out)
    return sim.clamp_(min=0)


def _unit_keys(keys: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """``keys[R, n, d] / ||k||`` in float32, zero for invalid elements.

    Zeroing the invalid keys before the product, not the product's rows and columns after it, saves
    two passes over the ``n x n`` matrix (of six on CUDA: the product, the clamp, the two masks, the
    row sums and the row maxima; likewise over each panel on the CPU): an entry of two valid keys is
    the same dot product (each entry is its own multiply-adds), and an entry with an invalid key is
    a dot product with a zero vector, +0 as the masked entry was (the product's accumulators start
    at +0; a non-finite padding key gives NaN there, as the masked product did). Always masked: a
    mask of ones changes nothing, and asking whether all are valid would be a host read."""
    units = keys.float() / key_norms(keys)[..., None]
    return units if valid is None else units.mul_(valid[..., None])


# Rows per matrix product of the prefill similarity on the CPU (at least half a panel in the last).
_PANEL_ROWS = 256


def relu_cosine_similarity_rows(
    keys: torch.Tensor, valid: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`relu_cosine_similarity` with its row sums and row maxima: ``(sim, sim.sum(-1), sim.amax(-1))``.

    On the CPU, the same values with half the products: each head's upper block triangle is
    computed in panels of rows (one matrix product per panel, written in place) and mirrored, and
    a panel's rows are summed while they are in cache. The product is symmetric to the bit (each
    entry is the same sequence of multiply-adds over the head dimension either way round, and a
    panel of 128 rows or more goes through the same kernel as the full product: a one-row product
    did not), so the mirrored entries are the ones the full product writes. On a kv-heavy layer at
    4k (8 x 3891 x 3891, d = 128, one thread) the full product took 0.77 s, the panels 0.28 s.
    ``out``: a contiguous ``[R, n, n]`` float32 tensor the matrix is written into (every element;
    :func:`similarity_buffer` on CUDA, a buffer reused from the previous layer on the CPU).
    """
    rows, n, _ = keys.shape
    if keys.device.type != "cpu" or n < 2 * _PANEL_ROWS:
        sim = relu_cosine_similarity(keys, valid, out)
        return sim, sim.sum(dim=-1), sim.amax(dim=-1)
    units = _unit_keys(keys, valid).contiguous()
    sim = units.new_empty(rows, n, n) if out is None else out
    row_sums = units.new_empty(rows, n)
    row_max = units.new_empty(rows, n)
    starts = list(range(0, n - _PANEL_ROWS // 2, _PANEL_ROWS))
    for row in range(rows):
        head, out = units[row], sim[row]
        for start, end in zip(starts, starts[1:] + [n], strict=True):
            panel = out[start:end, start:]
            torch.mm(head[start:end], head[start:].t(), out=panel)
            panel.clamp_(min=0)
            out[end:, start:end] = panel[:, end - start :].t()
            torch.sum(out[start:end], dim=-1, out=row_sums[row, start:end])
            torch.amax(out[start:end], dim=-1, out=row_max[row, start:end])
    return sim, row_sums, row_max


# ---------------------------------------------------------------------------------------------
# Concave functions phi of the feature-based term (float64)
# ---------------------------------------------------------------------------------------------


def power_concave(x: torch.Tensor, alpha: float = 0.04, beta: float = 1.0, iterations: int = 12) -> torch.Tensor:
    """``phi(x) = g^{-1}(x)`` with ``g(y) = alpha * y^(1/alpha) + beta * y`` (BumbleBee ♦), elementwise.

    ``g`` is increasing and convex on ``[0, inf)``, so Newton's method started above the root
    decreases monotonically to it (no overshoot). Both ``x / beta`` and ``(x / alpha)^alpha``
    are above the root (each drops one non-negative term of ``g``); the smaller one is the start.
    Vectorised over any shape. A fixed number of steps, so that no step waits for the host to
    test convergence (issue 25): over ``alpha`` in [0.005, 1], ``beta`` in [0, 1e6] and ``x`` in
    [1e-300, 1e300], no element moves by more than 1e-14 relative after the 8th step; 12 leave
    a margin (a converged element stays put: the step is then 0 or an ulp).
    """
    x = x.double().clamp_min(0)
    y = (x / alpha).pow(alpha)
    if beta > 0:
        y = torch.minimum(y, x / beta)
    for _ in range(iterations):
        power = y.pow(1.0 / alpha - 1.0)  # g'(y) - beta
        step = (alpha * power * y + beta * y - x) / (power + beta).clamp_min(1e-300)
        y = (y - step).clamp_min_(0)
    return y


@dataclass(frozen=True)
class Concave:
    """``phi`` of the feature-based function: ``"log"`` (♡, ``log(1 + x)``) or ``"power"`` (♦)."""

    kind: str = "log"
    alpha: float = 0.04
    beta: float = 1.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.double()
        if self.kind == "log":
            return torch.log1p(x)
        return power_concave(x, self.alpha, self.beta)

    def gain(self, base: torch.Tensor, added: torch.Tensor, phi_base: torch.Tensor | None = None) -> torch.Tensor:
        """``phi(base + added) - phi(base)`` without cancellation for the log form."""
        base, added = base.double(), added.double()
        if self.kind == "log":
            return torch.log1p(added / (1.0 + base))
        if phi_base is None:
            phi_base = self(base)
        return self(base + added) - phi_base

    def loss(self, total: torch.Tensor, removed: torch.Tensor, phi_total: torch.Tensor | None = None) -> torch.Tensor:
        """``phi(total) - phi(total - removed)``."""
        total, removed = total.double(), removed.double()
        rest = (total - removed).clamp_min(0)
        if self.kind == "log":
            return torch.log1p(removed / (1.0 + rest))
        if phi_total is None:
            phi_total = self(total)
        return phi_total - self(rest)


def _safe_divide(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    return torch.where(denominator > 0, numerator / denominator.clamp_min(1e-300), torch.zeros_like(numerator))


# ---------------------------------------------------------------------------------------------
# The mixture objective
# ---------------------------------------------------------------------------------------------


class Mixture:
    """``g_lam`` over a ground set of ``n`` elements per row (Eq. 4, both parts normalised).

    Args:
        sim: ``[R, n, n]`` non-negative symmetric similarity (zero rows/columns for invalid).
        weights: ``[R, n]`` non-negative modular weights of the feature function (accumulated
            attention); invalid elements count as 0.
        valid: ``[R, n]`` bool.
        lam: mixture weight ``lambda`` in [0, 1].
        phi: the concave function.
    """

    def __init__(
        self,
        sim: torch.Tensor,
        weights: torch.Tensor,
        valid: torch.Tensor,
        lam: float,
        phi: Concave,
        row_sums: torch.Tensor | None = None,
        row_max: torch.Tensor | None = None,
    ):
        self.sim = sim
        self.valid = valid
        self.weights = weights.double().clamp_min(0) * valid
        self.lam = float(lam)
        self.phi = phi
        # sim.sum(-1) and sim.amax(-1) when the caller has them (relu_cosine_similarity_rows).
        self.row_sums = sim.sum(dim=-1) if row_sums is None else row_sums
        self.fl_total = (sim.amax(dim=-1) if row_max is None else row_max).double().sum(dim=-1)  # f_FL(V)
        self.phi_total = phi(self.weights.sum(dim=-1))  # phi(a(V))
        # Unnormalised gains times these give the two terms of g's gain (0 for an empty row).
        self.facility_scale = _safe_divide(torch.full_like(self.fl_total, self.lam), self.fl_total)
        self.feature_scale = _safe_divide(torch.full_like(self.phi_total, 1.0 - self.lam), self.phi_total)

    @property
    def rows(self) -> int:
        return self.weights.shape[0]

    @property
    def size(self) -> int:
        return self.weights.shape[1]

    def facility_location(self, chosen: torch.Tensor) -> torch.Tensor:
        """``f_FL(S) / f_FL(V)`` for ``chosen[R, n]`` (bool), from the definition."""
        covered = self.sim.masked_fill(~chosen[:, None, :], 0.0).amax(dim=-1).double().sum(dim=-1)
        return _safe_divide(covered, self.fl_total)

    def feature(self, chosen: torch.Tensor) -> torch.Tensor:
        """``phi(a(S)) / phi(a(V))`` for ``chosen[R, n]``."""
        mass = (self.weights * chosen).sum(dim=-1)
        return _safe_divide(self.phi(mass), self.phi_total)

    def value(self, chosen: torch.Tensor) -> torch.Tensor:
        """``g_lam(S)`` per row, float64, from the definition (tests compare greedy against it)."""
        return self.lam * self.facility_location(chosen) + (1.0 - self.lam) * self.feature(chosen)


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

    On the device, without host round trips (issue 25): the ``k`` steps are a fixed number of
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
    GPU fast path, module section "The GPU fast path"; same kept sets, same host reads). None
    (the default): ``kvhive.static_step.prefill_fast_path`` decides, i.e. on CUDA only: the step
    compiled with inductor, the whole loop captured as one CUDA graph
    per shape bucket; the CPU runs the eager loop, the reference. True: the fixed-shape step
    (compiled and captured as on CUDA; eager on the CPU); a dynamo backend (e.g. ``"aot_eager"``,
    the tests' CPU proxy): the step compiled with it, not captured; False: the eager loop.

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
    sampler = _StochasticSampler(objective.valid, k, epsilon, generator) if method == "stochastic" else None
    cuda = objective.sim.device.type == "cuda"
    if fast is None:
        fast = static_step.prefill_fast_path(objective.sim.device)
    margin = _LAZY_EVALUATIONS
    if fast is False and objective.sim.device.type == "cpu":
        margin = _LAZY_EVALUATIONS * _EAGER_CPU_MARGIN // _EAGER_CPU_MARGIN_OF
    if sampler is None:
        widths = [n] * k
        evaluations = [min(margin, n)] * k
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
        else:
            named = fast is not True  # a backend (a name or a dynamo backend callable)
            backend = _fast_backend(fast) if cuda or named else None
            # Inside a capture or a trace of the caller's (in_static_step), the steps are recorded
            # into the caller's graph: no capture (nor compile) of our own.
            capture = captures_loops(objective.sim.device) and not named and not static_step.in_static_step()
            if static_step.in_static_step():
                backend = None
            chosen, enough, needed = _fast_lazy_greedy(
                objective, k, evaluations, sampler, attempts, backend, capture, donated
            )
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


class _StochasticSampler:
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
        # bounds too (measured on a kv-heavy layer at 4k: one run settles with 2x, not with 1.5x).
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
    objective: Mixture, k: int, evaluations: list[int], sampler: _StochasticSampler | None, attempts: int
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
    sampler: _StochasticSampler,
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


# ---------------------------------------------------------------------------------------------
# Streaming summary (Algorithm 2) with the similarity matrix cached
# ---------------------------------------------------------------------------------------------


@dataclass
class StreamingSummary:
    """The summary ``S`` of ``R`` rows, ``T`` members each, with its similarity matrix cached.

    Members live in *slots* (fixed rows/columns of ``sim``): a new member takes the slot of the
    one it replaces, so a step writes one row and one column (``O(T)``) instead of rebuilding
    the matrix. ``slot_of_rank[r, i]`` is the slot of the ``i``-th oldest member, i.e. of the
    ``i``-th stored token (the cache stores tokens oldest first and the summary precedes the
    local window); ``rank_of_slot`` is its inverse. ``positions[r, i]`` is the ``i``-th member's
    original position, which lets the caller check that the cached matrix still matches what
    the cache stores.

    Because every member covers itself (``sim(v, v) = 1``) and the ground set of the
    streaming objective is ``S' = S + {x}`` (Alg. 2 instantiates ``f_FL`` and ``c`` on the
    summary), ``f_FL(S') - f_FL(S' - x) = sim(x, x) - max_{u in S' - x} sim(x, u)``: a step
    only needs each member's nearest other member (``nearest``), kept up to date in ``O(T)``
    per step plus a scan of the rows whose nearest member may have left.

    ``sim`` holds zeros on its diagonal (``self_sim`` holds ``sim(v, v)``): a row's maximum is
    then its nearest other member, with no masked copy of the matrix at each step.
    """

    sim: torch.Tensor  # [R, T, T] float32, by slot; zero diagonal
    self_sim: torch.Tensor  # [R, T] sim(v, v): 1, or 0 for padding / zero keys
    nearest: torch.Tensor  # [R, T] max_{u in S, u != v} sim(v, u)
    norms: torch.Tensor  # [R, T] key norms by slot
    valid: torch.Tensor  # [R, T] bool by slot
    slot_of_rank: torch.Tensor  # [R, T] long
    rank_of_slot: torch.Tensor  # [R, T] long
    positions: torch.Tensor  # [R, T] original positions by rank

    @property
    def size(self) -> int:
        return self.sim.shape[-1]

    @classmethod
    def from_similarity(
        cls, sim: torch.Tensor, norms: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor
    ) -> StreamingSummary:
        """Summary whose members (in stored order) have the similarity matrix ``sim[R, T, T]``."""
        rows, size, _ = sim.shape
        self_sim = sim.diagonal(dim1=1, dim2=2).clone()
        others = sim.contiguous().clone()
        others.diagonal(dim1=1, dim2=2).zero_()
        order = torch.arange(size, device=sim.device).expand(rows, size)
        return cls(
            others,
            self_sim,
            others.amax(dim=-1),
            norms.float().clone(),
            valid.clone(),
            order.clone(),
            order.clone(),
            positions.clone(),
        )

    @classmethod
    def from_keys(cls, keys: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor) -> StreamingSummary:
        """Summary of ``keys[R, T, d]`` (the first ``T`` stored tokens); ``O(T^2 d)``."""
        return cls.from_similarity(relu_cosine_similarity(keys, valid), key_norms(keys), valid, positions)

    def step(
        self,
        keys: torch.Tensor,
        valid: torch.Tensor,
        weights: torch.Tensor,
        positions: torch.Tensor,
        first_joiner: int,
        joiners: int,
        lam: float,
        phi: Concave,
        normalise_mass: bool = False,
        active: torch.Tensor | None = None,
        stored_of_rank: torch.Tensor | None = None,
        joiner: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Let ``joiners`` stored tokens ``first_joiner, first_joiner + 1, ...`` join one at a time;
        after each, drop the element of ``S' = S + {x}`` with the smallest marginal gain
        ``g(x | S' - x)`` (Alg. 2, lines 10-11). Returns the dropped stored indices ``[R, joiners]``.

        ``keys[R, N, d]``, ``valid[R, N]``, ``weights[R, N]`` (accumulated attention) and
        ``positions[R, N]`` describe the stored tokens; the members are stored first (stored
        index = rank), the joiners next. ``normalise_mass``: ``phi`` is applied to the weights
        divided by their sum over ``S'`` (BumbleBee's ``importance_scale="normalised"``). Invalid elements are dropped first. Cost per joiner:
        ``O(T d + T)`` plus a scan of the rows whose nearest member left.

        ``active`` (a device bool broadcast over the rows, for a step of fixed shape): where False,
        nothing joins (the state is left as it is; the dropped index returned there is meaningless).
        The state's tensors are updated in place (a compiled step keeps their addresses).

        ``stored_of_rank [R, >= first_joiner + joiners]``: for a cache that does not store the tokens
        in their order (it writes the newest token into a freed slot), the stored index of the token
        of each rank, ranked by position; the indices above are then ranks, and the dropped ones
        returned are stored indices.

        ``joiner`` (one joiner): ``(stored index [R, 1], key [R, 1, d], products [R, N])``, its key's
        products with every stored key computed elsewhere (the attention's, which read the keys
        anyway): its similarities are formed from them instead of a multiply-sum over the stored
        keys (the same dot products, summed in the matrix product's order).
        """
        if joiner is not None and joiners != 1:
            raise ValueError(f"invalid joiners={joiners!r} with a joiner's products given: expected 1")
        rows, size = self.slot_of_rank.shape
        slots = torch.arange(size, device=keys.device)
        by_rank = stored_of_rank is not None
        if by_rank:
            member_index = stored_of_rank.gather(1, self.rank_of_slot)  # stored index of each slot's member
        else:
            member_index = self.rank_of_slot.clone()
        # A decode step is a few hundred small ops, each costing more than its arithmetic (issue 23):
        # the per-row values below stay [R, 1] (no unsqueeze per use), fresh temporaries are updated
        # in place, phi = log(1 + x) is applied inline (Concave's own formulas, without its dtype
        # casts of tensors that are float64 already), gathers broadcast their index
        # (take_along_dim: no expand), the weights of S' come from one gather at the members' and
        # x's stored indices, and the float64 row sum casts as it sums. Every value is computed as
        # before, to the bit (replayed streams against the previous step: the dropped indices and
        # every state tensor).
        log_form = phi.kind == "log"
        # phi(a(S')) of the log form is 0 or at least 2**-149 (a float64 sum of float32 weights,
        # each a multiple of 2**-149; normalised, 0 or 1): dividing by it unclamped is dividing by
        # its clamp at 1e-300, and where it is 0 the masked_fill below sets the term as before.
        unclamped_phi = log_form and (normalise_mass or weights.dtype != torch.float64)
        dropped = []
        for j in range(joiners):
            x = first_joiner + j
            if joiner is not None or by_rank:
                if joiner is not None:  # its stored index and key, chosen before the attention
                    x, key_x, _ = joiner
                else:
                    x = stored_of_rank[:, x : x + 1]  # [R, 1]
                    key_x = keys.take_along_dim(x[:, :, None], dim=1)
                valid_x = valid.gather(1, x)
                stored = keys  # the members are anywhere
                ground = torch.cat([member_index, x], dim=1)  # stored indices of S' (members by slot, x last)
            else:
                key_x, valid_x = keys[:, x : x + 1], valid[:, x : x + 1]
                stored = keys[:, :x]  # the members: the stored tokens before x
                ground = torch.nn.functional.pad(member_index, (0, 1), value=x)
            if key_x.dtype != torch.float32:
                key_x = key_x.float()  # [R, 1, d]
            if stored.dtype == torch.float64:  # a float32 product, as for every other key dtype
                stored = stored.float()
            raw_norm = torch.linalg.vector_norm(key_x, dim=-1)  # [R, 1] (Tensor.norm's kernel, without its wrapper)
            norm_x = raw_norm.clamp_min(1e-12)
            # O(T d): a multiply-sum beats a batched matrix-vector product on CPU here (the product
            # is formed in float32 for any key dtype: a 16-bit key's promotion casts it exactly, as
            # .float() does, without a float32 copy of the stored keys). vecdot is that multiply-sum.
            if joiner is not None:
                dots = joiner[2].gather(1, member_index)
            elif stored.dtype == torch.float32:
                dots = torch.linalg.vecdot(stored, key_x).gather(1, member_index)
            else:
                dots = (stored * key_x).sum(dim=-1).gather(1, member_index)
            sim_x = (dots / (self.norms * norm_x)).clamp_(min=0).mul_(self.valid & valid_x)
            self_x = (raw_norm / norm_x).square_().mul_(valid_x)

            nearest_with_x = torch.maximum(self.nearest, sim_x)
            facility = torch.cat([self.self_sim - nearest_with_x, self_x - sim_x.amax(dim=-1, keepdim=True)], dim=1)
            facility = facility.clamp_(min=0).double()
            facility_total = self.self_sim.sum(dim=-1, keepdim=True, dtype=torch.float64) + self_x  # f_FL(S') on S'
            valid_all = torch.cat([self.valid, valid_x], dim=1)
            mass = weights.gather(1, ground).double().mul_(valid_all)
            total = mass.sum(dim=-1, keepdim=True)
            if normalise_mass:  # phi of the fraction of the ground set's attention mass
                mass = _safe_divide(mass, total)
                total = (total > 0).double()
            if log_form:  # Concave.__call__ and Concave.loss of the log form
                phi_total = torch.log1p(total)
                feature = torch.log1p(mass / (total - mass).clamp_min_(0).add_(1.0))
            else:  # Concave.__call__ and Concave.loss, both phi values from one Newton loop
                values = phi(torch.cat([total, (total - mass).clamp_min_(0)], dim=1))
                phi_total = values[:, :1]
                feature = phi_total - values[:, 1:]
            # _safe_divide's values with fewer ops: phi_total is 0 or more, and the feature term 0
            # where it is 0; f_FL(S') is 0 only where every facility gain is 0 too (each is at most
            # its element's sim(v, v)), so its plain quotient by the clamped total is already 0 there.
            feature = feature.div_(phi_total if unclamped_phi else phi_total.clamp_min(1e-300))
            feature = feature.masked_fill_(phi_total <= 0, 0.0)
            gains = facility.div_(facility_total.clamp_min_(1e-300)).mul_(lam).add_(feature.mul_(1.0 - lam))
            drop = torch.where(valid_all, gains, float("-inf")).argmin(dim=-1, keepdim=True)  # == size: x goes

            # x takes the slot y of the dropped member (rows where x itself goes keep their state:
            # every update below is a no-op there).
            replace = drop < size  # [R, 1]
            if active is not None:
                replace = replace & active
            y = drop.clamp_(max=size - 1)
            # The slot x takes, as a mask that is all False where nothing changes: each O(T) field is
            # then written by one select (no gather of the old value, no scatter, no row mask).
            at_y = slots == y
            taken = replace & at_y
            dropped.append(torch.where(replace, member_index.gather(1, y), x))
            # The members whose nearest one may have left: y attains their maximum (a tie rescans to
            # the same value), and x itself. Read before x's column overwrites y's.
            column = self.sim.take_along_dim(y[:, :, None], dim=2).view(rows, size)
            rescan = (column >= self.nearest).logical_and_(replace).logical_or_(taken)
            # Write x's row and column of the cached matrix (O(T)); its diagonal entry is zero. Rows
            # where nothing joins write zeros onto the diagonal instead (entry j to (j, j), where the
            # matrix holds 0): they keep every other value, also of a matrix that one product's
            # rounding left not exactly symmetric, so the nearest values (read off its rows) stay
            # its row maxima.
            target = torch.where(replace, y, slots)
            new_row = sim_x.mul_(replace).masked_fill_(at_y, 0.0)
            self.sim.scatter_(1, target.view(rows, 1, size), new_row.view(rows, 1, size))
            self.sim.scatter_(2, target.view(rows, size, 1), new_row.view(rows, size, 1))
            for field, value in ((self.self_sim, self_x), (self.norms, norm_x), (self.valid, valid_x)):
                torch.where(taken, value, field, out=field)  # in place: no copy back
            if by_rank or joiner is not None:  # x a stored index per row
                torch.where(taken, x, member_index, out=member_index)
            else:
                member_index.masked_fill_(taken, x)
            # Nearest other member: x beats the old one, or the old one stays, except for the rows
            # rescanned. Every row is scanned and the rescanned ones taken (masked work over the
            # fixed T x T bound, Appx. E's O(T^2) per step): selecting the rows would be a host read.
            # Only the value is kept: which member attains it is read off the matrix when one leaves.
            torch.where(replace, nearest_with_x, self.nearest, out=self.nearest)
            torch.where(rescan, self.sim.amax(dim=-1), self.nearest, out=self.nearest)
            # x is the newest member: its slot moves to the last rank, the later ones move up.
            later = (self.rank_of_slot > self.rank_of_slot.gather(1, y)).logical_and_(replace)
            self.rank_of_slot.add_(later, alpha=-1).masked_fill_(taken, size - 1)
        # rank_of_slot is a permutation of each row: the scatter writes every entry of its inverse.
        self.slot_of_rank.scatter_(1, self.rank_of_slot, slots.expand(rows, size))
        member_index = member_index.gather(1, self.slot_of_rank)  # by rank
        if positions.dtype == self.positions.dtype:
            torch.gather(positions, 1, member_index, out=self.positions)
        else:
            self.positions.copy_(positions.gather(1, member_index))
        return dropped[0] if joiners == 1 else torch.cat(dropped, dim=1)

    @classmethod
    def empty(cls, rows: int, size: int, device) -> StreamingSummary:
        """A summary of ``size`` slots holding no members yet (zeros; unit norms), to be filled in
        place by :meth:`assign_where` (a layer in a fixed decode capacity whose prompt fit its budget)."""
        order = torch.arange(size, device=device).expand(rows, size)
        zeros = torch.zeros(rows, size, device=device)
        return cls(
            torch.zeros(rows, size, size, device=device),
            zeros.clone(),
            zeros.clone(),
            torch.ones(rows, size, device=device),
            torch.zeros(rows, size, dtype=torch.bool, device=device),
            order.clone(),
            order.clone(),
            torch.zeros(rows, size, dtype=torch.int32, device=device),
        )

    def assign_where(self, condition: torch.Tensor, other: StreamingSummary) -> None:
        """Take ``other``'s state where ``condition`` (a device bool) holds, in place."""
        for field in dataclasses.fields(self):
            mine = getattr(self, field.name)
            mine.copy_(torch.where(condition, getattr(other, field.name), mine))

    def assign_rows(self, rows: torch.Tensor, other: StreamingSummary) -> None:
        """Take ``other``'s state in the rows where ``rows`` (``[R]`` device bool) holds, in place."""
        for field in dataclasses.fields(self):
            mine = getattr(self, field.name)
            condition = rows.view(-1, *([1] * (mine.dim() - 1)))
            mine.copy_(torch.where(condition, getattr(other, field.name), mine))

    def mark_static(self) -> None:
        """Fix the state's addresses for a compiled decode step (updates are in place)."""
        for field in dataclasses.fields(self):
            torch._dynamo.mark_static_address(getattr(self, field.name))

    def nbytes(self) -> int:
        """Bytes held: the ``T x T`` similarity matrix plus ``O(T)`` per row (at most a ``k x k``
        matrix per row for a budget ``k``, never the stored tokens' ``N x N``)."""
        return sum(getattr(self, field.name).nbytes for field in dataclasses.fields(self))

    def matches(self, positions: torch.Tensor) -> torch.Tensor:
        """0-d device bool: the first ``T`` stored tokens are this summary's members
        (``positions[R, >=T]``), computed without a host read."""
        size = self.size
        if positions.shape[-1] < size:
            return torch.zeros((), dtype=torch.bool, device=positions.device)
        return (positions[:, :size] == self.positions).all()

    def aligned_with(self, positions: torch.Tensor) -> bool:
        """Whether the first ``T`` stored tokens are this summary's members (a host read)."""
        return bool(self.matches(positions))

    @classmethod
    def concatenate(cls, parts: list[StreamingSummary]) -> StreamingSummary:
        """Rows of several summaries (same ``T``) stacked in order."""
        if len(parts) == 1:
            return parts[0]
        fields = [field.name for field in dataclasses.fields(cls)]
        return cls(**{name: torch.cat([getattr(part, name) for part in parts], dim=0) for name in fields})


# ---------------------------------------------------------------------------------------------
# The GPU fast path of lazy / stochastic greedy: one fixed-shape step, compiled and captured
# ---------------------------------------------------------------------------------------------
#
# The eager loop above (``_lazy_greedy``) is the reference: on the CPU it runs as it is. On a GPU
# it is launch-bound (issue 25: ~185 dispatches per greedy step, ~410 steps per layer at 8k, each
# dispatch ~5-10 us of host time). The fast path runs the same greedy as ``k`` calls of one pure
# step function of fixed-shape tensors (state in, state out): no host read, no Python branch on a
# value, no shape that depends on the step. The step's varying inputs (the step's draws, their
# population and offset, whether a row evaluates everything) are rows of ``[k, R]`` tables picked
# by a 0-d step tensor, and every step's pool has the run's widest width ``W`` (draws beyond a
# row's own ``d`` are ineligible, as the columns beyond a row's draws already are in the eager
# loop). The exact gains a step evaluates are bucketed to a power of two (at least the eager
# loop's count, at most ``W``): evaluating more than needed changes only the stale bounds left
# behind, which stay upper bounds, and a settled step picks the exact argmax (lowest index among
# ties) whatever was evaluated, so the kept sets are the eager loop's (tests/test_greedy_graph.py).
# On CUDA the step is compiled with inductor (``fullgraph=True, dynamic=False``: its ~90 kernels
# fuse into a few) when torch compiles kvhive, and the whole loop of ``k`` steps is captured once
# as a CUDA graph per shape bucket and replayed for every later layer of the same shapes.

# Smallest bucket of exact gains per step (the eager loop's margin).
_BUCKET_FLOOR = _LAZY_EVALUATIONS
# Compiled step functions: one per (backend, input shapes, bucket of exact gains per step, static
# flags), the oldest dropped past 64; each has its own code object, so a second bucket or shape is a
# first compile of its own, not a recompile of another (dynamo caches per code object;
# tests/test_greedy_graph.py runs under error_on_recompile).
_STEP_FUNCTIONS = BoundedCache(held=64)
# Captured whole loops on CUDA, by shape bucket (few entries: a model's layers share their shapes),
# shared by the process's threads one at a time (their input buffers are shared).
CAPTURED_LOOPS = CapturedLoops(held=2)
# Which path the calling thread's last greedy_maximize call took (benchmarks/bench_gpu.py records it):
# `last_greedy_path`, each thread its own.
per_thread_attributes(__name__, "last_greedy_path")
_THIS_MODULE = sys.modules[__name__]


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
    """One greedy step of :func:`_lazy_greedy` as a pure function of fixed-shape tensors.

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


def _static_inputs(objective: Mixture, sampler: _StochasticSampler | None, attempts: int) -> dict[str, torch.Tensor]:
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
    matrix held instead of two, 31 GB each at 8 KV heads and a 32k prompt)."""
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
    matrix (``R n^2`` float32: 2 GiB at 8 KV heads and 8k) and holds one matrix, not two. The
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


def _fast_backend(fast) -> str | None:
    """The backend compiling the step: ``fast`` when it names one; on CUDA inductor where
    ``kvhive.static_step.config.prefill_compile``; else None (the step runs eagerly, still captured on
    CUDA). The step is a pure tensor function: no attention switch to trace, so it compiles on every
    torch kvhive runs on (the decode step's gate, ``TORCH_COMPILES_KVHIVE``, plays no part; torch 2.11
    checked by hand with tests/test_greedy_graph.py)."""
    if fast is not True:
        return fast
    return "inductor" if static_step.config.prefill_compile else None


def _fast_lazy_greedy(
    objective: Mixture,
    k: int,
    evaluations: list[int],
    sampler: _StochasticSampler | None,
    attempts: int,
    backend,
    capture: bool,
    donated: tuple[str, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_lazy_greedy`'s run on the fixed-shape step (same return values; ``needed`` counts
    what the bucketed run needed); ``donated``: inputs a new capture may keep (:func:`capture_buffers`)."""
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
        _THIS_MODULE.last_greedy_path = f"fixed-shape step ({label or 'eager'}), whole loop as one CUDA graph"
    else:
        functions = [_step_function(backend, shape, count=count, **static) for count in counts]
        state = _run_loop(inputs, list(torch.arange(k, device=device).unbind()), functions)
        _THIS_MODULE.last_greedy_path = f"fixed-shape step ({label or 'eager'})"
    chosen, *_, evaluated_enough, drew_enough, needed = state
    return chosen, torch.stack([evaluated_enough, drew_enough]), needed
