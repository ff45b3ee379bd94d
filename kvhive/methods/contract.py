"""The contract between a compression method and the cache.

A method is a :class:`Policy` subclass with a frozen dataclass config (:class:`PolicyConfig`)
holding its paper's defaults. It sees plain tensors through
:class:`~kvhive.methods.scoring.ScoringInputs` and answers with boolean keep masks; it never sees a
model class, and the cache never sees which method runs. What a method declares about itself (the
capability flags the cache reads once per layer) is one block of :class:`Policy`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Literal, get_args

import torch

from kvhive.methods.scoring import KeyProbes, ScoringInputs
from kvhive.methods.selection import keep_top_scores, lowest_ranked

HeadGranularity = Literal["kv", "query", "auto"]
"""Stored entry per KV head (``"kv"``), per query head (``"query"``: each query head keeps its own
copy of its group's keys/values), or ``"auto"``: per query head on a model with one KV head (where
per-KV-head allocation has nothing to allocate across), per KV head otherwise."""
KV_HEADS: Final[HeadGranularity] = "kv"
QUERY_HEADS: Final[HeadGranularity] = "query"
AUTO_HEADS: Final[HeadGranularity] = "auto"


def require_choice(value: Any, parameter: str, options: Any) -> None:
    """Raise a ValueError naming ``parameter`` unless ``value`` is one of the ``Literal`` ``options``."""
    accepted = get_args(options)
    require(value in accepted, parameter, " or ".join(repr(option) for option in accepted), value)


@dataclass(frozen=True)
class PolicyConfig:
    """Base of every method config. Subclasses add fields with their paper's defaults."""

    def validate(self) -> None:
        """Raise ValueError naming the parameter when a value is out of range."""


def require(condition: bool, parameter: str, accepted: str, value: Any) -> None:
    """Raise a ValueError naming ``parameter`` and the accepted values unless ``condition``."""
    if not condition:
        raise ValueError(f"invalid {parameter}={value!r}: expected {accepted}")


def require_int_at_least(value: Any, minimum: int, parameter: str) -> None:
    require(
        isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
        parameter,
        f"an integer >= {minimum}",
        value,
    )


SEED_LIMIT = 2**63


def require_seed(value: Any, parameter: str = "seed") -> None:
    """A seed is an integer in [0, 2**63): what every derived generator seed below stays within."""
    require(
        isinstance(value, int) and not isinstance(value, bool) and 0 <= value < SEED_LIMIT,
        parameter,
        "an integer in [0, 2**63)",
        value,
    )


def derived_seed(seed: int, layer_index: int, head: int | None = None) -> int:
    """The generator seed of one layer (and head): distinct for every (seed, layer, head) of a real
    model, in [0, 2**63) whatever the user's seed (torch.Generator.manual_seed overflows above 2**64)."""
    derived = seed * 1_000_003 + layer_index
    if head is not None:
        derived = derived * 1_009 + head
    return derived % SEED_LIMIT


