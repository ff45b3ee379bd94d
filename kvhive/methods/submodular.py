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
import math
from dataclasses import dataclass

import torch

# Rank given to invalid (padding) elements: below every real gain, above "not selectable".
PADDING_GAIN = -1e30
# Lazy evaluation: elements per row whose exact gain a round computes (the first round of a
# step takes as many as the previous step needed, up to 4x this).
_LAZY_EVALUATIONS = 8
# Plain greedy: elements of the temporary [rows, candidates, n] tensor per chunk.
_PLAIN_CHUNK = 1 << 24


# ---------------------------------------------------------------------------------------------
# Similarity
# ---------------------------------------------------------------------------------------------


def key_norms(keys: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """``||k||`` clamped at ``eps`` (float32), so ``cos = k_v . k_u / (norm_v * norm_u)``."""
    return keys.float().norm(dim=-1).clamp_min(eps)


def relu_cosine_similarity(keys: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """``[R, n, n]`` ReLU of the pairwise cosine similarity of ``keys[R, n, d]`` (float32).

    Rows and columns of invalid elements are zero. One batched matrix product: computing only
    the upper block triangle and mirroring it halves the flops but was slower on CPU because of
    the transposed copy (1.17 s vs 0.76 s for 8 x 4096 x 4096, d = 128, one thread).
    """
    units = keys.float() / key_norms(keys)[..., None]
    sim = torch.bmm(units, units.transpose(1, 2))
    sim.clamp_(min=0)
    if valid is not None and not bool(valid.all()):
        weight = valid.to(sim.dtype)
        sim.mul_(weight[:, :, None]).mul_(weight[:, None, :])
    return sim


# ---------------------------------------------------------------------------------------------
# Concave functions phi of the feature-based term (float64)
# ---------------------------------------------------------------------------------------------


def power_concave(
    x: torch.Tensor, alpha: float = 0.04, beta: float = 1.0, tolerance: float = 1e-14, max_iterations: int = 100
) -> torch.Tensor:
    """``phi(x) = g^{-1}(x)`` with ``g(y) = alpha * y^(1/alpha) + beta * y`` (BumbleBee ♦), elementwise.

    ``g`` is increasing and convex on ``[0, inf)``, so Newton's method started above the root
    decreases monotonically to it (no overshoot). Both ``x / beta`` and ``(x / alpha)^alpha``
    are above the root (each drops one non-negative term of ``g``); the smaller one is the start.
    Vectorised over any shape; iterates until every element moved less than ``tolerance``
    relative.
    """
    x = x.double().clamp_min(0)
    y = (x / alpha).pow(alpha)
    if beta > 0:
        y = torch.minimum(y, x / beta)
    for _ in range(max_iterations):
        power = y.pow(1.0 / alpha - 1.0)  # g'(y) - beta
        step = (alpha * power * y + beta * y - x) / (power + beta).clamp_min(1e-300)
        y = (y - step).clamp_min_(0)
        if not bool((step.abs() > tolerance * y).any()):
            break
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

    def __init__(self, sim: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor, lam: float, phi: Concave):
        self.sim = sim
        self.valid = valid
        self.weights = weights.double().clamp_min(0) * valid
        self.lam = float(lam)
        self.phi = phi
        self.fl_total = sim.amax(dim=-1).double().sum(dim=-1)  # f_FL(V)
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
        # Rows of the symmetric matrix (contiguous, unlike its columns): [r, m, n].
        similarity = (
            objective.sim.view(-1, objective.size)
            .index_select(0, (rows[:, None] * objective.size + elements).reshape(-1))
            .view(*elements.shape, objective.size)
        )
        similarity.sub_(self.coverage[rows][:, None, :]).clamp_(min=0)
        return similarity.sum(dim=-1).double() * objective.facility_scale[rows][:, None]

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
) -> torch.Tensor:
    """``chosen[R, n]`` with exactly ``min(k, n)`` elements per row maximising ``g`` greedily.

    ``method``:
      * ``"plain"``: Nemhauser et al. — every step evaluates every remaining element.
      * ``"lazy"``: Minoux's accelerated greedy — stale gains are upper bounds (submodularity);
        each step evaluates elements in decreasing order of their bounds until the best exact
        gain beats the next bound. Same set as plain (ties go to the lowest index in both).
      * ``"stochastic"``: stochastic greedy (Mirzasoleiman et al. 2015, the paper's fast path)
        — each step takes the best element of ``s = (n / k) ln(1 / epsilon)`` uniform draws
        from the remaining elements (independent draws, the form of their Lemma 2; when
        ``s`` covers what remains, all of it); the argmax over the sample is found lazily, so
        the result is exactly stochastic greedy's, at lazy-greedy cost.

    Each row is its own problem: the sample size uses the row's own number of valid elements
    and its draws come from ``generator[row]`` (a list, one per row) or, given one generator,
    from it row after row; so a row padded on the left draws exactly what it draws alone.

    Only the facility-location part of a bound is stale: the feature part ``c(e | S)`` costs
    ``O(1)`` per element and is recomputed exactly at every step, which keeps the bounds tight.
    All rows advance together; padding is picked only once a row has no valid element left.
    """
    rows, n = objective.rows, objective.size
    k = min(k, n)
    state = _GreedyState(objective)
    if k <= 0:
        return state.chosen
    device = objective.sim.device
    all_rows = state.rows
    valid = objective.valid
    if method == "plain":
        chunk = max(1, _PLAIN_CHUNK // max(1, rows * n))
        everything = torch.arange(n, device=device).expand(rows, n)
        for _ in range(k):
            facility = torch.cat(
                [state.facility_gains(all_rows, everything[:, start : start + chunk]) for start in range(0, n, chunk)],
                dim=1,
            )
            gains = state.combine(facility, state.feature_gains(everything), valid)
            state.add(gains.masked_fill(state.chosen, float("-inf")).argmax(dim=-1))
        return state.chosen
    if method not in ("lazy", "stochastic"):
        raise ValueError(f"invalid greedy={method!r}: expected 'stochastic', 'lazy' or 'plain'")

    # Stale facility-location gains: upper bounds of the current ones (submodularity).
    facility_bounds = objective.sim.sum(dim=-1).double() * objective.facility_scale[:, None]
    everything = torch.arange(n, device=device).expand(rows, n)
    # Stochastic greedy draws its sample from the valid elements left (padding only once none
    # is left): independent uniform draws from a static valid-first index list, the chosen
    # ones rejected, as many draws as give ``sample`` elements of V \ S in expectation.
    valid_first = torch.sort((~valid).long(), dim=-1, stable=True).indices
    valid_count = valid.sum(dim=-1)
    valid_left = valid_count.clone()
    counts_host = valid_count.tolist()
    if method == "lazy":
        samples = [n] * rows
    else:  # each row's own ground set: padding does not enlarge its sample
        samples = [stochastic_sample_size(max(1, count), k, epsilon) for count in counts_host]
    generators = generator if isinstance(generator, (list, tuple)) else [generator] * rows
    if len(generators) != rows:
        raise ValueError(f"invalid generator: expected one per row ({rows}), got {len(generators)}")
    batch = _LAZY_EVALUATIONS  # evaluations per row in the first round of a step; adapts
    for step in range(k):
        from_valid = valid_left > 0
        population = torch.where(from_valid, valid_count, n - valid_count)
        left = torch.where(from_valid, valid_left, n - valid_count - (step - (valid_count - valid_left)))
        draws = [
            math.ceil(samples[r] * p / max(1, q))
            for r, (p, q) in enumerate(zip(population.tolist(), left.tolist(), strict=True))
        ]
        full = [d >= p for d, p in zip(draws, population.tolist(), strict=True)]
        if all(full):  # every sample would cover V \ S: evaluate all of it (a plain greedy step)
            pool = everything
            eligible = ~state.chosen & (valid == from_valid[:, None])
        else:
            # Rows draw independently (their own count, generator and rejection retries), then
            # are padded to one width with ineligible entries; a row whose sample covers what is
            # left takes all of its elements, as alone.
            width = max(n if f else d for d, f in zip(draws, full, strict=True))
            pool = torch.zeros(rows, width, dtype=torch.long, device=device)
            eligible = torch.zeros(rows, width, dtype=torch.bool, device=device)
            offsets = torch.where(from_valid, 0, valid_count).tolist()
            for r in range(rows):
                if full[r]:
                    pool[r, :n] = everything[r]
                    eligible[r, :n] = ~state.chosen[r] & (valid[r] == from_valid[r])
                    continue
                size = int(population[r])
                while True:
                    drawn = torch.rand(draws[r], generator=generators[r], device=device) * size
                    row_pool = valid_first[r].gather(0, drawn.long().clamp_(max=n - 1) + offsets[r])
                    row_eligible = ~state.chosen[r].gather(0, row_pool)
                    if bool(row_eligible.any()):
                        break
                pool[r, : draws[r]] = row_pool
                eligible[r, : draws[r]] = row_eligible
        pool_feature = state.feature_gains(pool)
        bounds = state.combine(facility_bounds.gather(1, pool), pool_feature, valid.gather(1, pool))
        bounds = bounds.masked_fill(~eligible, float("-inf"))
        # Evaluate in decreasing order of the bounds until the best exact gain so far beats the
        # next bound: nothing unevaluated can reach it (Minoux's lazy greedy). Ties go to the
        # lowest element index, as in plain greedy: the sort is stable over an index-ordered pool
        # (lazy), and a bound equal to the best gain is still evaluated, except between padding
        # elements, whose gain is their bound.
        bounds, order = bounds.sort(dim=-1, descending=True, stable=True)
        order_feature = pool_feature.gather(1, order)
        elements = pool.gather(1, order)
        best_gain = torch.full((rows,), float("-inf"), dtype=torch.float64, device=device)
        picks = torch.full((rows,), n, dtype=torch.long, device=device)
        start = 0
        while True:
            stop = min(pool.shape[1], start + batch)
            chunk = elements[:, start:stop]
            facility = state.facility_gains(all_rows, chunk)
            facility_bounds.scatter_(1, chunk, facility)
            exact = state.combine(facility, order_feature[:, start:stop], valid.gather(1, chunk))
            exact = exact.masked_fill(bounds[:, start:stop] == float("-inf"), float("-inf"))
            chunk_best = exact.max(dim=-1).values
            chunk_pick = torch.where(exact == chunk_best[:, None], chunk, n).amin(dim=-1)
            picks = torch.where(
                chunk_best > best_gain,
                chunk_pick,
                torch.where(chunk_best == best_gain, torch.minimum(picks, chunk_pick), picks),
            )
            best_gain = torch.maximum(best_gain, chunk_best)
            if stop == pool.shape[1]:
                break
            following = bounds[:, stop]
            settled = (best_gain > following) | (following == float("-inf")) | (best_gain == PADDING_GAIN)
            if bool(settled.all()):
                break
            start = stop
        batch = max(_LAZY_EVALUATIONS, min(4 * _LAZY_EVALUATIONS, stop))
        state.add(picks)
        valid_left -= valid.gather(1, picks[:, None]).squeeze(1).long()
    return state.chosen


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
    only needs each member's nearest other member (``nearest``, ``nearest_slot``), kept up to
    date in ``O(T)`` per step plus a scan of the rows whose nearest member left.
    """

    sim: torch.Tensor  # [R, T, T] float32, by slot
    self_sim: torch.Tensor  # [R, T] sim(v, v): 1, or 0 for padding / zero keys
    nearest: torch.Tensor  # [R, T] max_{u in S, u != v} sim(v, u)
    nearest_slot: torch.Tensor  # [R, T] long
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
        sim = sim.contiguous().clone()
        self_sim = sim.diagonal(dim1=1, dim2=2).clone()
        others = sim.clone()
        others.diagonal(dim1=1, dim2=2).zero_()
        nearest, nearest_slot = others.max(dim=-1)
        order = torch.arange(size, device=sim.device).expand(rows, size)
        return cls(
            sim,
            self_sim,
            nearest,
            nearest_slot,
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
    ) -> torch.Tensor:
        """Let ``joiners`` stored tokens ``first_joiner, first_joiner + 1, ...`` join one at a time;
        after each, drop the element of ``S' = S + {x}`` with the smallest marginal gain
        ``g(x | S' - x)`` (Alg. 2, lines 10-11). Returns the dropped stored indices ``[R, joiners]``.

        ``keys[R, N, d]``, ``valid[R, N]``, ``weights[R, N]`` (accumulated attention) and
        ``positions[R, N]`` describe the stored tokens; the members are stored first (stored
        index = rank), the joiners next. ``normalise_mass``: ``phi`` is applied to the weights
        divided by their sum over ``S'`` (BumbleBee's ``importance_scale="normalised"``). Invalid elements are dropped first. Cost per joiner:
        ``O(T d + T)`` plus a scan of the rows whose nearest member left.
        """
        rows, size = self.slot_of_rank.shape
        device = keys.device
        slots = torch.arange(size, device=device)
        all_rows = torch.arange(rows, device=device)
        member_index = self.rank_of_slot.clone()  # stored index of each slot's member
        dropped = torch.empty(rows, joiners, dtype=torch.long, device=device)
        for j in range(joiners):
            x = first_joiner + j
            key_x = keys[:, x].float()
            raw_norm = key_x.norm(dim=-1)
            norm_x = raw_norm.clamp_min(1e-12)
            valid_x = valid[:, x]
            # O(T d): a multiply-sum beats a batched matrix-vector product on CPU here.
            dots = (keys[:, :x].float() * key_x[:, None, :]).sum(dim=-1).gather(1, member_index)
            sim_x = (dots / (self.norms * norm_x[:, None])).clamp_(min=0).mul_(self.valid & valid_x[:, None])
            self_x = (raw_norm / norm_x).square() * valid_x

            nearest_with_x = torch.maximum(self.nearest, sim_x)
            facility = torch.cat([self.self_sim - nearest_with_x, (self_x - sim_x.amax(dim=-1))[:, None]], dim=1)
            facility = facility.clamp_(min=0).double()
            facility_total = self.self_sim.double().sum(dim=-1) + self_x  # f_FL(S') on the ground set S'
            valid_all = torch.cat([self.valid, valid_x[:, None]], dim=1)
            mass = torch.cat([weights.gather(1, member_index), weights[:, x, None]], dim=1).double() * valid_all
            total = mass.sum(dim=-1, keepdim=True)
            if normalise_mass:  # phi of the fraction of the ground set's attention mass
                mass = _safe_divide(mass, total)
                total = (total > 0).double()
            phi_total = phi(total)
            feature = _safe_divide(phi.loss(total, mass, phi_total), phi_total)
            gains = lam * _safe_divide(facility, facility_total[:, None]) + (1.0 - lam) * feature
            drop = gains.masked_fill_(~valid_all, float("-inf")).argmin(dim=-1)  # == size: x itself goes

            # x takes the slot y of the dropped member (rows where x itself goes keep their state:
            # every update below is a no-op there).
            replace = drop < size
            y = drop.clamp(max=size - 1)[:, None]
            dropped[:, j] = torch.where(replace, member_index.gather(1, y).squeeze(1), x)
            keep_old = ~replace[:, None]
            # Write x's row and column of the cached matrix (O(T)).
            row = torch.where(keep_old, self.sim[all_rows, y[:, 0]], sim_x.scatter(1, y, self_x[:, None]))
            self.sim[all_rows, y[:, 0]] = row
            self.sim[all_rows, :, y[:, 0]] = row
            for field, value in ((self.self_sim, self_x), (self.norms, norm_x), (self.valid, valid_x)):
                field.scatter_(1, y, torch.where(keep_old, field.gather(1, y), value[:, None]))
            member_index.scatter_(1, y, torch.where(keep_old, member_index.gather(1, y), x))
            # Nearest other member: x beats the old one, or the old one stays, except for the
            # members whose nearest one just left, and for x: scan their rows.
            old_slot = self.nearest_slot
            rescan = replace[:, None] & ((old_slot == y) | (slots == y))
            self.nearest_slot = torch.where(keep_old | (sim_x <= self.nearest), old_slot, y)
            self.nearest = torch.where(keep_old, self.nearest, nearest_with_x)
            which, members = rescan.nonzero(as_tuple=True)
            scanned = self.sim[which, members]
            scanned[torch.arange(which.numel(), device=device), members] = 0.0
            value, argument = scanned.max(dim=-1)
            self.nearest[which, members] = value
            self.nearest_slot[which, members] = argument
            # x is the newest member: its slot moves to the last rank, the later ones move up.
            rank_y = self.rank_of_slot.gather(1, y)
            shifted = (self.rank_of_slot - (self.rank_of_slot > rank_y).long()).scatter_(1, y, size - 1)
            self.rank_of_slot = torch.where(keep_old, self.rank_of_slot, shifted)
            self.slot_of_rank = torch.empty_like(shifted).scatter_(1, self.rank_of_slot, slots.expand(rows, size))
        self.positions = positions.gather(1, member_index.gather(1, self.slot_of_rank))
        return dropped

    def nbytes(self) -> int:
        """Bytes held: the ``T x T`` similarity matrix plus ``O(T)`` per row (at most a ``k x k``
        matrix per row for a budget ``k``, never the stored tokens' ``N x N``)."""
        return sum(getattr(self, field.name).nbytes for field in dataclasses.fields(self))

    def aligned_with(self, positions: torch.Tensor) -> bool:
        """Whether the first ``T`` stored tokens are this summary's members (``positions[R, >=T]``)."""
        size = self.size
        return positions.shape[-1] >= size and bool((positions[:, :size] == self.positions).all())

    @classmethod
    def concatenate(cls, parts: list[StreamingSummary]) -> StreamingSummary:
        """Rows of several summaries (same ``T``) stacked in order."""
        if len(parts) == 1:
            return parts[0]
        fields = [field.name for field in dataclasses.fields(cls)]
        return cls(**{name: torch.cat([getattr(part, name) for part in parts], dim=0) for name in fields})
