"""Random+Local: the random-eviction baseline with a recent window (docs/METHODS.md baselines).

Of a budget ``b``, the most recent ``b - floor(b * (1 - recent_fraction))`` tokens are kept
(``recent_fraction=0.5``: half the budget), the rest is a uniformly random subset of the older
real tokens, independently per (batch row, head).

Randomness is seeded and reproducible: every token gets one i.i.d. priority ``u ~ U(0, 1]`` when
it enters the cache (``state["token_scores"]["random_priority"]``, kept aligned by the cache),
computed on the device by a counter-based hash of ``(seed, layer, head, the token's index among its
row's real tokens)`` (:mod:`kvhive.methods.counter_random`): no generator state, no host read, and a
row of a padded batch draws exactly what it would draw alone; the kept older tokens are the ones
with the highest priorities. Keeping the top-``r`` priorities of a stream is
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
    require_probability,
    require_seed,
)
from kvhive.methods.counter_random import fold, hashed_words, uniforms_of

PRIORITY = "random_priority"
# [B, H] original position of each row's first real token: a token's draw is indexed by its
# position minus this, i.e. its index among the row's real tokens (what the row would have alone).
FIRST_REAL_POSITION = "random_first_real_position"
HEAD_WORDS = "random_head_words"  # [1, H, 1] hash of (seed, layer, head)


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
    static_decode = True  # evicts to exactly the budget each step (tests/cache/test_compiled_decode.py)
    reads_stored_order = False  # recency by position (ScoringInputs): evictions fill the freed slot
    paper = "baseline: random eviction + recent window (Random+Local)"

    def recent_count(self, budget: int) -> int:
        return budget - int(budget * (1.0 - self.config.recent_fraction))

    def _first_real_position(self, scoring: ScoringInputs, state: dict) -> torch.Tensor:
        """``[B, H]`` position of each row's first real token, recorded at the layer's first call
        (nothing is evicted before it, so the row's padding is still there to be skipped)."""
        if FIRST_REAL_POSITION not in state:
            valid = scoring.valid.expand(scoring.batch_size, scoring.num_heads, scoring.num_tokens)
            positions = scoring.positions.to(torch.int64)
            beyond = torch.iinfo(torch.int64).max
            state[FIRST_REAL_POSITION] = torch.where(valid, positions, beyond).amin(-1)
        return state[FIRST_REAL_POSITION]

    def _head_words(self, scoring: ScoringInputs, state: dict) -> torch.Tensor:
        """``[1, H, 1]`` the hash of (seed, layer, head), once per layer: a draw folds in one index."""
        if HEAD_WORDS not in state:
            head = torch.arange(scoring.num_heads, device=scoring.keys.device)[None, :, None]
            state[HEAD_WORDS] = hashed_words(derived_seed(self.config.seed, scoring.layer_index), head)
        return state[HEAD_WORDS]

    def _priorities(self, scoring: ScoringInputs, state: dict) -> torch.Tensor:
        """Priorities for every stored token (once per forward of a layer: ``observe_decode`` and the
        decision after it read the same ones; a decode step hashed twice before)."""
        return scoring.once(PRIORITY, lambda: self._draw(scoring, state))

    def _draw(self, scoring: ScoringInputs, state: dict) -> torch.Tensor:
        """Priorities for every stored token; real tokens not drawn yet (0) draw now. Padding gets
        1 once (never ranked: padding is never kept first).

        The cache calls a hook of this method at every forward of the layer (``initialize_decode``
        at prefill, ``observe_decode`` at every decode step), so once the priorities exist only the
        tokens of the current forward (the last ``q`` columns) can be new: only they are hashed,
        and the fresh ones among them taken (a fixed amount of work, no host read)."""
        priorities = scoring.token_scores.get(PRIORITY)
        if priorities is None:
            valid = scoring.valid.expand(scoring.batch_size, scoring.num_heads, scoring.num_tokens)
            priorities = (~valid).to(torch.float32)
            new_slots = torch.arange(scoring.num_tokens, device=priorities.device)
        elif scoring.filled is not None:
            # A layer filling a fixed capacity: the new token sits at the filled length, not at
            # the end (the slots past it are empty), a device index.
            # (Stacked rows of different lengths: [B, 1, 1], each row's own.)
            new_slots = scoring.filled - 1 if scoring.filled.dim() == 3 else (scoring.filled - 1).reshape(1)
        else:
            # Made on the device: a host arange copied over is a copy a CUDA graph cannot capture
            # (and a synchronisation in an eager step).
            first_new = max(0, scoring.num_tokens - scoring.num_queries)
            new_slots = torch.arange(first_new, scoring.num_tokens, device=priorities.device)
        slots = new_slots.expand(scoring.batch_size, scoring.num_heads, -1)
        first = self._first_real_position(scoring, state)
        index = scoring.positions.gather(-1, slots).to(torch.int64) - first[..., None]
        # in (0, 1]: 0 marks "not drawn yet"
        drawn = 1.0 - uniforms_of(fold(self._head_words(scoring, state), index))
        current = priorities.gather(-1, slots)
        priorities = priorities.scatter(-1, slots, torch.where(current == 0, drawn, current))
        scoring.token_scores[PRIORITY] = priorities
        return priorities

    def initialize_decode(self, scoring: ScoringInputs, state: dict, budget: int | None = None) -> None:
        self._priorities(scoring, state)

    def observe_decode(self, scoring: ScoringInputs, state: dict, budget: int | None = None) -> None:
        self._priorities(scoring, state)

    def score(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor:
        return self._priorities(scoring, state)

    def protected(self, scoring: ScoringInputs, budget: int) -> torch.Tensor:
        return scoring.recent_tokens(self.recent_count(budget))

    def select_state_rows(self, state: dict, index: torch.Tensor, num_heads: int) -> dict:
        # The first real position is per row; the head hash [1, H, 1] is shared by every row.
        selected = dict(state)
        if FIRST_REAL_POSITION in state:
            first = state[FIRST_REAL_POSITION]
            selected[FIRST_REAL_POSITION] = first.index_select(0, index.to(first.device))
        return selected

    def stack_states(self, states: list[dict], tokens_seen: list[int]) -> dict:
        stacked = dict(states[0])
        if any(FIRST_REAL_POSITION in state for state in states):
            stacked[FIRST_REAL_POSITION] = torch.cat([state[FIRST_REAL_POSITION] for state in states])
        return stacked
