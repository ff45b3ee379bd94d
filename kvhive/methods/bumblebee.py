"""BumbleBee (Kumari et al., "BumbleBee: Dynamic KV-Cache Streaming Submodular Summarization
for Infinite-Context Transformers", COLM 2024; docs/METHODS.md, "BumbleBee").

Per (layer, KV head) the cache holds a global summary ``S`` of ``tau_s`` tokens plus the most
recent ``tau_l`` tokens (Figure 1), ``tau_s + tau_l = budget``. The summary maximises

    g_lam(S) = lam * f_FL(S) + (1 - lam) * c(S)                                    (Eq. 4)

with ``f_FL`` the facility location on ``ReLU(cos)`` of the keys (Eq. 2) and ``c`` the
feature-based function ``phi(sum_{u in S} a_u)`` of the accumulated attention (Eq. 3), both
normalised to ``f(empty) = 0``, ``f(V) = 1``. ``phi`` is ``log(1 + x)`` (♡, :class:`BumbleBee`)
or ``g^{-1}`` with ``g(y) = 0.04 y^25 + y`` (♦, :class:`BumbleBeePower`).

* **Prefill** (Algorithm 1): cardinality-constrained greedy on ``g_lam`` over the prompt tokens
  outside the local window — stochastic greedy with ``epsilon = 1e-5`` (Appx. D, the default),
  lazy or plain greedy; all (batch, head) rows of a layer at once (``kvhive.methods.submodular``).
* **Decode** (Algorithm 2): each new token pushes the oldest token of the local window out; it
  joins ``S' = S + {x}``, the accumulated scores include every new query's attention, and the
  element of ``S'`` with the smallest ``g_lam(x | S' - x)`` is dropped. The similarity matrix of
  the summary is cached in the layer's policy state, so a step costs ``O(tau_s d + tau_s)``
  plus one pass over that matrix for the members whose nearest member may have left (Appx. E:
  ``O(tau_s d + tau_s^2)``).
  The state also records the members' positions; a step checks them against the stored
  tokens (``scoring.positions``) and rebuilds the matrix from the keys if they ever differ.

Choices the paper leaves open (docs/METHODS.md style, **(choice)**):

* ``local_fraction = 0.5``: the paper never states ``tau_l / tau_s`` for its LLM runs; its
  synthetic study (Appx. B) uses equal sizes (``h = k = 32``) and its main baseline, H2 + Local,
  splits the budget 50/50 — the same split keeps the comparison at equal budgets.
  ``local_window`` (tokens) overrides the fraction.
* The ground set ``V`` of both functions is the set of tokens the summary is chosen from: the
  prompt outside the local window in prefill, ``S'`` in decode (the only tokens Alg. 2 keeps a
  similarity matrix for). The local window represents itself.
* ``importance_scale`` (what ``phi`` of Eq. 3 is applied to). ``"raw"`` (default):
  ``c(S) = phi(a(S)) / phi(a(V))`` on the raw accumulated attention ``a`` (Sec. 5: the feature
  weight of key ``k_i`` "is ``a_n^i``"; it sums to about the number of queries), normalised at the
  output so ``c(V) = 1``. ``"normalised"``: ``c(S) = phi(a(S)/a(V)) / phi(1)``, phi of the
  fraction of the attention mass. Measured on Gemma-3-270M (WikiText-2, 256-token prompt,
  budget 64, ``benchmarks/bumblebee_importance_scale.py``): the feature term is on average
  21% (log) / 51% (power) of the first greedy gains with ``"raw"`` and 1.6% / 1.2% with
  ``"normalised"`` (phi is nearly linear on [0, 1], where the facility-location gains of the
  first picks dominate); the continuation NLL moved by < 0.05 nats either way on that text.
  ``"raw"`` stays the default: it is the paper's text and keeps both terms in play.
* Stochastic greedy draws its samples (independent uniform draws from the remaining
  elements, the form analysed in Mirzasoleiman et al.'s Lemma 2) from one generator per
  (batch row, KV head) seeded with ``seed``, the layer and the head (not the batch row), and its
  sample size counts the row's real tokens only: a run is reproducible and a row of a
  left-padded batch draws exactly what it draws alone.
* Padding (left-padded batches) never enters the summary while real tokens remain and leaves it
  first in decode.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import torch

from kvhive import static_step
from kvhive.methods.base import (
    DECODE,
    PREFILL,
    KeyProbes,
    Policy,
    PolicyConfig,
    ScoringInputs,
    derived_seed,
    require,
    require_int_at_least,
    require_probability,
    require_seed,
)
from kvhive.methods.bumblebee_order import oldest_tokens, rank_by_position
from kvhive.methods.bumblebee_streaming import stream_later_candidates
from kvhive.methods.submodular import (
    CAPTURED_LOOPS,
    Concave,
    Mixture,
    StreamingSummary,
    captures_loops,
    greedy_maximize,
    held_similarity_bytes,
    key_norms,
    relu_cosine_similarity_rows,
    similarity_buffer,
)

SCORE = "bumblebee_accumulated"
SUMMARY = "bumblebee_summary"
# (tokens seen, tokens kept per row) after the layer's last decision: host integers that tell a
# decode step whether the cache only appended since (then the summary's members are still the
# oldest tau_s stored tokens) without reading the stored positions back from the device.
SYNCED = "bumblebee_synced"
# How many times a layer's summary was (re)built from the stored keys in decode: once when the
# prompt fit in the budget (no prefill selection), never after a prefill selection.
REBUILDS = "bumblebee_rebuilds"
# A layer in a fixed decode capacity: a 0-d device bool, whether the summary holds its members (set
# at the prefill's selection, else at the layer's first eviction, by a build inside the step).
BUILT = "bumblebee_built"
# Stacked rows (KVHiveCache.stack): a [B * H] device bool, the rows whose prompt fit the budget (no
# summary yet, empty slots in SUMMARY) beside rows summarised at their prefill. At the layer's next
# eviction those rows build theirs from their oldest tau_s stored tokens, as alone.
PENDING = "bumblebee_pending"
GREEDY_METHODS = ("stochastic", "lazy", "plain")
CONCAVE_FORMS = ("log", "power")
IMPORTANCE_SCALES = ("raw", "normalised")
# Largest similarity matrix (elements; 2 GiB of float32) built at once in a CPU prefill: one layer  # lint-text: ok
# of 8 KV heads at an 8k prompt fits, so the greedy steps run once for all heads; more rows run
# in chunks (each chunk repeats the tau_s greedy steps).
MAX_SIMILARITY_ELEMENTS = 1 << 29
# On CUDA the rows' matrices fill up to this fraction of the memory the device can still give
# (similarity_rows_per_chunk): there a greedy step costs its launches, not its arithmetic, so every
# chunk more repeats the tau_s dependent steps at full price. With the CPU's bound a long prompt
# runs each KV head as a chunk of its own; half the free memory holds all heads of a layer at once
# on a large GPU beside the model (results/tuning_notes.md, "BumbleBee similarity chunks").
DEVICE_SIMILARITY_FRACTION = 0.5


def similarity_rows_per_chunk(rows: int, candidates: int, device: torch.device | str, reusable: int = 0) -> int:
    """How many (batch, KV head) rows build their ``candidates x candidates`` similarity matrices, and
    run their greedy, at once: on CUDA those whose float32 matrices fit in
    ``DEVICE_SIMILARITY_FRACTION`` of the memory the device can still give (:func:`_device_room`),
    elsewhere those within ``MAX_SIMILARITY_ELEMENTS``; at least 1, at most ``rows``, the rows shared
    evenly by as few chunks as that bound allows. ``reusable``: bytes of matrices of these candidates
    that captures hold and this prefill reuses (:func:`held_similarity_bytes`), counted as room: each
    layer then chunks as the first did, instead of fewer rows beside its predecessor's matrix (a new
    shape, a new capture and matrix, and so on down). The kept
    tokens do not depend on it (each row is its own problem). Where not even one row's matrix fits
    in all the device's room, ``torch.OutOfMemoryError`` before anything is allocated, naming the way
    out (a chunked prefill: BumbleBee's streaming summary, no matrix of the whole prompt)."""
    per_row = candidates * candidates
    room = _device_room(device)
    if room is None:
        fitting = MAX_SIMILARITY_ELEMENTS // per_row
    else:
        room += reusable
        if 4 * per_row > room:
            raise torch.OutOfMemoryError(
                f"BumbleBee's prefill needs a {candidates:,} x {candidates:,} float32 similarity matrix per KV head "
                f"({4 * per_row / 2**30:.1f} GiB) and {torch.device(device)} can give {room / 2**30:.1f} GiB: feed the "
                "prompt in chunks (make_cache(..., prefill_chunk=N), kvhive generate --prefill-chunk N), which "
                "keeps BumbleBee's streaming summary instead of a matrix of the whole prompt"
            )
        fitting = int(room * DEVICE_SIMILARITY_FRACTION) // (4 * per_row)
    # As few chunks as fit, of equal size: one shape (one capture, one compile of its steps on CUDA),
    # and 4 + 4 rows hold less than 7 + 1 between their captures.
    chunks = -(-rows // max(1, min(rows, fitting)))
    return -(-rows // chunks)


def _device_room(device: torch.device | str) -> int | None:
    """Bytes a CUDA device can still give: the driver's free memory plus what torch's caching
    allocator holds unused. None elsewhere, and while a CUDA graph captures (a caller's capture of the
    prefill: no driver query inside it)."""
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


@dataclass(frozen=True)
class BumbleBeeConfig(PolicyConfig):
    """BumbleBee's parameters (paper defaults: LongBench ``lambda = 0.3``, stochastic greedy
    with ``epsilon = 1e-5``, ♦ with ``alpha = 0.04``, ``beta = 1``)."""

    mixture_weight: float = 0.3  # lambda of Eq. 4: weight of the facility location
    concave: Literal["log", "power"] = "log"  # phi of Eq. 3: "log" (♡) or "power" (♦)
    power_alpha: float = 0.04
    power_beta: float = 1.0
    local_fraction: float = 0.5  # tau_l = floor(budget * local_fraction) (choice, see module doc)
    local_window: int | None = None  # tau_l in tokens; overrides local_fraction
    importance_scale: Literal["raw", "normalised"] = (
        "raw"  # what phi of Eq. 3 is applied to: "raw" | "normalised" (module doc)
    )
    greedy: Literal["stochastic", "lazy", "plain"] = "stochastic"  # prefill maximiser: "stochastic" | "lazy" | "plain"
    epsilon: float = 1e-5  # stochastic greedy's epsilon
    seed: int = 0
    # Prompts with more candidates (tokens outside the local window) than this are streamed: Algorithm 1
    # over the first this many, Algorithm 2 over the rest (no n x n matrix); None: always one-shot.
    streaming_above_tokens: int | None = 8192

    def validate(self) -> None:
        require_probability(self.mixture_weight, "mixture_weight")
        require(self.concave in CONCAVE_FORMS, "concave", "'log' or 'power'", self.concave)
        require(
            _is_number(self.power_alpha) and 0 < self.power_alpha <= 1,
            "power_alpha",
            "a number in (0, 1]",
            self.power_alpha,
        )
        require(
            _is_number(self.power_beta) and 0 <= self.power_beta < math.inf,
            "power_beta",
            "a finite number >= 0",
            self.power_beta,
        )
        require(
            _is_number(self.local_fraction) and 0 <= self.local_fraction < 1,
            "local_fraction",
            "a number in [0, 1)",
            self.local_fraction,
        )
        if self.local_window is not None:
            require_int_at_least(self.local_window, 0, "local_window")
        require(
            self.importance_scale in IMPORTANCE_SCALES,
            "importance_scale",
            "'raw' or 'normalised'",
            self.importance_scale,
        )
        require(self.greedy in GREEDY_METHODS, "greedy", "'stochastic', 'lazy' or 'plain'", self.greedy)
        require(_is_number(self.epsilon) and 0 < self.epsilon < 1, "epsilon", "a number in (0, 1)", self.epsilon)
        require_seed(self.seed)
        if self.streaming_above_tokens is not None:
            require_int_at_least(self.streaming_above_tokens, 1, "streaming_above_tokens")


@dataclass(frozen=True)
class BumbleBeePowerConfig(BumbleBeeConfig):
    concave: Literal["log", "power"] = "power"


class BumbleBee(Policy):
    name = "bumblebee"
    phases = frozenset({PREFILL, DECODE})
    config_class = BumbleBeeConfig
    paper = "Kumari et al. 2024, Algorithms 1-2 (submodular summary + local context), phi = log(1+x)"
    needs_decode_attention = True
    prefill_column_sums = True  # accumulated attention of the prompt, with the attention's output
    # Within its budget at every step (a prompt that fit it fills up first): a fixed decode capacity
    # of the budget (fixed_decode_capacity) gives its decode step one shape (tests/cache/test_compiled_decode.py).
    static_decode = True
    # The summary is always the tau_s oldest stored tokens and the joiner the next oldest (the local
    # window holds the newest): a step ranks the stored tokens by position (one sort of the stored
    # positions) where the cache no longer stores them in their order, so an eviction may write the
    # newest token into the freed slot instead of moving every later token down.
    reads_stored_order = False
    drops_at_most_one = True  # over its fixed capacity: one token per step once full, none before

    @property
    def concave(self) -> Concave:
        return Concave(self.config.concave, self.config.power_alpha, self.config.power_beta)

    # -- budgets -------------------------------------------------------------------------------
    def minimum_budget(self) -> int:
        return (self.config.local_window or 0) + 1

    def split(self, budget: int) -> tuple[int, int]:
        """``(tau_s, tau_l)``: summary and local-window sizes for a per-head ``budget``."""
        if self.config.local_window is not None:
            local = self.config.local_window
        else:
            local = int(budget * self.config.local_fraction)
        if budget < local + 1:
            raise ValueError(
                f"invalid budget={budget}: BumbleBee needs at least local_window + 1 = {local + 1} tokens per head "
                "(a summary of one token or more)"
            )
        return budget - local, local

    # -- scores --------------------------------------------------------------------------------
    def initialize_decode(self, scoring: ScoringInputs, state: dict, budget: int | None = None) -> None:
        scoring.token_scores[SCORE] = scoring.to_kv_heads(scoring.accumulated_attention()).float()

    def observe_decode(self, scoring: ScoringInputs, state: dict, budget: int | None = None) -> None:
        scores = scoring.token_scores[SCORE]
        weights = scoring.to_kv_heads(scoring.last_query_attention())
        scores += weights if weights.dtype == scores.dtype else weights.to(scores.dtype)

    def _accumulated(self, scoring: ScoringInputs) -> torch.Tensor:
        if SCORE not in scoring.token_scores:
            self.initialize_decode(scoring, {})
        return scoring.token_scores[SCORE]

    # -- prefill: Algorithm 1 ------------------------------------------------------------------
    def select_prefill(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor:
        batch, heads, tokens, dim = scoring.keys.shape
        if tokens <= budget:
            return torch.ones(batch, heads, tokens, dtype=torch.bool, device=scoring.keys.device)
        summary_size, local = self.split(budget)
        candidates = tokens - local
        threshold = self.config.streaming_above_tokens
        if threshold is not None and candidates > max(threshold, summary_size):
            chosen = self._stream_prompt(scoring, max(threshold, summary_size), candidates, summary_size, state)
        else:
            chosen = self._summarise(scoring, candidates, summary_size, state)
        state[SYNCED] = (scoring.sequence_length, budget)
        keep = torch.cat([chosen, chosen.new_ones(batch * heads, local)], dim=1)
        return keep.reshape(batch, heads, tokens)

    def _summarise(self, scoring: ScoringInputs, candidates: int, summary_size: int, state: dict) -> torch.Tensor:
        """Algorithm 1 over the first ``candidates`` stored tokens: ``chosen [R, candidates]``, the
        ``summary_size`` members picked by the greedy; their summary goes to ``state[SUMMARY]``."""
        batch, heads, _, dim = scoring.keys.shape
        rows = batch * heads
        keys = scoring.keys[:, :, :candidates].reshape(rows, candidates, dim)
        valid = scoring.valid[:, :, :candidates].reshape(rows, candidates)
        weights = self._accumulated(scoring)[:, :, :candidates].reshape(rows, candidates)
        if self.config.importance_scale == "normalised":
            # phi of the fraction of the ground set's attention mass: a(V) = 1 (module doc).
            real = weights.clamp_min(0) * valid
            weights = real / real.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(real.dtype).tiny)
        positions = scoring.positions[:, :, :candidates].reshape(rows, candidates)
        # One generator per (batch row, head), seeded by the head and layer only: a row draws
        # what it draws alone, whatever else is in the batch.
        generators = []
        for row in range(rows):
            generator = torch.Generator(device=keys.device)
            generator.manual_seed(derived_seed(self.config.seed, scoring.layer_index, row % heads))
            generators.append(generator)
        chosen = torch.zeros(rows, candidates, dtype=torch.bool, device=keys.device)
        order = torch.arange(candidates, device=keys.device)
        summaries = []
        # Where the greedy captures its loop (CUDA), the matrix goes into the captured loop's buffer;
        # not inside a caller's capture or trace (in_static_step), where the greedy records its steps
        # into the caller's graph and a replay of that would write into the shared buffer.
        fast = (
            static_step.prefill_fast_path(keys.device)
            and captures_loops(keys.device)
            and not static_step.in_static_step()
        )
        # On the CPU, the matrix goes into the cache's prefill scratch, reused by the next layer or
        # row chunk of the same shape: a fresh matrix costs the page faults of its first write
        # (CUDA's caching allocator reuses the freed block itself).
        scratch = scoring.scratch if keys.device.type == "cpu" else None
        reusable = held_similarity_bytes(candidates, keys.device) if fast else 0
        rows_per_chunk = similarity_rows_per_chunk(rows, candidates, keys.device, reusable)
        # On the fast path the matrix is a captured loop's input buffer, shared by the process's
        # threads: held from writing it to the last read of it (submodular.similarity_buffer).
        holding = CAPTURED_LOOPS.using(keys.device) if fast else contextlib.nullcontext()
        with holding:
            for start in range(0, rows, rows_per_chunk):
                part = slice(start, min(rows, start + rows_per_chunk))
                part_rows = part.stop - part.start
                # On the fast path (CUDA), into the matrix a captured greedy loop of these shapes reads:
                # its replay then copies no matrix (None: a new one).
                out = similarity_buffer(part_rows, candidates, keys.device) if fast else None
                if scratch is not None:
                    out = scratch.take((part_rows, candidates, candidates), torch.float32, keys.device)
                sim, row_sums, row_max = relu_cosine_similarity_rows(keys[part], valid[part], out)
                objective = Mixture(
                    sim, weights[part], valid[part], self.config.mixture_weight, self.concave, row_sums, row_max
                )
                # A matrix of its own (no capture of these shapes yet): the capture the greedy makes
                # keeps it as its input buffer rather than a copy (one R x n x n matrix, not two), and
                # the next layers compute theirs into it.
                picked = greedy_maximize(
                    objective,
                    summary_size,
                    self.config.greedy,
                    self.config.epsilon,
                    generators[part],
                    donate_similarity=fast and out is None,
                )
                chosen[part] = picked
                # The members in stored order, with their similarity matrix, seed Algorithm 2.
                members = torch.where(picked, order, candidates).sort(dim=-1).values[:, :summary_size]
                count = members.shape[0]
                member_sim = sim.gather(1, members[:, :, None].expand(count, summary_size, candidates))
                member_sim = member_sim.gather(2, members[:, None, :].expand(count, summary_size, summary_size))
                member_keys = keys[part].gather(1, members[:, :, None].expand(count, summary_size, dim))
                summaries.append(
                    StreamingSummary.from_similarity(
                        member_sim,
                        key_norms(member_keys),
                        valid[part].gather(1, members),
                        positions[part].gather(1, members),
                    )
                )
                del objective
                if scratch is not None:
                    scratch.give(sim)  # nothing refers to it any more (the summary took copies)
                del sim
        state[SUMMARY] = StreamingSummary.concatenate(summaries)
        return chosen

    def _stream_prompt(
        self, scoring: ScoringInputs, first: int, candidates: int, summary_size: int, state: dict
    ) -> torch.Tensor:
        """A long prompt the streaming way (:func:`~kvhive.methods.bumblebee_streaming.stream_later_candidates`):
        Algorithm 1 over its first ``first`` tokens, then Algorithm 2 for the later candidates.
        ``chosen [R, candidates]``."""
        chosen_first = self._summarise(scoring, first, summary_size, state)
        return stream_later_candidates(
            scoring,
            chosen_first,
            state[SUMMARY],
            self._accumulated(scoring),
            candidates,
            summary_size,
            self.config.mixture_weight,
            self.concave,
            normalise_mass=self.config.importance_scale == "normalised",
        )

    def kept_per_row(self, phase: str, num_tokens: int, budget: int, state: dict) -> int | None:
        # Prefill keeps tau_s members and the tau_l window; decode drops num_tokens - budget.
        return min(budget, num_tokens)

    def state_nbytes(self, state: dict) -> int:
        """Bytes of the layer's streaming summary (similarity matrix of the ``tau_s`` members and
        their per-member vectors); the accumulated scores live with the cached tokens."""
        summary: StreamingSummary | None = state.get(SUMMARY)
        return 0 if summary is None else summary.nbytes()

    # -- decode: Algorithm 2 -------------------------------------------------------------------
    def fixed_decode_capacity(self, keys: torch.Tensor, budget: int, state: dict) -> int | None:
        """A layer holds at most its budget after every decision (fewer only while a prompt that
        fit the budget fills up): the bound of a fixed decode capacity."""
        self.split(budget)  # a budget below the local window is refused here too
        return budget

    def prepare_fixed_capacity(self, keys: torch.Tensor, budget: int, state: dict) -> None:
        """The summary's tensors get fixed addresses; a layer whose prompt fit gets an empty summary
        (``tau_s`` slots: the cache takes the capacity only for a budget near the tokens held) that
        its first eviction builds from the oldest ``tau_s`` stored tokens, as :meth:`select_decode`
        does."""
        batch, heads, tokens, _ = keys.shape
        summary_size, _ = self.split(budget)
        summary: StreamingSummary | None = state.get(SUMMARY)
        built = summary is not None and summary.size == summary_size
        if not built:
            summary = StreamingSummary.empty(batch * heads, summary_size, keys.device)
            state[SUMMARY] = summary
            state[REBUILDS] = torch.tensor(state.get(REBUILDS, 0), dtype=torch.int64, device=keys.device)
            torch._dynamo.mark_static_address(state[REBUILDS])
        summary.mark_static()
        state[BUILT] = torch.tensor(built, device=keys.device)
        torch._dynamo.mark_static_address(state[BUILT])

    takes_key_probes = True

    def decode_key_probes(self, scoring: ScoringInputs, budget: int, state: dict) -> KeyProbes | None:
        """A decode step over a fixed capacity whose summary the prefill built: the joiner's key,
        whose products with every stored key its similarities to the summary's members come from
        (:meth:`StreamingSummary.step`). The joiner is the token after the summary in position order,
        known before the step's attention (it joins only if the step evicts); ``context``: the rank
        order, the ranked positions, the joiner's stored index and key. None for any other step."""
        batch, heads, capacity, dim = scoring.keys.shape
        if scoring.filled is None or SUMMARY not in state or REBUILDS in state or capacity <= budget:
            return None
        summary_size, _ = self.split(budget)
        rows = batch * heads
        keys = scoring.keys.reshape(rows, capacity, dim)
        order, ranked = rank_by_position(
            scoring, scoring.positions.reshape(rows, capacity), self._stored_slots(scoring)
        )
        if order is None:  # stored in order: the rank is the stored index
            joiner = torch.full((rows, 1), summary_size, dtype=torch.int64, device=keys.device)
        else:
            joiner = order[:, summary_size : summary_size + 1]
        joiner_key = keys.take_along_dim(joiner[:, :, None], dim=1)  # [R, 1, d]
        return KeyProbes(rows=joiner_key.view(batch, heads, 1, dim), context=(order, ranked, joiner, joiner_key))

    @staticmethod
    def _stored_slots(scoring: ScoringInputs) -> torch.Tensor | None:
        """``[C]`` the slots of a fixed capacity that hold a token (the empty ones last); None where
        the host knows every slot does (an eager step of a full capacity: no mask to build)."""
        capacity = scoring.keys.shape[2]
        if scoring.known_filled == capacity:
            return None
        return torch.arange(capacity, device=scoring.keys.device) < scoring.filled

    @staticmethod
    def _known_full(scoring: ScoringInputs, budget: int, state: dict) -> bool:
        """An eager step over a full fixed capacity, known on the host, whose summary the prefill
        built: every slot holds a token and the step evicts one (no device mask of either)."""
        capacity = scoring.keys.shape[2]
        return scoring.known_filled == capacity and capacity > budget and REBUILDS not in state

    def _ranked(self, scoring: ScoringInputs, stored: torch.Tensor | None):
        """``(order, ranked, joiner)``: :func:`rank_by_position` of the stored tokens, as
        :meth:`decode_key_probes` took it before the attention where the attention computed the
        joiner's products (``joiner``: ``(stored index, key, products)`` for
        :meth:`StreamingSummary.step`), else now (``joiner`` None)."""
        batch, heads, capacity, _ = scoring.keys.shape
        probes = scoring.key_probes
        if probes is not None and probes.products is not None:
            order, ranked, joiner, joiner_key = probes.context
            return order, ranked, (joiner, joiner_key, probes.products.reshape(batch * heads, capacity))
        positions = scoring.positions.reshape(batch * heads, capacity)
        return (*rank_by_position(scoring, positions, stored), None)

    def _summary_step(
        self, scoring: ScoringInputs, budget: int, state: dict, order, active: torch.Tensor | None, joiner
    ) -> torch.Tensor:
        """The summary's step for the newest joiner over the capacity (Algorithm 2): the dropped stored
        index ``[R, 1]`` of each row (where ``active`` is False, nothing joins)."""
        batch, heads, capacity, dim = scoring.keys.shape
        rows = batch * heads
        summary: StreamingSummary = state[SUMMARY]
        return summary.step(
            scoring.keys.reshape(rows, capacity, dim),
            scoring.valid.reshape(rows, capacity),
            self._accumulated(scoring).reshape(rows, capacity),
            scoring.positions.reshape(rows, capacity),
            self.split(budget)[0],
            1,
            self.config.mixture_weight,
            self.concave,
            normalise_mass=self.config.importance_scale == "normalised",
            active=active,
            stored_of_rank=order,
            joiner=joiner,
        )

    def _drop_in_full_capacity(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor:
        """The dropped stored index ``[R, 1]`` of a step over a full capacity (:meth:`_known_full`)."""
        order, ranked, joiner = self._ranked(scoring, None)
        torch._assert_async(state[SUMMARY].matches(ranked), "BumbleBee's summary is not the oldest stored tokens")
        return self._summary_step(scoring, budget, state, order, None, joiner)

    def _select_in_capacity(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor:
        """:meth:`select_decode` over a fixed capacity of ``budget + 1`` slots: at a step where the
        layer holds more than its budget (then exactly one more), the token after the summary joins
        it and the element of smallest marginal gain goes (Algorithm 2); at a step within the budget
        nothing goes. The first eviction of a layer whose prompt fit builds the summary from the
        oldest ``tau_s`` stored tokens (as the rebuild of :meth:`select_decode`). Fixed shapes, no
        host read."""
        batch, heads, capacity, dim = scoring.keys.shape
        slots = torch.arange(capacity, device=scoring.keys.device)
        if self._known_full(scoring, budget, state):
            return (slots != self._drop_in_full_capacity(scoring, budget, state)).view(batch, heads, capacity)
        summary: StreamingSummary = state[SUMMARY]
        built = state[BUILT]
        evict = scoring.filled > budget
        stored = slots < scoring.filled  # [C]: the slots holding a token (the empty ones last)
        order, ranked, joiner = self._ranked(scoring, stored)
        if REBUILDS in state:  # the prompt fit the budget: the first eviction builds the summary
            build = evict & ~built
            # The oldest tau_s stored tokens are the first ones: the cache fills freed slots only
            # from the first eviction on.
            size, rows = self.split(budget)[0], batch * heads
            fresh = StreamingSummary.from_keys(
                scoring.keys[:, :, :size].reshape(rows, size, dim),
                scoring.valid[:, :, :size].reshape(rows, size),
                scoring.positions[:, :, :size].reshape(rows, size),
            )
            summary.assign_where(build, fresh)
            state[REBUILDS].add_(build.long())
            built.copy_(built | evict)
            aligned = summary.matches(ranked) | ~built
        else:  # built at the prefill's selection: the summary holds its members at every step
            aligned = summary.matches(ranked)
        torch._assert_async(aligned, "BumbleBee's summary is not the oldest stored tokens")
        dropped = self._summary_step(scoring, budget, state, order, evict, joiner)
        stays = (slots != torch.where(evict, dropped, capacity)).view(batch, heads, capacity)
        return stored & stays

    def select_decode_drop(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor | None:
        """The joiner's step over a full fixed capacity (:meth:`_known_full`): Algorithm 2 drops one
        element of ``S'`` by construction, its stored index is what the step returns."""
        if scoring.filled is None or not self._known_full(scoring, budget, state):
            return None
        return self._drop_in_full_capacity(scoring, budget, state).view(scoring.keys.shape[:2])

    def select_decode(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor | None:
        if scoring.filled is not None:
            return self._select_in_capacity(scoring, budget, state)
        batch, heads, tokens, dim = scoring.keys.shape
        if tokens <= budget:
            return None
        summary_size, _ = self.split(budget)
        rows = batch * heads
        keys = scoring.keys.reshape(rows, tokens, dim)
        valid = scoring.valid.reshape(rows, tokens)
        positions = scoring.positions.reshape(rows, tokens)
        weights = self._accumulated(scoring).reshape(rows, tokens)
        summary: StreamingSummary | None = state.get(SUMMARY)
        seen, kept = state.get(SYNCED, (None, None))
        order, ranked = rank_by_position(scoring, positions, None)
        # Only appends since the last decision (counted on the host): the members are still the
        # oldest tau_s stored tokens. The device checks it without the host waiting.
        appended_only = seen is not None and tokens == kept + scoring.sequence_length - seen
        pending = state.pop(PENDING, None)
        if summary is None or summary.size != summary_size or not appended_only:
            # The prompt fit in the budget (Alg. 2 lines 6-8 kept every token so far), or the
            # stored tokens changed otherwise: the oldest tau_s stored tokens are the summary.
            summary = StreamingSummary.from_keys(*oldest_tokens(keys, valid, positions, order, summary_size))
            state[SUMMARY] = summary
            state[REBUILDS] = int(state.get(REBUILDS, 0)) + 1
        else:
            if pending is not None:  # stacked rows whose prompt fit: their summary, as alone
                fresh = StreamingSummary.from_keys(*oldest_tokens(keys, valid, positions, order, summary_size))
                summary.assign_rows(pending, fresh)
                state[REBUILDS] = int(state.get(REBUILDS, 0)) + 1
            torch._assert_async(summary.matches(ranked), "BumbleBee's summary is not the oldest stored tokens")
        state[SYNCED] = (scoring.sequence_length, budget)
        # The tokens between the summary and the local window leave the window, oldest first.
        dropped = summary.step(
            keys,
            valid,
            weights,
            positions,
            summary_size,
            tokens - budget,
            self.config.mixture_weight,
            self.concave,
            normalise_mass=self.config.importance_scale == "normalised",
            stored_of_rank=order,
        )
        keep = torch.ones(rows, tokens, dtype=torch.bool, device=keys.device)
        keep.scatter_(1, dropped, False)
        return keep.reshape(batch, heads, tokens)

    def select_state_rows(self, state: dict, index: torch.Tensor, num_heads: int) -> dict:
        # The summary holds one row per (batch row, head), batch-major; the sync marker is per layer.
        selected = dict(state)
        summary: StreamingSummary | None = state.get(SUMMARY)
        if summary is not None:
            rows = index.to(summary.sim.device)[:, None] * num_heads + torch.arange(
                num_heads, device=summary.sim.device
            )
            rows = rows.reshape(-1)
            selected[SUMMARY] = dataclasses.replace(
                summary,
                **{
                    field.name: getattr(summary, field.name).index_select(0, rows)
                    for field in dataclasses.fields(summary)
                },
            )
            if PENDING in state:
                selected[PENDING] = state[PENDING].index_select(0, rows)
        return selected

    def stack_states(self, states: list[dict], tokens_seen: list[int]) -> dict:
        """The rows' summaries stacked in order. A layer that evicts while decoding keeps one length
        for every row (``KVHiveCache.stack`` refuses others), so every row holds the same number of
        tokens: the budget once summarised. The sync marker is re-based on the most tokens any row
        has seen (the stacked layer's ``sequence_length``): the next step then sees that only a token
        was appended since. Rows whose prompt fit the budget exactly (no summary yet) beside
        summarised ones get empty slots and build their summary at the next eviction (``PENDING``),
        from their oldest ``tau_s`` stored tokens, as alone."""
        if not any(states):
            return {}
        summarised = [self._summarised(state) for state in states]
        if not any(summarised):
            return {}  # every row's prompt fit: the first eviction builds every summary, as alone
        model = next(state[SUMMARY] for state, done in zip(states, summarised, strict=True) if done)
        kept = next(state[SYNCED][1] for state, done in zip(states, summarised, strict=True) if done)
        heads, size, device = model.sim.shape[0], model.size, model.sim.device
        parts = [
            state[SUMMARY] if done else StreamingSummary.empty(heads, size, device)
            for state, done in zip(states, summarised, strict=True)
        ]
        fields = [field.name for field in dataclasses.fields(StreamingSummary)]
        summary = StreamingSummary(  # a new summary: the sources' are left as they were
            **{name: torch.cat([getattr(part, name).to(device) for part in parts], dim=0) for name in fields}
        )
        stacked = {SUMMARY: summary, SYNCED: (max(tokens_seen), kept)}
        if not all(summarised):
            stacked[PENDING] = torch.tensor(
                [not done for done in summarised for _ in range(heads)], dtype=torch.bool, device=device
            )
        return stacked

    @staticmethod
    def _summarised(state: dict) -> bool:
        """Whether a row's summary holds its members (chosen at its prefill, or built at an eviction);
        a row whose prompt fit the budget has none yet (or, in a fixed decode capacity, empty slots
        its first eviction fills: ``BUILT`` read once)."""
        summary = state.get(SUMMARY)
        if summary is None or SYNCED not in state:
            return False
        if BUILT in state and not bool(state[BUILT]):
            return False
        if PENDING in state and bool(state[PENDING].any()):
            return False
        return True


class BumbleBeePower(BumbleBee):
    """BumbleBee ♦: ``phi = g^{-1}``, ``g(y) = alpha y^(1/alpha) + beta y`` (alpha 0.04, beta 1)."""

    name = "bumblebee-power"
    config_class = BumbleBeePowerConfig
    paper = "Kumari et al. 2024, Algorithms 1-2, phi = g^-1 with g(y) = 0.04 y^25 + y"
