"""SubGen eviction (Zandieh et al., 2024, "SubGen: Token Generation in Sublinear Time and
Memory", Sec. 3.2 "End-to-end Text Generation").

The paper's experiments keep "the most recent ``r`` token embeddings, in addition to ``k``
centers selected from the remaining tokens" by the greedy k-center algorithm (Dyer & Frieze
1985 / Gonzalez: farthest-point clustering), with the cache budget ``r + k``. Per (batch, KV
head), L2 distance between keys (after RoPE, as stored).

Prefill (the paper's "apply the greedy k-center clustering algorithm once to compress the
entire KV cache"): the first center is the oldest real token outside the recent window
**(choice: the paper leaves the seed point open; the oldest token is deterministic and keeps
the attention sink)**; each next center is the candidate farthest from the centers chosen so
far. Computed exactly as a fixed number of device steps batched over rows and heads (see
:func:`farthest_point_order`), with no host read.

Decode **(choice; the paper compresses once)**: when a token leaves the recent window it
joins the candidate set (the ``k`` kept centers); while the set is larger than ``k`` the
closest pair of candidates is found and its *newer* member is evicted. Evicting a member of
the closest pair is the single removal that keeps the k-center covering radius of the
candidates smallest; keeping the older one mirrors Algorithm 1, whose cluster representative
is the first key of the cluster. Each candidate's nearest-neighbour distance and position are
kept as per-token scores (compacted by the cache with the tokens), so a decode step costs
``O(N·d)`` per head (distances of the newcomer to the candidates), not ``O(k²·d)``.

Default ``recent = 32`` **(choice: the paper gives no value; 32 is the recent window of the
other methods here, SnapKV's observation window and AhaKV's ``B_r``)**; ``budget ≥ recent + 1``.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvhive import static_step
from kvhive.methods import farthest_kernel
from kvhive.methods.base import (
    DECODE,
    PREFILL,
    KeyProbes,
    Policy,
    PolicyConfig,
    ScoringInputs,
    keep_top_scores,
    require_int_at_least,
)
from kvhive.static_step import BoundedCache, CapturedLoops, capture_stream, per_thread_attributes

# Per-token scores (kept aligned with the stored tokens by the cache).
NEAREST_DISTANCE = "subgen_nn_sqdist"  # squared L2 distance to the nearest other candidate
NEAREST_POSITION = "subgen_nn_position"  # original position of that candidate (-1: none)
KEY_NORM = "subgen_key_sqnorm"  # squared L2 norm of the key (current for the ready candidates)
# A candidate is *ready* (its entries above are current) once a decision saw it among the
# candidates: after a decision the layer holds the budget, so the candidates not ready at the next
# one are the newest ``N - budget`` (the tokens that left the recent window since).
# The cache's record of the position each kept key is rotated at (kvhive.cache.kv_cache.ROPE_POSITION,
# only with cache positions): its keys are re-rotated, so recorded key norms are not reused then.
_ROPE_POSITION = "_rope_position"

# Elements of a distance block computed at once (rows x new tokens x stored tokens).
_BLOCK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class SubGenConfig(PolicyConfig):
    recent: int = 32

    def validate(self) -> None:
        require_int_at_least(self.recent, 0, "recent")


# ---------------------------------------------------------------------------------------------
# Greedy k-center (farthest point)
# ---------------------------------------------------------------------------------------------


def _after_every(positions: torch.Tensor) -> float | int:
    """A value above every position of ``positions``' dtype (the positions are float copies of the
    per-token scores' dtype in the decode bookkeeping)."""
    return float("inf") if positions.is_floating_point() else torch.iinfo(positions.dtype).max


def _squared_distances(
    points: torch.Tensor, points_sq: torch.Tensor, centers: torch.Tensor, centers_sq: torch.Tensor
) -> torch.Tensor:
    """``[R, N, d] x [R, P, d] -> [R, N, P]`` squared L2 distances (clamped at 0)."""
    dots = torch.matmul(points, centers.transpose(-1, -2))
    return (points_sq[..., :, None] - 2 * dots + centers_sq[..., None, :]).clamp_min_(0)


