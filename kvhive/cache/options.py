"""A cache's options: what a user may choose beside the method and the budget, checked once.

:class:`CacheOptions` holds them (frozen; the checks run when it is made, each naming the parameter
it refuses); :meth:`CacheOptions.check_for` adds the checks that depend on the method.
:func:`check_question_tokens` is shared with the evaluation harness, which refuses a bad
``question_tokens`` before it loads a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal, get_args

from kvhive.cache.budget import Budget
from kvhive.cache.traits import MethodTraits
from kvhive.methods.base import DECODE, PREFILL, Policy
from kvhive.methods.contract import require

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


def _choice(options) -> tuple:
    """A rule's check and expected values for a choice among the ``Literal`` ``options``."""
    accepted = get_args(options)
    return (lambda value: value in accepted), " or ".join(repr(option) for option in accepted)


# The value each option takes, one row per option, checked in this order: (option, accepts the
# value, what is expected).
_VALUE_RULES = (
    ("decode_every", lambda value: _is_count(value, 1), "an integer >= 1"),
    ("decode_slack", lambda value: _is_count(value, 0), "an integer >= 0"),
    ("compress_sliding", lambda value: isinstance(value, bool), "True or False"),
    ("record_prefill", lambda value: isinstance(value, bool), "True or False"),
    ("positions", *_choice(Positions)),
    ("dense_decode", *_choice(DenseDecode)),
    ("prefill_chunk", lambda value: value is None or _is_count(value, 1), "an integer >= 1 (tokens), or None"),
    ("decode_capacity", lambda value: value is None or _is_count(value, 1), "an integer >= 1 (tokens), or None"),
)

# Options that cannot be combined: (option, value, other option, its value, why). ``_GIVEN`` stands
# for any value but None.
_GIVEN: Final = object()
_EXCLUSIVE_OPTIONS = (
    (
        "decode_capacity",
        _GIVEN,
        "prefill_chunk",
        _GIVEN,
        "decode_capacity (a compiled decode) and prefill_chunk cannot be combined yet",
    ),
    (
        "prefill_chunk",
        _GIVEN,
        "positions",
        CACHE_POSITIONS,
        "prefill_chunk is not supported with positions='cache' (stream token by token instead)",
    ),
)


def _takes(value, wanted) -> bool:
    return value is not None if wanted is _GIVEN else value == wanted


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
        for option, accepts, expected in _VALUE_RULES:
            value = getattr(self, option)
            require(accepts(value), option, expected, value)
        for option, value, other, other_value, why in _EXCLUSIVE_OPTIONS:
            if _takes(getattr(self, option), value) and _takes(getattr(self, other), other_value):
                raise ValueError(why)

    def check_for(self, policy: Policy, traits: MethodTraits, key_rotator) -> None:
        """Refuse options that ``policy`` cannot run with (the checks that need the method)."""
        check_question_tokens(self.question_tokens, self.prefill_chunk, policy)
        if self.positions != CACHE_POSITIONS:
            return
        if key_rotator is None:
            raise ValueError("positions='cache' needs a key_rotator (use kvhive.make_cache)")
        if traits.attends_outside_cache:
            raise ValueError(
                f"positions='cache' is not supported by method {policy.name!r}: its estimator "
                "keeps keys outside the cache that cannot be re-indexed"
            )


# The phases of a method that compresses only the prompt (the methods a question-aware prefill serves).
_PROMPT_ONLY = frozenset({PREFILL})


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
    if policy.phases != _PROMPT_ONLY:
        raise ValueError(
            f"question_tokens is for methods that compress only the prompt (e.g. snapkv, pyramidkv): method "
            f"{policy.name!r} "
            + ("evicts by its decode rule after each chunk" if DECODE in policy.phases else "never evicts")
            + "; give question_tokens=None for it"
        )
