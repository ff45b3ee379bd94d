"""The objective BumbleBee maximises, model-agnostic and batched over rows.

A *row* is one independent problem (one (batch, KV head) pair of one layer); every function
works on ``R`` rows at once with tensor ops.

Objective (BumbleBee Eq. 2-4, normalised as docs/METHODS.md asks, ``f(empty) = 0``, ``f(V) = 1``)::

Objective (BumbleBee Eq. 2-4, normalised as docs/METHODS.md asks, ``f(empty) = 0``, ``f(V) = 1``)::

    g(S) = lam * f_FL(S) / f_FL(V) + (1 - lam) * phi(sum_{u in S} a_u) / phi(sum_{u in V} a_u)
    f_FL(S) = sum_{v in V} max_{u in S} sim(v, u),   sim = ReLU(cos(k_v, k_u))

Invalid elements (left padding) have zero similarity and zero weight; the maximisers never
pick one while a valid element is still available, and the streaming step drops them first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Rank given to invalid (padding) elements: below every real gain, above "not selectable".
PADDING_GAIN = -1e30


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
    the upper block triangle and mirroring it halves the flops but is slower on CPU because of
    the transposed copy. ``out``: a
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
    a dot product with a zero vector, +0 as a masked entry is (the product's accumulators start
    at +0; a non-finite padding key gives NaN there, as masking the product would). Always masked: a
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
    does not), so the mirrored entries are the ones the full product writes. The panels stay in
    cache, which makes them faster than the full product on the CPU.
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
    test convergence: over ``alpha`` in [0.005, 1], ``beta`` in [0, 1e6] and ``x`` in
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


def safe_divide(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
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
        self.facility_scale = safe_divide(torch.full_like(self.fl_total, self.lam), self.fl_total)
        self.feature_scale = safe_divide(torch.full_like(self.phi_total, 1.0 - self.lam), self.phi_total)

    @property
    def rows(self) -> int:
        return self.weights.shape[0]

    @property
    def size(self) -> int:
        return self.weights.shape[1]

    def facility_location(self, chosen: torch.Tensor) -> torch.Tensor:
        """``f_FL(S) / f_FL(V)`` for ``chosen[R, n]`` (bool), from the definition."""
        covered = self.sim.masked_fill(~chosen[:, None, :], 0.0).amax(dim=-1).double().sum(dim=-1)
        return safe_divide(covered, self.fl_total)

    def feature(self, chosen: torch.Tensor) -> torch.Tensor:
        """``phi(a(S)) / phi(a(V))`` for ``chosen[R, n]``."""
        mass = (self.weights * chosen).sum(dim=-1)
        return safe_divide(self.phi(mass), self.phi_total)

    def value(self, chosen: torch.Tensor) -> torch.Tensor:
        """``g_lam(S)`` per row, float64, from the definition (tests compare greedy against it)."""
        return self.lam * self.facility_location(chosen) + (1.0 - self.lam) * self.feature(chosen)
