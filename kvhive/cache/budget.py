"""Budgets: what a user asks for (tokens per head or a ratio of the prompt), resolved to tokens
per head and split across layers. The only place these rules live: the cache, the API, the CLI
and the evaluation harness all use it.

* :class:`Budget` — ``tokens`` (an int >= 1, tokens per stored head per layer) or ``ratio`` (a float
  in (0, 1], of the prompt length), resolved by :meth:`Budget.resolve`.
* :func:`minimum_budget_problem` — why a resolved budget is below what a method needs.
* :func:`layer_budgets` — the per-layer budgets of a method (uniform unless it allocates across
  layers, e.g. PyramidKV) for one sequence of a given real (unpadded) length.
* :func:`resolve_row_layer_budgets` — every compressed layer's budget for every row of a batch.
* :func:`budget_label` — how a budget is written in results and reports (``"ratio 0.2"``,
  ``"40 tok"``), so a ratio never reads like a token count.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from kvhive.methods.base import DECODE, Policy


def as_python_number(value):
    """A numeric scalar of another library (``numpy.int64(16)``, ``numpy.float32(0.2)``) as the
    Python int or float it holds, so it is read like the same number typed in; anything else
    (bools included, which are refused later) unchanged."""
    if isinstance(value, bool) or isinstance(value, (int, float)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


BUCKETS_PER_OCTAVE = 4


def bucket_up(tokens: int) -> int:
    """The smallest of a few sizes >= ``tokens``: multiples of 2**(k-2) within each octave
    [2**k, 2**(k+1)) (4 sizes per octave: 8, 10, 12, 14, 16, 20, 24, 28, 32, ..., 2048, 2560, 3072,
    3584, 4096, ...), so at most 25% more than ``tokens`` and ~9% on average. Prompts of different
    lengths whose ratio budgets share a size share one compiled decode graph."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"invalid tokens={tokens!r}: expected an integer >= 1")
    step = 1 << max(0, tokens.bit_length() - 1 - (BUCKETS_PER_OCTAVE.bit_length() - 1))
    return -(-tokens // step) * step


@dataclass(frozen=True)
class Budget:
    """Tokens kept per head per layer (``tokens``) or a fraction of the prompt (``ratio``).

    ``bucketed``: a ratio resolves to :func:`bucket_up` of ``ratio × prompt`` (at most the prompt),
    so a compiled decode step has one shape for many prompt lengths; a token budget is one shape
    already and is unchanged."""

    tokens: int | None = None
    ratio: float | None = None
    bucketed: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", as_python_number(self.tokens))
        object.__setattr__(self, "ratio", as_python_number(self.ratio))
        if (self.tokens is None) == (self.ratio is None):
            raise ValueError("give exactly one of budget (tokens per head) or ratio (fraction of the context)")
        if self.tokens is not None:
            if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 1:
                raise ValueError(f"invalid budget={self.tokens!r}: expected an integer >= 1 (tokens per head)")
        if self.ratio is not None:
            ratio = self.ratio
            if (
                isinstance(ratio, bool)
                or not isinstance(ratio, (int, float))
                or math.isnan(ratio)
                or not 0 < ratio <= 1
            ):
                raise ValueError(f"invalid ratio={ratio!r}: expected a number in (0, 1]")
        if not isinstance(self.bucketed, bool):
            raise ValueError(f"invalid bucket_budget={self.bucketed!r}: expected True or False")

    @classmethod
    def parse(cls, value: int | float | str) -> Budget:
        """``128`` → tokens, ``0.2`` → ratio (a float in (0, 1]; ``1.0`` is the whole context)."""
        value = as_python_number(value)
        if isinstance(value, str):
            text = value.strip()
            try:
                value = int(text)
            except ValueError:
                try:
                    value = float(text)
                except ValueError:
                    raise ValueError(
                        f"invalid budget={text!r}: expected tokens per head (integer >= 1) or a ratio in (0, 1]"
                    ) from None
        try:
            if isinstance(value, float):
                return cls(ratio=value)
            return cls(tokens=value)
        except ValueError:
            raise ValueError(
                f"invalid budget={value!r}: expected tokens per head (an integer >= 1) or a ratio (a float in (0, 1])"
            ) from None

    def resolve(self, context_length: int) -> int:
        if self.tokens is not None:
            return self.tokens
        tokens = max(1, round(self.ratio * context_length))
        return min(context_length, bucket_up(tokens)) if self.bucketed else tokens

    def __str__(self) -> str:
        if self.tokens is not None:
            return str(self.tokens)
        return f"{self.ratio:g}" + (" bucketed" if self.bucketed else "")


def budget_label(budget: int | float | Budget) -> str:
    """``"40 tok"`` for tokens per head, ``"ratio 0.2"`` for a ratio of the prompt."""
    if not isinstance(budget, Budget):
        budget = Budget.parse(budget)
    if budget.tokens is not None:
        return f"{budget.tokens} tok"
    return f"ratio {budget.ratio:g}" + (" (bucketed up)" if budget.bucketed else "")


def minimum_budget_problem(policy: Policy, tokens: int) -> str | None:
    """Why ``tokens`` per head is below what ``policy`` needs, or None."""
    minimum = policy.minimum_budget()
    if tokens < minimum:
        return (
            f"invalid budget={tokens} for method {policy.name!r}: it needs at least {minimum} tokens per head "
            f"({policy.config})"
        )
    return None


def budget_problem(policy: Policy, budget: Budget, context_length: int) -> str | None:
    """Why ``budget`` cannot be honoured by ``policy`` on a prompt of ``context_length`` tokens, or
    None. A ratio is named as the user gave it (not the token count it became), and a ratio
    resolving to 0 tokens is refused, never raised silently to 1."""
    if budget.tokens is not None:
        return minimum_budget_problem(policy, budget.tokens)
    minimum = max(1, policy.minimum_budget())
    tokens = round(budget.ratio * context_length)
    if tokens < minimum:
        return (
            f"invalid budget: ratio={budget.ratio:g} of a {context_length}-token prompt is {tokens} tokens per "
            f"head; method {policy.name!r} needs at least {minimum} tokens per head ({policy.config})"
        )
    return None


def layer_budgets(policy: Policy, tokens: int, num_layers: int, context_length: int) -> list[int]:
    """Per-layer budgets of ``policy`` for a budget of ``tokens`` per head on one sequence of
    ``context_length`` real tokens (a layer-wise method may depend on it: PyramidKV's short-prompt rule)."""
    budgets = list(policy.layer_budgets(tokens, num_layers, context_length))
    if len(budgets) != num_layers or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in budgets):
        raise ValueError(f"{policy.name}: layer_budgets must give {num_layers} integers >= 1, got {budgets}")
    return budgets


