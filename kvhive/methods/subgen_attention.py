"""SubGen streaming attention (Zandieh et al., 2024, Algorithm 1 "SubGen: Sublinear Streaming
Attention").

Two data structures per (batch, KV head), updated for every token that leaves the exact
window:

* ``D`` (UPDATESOFTMAXNORMALIZER, Lemma 2): clusters of radius ``delta`` in key space. A key
  within ``delta`` of the nearest representative joins that cluster (count + 1, and each of the
  cluster's ``t`` reservoir slots is replaced by the key with probability ``1/count``);
  otherwise it founds a new cluster (representative = the key, ``t`` copies of it, count 1).
* ``M`` (UPDATEMATRIXPRODUCT, Lemma 1): ``s`` slots, each replaced by ``(k, v)`` with
  probability ``‖v‖² / (μ + ‖v‖²)``, so every slot is an i.i.d. sample ∝ ``‖v‖²``; ``μ = Σ‖v‖²``.

QUERYSTREAMATTN: ``z = Σ_{(k,v)∈M} μ/(s‖v‖²) · exp(q·k·scaling) · v`` estimates
``Σ_i exp(q·k_i·scaling) v_i`` and ``τ = Σ_{clusters} n'/t · Σ_{k∈S} exp(q·k·scaling)`` the
partition function; the paper's output is ``z / τ``. Logits use the model's scaling.

**Estimator variant (choice, docs/METHODS.md).** Algorithm 1 answers a query with ``z / τ`` alone.
kvhive combines it with an exact recent window: the cache keeps the last ``window`` tokens as
real tokens (exact attention); every token leaving the window (prefill: the prompt beyond the
window, in order; decode: one per step) is inserted into ``D`` and ``M``.
:meth:`SubGenAttention.extra_attention` returns ``(z, τ)`` relative to a common max logit, and
the attention integration adds them to the window's numerator and denominator
(``output = (z + Σ_window e^l v) / (τ + Σ_window e^l)``): exact attention over the window plus
the estimator over the evicted tokens. The prefill attention itself is exact (all prompt tokens
are present while the prompt is encoded).

**Budget = the method's whole memory**, in token-equivalents per (layer, KV head) (one token =
its key and its value, the unit of every other method's budget). A budget ``C`` is split into
``s = floor(C · value_sample_fraction)`` ℓ2 samples of ``M`` (each a key and a value: ``s``
tokens), ``floor(C · cluster_fraction)`` token-equivalents of clusters (each a representative
and ``t`` reservoir keys: ``(t + 1) / 2`` tokens, so at most
``max_clusters = floor(2 · C · cluster_fraction / (t + 1))`` clusters) and the exact window, the
rest (``C − s − cluster share``). Defaults (**choice**; the paper fixes none for LLM decoding):
a quarter of the budget for ``M``, a quarter for ``D``, half for the window, ``t = 4``. The
structures are allocated at that size once (``state_nbytes`` is bounded by the budget; it never
grows with ``n``).

**Clusterable or not** (Algorithm 1 assumes the keys fall in a sublinear number of
``δ``-clusters). While a row has fewer than ``max_clusters`` clusters a key farther than ``δ``
from every representative founds one; once it has ``max_clusters`` such a key joins its nearest
cluster anyway and is counted in ``beyond_radius`` — the keys were not clusterable at this
``δ`` and budget, and :func:`clustering_statistics` says so (``clusterable: False`` with the
count) instead of growing the state.

Radius **(choice)**: with ``relative_radius=True`` (default) the radius of a (batch, head) row is
``cluster_radius`` times the mean L2 norm of its real keys at its first insertion (keys' scale
differs per model, layer and head; ``relative_radius=False`` uses ``cluster_radius`` as is).

Batch insertion is exactly the sequential algorithm: cluster assignment follows the stream
order (a token's nearest representative is searched among the clusters founded before it), and
the reservoir updates of a batch are drawn in closed form with the same distribution as the
token-by-token coin flips (each slot independently: replaced with probability
``added/(old+added)`` by a uniform / ``‖v‖²``-weighted draw among the added tokens).

Public parameter names (paper symbols in brackets): ``cluster_radius`` (δ),
``samples_per_cluster`` (t), ``value_sample_fraction`` (s / C), ``cluster_fraction``; ``s``
itself is derived from the budget.

Limitations: the structures' keys keep the rotation they had when inserted, so the method
assumes ``positions="original"`` (with ``positions="cache"`` the window is re-rotated but ``D``
and ``M`` are not); on sliding-window layers compressed with ``compress_sliding=True`` the
estimator keeps tokens that the model's window would already have dropped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvhive.methods.base import (
    DECODE,
    PREFILL,
    Policy,
    PolicyConfig,
    ScoringInputs,
    derived_seed,
    keep_top_scores,
    require,
    require_int_at_least,
    require_seed,
)
from kvhive.methods.subgen_structures import StreamingStructures

STATE_KEY = "subgen_structures"
PLAN_KEY = "subgen_memory_plan"


@dataclass(frozen=True)
class SubGenAttentionConfig(PolicyConfig):
    """``cluster_radius`` = δ (Lemma 2's cluster radius; relative to the mean key norm when
    ``relative_radius``), ``samples_per_cluster`` = t (reservoir keys per cluster),
    ``value_sample_fraction`` = s / budget (ℓ2 samples of M, Lemma 1), ``cluster_fraction`` = the
    budget share of the clusters D (token-equivalents); the exact window gets the rest."""

    cluster_radius: float = 0.5
    relative_radius: bool = True
    samples_per_cluster: int = 4
    value_sample_fraction: float = 0.25
    cluster_fraction: float = 0.25
    seed: int = 0

    def validate(self) -> None:
        ok = (
            isinstance(self.cluster_radius, (int, float))
            and not isinstance(self.cluster_radius, bool)
            and math.isfinite(self.cluster_radius)
            and self.cluster_radius > 0
        )
        require(ok, "cluster_radius", "a finite number > 0 (cluster radius delta)", self.cluster_radius)
        require(isinstance(self.relative_radius, bool), "relative_radius", "a bool", self.relative_radius)
        require_int_at_least(self.samples_per_cluster, 1, "samples_per_cluster")
        for name in ("value_sample_fraction", "cluster_fraction"):
            value = getattr(self, name)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1
            require(ok, name, "a number in (0, 1)", value)
        total = self.value_sample_fraction + self.cluster_fraction
        require(total < 1, "value_sample_fraction + cluster_fraction", "a sum < 1 (the window needs the rest)", total)
        require_seed(self.seed)


@dataclass(frozen=True)
class MemoryPlan:
    """How a per-head budget (token-equivalents) is spent: exact window, ℓ2 samples, clusters."""

    window: int
    value_samples: int
    max_clusters: int
    samples_per_cluster: int

    @property
    def token_equivalents(self) -> float:
        """The most the method holds per (layer, KV head), in tokens (key + value each)."""
        return self.window + self.value_samples + self.max_clusters * (self.samples_per_cluster + 1) / 2


def memory_plan(budget: int, config: SubGenAttentionConfig) -> MemoryPlan | None:
    """The split of ``budget`` (module docstring); None when a part would be empty."""
    samples = math.floor(budget * config.value_sample_fraction)
    cluster_share = math.floor(budget * config.cluster_fraction)
    max_clusters = (2 * cluster_share) // (config.samples_per_cluster + 1)
    window = budget - samples - cluster_share
    if samples < 1 or max_clusters < 1 or window < 1:
        return None
    return MemoryPlan(window, samples, max_clusters, config.samples_per_cluster)


def minimum_plan_budget(config: SubGenAttentionConfig) -> int:
    """The smallest budget :func:`memory_plan` splits. A plan needs one value sample
    (``budget >= 1 / value_sample_fraction``) and one cluster of ``samples_per_cluster + 1`` keys
    (``floor(budget * cluster_fraction) >= ceil((samples_per_cluster + 1) / 2)``); its window is never
    empty (at least ``budget * (1 - both fractions) > 0`` tokens). Both needs only grow with the
    budget, so the answer is found by bisection below that closed form's estimate (float rounding may
    put the estimate a token off), in a number of steps logarithmic in the budget, whatever
    ``samples_per_cluster`` is."""
    half_cluster = -(-(config.samples_per_cluster + 1) // 2)
    high = max(1, math.ceil(1 / config.value_sample_fraction), math.ceil(half_cluster / config.cluster_fraction))
    while memory_plan(high, config) is None:
        high *= 2
    low = 0  # no plan at budget 0
    while high - low > 1:
        middle = (low + high) // 2
        if memory_plan(middle, config) is None:
            low = middle
        else:
            high = middle
    return high


class SubGenAttention(Policy):
    name = "subgen-attention"
    phases = frozenset({PREFILL, DECODE})
    config_class = SubGenAttentionConfig
    static_decode = True  # keeps exactly the window each step (tests/cache/test_compiled_decode.py)
    compiles_below_budget = False  # its clusters (and their buffers) appear at the first eviction
    # The window by position and the leaving tokens inserted in position order: an eviction fills
    # the freed slot.
    reads_stored_order = False
    paper = (
        "Zandieh et al. 2024, Algorithm 1 (clusters D + l2 samples M; z/tau) + exact recent window; "
        "budget = window + clusters + samples"
    )

    def __init__(self, config: SubGenAttentionConfig | None = None, **parameters) -> None:
        super().__init__(config, **parameters)
        # The cache stores only the exact window, so its layer budget is the window; the plan of
        # the method's whole budget is found again from it (one cache per policy instance).
        self._plans_by_window: dict[int, MemoryPlan] = {}

    # -- budget ----------------------------------------------------------------------------------
    def layer_budgets(self, budget: int, num_layers: int, context_length: int | None = None) -> list[int]:
        """The cache holds the exact window (the structures hold the rest of the budget), whatever
        the prompt length."""
        plan = self.plan(budget)
        self._plans_by_window[plan.window] = plan
        return [plan.window] * num_layers

    def _plan_for(self, layer_budget: int) -> MemoryPlan:
        """The plan whose window is the cache's layer budget, or the plan of a whole budget
        given directly (``select_*`` called outside a cache)."""
        return self._plans_by_window.get(layer_budget) or self.plan(layer_budget)

    def plan(self, budget: int) -> MemoryPlan:
        plan = memory_plan(budget, self.config)
        if plan is None:
            raise ValueError(
                f"invalid budget={budget!r} for subgen-attention: expected an integer >= {self.minimum_budget()} so "
                f"that the window, the value samples (fraction {self.config.value_sample_fraction}) and one cluster "
                f"of {self.config.samples_per_cluster} + 1 keys (fraction {self.config.cluster_fraction}) all fit"
            )
        return plan

    def minimum_budget(self) -> int:
        return minimum_plan_budget(self.config)

    # -- structures ------------------------------------------------------------------------------
    def _structures(self, scoring: ScoringInputs, plan: MemoryPlan, state: dict) -> StreamingStructures:
        structures = state.get(STATE_KEY)
        if structures is None:
            b, h, _, d = scoring.keys.shape
            structures = StreamingStructures(
                b * h,
                d,
                plan.samples_per_cluster,
                plan.value_samples,
                dtype=scoring.keys.dtype,
                device=scoring.keys.device,
                # Draws seeded by the layer, one stream per KV head (a batch row draws what it
                # draws alone).
                seed=derived_seed(self.config.seed, scoring.layer_index),
                delta=self.config.cluster_radius,
                relative_delta=self.config.relative_radius,
                max_clusters=plan.max_clusters,
                streams_per_seed=h,
            )
            state[STATE_KEY] = structures
            state[PLAN_KEY] = plan
        return structures

    def _window(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor:
        """Keep the last ``window`` real tokens; insert every real token that leaves, in stream
        order."""
        plan = self._plan_for(budget)
        positions = None if scoring.stored_in_order else scoring.positions
        b, h, n, d = scoring.keys.shape
        if n - plan.window == 1 and scoring.mask is None:
            return self._steady_window(scoring, positions, plan, state)
        valid = scoring.valid
        keep = keep_top_scores(scoring.recency_scores(), plan.window, valid, positions=positions)
        # The kept ones are the newest real tokens, so at most n - window leave: a bound known on
        # the host.
        upto = n - plan.window
        if upto > 0:
            leaving = valid & ~keep
            keys, values = scoring.keys, scoring.values
            if positions is None:
                # Stored oldest first: the leaving ones lie in the first n - window columns.
                keys, values, leaving = keys[:, :, :upto], values[:, :, :upto], leaving[:, :, :upto]
            else:
                # Stored in any order (the newest token written into a freed slot): the leaving
                # tokens gathered oldest first, the stream order the structures insert in.
                if upto == 1:  # a steady step: one token leaves, no sort
                    order = positions.masked_fill(~leaving, torch.iinfo(positions.dtype).max).argmin(-1, keepdim=True)
                else:
                    ranked = positions.masked_fill(~leaving, torch.iinfo(positions.dtype).max)
                    order = torch.sort(ranked, dim=-1, stable=True).indices[..., :upto]
                order = order.expand(b, h, upto)
                keys = keys.gather(2, order[..., None].expand(-1, -1, -1, d))
                values = values.gather(2, order[..., None].expand(-1, -1, -1, values.shape[-1]))
                leaving = leaving.gather(2, order)
            self._structures(scoring, plan, state).insert(
                keys.reshape(b * h, upto, d),
                values.reshape(b * h, upto, values.shape[-1]),
                leaving.reshape(b * h, upto),
            )
        return keep

    def _steady_window(self, scoring: ScoringInputs, positions: torch.Tensor | None, plan: MemoryPlan, state: dict):
        """:meth:`_window` of a steady step: every stored token real and one more than the window,
        so the oldest leaves (what keep_top_scores over the recency drops: the oldest position, or
        the first stored token in stored order), found by one argmin instead of a ranking."""
        b, h, n, d = scoring.keys.shape
        keys, values = scoring.keys, scoring.values
        if positions is None:
            keys, values = keys[:, :, :1], values[:, :, :1]
            keep = torch.ones(b, h, n, dtype=torch.bool, device=keys.device)
            keep[:, :, 0] = False
        else:
            oldest = positions.argmin(dim=-1, keepdim=True).expand(b, h, 1)  # positions are distinct
            keys = keys.gather(2, oldest[..., None].expand(-1, -1, -1, d))
            values = values.gather(2, oldest[..., None].expand(-1, -1, -1, values.shape[-1]))
            keep = torch.ones(b, h, n, dtype=torch.bool, device=keys.device).scatter_(-1, oldest, False)
        self._structures(scoring, plan, state).insert(
            keys.reshape(b * h, 1, d),
            values.reshape(b * h, 1, values.shape[-1]),
            torch.ones(b * h, 1, dtype=torch.bool, device=keys.device),
        )
        return keep

    def kept_per_row(self, phase: str, num_tokens: int, budget: int, state: dict) -> int | None:
        # keep_top_scores keeps exactly min(window, N) per row; the cache's budget is the window.
        return min(self._plan_for(budget).window, num_tokens)

    def select_prefill(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor:
        return self._window(scoring, budget, state)

    def select_decode(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor:
        return self._window(scoring, budget, state)

    # -- attention -------------------------------------------------------------------------------
    def extra_attention(self, state: dict, queries: torch.Tensor, scaling: float):
        structures: StreamingStructures | None = state.get(STATE_KEY)
        if structures is None:
            return None
        batch, query_heads, num_queries, dim = queries.shape
        heads = structures.rows // batch
        group = query_heads // heads
        grouped = queries.reshape(batch * heads, group * num_queries, dim)
        z, tau, max_logit = structures.query(grouped, scaling)
        dtype = queries.dtype
        return (
            z.reshape(batch, query_heads, num_queries, dim).to(dtype),
            tau.reshape(batch, query_heads, num_queries).to(dtype),
            max_logit.reshape(batch, query_heads, num_queries).to(dtype),
        )

    def estimate(self, state: dict, queries: torch.Tensor, scaling: float) -> torch.Tensor | None:
        """The paper's output ``z / τ`` over the inserted tokens only, ``[B, Hq, q, d]``."""
        extra = self.extra_attention(state, queries, scaling)
        if extra is None:
            return None
        z, tau, _ = extra
        return z / tau[..., None]

    # -- accounting ------------------------------------------------------------------------------
    def state_nbytes(self, state: dict) -> int:
        """Bytes allocated by one layer's ``D`` and ``M`` (0 before any insertion)."""
        structures = state.get(STATE_KEY)
        return 0 if structures is None else structures.nbytes()

    # -- batch rows ------------------------------------------------------------------------------
    # The structures hold one row per (batch row, KV head), batch-major, each drawing from its KV
    # head's stream and its own count of inserted tokens: a row's estimate and its later insertions
    # depend on nothing else in the batch, so rows may be selected and stacked.
    def select_state_rows(self, state: dict, index: torch.Tensor, num_heads: int) -> dict:
        selected = dict(state)
        structures: StreamingStructures | None = state.get(STATE_KEY)
        if structures is not None:
            device = structures.counts.device
            rows = index.to(device)[:, None] * num_heads + torch.arange(num_heads, device=device)
            selected[STATE_KEY] = structures.select_rows(rows.reshape(-1))
        return selected

    def stack_states(self, states: list[dict], tokens_seen: list[int]) -> dict:
        """The rows' structures stacked in order; a row that inserted nothing yet (its prompt fit the
        window) gets empty structures, what it creates alone at its first insertion. Nothing in them
        follows the tokens seen."""
        present = [state.get(STATE_KEY) for state in states]
        if all(structures is None for structures in present):
            return {}
        model = next(structures for structures in present if structures is not None)
        # Each state is one batch row (a cache of one row, or a row selected from a batch): its
        # structures hold one row per KV head.
        heads = model.rows
        parts = [structures if structures is not None else model.empty_like(heads, heads) for structures in present]
        plan = next(state[PLAN_KEY] for state in states if PLAN_KEY in state)
        return {STATE_KEY: StreamingStructures.concatenate(parts), PLAN_KEY: plan}