def require_probability(value: Any, parameter: str, low_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    ok = ok and (0.0 < value <= 1.0 if low_open else 0.0 <= value <= 1.0)
    require(ok, parameter, "a number in (0, 1]" if low_open else "a number in [0, 1]", value)


class Policy:
    """A KV-cache compression method. Subclasses set ``name``, ``phases`` and ``config_class``."""

    name: ClassVar[str] = ""
    phases: ClassVar[frozenset[str]] = frozenset()
    config_class: ClassVar[type[PolicyConfig]] = PolicyConfig
    paper: ClassVar[str] = ""

    # -- capabilities ------------------------------------------------------------------------
    # What the method declares about itself; the cache and the attention read these once per
    # layer and choose their routes from them. Every flag defaults to the plain, always-correct
    # route; a method sets one only where its decisions meet the flag's condition.
    head_granularity: HeadGranularity = KV_HEADS
    """Stored entry per KV head, per query head, or chosen by the model (:data:`HeadGranularity`;
    Ada-KV offers the other two)."""

    prefill_column_sums: ClassVar[bool] = False
    """The prefill decision (or ``initialize_decode``) reads :meth:`ScoringInputs.accumulated_attention`,
    the column sums of the prompt's causal attention: a compressed layer's prefill attention then
    computes them in the pass that computes its output (``ScoringInputs.attention_with_column_sums``
    on CPU, the column-sum kernel after flash attention on CUDA) instead of a second ``QK^T``
    pass for scoring."""

    chunk_column_sums: ClassVar[bool] = False
    """Several new queries after a layer's prefill (a later chunk of a chunked prefill) are scored by
    :meth:`ScoringInputs.accumulated_attention` over those queries (H2O's ``observe_decode`` of a
    chunk; the prefill decision over kept + new tokens of a prefill-only method that reads it): the
    attention computes the sums with its output (``ScoringInputs.attention_with_column_sums``,
    causal by the stored positions) instead of sdpa and a second ``QK^T`` pass. A method that reads
    only the newest query's weights of a chunk (BUZZ, BumbleBee) leaves it False: sdpa is faster
    than the pass with column sums, and its one row costs what a decode step's does."""

    needs_decode_attention: ClassVar[bool] = False
    """A decode step's decision reads the newest query's attention weights
    (``ScoringInputs.last_query_weights``): the attention computes them with its output. False: a
    decode step runs the model's own attention and hands the method no weights."""

    takes_key_probes: ClassVar[bool] = False
    """The method may ask for :meth:`decode_key_probes` (the cache skips the call otherwise)."""

    reads_stored_order: ClassVar[bool] = True
    """Whether the method's decisions read the order tokens are stored in (recent windows, sinks
    and ties by stored index). False for a method that reads recency from ``ScoringInputs`` only
    (:meth:`ScoringInputs.recent_tokens`, ``recency_scores``, ``first_real``, ties by position in
    :meth:`ScorerPolicy.keep`): a decode step that evicts one of its tokens writes the newest token
    into the freed slot (one token per head moved) instead of moving every later token down."""

    reads_newest_token_scores: ClassVar[bool] = True
    """Whether the method reads the per-token scores of the newest stored token before writing them:
    the cache then zeroes a token's scores when it arrives and, where a decode eviction writes the
    newest token into the freed slot (:attr:`reads_stored_order` False), moves its scores with it.
    False for a method that writes a token's scores before it reads them, and not while the token
    is the newest (SubGen with a recent window: a token's neighbour bookkeeping is written when it
    leaves the window): the cache does neither, three fewer small ops per score and step (but for its
    own padding flag, ``kvhive.cache.storage.PADDING_SCORE``; tests/cache/test_unset_scores.py fills the
    slots left unset with NaN)."""

    static_decode: ClassVar[bool] = False
    """A decode decision keeps exactly the layer's budget at every step (or, with
    :meth:`fixed_decode_capacity`, a number that varies within a declared bound), computed by tensor
    work of fixed shape without host reads, so a decode step compiles to one graph that serves every
    later step (``KVHiveCache.is_compileable``; tests/cache/test_compiled_decode.py holds every such method
    to it)."""

    compiles_below_budget: ClassVar[bool] = True
    """With :attr:`static_decode`: a layer left below its budget by a short prompt also decodes in
    one graph (the cache holds it in a capacity of the budget while it fills). False for a method
    that builds state at its first eviction (a new buffer, a new structure), which changes the graph."""

    drops_at_most_one: ClassVar[bool] = False
    """With :meth:`fixed_decode_capacity`: every decode decision over the capacity drops at most one
    filled slot per row (the method keeps ``min(budget, filled)``, as BumbleBee does). The cache then
    compacts without a sort and, for a method that reads no stored order
    (:attr:`reads_stored_order` False), writes the newest token into the freed slot."""

    decodes_rows_of_different_lengths: ClassVar[bool] = False
    """Rows that hold different numbers of tokens (caches prefilled separately and stacked,
    ``KVHiveCache.stack``) may decode together in a layer that evicts: the cache holds them in slots
    of a common capacity (``fixed_decode_capacity`` of the stacked state, plus the new token), each
    row its own length, and every decode step calls ``observe_decode`` and ``select_decode`` with
    ``ScoringInputs.filled`` the ``[B, 1, 1]`` lengths (the keep mask must be False on each row's
    empty slots and keep one count for every head of a row). Each row's decision must depend only
    on that row's tokens and state (BUZZ: per-row schedule counters on the device). False: the
    stacked rows of such a layer must keep one length (the cache refuses others)."""

    def __init__(self, config: PolicyConfig | None = None, **parameters: Any) -> None:
        if config is not None and parameters:
            raise ValueError("pass either a config object or keyword parameters, not both")
        if config is None:
            known = {field.name for field in dataclasses.fields(self.config_class)}
            unknown = sorted(set(parameters) - known)
            if unknown:
                raise ValueError(f"unknown parameter(s) {unknown} for method {self.name!r}; accepted: {sorted(known)}")
            config = self.config_class(**parameters)
        config.validate()
        self.config = config

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config})"

    # -- budgets -----------------------------------------------------------------------------
    def minimum_budget(self) -> int:
        """Smallest budget (tokens per head) the method can honour."""
        return 1

    def layer_budgets(self, budget: int, num_layers: int, context_length: int | None = None) -> list[int]:
        """Per-layer budgets for one sequence of ``context_length`` real tokens (None: long enough
        for any split); uniform unless the method allocates across layers (PyramidKV). The cache
        calls it through ``kvhive.cache.budget.layer_budgets``."""
        return [budget] * num_layers

    # -- prefill -----------------------------------------------------------------------------
    def select_prefill(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor:
        raise NotImplementedError(f"{self.name} has no prefill phase")

    # -- decode ------------------------------------------------------------------------------
    def initialize_decode(self, scoring: ScoringInputs, state: dict, budget: int | None = None) -> None:
        """Called once per layer before the first decode-phase decision (e.g. seed running
        scores from the prompt into ``scoring.token_scores``). ``budget`` is the layer's budget,
        the same number the cache passes to ``select_*`` (None: no budget, nothing evicted)."""

    def observe_decode(self, scoring: ScoringInputs, state: dict, budget: int | None = None) -> None:
        """Called after every decode step's attention (e.g. to accumulate scores); ``budget`` as
        in :meth:`initialize_decode`."""

    def select_decode(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor | None:
        raise NotImplementedError(f"{self.name} has no decode phase")

    def select_decode_drop(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor | None:
        """A steady decode step that drops one token: the layer holds ``budget + 1`` stored tokens
        (left padding included). The stored index ``[B, H]`` (long) of the token each row drops, decided as
        :meth:`select_decode` decides (same state changes, same token), or None to decide through
        :meth:`select_decode`'s keep mask (changing nothing here). The cache asks for it only where
        it then moves the newest token into the freed slot (``reads_stored_order`` False): naming the
        token spares the keep mask, its count check and the search for its one False (about ten small
        operations per layer and step, each a kernel launch in an eager GPU step)."""
        return None

    def decode_eviction_due(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor | None:
        """Over a fixed decode capacity, before :meth:`select_decode`: a 0-d bool tensor on the
        scores' device, False where this step's decision keeps every filled slot and changes no state
        (so a captured step may skip it and the compaction: ``kvhive.static_step.run_if``), or None
        (the default: any step may evict). Device work only, no host read; asked only while a CUDA
        graph captures the step."""
        return None

    def decode_key_probes(self, scoring: ScoringInputs, budget: int, state: dict) -> KeyProbes | None:
        """Before a decode step's attention (``scoring`` has no weights yet): stored keys whose dot
        products with every stored key this step's :meth:`select_decode` will read, or None. The
        attention computes them with its logits where it can (float32 keys on the CPU, where a
        second pass over the keys costs as much as the attention's own) and hands them back in
        ``ScoringInputs.key_probes``; where it does not, ``key_probes`` is None and the method
        computes what it needs itself. Asking changes no state: a step that decides nothing
        (or an attention that takes no probes) leaves everything as it was."""
        return None

    def prefill_limit(self, budget: int) -> int:
        """The most tokens per (row, head) a layer may hold right after its prefill decision at
        ``budget`` (the cache refuses more): the budget itself, unless a method's option says
        otherwise (BUZZ's ``prefill_fit="peak"``, Remark 2's literal container ``T + k + w``).
        Decode decisions always keep the budget."""
        return budget

    def state_nbytes(self, state: dict) -> int:
        """Bytes a method holds per layer beside the cached tokens (e.g. SubGen's clusters)."""
        return 0

    # -- batch rows of the per-layer state ------------------------------------------------------
    def select_state_rows(self, state: dict, index: torch.Tensor, num_heads: int) -> dict:
        """The per-layer ``state`` of batch rows ``index`` (1-D, on the host; rows may repeat or be
        reordered: beam search, ``batch_select_indices``, ``batch_repeat_interleave``). ``num_heads``
        is the layer's stored heads. A new dict; ``state`` is left as it was.

        The default serves a method that keeps nothing per layer (its per-token scores live in the
        cache, which selects them itself); a method with per-row state overrides it."""
        if not state:
            return {}
        raise NotImplementedError(
            f"method {self.name!r} keeps per-layer state ({', '.join(sorted(state))}) that it cannot select by "
            "batch row: reordering or selecting the rows of its cache (beam search, batch_select_indices) is not "
            "supported"
        )

    def stack_states(self, states: list[dict], tokens_seen: list[int]) -> dict:
        """One layer's state for caches prefilled separately and stacked as the rows of one batch
        (``KVHiveCache.stack``): ``states[i]`` is row ``i``'s (a batch of one: a row of a cache of
        several rows comes from :meth:`select_state_rows`), ``tokens_seen[i]`` the tokens seen of the
        layer it came from, its ``sequence_length`` (a row's own count for a cache of one row; for a
        row of a stacked cache, the most any of its rows has seen, which its state may be relative
        to). The stacked layer's ``sequence_length`` is their maximum. Raises ValueError when the
        method cannot decode such rows together."""
        if not any(states):
            return {}
        raise ValueError(
            f"method {self.name!r} keeps per-layer state ({', '.join(sorted(states[0]))}) that cannot be stacked "
            "from caches prefilled separately"
        )

    def fixed_decode_capacity(self, keys: torch.Tensor, budget: int, state: dict) -> int | None:
        """For a method whose kept count varies from one decode step to the next (BUZZ's schedule,
        BumbleBee filling up to its budget): the most tokens per row the layer holds after any later
        decode decision, given its stored ``keys [B, H, N, d]`` right after the prefill (their shape
        and device; ``N`` is at most the bound) and ``state`` as the prefill left it. None (the
        default): every decision keeps ``kept_per_row`` tokens, the budget once the layer is full.

        The cache (when its decode step is static, ``KVHiveCache.is_compileable``) then holds the
        layer in fixed buffers of that bound plus one new token, and every decode step calls
        ``observe_decode`` and ``select_decode`` with ``ScoringInputs.filled`` set: the inputs cover
        the whole capacity, the keep mask must be False on the empty slots, and nothing the method
        reads from ``state`` on the host may change from step to step (counters live on the device;
        this hook, called once per layer, is where the method moves them there). The cache counts
        the kept tokens on the device and keeps them compacted, oldest first. An eager step (not
        compiling) may return None where the method knows on the host that it evicts nothing (the
        cache then compacts nothing)."""
        return None

    def prepare_fixed_capacity(self, keys: torch.Tensor, budget: int, state: dict) -> None:
        """Called once the cache holds a layer in the fixed capacity :meth:`fixed_decode_capacity`
        declared (never where the layer decodes in the growing layout instead, e.g. a bound far above
        what the prompt left): where a method allocates the state of fixed addresses that a decode
        step over that capacity writes. :meth:`fixed_decode_capacity` itself allocates nothing sized
        by the bound, so a budget far above the prompt costs memory only for the tokens held."""

    def kept_per_row(self, phase: str, num_tokens: int, budget: int, state: dict) -> int | None:
        """Tokens every (batch row, head) keeps after ``select_prefill`` (``phase="prefill"``) or
        ``select_decode`` (``"decode"``) on a layer holding ``num_tokens`` per row, known on the host
        without reading the device; None when the count depends on the data.

        The cache trusts this count to lay out what is kept, so a decision costs no host
        synchronisation (it checks the mask against it on the device, asynchronously, and a
        mismatch is a device-side assertion). With None the cache reads the counts back: one
        synchronisation per decision. It is asked only when ``num_tokens > budget``, before the
        decision (``state`` as the decision will see it)."""
        return None

    # -- attention changes -------------------------------------------------------------------
    @property
    def changes_attention_logits(self) -> bool:
        """Whether :meth:`logit_scale` is overridden (the attention skips the hook otherwise, so
        an unchanged method costs no per-layer work)."""
        return type(self).logit_scale is not Policy.logit_scale

    def logit_scale(self, key_counts: torch.Tensor) -> torch.Tensor | None:
        """Per-query multiplier of the model's attention logits (BUZZ log n); None = unchanged."""
        return None

    def extra_attention(self, state: dict, queries: torch.Tensor, scaling: float):
        """Estimated attention over evicted tokens (SubGen): ``(numerator, denominator, max_logit)``."""
        return None

    @classmethod
    def describe(cls) -> dict[str, Any]:
        """Registry name, phases, the paper (or the label of a kvhive combination/example) and the
        parameters with their defaults."""
        fields = dataclasses.fields(cls.config_class)
        return {
            "name": cls.name,
            "phases": sorted(cls.phases),
            "paper": cls.paper,
            "parameters": {field.name: field.default for field in fields},
        }


class ScorerPolicy(Policy):
    """A method that is "a score per token plus protected tokens" (modelled on kvpress's ScorerPress).

    Subclasses implement :meth:`score` and, where they always keep some tokens (sinks, a recent
    window), :meth:`protected`; selection in both phases comes from here: the protected tokens,
    then the highest scores, exactly ``min(budget, N)`` per row, padding never kept while a row
    has real tokens left (:func:`keep_top_scores`). Ada-KV (:mod:`kvhive.methods.adakv`) wraps
    any scorer: it reads the same two methods and allocates the budget across heads instead.
    """

    def score(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor:
        """``[B, H, N]`` float scores of the stored tokens, higher = keep. ``budget`` is the layer's
        budget (a score may depend on it: AhaKV's step gain)."""
        raise NotImplementedError

    def protected(self, scoring: ScoringInputs, budget: int) -> torch.Tensor | None:
        """``[B, H, N]`` (or broadcastable) bool: tokens kept whatever their score; None = none."""
        return None

    def keep(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor:
        scores = self.score(scoring, budget, state)
        positions = None if scoring.stored_in_order else scoring.positions
        return keep_top_scores(
            scores, budget, scoring.valid, forced=self.protected(scoring, budget), positions=positions
        )

    def kept_per_row(self, phase: str, num_tokens: int, budget: int, state: dict) -> int | None:
        # keep_top_scores keeps exactly min(budget, N) per row, padding included when it must.
        return min(budget, num_tokens)

    def select_prefill(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor:
        return self.keep(scoring, budget, state)

    def select_decode(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor:
        return self.keep(scoring, budget, state)

    def select_decode_drop(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor | None:
        """:meth:`keep`'s one dropped token (:func:`lowest_ranked`), where :meth:`keep` and
        :meth:`select_decode` are this class's own (a subclass or an instance that decides otherwise
        is asked for its mask). Without a model mask every stored token is real: no validity to fill in."""
        own = (getattr(self.keep, "__func__", None), getattr(self.select_decode, "__func__", None))
        if own != (ScorerPolicy.keep, ScorerPolicy.select_decode):  # (an instance's own too)
            return None
        scores = self.score(scoring, budget, state)
        valid = None if scoring.mask is None else scoring.valid
        positions = None if scoring.stored_in_order else scoring.positions
        return lowest_ranked(scores, valid, self.protected(scoring, budget), positions).squeeze(-1)