def resolve_row_layer_budgets(
    policy: Policy,
    budget: Budget,
    compressed_layers: list[int],
    context_length: int,
    row_lengths: list[int] | None = None,
) -> dict[int, list[int]]:
    """Every compressed layer's budget for every row: a token budget is the same for every row; a
    ratio resolves on each row's real (unpadded) prompt length ``row_lengths``, so a row of a
    left-padded batch keeps what it would keep alone, and so does a layer-wise split (PyramidKV's
    short-prompt rule). A method that also keeps its budget while decoding holds every row of a
    layer at one length, so rows whose ratio resolves to different token counts are refused for it."""
    lengths = row_lengths or [context_length]
    row_tokens = []
    for row, length in enumerate(lengths):
        problem = budget_problem(policy, budget, length)
        if problem is not None:
            raise ValueError(problem if len(lengths) == 1 else f"row {row} of the batch: {problem}")
        row_tokens.append(budget.resolve(length))
    if len(set(row_tokens)) > 1 and DECODE in policy.phases:
        raise ValueError(
            f"invalid budget for this batch: ratio={budget.ratio:g} of rows with {lengths} real tokens is "
            f"{row_tokens} tokens per head, but method {policy.name!r} keeps one budget for every row of a "
            "layer while decoding; give a token budget (budget=N, the same for every row) or batch rows of equal "
            "real length"
        )
    per_row = [
        layer_budgets(policy, tokens, len(compressed_layers), length)
        for tokens, length in zip(row_tokens, lengths, strict=True)
    ]
    return {layer: [row[i] for row in per_row] for i, layer in enumerate(compressed_layers)}


def planned_layer_budgets(
    policy: Policy, budget: Budget, compressed_layers: list[int], prompt_length: int
) -> dict[int, int]:
    """The layer budgets a prefill of ``prompt_length`` tokens will resolve, without fixing them."""
    per_layer = layer_budgets(policy, budget.resolve(prompt_length), len(compressed_layers), prompt_length)
    return dict(zip(compressed_layers, per_layer, strict=True))


def row_budgets(layer_budgets: dict[int, int], row_layer_budgets: dict[int, list[int]], layer: int, rows: int):
    """Layer ``layer``'s budget for each of ``rows`` rows: its per-row budgets where they cover the
    batch, else the layer's budget for every row."""
    budgets = row_layer_budgets[layer]
    return budgets if len(budgets) == rows else [layer_budgets[layer]] * rows
