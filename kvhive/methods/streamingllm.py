"""StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language Models with Attention Sinks"):
keep the first ``sink`` tokens (attention sinks) and the most recent ``budget - sink``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvhive.methods.base import (
    DECODE,
    PREFILL,
    PolicyConfig,
    ScorerPolicy,
    ScoringInputs,
    require_int_at_least,
)


@dataclass(frozen=True)
class StreamingLLMConfig(PolicyConfig):
    sink: int = 4

    def validate(self) -> None:
        require_int_at_least(self.sink, 0, "sink")


class StreamingLLM(ScorerPolicy):
    name = "streamingllm"
    phases = frozenset({PREFILL, DECODE})
    static_decode = True  # evicts to exactly the budget each step (tests/cache/test_compiled_decode.py)
    reads_stored_order = False  # recency by position (ScoringInputs): evictions fill the freed slot
    config_class = StreamingLLMConfig
    paper = "Xiao et al. 2023, Sec. 3.2 (rolling KV cache with attention sinks)"

    def minimum_budget(self) -> int:
        return self.config.sink + 1

    def score(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor:
        return scoring.recency_scores()

    def protected(self, scoring: ScoringInputs, budget: int) -> torch.Tensor:
        return scoring.first_real(self.config.sink)
