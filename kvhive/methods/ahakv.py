"""AhaKV (Gu et al., 2025, "AhaKV: Adaptive Holistic Attention-Driven KV Cache Eviction for
Efficient Inference of Large Language Models"), Algorithm 1, both phases.

Prefill (Algorithm 1, lines 5-12), per layer and head:

* **Recent accumulation** (Eq. 5): the eviction score of key ``j`` sums the attention weights
  of the last ``r`` query rows only, ``S_j = sum_{i=n-r}^{n} a_ij``, so every key has the same
  number of terms (the plain accumulated score of H2O, Eq. 2-4, decays with the position).
  ``r`` = the recent budget ``B_r`` (``recent = 32``; docs/METHODS.md choice).
* **Step-gain softmax** (Eq. 9-12): the weights come from ``softmax(lambda w)`` with
  ``lambda = sqrt(2 ln(n/k) / d)`` (Eq. 12, :func:`sg_lambda`); ``n`` = tokens seen so far,
  ``k`` = the budget, ``d`` = the head dimension. This only changes the *scores*, never the
  model's attention. For ``n <= k`` (nothing to evict) the gain is 0 (Eq. 12 gives ``ln 1 = 0``
  at ``n = k``). The paper admits two readings of ``w`` (``AhaKVConfig.gain_input``, see
  "Which reading" below): ``"raw_qk"`` (default), ``w = q.k`` as Eq. 8-12 derive it, i.e. the
  model's logits ``q.k / sqrt(d)`` times ``sqrt(2 ln(n/k))``; ``"scaled_qk"``,
  ``w = q.k / sqrt(d)`` as Algorithm 1 line 6 writes ``A = QK^T / sqrt(d)`` before
  ``SGsoftmax(A)``, i.e. the model's logits times ``lambda`` itself. Both are computed from
  ``q``, ``k`` and ``d`` alone (:func:`sg_logit_multiplier`), not from the model's own
  ``scaling`` (which may differ from ``1/sqrt(d)``).
* **Value prior** (Eq. 13-15): ``gamma = Avgpool(||v||^2)`` (mean filter of ``kernel = 7``
  tokens along the sequence, docs/METHODS.md choice), ``gamma_bar = gamma / max gamma`` per head,
  ``S_hat = gamma_bar * S``.
* Keep the top ``B_s = budget - B_r`` keys by ``S_hat`` outside the most recent ``B_r`` tokens,
  plus those ``B_r`` recent tokens (``S^s ∪ S^r``, line 12).

Decode (lines 17-30): the running score starts at ``F_0 = S_hat`` (line 19, so the value prior
enters through the prompt's scores only); each step adds the new query's step-gain softmax over
the kept keys, ``F_t = SG-softmax(A_t) + F_{t-1}`` (line 27, no prior on the new term, new
tokens start at 0), and the cache is cut back to the top ``B_s`` by ``F_t`` plus the recent
``B_r`` (lines 28-30). ``F`` lives in ``scoring.token_scores`` so the cache keeps it aligned with
the stored tokens.

Which reading (the default is ``raw_qk``): the paper states what the gain is for: "to make
expected information entropy equals to the maximum information entropy [of the ``k`` kept
tokens, ``log k``] regardless of the number of total tokens" (Eq. 11) and to "prevent attention
score flattening" / "emphasize key tokens" (Sec. 4.2, Fig. 3). Eq. 8 models ``w`` as Gaussian
with variance ``d``, which is raw ``q.k``; under that model ``raw_qk`` gives rows of entropy
``log k`` while ``scaled_qk`` gives ``log n - ln(n/k)/d``, barely below the plain softmax's
``log n - 1/2`` (``tests/methods/test_ahakv.py::test_gain_entropy_on_gaussian_inputs_eq_10``). On real
activations (``benchmarks/ahakv_gain_entropy.py``, ``results/ahakv_gain/``; Gemma-3-270M, 3
texts, full-attention layers, the last 32 rows before ``n`` = 512/1024/2048, ``k`` = 64/128/256)
neither reaches ``log k`` = 4.16-5.55: the model's own rows already have entropy 2.8-3.6;
``raw_qk`` sharpens them to 0.4-2.0 (too sharp: the multiplier that gives exactly ``log k`` is a
nearly constant 0.35-0.41 times raw_qk's over every ``n`` and ``k``, so Eq. 12's dependence on
``n/k`` holds and only its variance assumption is off: the model's scaled logits have a standard
deviation of 1.9-2.4, not 1); ``scaled_qk`` flattens them to 6.2-7.6, within 0.1 nat of the
uniform row's ``log n`` at every ``n`` (the target needs 5.6-6.5 times its multiplier), so it
does the opposite of the stated intent. Qwen2.5-0.5B (all 24 layers, n = 512/1024) shows the
same: own rows 2.9-3.2, ``raw_qk`` 1.1-2.4 (needed factor 0.34-0.36), ``scaled_qk`` 5.8-6.6
(needed factor 2.7-2.8). On Gemma the two keep largely different tokens (Jaccard of the
``B_s`` selected tokens 0.13-0.49). On the 10 needle prompts of 1k-2k tokens
(``benchmarks/ahakv_gain_needle_retention.py``) ``raw_qk`` keeps more of the needle sentence's
tokens at prefill than ``scaled_qk`` on every prompt (budget 128: 0.49 vs 0.35; 256: 0.65 vs
0.54; paired difference +0.15 +- 0.03 and +0.11 +- 0.03 s.e.). ``raw_qk`` is therefore the
default; ``scaled_qk`` is kept for comparison. On generation the effect depends on the model:
Gemma's needle shows no difference (n = 16), Qwen2.5-0.5B's needle favours ``scaled_qk`` (exact
match 0.48 vs 0.30, n = 40), mdqa neither (``results/ahakv_gain/README.md``).

GQA: scores are computed per query head and averaged over each KV group (docs/METHODS.md choice);
the value prior is per stored head. Padding (``valid`` False) is excluded from the mean filter
and from ``max gamma`` and ranks last.

:func:`ahakv_scores` computes ``S_hat`` for one layer; Ada-KV (``ada-ahakv``) reuses it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from kvhive.methods.base import (
    DECODE,
    PREFILL,
    PolicyConfig,
    ScorerPolicy,
    ScoringInputs,
    require,
    require_int_at_least,
)

SCORE = "ahakv_running"


# How SG-softmax's lambda is applied: to raw q.k (Eq. 8-12) or to q.k / sqrt(d) (Algorithm 1, line 6).
GainInput = Literal["raw_qk", "scaled_qk"]
GAIN_INPUTS: tuple[str, ...] = ("raw_qk", "scaled_qk")
DEFAULT_GAIN_INPUT: GainInput = "raw_qk"

# What n of Eq. 12 counts while decoding: the row's tokens seen so far ("seen", the paper's n,
# the sequence length) or the keys the new query's softmax runs over ("stored", about b + 1 once
# the cache is full). The paper does not say which for the decode phase.
DecodeN = Literal["seen", "stored"]
DECODE_N_READINGS: tuple[str, ...] = ("seen", "stored")
DEFAULT_DECODE_N: DecodeN = "seen"


def sg_lambda(num_tokens: int | torch.Tensor, budget: int, head_dim: int) -> float | torch.Tensor:
    """Eq. 12: ``lambda = sqrt(2 ln(n/k) / d)``; zero while ``n <= k`` (nothing to evict).

    ``n`` may be a device tensor (a compiled decode step counts tokens seen on the device): the
    same formula as tensor work, so the step neither reads it back nor specialises on its value."""
    if budget < 1:
        raise ValueError(f"invalid budget={budget!r}: expected an integer >= 1")
    if head_dim < 1:
        raise ValueError(f"invalid head_dim={head_dim!r}: expected an integer >= 1")
    if isinstance(num_tokens, torch.Tensor):
        ratio = num_tokens.to(torch.float64) / budget
        return torch.sqrt(2.0 * torch.log(ratio.clamp_min(1.0)) / head_dim)  # log 1 = 0 while n <= k
    if num_tokens <= budget:
        return 0.0
    return math.sqrt(2.0 * math.log(num_tokens / budget) / head_dim)


def sg_logit_multiplier(
    num_tokens: int, budget: int, head_dim: int, scaling: float, gain_input: GainInput = DEFAULT_GAIN_INPUT
) -> float:
    """Factor on the model's logits ``q.k * scaling`` that gives SG-softmax's logits (Eq. 9, 12).

    ``gain_input="raw_qk"``: ``lambda * q.k`` (Eq. 8-12 derive lambda for raw ``q.k``, whose
    variance is ``d`` under their Gaussian assumption); ``"scaled_qk"``: ``lambda * q.k / sqrt(d)``
    (Algorithm 1, line 6 forms ``A = QK^T / sqrt(d)`` before ``SGsoftmax(A)``). With the usual
    ``scaling = 1/sqrt(d)`` these are ``sqrt(2 ln(n/k))`` and ``lambda`` respectively.
    """
    require(gain_input in GAIN_INPUTS, "gain_input", f"one of {GAIN_INPUTS}", gain_input)
    require(scaling > 0, "scaling", "a number > 0", scaling)
    gain = sg_lambda(num_tokens, budget, head_dim)
    if gain_input == "scaled_qk":
        gain /= math.sqrt(head_dim)
    return gain / scaling


def value_prior(values: torch.Tensor, valid: torch.Tensor | None, kernel: int) -> torch.Tensor:
    """``gamma_bar [B, H, N]`` = mean filter of ``||v||^2`` (Eq. 13) divided by its maximum (Eq. 14).

    The mean filter is centred with ``kernel`` taps and averages only real tokens (padding and
    the sequence edges do not count), so a row's padding never dilutes its real values.
    """
    norms = values.float().pow(2).sum(dim=-1)
    if valid is None:
        valid = torch.ones_like(norms, dtype=torch.bool)
    weight = valid.to(norms.dtype)
    norms = norms * weight
    if kernel > 1:
        b, h, n = norms.shape
        stacked = torch.stack([norms, weight], dim=2).reshape(b * h, 2, n)
        pooled = F.avg_pool1d(stacked, kernel_size=kernel, stride=1, padding=kernel // 2, count_include_pad=True)
        pooled = pooled.reshape(b, h, 2, n)
        gamma = pooled[:, :, 0] / pooled[:, :, 1].clamp_min(1e-12)
    else:
        gamma = norms
    gamma = torch.where(valid, gamma, torch.zeros_like(gamma))
    peak = gamma.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(gamma.dtype).tiny)
    return gamma / peak


def ahakv_scores(
    scoring: ScoringInputs, budget: int, recent: int = 32, kernel: int = 7, gain_input: GainInput = DEFAULT_GAIN_INPUT
) -> torch.Tensor:
    """AhaKV's prefill eviction scores ``S_hat [B, H, N]`` for one layer (Eq. 5, 12, 13-15).

    Step-gain softmax weights of the last ``recent`` query rows, summed per key (per query
    head, then averaged over each KV group), times the normalised value prior. ``budget`` is
    the ``k`` of Eq. 12 (tokens kept per head); ``n`` is ``scoring.sequence_length``;
    ``gain_input`` picks the reading of the gain (:func:`sg_logit_multiplier`).
    """
    gain = _scoring_multiplier(scoring, budget, gain_input)
    accumulated = scoring.recent_accumulated_attention(recent, logit_multiplier=gain)
    scores = scoring.to_kv_heads(accumulated)
    return value_prior(scoring.values, scoring.valid, kernel) * scores


def _scoring_multiplier(
    scoring: ScoringInputs, budget: int, gain_input: GainInput, padding: list[int] | None = None
) -> float | tuple[float, ...]:
    """The gain's logit factor; ``n`` of Eq. 12 is each row's own token count (its left padding
    ``padding[b]`` excluded, so a row of a padded batch gets the factor it gets alone)."""
    if padding is None:
        padding = row_padding(scoring)
    factors = tuple(
        sg_logit_multiplier(scoring.sequence_length - pad, budget, scoring.keys.shape[-1], scoring.scaling, gain_input)
        for pad in padding
    )
    if isinstance(factors[0], torch.Tensor):  # n on the device (compiled step): one factor per row
        return factors[0] if len(set(padding)) == 1 else torch.stack(factors)
    return factors[0] if len(set(factors)) == 1 else factors


def _set_row_padding(state: dict, padding: list[int], device) -> None:
    """Each row's left padding, on the host and (for the decode step's per-row factors) on the device."""
    state["ahakv_row_padding"] = list(padding)
    if device is not None:
        state["ahakv_row_padding_device"] = torch.tensor(padding, dtype=torch.int64, device=device)


def _padding_device(state: dict):
    tensor = state.get("ahakv_row_padding_device")
    return None if tensor is None else tensor.device


def row_padding(scoring: ScoringInputs) -> list[int]:
    """Left-padding tokens of each row in a prefill: tokens no query of the prompt may attend."""
    if scoring.mask is None:
        return [0] * scoring.batch_size
    real = scoring.mask[:, 0].any(dim=-2).sum(dim=-1).tolist()
    return [scoring.num_tokens - r for r in real]


@dataclass(frozen=True)
class AhaKVConfig(PolicyConfig):
    """``recent`` = ``B_r`` (the rows of Eq. 5 and the recent budget), ``kernel`` = the value
    prior's mean filter (Eq. 13), ``gain_input`` = what SG-softmax's ``lambda`` multiplies
    (``"raw_qk"``: ``q.k``, Eq. 8-12; ``"scaled_qk"``: ``q.k / sqrt(d)``, Algorithm 1 line 6),
    ``decode_n`` = what ``n`` of Eq. 12 counts while decoding (``"seen"``: the row's tokens seen;
    ``"stored"``: the keys the new query attends, about ``b + 1``)."""

    recent: int = 32
    kernel: int = 7
    gain_input: GainInput = DEFAULT_GAIN_INPUT
    decode_n: DecodeN = DEFAULT_DECODE_N

    def validate(self) -> None:
        require_int_at_least(self.recent, 1, "recent")
        is_int = isinstance(self.kernel, int) and not isinstance(self.kernel, bool)
        require(
            is_int and self.kernel >= 1 and self.kernel % 2 == 1,
            "kernel",
            "an odd integer >= 1 (centred mean filter)",
            self.kernel,
        )
        require(self.gain_input in GAIN_INPUTS, "gain_input", f"one of {GAIN_INPUTS}", self.gain_input)
        require(self.decode_n in DECODE_N_READINGS, "decode_n", f"one of {DECODE_N_READINGS}", self.decode_n)


class AhaKV(ScorerPolicy):
    name = "ahakv"
    phases = frozenset({PREFILL, DECODE})
    static_decode = True  # evicts to exactly the budget each step (tests/cache/test_compiled_decode.py)
    reads_stored_order = False  # recency by position (ScoringInputs): evictions fill the freed slot
    config_class = AhaKVConfig
    paper = "Gu et al. 2025, Algorithm 1 (Eq. 5, 12, 13-15)"
    # The decode attention hands over the new query's logits, which SG-softmax rescales (Eq. 9, 12):
    # sdpa followed by a second q.K^T over every stored key read the keys twice per step.
    needs_decode_attention = True

    def minimum_budget(self) -> int:
        return self.config.recent

    def _check_budget(self, budget: int) -> None:
        if budget < self.config.recent:
            raise ValueError(
                f"invalid budget={budget}: AhaKV keeps the recent budget B_r (recent={self.config.recent}) "
                f"inside the budget, so it must be >= {self.config.recent}"
            )

    @staticmethod
    def _layer_budget(scoring: ScoringInputs, budget: int | None) -> int:
        """``k`` of Eq. 12: the layer budget the cache passes (without one, nothing is evicted,
        ``k = n`` and the step gain is 0)."""
        return budget if budget is not None else scoring.sequence_length

    # -- prefill ---------------------------------------------------------------------------------
    def initialize_decode(self, scoring: ScoringInputs, state: dict, budget: int | None = None) -> None:
        """``F_0 = S_hat`` over the prompt (Algorithm 1, line 19)."""
        budget = self._layer_budget(scoring, budget)
        scoring.token_scores[SCORE] = ahakv_scores(
            scoring, budget, self.config.recent, self.config.kernel, self.config.gain_input
        )
        state["ahakv_scored_with"] = budget
        padding = row_padding(scoring)  # n of Eq. 12 per row while decoding
        _set_row_padding(state, padding, scoring.keys.device)

    def score(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor:
        """``S_hat`` in prefill (line 12), the running ``F_t`` in decode (line 28)."""
        self._check_budget(budget)
        stale = scoring.phase == PREFILL and state.get("ahakv_scored_with") != budget
        if SCORE not in scoring.token_scores or stale:
            scoring.token_scores[SCORE] = ahakv_scores(
                scoring, budget, self.config.recent, self.config.kernel, self.config.gain_input
            )
            state["ahakv_scored_with"] = budget
        return scoring.token_scores[SCORE]

    def protected(self, scoring: ScoringInputs, budget: int) -> torch.Tensor:
        return scoring.recent_tokens(self.config.recent)

    # -- decode ----------------------------------------------------------------------------------
    def select_state_rows(self, state: dict, index: torch.Tensor, num_heads: int) -> dict:
        selected = dict(state)
        if "ahakv_row_padding" in state:
            padding = state["ahakv_row_padding"]
            _set_row_padding(selected, [padding[row] for row in index.tolist()], _padding_device(state))
        return selected

    def stack_states(self, states: list[dict], tokens_seen: list[int]) -> dict:
        """``n`` of Eq. 12 is each row's own tokens seen. A stacked layer's ``sequence_length`` is the
        most any row has seen, so a row that has seen fewer counts the difference as padding (both
        advance by one token per step: the difference stays). A row of a stacked cache (joining
        another batch) already counts its difference to that cache's count ``tokens_seen[i]``: it
        gains the difference between that count and the new maximum."""
        scored_with = {state.get("ahakv_scored_with") for state in states}
        if len(scored_with) > 1:
            raise ValueError(
                f"method {self.name!r}: the caches were scored with different budgets {sorted(scored_with)}"
            )
        stacked = dict(states[0])
        if any("ahakv_row_padding" in state for state in states):
            most = max(tokens_seen)
            padding = [
                most - seen + pad
                for state, seen in zip(states, tokens_seen, strict=True)
                for pad in state.get("ahakv_row_padding", [0])
            ]
            device = next((_padding_device(state) for state in states if "ahakv_row_padding" in state), None)
            _set_row_padding(stacked, padding, device)
        return stacked

    def observe_decode(self, scoring: ScoringInputs, state: dict, budget: int | None = None) -> None:
        """``F_t = SG-softmax(A_t) + F_{t-1}`` over the stored keys (line 27)."""
        budget = self._layer_budget(scoring, budget)
        if self.config.decode_n == "stored":
            # n = the real keys each row's softmax runs over (stored heads hold equal counts while decoding)
            factors = tuple(
                sg_logit_multiplier(int(count), budget, scoring.keys.shape[-1], scoring.scaling, self.config.gain_input)
                for count in scoring.valid[:, 0].sum(dim=-1).tolist()
            )
            gain = factors[0] if len(set(factors)) == 1 else factors
        else:
            # Each row's n excludes its prompt padding (recorded at prefill: padding may be evicted since).
            padding = state.get("ahakv_row_padding")
            if padding is not None and len(padding) > 1 and "ahakv_row_padding_device" in state:
                # Several rows (whose n may differ: a padded batch, stacked rows): each row's factor
                # computed on the device from its padding there, with no per-step host-to-device copy
                # of factors, and no guard on the padding's values (rows joining fixed slots change them).
                seen = scoring.sequence_length - state["ahakv_row_padding_device"]
                gain = sg_logit_multiplier(
                    seen, budget, scoring.keys.shape[-1], scoring.scaling, self.config.gain_input
                )
            else:
                gain = _scoring_multiplier(scoring, budget, self.config.gain_input, padding)
        # Every query of this forward pass: one while generating (its weights from the attention's
        # own logits), a whole chunk in a chunked prefill.
        if scoring.num_queries == 1:
            new_rows = scoring.last_query_attention(gain)
        else:
            new_rows = scoring.recent_accumulated_attention(scoring.num_queries, logit_multiplier=gain)
        running = scoring.token_scores[SCORE]
        running += scoring.to_kv_heads(new_rows).to(running.dtype)
