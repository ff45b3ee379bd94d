"""Local: keep the most recent ``budget`` tokens (the sliding-window baseline of every paper)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvhive.methods.base import DECODE, PREFILL, PolicyConfig, ScorerPolicy, ScoringInputs


@dataclass(frozen=True)
class LocalConfig(PolicyConfig):
    pass


class Local(ScorerPolicy):
    name = "local"
    phases = frozenset({PREFILL, DECODE})
    static_decode = True  # evicts to exactly the budget each step (tests/cache/test_compiled_decode.py)
    reads_stored_order = False  # recency by position (ScoringInputs): evictions fill the freed slot
    config_class = LocalConfig
    paper = "baseline: window attention (StreamingLLM, Xiao et al. 2023, Fig. 1b)"

    def score(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor:
        return scoring.recency_scores()
