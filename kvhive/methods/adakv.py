"""Ada-KV (Feng et al., 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget
Allocation for Efficient LLM Inference", arXiv:2407.11550): adaptive head-wise budget allocation
over any score-based method (``ada-<scorer>``, like kvpress's ``AdaKVPress(press)``).

Algorithm 2 (adaptive allocation) inside Algorithm 3 (Ada-SnapKV / Ada-Pyramid in one layer):

* The layer's total budget is ``B = b × H`` (``b`` tokens per stored head on average, ``H``
  stored heads). Every head keeps the scorer's protected tokens (SnapKV's observation window,
  AhaKV's recent budget ``B_r``, StreamingLLM's sinks, ...), ``w`` per head, inside the budget, so
  the part left to allocate is ``H × b'`` with ``b' = b - w``.
* **Allocation as the authors' code** (``allocation="authors"``, default; FFY0/AdaKV
  ``AdaptiveSnapKVCluster``): ``f_i`` = how many of the layer's global top ``H b'`` scores head
  ``i`` owns; head budget ``B_i = round((1 - alpha) f_i + floor(alpha b'))`` (``alpha = 0.5``,
  the safeguard of Sec. 3.4; ``torch.round``: half to even). The authors' rounding can miss the
  layer total by a few tokens; kvhive settles the difference by largest remainder so a layer
  keeps *exactly* ``b × H`` (:func:`authors_head_budgets`). Each head keeps its own top ``B_i``.
* ``allocation="kvpress"``: kvpress's rule — each head first keeps its own top
  ``floor(alpha b')``, the rest of ``H b'`` goes to the largest remaining scores over all heads
  (:func:`adaptive_allocation`); Theorem 4 holds for it with the safeguard on.

Scores are compared across heads as the scorer gives them (for SnapKV/PyramidKV/AhaKV softmax
attention weights, comparable across heads). On GQA with per-KV-head storage the authors average
the group's window weights *before* pooling (``gqa_support``): the Ada-KV wrappers default to the
scorer option ``group_pooling="mean_then_pool"`` where the scorer has it.

**Head granularity** (``head_granularity``): ``"kv"`` allocates per KV head; ``"query"`` stores one
copy of each KV head per query head (the cache grows by the group size before compression, as in
the original Ada-KV runs on GQA models) and allocates per query head, the budget ``b`` then being
per *query* head; ``"auto"`` (default) is ``"query"`` on a model with one KV head (Gemma-3-270M),
where per-KV-head allocation has nothing to allocate across, and ``"kv"`` otherwise.

**Storage**: heads keep different numbers of tokens; the cache stores them for real (variable
per-head lengths, evicted entries freed) and decodes with its variable-length path.

Prefill phase only, as in the paper (Algorithm 3 runs after each layer's prefill); tokens
generated afterwards are appended to every head. Only ``ada-snapkv`` and ``ada-pyramidkv`` are
the paper's methods; every other ``ada-<scorer>`` (``ada-ahakv`` included) is a kvhive combination
and says so in :meth:`describe`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from typing import Any, ClassVar, Final, Literal

import torch

from kvhive.methods.ahakv import AhaKV
from kvhive.methods.base import (
    AUTO_HEADS,
    PREFILL,
    HeadGranularity,
    Policy,
    PolicyConfig,
    ScorerPolicy,
    ScoringInputs,
    require_choice,
    require_probability,
    top_indices,
)
from kvhive.methods.pyramidkv import PyramidKV
from kvhive.methods.snapkv import MEAN_THEN_POOL, SnapKV

_PADDING_RANK = -1e30  # below every real score, above the entries already kept (-inf)

Allocation = Literal["authors", "kvpress"]
"""How a layer's selectable budget is split across heads (module docstring)."""
AUTHORS_ALLOCATION: Final[Allocation] = "authors"
KVPRESS_ALLOCATION: Final[Allocation] = "kvpress"


def safeguard_count(budget: int, alpha: float) -> int:
    """``floor(alpha × budget)`` without float fuzz (``0.29 × 100`` is 29, not 28)."""
    return max(0, min(budget, math.floor(alpha * budget + 1e-9)))


