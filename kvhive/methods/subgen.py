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
from kvhive.methods.subgen_candidates import (
    KEY_NORM,
    NEAREST_DISTANCE,
    NEAREST_POSITION,
    SteadyProbe,
    after_every,
    is_steady_step,
    maintain_candidates,
    neighbours_recorded,
    newest_candidate,
    refresh_width,
    squared_distances,
    steady_rows,
)
from kvhive.methods.submodular_graph import prefill_compile_backend
from kvhive.static_step import BoundedCache, CapturedLoops, capture_stream, per_thread_attributes

# The cache's record of the position each kept key is rotated at (kvhive.cache.kv_cache.ROPE_POSITION,
# only with cache positions): its keys are re-rotated, so recorded key norms are not reused then.
_ROPE_POSITION = "_rope_position"


@dataclass(frozen=True)
class SubGenConfig(PolicyConfig):
    recent: int = 32
    # None: the paper's rule on every decode decision (every stale candidate refreshed before a
    # removal). An integer: refresh at most that many per row and removal, an approximation
    # (docs/METHODS.md, SubGen decode) that is cheaper on long prompts whose keys have hubs.
    stale_refresh_width: int | None = None

    def validate(self) -> None:
        require_int_at_least(self.recent, 0, "recent")
        if self.stale_refresh_width is not None:
            require_int_at_least(self.stale_refresh_width, 1, "stale_refresh_width")


# ---------------------------------------------------------------------------------------------
# Greedy k-center (farthest point)
# ---------------------------------------------------------------------------------------------


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
    argmax of each step stays on the device. (A blocked order that reads the keys once per several
    centers needs a host-read certificate at every pick, and sound certificates fail often on
    high-dimensional keys, so the exact algorithm takes the pass per pick.)

    ``fast`` (the GPU fast path): run each step as one fixed-shape launch or function.
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
        chosen = positions.masked_fill(~candidates, after_every(positions)).argmin(-1)
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
        # on CPU (a contiguous [R, d, 1] takes a slower kernel there).
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


# The GPU fast path: the same loop as one fixed-shape step, compiled and captured. The eager loop
# above is launch-bound on a GPU (a dozen or so dispatches per center, budget - recent centers per
# layer): the step below is a pure function of fixed-shape tensors (state
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
    on CUDA); on every torch kvhive runs on, as BumbleBee's (``submodular_graph.fast_backend``)."""
    if static_step.config.prefill_kernels and farthest_kernel.kernel_supports(keys):
        return KERNEL_BACKEND
    return prefill_compile_backend()


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


class SubGen(Policy):
    name = "subgen"
    phases = frozenset({PREFILL, DECODE})
    config_class = SubGenConfig
    paper = "Zandieh et al. 2024, Sec. 3.2 (recent r + greedy k-center of the rest, budget r + k)"
    static_decode = True  # evicts to exactly the budget each step (tests/cache/test_compiled_decode.py)
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
        distances = squared_distances(centers, centers_sq, centers, centers_sq)
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
        decision): the newcomer and the stale candidates :func:`steady_rows` picks, whose distances
        to every candidate the step reads, chosen from the state before this step's attention (the
        decision after it sees the same). None for any other step."""
        if not is_steady_step(scoring, budget, self.config.stale_refresh_width):
            return None
        b, h, n, d = scoring.keys.shape
        scores = scoring.token_scores
        shape = (b * h, n)
        split = self._split(scoring)
        candidates = split[2].reshape(shape)
        nearest_position = scores[NEAREST_POSITION].reshape(shape)
        positions = scoring.positions.reshape(shape).to(nearest_position.dtype)
        newcomer = newest_candidate(candidates, positions)
        index, asked, asked_sq = steady_rows(
            scoring.keys.reshape(b * h, n, d).float(),
            candidates,
            scores[NEAREST_DISTANCE].reshape(shape),
            nearest_position,
            newcomer,
            refresh_width(self.config.stale_refresh_width, n),
        )
        context = SteadyProbe(split, positions, newcomer, index, asked_sq, None)
        return KeyProbes(rows=asked.view(b, h, -1, d), context=context)

    def select_decode_drop(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor | None:
        """A steady step over real tokens only (one newcomer, one removal, every row full: after a
        decision, without a model mask): the token its closest-pair removal drops (the same
        decision as :meth:`select_decode`'s), as a stored index. None for any other step."""
        if scoring.mask is not None or not is_steady_step(scoring, budget, self.config.stale_refresh_width):
            return None
        dropped = self._decide(scoring, budget)[3]
        if dropped is None:  # (maintain_candidates takes its steady step under exactly these conditions)
            raise RuntimeError("SubGen's steady decode step did not run where its conditions held")
        # argmax takes no bool: a free view as uint8 eagerly; traced, a conversion (which Inductor fuses
        # into the argmax), as Inductor before torch 2.13 cannot lower a bool tensor viewed as another dtype.
        flags = dropped.to(torch.uint8) if torch.compiler.is_compiling() else dropped.view(torch.uint8)
        return flags.argmax(dim=-1).view(scoring.keys.shape[:2])

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

        decided = neighbours_recorded(scores)
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
            stale_refresh_width=self.config.stale_refresh_width,
        )
        # NEAREST_DISTANCE, NEAREST_POSITION and KEY_NORM were updated in place (stored()).
        return kept.reshape(b, h, n), forced, valid, dropped
