"""TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs"), Token Omission Via Attention.

Sec. 3.3 ("Our proposed policy: TOVA"): at every decoding step, once the multi-state (the cache)
is full, drop the token whose attention from the *current* query is lowest. The scores are the
newest query's softmax weights averaged over **all** heads of the layer (docs/METHODS.md), so a layer
keeps one set shared by every head (with GQA the average runs over all query heads). No running
sum: only the current query's attention counts.

Prefill: keep the top ``budget`` tokens by the last prompt query's attention (averaged the same
way). Padding (``valid`` False) is never kept while real tokens remain.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvhive.methods.base import DECODE, PREFILL, PolicyConfig, ScorerPolicy, ScoringInputs


@dataclass(frozen=True)
class TOVAConfig(PolicyConfig):
    pass


def layer_scores(scoring: ScoringInputs) -> torch.Tensor:
    """``[B, H, N]``: the newest query's attention averaged over every query head, one row per
    batch element broadcast to every stored head (one kept set per layer)."""
    averaged = scoring.last_query_attention().float().mean(dim=1, keepdim=True)
    return averaged.expand(scoring.token_shape)  # [B, H, N]


class TOVA(ScorerPolicy):
    name = "tova"
    phases = frozenset({PREFILL, DECODE})
    static_decode = True  # evicts to exactly the budget each step (tests/cache/test_compiled_decode.py)
    reads_stored_order = False  # recency by position (ScoringInputs): evictions fill the freed slot
    config_class = TOVAConfig
    paper = "Oren et al. 2024, Sec. 3.3 (TOVA: drop the lowest current-query attention, averaged over heads)"
    needs_decode_attention = True

    def score(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor:
        return layer_scores(scoring)