def adaptive_allocation(
    scores: torch.Tensor, budget: int, alpha: float, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """kvpress's rule (``allocation="kvpress"``) as a keep mask ``[B, H, M]``.

    ``scores[B, H, M]``: comparable scores of the candidate keys of each head; ``budget``: the
    average number of candidates kept per head (``b'``). Every head keeps its own top
    ``floor(alpha × budget)``; the rest of the layer's ``H × budget`` goes to the largest
    remaining scores over all heads. Each batch row keeps exactly ``H × min(budget, M)``
    entries. Padding (``valid`` False) ranks below every real key in every head.
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
        keep.scatter_(-1, top_indices(ranking, floor), True)
    adaptive = heads * (budget - floor)
    if adaptive > 0:
        remaining = ranking.masked_fill(keep, float("-inf")).reshape(batch, heads * candidates)
        chosen = top_indices(remaining, adaptive)
        keep = keep.reshape(batch, heads * candidates).scatter_(-1, chosen, True).reshape(batch, heads, candidates)
    return keep


def authors_head_budgets(
    scores: torch.Tensor, budget: int, alpha: float, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Head budgets ``[B, H]`` as the authors' ``AdaptiveSnapKVCluster`` computes them.

    ``f_i`` = how many of the row's global top ``H × budget`` candidate scores head ``i`` owns;
    ``B_i = round((1 - alpha) f_i + floor(alpha × budget))`` (round half to even, as
    ``torch.round``). The authors' rounding can miss the layer total by a few entries; here the
    difference is settled by largest remainder of the real targets (ties to the lower head index,
    never past a head's candidates), so every row keeps exactly ``H × budget``.
    """
    batch, heads, candidates = scores.shape
    ranking = scores.float()
    if valid is not None:
        ranking = torch.where(valid, ranking, torch.full_like(ranking, _PADDING_RANK))
    chosen = top_indices(ranking.reshape(batch, heads * candidates), heads * budget) // candidates
    owned = torch.zeros(batch, heads, dtype=torch.long, device=scores.device)
    owned.scatter_add_(-1, chosen, torch.ones_like(chosen))
    targets = owned.double() * (1 - alpha) + safeguard_count(budget, alpha)
    budgets = torch.round(targets).long()
    total = heads * budget
    # Where the rounding missed the total, the heads with room and the largest remainders (in the
    # direction of the miss; ties to the lower index) take one entry each, on the device. The
    # targets sum to H x budget less H x frac(alpha x budget), and each rounds by at most 1/2, so
    # a miss is at most 3H/2 + 1 entries; every pass settles at least one while one is missing
    # (some head has room: H x budget fits the candidates), so 2H + 1 passes settle every row, a
    # settled row's pass changing nothing, and the total is checked on the device. (It ran on the
    # host before, reading every head's remainder whenever the rounding missed: host reads that
    # grew with the data.)
    head_index = torch.arange(heads, device=scores.device).expand(batch, heads)
    for _ in range(2 * heads + 1):
        missing = total - budgets.sum(dim=-1, keepdim=True)
        step = missing.sign()
        room = torch.where(step > 0, budgets < candidates, budgets > 0)
        remainder = (targets - budgets.double()) * step
        order = torch.sort(torch.where(room, -remainder, float("inf")), dim=-1, stable=True).indices
        rank = torch.empty_like(order).scatter_(-1, order, head_index)
        budgets = budgets + (room & (rank < missing.abs())).long() * step
    torch._assert_async((budgets.sum(dim=-1) == total).all(), "Ada-KV's head budgets do not add up to the layer's")
    return budgets


def keep_head_budgets(
    scores: torch.Tensor, head_budgets: torch.Tensor, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Keep mask ``[B, H, M]``: head ``(b, h)`` keeps its own top ``head_budgets[b, h]`` scores."""
    ranking = scores.float()
    if valid is not None:
        ranking = torch.where(valid, ranking, torch.full_like(ranking, _PADDING_RANK))
    order = top_indices(ranking, ranking.shape[-1])
    rank_kept = torch.arange(scores.shape[-1], device=scores.device) < head_budgets[..., None]
    return torch.zeros_like(rank_kept).scatter_(-1, order, rank_kept)


def allocate(
    scores: torch.Tensor, budget: int, alpha: float, allocation: Allocation, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Keep mask ``[B, H, M]`` over the candidates: ``H × min(budget, M)`` entries per row."""
    if budget >= scores.shape[-1]:
        return torch.ones_like(scores, dtype=torch.bool)
    if budget <= 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    if allocation == KVPRESS_ALLOCATION:
        return adaptive_allocation(scores, budget, alpha, valid)
    return keep_head_budgets(scores, authors_head_budgets(scores, budget, alpha, valid), valid)


def ada_keep(
    scores: torch.Tensor,
    budget: int,
    window: int,
    alpha: float,
    valid: torch.Tensor | None = None,
    allocation: Allocation = KVPRESS_ALLOCATION,
) -> torch.Tensor:
    """Keep mask ``[B, H, N]``: the last ``window`` tokens of every head plus the adaptive
    allocation of ``H × (budget - window)`` over the older tokens (see the module docstring).

    Each batch row keeps exactly ``H × min(budget, N)`` tokens.
    """
    num_tokens = scores.shape[-1]
    if budget >= num_tokens:
        return torch.ones_like(scores, dtype=torch.bool)
    window = min(window, budget)
    older = num_tokens - window
    keep_older = allocate(
        scores[..., :older], budget - window, alpha, allocation, None if valid is None else valid[..., :older]
    )
    recent = torch.ones(*scores.shape[:-1], window, dtype=torch.bool, device=scores.device)
    return torch.cat([keep_older, recent], dim=-1)


def _protected_window(protected: torch.Tensor | None, num_tokens: int) -> int | None:
    """The ``w`` when ``protected`` is exactly the last ``w`` tokens of every head (or None)."""
    if protected is None:
        return 0
    counts = protected.sum(dim=-1, keepdim=True)
    first = counts.flatten()[0]
    # Each head's mask is the suffix of its own count, and every count is the first: computed on the
    # device and read back with the count in one read (not three).
    suffix = torch.arange(num_tokens, device=protected.device) >= num_tokens - counts
    exact = (protected == suffix).all() & (counts == first).all()
    window, is_window = torch.stack([first, exact.to(first.dtype)]).tolist()
    return window if is_window else None


@dataclasses.dataclass(frozen=True)
class AdaKVOptions(PolicyConfig):
    """Ada-KV's own parameters, added to the wrapped scorer's."""

    alpha: float = 0.5
    allocation: Allocation = AUTHORS_ALLOCATION
    head_granularity: HeadGranularity = AUTO_HEADS

    def validate(self) -> None:
        require_probability(self.alpha, "alpha")
        require_choice(self.allocation, "allocation", Allocation)
        require_choice(self.head_granularity, "head_granularity", HeadGranularity)


# Scorer parameters whose default differs under Ada-KV: the authors average a GQA group's
# weights before pooling (``gqa_support``).
_ADA_SCORER_DEFAULTS: dict[str, Any] = {"group_pooling": MEAN_THEN_POOL}
# Registry names of the Ada-KV combinations the paper ran (Algorithm 3): the others are kvhive's.
PAPER_COMBINATIONS = {"snapkv": "Ada-SnapKV", "pyramidkv": "Ada-Pyramid"}


class AdaKV(Policy):
    """Ada-KV over a scorer (``scorer_class``): the scorer's protected tokens are kept in every
    head, its scores of the other tokens are allocated across the heads of a layer."""

    phases = frozenset({PREFILL})
    scorer_class: ClassVar[type[ScorerPolicy]]

    def __init__(self, config=None, **parameters) -> None:
        super().__init__(config, **parameters)
        scorer_fields = [field.name for field in dataclasses.fields(self.scorer_class.config_class)]
        self.scorer = self.scorer_class(**{name: getattr(self.config, name) for name in scorer_fields})
        # Read by the cache (expand storage to query heads) and the attention (scoring inputs).
        self.head_granularity = self.config.head_granularity

    def minimum_budget(self) -> int:
        return self.scorer.minimum_budget()

    def layer_budgets(self, budget: int, num_layers: int, context_length: int | None = None) -> list[int]:
        return self.scorer.layer_budgets(budget, num_layers, context_length)

    def select_prefill(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor:
        minimum = self.minimum_budget()
        if budget < minimum:
            raise ValueError(f"invalid budget={budget}: {self.name} needs at least {minimum} tokens per head")
        # The scorer may leave running scores in token_scores: a prefill-only method stores none.
        scores = self.scorer.score(
            dataclasses.replace(scoring, token_scores={}), budget, state.setdefault("scorer", {})
        )
        protected = self.scorer.protected(scoring, budget)
        num_tokens = scoring.num_tokens
        if protected is not None:
            protected = protected.expand(scores.shape)
        window = _protected_window(protected, num_tokens)
        if window is not None:
            keep = ada_keep(scores, budget, window, self.config.alpha, scoring.valid, self.config.allocation)
        else:  # protected tokens anywhere (sinks): they rank first, the allocation sees the rest
            keep = self._keep_with_protected(scores, protected, budget, scoring.valid)
        return keep  # head budgets: keep.sum(-1), held by the cache as its per-head lengths

    def select_state_rows(self, state: dict, index: torch.Tensor, num_heads: int) -> dict:
        selected = dict(state)
        if "scorer" in state:
            selected["scorer"] = self.scorer.select_state_rows(state["scorer"], index, num_heads)
        return selected

    def stack_states(self, states: list[dict], tokens_seen: list[int]) -> dict:
        stacked = dict(states[0])
        if any("scorer" in state for state in states):
            stacked["scorer"] = self.scorer.stack_states([state.get("scorer", {}) for state in states], tokens_seen)
        return stacked

    def _keep_with_protected(self, scores, protected, budget, valid) -> torch.Tensor:
        # Protected tokens are the same count in every head of a row (sinks, windows); the row
        # allocates H x (budget - count) over the rest.
        counts = protected.sum(dim=-1)
        keep = protected.clone()
        for row in range(scores.shape[0]):
            count = int(counts[row].max())
            if not bool((counts[row] == count).all()):
                raise ValueError(f"{self.name}: the scorer protects different numbers of tokens per head")
            ranking = scores[row : row + 1].float().masked_fill(protected[row : row + 1], float("-inf"))
            row_valid = valid[row : row + 1] & ~protected[row : row + 1]
            chosen = allocate(ranking, max(0, budget - count), self.config.alpha, self.config.allocation, row_valid)
            keep[row] |= chosen[0] & ~protected[row]
        return keep


_ADA_CLASS_LOCK = threading.Lock()


def ada_class(scorer_class: type[ScorerPolicy]) -> type[AdaKV]:
    """The Ada-KV policy class over ``scorer_class`` (registry name ``ada-<scorer>``): one class per
    scorer, also when threads ask for it at the same time (``functools.cache`` alone may build two)."""
    with _ADA_CLASS_LOCK:
        return _build_ada_class(scorer_class)


@functools.cache
def _build_ada_class(scorer_class: type[ScorerPolicy]) -> type[AdaKV]:
    if not issubclass(scorer_class, ScorerPolicy):
        raise ValueError(
            f"invalid method=ada-{scorer_class.name}: Ada-KV wraps a score-based method "
            "(a ScorerPolicy: score() plus protected tokens)"
        )
    base_config = scorer_class.config_class
    base_fields = {field.name for field in dataclasses.fields(base_config)}
    overrides = [
        (name, type(default), dataclasses.field(default=default))
        for name, default in _ADA_SCORER_DEFAULTS.items()
        if name in base_fields
    ]
    own = [
        (field.name, field.type, dataclasses.field(default=field.default)) for field in dataclasses.fields(AdaKVOptions)
    ]

    def validate(self) -> None:
        base_config.validate(self)
        AdaKVOptions.validate(self)

    title = scorer_class.__name__
    config_class = dataclasses.make_dataclass(
        f"Ada{title}Config", overrides + own, bases=(base_config,), frozen=True, namespace={"validate": validate}
    )
    config_class.__module__ = __name__
    paper_name = PAPER_COMBINATIONS.get(scorer_class.name)
    if paper_name is not None:
        paper = f"Feng et al. 2024, Algorithms 2-3 ({paper_name})"
    else:
        paper = (
            f"kvhive combination, not a paper method: Ada-KV allocation (Feng et al. 2024, Algorithm 2) "
            f"over {scorer_class.name} scores ({scorer_class.paper})"
        )
    return type(
        f"Ada{title}",
        (AdaKV,),
        {
            "name": f"ada-{scorer_class.name}",
            "scorer_class": scorer_class,
            "prefill_column_sums": scorer_class.prefill_column_sums,
            # A later prompt chunk is scored by the same prefill decision (over kept + new tokens).
            "chunk_column_sums": scorer_class.prefill_column_sums,
            "config_class": config_class,
            "paper": paper,
            "__module__": __name__,
        },
    )


# The registry's fixed names (the paper's two combinations and kvhive's ada-ahakv).
AdaSnapKV = ada_class(SnapKV)
AdaPyramidKV = ada_class(PyramidKV)
AdaAhaKV = ada_class(AhaKV)