def farthest_point_order(
    keys: torch.Tensor,
    candidates: torch.Tensor,
    count: int,
    positions: torch.Tensor | None = None,
    fast: bool | str | None = None,
) -> torch.Tensor:
    """Greedy k-center on each row: ``[R, count]`` indices of the chosen centers in pick order.

    ``keys [R, N, d]``, ``candidates [R, N]`` bool. The first center is each row's first
    candidate (the one of oldest ``positions [R, N]`` when given: tokens stored out of their
    order); every next one is the candidate with the largest distance to its nearest chosen
    center (ties: the first maximiser). A row with fewer candidates than ``count`` gets ``-1``
    after its candidates run out.

    ``min(count, N)`` fixed tensor steps batched over rows, each one pass over the keys (the
    distances of every point to the newest center, one fused product), with no host read: the
    argmax of each step stays on the device. (An earlier blocked version read the keys once per
    32 centers but read a bool on the host at every pick to certify it; sound certificates fail
    often on high-dimensional keys, so the exact algorithm needs the pass per pick anyway.)

    ``fast`` (the GPU fast path, issue 25): run each step as one fixed-shape launch or function.
    None (the default): ``kvhive.static_step.prefill_fast_path`` decides, i.e. on CUDA only: each
    pick one launch of :mod:`kvhive.methods.farthest_kernel`'s Triton kernel (the keys read in
    their dtype; ``static_step.config.prefill_kernels`` False: the torch step :func:`_farthest_step`
    compiled with inductor instead), the whole loop captured as one CUDA graph per shape (rows,
    points, head dimension, count) and replayed for every later layer of those shapes; the CPU runs
    the eager loop below, the reference. True: that fast path (on the CPU the torch step, eager);
    ``"triton"``: the kernel, not captured (on the CPU under ``TRITON_INTERPRET=1``, the tests'
    proxy); a dynamo backend (e.g. ``"aot_eager"``): the torch step compiled with it, not captured;
    False: the eager loop. The torch step gives the eager loop's order exactly; the kernel sums the
    dot products in its own order, so near-ties may resolve otherwise (exact on integer keys).
    """
    rows, num_points, _ = keys.shape
    steps = min(count, num_points)
    order = torch.full((rows, count), -1, dtype=torch.long, device=keys.device)
    if steps == 0 or rows == 0:
        return order
    stored_keys = keys  # the model's dtype: the Triton kernel reads these (the same numbers as float32)
    keys = keys.float()
    keys_sq = (keys * keys).sum(-1)
    row_index = torch.arange(rows, device=keys.device)
    nearest = torch.where(candidates, float("inf"), float("-inf"))  # -inf: not eligible
    if positions is None:
        chosen = candidates.to(torch.int8).argmax(-1)
    else:
        chosen = positions.masked_fill(~candidates, _after_every(positions)).argmin(-1)
    cuda = keys.device.type == "cuda"
    if fast is None:
        fast = static_step.prefill_fast_path(keys.device)
    if fast is not False:
        named = fast is not True  # a backend (a name, "triton", or a dynamo backend callable)
        backend = fast if named else (_fast_backend(stored_keys) if cuda else None)
        # Inside a capture or a trace of the caller's (in_static_step), the steps are recorded into
        # the caller's graph: no capture (nor compile, nor kernel) of our own.
        capture = cuda and not named and not static_step.in_static_step()
        if static_step.in_static_step():
            backend = None
        if backend == KERNEL_BACKEND:
            if not farthest_kernel.kernel_supports(stored_keys):
                raise ValueError(
                    f"fast={KERNEL_BACKEND!r}: the Triton kernel needs Triton on a CUDA device (or TRITON_INTERPRET=1), "
                    f"float32/16/bf16 keys and a head dim <= 256; got {stored_keys.dtype} keys of shape "
                    f"{tuple(stored_keys.shape)} on {stored_keys.device}"
                )
            keys = stored_keys
        order = _farthest_loop(keys, keys_sq, order, nearest, chosen, steps, backend, capture)
        exhausted = torch.arange(count, device=keys.device)[None, :] >= candidates.sum(-1)[:, None]
        return order.masked_fill_(exhausted, -1)
    _THIS_MODULE.last_farthest_path = "eager loop"
    for step in range(steps):
        order[:, step] = chosen
        # [R, 1, d] viewed as [R, d, 1]: this layout takes the fast batched matrix-vector kernel
        # on CPU (a contiguous [R, d, 1] is ~6x slower there).
        center = keys[row_index, chosen][:, None, :].transpose(1, 2)
        # |x|² - 2 x·c in one fused product, then + |c|².
        partial = torch.baddbmm(keys_sq[:, :, None], keys, center, alpha=-2).squeeze(-1)
        distance = (partial + keys_sq[row_index, chosen][:, None]).clamp_min_(0)
        nearest = torch.minimum(nearest, distance)
        nearest[row_index, chosen] = float("-inf")
        chosen = nearest.argmax(-1)
    # A row that ran out of candidates kept "picking" ineligible points: those become -1.
    exhausted = torch.arange(count, device=keys.device)[None, :] >= candidates.sum(-1)[:, None]
    return order.masked_fill_(exhausted, -1)


# The GPU fast path: the same loop as one fixed-shape step, compiled and captured (issue 25). The
# eager loop above is launch-bound on a GPU (~16 aten dispatches per center, budget - recent centers
# per layer: ~800 at an 8k prompt with ratio 0.1): the step below is a pure function of fixed-shape tensors (state
# in, state out; the step a 0-d tensor), so it compiles with ``fullgraph=True, dynamic=False`` and
# the whole loop of ``steps`` calls is captured once as a CUDA graph per shape and replayed for
# every later layer of that shape. It is the eager step's arithmetic in the same order (the same
# product, then the same additions), so on the CPU it gives the eager loop's order exactly.

# Compiled steps by backend; captured loops by shape (a model's layers share their shapes).
_STEP_FUNCTIONS = BoundedCache(held=16)
# Shared by the process's threads one at a time (a captured loop's input buffers are overwritten by
# each call: static_step.CapturedLoops).
CAPTURED_LOOPS = CapturedLoops(held=2)
# The fast path's name for the Triton kernel (``fast="triton"``; on CUDA by default).
KERNEL_BACKEND = "triton"
# Which path the calling thread's last farthest_point_order call took (benchmarks/bench_gpu.py records
# it): `last_farthest_path`, each thread its own.
per_thread_attributes(__name__, "last_farthest_path")
_THIS_MODULE = sys.modules[__name__]


def _fast_backend(keys: torch.Tensor) -> str | None:
    """The fast path's step on the GPU: the Triton kernel (one launch a pick, the keys read in their
    dtype) where ``static_step.config.prefill_kernels`` and it runs on ``keys``; else the torch
    step compiled with inductor where ``static_step.config.prefill_compile``, else None (the eager step, still captured
    on CUDA); on every torch kvhive runs on, as BumbleBee's (``submodular._fast_backend``)."""
    if static_step.config.prefill_kernels and farthest_kernel.kernel_supports(keys):
        return KERNEL_BACKEND
    return "inductor" if static_step.config.prefill_compile else None


