"""Two launches per step of BumbleBee's stochastic greedy (Triton: BumbleBee's prefill on a GPU).

:func:`kvhive.methods.submodular.greedy_maximize` takes ``k`` dependent steps per layer; each step
draws its sample, evaluates the gains ``g(e | S)`` of the drawn elements, takes their argmax and
adds it to ``S`` (the running maxima ``coverage[v] = max_{u in S} sim(v, u)`` and the attention mass
``a(S)``). The torch step (eager or compiled) splits this into many dependent kernels; here a step is
two launches, each over all (batch, KV head) rows of a layer:

1. ``_greedy_gains_kernel``, program ``(block j, row r)``: draws the row's sample from its stream
   as the torch step does (the first attempt whose draws hold an eligible element, rows that
   evaluate everything take every element), and for the sample's columns in block ``j`` writes
   each element and its exact gain: ``lam / f_FL(V) * sum_v max(sim(e, v) - coverage[v], 0)``
   (float32 sum, as the torch step's) plus the feature part ``(1 - lam) [c(S + e) - c(S)]``
   (float64); padding ``PADDING_GAIN``, an element that may not be picked ``-inf``.
2. ``_greedy_pick_kernel``, program ``(block j, row r)``: the argmax of the row's gains (the lowest
   element index among ties, as the torch step), then ``coverage`` of the points in block ``j``
   updated with the pick's similarity row; block 0 also records the pick, the attention mass,
   the stream values consumed and whether the row drew an eligible element.

Every drawn element is evaluated (no stale bounds): the pick is the argmax over the sample, which
is what the lazy evaluation of the torch step finds once settled, so the kept sets are the torch
step's up to the order in which the kernel sums a gain's float32 terms (near-ties; with exact sums
the same picks to the index). ``tests/methods/greedy_kernel_check.py`` runs both in Triton's CPU
interpreter. No host read: a CUDA graph captures the whole loop (``submodular_graph``).
"""

from __future__ import annotations

import os

import torch

from kvhive.methods.submodular_objective import PADDING_GAIN, Concave

try:  # Triton ships with CUDA builds of PyTorch; CPU builds may lack it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None
    tl = None

# Launches per greedy step (the gains, the pick): what the kernel check counts.
LAUNCHES_PER_STEP = 2
# Newton steps of the power concave function (``submodular_objective.power_concave``'s count).
_NEWTON_STEPS = 12
# Sample columns per program of the gains kernel, points per program of the pick kernel.
_BLOCK_ELEMENTS = 16
_BLOCK_POINTS = 256
# Sample columns per pass of the attempt scan (runs after the first only).
_BLOCK_SCAN = 128
_BLOCK_PICK_POINTS = 1024
_BLOCK_GAINS = 128


