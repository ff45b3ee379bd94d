"""Random+Local: the random-eviction baseline with a recent window (METHODS.md baselines).

Of a budget ``b``, the most recent ``b - floor(b * (1 - recent_fraction))`` tokens are kept
(``recent_fraction=0.5``: half the budget), the rest is a uniformly random subset of the older
real tokens, independently per (batch row, head).

Randomness is seeded and reproducible: every token gets one i.i.d. priority ``u ~ U(0, 1]`` when
it enters the cache (``state["token_scores"]["random_priority"]``, kept aligned by the cache),
drawn from a per-layer ``torch.Generator`` seeded with ``(seed, layer)``; the kept older tokens
are the ones with the highest priorities. Keeping the top-``r`` priorities of a stream is
priority (bottom-k) sampling, so in decoding too the kept older tokens are at every step a
uniform random ``r``-subset of all older tokens seen so far (not biased towards recent ones as
"evict a random token each step" would be). Padding is never kept while real tokens remain.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvhive.methods.base import (DECODE, PREFILL, PolicyConfig, ScorerPolicy, ScoringInputs, recent_mask, require,
                                 require_int_at_least, require_probability)

PRIORITY = "random_priority"
GENERATOR = "random_generator"


@dataclass(frozen=True)
class RandomLocalConfig(PolicyConfig):
    recent_fraction: float = 0.5
    seed: int = 0

    def validate(self) -> None:
        require_probability(self.recent_fraction, "recent_fraction")
        require_int_at_least(self.seed, 0, "seed")
        require(self.seed < 2**63, "seed", "an integer in [0, 2**63)", self.seed)


class RandomLocal(ScorerPolicy):
    name = "random"
    phases = frozenset({PREFILL, DECODE})
    config_class = RandomLocalConfig
    paper = "baseline: random eviction + recent window (Random+Local)"

    def recent_count(self, budget: int) -> int:
        return budget - int(budget * (1.0 - self.config.recent_fraction))

    def _generator(self, scoring: ScoringInputs, state: dict) -> torch.Generator:
        if GENERATOR not in state:
            seed = (self.config.seed * 1_000_003 + scoring.layer_index) % 2**63
            state[GENERATOR] = torch.Generator(device="cpu").manual_seed(seed)
        return state[GENERATOR]

    def _draw(self, shape, scoring: ScoringInputs, state: dict) -> torch.Tensor:
        uniform = torch.rand(shape, generator=self._generator(scoring, state), dtype=torch.float32)
        return (1.0 - uniform).to(scoring.keys.device)  # in (0, 1]: 0 marks "not drawn yet"

    def _priorities(self, scoring: ScoringInputs, state: dict) -> torch.Tensor:
        """Priorities for every stored token; tokens the cache appended since (filled with 0) draw now."""
        shape = (scoring.batch_size, scoring.num_heads, scoring.num_tokens)
        priorities = scoring.token_scores.get(PRIORITY)
        if priorities is None:
            priorities = self._draw(shape, scoring, state)
        else:
            fresh = priorities == 0
            count = int(fresh.sum())
            if count:
                priorities = priorities.clone()
                priorities[fresh] = self._draw((count,), scoring, state)
        scoring.token_scores[PRIORITY] = priorities
        return priorities

    def initialize_decode(self, scoring: ScoringInputs, state: dict) -> None:
        self._priorities(scoring, state)

    def observe_decode(self, scoring: ScoringInputs, state: dict) -> None:
        self._priorities(scoring, state)

    def score(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor:
        return self._priorities(scoring, state)

    def protected(self, scoring: ScoringInputs, budget: int) -> torch.Tensor:
        return recent_mask(scoring.num_tokens, self.recent_count(budget), scoring.valid)
