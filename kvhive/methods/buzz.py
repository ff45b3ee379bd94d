"""BUZZ (Zhao et al., 2024, "BUZZ: Beehive-structured Sparse KV Cache with Segmented Heavy
Hitters for Efficient LLM Inference", ../shared/papers/buzz.txt) and BUZZ with log n.

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
  the query heads of a KV group (METHODS.md: the reference code sums over the group). They are
  held in ``scoring.token_scores["buzz_accumulated"]`` so the cache keeps them aligned. The
  prefill column sums are computed by :func:`prefill_accumulated_attention`, which skips the
  causally masked key blocks (3x faster than the generic ``ScoringInputs`` path at 2k tokens).
* **Prefill** (Remark 2): the prompt is one big arrival of new tokens; sample as above, then keep
  interval-sampling the old samples with ``ŝ`` until the cache fits in ``k + w + T``
  (``r`` extra rounds of stride ``ŝ`` are one round of stride ``ŝ**r``).
* **Budget** (METHODS.md choice, Theorem 3.1 / Eq. 6). For a budget ``C`` and stride ``s`` use
  ``T / w = r`` with ``r = (s² + 1)/(s + 1)`` (s odd) or ``s − 1`` (s even): then the
  steady-state number of old samples is ``w`` (Appendix D.1; the proof's odd/even labels are
  swapped, the theorem's are right). With ``T`` as defined by Eq. (10) — the size of the whole
  region between sink and window at eviction, old samples included — the largest cache is
  ``k + w + T`` (old ``≈ w`` plus new ``≈ T − w`` at the peak, i.e. ``k + 2w + (T − w)``;
  METHODS.md's ``k + 2w + T`` counts ``T`` as new tokens only, which contradicts Eq. 10 and
  Theorem 3.1). So the budget **is** the peak: ``C = k + w + T`` with
  ``w = floor((C − k) / (1 + r))`` and ``T = C − k − w`` (rounding down ``w`` gives
  ``r <= T/w < r + (1 + r)/w``, inside Eq. 13/14's ``[r, r + 2s/w)``). The cache asks for an
  eviction exactly when the stored length exceeds ``C``, i.e. when old + new reaches ``T + 1``,
  so the threshold and the cache's schedule coincide and the cache never holds more than ``C``
  tokens after a step. ``select_decode`` returns ``None`` (keep everything) if ever called below
  the threshold. (This needs the cache's default schedule, ``decode_every=1, decode_slack=0``;
  a slack makes every eviction late by up to the slack, as for any method.)
* **Left padding.** The layout is shared by every head and batch row (one set of boundaries per
  layer, in ``state``). A left-padded row never keeps padding while it has real tokens: its
  structural picks that fall on padding are replaced by its first ``k`` real tokens (its true
  attention sinks) and then by its highest accumulated-attention tokens, so every row keeps
  the same count.

**BUZZ with log n** (Sec. 3.5, Eq. 7–8): attention logits are multiplied by ``log_512(n)``,
``n`` = the number of keys the query attends to (the ``logit_scale`` hook: ``1..q`` causally in
prefill, the stored length in decode; METHODS.md). For ``n < 512`` the factor is below 1 and is
**not** clamped: Eq. 7 has no clamp, Lemma 3.1's entropy argument holds for every ``n``, and the
log-n line of the reference code (``modify_llama_forward.py``, left commented out there)
multiplies by ``math.log(key_states.shape[2], 512)`` unconditionally. ``n = 1`` gives 0, which is
harmless (one key gets weight 1 whatever its logit). That reference line uses the whole key
length for every prefill row; METHODS.md's per-query count (row ``i`` attends ``i + 1`` keys) is
what the causal mask actually lets each row see, and equals it for the last row and in decode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch

from kvhive.methods.base import (DECODE, PREFILL, Policy, PolicyConfig, ScoringInputs, first_real_tokens,
                                 keep_top_scores, require_int_at_least)

SCORE = "buzz_accumulated"
OLD = "buzz_old_samples"  # per-layer state: number of old samples (same for every head and row)
LAYOUT = "buzz_layout"  # per-layer state: (sink, window, threshold) derived from the layer budget
EVICTIONS = "buzz_evictions"  # per-layer state: number of evictions so far (prefill included)


@dataclass(frozen=True)
class BuzzConfig(PolicyConfig):
    """``sink`` = k (Sec. 3.3: "often a small number ranging from 1 to 5"; the reference uses 4),
    ``stride`` = s (the paper's experiments, Fig. 4 and Table A, use 5). Window and threshold are
    derived from the budget (module docstring)."""

    sink: int = 4
    stride: int = 5

    def validate(self) -> None:
        require_int_at_least(self.sink, 0, "sink")
        require_int_at_least(self.stride, 1, "stride")
        if self.stride < 3:
            raise ValueError(
                f"invalid stride={self.stride!r}: expected an integer >= 3 (stride 1 evicts nothing and stride 2 "
                f"gives the small stride floor((2+1)/2) = 1, which never thins the old samples, so the cache "
                f"would grow without bound)"
            )


def small_stride(stride: int) -> int:
    """``ŝ = floor((s + 1) / 2)`` (Table 1)."""
    return (stride + 1) // 2


def theorem_ratio(stride: int) -> Fraction:
    """Theorem 3.1 (Eq. 6): ``T / w = (s² + 1)/(s + 1)`` for odd ``s``, ``s − 1`` for even ``s``."""
    if stride % 2 == 1:
        return Fraction(stride * stride + 1, stride + 1)
    return Fraction(stride - 1)


@dataclass(frozen=True)
class BuzzLayout:
    sink: int
    window: int
    threshold: int

    @property
    def peak(self) -> int:
        return self.sink + self.window + self.threshold


def layout_for_budget(budget: int, sink: int, stride: int) -> BuzzLayout:
    """``(k, w, T)`` for a budget ``C = k + w + T`` with ``T / w`` from Theorem 3.1 (rounded as in
    the module docstring). Raises ValueError naming ``budget`` when ``C`` leaves no window."""
    ratio = theorem_ratio(stride)
    room = budget - sink
    window = math.floor(Fraction(room) / (1 + ratio)) if room > 0 else 0
    if window < 1:
        raise ValueError(
            f"invalid budget={budget!r} for BUZZ (sink={sink}, stride={stride}): expected an integer >= "
            f"{minimum_buzz_budget(sink, stride)} so that sink + window + threshold fits with window >= 1 and "
            f"threshold/window = {ratio} (Theorem 3.1)"
        )
    return BuzzLayout(sink=sink, window=window, threshold=room - window)


def minimum_buzz_budget(sink: int, stride: int) -> int:
    return sink + math.ceil(1 + theorem_ratio(stride))


def old_sample_sizes(threshold: int, stride: int, evictions: int, start: int = 0) -> list[int]:
    """The exact recurrence of Eq. (10) for steady decoding: ``a_n`` after each eviction, each
    eviction seeing ``T + 1`` tokens between sink and window."""
    sizes, old, hat = [], start, small_stride(stride)
    for _ in range(evictions):
        new = threshold + 1 - old
        old = -(-old // hat) + -(-new // stride)
        sizes.append(old)
    return sizes


def group_sum(per_query_head: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``[B, Hq, N] -> [B, H, N]`` summed over the query heads of each KV group (reference code)."""
    b, hq = per_query_head.shape[:2]
    return per_query_head.reshape(b, num_heads, hq // num_heads, *per_query_head.shape[2:]).sum(dim=2)


def prefill_accumulated_attention(queries: torch.Tensor, keys: torch.Tensor, mask_rows, scaling: float,
                                  max_elements: int = 1 << 22) -> torch.Tensor:
    """Column sums ``[B, Hq, N]`` of the prefill attention (H2O's accumulated attention), chunked
    over query rows. Prefill is causal, so a chunk of rows ``[start, stop)`` only multiplies the
    keys ``[0, stop)``: about half the work of :meth:`ScoringInputs.accumulated_attention`, and
    small chunks (``max_elements`` logits at a time) stay in cache; same result (fully masked
    padding rows count 0)."""
    b, hq, n, d = queries.shape
    h = keys.shape[1]
    group = hq // h
    total = torch.zeros(b, hq, n, dtype=torch.float32, device=queries.device)
    rows = max(1, max_elements // max(1, b * hq * n))
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        # [B, H, G*rows, d] @ [B, H, d, stop]: no broadcast over the group, so the keys are not
        # expanded (copied) once per chunk.
        chunk = queries[:, :, start:stop].reshape(b, h, group * (stop - start), d) * scaling
        logits = torch.matmul(chunk, keys[:, :, :stop].transpose(-1, -2))
        logits = logits.reshape(b, hq, stop - start, stop).float()
        allowed = mask_rows(slice(start, stop), stop)
        if allowed.shape[1] not in (1, hq):
            allowed = allowed.repeat_interleave(group, dim=1)
        logits.masked_fill_(~allowed, float("-inf"))
        # Fully masked (padding) query rows give NaN rows; they count 0 (a model NaN stays NaN).
        weights = torch.where(allowed.any(dim=-1, keepdim=True), torch.softmax(logits, dim=-1), 0.0)
        total[..., :stop] += weights.sum(dim=2)
    return total


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
    paper = "Zhao et al. 2024 (BUZZ), Algorithms 1-2, Remark 2, Theorem 3.1"
    needs_decode_attention = True

    # -- budget --------------------------------------------------------------------------------
    def minimum_budget(self) -> int:
        return minimum_buzz_budget(self.config.sink, self.config.stride)

    def layout(self, budget: int) -> BuzzLayout:
        return layout_for_budget(budget, self.config.sink, self.config.stride)

    # -- scores --------------------------------------------------------------------------------
    def initialize_decode(self, scoring: ScoringInputs, state: dict) -> None:
        if scoring.phase == PREFILL and scoring.num_queries == scoring.num_tokens:
            accumulated = prefill_accumulated_attention(scoring.queries, scoring.keys, scoring.mask_rows,
                                                        scoring.scaling)
        else:
            accumulated = scoring.accumulated_attention()
        scoring.token_scores[SCORE] = group_sum(accumulated, scoring.num_heads)

    def observe_decode(self, scoring: ScoringInputs, state: dict) -> None:
        scores = scoring.token_scores[SCORE]
        scoring.token_scores[SCORE] = scores + group_sum(scoring.last_query_attention(), scoring.num_heads).to(
            scores.dtype)

    # -- selection -----------------------------------------------------------------------------
    def select_prefill(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor | None:
        return self._evict(scoring, budget, state)

    def select_decode(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor | None:
        return self._evict(scoring, budget, state)

    def _evict(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor | None:
        layout = self.layout(budget)
        state[LAYOUT] = layout
        n = scoring.num_tokens
        old = state.get(OLD, 0)
        sink_end = min(layout.sink, n)
        window_start = max(sink_end, n - layout.window)
        old_end = min(sink_end + old, window_start)
        old = old_end - sink_end
        if window_start - sink_end <= layout.threshold:
            return None  # below the threshold: buffer, evict nothing
        stride, hat = self.config.stride, small_stride(self.config.stride)
        if SCORE not in scoring.token_scores:
            self.initialize_decode(scoring, state)
        scores = scoring.token_scores[SCORE]
        valid = scoring.valid
        index = torch.arange(n, device=scores.device)

        # Algorithm 1 line 15: interval-sample the old samples, local-max-sample the new tokens.
        old_picks = (index >= sink_end) & (index < old_end) & ((index - sink_end) % hat == 0)
        ranked = scores.float().masked_fill(~valid, -1e30)  # a segment's max is a real token if it has one
        samples = old_picks | local_max_mask(ranked, old_end, window_start, stride)
        count = -(-old // hat) + -(-(window_start - old_end) // stride)
        # Remark 2: keep sampling the old samples with ŝ until they fit (r rounds = stride ŝ**r).
        step = 1
        while -(-count // step) > layout.threshold:
            step *= hat
        if step > 1:
            ordinal = samples.long().cumsum(dim=-1) - 1
            samples = samples & (ordinal % step == 0)
            count = -(-count // step)
        structural = samples | (index < sink_end) | (index >= window_start)
        kept = sink_end + count + (n - window_start)
        # Padding never takes budget from real tokens: a padded row's real sinks come first, then
        # its highest accumulated attention (rows without padding keep exactly `structural`).
        forced = (structural & valid) | first_real_tokens(valid, layout.sink)
        keep = keep_top_scores(scores, kept, valid, forced=forced)
        state[OLD] = count
        state[EVICTIONS] = state.get(EVICTIONS, 0) + 1
        return keep


@dataclass(frozen=True)
class BuzzLogNConfig(BuzzConfig):
    """``log_base`` = 512, "the mainstream model's pre-training length" (Sec. 3.5)."""

    log_base: int = 512

    def validate(self) -> None:
        super().validate()
        require_int_at_least(self.log_base, 2, "log_base")


class BuzzLogN(Buzz):
    """BUZZ eviction plus attention logits multiplied by ``log_base(n)`` (Eq. 7-8)."""

    name = "buzz-logn"
    config_class = BuzzLogNConfig
    paper = "Zhao et al. 2024 (BUZZ), Sec. 3.5 Eq. 7-8 (log n) with Algorithms 1-2"

    def logit_scale(self, key_counts: torch.Tensor) -> torch.Tensor:
        counts = key_counts.to(torch.float64).clamp_min(1.0)
        return (torch.log(counts) / math.log(self.config.log_base)).to(torch.float32)