def _farthest_step(
    keys: torch.Tensor,
    keys_sq: torch.Tensor,
    order: torch.Tensor,
    nearest: torch.Tensor,
    chosen: torch.Tensor,
    step: torch.Tensor,
    row_index: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of :func:`farthest_point_order`'s loop: record ``chosen`` at column ``step`` (a
    0-d long tensor) of ``order``, update every point's distance to its nearest center, pick the
    next center. ``(order, nearest, chosen)`` in, the same out (``order`` written in place: the
    loop's own buffer); ``row_index`` = ``arange(rows)``; fixed shapes, no host read.

    In place where a tensor is the loop's own (``order``) or this step's (``nearest`` after the
    minimum): an out-of-place ``index_copy``/``scatter`` is a copy kernel plus the write, and a
    captured eager step on the GPU is launch-bound (~13 kernels a center before, 10 now)."""
    order.index_copy_(1, step.view(1), chosen[:, None])
    center = keys[row_index, chosen][:, None, :].transpose(1, 2)
    partial = torch.baddbmm(keys_sq[:, :, None], keys, center, alpha=-2).squeeze(-1)
    distance = (partial + keys_sq[row_index, chosen][:, None]).clamp_min_(0)
    nearest = torch.minimum(nearest, distance)
    nearest.scatter_(1, chosen[:, None], float("-inf"))  # (no host scalar: capturable eagerly)
    return order, nearest, nearest.argmax(-1)


def _farthest_function(backend, shape: tuple):
    """The step compiled with ``backend`` (None: eager) for one shape, each shape on a code object
    of its own: a second shape (another prompt length) is a first compile, not a recompile of the
    first (dynamo caches per code object; with ``dynamic=False`` every shape compiles anyway)."""
    if backend is None:
        return _farthest_step

    def make(number: int):
        code = _farthest_step.__code__.replace(co_name=f"_farthest_step_{number}")
        body = types.FunctionType(code, _farthest_step.__globals__, code.co_name)
        return torch.compile(body, backend=backend, fullgraph=True, dynamic=False)

    return _STEP_FUNCTIONS.get((backend, shape), make)


def _run_farthest(function, keys, keys_sq, order, nearest, chosen, row_index, steps):
    for step in steps:
        order, nearest, chosen = function(keys, keys_sq, order, nearest, chosen, step, row_index)
    return order


class _FarthestGraph:
    """The whole loop of one shape captured as one CUDA graph: fixed input buffers (each call
    copies the layer's inputs in) and the final order. ``run(*inputs)`` is the loop (it returns
    the order); whatever it holds on to (the step tensors a graph reads) stays with it."""

    def __init__(self, run, inputs: tuple[torch.Tensor, ...]):
        self.inputs = tuple(value.clone() for value in inputs)
        self.run = run
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up on a side stream, as torch.cuda.graph asks
            run(*self.inputs)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=capture_stream(), capture_error_mode="thread_local"):
            self.order = run(*self.inputs)

    def __call__(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        for mine, value in zip(self.inputs, inputs, strict=True):
            mine.copy_(value)
        self.graph.replay()
        return self.order.clone()


def _farthest_loop(keys, keys_sq, order, nearest, chosen, steps: int, backend: str | None, capture: bool):
    """The ``steps`` fixed-shape steps from the initial state; the order ``[R, count]``. ``backend``
    "triton": :func:`farthest_kernel.farthest_point_steps` (``keys`` in their stored dtype), else the
    torch step compiled with it (None: eager)."""
    if backend == KERNEL_BACKEND:
        inputs = (keys, keys_sq, order, nearest, chosen)
        label = "farthest-point kernel (triton)"

        def run(keys, keys_sq, order, nearest, chosen):
            return farthest_kernel.farthest_point_steps(keys, keys_sq, nearest, chosen, order, steps)

    else:
        function = _farthest_function(backend, (steps, *(tuple(value.shape) for value in (keys, order))))
        step_tensors = list(torch.arange(steps, device=keys.device).unbind())
        inputs = (keys, keys_sq, order, nearest, chosen, torch.arange(keys.shape[0], device=keys.device))
        name = backend if backend is None or isinstance(backend, str) else getattr(backend, "__name__", "backend")
        label = f"fixed-shape step ({name or 'eager'})"

        def run(*values):  # the step tensors stay referenced by the loop (a captured graph reads them)
            return _run_farthest(function, *values, step_tensors)

    if not capture:
        _THIS_MODULE.last_farthest_path = label
        return run(*inputs)
    key = (keys.device, keys.dtype, backend, steps, *(tuple(value.shape) for value in inputs))
    with CAPTURED_LOOPS.using(keys.device):
        graph = CAPTURED_LOOPS.take(key)
        if graph is None:
            CAPTURED_LOOPS.make_room()
            graph = _FarthestGraph(run, inputs)
        CAPTURED_LOOPS.put(key, graph)
        order = graph(inputs)  # a copy: the next holder may replay at once
    _THIS_MODULE.last_farthest_path = f"{label}, whole loop as one CUDA graph"
    return order


# ---------------------------------------------------------------------------------------------
# Decode-phase maintenance of the candidate set
# ---------------------------------------------------------------------------------------------


def _padded_indices(
    mask: torch.Tensor, width: int, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mask [R, N]`` -> ``(index [R, width], present [R, width])``: the first ``width`` True
    columns of each row, in order (``width`` is a bound known on the host: no read of the counts).
    With ``positions [R, N]``: the ``width`` True columns of oldest positions, oldest first (the
    stored order need not be the tokens')."""
    width = min(width, mask.shape[-1])
    # A stable sort puts the True columns first, in order (of column, or of position).
    order = (~mask).to(torch.int8) if positions is None else positions.masked_fill(~mask, _after_every(positions))
    index = torch.sort(order, dim=-1, stable=True).indices[:, :width]
    return index, mask.gather(1, index)


def _smallest_indices(values: torch.Tensor, mask: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index [R, width], present [R, width])``: the ``width`` True columns of ``mask`` with the
    smallest ``values`` (fewer where a row has fewer; ``present`` marks the real ones)."""
    width = min(width, mask.shape[-1])
    index = torch.where(mask, values, float("inf")).topk(width, dim=-1, largest=False).indices
    return index, mask.gather(1, index)


def _pair_distances(
    rows: torch.Tensor, rows_sq: torch.Tensor, keys: torch.Tensor, columns_sq: torch.Tensor
) -> torch.Tensor:
    """``[R, c, d] x [R, N, d] -> [R, c, N]``: ``rows_sq - 2 rows·keys + columns_sq`` clamped at 0,
    the arithmetic of :func:`_squared_distances` in the same order (so the same bits), done in place
    on the product. An ``inf`` in ``rows_sq`` / ``columns_sq`` makes its row / column ``inf``: the
    masks are folded into the norms instead of a masked pass over the block."""
    dots = torch.matmul(rows, keys.transpose(-1, -2))
    # -2·dot is exact, and x + (-y) is x - y in IEEE arithmetic.
    return dots.mul_(-2).add_(rows_sq[..., :, None]).add_(columns_sq[..., None, :]).clamp_min_(0)


def _nearest_among(
    keys: torch.Tensor,
    keys_sq: torch.Tensor,
    members: torch.Tensor,
    index: torch.Tensor,
    present: torch.Tensor,
    gathered: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """Yield ``(columns, distances [R, c, N])``: squared distances of the tokens ``index`` to
    every token, ``inf`` where the token is not in ``members`` or is the token itself, and on the
    rows not ``present``. ``keys_sq`` must be current for the members and the present tokens
    (other entries are not read). ``gathered``: the keys and squared norms of the tokens
    ``index`` when the caller has them (not gathered again)."""
    rows, num_tokens, dim = keys.shape
    columns_sq = torch.where(members, keys_sq, float("inf"))
    step = max(1, _BLOCK_ELEMENTS // max(1, rows * num_tokens))
    for start in range(0, index.shape[1], step):
        columns = slice(start, start + step)
        chosen = index[:, columns]
        if gathered is not None:
            chosen_keys, chosen_sq = (part[:, columns] for part in gathered)
        else:
            chosen_keys, chosen_sq = keys.gather(1, chosen[..., None].expand(-1, -1, dim)), keys_sq.gather(1, chosen)
        chosen_sq = torch.where(present[:, columns], chosen_sq, float("inf"))
        distances = _pair_distances(chosen_keys, chosen_sq, keys, columns_sq)
        distances.scatter_(2, chosen[..., None], float("inf"))
        yield columns, distances


def _first_true(mask: torch.Tensor, width: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_padded_indices` (the ``width`` oldest True columns of each row); one column is an
    ``argmax`` (a row's only True column when the bound is 1, column 0 in a row with none; its
    ``present`` is False then), not a sort of the row."""
    if min(width, mask.shape[-1]) == 1:
        index = mask.to(torch.int8).argmax(-1, keepdim=True)
        return index, mask.gather(1, index)
    return _padded_indices(mask, width, positions)


def _oldest_minimum(
    values: torch.Tensor, positions: torch.Tensor, dim: int = -1, with_position: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(oldest position, index)`` along ``dim`` (kept) of the minimum of ``values``: among equal
    minima the oldest position, what ``min`` (the first minimum) gives when tokens are stored
    oldest first, whatever order they are stored in. ``positions`` broadcasts against ``values``.
    Without ``with_position``: ``(minimum, oldest position)`` (no index)."""
    low = values.amin(dim, keepdim=True)
    # One broadcasting where (a masked_fill of the expanded positions copies them first).
    at_low = torch.where(values == low, positions, _after_every(positions))
    if with_position:
        return at_low.min(dim, keepdim=True)
    return low, at_low.amin(dim, keepdim=True)


# Candidates whose nearest neighbour was dropped that get a new one before the next removal, per
# removal and row, smallest recorded distance first. The dropped token is on average the nearest
# neighbour of one candidate; a row with more keeps the rest as lower bounds (still stale) and
# refreshes them before later removals, smallest first (high-dimensional keys have hubs: on the
# kv-heavy benchmark model a row holds up to ~130 stale candidates after a removal).
STALE_REFRESH_WIDTH = 8


class _SteadyProbe(NamedTuple):
    """What :meth:`SubGen.decode_key_probes` derived before a steady step's attention, handed back
    to :meth:`SubGen.select_decode` with the attention's products of the probed rows."""

    split: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]  # SubGen._split: valid, forced, candidates
    positions: torch.Tensor  # [R, N] the stored positions, in nearest_position's dtype
    newcomer: torch.Tensor  # [R, 1] each row's newcomer (stored index)
    index: torch.Tensor  # [R, 1 + w] the probed rows (_steady_rows)
    asked_sq: torch.Tensor  # [R, 1 + w] their squared norms
    products: torch.Tensor | None  # [R, 1 + w, N] their products with every stored key


def maintain_candidates(
    keys: torch.Tensor,
    positions: torch.Tensor,
    candidates: torch.Tensor,
    target: int,
    nearest_sq: torch.Tensor,
    nearest_position: torch.Tensor,
    ready: torch.Tensor | None,
    *,
    newcomer_bound: int,
    removal_bound: int,
    stale_refresh_width: int = STALE_REFRESH_WIDTH,
    keys_sq: torch.Tensor | None = None,
    every_row_full: bool = False,
    probe: _SteadyProbe | None = None,
):
    """Shrink each row's candidate set to ``target`` by repeatedly evicting the newer member of
    the closest pair. All ``[R, N]`` (keys ``[R, N, d]``); ``nearest_*`` are updated in place for
    the candidates; returns ``(survivors, dropped)``: the surviving candidates ``[R, N]`` bool and,
    for a steady step (:func:`_steady_step`), the token it dropped (``[R, N]`` bool, one True per row
    where every row is full), else None.

    The tokens may be stored in any order (``positions``, distinct per row, say which is which):
    newcomers are taken oldest first, and among equal distances the oldest token is the closest
    pair's first member and a newcomer's nearest neighbour, which is what the first minimum gives
    when tokens are stored oldest first; so the kept sets do not depend on the stored order.

    Fixed work, no host read: ``newcomer_bound`` (a host-known bound on the candidates not yet
    ``ready`` in any row) and ``removal_bound`` (on the excess over ``target``) set the number of
    tensor steps; a row with less to do is masked. After each removal the
    ``stale_refresh_width`` stale candidates (nearest neighbour gone) with the smallest recorded
    distances get their nearest neighbour again. A stale candidate beyond that width keeps its
    recorded distance, a lower bound of the true one, until a later removal refreshes it: the
    closest-pair search is exact whenever no row has more stale candidates than that width at a
    removal (true on the tests' streams and golden cases; in 2 dimensions a token is the unique
    nearest neighbour of at most 6 others). A steady step (:func:`_steady_step`) refreshes its
    removal's stale candidates at the start of the next step instead; those left here are
    refreshed (the same width, smallest first) before the first removal.

    Stale candidates are recorded with ``nearest_position = -1`` (the position of no token), so
    a removal finds them without searching for every candidate's neighbour: this needs every
    ready candidate's recorded position to be ``-1`` or a candidate's (what the prefill's record
    and every call here leave; a candidate leaves the set only by a removal here).

    ``ready`` (``[R, N]`` bool, updated in place to the survivors): the candidates whose entries are
    current; None: all but the ``newcomer_bound`` newest candidates of each row (what a decision
    leaves: see ``KEY_NORM``), and a steady step takes each row's newest candidate as its newcomer.

    ``keys_sq`` (``[R, N]``, optional): the keys' squared norms, current for the ready
    candidates; the newcomers' are computed and written into it (in place). Without it every
    key's norm is computed (a pass over all keys). ``every_row_full``: every row holds more than
    ``target`` candidates (known on the host), which the steady step uses to skip its row mask.
    ``probe`` (a steady step, ``ready`` None): what :meth:`SubGen.decode_key_probes` chose before the
    step's attention, with the attention's ``products``: the step computes no product of its own."""
    keys = keys.float()
    if keys_sq is None:
        keys_sq = (keys * keys).sum(-1)
    positions = positions.to(nearest_position.dtype)
    rows, _, dim = keys.shape
    if probe is None:  # (a probed step's candidates are the probe's own, made for this step)
        candidates = candidates.clone()
    # A steady step (one token joins, one leaves) whose refresh is one block of _nearest_among.
    if newcomer_bound == 1 and removal_bound == 1 and _steady_block_fits(rows, keys.shape[1], stale_refresh_width):
        # Each row's newcomer; in a row that has none, a ready candidate (recomputed to the same
        # neighbour) or a non-candidate (no candidate is closer to it than to its own neighbour).
        probed = None
        if probe is not None:  # chosen before the attention, from the same state
            newcomer, probed = probe.newcomer, (probe.index, probe.asked_sq, probe.products)
        elif ready is None:  # the newest candidate
            newcomer = _newest_candidate(candidates, positions)
        else:
            newcomer = (candidates & ~ready).to(torch.int8).argmax(-1, keepdim=True)
        dropped = _steady_step(
            keys,
            keys_sq,
            positions,
            candidates,
            target,
            nearest_sq,
            nearest_position,
            newcomer,
            stale_refresh_width,
            every_row_full,
            probed,
        )
        if ready is not None:
            ready.copy_(candidates)
        return candidates, dropped
    if ready is None:
        width = min(newcomer_bound, candidates.shape[-1])
        newest = torch.where(candidates, positions, -1.0).topk(width, dim=-1).indices
        ready = candidates.clone().scatter_(1, newest, False)

    def recompute(index: torch.Tensor, present: torch.Tensor, update_others: bool, gathered=None) -> None:
        if index.shape[1] == 0:
            return
        for columns, distances in _nearest_among(keys, keys_sq, candidates, index, present, gathered):
            chosen, here = index[:, columns], present[:, columns]
            # Rows not present are all inf: no neighbour found there, nothing written below.
            best, best_position = (found.squeeze(-1) for found in _oldest_minimum(distances, positions[:, None, :]))
            new_pos = torch.where(torch.isfinite(best), best_position, -1.0)
            # Entries not present scatter their own current value back (indices are distinct).
            nearest_sq.scatter_(1, chosen, torch.where(here, best, nearest_sq.gather(1, chosen)))
            nearest_position.scatter_(1, chosen, torch.where(here, new_pos, nearest_position.gather(1, chosen)))
            if update_others:
                # The new tokens may be the nearest neighbour of candidates that were already there.
                if chosen.shape[1] == 1:  # one new token (a steady step): its own row, no reduction
                    column_best, source = distances[:, 0], positions.gather(1, chosen)
                else:
                    column_best, column_arg = distances.min(1)
                    source = positions.gather(1, chosen.gather(1, column_arg))
                closer = ready & (column_best < nearest_sq)
                nearest_sq.copy_(torch.where(closer, column_best, nearest_sq))
                nearest_position.copy_(torch.where(closer, source, nearest_position))

    # (No streaming read of the keys first any more: it paid while every step compacted the kept
    # window into place before the next one; with the freed slot filled the products find the
    # keys warm from the step's attention: kv-heavy 4k, 2 layers, seven runs each on a shared
    # machine, 1.34-1.43x SnapKV with it, 1.32-1.45x without, no difference to measure.)
    newcomers, present = _first_true(candidates & ~ready, newcomer_bound, positions)
    gathered = None
    if newcomers.shape[1] > 0:
        # The newcomers' norms (a row's own norm wherever an index is padding: true all the same).
        joining = keys.gather(1, newcomers[..., None].expand(-1, -1, dim))
        gathered = (joining, (joining * joining).sum(-1))
        keys_sq.scatter_(1, newcomers, gathered[1])
    recompute(newcomers, present, update_others=True, gathered=gathered)
    # The stale candidates a steady step left for the next one to refresh (it marks them and
    # refreshes at its start): the smallest first, as after each removal below.
    left_stale = candidates & ready & (nearest_position < 0)
    recompute(*_smallest_indices(nearest_sq, left_stale, stale_refresh_width), update_others=False)
    excess = candidates.sum(-1, keepdim=True) - target
    for removal in range(removal_bound):
        active = excess > 0
        value = torch.where(candidates, nearest_sq, float("inf"))
        first_position, first = _oldest_minimum(value, positions, with_position=True)
        partner_position = nearest_position.gather(1, first)
        partner_mask = candidates & (positions == partner_position)
        partner = partner_mask.to(torch.int8).argmax(-1, keepdim=True)
        # The partner's slot holds it iff there is one (positions are distinct), at partner_position.
        newer_is_partner = partner_mask.gather(1, partner) & (partner_position > first_position)
        drop = torch.where(newer_is_partner, partner, first)
        held = candidates.gather(1, drop)
        dropped = held & active
        candidates.scatter_(1, drop, held ^ dropped)
        # Stale now: the candidates recorded stale (-1) and those whose neighbour was just dropped.
        dropped_position = torch.where(newer_is_partner, partner_position, first_position)
        lost = candidates & (nearest_position == torch.where(dropped, dropped_position, -1.0))
        nearest_position.masked_fill_(lost, -1.0)
        stale = candidates & (nearest_position < 0)
        recompute(*_smallest_indices(nearest_sq, stale, stale_refresh_width), update_others=False)
        if removal + 1 < removal_bound:
            excess = excess - active.long()
    ready.copy_(candidates.to(ready.dtype))
    return candidates, None


def _decided(scores: dict) -> bool:
    """Whether a decision (the prefill's included) recorded the candidates' nearest neighbours."""
    return scores.get(NEAREST_DISTANCE) is not None


def _steady_block_fits(rows: int, tokens: int, stale_refresh_width: int) -> bool:
    """Whether a steady step's refresh (newcomer and stale candidates) is one block of distances."""
    return 0 < stale_refresh_width <= max(1, _BLOCK_ELEMENTS // max(1, rows * tokens))


def _steady(scoring: ScoringInputs, budget: int) -> bool:
    """Whether a decode step's decision is :func:`_steady_step` (what :func:`maintain_candidates`
    takes after a decision, one token over the budget, the block fitting): the step whose rows
    :meth:`SubGen.decode_key_probes` asks for and whose dropped token :meth:`SubGen.select_decode_drop`
    names."""
    b, h, n, _ = scoring.keys.shape
    return _decided(scoring.token_scores) and n - budget == 1 and _steady_block_fits(b * h, n, STALE_REFRESH_WIDTH)


def _newest_candidate(candidates: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``[R, 1]``: each row's candidate of the highest position (a steady step's newcomer)."""
    return torch.where(candidates, positions, -1.0).argmax(-1, keepdim=True)


def _steady_rows(
    keys: torch.Tensor,
    candidates: torch.Tensor,
    nearest_sq: torch.Tensor,
    nearest_position: torch.Tensor,
    newcomer: torch.Tensor,
    stale_refresh_width: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows whose distances :func:`_steady_step` computes: ``(index [R, 1 + w], keys
    [R, 1 + w, d], squared norms [R, 1 + w])``, each row's newcomer first (the rows to compute),
    then its stale candidates (recorded ``nearest_position < 0``) of smallest recorded distance,
    then, where fewer are stale, the candidates of smallest recorded distance. Changes nothing."""
    inf = float("inf")
    order = torch.where(candidates & (nearest_position < 0), nearest_sq, inf).scatter_(1, newcomer, -inf)
    index = order.topk(min(1 + stale_refresh_width, order.shape[-1]), dim=-1, largest=False).indices
    asked = keys.gather(1, index[..., None].expand(-1, -1, keys.shape[-1]))
    return index, asked, torch.linalg.vecdot(asked, asked)


def _steady_step(
    keys: torch.Tensor,
    keys_sq: torch.Tensor,
    positions: torch.Tensor,
    candidates: torch.Tensor,
    target: int,
    nearest_sq: torch.Tensor,
    nearest_position: torch.Tensor,
    newcomer: torch.Tensor,
    stale_refresh_width: int,
    every_row_full: bool,
    probe: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """:func:`maintain_candidates` for a steady decode step (at most one newcomer and one removal
    per row), the same decisions in about half the tensor ops and one product of the keys.

    The stale candidates (nearest neighbour dropped) are refreshed at the *start* of the next step
    instead of the end of this one, in the same product as the newcomer's distances: the
    ``stale_refresh_width`` stale candidates of smallest recorded distance and the newcomer are one
    ``[R, 1 + width, d]`` block of rows against the candidates (the newcomer among them). The removal
    then sees what the end-of-step refresh and the newcomer's update gave it before: each refreshed
    candidate's nearest neighbour among the candidates, newcomer included, and every other
    candidate's record lowered to the newcomer where it is closer (a stale one's recorded distance
    is a lower bound: a newcomer closer than it is its true nearest neighbour). Where a row has
    fewer stale candidates than the width (or no newcomer), the block's spare rows are the
    candidates of smallest recorded distance, whose records are exact: recomputing them changes
    nothing but rounding. After the removal the candidates whose neighbour it dropped are marked
    stale (``nearest_position = -1``) for the next step (or :func:`maintain_candidates`) to refresh.

    ``newcomer [R, 1]``: each row's newcomer (stored index). ``every_row_full``: every row holds
    more than ``target`` candidates (known on the host when every stored token is real), so every
    row drops one and every candidate has a neighbour: no row is masked. ``probe``:
    ``(index, asked_sq, products)``: :func:`_steady_rows`'s rows with their products with every
    stored key computed elsewhere (the attention's, ``[R, 1 + w, N]``); None: chosen and computed
    here. Updates ``candidates`` (the survivors), ``nearest_*`` and ``keys_sq`` in place; returns the
    dropped token ``[R, N]`` (bool: one per row that drops one)."""
    inf = float("inf")
    if probe is None:
        index, asked, asked_sq = _steady_rows(
            keys, candidates, nearest_sq, nearest_position, newcomer, stale_refresh_width
        )
        # [R, 1 + w, N] squared distances, |x|² - 2·dot + |y|² (-2·dot exact, so one rounding per
        # add); non-candidate columns inf through their norm, each row's own column inf. (baddbmm
        # reads the stored keys where they lie: matmul copies a slice of the cache's buffer first.)
        distances = torch.baddbmm(asked_sq[..., None], asked, keys.transpose(-1, -2), alpha=-2)
    else:  # the same rows' products, computed by the attention with its logits: the same sum
        index, asked_sq, products = probe
        distances = torch.add(asked_sq[..., None], products, alpha=-2)
    keys_sq.scatter_(1, index, asked_sq)  # the newcomer's norm (the others' are rewritten as they were)
    distances = distances.add_(torch.where(candidates, keys_sq, inf)[:, None, :]).clamp_min_(0)
    distances.scatter_(2, index[..., None], inf)
    best, best_position = _oldest_minimum(distances, positions[:, None, :])
    if not every_row_full:  # (else every candidate has another: every distance found is finite)
        best_position = torch.where(torch.isfinite(best), best_position, -1.0)
    # The newcomer may be the nearest neighbour of candidates already there (row 0 of the block).
    # Its non-candidate columns are inf: never closer. (Where the row has no newcomer, row 0 is a
    # non-candidate, all inf, or a candidate, which is no closer to any candidate than that one's
    # nearest neighbour, nor than a stale one's lower bound.)
    from_newcomer = distances[:, 0]
    closer = from_newcomer < nearest_sq
    nearest_position.copy_(torch.where(closer, positions.gather(1, newcomer), nearest_position))
    nearest_sq.clamp_max_(from_newcomer)  # the same values as where(closer, from_newcomer, nearest_sq)
    nearest_sq.scatter_(1, index, best.squeeze(-1))
    nearest_position.scatter_(1, index, best_position.squeeze(-1))
    # One removal: the newer member of the closest pair (first member: oldest among the minima).
    value = torch.where(candidates, nearest_sq, inf)
    first_position, first = _oldest_minimum(value, positions, with_position=True)
    dropped_position = torch.maximum(nearest_position.gather(1, first), first_position)
    # (A candidate's position: the first member's, or its recorded neighbour's, a candidate's. The
    # positions are distinct, so no other token is dropped.)
    drop = positions == dropped_position
    if not every_row_full:  # (a row with no candidate, or not over its target, drops none)
        drop &= candidates & (candidates.sum(-1, keepdim=True) > target)
        dropped_position = torch.where(drop.any(-1, keepdim=True), dropped_position, -2.0)
    candidates.logical_xor_(drop)
    # Stale for the next step: the candidates whose neighbour was just dropped (a non-candidate marked
    # too is rewritten when it joins).
    nearest_position.masked_fill_(nearest_position == dropped_position, -1.0)
    return drop


class SubGen(Policy):
    name = "subgen"
    phases = frozenset({PREFILL, DECODE})
    config_class = SubGenConfig
    paper = "Zandieh et al. 2024, Sec. 3.2 (recent r + greedy k-center of the rest, budget r + k)"
    static_decode = True  # evicts to exactly the budget each step (tests/test_compiled_decode.py)
    compiles_below_budget = False  # its clusters (and their buffers) appear at the first eviction
    # Recent window, candidate order and ties by original position, per-token state kept as
    # per-token scores (they move with their token): an eviction fills the freed slot.
    reads_stored_order = False

    @property
    def reads_newest_token_scores(self) -> bool:
        # Its per-token state is read only for ready candidates (KEY_NORM), and a token's state is
        # written when it joins the candidates, i.e. leaves the recent window: with a recent window
        # the newest token has none yet (nothing to reset when it arrives, nor to move with it).
        return self.config.recent == 0

    def minimum_budget(self) -> int:
        return self.config.recent + 1

    def kept_per_row(self, phase: str, num_tokens: int, budget: int, state: dict) -> int | None:
        # Both decisions end in keep_top_scores: exactly min(budget, N) per row.
        return min(budget, num_tokens)

    def _split(self, scoring: ScoringInputs):
        """``(valid, forced, candidates)``: the real tokens (None where every stored token is real),
        the recent window, and the tokens the clusters choose from."""
        # The recent window by position (the stored order is not the tokens' once a decode step
        # wrote the newest token into a freed slot): the same tokens as the last r stored, since
        # the window is always kept.
        forced = scoring.recent_tokens(self.config.recent)
        if scoring.mask is None:  # every stored token is real
            return None, forced, ~forced
        valid = scoring.valid
        forced = forced & valid
        return valid, forced, valid & ~forced

    @staticmethod
    def _positions(scoring: ScoringInputs) -> torch.Tensor | None:
        """The positions that break ties and order the tokens, where the stored order is not theirs
        (None: the stored order, the same answers)."""
        return None if scoring.stored_in_order else scoring.positions

    def select_prefill(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor:
        valid, forced, candidates = self._split(scoring)
        b, h, n, d = scoring.keys.shape
        count = budget - self.config.recent
        positions = self._positions(scoring)
        order = farthest_point_order(
            scoring.keys.reshape(b * h, n, d),
            candidates.reshape(b * h, n),
            min(count, n),
            positions=None if positions is None else positions.expand(b, h, n).reshape(b * h, n),
        )
        rank = torch.zeros(b * h, n, dtype=torch.float32, device=scoring.keys.device)
        # Earlier picks rank higher; -1 entries (no candidate left) go to a scratch column.
        scores = torch.arange(order.shape[1], 0, -1, dtype=torch.float32, device=rank.device).expand_as(order)
        scratch = torch.cat([rank, rank.new_zeros(b * h, 1)], dim=1)
        scratch.scatter_(1, torch.where(order >= 0, order, n), scores)
        rank = scratch[:, :n].reshape(b, h, n)
        self._record_center_neighbours(scoring, order)
        return keep_top_scores(rank, budget, valid, forced=forced, positions=positions)

    def _record_center_neighbours(self, scoring: ScoringInputs, order: torch.Tensor) -> None:
        """Each kept center's nearest other center (distance, position) and key norm, as per-token
        scores: the decode bookkeeping starts from the prefill's decision, so the first decode
        step does the work of every later one (one newcomer), not a from-scratch pass over all
        candidates (a decode step of fixed shape compiles to one graph)."""
        b, h, n, d = scoring.keys.shape
        picked, present = order.clamp_min(0), order >= 0
        keys = scoring.keys.reshape(b * h, n, d).float()
        centers = keys.gather(1, picked[..., None].expand(-1, -1, d))
        centers_sq = (centers * centers).sum(-1)
        distances = _squared_distances(centers, centers_sq, centers, centers_sq)
        excluded = ~present[:, None, :] | torch.eye(order.shape[1], dtype=torch.bool, device=keys.device)
        best, where_best = distances.masked_fill(excluded, float("inf")).min(-1)
        found = torch.isfinite(best) & present
        positions = scoring.positions.reshape(b * h, n).float()
        neighbour_position = positions.gather(1, picked.gather(1, where_best))
        slot = torch.where(present, order, n)  # absent picks go to a scratch column

        def per_token(values: torch.Tensor, fill: float) -> torch.Tensor:
            scratch = torch.full((b * h, n + 1), fill, device=keys.device)
            return scratch.scatter_(1, slot, values)[:, :n].reshape(b, h, n)

        scores = scoring.token_scores
        scores[NEAREST_DISTANCE] = per_token(torch.where(found, best, float("inf")), float("inf"))
        scores[NEAREST_POSITION] = per_token(torch.where(found, neighbour_position, -1.0), -1.0)
        scores[KEY_NORM] = per_token(centers_sq, 0.0)

    takes_key_probes = True

    def decode_key_probes(self, scoring: ScoringInputs, budget: int, state: dict) -> KeyProbes | None:
        """A steady decode step's rows (one token joins the candidates, one leaves: what follows a
        decision): the newcomer and the stale candidates :func:`_steady_rows` picks, whose distances
        to every candidate the step reads, chosen from the state before this step's attention (the
        decision after it sees the same). None for any other step."""
        if not _steady(scoring, budget):
            return None
        b, h, n, d = scoring.keys.shape
        scores = scoring.token_scores
        shape = (b * h, n)
        split = self._split(scoring)
        candidates = split[2].reshape(shape)
        nearest_position = scores[NEAREST_POSITION].reshape(shape)
        positions = scoring.positions.reshape(shape).to(nearest_position.dtype)
        newcomer = _newest_candidate(candidates, positions)
        index, asked, asked_sq = _steady_rows(
            scoring.keys.reshape(b * h, n, d).float(),
            candidates,
            scores[NEAREST_DISTANCE].reshape(shape),
            nearest_position,
            newcomer,
            STALE_REFRESH_WIDTH,
        )
        context = _SteadyProbe(split, positions, newcomer, index, asked_sq, None)
        return KeyProbes(rows=asked.view(b, h, -1, d), context=context)

    def select_decode_drop(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor | None:
        """A steady step over real tokens only (one newcomer, one removal, every row full: after a
        decision, without a model mask): the token its closest-pair removal drops (the same
        decision as :meth:`select_decode`'s), as a stored index. None for any other step."""
        if scoring.mask is not None or not _steady(scoring, budget):
            return None
        dropped = self._decide(scoring, budget)[3]
        if dropped is None:  # (maintain_candidates takes its steady step under exactly these conditions)
            raise RuntimeError("SubGen's steady decode step did not run where its conditions held")
        return dropped.view(torch.uint8).argmax(dim=-1).view(scoring.keys.shape[:2])

    def select_decode(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor:
        kept, forced, valid, _ = self._decide(scoring, budget)
        if scoring.mask is None:
            # Every token is real: the candidates were cut to exactly budget - recent (all kept when
            # fewer), beside the recent window: what keep_top_scores keeps below, without its ranks.
            return kept | forced
        return keep_top_scores(kept.float(), budget, valid, forced=forced, positions=self._positions(scoring))

    def _decide(self, scoring: ScoringInputs, budget: int):
        """The decode decision: ``(kept candidates [B, H, N], forced, valid, dropped)``, ``dropped``
        the steady step's dropped token ``[B*H, N]`` (:func:`maintain_candidates`) or None."""
        b, h, n, d = scoring.keys.shape
        probes = scoring.key_probes
        probe = None
        if probes is not None and probes.products is not None:  # the attention computed the products
            probe = probes.context._replace(products=probes.products.reshape(b * h, -1, n))
            valid, forced, candidates = probe.split
        else:
            valid, forced, candidates = self._split(scoring)
        scores = scoring.token_scores
        shape = (b * h, n)
        device = scoring.keys.device

        def stored(name: str, fill: float | None) -> torch.Tensor | None:
            # A [B*H, N] view of the per-token score, updated in place: the cache gets its own
            # view back (no copy) and no step copies every token's entry first. A score that does
            # not view as [B*H, N] is copied once and handed back as the copy.
            value = scores.get(name)
            if value is None:
                if fill is None:
                    return None
                value = scores[name] = torch.full((b, h, n), fill, device=device)
            try:
                return value.view(shape)
            except RuntimeError:
                rows = value.reshape(shape).clone()
                scores[name] = rows.view(b, h, n)
                return rows

        decided = _decided(scores)
        nearest_sq = stored(NEAREST_DISTANCE, float("inf"))
        nearest_position = stored(NEAREST_POSITION, -1.0)
        # The ready candidates' key norms as recorded when they joined; not when the cache
        # re-rotates kept keys (cache positions: a rotation moves the norms' last bits), nor
        # before any decision.
        keys_sq = stored(KEY_NORM, None) if decided and _ROPE_POSITION not in scores else None
        # After a decision the kept candidates are ready, and the candidates not ready since are
        # the tokens that left the recent window: the newest n - budget (ready=None below says so).
        # Without a decision before (select_decode called first), none is ready.
        newcomer_bound = n - budget if decided else n - self.config.recent
        ready = None if decided else torch.zeros(shape, dtype=torch.bool, device=device)
        keys = scoring.keys.reshape(b * h, n, d)
        if keys_sq is None:
            keys_sq = (keys.float() * keys.float()).sum(-1)
            scores[KEY_NORM] = keys_sq.view(b, h, n)
        kept, dropped = maintain_candidates(
            keys,
            scoring.positions.reshape(shape) if probe is None else probe.positions,
            candidates.reshape(shape),
            budget - self.config.recent,
            nearest_sq,
            nearest_position,
            ready,
            newcomer_bound=max(0, newcomer_bound),
            removal_bound=max(0, n - budget),
            keys_sq=keys_sq,
            # Every stored token real: each row holds n - recent candidates, one over the target.
            every_row_full=scoring.mask is None and n - budget == 1,
            probe=probe,
        )
        # NEAREST_DISTANCE, NEAREST_POSITION and KEY_NORM were updated in place (stored()).
        return kept.reshape(b, h, n), forced, valid, dropped
