"""PyramidKV (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
Information Funneling"; also Yang et al., 2024, "PyramidInfer").

Scoring and selection inside a layer are SnapKV's (observation-window attention summed over
the last ``window`` prompt queries, max pooling with ``kernel``, top-k + the window itself; see
:func:`kvhive.methods.snapkv.observation_scores`). What changes is the budget per layer
(Sec. 3.3 of the PyramidKV paper, docs/METHODS.md "PyramidKV"): budgets decrease linearly from the
first to the last layer with the same total. For an average budget ``b`` the last layer gets
``b_min = b / beta`` (``beta = 20``), the first ``b_max = 2 b - b_min``, linear in between.

Window accounting (choice, as in the reference implementations of PyramidKV and Ada-KV,
``pyramidkv_utils.py`` / ``AdaptiveSnapKVCluster``): the pyramid is laid over the *selected*
part of the budget, ``b - window``; every layer keeps its observation window on top of its
pyramid share. So layer ``l`` of ``L`` keeps

    window + p_l,   p_l = p_max - l (p_max - p_min) / (L - 1),
    p_min = (b - window) / beta,   p_max = 2 (b - window) - p_min,

which is never below the window and sums to ``b L``. With ``window_in_pyramid=True`` the
pyramid spans the whole budget instead (``b_min = b / beta`` including the window, the literal
reading of docs/METHODS.md); a layer whose budget would fall below the window is then an error.

Short prompts, as the reference code (``PyramidKVCluster.update_kv`` in Zefan-Cai/PyramidKV), on
each sequence's real (unpadded) length ``n``: if ``n < 2 (b - window)`` every layer gets the
uniform budget ``b`` (SnapKV; a prompt shorter than ``b`` is kept whole); otherwise, if the first
layer's share ``p_max`` exceeds what the prompt holds (``n - window``), it is clamped to
``n - window`` and the last layer raised to ``p_min = 2 (b - window) - p_max``, the total
unchanged. (The reference's integer steps ``(p_max - p_min) // (L - 1)`` are replaced by the
exact-total rounding below.) With ``window_in_pyramid=True`` the same rule applies with the
window inside the pyramid (``b`` for ``b - window``, ``n`` for ``n - window``).

Integer budgets: the real-valued targets are rounded by the largest-remainder method, so the
integer budgets sum *exactly* to ``b × L`` and stay non-increasing. Prefill phase only, like SnapKV.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvhive.methods.base import require
from kvhive.methods.snapkv import SnapKV, SnapKVConfig


def require_beta(beta: object) -> None:
    ok = isinstance(beta, (int, float)) and not isinstance(beta, bool) and math.isfinite(beta) and beta > 1
    require(ok, "beta", "a finite number > 1 (last layer gets budget / beta; beta = 1 would be uniform SnapKV)", beta)


def _round_preserving_sum(targets: list[float], total: int) -> list[int]:
    """Largest-remainder rounding: integers within 1 of ``targets`` summing exactly to ``total``.

    Ties in the fractional part go to the earlier (shallower) layer, so a non-increasing list of
    targets gives a non-increasing list of integers.
    """
    floors = [math.floor(t + 1e-9) for t in targets]
    remainder = total - sum(floors)
    order = sorted(range(len(targets)), key=lambda i: (-(targets[i] - floors[i]), i))
    for i in order[: max(0, remainder)]:
        floors[i] += 1
    return floors


def pyramid_budgets(
    budget: int,
    num_layers: int,
    beta: float,
    window: int,
    window_in_pyramid: bool = False,
    context_length: int | None = None,
) -> list[int]:
    """Per-layer integer budgets, linear from the first to the last layer, summing to ``budget × L``.

    See the module docstring for the formula, the window accounting and the short-prompt rule
    (``context_length``: the sequence's real length; None = long enough for the full pyramid).
    """
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"invalid budget={budget!r}: expected an integer >= 1 (tokens per head)")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"invalid num_layers={num_layers!r}: expected an integer >= 1")
    require_beta(beta)
    if budget < window:
        raise ValueError(
            f"invalid budget={budget}: PyramidKV keeps the observation window (window={window}) in every layer, "
            f"so the budget must be >= {window}"
        )
    if context_length is not None:
        require(
            isinstance(context_length, int) and not isinstance(context_length, bool) and context_length >= 1,
            "context_length",
            "an integer >= 1 (real tokens of the sequence)",
            context_length,
        )
    if num_layers == 1:
        return [budget]
    base = budget if window_in_pyramid else budget - window
    offset = 0 if window_in_pyramid else window
    if context_length is not None and context_length < 2 * base:
        # The reference code's short prompt: SnapKV's uniform budget in every layer.
        return [budget] * num_layers
    smallest = base / beta
    largest = 2 * base - smallest
    if context_length is not None and largest >= context_length - offset:
        # The reference code clamps the first layer at what the prompt holds and raises the last
        # by as much, so the total stays 2 x base per pair of layers.
        largest = context_length - offset
        smallest = 2 * base - largest
    step = (largest - smallest) / (num_layers - 1)
    targets = [offset + largest - layer * step for layer in range(num_layers)]
    budgets = _round_preserving_sum(targets, budget * num_layers)
    if budgets[-1] < window:
        raise ValueError(
            f"invalid budget={budget} for PyramidKV with window_in_pyramid=True, beta={beta}: the last layer would "
            f"keep {budgets[-1]} tokens, fewer than the observation window (window={window}); use a budget >= "
            f"{math.ceil(window * beta)} or window_in_pyramid=False"
        )
    return budgets


@dataclass(frozen=True)
class PyramidKVConfig(SnapKVConfig):
    beta: float = 20.0
    window_in_pyramid: bool = False

    def validate(self) -> None:
        super().validate()
        require_beta(self.beta)
        require(isinstance(self.window_in_pyramid, bool), "window_in_pyramid", "True or False", self.window_in_pyramid)


class PyramidKV(SnapKV):
    """SnapKV inside each layer; only the layer budgets differ."""

    name = "pyramidkv"
    config_class = PyramidKVConfig
    paper = "Cai et al. 2024, Sec. 3.3 (pyramidal layer budgets) with SnapKV selection"

    def layer_budgets(self, budget: int, num_layers: int, context_length: int | None = None) -> list[int]:
        config = self.config
        return pyramid_budgets(budget, num_layers, config.beta, config.window, config.window_in_pyramid, context_length)