if triton is not None:

    @triton.jit
    def _log1p(x):
        """``log(1 + x)`` without cancellation for small ``x`` (Kahan: ``log(u) * x / (u - 1)``)."""
        u = 1.0 + x
        return tl.where(u == 1.0, x, tl.log(u) * (x / (u - 1.0)))

    @triton.jit
    def _power_phi(x, constants, ITERATIONS: tl.constexpr):
        """``submodular_objective.power_concave`` (Newton on ``g(y) = alpha y^(1/alpha) + beta y``);
        ``constants`` holds ``alpha, beta, 1/alpha - 1, tiny`` as float64."""
        alpha = tl.load(constants + 0)
        beta = tl.load(constants + 1)
        exponent = tl.load(constants + 2)
        tiny = tl.load(constants + 3)
        x = tl.maximum(x, 0.0)
        y = tl.exp(tl.log(x / alpha) * alpha)
        y = tl.where(beta > 0, tl.minimum(y, x / tl.where(beta > 0, beta, 1.0)), y)
        for _ in tl.static_range(ITERATIONS):
            power = tl.where(exponent == 0, 1.0, tl.exp(tl.log(y) * exponent))
            step = (alpha * power * y + beta * y - x) / tl.maximum(power + beta, tiny)
            y = tl.maximum(y - step, 0.0)
        return y

    @triton.jit
    def _draw(
        stream,
        valid_first,
        chosen,
        row64,
        columns,
        attempt,
        start,
        draws,
        population,
        offset,
        n,
        width,
        stream_length,
    ):
        """The elements drawn at ``columns`` of attempt ``attempt`` (the torch step's arithmetic:
        ``valid_first[floor(u * population) + offset]``) and whether each may be picked."""
        inside = columns < width
        index = tl.minimum(start + attempt * draws + columns, stream_length - 1)
        value = tl.load(stream + row64 * stream_length + index, mask=inside, other=0.0)
        drawn = tl.minimum((value * population.to(tl.float32)).to(tl.int64), n - 1) + offset
        drawn = tl.minimum(drawn, n - 1)  # in range already; never a read beyond the row
        element = tl.load(valid_first + row64 * n + drawn, mask=inside, other=0)
        taken = tl.load(chosen + row64 * n + element, mask=inside, other=1)
        eligible = (taken == 0) & (columns < draws) & inside
        return element, eligible

    @triton.jit(do_not_specialize=["step", "width", "attempts", "stream_length"])
    def _greedy_gains_kernel(
        sim,
        weights,
        valid,
        chosen,
        coverage,
        mass,
        phi_mass,
        facility_scale,
        feature_scale,
        valid_count,
        stream,
        consumed,
        draws_table,
        population_table,
        offset_table,
        full_table,
        valid_first,
        constants,
        gains,
        pool,
        used,
        step,
        n,
        width,
        attempts,
        stream_length,
        gains_stride,
        SAMPLED: tl.constexpr,
        ANY_FULL: tl.constexpr,
        LOG: tl.constexpr,
        ITERATIONS: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_S: tl.constexpr,
        RETRIES: tl.constexpr,
    ):
        block = tl.program_id(0)
        row = tl.program_id(1)
        rows = tl.num_programs(1)
        row64 = row.to(tl.int64)
        columns = block * BLOCK_E + tl.arange(0, BLOCK_E)
        inside = columns < width
        from_valid = tl.load(valid_count + row) > step
        if SAMPLED:
            table = step * rows + row
            draws = tl.load(draws_table + table)
            population = tl.load(population_table + table)
            offset = tl.load(offset_table + table)
            full = tl.load(full_table + table) != 0
            start = tl.load(consumed + row)
            # The first attempt whose draws hold an eligible element (0 where none does); a run of
            # one attempt (RETRIES False, the first run) takes it without looking.
            attempt = 0
            if RETRIES:
                tries = tl.arange(0, BLOCK_T)
                holds = tl.zeros([BLOCK_T], dtype=tl.int32)
                for first_column in range(0, width, BLOCK_S):
                    scan = first_column + tl.arange(0, BLOCK_S)
                    _, eligible = _draw(
                        stream,
                        valid_first,
                        chosen,
                        row64,
                        scan[None, :],
                        tries[:, None],
                        start,
                        draws,
                        population,
                        offset,
                        n,
                        width,
                        stream_length,
                    )
                    eligible = eligible & (tries[:, None] < attempts)
                    holds = tl.maximum(holds, tl.max(eligible.to(tl.int32), axis=1))
                attempt = tl.min(tl.where(holds > 0, tries, BLOCK_T), axis=0)
                attempt = tl.where(attempt == BLOCK_T, 0, attempt)
            element, eligible = _draw(
                stream,
                valid_first,
                chosen,
                row64,
                columns,
                attempt,
                start,
                draws,
                population,
                offset,
                n,
                width,
                stream_length,
            )
            if ANY_FULL:  # width == n: a row that evaluates everything takes every element
                taken = tl.load(chosen + row64 * n + columns, mask=inside, other=1)
                everyone = (taken == 0) & (
                    (tl.load(valid + row64 * n + columns, mask=inside, other=0) != 0) == from_valid
                )
                element = tl.where(full, columns.to(tl.int64), element)
                eligible = tl.where(full, everyone & inside, eligible)
            tl.store(used + row, tl.where(full, 0, (attempt + 1) * draws), mask=block == 0)
        else:
            element = columns.to(tl.int64)
            taken = tl.load(chosen + row64 * n + columns, mask=inside, other=1)
            is_valid = tl.load(valid + row64 * n + columns, mask=inside, other=0) != 0
            eligible = (taken == 0) & (is_valid == from_valid) & inside
        # Facility part: sum_v max(sim(e, v) - coverage[v], 0), float32 as the torch step.
        partial = tl.zeros([BLOCK_E, BLOCK_V], dtype=tl.float32)
        element_rows = sim + row64 * n * n + element[:, None] * n
        for first_point in range(0, n, BLOCK_V):
            points = first_point + tl.arange(0, BLOCK_V)
            in_points = points < n
            covered = tl.load(coverage + row64 * n + points, mask=in_points, other=0.0)
            similarity = tl.load(element_rows + points[None, :], mask=eligible[:, None] & in_points[None, :], other=0.0)
            partial += tl.maximum(similarity - covered[None, :], 0.0)
        facility = tl.sum(partial, axis=1).to(tl.float64) * tl.load(facility_scale + row)
        # Feature part (float64): phi(a(S) + a_e) - phi(a(S)).
        added = tl.load(weights + row64 * n + element, mask=inside, other=0.0)
        held = tl.load(mass + row)
        if LOG:
            feature = _log1p(added / (1.0 + held))
        else:
            feature = _power_phi(held + added, constants, ITERATIONS) - tl.load(phi_mass + row)
        gain = facility + feature * tl.load(feature_scale + row)
        element_valid = tl.load(valid + row64 * n + element, mask=inside, other=0) != 0
        gain = tl.where(element_valid, gain, tl.load(constants + 4))
        gain = tl.where(eligible, gain, float("-inf"))
        tl.store(gains + row64 * gains_stride + columns, gain, mask=inside)
        tl.store(pool + row64 * gains_stride + columns, element, mask=inside)

    @triton.jit(do_not_specialize=["width"])
    def _greedy_pick_kernel(
        sim,
        weights,
        chosen,
        coverage,
        mass,
        phi_mass,
        consumed,
        gains,
        pool,
        used,
        drew_enough,
        constants,
        n,
        width,
        gains_stride,
        SAMPLED: tl.constexpr,
        LOG: tl.constexpr,
        ITERATIONS: tl.constexpr,
        BLOCK_W: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        block = tl.program_id(0)
        row = tl.program_id(1)
        row64 = row.to(tl.int64)
        beyond: tl.constexpr = 2**62  # after every element: loses every tie of the lowest-index rule
        # Per lane: the best gain seen and the lowest element attaining it.
        best = tl.full([BLOCK_W], float("-inf"), tl.float64)
        lowest = tl.full([BLOCK_W], beyond, tl.int64)
        for first_column in range(0, width, BLOCK_W):
            columns = first_column + tl.arange(0, BLOCK_W)
            inside = columns < width
            gain = tl.load(gains + row64 * gains_stride + columns, mask=inside, other=float("-inf"))
            element = tl.load(pool + row64 * gains_stride + columns, mask=inside, other=beyond)
            lowest = tl.where(gain > best, element, tl.where(gain == best, tl.minimum(lowest, element), lowest))
            best = tl.maximum(best, gain)
        top = tl.max(best, axis=0)
        pick = tl.minimum(tl.min(tl.where(best == top, lowest, beyond), axis=0), n - 1)
        # The running maxima of this block's points.
        points = block * BLOCK_V + tl.arange(0, BLOCK_V)
        in_points = points < n
        covered = tl.load(coverage + row64 * n + points, mask=in_points, other=0.0)
        similarity = tl.load(sim + row64 * n * n + pick * n + points, mask=in_points, other=0.0)
        tl.store(coverage + row64 * n + points, tl.maximum(covered, similarity), mask=in_points)
        if block == 0:
            tl.store(chosen + row64 * n + pick, 1)
            total = tl.load(mass + row) + tl.load(weights + row64 * n + pick)
            tl.store(mass + row, total)
            if LOG:
                tl.store(phi_mass + row, _log1p(total))
            else:
                tl.store(phi_mass + row, _power_phi(total, constants, ITERATIONS))
            if SAMPLED:
                tl.store(consumed + row, tl.load(consumed + row) + tl.load(used + row))
            tl.store(drew_enough, 0, mask=top == float("-inf"))


def kernel_supports(sim: torch.Tensor) -> bool:
    """Whether :func:`greedy_kernel_step` runs on the similarity ``sim [R, n, n]``: Triton on a CUDA
    device (or its CPU interpreter), a contiguous float32 matrix."""
    if triton is None or not (sim.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    return sim.dtype == torch.float32 and sim.is_contiguous()


# The constants' tensors by (phi, device): made once (a host-to-device copy waits for the host).
_CONSTANTS: dict = {}


def kernel_constants(phi: Concave, device) -> torch.Tensor:
    """The float64 constants the kernels read (Python floats reach a kernel as float32):
    ``alpha, beta, 1/alpha - 1, tiny, PADDING_GAIN``; one tensor per (phi, device), never written."""
    key = (phi, torch.device(device))
    if key not in _CONSTANTS:
        values = [phi.alpha, phi.beta, 1.0 / phi.alpha - 1.0, 1e-300, PADDING_GAIN]
        _CONSTANTS[key] = torch.tensor(values, dtype=torch.float64, device=device)
    return _CONSTANTS[key]


def greedy_kernel_step(
    inputs: dict[str, torch.Tensor],
    state: tuple[torch.Tensor, ...],
    step: int,
    *,
    width: int,
    sampled: bool,
    any_full: bool,
    phi: Concave,
) -> tuple[torch.Tensor, ...]:
    """Step ``step`` of the greedy (``submodular_graph``'s state tuple, updated in place and
    returned) in :data:`LAUNCHES_PER_STEP` launches; ``width`` the step's sample width (``n`` where
    a row evaluates everything). ``inputs``: ``submodular_graph``'s fixed inputs, plus
    ``constants`` (:func:`kernel_constants`)."""
    chosen, coverage, mass, phi_mass, _, consumed, _, drew_enough, _ = state
    sim, valid = inputs["sim"], inputs["valid"]
    rows, n = valid.shape
    device = valid.device
    gains = torch.empty(rows, width, dtype=torch.float64, device=device)
    pool = torch.empty(rows, width, dtype=torch.int64, device=device)
    used = torch.zeros(rows, dtype=torch.int64, device=device)
    chosen_bytes = chosen.view(torch.uint8)
    valid_bytes = valid.view(torch.uint8)
    if sampled:
        stream = inputs["stream"]
        tables = (inputs["draws"], inputs["population"], inputs["offset"], inputs["full"].view(torch.uint8))
        valid_first, attempts = inputs["valid_first"], inputs["tries"].shape[0]
    else:  # not read
        stream, tables, valid_first, attempts = gains, (used, used, used, used), used, 1
    log = phi.kind == "log"
    _greedy_gains_kernel[(triton.cdiv(width, _BLOCK_ELEMENTS), rows)](
        sim,
        inputs["weights"],
        valid_bytes,
        chosen_bytes,
        coverage,
        mass,
        phi_mass,
        inputs["facility_scale"],
        inputs["feature_scale"],
        inputs["valid_count"],
        stream,
        consumed,
        *tables,
        valid_first,
        inputs["constants"],
        gains,
        pool,
        used,
        step,
        n,
        width,
        attempts,
        stream.shape[-1],
        width,
        SAMPLED=sampled,
        ANY_FULL=any_full,
        LOG=log,
        ITERATIONS=_NEWTON_STEPS,
        BLOCK_E=_BLOCK_ELEMENTS,
        BLOCK_V=_BLOCK_POINTS,
        BLOCK_T=max(2, triton.next_power_of_2(attempts)),
        BLOCK_S=_BLOCK_SCAN,
        RETRIES=attempts > 1,
        num_warps=4,
    )
    _greedy_pick_kernel[(triton.cdiv(n, _BLOCK_PICK_POINTS), rows)](
        sim,
        inputs["weights"],
        chosen_bytes,
        coverage,
        mass,
        phi_mass,
        consumed,
        gains,
        pool,
        used,
        drew_enough.view(torch.uint8),
        inputs["constants"],
        n,
        width,
        width,
        SAMPLED=sampled,
        LOG=log,
        ITERATIONS=_NEWTON_STEPS,
        BLOCK_W=_BLOCK_GAINS,
        BLOCK_V=_BLOCK_PICK_POINTS,
        num_warps=4,
    )
    return state