def structures_nbytes(cache) -> int:
    """Bytes of every layer's SubGen structures in a ``KVHiveCache`` (add to ``cache.nbytes()``)."""
    total = 0
    for layer in cache.layers:
        structures = getattr(layer, "policy_state", {}).get(STATE_KEY)
        if structures is not None:
            total += structures.nbytes()
    return total


def clustering_statistics(cache) -> dict[int, dict]:
    """Per layer that inserted tokens: the memory plan, clusters used (largest row), keys
    inserted and keys beyond the radius (joined a full row's nearest cluster), ``clusterable``
    (no key beyond the radius) and the token-equivalents held per (batch, KV head) row (largest
    row: window + samples + clusters)."""
    result = {}
    for index, layer in enumerate(cache.layers):
        state = getattr(layer, "policy_state", {})
        structures, plan = state.get(STATE_KEY), state.get(PLAN_KEY)
        if structures is None or plan is None:
            continue
        beyond = int(structures.beyond_radius.sum())
        result[index] = {
            "window": plan.window,
            "value_samples": plan.value_samples,
            "max_clusters": plan.max_clusters,
            "clusters": int(structures.num_clusters.max()),
            "inserted": int(structures.tokens.sum()),
            "beyond_radius": beyond,
            "clusterable": beyond == 0,
            "token_equivalents": float(plan.window + structures.token_equivalents().max()),
            "budget_token_equivalents": plan.token_equivalents,
        }
    return result


def cluster_counts(cache) -> dict[int, torch.Tensor]:
    """Clusters held per layer as ``[B*H]`` (layers that inserted tokens only)."""
    counts = {}
    for index, layer in enumerate(cache.layers):
        structures = getattr(layer, "policy_state", {}).get(STATE_KEY)
        if structures is not None:
            counts[index] = structures.num_clusters.clone()
    return counts
