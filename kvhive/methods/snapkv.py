"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation").

Scores: attention of the last ``window`` prompt queries (the observation window) to each
earlier key, summed over the window (Sec. 4.2, Listing 1), 1-D max pooling with ``kernel``
(docs/METHODS.md follows the Ada-KV paper: max pooling), averaged over the query heads of a KV
group (``group_pooling="pool_then_mean"``, as kvpress; the Ada-KV authors average the group
first, ``"mean_then_pool"``). Keep the top ``budget - window`` keys plus the window itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

import torch
import torch.nn.functional as F

from kvhive.methods.base import (
    PREFILL,
    PolicyConfig,
    ScorerPolicy,
    ScoringInputs,
    recent_mask,
    require,
    require_choice,
    require_int_at_least,
)

Pooling = Literal["max", "avg"]
GroupPooling = Literal["pool_then_mean", "mean_then_pool"]
"""GQA: pool each query head's scores then average over the group (kvpress, kvhive's SnapKV), or
average the group's weights first and pool once (the Ada-KV authors' ``gqa_support``)."""
POOL_THEN_MEAN: Final[GroupPooling] = "pool_then_mean"
MEAN_THEN_POOL: Final[GroupPooling] = "mean_then_pool"


@dataclass(frozen=True)
class SnapKVConfig(PolicyConfig):
    window: int = 32
    kernel: int = 7
    pooling: Pooling = "max"
    group_pooling: GroupPooling = POOL_THEN_MEAN

    def validate(self) -> None:
        require_int_at_least(self.window, 1, "window")
        is_int = isinstance(self.kernel, int) and not isinstance(self.kernel, bool)
        require(
            is_int and self.kernel >= 1 and self.kernel % 2 == 1,
            "kernel",
            "an odd integer >= 1 (centred pooling)",
            self.kernel,
        )
        require_choice(self.pooling, "pooling", Pooling)
        require_choice(self.group_pooling, "group_pooling", GroupPooling)


def observation_scores(
    scoring: ScoringInputs, window: int, kernel: int, pooling: Pooling, group_pooling: GroupPooling = POOL_THEN_MEAN
) -> torch.Tensor:
    """Pooled observation-window scores ``[B, H, N]`` per stored head; the window itself is
    excluded from the pooling input (it is always kept)."""
    weights = scoring.observation_attention(window).sum(dim=2)
    if group_pooling == MEAN_THEN_POOL:
        weights = scoring.to_kv_heads(weights)
    num_prefix = max(0, scoring.num_tokens - window)
    prefix = weights[..., :num_prefix]
    if kernel > 1 and num_prefix > 0:
        b, hq, n = prefix.shape
        flat = prefix.reshape(b * hq, 1, n)
        if pooling == "max":
            flat = F.max_pool1d(flat, kernel_size=kernel, stride=1, padding=kernel // 2)
        else:
            flat = F.avg_pool1d(
                flat, kernel_size=kernel, stride=1, padding=kernel // 2
            )  # zero padding counts, as in the SnapKV reference code
        prefix = flat.reshape(b, hq, n)
    pooled = torch.cat([prefix, weights[..., num_prefix:]], dim=-1)
    return pooled if group_pooling == MEAN_THEN_POOL else scoring.to_kv_heads(pooled)


class SnapKV(ScorerPolicy):
    name = "snapkv"
    phases = frozenset({PREFILL})
    config_class = SnapKVConfig
    paper = "Li et al. 2024, Sec. 4 and Listing 1"

    def minimum_budget(self) -> int:
        return self.config.window

    def score(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor:
        config = self.config
        return observation_scores(scoring, config.window, config.kernel, config.pooling, config.group_pooling)

    def protected(self, scoring: ScoringInputs, budget: int) -> torch.Tensor:
        return recent_mask(scoring.num_tokens, self.config.window, scoring.valid)
