"""BUZZ (Zhao et al., 2024, "BUZZ: Beehive-structured Sparse KV Cache with Segmented Heavy
Hitters for Efficient LLM Inference", arXiv:2410.23079; docs/METHODS.md, "BUZZ") and BUZZ with log n.

Cache layout per head (Sec. 3.3, Fig. 3)::

    sink (k) | old samples (a) | new tokens (m) | window (w)

* **Eviction** (Algorithm 1). Between two evictions nothing is evicted: tokens that leave the
  window pile up as *new tokens*. When the region between the sink and the window (old samples
  + new tokens) exceeds the threshold ``T`` (it holds ``T + 1`` tokens, as in Algorithm 1's
  ``while m <= T`` and the reference code's ``other_size <= sample_threshold`` test), the old
  samples are interval-sampled with the small stride ``ŝ = floor((s + 1) / 2)`` (indices
  ``0, ŝ, 2ŝ, ...``) and the new tokens are cut into segments of ``s`` (the last one may be
  shorter) each keeping its local maximum of accumulated attention (Algorithm 2); the result
  becomes the old samples. The sizes follow Eq. (10); exactly (no approximation)::

      a_n = ceil(a_{n-1} / ŝ) + ceil(m_n / s),   m_n = T + 1 - a_{n-1},   a_0 = 0

  (Eq. 10 prints floors, a spurious factor 2 in the first term — its own bound Eq. 11 uses
  ``a/ŝ ~ 2a/(s+1)`` — and ``T`` for ``T + 1``; floors and ceilings differ by at most 1 per term).
* **Scores**: accumulated attention (H2O's column sums over every query seen so far), summed over
  the query heads of a KV group (docs/METHODS.md: the reference code sums over the group). They are
  held in ``scoring.token_scores["buzz_accumulated"]`` so the cache keeps them aligned. The
  column sums come from ``ScoringInputs.accumulated_attention`` (the one scoring-attention path:
  causal chunks skip the masked key blocks, float32 softmax, float16-safe product).
* **Prefill**: the prompt is one big arrival of new tokens, sampled once as above — as the
  authors' code does (``BuzzKVCacheWithAccumulation``: one call in the prefill forward) — and,
  only where that does not fit the cache's hard limit ``C``, the old samples are
  interval-sampled again with ``ŝ`` until it fits (Remark 2; ``r`` extra rounds of stride ``ŝ``
  are one round of stride ``ŝ**r``). In the peak form the limit is ``k + w + T``, Remark 2's
  "until it fits". The authors' code never thins: on a long prompt it holds
  ``k + w + ceil(m/s)`` tokens after prefill (92 at 400 tokens where ``C = 60``) and shrinks
  over the next decode steps; a kvhive cache (by default) never holds more than its budget
  after an eviction, so where the single pass exceeds it the rounds are counted in the layer state
  (``buzz_prefill_rounds``, 0 = exactly the authors' result).
  ``prefill_fit`` says what "fits" means in the mean form, where the two readings of Remark 2
  part (in the peak form both are ``C = k + w + T``):

  - ``"budget"`` (default): thin until the layer holds at most ``C`` (``C − k − w`` samples), so
    a kvhive cache never holds more than its budget after an eviction;
  - ``"peak"``: Remark 2's literal words, "until the selected tokens can fit within a container
    of length T + k + w" (``T`` samples): at ``C = 100`` (layout ``(4, 26, 113)``) a 450-token
    prompt keeps the single pass's 84 samples, 114 tokens (the default keeps 28, 58 tokens).
    The layer then holds up to the peak, above ``C``, until its next eviction (decode evictions
    keep ``C`` under both readings: Remark 2 is about the prefill), so at the same ``C`` it
    holds more memory. The cache lets it (``Policy.prefill_limit``).

  Measured on Gemma-3-270M (``results/buzz_remark2/``, docs/METHODS.md "Prefill (Remark 2)").
* **Budget** (Theorem 3.1 / Eq. 6). For a stride ``s`` use ``T / w = r`` with
  ``r = (s² + 1)/(s + 1)`` (s odd) or ``s − 1`` (s even): then the steady-state number of old
  samples is ``w`` (Appendix D.1; the proof's odd/even labels are swapped, the theorem's are
  right). With ``T`` as defined by Eq. (10) — the size of the whole region between sink and
  window at eviction, old samples included — a layer holds ``k + w + a`` tokens right after an
  eviction and grows by one per step up to ``k + w + T`` (the peak), so the steady-state
  **mean** size is ``k + w + (a* + T) / 2`` with ``a*`` the fixed point of Eq. (10) (``≈ w``).
  Two readings of a budget ``C``, ``budget_form``:

  - ``"mean"`` (default): ``C`` is the mean number of tokens held, the size the paper's
    comparisons use ("average cache size"). ``w`` and ``T`` are the integers nearest to
    ``w = 2(C − k)/(3 + r)``, ``T ≈ r·w`` whose exact steady-state mean (Eq. 10 iterated, see
    :func:`steady_state_sizes`) is the largest one ``<= C``; the peak is then ``k + w + T > C``
    (at ``C = 60, s = 5``: ``w = 15, T = 65``, mean 59.5, peak 84; 70% of it in the peak form).
  - ``"peak"``: ``C = k + w + T`` with ``w = floor((C − k) / (1 + r))`` and ``T = C − k − w``
    (rounding down ``w`` gives ``r <= T/w < r + (1 + r)/w``, inside Eq. 13/14's ``[r, r + 2s/w)``);
    BUZZ then holds about 70% of ``C`` on average (min ~40%).

  The cache asks for an eviction whenever the stored length exceeds ``C``; below BUZZ's own
  threshold (old + new ``<= T``) ``select_decode`` returns ``None`` (keep everything), so the
  layer grows to its peak and is cut when old + new reaches ``T + 1``, exactly Algorithm 1's
  schedule in both forms. After any eviction a layer holds at most ``C`` tokens (the cache's
  hard limit: the prefill below is thinned to it; with ``prefill_fit="peak"`` the prefill may
  leave up to ``k + w + T``). (This needs the cache's default schedule,
  ``decode_every=1, decode_slack=0``; a slack makes every eviction late by up to the slack, as
  for any method.) :func:`kept_size_statistics` reports the mean and peak sizes a cache's BUZZ
  layers actually held.
* **Batches.** The layout is shared by every head and batch row (one set of boundaries per
  layer, in ``state``). A batch whose rows hold different numbers of real tokens (left
  padding) is refused: each row would need its own eviction schedule (a shorter row reaches
  its threshold at other steps, so alone it keeps other tokens: 21 instead of 29 on a 2-row
  test batch), and a kvhive cache keeps every row of a decode-phase layer at the same length.
  Run such rows one at a time (the evaluation runs batches of one). Rows of equal length are
  independent: each gets exactly what it gets alone. Rows prefilled separately and stacked
  (``KVHiveCache.stack``, ``kvhive.generate_batch``) are the other way round: each keeps its own
  schedule (``stack_states``: every counter per row, ``[B, 1, 1]`` on the device), the cache holds
  them with a length per row (``decodes_rows_of_different_lengths``), and every decode step runs
  the fixed-capacity decision with each row's own counts, so a row evicts at its own steps and
  keeps exactly what it keeps alone.

**Against the authors' code** (danielfang001/buzz-llm, ``BuzzKVCacheWithAccumulation`` and
``modify_llama_forward.py``; ``tests/methods/test_buzz_authors_fixtures.py`` checks kvhive's kept
positions against their class on fixed inputs, prefill and 160 decode steps):

- decode evictions: the same positions at every step (two strides, two heads);
- prefill: one local-max pass, as theirs, whenever it fits the budget; otherwise theirs holds
  ``k + w + ceil(m/s)`` (92 tokens on a 400-token prompt at ``C = 60``) and kvhive thins the old
  samples with Remark 2's rounds (40 tokens in the peak form, 45 in the mean form;
  ``buzz_prefill_rounds`` counts them): kvhive never holds more than its budget after an
  eviction (``prefill_fit="peak"``: its peak after the prefill); mean-form layouts given to
  their class keep the same positions too (``tests/fixtures/buzz_authors_mean_form.json``);
- sizes: theirs takes ``w`` and ``T`` as arguments (their script's defaults: ``w = 160``,
  ``T = 400``, ``s = 5``, a ratio 2.5 where Theorem 3.1 gives 4.33); kvhive derives them from the
  budget (mean form by default);
- positions: their attention re-rotates the stored (un-rotated) keys at ``0..L-1`` and the
  query at the compressed length, StreamingLLM-style. kvhive does this through its cache
  interface, without patching model code: ``make_cache(..., positions="cache")``
  (``kvhive.attention.rope.KeyRotator`` re-rotates kept keys to contiguous positions after
  each eviction; RoPE depends only on differences, so this equals their scheme). It is a cache
  option, not a method parameter: the evaluation must pass it for the authors' setting (it is
  refused with SubGen's estimator and does not support left-padded batches);
- log n: their line scales every layer with ``n = key_states.shape[2]``; ``buzz-logn`` does the
  same by default (``log_count="key-length"``, below);
- scores: theirs sums the attention over query heads without grouping (MHA Llama-2); kvhive
  sums over the query heads of a KV group (equal on MHA); theirs zeroes the scores of the
  sink and old samples after an eviction, which no later choice reads (old samples are
  interval-sampled), so kvhive keeps them.

**BUZZ with log n** (Sec. 3.5, Eq. 7–8): attention logits are multiplied by ``log_512(n)`` in
**every** attention layer of the model (the authors patch the forward of every attention
module; on Gemma-3 the sliding-window layers that kvhive does not compress are scaled too).
``n`` (``log_count``):

- ``"key-length"`` (default, the authors' line in ``modify_llama_forward.py``, left commented
  out there: ``math.log(key_states.shape[2], 512)``): the number of keys in the attention call
  — every prefill row of a prompt of ``L`` tokens uses ``n = L``, a decode step the number of
  stored keys plus the new one; padding is not counted (a row's ``n`` is what it would be
  alone).
- ``"attended"`` (docs/METHODS.md's reading of Eq. 7): the keys the query may attend, ``i + 1`` for
  prefill row ``i`` (causal), the real stored keys in decode; equal to the above for the last
  prefill row and in decode.

For ``n < 512`` the factor is below 1 and is **not** clamped: Eq. 7 has no clamp, Lemma 3.1's
entropy argument holds for every ``n``, and the authors' line has none. ``n = 1`` gives 0,
which is harmless (one key gets weight 1 whatever its logit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from kvhive import static_step
from kvhive.methods.base import DECODE, PREFILL, Policy, PolicyConfig, ScoringInputs, require, require_int_at_least
from kvhive.methods.buzz_layout import (  # the layout names are re-exported here
    BuzzLayout,
    cached_layout,
    eviction_plan,
    minimum_buzz_budget,
    rounds_for,
    small_stride,
)
from kvhive.methods.buzz_layout import (
    EvictionPlan as EvictionPlan,
)
from kvhive.methods.buzz_layout import (
    layout_for_budget as layout_for_budget,
)
from kvhive.methods.buzz_layout import (
    mean_layout as mean_layout,
)
from kvhive.methods.buzz_layout import (
    old_sample_sizes as old_sample_sizes,
)
from kvhive.methods.buzz_layout import (
    peak_layout as peak_layout,
)
from kvhive.methods.buzz_layout import (
    steady_state_sizes as steady_state_sizes,
)
from kvhive.methods.buzz_layout import (
    theorem_ratio as theorem_ratio,
)

SCORE = "buzz_accumulated"
OLD = "buzz_old_samples"  # per-layer state: number of old samples (same for every head and row)
LAYOUT = "buzz_layout"  # per-layer state: (sink, window, threshold) derived from the layer budget
EVICTIONS = "buzz_evictions"  # per-layer state: number of evictions so far (prefill included)
# Per-layer state: padding tokens at the front of every row, read from the device once (at the
# prefill) and then followed on the host: appends add none and an eviction drops them all.
PADDING = "buzz_padding"
UNEQUAL_ROWS = "buzz_unequal_rows"  # per-layer state: real tokens per row when rows differ (refused at eviction)


BudgetForm = Literal["mean", "peak"]
BUDGET_FORMS = ("mean", "peak")
# What Remark 2 thins a long prompt's samples to fit (module docstring, "Prefill"): the budget C
# (default) or the paper's literal container T + k + w (the layout's peak; equal to C in the peak form).
PrefillFit = Literal["budget", "peak"]
PREFILL_FITS = ("budget", "peak")
PREFILL_ROUNDS = "buzz_prefill_rounds"  # per-layer state: Remark 2 rounds beyond the authors' single pass
# Per-layer state: sizes held after each decode step (sum, count, largest), for kept_size_statistics.
SIZE_SUM, SIZE_STEPS, SIZE_PEAK = "buzz_size_sum", "buzz_size_steps", "buzz_size_peak"
SIZE_LAST = "buzz_size_last"
# The per-layer counters a layer in a fixed decode capacity keeps on the device (0-d int64 tensors,
# updated in place: a compiled decode step reads and advances them without the host).
DEVICE_COUNTERS = (OLD, PADDING, EVICTIONS, SIZE_SUM, SIZE_STEPS, SIZE_PEAK, SIZE_LAST)
# Per-layer state of a layer in a fixed decode capacity: (tokens seen, tokens kept, old samples,
# padding) after the last eager decision, host ints that let an eager step that evicts nothing skip
# the decision (and the cache its compaction). A compiled step never reads or writes them; an eager
# step after compiled ones sees the tokens seen moved on and reads the device counters once.
HOST_MIRROR = "buzz_host_mirror"
PREFILL_SEEN = "buzz_prefill_seen"  # per-layer state: tokens seen at the layer's prefill (host int)
# Per-layer state of stacked rows (KVHiveCache.stack): True when every DEVICE_COUNTERS entry is a
# [B, 1, 1] device tensor, each row's own schedule (its old samples, padding, evictions, sizes).
ROWS = "buzz_rows"
# The largest stride accepted. A layout search tries up to ``stride + 1`` thresholds for each of
# five windows, so the stride bounds its work (no value can make make_cache run for minutes);
# the paper uses s = 5, and at s = 1024 the smallest mean budget is already about 500 + sink.
MAX_STRIDE = 1024


@dataclass(frozen=True)
class BuzzConfig(PolicyConfig):
    """``sink`` = k (Sec. 3.3: "often a small number ranging from 1 to 5"; the reference uses 4),
    ``stride`` = s (the paper's experiments, Fig. 4 and Table A, use 5). Window and threshold are
    derived from the budget: ``budget_form="mean"`` reads the budget as the mean number of tokens
    held (the paper's "average cache size"), ``"peak"`` as the largest, ``k + w + T`` (module
    docstring). ``prefill_fit``: what Remark 2 thins a long prompt's samples to fit, ``"budget"``
    (``C``, default) or ``"peak"`` (the paper's literal ``T + k + w``; differs in the mean form)."""

    sink: int = 4
    stride: int = 5
    budget_form: BudgetForm = "mean"
    prefill_fit: PrefillFit = "budget"

    def validate(self) -> None:
        require_int_at_least(self.sink, 0, "sink")
        # One message for every refused stride, stating the whole range, why 1 and 2 are out and
        # why there is a largest one.
        require(
            isinstance(self.stride, int) and not isinstance(self.stride, bool) and 3 <= self.stride <= MAX_STRIDE,
            "stride",
            f"an integer in [3, {MAX_STRIDE}] (stride 1 evicts nothing and stride 2 gives the small stride "
            "floor((2+1)/2) = 1, which never thins the old samples, so the cache would grow without bound; "
            f"{MAX_STRIDE} bounds the search for the window and threshold a budget gives)",
            self.stride,
        )
        require(self.budget_form in BUDGET_FORMS, "budget_form", "'mean' or 'peak'", self.budget_form)
        require(
            self.prefill_fit in PREFILL_FITS,
            "prefill_fit",
            "'budget' (Remark 2 thins a long prompt's samples until the layer fits the budget C) or 'peak' "
            "(until they fit the paper's literal container T + k + w, above C in the mean form)",
            self.prefill_fit,
        )


def group_sum(per_query_head: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``[B, Hq, N] -> [B, H, N]`` summed over the query heads of each KV group (reference code)."""
    b, hq = per_query_head.shape[:2]
    return per_query_head.reshape(b, num_heads, hq // num_heads, *per_query_head.shape[2:]).sum(dim=2)


def local_max_mask(scores: torch.Tensor, start: int, stop: int, stride: int) -> torch.Tensor:
    """Algorithm 2, vectorised: ``[..., N]`` True at the argmax of each segment
    ``[start + i*s, start + (i+1)*s) ∩ [start, stop)`` (first index on ties)."""
    mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    length = stop - start
    if length <= 0:
        return mask
    segments = -(-length // stride)
    region = scores[..., start:stop].float()
    pad = segments * stride - length
    if pad:
        region = torch.cat([region, region.new_full((*region.shape[:-1], pad), float("-inf"))], dim=-1)
    best = region.reshape(*region.shape[:-1], segments, stride).argmax(dim=-1)
    index = start + torch.arange(segments, device=scores.device) * stride + best
    mask.scatter_(-1, index, True)
    return mask


class Buzz(Policy):
    name = "buzz"
    phases = frozenset({PREFILL, DECODE})
    config_class = BuzzConfig
    paper = "Zhao et al. 2024 (BUZZ), Algorithms 1-2, Remark 2, Theorem 3.1; budget = mean size held"
    needs_decode_attention = True
    prefill_column_sums = True  # accumulated attention of the prompt, with the attention's output
    # Its kept size varies with its schedule, within the peak: a fixed decode capacity of that bound
    # (fixed_decode_capacity) gives its decode step one shape (tests/cache/test_compiled_decode.py).
    static_decode = True
    # Stacked rows keep their own schedule (per-row counters, ROWS), so their lengths part.
    decodes_rows_of_different_lengths = True

    # -- budget --------------------------------------------------------------------------------
    def minimum_budget(self) -> int:
        return minimum_buzz_budget(self.config.sink, self.config.stride, self.config.budget_form)

    def layout(self, budget: int) -> BuzzLayout:
        return cached_layout(budget, self.config.sink, self.config.stride, self.config.budget_form)

    def prefill_limit(self, budget: int) -> int:
        """The most tokens a layer holds after its prefill eviction: the budget ``C``
        (``prefill_fit="budget"``), or the layout's peak ``k + w + T`` (``"peak"``, Remark 2's
        literal container; above ``C`` in the mean form, equal to it in the peak form)."""
        return self.layout(budget).peak if self.config.prefill_fit == "peak" else budget

    def _limit(self, phase: str, budget: int) -> int:
        """What an eviction in ``phase`` thins to: decode evictions always keep the budget."""
        return self.prefill_limit(budget) if phase == PREFILL else budget

    # -- scores --------------------------------------------------------------------------------
    def _seed_scores(self, scoring: ScoringInputs) -> None:
        scoring.token_scores[SCORE] = group_sum(scoring.accumulated_attention(), scoring.num_heads)

    def initialize_decode(self, scoring: ScoringInputs, state: dict, budget: int | None = None) -> None:
        self._seed_scores(scoring)
        if isinstance(scoring.sequence_length, int):
            state[PREFILL_SEEN] = scoring.sequence_length
        _record_step(state, scoring.num_tokens - _padding(scoring, state))

    def observe_decode(self, scoring: ScoringInputs, state: dict, budget: int | None = None) -> None:
        scores = scoring.token_scores[SCORE]
        scoring.token_scores[SCORE] = scores + group_sum(scoring.last_query_attention(), scoring.num_heads).to(
            scores.dtype
        )
        if scoring.filled is not None:  # a fixed capacity: the size is a device count
            _record_step_on_device(state, scoring.filled - state[PADDING])
            return
        _record_step(state, scoring.num_tokens - _padding(scoring, state))

    def kept_per_row(self, phase: str, num_tokens: int, budget: int, state: dict) -> int | None:
        if PADDING not in state or state.get(UNEQUAL_ROWS) is not None or state.get(ROWS):
            return None  # known once the layer has seen its prompt (and refused for unequal rows)
        plan = eviction_plan(
            self.layout(budget),
            num_tokens,
            _host_int(state[PADDING]),
            _host_int(state.get(OLD, 0)),
            self._limit(phase, budget),
        )
        return num_tokens if plan is None else plan.kept

    def fixed_decode_capacity(self, keys: torch.Tensor, budget: int, state: dict) -> int | None:
        """Between evictions a layer grows to ``k + w + T`` (the peak; a common left padding that no
        eviction dropped yet adds its length), and after one it holds at most the budget: the bound
        of a fixed decode capacity. The host counters move to the device. A batch of unequal rows
        keeps the host path (it is refused at its first eviction, as before).

        Stacked rows (``ROWS``): each row's counters become ``[B, 1, 1]`` on the keys' device and the
        bound covers the row with the most padding (read once, at stacking)."""
        if state.get(ROWS):
            layout = self.layout(budget)
            state[LAYOUT] = layout
            batch = keys.shape[0]
            for key in DEVICE_COUNTERS:
                state[key] = state[key].to(keys.device).reshape(batch, 1, 1)
            return max(budget, layout.peak + int(state[PADDING].max()))
        if PADDING not in state or state.get(UNEQUAL_ROWS) is not None:
            return None
        layout = self.layout(budget)
        state[LAYOUT] = layout
        bound = max(budget, layout.peak + _host_int(state[PADDING]))
        # The mirror as the prefill left the layer (its old samples and padding still host ints).
        mirror = (state.get(PREFILL_SEEN), keys.shape[2], _host_int(state.get(OLD, 0)), _host_int(state[PADDING]))
        # The counters still host ints go to the device in one copy (not one per counter: how many the
        # prefill left as host ints depends on its evictions, and each copy is a host-to-device transfer).
        on_host = [key for key in DEVICE_COUNTERS if not isinstance(state.get(key, 0), torch.Tensor)]
        if on_host:
            moved = torch.tensor([state.get(key, 0) for key in on_host], dtype=torch.int64, device=keys.device)
            for key, value in zip(on_host, moved, strict=True):
                value = value.clone()  # a counter of its own, updated in place by the decode steps
                torch._dynamo.mark_static_address(value)
                state[key] = value
        state[HOST_MIRROR] = mirror if mirror[0] is not None else None
        return bound

    # -- selection -----------------------------------------------------------------------------
    def select_prefill(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor | None:
        return self._evict(scoring, budget, state)

    def select_decode(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor | None:
        if scoring.filled is None:
            return self._evict(scoring, budget, state)
        if (
            static_step.in_static_step() or state.get(ROWS)
        ):  # stacked rows: every row's own schedule, on the device  # traced or captured once: the device path (kvhive.static_step)
            return self._evict_in_capacity(scoring, budget, state)
        # An eager step: the schedule is known on the host (Eq. 10's sizes do not depend on the
        # scores), so a step below the threshold returns None and costs nothing.
        seen, kept, old, padding = self._host_mirror(scoring, state)
        plan = eviction_plan(state[LAYOUT], kept + 1, padding, old, budget) if kept + 1 > budget else None
        if plan is None:
            state[HOST_MIRROR] = (scoring.sequence_length, kept + 1, old, padding)
            return None
        state[HOST_MIRROR] = (scoring.sequence_length, plan.kept, plan.samples, 0)
        return self._evict_in_capacity(scoring, budget, state)

    @staticmethod
    def _host_mirror(scoring: ScoringInputs, state: dict) -> tuple[int, int, int, int]:
        """(tokens seen, kept, old samples, padding) before this step's token, on the host: the
        mirror of the last eager decision, or (after compiled steps, or at the first step) the
        device counters read once."""
        mirror = state.get(HOST_MIRROR)
        if mirror is not None and mirror[0] + 1 == scoring.sequence_length:
            return mirror
        return (
            scoring.sequence_length - 1,
            int(scoring.filled) - 1,
            int(state[OLD]),
            int(state[PADDING]),
        )

    def _evict_in_capacity(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor:
        """:meth:`_evict` over a fixed capacity: the same plan (:func:`eviction_plan`) computed from
        the device counts (``scoring.filled`` tokens stored, the old samples and padding in
        ``state``), the same masks built over the whole capacity, and every filled slot kept at a
        step that evicts nothing. Fixed shapes, no host read. Stacked rows (``ROWS``): the counts
        are ``[B, 1, 1]`` and every quantity below is each row's own (broadcast over heads and
        slots), so a row evicts at its own steps and keeps what it keeps alone."""
        layout = state[LAYOUT]  # set by fixed_decode_capacity (the layout search is host work)
        n = scoring.filled
        capacity = scoring.num_tokens
        padding, old = state[PADDING], state[OLD]
        stride, hat = layout.stride, small_stride(layout.stride)
        # Each line is a kernel or two of a captured step (0-d or [B, 1, 1] counts): the plan of
        # eviction_plan in as few tensor operations as it takes.
        sink_end, window_start, evict = _region(layout, n, padding, budget)
        old_end = torch.minimum(sink_end + old, window_start)
        count = _ceil_div(old_end - sink_end, hat) + _ceil_div(window_start - old_end, stride)
        # Remark 2's rounds, enough for any count the capacity can hold (ŝ**rounds >= capacity): round
        # r + 1 is taken exactly where ceil(count / ŝ**r) > room, i.e. count > room * ŝ**r, so their
        # number is one comparison and a sum (a loop of rounds cost ~6 kernels a round).
        room = budget - layout.sink - layout.window
        round_limits = room * torch.pow(hat, torch.arange(rounds_for(capacity, hat), device=n.device))
        thinning = torch.pow(hat, (count.unsqueeze(-1) > round_limits).sum(dim=-1))
        count = _ceil_div(count, thinning)
        kept = (sink_end - padding) + count + (n - window_start)

        scores = scoring.token_scores[SCORE]
        index = torch.arange(capacity, device=scores.device)
        from_sink = index - sink_end
        old_picks = (from_sink >= 0) & (index < old_end) & (from_sink % hat == 0)
        samples = old_picks | _local_max_in_capacity(scores, old_end, window_start, stride)
        samples = samples & ((samples.cumsum(dim=-1) - 1) % thinning == 0)
        filled_slots = index < n
        evicting = samples | ((index >= padding) & (index < sink_end)) | ((index >= window_start) & filled_slots)
        keep = torch.where(evict, evicting, filled_slots).expand(scores.shape)

        # The counters in place, each written by one kernel where it can be (out= the counter itself).
        torch.where(evict, count, old, out=state[OLD])
        state[PADDING].masked_fill_(evict, 0)  # the eviction dropped the padding
        state[EVICTIONS].add_(evict)
        state[SIZE_SUM].sub_(torch.where(evict, state[SIZE_LAST] - kept, 0))
        torch.where(evict, kept, state[SIZE_LAST], out=state[SIZE_LAST])
        return keep

    def decode_eviction_due(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor | None:
        """Algorithm 1's test over a fixed capacity (:meth:`_evict_in_capacity` changes nothing where it
        fails): a captured step runs the decision at one step in ``T + 1 - a``. Stacked rows: where any
        row evicts (each row's own test decides inside)."""
        if scoring.filled is None:
            return None
        return _region(state[LAYOUT], scoring.filled, state[PADDING], budget)[2].any()

    def _evict(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor | None:
        layout = self.layout(budget)
        state[LAYOUT] = layout
        n = scoring.num_tokens
        padding = _padding(scoring, state, evicting=True)
        plan = eviction_plan(layout, n, padding, _host_int(state.get(OLD, 0)), self._limit(scoring.phase, budget))
        if plan is None:
            return None  # below the threshold: buffer, evict nothing
        if SCORE not in scoring.token_scores:
            self._seed_scores(scoring)
        scores = scoring.token_scores[SCORE]
        index = torch.arange(n, device=scores.device)
        sink_end, old_end, window_start = plan.sink_end, plan.old_end, plan.window_start
        hat = small_stride(self.config.stride)

        # Algorithm 1 line 15: interval-sample the old samples, local-max-sample the new tokens.
        old_picks = (index >= sink_end) & (index < old_end) & ((index - sink_end) % hat == 0)
        samples = old_picks | local_max_mask(scores, old_end, window_start, self.config.stride)
        if plan.thinning > 1:
            ordinal = samples.long().cumsum(dim=-1) - 1
            samples = samples & (ordinal % plan.thinning == 0)
        keep = (samples | ((index >= padding) & (index < sink_end)) | (index >= window_start)).expand(scores.shape)
        keep = keep.clone()
        if scoring.phase == PREFILL:
            state[PREFILL_ROUNDS] = plan.rounds
        state[OLD] = plan.samples
        state[PADDING] = 0  # the eviction dropped the padding
        state[EVICTIONS] = _host_int(state.get(EVICTIONS, 0)) + 1
        _record_eviction(state, plan.kept)
        return keep

    def select_state_rows(self, state: dict, index: torch.Tensor, num_heads: int) -> dict:
        selected = dict(state)
        if state.get(ROWS):  # stacked rows: each row's schedule counters
            for key in DEVICE_COUNTERS:
                selected[key] = state[key].index_select(0, index.to(state[key].device))
        # Otherwise the state is the layer's eviction schedule and size statistics, the same for
        # every row (BUZZ refuses rows of different real lengths), so any selection keeps it.
        return selected

    def stack_states(self, states: list[dict], tokens_seen: list[int]) -> dict:
        """Each row keeps its own schedule: the counters (old samples, padding, evictions, sizes),
        host ints or device counts in a row's state, become per-row device tensors (``ROWS``; laid
        out as ``[B, 1, 1]`` by :meth:`fixed_decode_capacity`, which the stacking cache calls with
        the layer's budget). The schedule depends on a row's stored tokens and these counts only,
        never on the tokens seen, so no row is re-based."""
        if not any(states):
            return {}
        if any(state.get(UNEQUAL_ROWS) is not None for state in states):
            raise ValueError(
                f"method {self.name!r} cannot stack caches of a batch whose rows hold different numbers of real "
                "tokens (left padding): prefill each prompt alone"
            )
        stacked = {ROWS: True}
        layouts = [state[LAYOUT] for state in states if LAYOUT in state]
        if layouts:
            stacked[LAYOUT] = layouts[0]
        stacked[PREFILL_ROUNDS] = max(_host_int(state.get(PREFILL_ROUNDS, 0)) for state in states)
        for key in DEVICE_COUNTERS:
            stacked[key] = _per_row_counter([state.get(key, 0) for state in states])
        return stacked


def _per_row_counter(values: list) -> torch.Tensor:
    """One int64 tensor ``[B]`` of per-row counts, each a host int, a 0-d device counter (a layer
    in a fixed decode capacity) or a ``[1, 1, 1]`` row of stacked rows; a new tensor (the sources'
    counters are never advanced by the stacked layer), on the device of the first device counter."""
    device = next((value.device for value in values if isinstance(value, torch.Tensor)), torch.device("cpu"))
    return torch.cat([torch.as_tensor(value, dtype=torch.int64).reshape(-1).to(device) for value in values])


def _host_int(value) -> int:
    """A per-layer count as a host int: a device counter (a layer that left its fixed decode
    capacity, e.g. for a multi-token continuation) is read back once."""
    return int(value)


def _ceil_div(numerator: torch.Tensor, denominator) -> torch.Tensor:
    """``ceil(numerator / denominator)`` of a non-negative integer tensor by a positive integer
    (or integer tensor): ``(a + b - 1) // b``, two kernels (``-(-a // b)`` is three)."""
    return torch.div(numerator + (denominator - 1), denominator, rounding_mode="floor")


def _region(
    layout: BuzzLayout, filled: torch.Tensor, padding: torch.Tensor, budget: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sink end, window start, evict)`` of a layer holding ``filled`` tokens, ``padding`` of them
    at the front (device counts, 0-d or ``[B, 1, 1]``): where the old samples and new tokens lie, and
    Algorithm 1's test on them (below the budget nothing is evicted: the cache asks only above it).
    ``padding + min(filled - padding, k)`` is ``min(filled, padding + k)``: a kernel fewer."""
    sink_end = torch.minimum(filled, padding + layout.sink)
    window_start = torch.maximum(sink_end, filled - layout.window)
    return sink_end, window_start, (window_start - sink_end > layout.threshold) & (filled > budget)


def _local_max_in_capacity(scores: torch.Tensor, start: torch.Tensor, stop: torch.Tensor, stride: int) -> torch.Tensor:
    """:func:`local_max_mask` with device bounds ``start``/``stop`` (0-d tensors, or ``[B, 1, 1]``
    for stacked rows) over a fixed capacity: the region is gathered to the front, padded with
    ``-inf`` to whole segments and each segment's first argmax kept, exactly as there; segments
    past ``stop`` keep nothing."""
    capacity = scores.shape[-1]
    segments = -(-capacity // stride)
    source = start + torch.arange(segments * stride, device=scores.device)
    region = scores.float().gather(-1, source.clamp(max=capacity - 1).expand(*scores.shape[:-1], -1))
    region = region.masked_fill(source >= stop, float("-inf"))
    best = region.view(*scores.shape[:-1], segments, stride).argmax(dim=-1)
    segment_start = source.view(*source.shape[:-1], segments, stride)[..., 0]
    index = torch.where(segment_start < stop, segment_start + best, capacity)
    mask = torch.zeros(*scores.shape[:-1], capacity + 1, dtype=torch.bool, device=scores.device)
    mask.scatter_(-1, index, True)
    return mask[..., :capacity]


def _padding(scoring: ScoringInputs, state: dict, evicting: bool = False) -> int:
    """Padding tokens at the front of the first row: read from the device the first time a layer
    is seen (one host read), then followed on the host (``PADDING``). An eviction (``evicting``)
    refuses rows with different amounts (module docstring, "Batches"); a layer that never evicts
    runs them, its sizes counted on the first row."""
    if PADDING not in state:
        real = scoring.valid[:, 0].sum(dim=-1).tolist()
        state[PADDING] = scoring.num_tokens - real[0]
        if any(count != real[0] for count in real):
            state[UNEQUAL_ROWS] = real
    if evicting and state.get(UNEQUAL_ROWS) is not None:
        raise ValueError(
            f"BUZZ cannot compress a batch whose rows hold different numbers of real tokens ({state[UNEQUAL_ROWS]}, "
            "left padding): each row needs its own eviction schedule, and a kvhive cache keeps every row of a "
            "layer at the same length; run these rows one at a time (batch size 1)"
        )
    return _host_int(state[PADDING])


def _record_step(state: dict, size: int) -> None:
    """One more step held ``size`` tokens (corrected by :func:`_record_eviction` if it evicts)."""
    state[SIZE_PEAK] = max(state.get(SIZE_PEAK, 0), state.get("buzz_size_last", 0))
    state[SIZE_SUM] = state.get(SIZE_SUM, 0) + size
    state[SIZE_STEPS] = state.get(SIZE_STEPS, 0) + 1
    state["buzz_size_last"] = size


def _record_eviction(state: dict, kept: int) -> None:
    if SIZE_STEPS in state:
        state[SIZE_SUM] -= state["buzz_size_last"] - kept
        state["buzz_size_last"] = kept


def _record_step_on_device(state: dict, size: torch.Tensor) -> None:
    """:func:`_record_step` on the device counters of a layer in a fixed decode capacity."""
    torch.maximum(state[SIZE_PEAK], state[SIZE_LAST], out=state[SIZE_PEAK])
    state[SIZE_SUM].add_(size)
    state[SIZE_STEPS].add_(1)
    state[SIZE_LAST].copy_(size)


def size_statistics(state: dict) -> dict | None:
    """Sizes one BUZZ layer held (tokens per head, after each forward step, prefill included):
    ``mean_kept``, ``peak_kept``, ``steps``, and the layout with its steady-state mean and peak;
    None before the layer ran."""
    steps = state.get(SIZE_STEPS)
    if isinstance(steps, torch.Tensor) and steps.numel() > 1:
        # Stacked rows (ROWS): each row's own sizes; the mean of the rows' means, the largest peak.
        steps = steps.reshape(-1).tolist()
        totals = state[SIZE_SUM].reshape(-1).tolist()
        rows = [(total / count) for total, count in zip(totals, steps, strict=True) if count]
        if not rows:
            return None
        peak = int(torch.maximum(state[SIZE_PEAK], state[SIZE_LAST]).max())
        steps_taken, mean_kept = max(steps), sum(rows) / len(rows)
    else:
        if not steps:
            return None
        steps_taken, total = int(steps), int(state[SIZE_SUM])  # device counters read once
        mean_kept = total / steps_taken
        peak = max(int(state[SIZE_PEAK]), int(state[SIZE_LAST]))
    result = {
        "steps": steps_taken,
        "mean_kept": mean_kept,
        "peak_kept": peak,
        "prefill_rounds": state.get(PREFILL_ROUNDS, 0),
    }
    layout = state.get(LAYOUT)
    if layout is not None:
        result.update(
            sink=layout.sink,
            window=layout.window,
            threshold=layout.threshold,
            steady_mean_kept=float(layout.steady_mean),
            steady_peak_kept=layout.peak,
        )
    return result


def kept_size_statistics(cache) -> dict:
    """Mean and peak tokens per head held by a cache's BUZZ layers (``KVHiveCache``): the mean
    over layers of each layer's mean over steps, the largest peak, and ``per_layer``."""
    per_layer = {}
    for index, layer in enumerate(cache.layers):
        stats = size_statistics(getattr(layer, "policy_state", {}))
        if stats is not None:
            per_layer[index] = stats
    if not per_layer:
        return {"mean_kept": 0.0, "peak_kept": 0, "per_layer": {}}
    return {
        "mean_kept": sum(s["mean_kept"] for s in per_layer.values()) / len(per_layer),
        "peak_kept": max(s["peak_kept"] for s in per_layer.values()),
        "per_layer": per_layer,
    }


LogCount = Literal["key-length", "attended"]


@dataclass(frozen=True)
class BuzzLogNConfig(BuzzConfig):
    """``log_base`` = 512, "the mainstream model's pre-training length" (Sec. 3.5); ``log_count``:
    ``"key-length"`` (the authors' line) or ``"attended"`` (module docstring)."""

    log_base: int = 512
    log_count: LogCount = "key-length"

    def validate(self) -> None:
        super().validate()
        require_int_at_least(self.log_base, 2, "log_base")
        require(self.log_count in ("key-length", "attended"), "log_count", "'key-length' or 'attended'", self.log_count)


class BuzzLogN(Buzz):
    """BUZZ eviction plus attention logits multiplied by ``log_base(n)`` in every layer (Eq. 7-8)."""

    name = "buzz-logn"
    config_class = BuzzLogNConfig
    paper = "Zhao et al. 2024 (BUZZ), Sec. 3.5 Eq. 7-8 (log n, every layer) with Algorithms 1-2"

    def logit_scale(self, key_counts: torch.Tensor) -> torch.Tensor:
        """``key_counts [..., q]``: the keys each query row may attend (its own row of the batch,
        padding excluded). ``"key-length"`` uses the row's largest count (the keys in the call)."""
        counts = key_counts.to(torch.float64)
        if self.config.log_count == "key-length":
            counts = counts.amax(dim=-1, keepdim=True).expand_as(counts)
        return (torch.log(counts.clamp_min(1.0)) / math.log(self.config.log_base)).to(torch.float32)
