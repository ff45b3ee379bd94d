"""H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference").

Accumulated attention (the column sums of the attention matrix, Sec. 3 / Algorithm 1) ranks
keys; keep the top ``heavy_fraction`` of the budget by score plus the most recent rest
(docs/METHODS.md: 50/50 as in H2O). While decoding, each new query's attention is added to the
running scores and the lowest-score key outside the recent part is evicted (Algorithm 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvhive.methods.base import (
    DECODE,
    PREFILL,
    PolicyConfig,
    ScorerPolicy,
    ScoringInputs,
    require_probability,
)

SCORE = "h2o_accumulated"


@dataclass(frozen=True)
class H2OConfig(PolicyConfig):
    heavy_fraction: float = 0.5

    def validate(self) -> None:
        require_probability(self.heavy_fraction, "heavy_fraction")


class H2O(ScorerPolicy):
    name = "h2o"
    phases = frozenset({PREFILL, DECODE})
    static_decode = True  # evicts to exactly the budget each step (tests/cache/test_compiled_decode.py)
    reads_stored_order = False  # recency by position (ScoringInputs): evictions fill the freed slot
    config_class = H2OConfig
    paper = "Zhang et al. 2023, Algorithm 1 (heavy hitters + recent)"
    needs_decode_attention = True
    prefill_column_sums = True  # accumulated attention of the prompt, with the attention's output
    chunk_column_sums = True  # and of each later prompt chunk (observe_decode adds the chunk's sums)

    def _recent_count(self, budget: int) -> int:
        return budget - int(budget * self.config.heavy_fraction)

    def initialize_decode(self, scoring: ScoringInputs, state: dict, budget: int | None = None) -> None:
        scoring.token_scores[SCORE] = scoring.to_kv_heads(scoring.accumulated_attention())

    def observe_decode(self, scoring: ScoringInputs, state: dict, budget: int | None = None) -> None:
        # Every new query adds its weights: one while generating, a whole chunk in a chunked prefill.
        scores = scoring.token_scores[SCORE]
        new_queries = scoring.last_query_attention() if scoring.num_queries == 1 else scoring.accumulated_attention()
        scores += scoring.to_kv_heads(new_queries).to(scores.dtype)

    def score(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor:
        if SCORE not in scoring.token_scores:  # prefill-only use (e.g. under Ada-KV): the prompt's sums
            self.initialize_decode(scoring, state)
        return scoring.token_scores[SCORE]

    def protected(self, scoring: ScoringInputs, budget: int) -> torch.Tensor:
        return scoring.recent_tokens(self._recent_count(budget))
