"""Random+Local: the random-eviction baseline with a recent window (docs/METHODS.md baselines).

Of a budget ``b``, the most recent ``b - floor(b * (1 - recent_fraction))`` tokens are kept
(``recent_fraction=0.5``: half the budget), the rest is a uniformly random subset of the older
real tokens, independently per (batch row, head).

Randomness is seeded and reproducible: every token gets one i.i.d. priority ``u ~ U(0, 1]`` when
it enters the cache (``state["token_scores"]["random_priority"]``, kept aligned by the cache),
drawn from a ``torch.Generator`` per layer and batch row seeded with ``(seed, layer)`` (so a row of a
padded batch draws exactly what it would draw alone: its real tokens in order); the kept older tokens
are the ones with the highest priorities. Keeping the top-``r`` priorities of a stream is
priority (bottom-k) sampling, so in decoding too the kept older tokens are at every step a
uniform random ``r``-subset of all older tokens seen so far (not biased towards recent ones as
"evict a random token each step" would be). Padding is never kept while real tokens remain.
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
    derived_seed,
    recent_mask,
    require_probability,
    require_seed,
)

PRIORITY = "random_priority"
GENERATOR = "random_generator"


@dataclass(frozen=True)
class RandomLocalConfig(PolicyConfig):
    recent_fraction: float = 0.5
    seed: int = 0

    def validate(self) -> None:
        require_probability(self.recent_fraction, "recent_fraction")
        require_seed(self.seed)


class RandomLocal(ScorerPolicy):
    name = "random"
    phases = frozenset({PREFILL, DECODE})
    config_class = RandomLocalConfig
    paper = "baseline: random eviction + recent window (Random+Local)"

    def recent_count(self, budget: int) -> int:
        return budget - int(budget * (1.0 - self.config.recent_fraction))

    def _generators(self, scoring: ScoringInputs, state: dict) -> list[torch.Generator]:
        """One generator per batch row, each seeded with ``(seed, layer)``: a row draws what it
        would draw alone, whatever the rest of the batch."""
        if GENERATOR not in state:
            seed = derived_seed(self.config.seed, scoring.layer_index)
            state[GENERATOR] = [torch.Generator(device="cpu").manual_seed(seed) for _ in range(scoring.batch_size)]
        return state[GENERATOR]

    def _priorities(self, scoring: ScoringInputs, state: dict) -> torch.Tensor:
        """Priorities for every stored token; real tokens not drawn yet (0) draw now, per row in
        (head, token) order. Padding gets 1 once (never ranked: padding is never kept first)."""
        priorities = scoring.token_scores.get(PRIORITY)
        if priorities is None:
            valid = scoring.valid.expand(scoring.batch_size, scoring.num_heads, scoring.num_tokens)
            priorities = (~valid).to(torch.float32)
        fresh = priorities == 0
        counts = fresh.sum(dim=(1, 2)).tolist()
        if any(counts):
            priorities = priorities.clone()
            for row, (generator, count) in enumerate(zip(self._generators(scoring, state), counts, strict=True)):
                if count:
                    uniform = torch.rand((count,), generator=generator, dtype=torch.float32)
                    # in (0, 1]: 0 marks "not drawn yet"
                    priorities[row][fresh[row]] = (1.0 - uniform).to(priorities.device)
        scoring.token_scores[PRIORITY] = priorities
        return priorities

    def initialize_decode(self, scoring: ScoringInputs, state: dict, budget: int | None = None) -> None:
        self._priorities(scoring, state)

    def observe_decode(self, scoring: ScoringInputs, state: dict, budget: int | None = None) -> None:
        self._priorities(scoring, state)

    def score(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor:
        return self._priorities(scoring, state)

    def protected(self, scoring: ScoringInputs, budget: int) -> torch.Tensor:
        return recent_mask(scoring.num_tokens, self.recent_count(budget), scoring.valid)
