"""Value norm (``vnorm``): a kvhive example of a score-based method, not a paper method.

Keeps, per stored head, the tokens whose values have the largest L2 norm ``||v_j||_2`` (a token
with a small value moves the attention output little whatever its weight), plus the most recent
``window`` tokens. It shows what a new scorer needs: a config, ``score()`` and ``protected()``;
selection in both phases, padding handling and Ada-KV (``ada-vnorm``) come from the base.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvhive.methods import base


@dataclass(frozen=True)
class ValueNormConfig(base.PolicyConfig):
    window: int = 8  # recent tokens always kept

    def validate(self) -> None:
        base.require_int_at_least(self.window, 0, "window")


class ValueNorm(base.ScorerPolicy):
    name = "vnorm"
    phases = frozenset({base.PREFILL, base.DECODE})
    static_decode = True  # evicts to exactly the budget each step (tests/cache/test_compiled_decode.py)
    config_class = ValueNormConfig
    paper = "kvhive example scorer, not a paper method: keep the largest value norms plus a recent window"

    def minimum_budget(self) -> int:
        return self.config.window + 1

    def score(self, scoring: base.ScoringInputs, budget: int, state: dict) -> torch.Tensor:
        return torch.linalg.vector_norm(scoring.values.float(), dim=-1)

    def protected(self, scoring: base.ScoringInputs, budget: int) -> torch.Tensor:
        return base.recent_mask(scoring.num_tokens, self.config.window, scoring.valid)
