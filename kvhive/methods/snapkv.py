"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation").

Scores: attention of the last ``window`` prompt queries (the observation window) to each
earlier key, summed over the window (Sec. 4.2, Listing 1), 1-D max pooling with ``kernel``
(METHODS.md follows the Ada-KV paper: max pooling), averaged over the query heads of a KV
group. Keep the top ``budget - window`` keys plus the window itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvhive.methods.base import (PREFILL, Policy, PolicyConfig, ScoringInputs, keep_top_scores, recent_mask,
                                 require, require_int_at_least)


@dataclass(frozen=True)
class SnapKVConfig(PolicyConfig):
    window: int = 32
    kernel: int = 7
    pooling: str = "max"

    def validate(self) -> None:
        require_int_at_least(self.window, 1, "window")
        require_int_at_least(self.kernel, 1, "kernel")
        require(self.kernel % 2 == 1, "kernel", "an odd integer (centred pooling)", self.kernel)
        require(self.pooling in ("max", "avg"), "pooling", "'max' or 'avg'", self.pooling)


def observation_scores(scoring: ScoringInputs, window: int, kernel: int, pooling: str) -> torch.Tensor:
    """Pooled observation-window scores per query head ``[B, Hq, N]``; the window itself is
    excluded from the pooling input (it is always kept)."""
    weights = scoring.observation_attention(window).sum(dim=2)
    num_prefix = max(0, scoring.num_tokens - window)
    prefix = weights[..., :num_prefix]
    if kernel > 1 and num_prefix > 0:
        b, hq, n = prefix.shape
        flat = prefix.reshape(b * hq, 1, n)
        if pooling == "max":
            flat = F.max_pool1d(flat, kernel_size=kernel, stride=1, padding=kernel // 2)
        else:
            flat = F.avg_pool1d(flat, kernel_size=kernel, stride=1, padding=kernel // 2)  # zero padding counts, as in the SnapKV reference code
        prefix = flat.reshape(b, hq, n)
    return torch.cat([prefix, weights[..., num_prefix:]], dim=-1)


class SnapKV(Policy):
    name = "snapkv"
    phases = frozenset({PREFILL})
    config_class = SnapKVConfig
    paper = "Li et al. 2024, Sec. 4 and Listing 1"

    def minimum_budget(self) -> int:
        return self.config.window

    def select_prefill(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor:
        config = self.config
        scores = scoring.to_kv_heads(observation_scores(scoring, config.window, config.kernel, config.pooling))
        window = recent_mask(scoring.num_tokens, config.window, scores)
        return keep_top_scores(scores, budget, scoring.valid, forced=window)
