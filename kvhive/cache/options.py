"""A cache's options: what a user may choose beside the method and the budget, checked once.

:class:`CacheOptions` holds them (frozen; the checks run when it is made, each naming the parameter
it refuses); :meth:`CacheOptions.check_for` adds the checks that depend on the method.
:func:`check_question_tokens` is shared with the evaluation harness, which refuses a bad
``question_tokens`` before it loads a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from kvhive.cache.budget import Budget
from kvhive.cache.traits import MethodTraits
from kvhive.methods.base import DECODE, PREFILL, Policy, require_choice

Positions = Literal["original", "cache"]
"""Keys keep their true positions (``"original"``) or are re-indexed to contiguous ones (``"cache"``)."""
ORIGINAL_POSITIONS: Final[Positions] = "original"
CACHE_POSITIONS: Final[Positions] = "cache"
DenseDecode = Literal["auto", "sdpa", "kernel"]
"""Attention of a decode step over equal-length heads on CUDA: sdpa, kvhive's split-K kernel, or
``"auto"``: the kernel over a fixed capacity (where sdpa would need a mask over the empty slots,
which takes it off flash-decoding's split-K path), sdpa over a growing layer's unmasked slice."""


class BudgetNotKeptWarning(UserWarning):
    """A cache holds more than its budget because its method cannot compress in this phase
    (a prefill-only method fed token by token, or decoding past a prompt that fit the budget)."""


def _is_count(value, minimum: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= minimum


@dataclass(frozen=True)
class CacheOptions:
    """The options of a :class:`~kvhive.cache.kv_cache.KVHiveCache` (its docstring says what each
    does). ``budget`` may be given as an int or a float; it is held as a :class:`Budget`."""

    budget: Budget
    compress_sliding: bool = False
    decode_every: int = 1
    decode_slack: int = 0
    record_prefill: bool = False
    positions: Positions = ORIGINAL_POSITIONS
    dense_decode: DenseDecode = "auto"
    prefill_chunk: int | None = None
    decode_capacity: int | None = None
    question_tokens: int | None = None

    def __post_init__(self) -> None:
        budget = self.budget
        if not isinstance(budget, (Budget, bool, str)):
            budget = Budget.parse(budget)  # ints and floats, numpy's included
            object.__setattr__(self, "budget", budget)
        if not isinstance(budget, Budget):
            raise ValueError(f"invalid budget={budget!r}: expected an int >= 1 or a ratio in (0, 1]")
        if not _is_count(self.decode_every, 1):
            raise ValueError(f"invalid decode_every={self.decode_every!r}: expected an integer >= 1")
        if not _is_count(self.decode_slack, 0):
            raise ValueError(f"invalid decode_slack={self.decode_slack!r}: expected an integer >= 0")
        if not isinstance(self.compress_sliding, bool):
            raise ValueError(f"invalid compress_sliding={self.compress_sliding!r}: expected True or False")
        if not isinstance(self.record_prefill, bool):
            raise ValueError(f"invalid record_prefill={self.record_prefill!r}: expected True or False")
        require_choice(self.positions, "positions", Positions)
        require_choice(self.dense_decode, "dense_decode", DenseDecode)
        chunk, capacity = self.prefill_chunk, self.decode_capacity
        if chunk is not None and not _is_count(chunk, 1):
            raise ValueError(f"invalid prefill_chunk={chunk!r}: expected an integer >= 1 (tokens), or None")
        if capacity is not None and not _is_count(capacity, 1):
            raise ValueError(f"invalid decode_capacity={capacity!r}: expected an integer >= 1 (tokens), or None")
        if capacity is not None and chunk is not None:
            raise ValueError("decode_capacity (a compiled decode) and prefill_chunk cannot be combined yet")
        if chunk is not None and self.positions == CACHE_POSITIONS:
            raise ValueError("prefill_chunk is not supported with positions='cache' (stream token by token instead)")

    def check_for(self, policy: Policy, traits: MethodTraits, key_rotator) -> None:
        """Refuse options that ``policy`` cannot run with (the checks that need the method)."""
        check_question_tokens(self.question_tokens, self.prefill_chunk, policy)
        if self.positions == CACHE_POSITIONS and key_rotator is None:
            raise ValueError("positions='cache' needs a key_rotator (use kvhive.make_cache)")
        if self.positions == CACHE_POSITIONS and traits.attends_outside_cache:
            raise ValueError(
                f"positions='cache' is not supported by method {policy.name!r}: its estimator "
                "keeps keys outside the cache that cannot be re-indexed"
            )


def check_question_tokens(question_tokens, prefill_chunk, policy: Policy) -> None:
    """Refuse a question-aware chunked prefill that cannot run, naming the parameter."""
    if question_tokens is None:
        return
    if isinstance(question_tokens, bool) or not isinstance(question_tokens, int) or question_tokens < 1:
        raise ValueError(
            f"invalid question_tokens={question_tokens!r}: expected an integer >= 1 (the prompt's last tokens that are "
            "its question), or None"
        )
    if prefill_chunk is None:
        raise ValueError(
            f"question_tokens={question_tokens} needs prefill_chunk (the question is appended to each chunk of a "
            "chunked prefill); without chunks the prompt's own last queries are the question already"
        )
    if DECODE in policy.phases or PREFILL not in policy.phases:
        raise ValueError(
            f"question_tokens is for methods that compress only the prompt (e.g. snapkv, pyramidkv): method "
            f"{policy.name!r} "
            + ("evicts by its decode rule after each chunk" if DECODE in policy.phases else "never evicts")
            + "; give question_tokens=None for it"
        )
