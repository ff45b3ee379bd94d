"""Ada-KV (Feng et al., 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget
Allocation for Efficient LLM Inference"): adaptive head-wise budget allocation.

Algorithm 2 (adaptive allocation) inside Algorithm 3 (Ada-SnapKV / Ada-Pyramid in one layer),
as settled by METHODS.md "Ada-KV":

* The layer's total budget is ``B = b × H`` (``b`` tokens per stored head on average, ``H``
  stored heads). Every head keeps its recent window (the SnapKV observation window, or AhaKV's
  recent budget ``B_r``), so the part left to allocate is ``B' = (b - w) × H``; with
  ``b' = b - w`` the selectable budget of an average head.
* **Safeguard** (Sec. 3.4, ``alpha = 0.5``): every head first keeps its own top
  ``floor(alpha × b')`` keys.
* **Adaptive part** (Algorithm 2): the remaining ``B' - H floor(alpha × b')`` entries go to the
  largest scores across *all heads of the layer* (the safeguard picks excluded); a head's budget
  ``B_i`` is how many of the layer's selected scores it owns.
* The window is kept in every head on top of its ``B_i``.

Window accounting (documented choice, as in the authors' code ``AdaptiveSnapKVCluster``, where
``base_capacity = budget - window_size`` and ``floor_capacity = int(base_capacity × alpha)``):
the window counts against the budget, so a layer keeps *exactly* ``b × H`` tokens per sequence
(``H w`` window entries + ``H b'`` selected ones). Each head keeps at least
``w + floor(alpha (b - w)) >= floor(alpha × b)`` tokens. With ``alpha = 1`` every head keeps
exactly ``b`` and Ada-SnapKV is SnapKV. (The authors' code rescales the global top counts to
``floor + (1 - alpha) × count``; METHODS.md's "own top floor first, then global top of the rest"
is used here, which also makes Theorem 4 hold with the safeguard on.)

Scores are compared across heads as softmax-normalised attention weights (every head's window
rows sum to one): SnapKV's pooled observation-window weights for Ada-SnapKV / Ada-Pyramid, and
AhaKV's step-gain-softmax recent accumulation times the normalised value prior for Ada-AhaKV.
The allocation (:func:`adaptive_allocation`, :func:`ada_keep`) is vectorised over batch and
heads (no Python loop over heads) and takes any scorer's ``[B, H, N]`` scores.

Theorem 4 (App. A.5): for the same scores and total budget, the summed kept weight under the
adaptive allocation is >= under the uniform one (the global top-k of the post-safeguard
remainder dominates the per-head picks).

**Storage**: heads keep different numbers of tokens; the cache stores them for real (variable
per-head lengths, evicted entries freed) and decodes with its variable-length path.

**Head granularity**: ``head_granularity="kv"`` (default) allocates per KV head. ``"query"``
stores one copy of each KV head per query head (the cache grows by the group size before
compression, as in the original Ada-KV runs on GQA models) and allocates per query head; the
budget ``b`` is then per *query* head (``b × Hq`` per layer). On a model with one KV head
(Gemma-3-270M) only ``"query"`` makes the allocation adaptive.

Prefill phase only, as in the paper (Algorithm 3 runs after each layer's prefill); tokens
generated afterwards are appended to every head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvhive.methods.ahakv import ahakv_scores
from kvhive.methods.base import PREFILL, Policy, PolicyConfig, ScoringInputs, require, require_int_at_least, require_probability
from kvhive.methods.pyramidkv import pyramid_budgets, require_beta
from kvhive.methods.snapkv import SnapKVConfig, observation_scores

_PADDING_RANK = -1e30  # below every real score, above the entries already kept (-inf)


def safeguard_count(budget: int, alpha: float) -> int:
    """``floor(alpha × budget)`` without float fuzz (``0.29 × 100`` is 29, not 28)."""
    return max(0, min(budget, math.floor(alpha * budget + 1e-9)))


def adaptive_allocation(scores: torch.Tensor, budget: int, alpha: float,
                        valid: torch.Tensor | None = None) -> torch.Tensor:
    """Ada-KV's Algorithm 2 with the safeguard, as a keep mask ``[B, H, M]``.

    ``scores[B, H, M]``: comparable scores of the candidate keys of each head; ``budget``: the
    average number of candidates kept per head (``b'``). Every head keeps its own top
    ``floor(alpha × budget)``; the rest of the layer's ``H × budget`` goes to the largest
    remaining scores over all heads. Each batch row keeps exactly ``H × min(budget, M)``
    entries; row ``(b, h)`` keeps ``keep[b, h].sum()`` (its allocated budget ``B_i``). Padding
    (``valid`` False) ranks below every real key in every head.
    """
    batch, heads, candidates = scores.shape
    if budget >= candidates:
        return torch.ones_like(scores, dtype=torch.bool)
    if budget <= 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    ranking = scores.float()
    if valid is not None:
        ranking = torch.where(valid, ranking, torch.full_like(ranking, _PADDING_RANK))
    keep = torch.zeros(batch, heads, candidates, dtype=torch.bool, device=scores.device)
    floor = safeguard_count(budget, alpha)
    if floor > 0:
        keep.scatter_(-1, ranking.topk(floor, dim=-1).indices, True)
    adaptive = heads * (budget - floor)
    if adaptive > 0:
        remaining = ranking.masked_fill(keep, float("-inf")).reshape(batch, heads * candidates)
        chosen = remaining.topk(adaptive, dim=-1).indices
        keep = keep.reshape(batch, heads * candidates).scatter_(-1, chosen, True).reshape(batch, heads, candidates)
    return keep


def ada_keep(scores: torch.Tensor, budget: int, window: int, alpha: float,
             valid: torch.Tensor | None = None) -> torch.Tensor:
    """Keep mask ``[B, H, N]``: the last ``window`` tokens of every head plus the adaptive
    allocation of ``H × (budget - window)`` over the older tokens (see the module docstring).

    Each batch row keeps exactly ``H × min(budget, N)`` tokens.
    """
    num_tokens = scores.shape[-1]
    if budget >= num_tokens:
        return torch.ones_like(scores, dtype=torch.bool)
    window = min(window, budget)
    older = num_tokens - window
    keep_older = adaptive_allocation(
        scores[..., :older], budget - window, alpha, None if valid is None else valid[..., :older]
    )
    recent = torch.ones(*scores.shape[:-1], window, dtype=torch.bool, device=scores.device)
    return torch.cat([keep_older, recent], dim=-1)


def _validate_ada(alpha: float, head_granularity: str) -> None:
    require_probability(alpha, "alpha")
    require(head_granularity in ("kv", "query"), "head_granularity", "'kv' or 'query'", head_granularity)


@dataclass(frozen=True)
class AdaSnapKVConfig(SnapKVConfig):
    alpha: float = 0.5
    head_granularity: str = "kv"

    def validate(self) -> None:
        super().validate()
        _validate_ada(self.alpha, self.head_granularity)


@dataclass(frozen=True)
class AdaPyramidKVConfig(AdaSnapKVConfig):
    beta: float = 20.0
    window_in_pyramid: bool = False

    def validate(self) -> None:
        super().validate()
        require_beta(self.beta)
        require(isinstance(self.window_in_pyramid, bool), "window_in_pyramid", "True or False", self.window_in_pyramid)


@dataclass(frozen=True)
class AdaAhaKVConfig(PolicyConfig):
    recent: int = 32
    kernel: int = 7
    alpha: float = 0.5
    head_granularity: str = "kv"

    def validate(self) -> None:
        require_int_at_least(self.recent, 1, "recent")
        require_int_at_least(self.kernel, 1, "kernel")
        require(self.kernel % 2 == 1, "kernel", "an odd integer (centred mean filter)", self.kernel)
        _validate_ada(self.alpha, self.head_granularity)


class _AdaKV(Policy):
    """Shared prefill logic: score, then :func:`ada_keep` with the method's window."""

    phases = frozenset({PREFILL})

    def __init__(self, config=None, **parameters) -> None:
        super().__init__(config, **parameters)
        # Read by the cache (expand storage to query heads) and the attention (scoring inputs).
        self.head_granularity = self.config.head_granularity

    def _window(self) -> int:
        return self.config.window

    def _scores(self, scoring: ScoringInputs, budget: int) -> torch.Tensor:
        config = self.config
        return scoring.to_kv_heads(observation_scores(scoring, config.window, config.kernel, config.pooling))

    def minimum_budget(self) -> int:
        return self._window()

    def select_prefill(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor:
        window = self._window()
        if budget < window:
            raise ValueError(
                f"invalid budget={budget}: {self.name} keeps a window of {window} tokens in every head inside the "
                f"budget, so it must be >= {window}"
            )
        keep = ada_keep(self._scores(scoring, budget), budget, window, self.config.alpha, scoring.valid)
        state["ada_head_budgets"] = keep.sum(dim=-1)
        return keep


class AdaSnapKV(_AdaKV):
    name = "ada-snapkv"
    config_class = AdaSnapKVConfig
    paper = "Feng et al. 2024, Algorithms 2-3 (Ada-SnapKV)"


class AdaPyramidKV(_AdaKV):
    name = "ada-pyramidkv"
    config_class = AdaPyramidKVConfig
    paper = "Feng et al. 2024, Algorithms 2-3 (Ada-Pyramid)"

    def layer_budgets(self, budget: int, num_layers: int) -> list[int]:
        config = self.config
        return pyramid_budgets(budget, num_layers, config.beta, config.window, config.window_in_pyramid)


class AdaAhaKV(_AdaKV):
    name = "ada-ahakv"
    config_class = AdaAhaKVConfig
    paper = "Feng et al. 2024, Algorithm 2 over AhaKV scores (Gu et al. 2025, Eq. 5, 12, 15)"

    def _window(self) -> int:
        return self.config.recent

    def _scores(self, scoring: ScoringInputs, budget: int) -> torch.Tensor:
        return ahakv_scores(scoring, budget, self.config.recent, self.config.kernel)
