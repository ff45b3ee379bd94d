"""The model interface the evaluation harness depends on and budget validation.

The harness (tasks, runner, report, claims) never imports model code: it talks to a
:class:`Backend`. The real one (``kvhive/evaluation/kvhive_backend.py``) wraps ``kvhive.api``;
the tests use a deterministic stand-in (``tests/fake_backend.py``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from kvhive.cache.budget import Budget

__all__ = [
    "Setting",
    "SettingFailure",
    "Backend",
    "FULL_METHOD",
    "FULL_BUDGET",
    "validate_budget",
    "validate_budgets",
    "parse_budget",
    "parse_budgets",
    "budget_key",
    "budget_to_tokens",
    "DTYPES",
    "DEFAULT_DTYPE",
    "validate_dtype",
    "compresses_sliding",
    "CACHE_OPTIONS",
    "split_cache_options",
    "with_cache_options",
]

FULL_METHOD = "full"
FULL_BUDGET = 1.0  # the budget recorded for the uncompressed cache (a ratio of 1.0: keep everything)

# The dtypes a run may load its model in (recorded with every result: numbers of two dtypes are
# not the same experiment).
DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_DTYPE = "float32"


def validate_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise ValueError(f"invalid dtype={dtype!r}: expected one of {', '.join(DTYPES)}")
    return dtype


# Options of a setting's method spec that configure the cache, not the method: ``snapkv:prefill_chunk=512``
# feeds the prompt in chunks of 512 tokens (chunked prefill); ``:prefill_question=true`` with it scores
# every chunk with the item's question (question-aware chunked prefill: the item's ``question``, the
# prompt's final part, is appended to each chunk and dropped after). Kept in the method spec, so such a
# setting has its own name (label, results key, report row) and is never mixed with the one-shot one.
# ``:kv_bits=4`` (or 8) stores the kept keys and values quantized (``make_cache(kv_bits=...)``): a
# setting of its own beside the full-precision one, so quality can be read against held bytes.
CACHE_OPTIONS = ("prefill_chunk", "prefill_question", "kv_bits")
ACCEPTED_KV_BITS = (4, 8)


def split_cache_options(method: str) -> tuple[str, dict[str, int | bool]]:
    """``"snapkv:window=8:prefill_chunk=512"`` -> ``("snapkv:window=8", {"prefill_chunk": 512})``:
    the method's own spec (for the method registry) and the cache options, validated
    (``prefill_question=true`` -> ``{"prefill_question": True}``, only beside ``prefill_chunk``)."""
    name, *parts = method.split(":")
    kept, options = [name], {}
    for part in parts:
        option, equals, text = part.partition("=")
        if option.strip() not in CACHE_OPTIONS:
            kept.append(part)
            continue
        option = option.strip()
        if option in options:
            raise ValueError(f"invalid method={method!r}: option {option!r} given twice")
        if option == "prefill_question":
            if not equals or text.strip().lower() not in ("true", "false"):
                raise ValueError(f"invalid method={method!r}: prefill_question must be true or false, got {text!r}")
            if text.strip().lower() == "true":
                options[option] = True
            continue
        if option == "kv_bits":
            if not equals or text.strip() not in {str(bits) for bits in ACCEPTED_KV_BITS}:
                raise ValueError(f"invalid method={method!r}: kv_bits must be one of 4, 8, got {text!r}")
            options[option] = int(text)
            continue
        if not equals or not re.fullmatch(r"\s*\d+\s*", text) or int(text) < 1:
            raise ValueError(f"invalid method={method!r}: {option} must be an integer >= 1 (tokens), got {text!r}")
        options[option] = int(text)
    if options.get("prefill_question") and "prefill_chunk" not in options:
        raise ValueError(
            f"invalid method={method!r}: prefill_question=true makes a chunked prefill question-aware; give "
            "prefill_chunk=N too"
        )
    return ":".join(kept), options


def with_cache_options(method: str, options: dict[str, int | bool]) -> str:
    """The method spec with the cache options appended (in :data:`CACHE_OPTIONS` order): the
    canonical spelling of a setting whose method spec is already canonical."""
    spelled = [
        f"{option}={'true' if options[option] is True else options[option]}"
        for option in CACHE_OPTIONS
        if options.get(option)
    ]
    return ":".join([method, *spelled])


ACCEPTED_BUDGETS = "a ratio of the context (float in (0, 1]) or a number of tokens per head (int >= 1)"


@dataclass(frozen=True)
class Setting:
    """One compression configuration.

    ``method`` is a registry name ("full", "snapkv", "buzz", ...). ``budget`` is either a float in
    (0, 1] (ratio of the context kept) or an int >= 1 (tokens kept per KV head per layer).
    """

    method: str
    budget: float | int

    @property
    def label(self) -> str:
        """Short human-readable name, e.g. ``snapkv@0.2`` or ``h2o@128``."""
        return f"{self.method}@{budget_key(self.budget)}"

    @property
    def prefill_chunk(self) -> int | None:
        """The chunk size of a chunked prefill (``snapkv:prefill_chunk=512``), or None: one prefill."""
        return split_cache_options(self.method)[1].get("prefill_chunk")

    @property
    def prefill_question(self) -> bool:
        """Whether the chunked prefill is question-aware (``snapkv:prefill_chunk=512:prefill_question=true``):
        every chunk scored with the item's question (``Item.question``) instead of its own last queries."""
        return bool(split_cache_options(self.method)[1].get("prefill_question"))

    @property
    def kv_bits(self) -> int | None:
        """The bits the kept keys and values are stored in (``snapkv:kv_bits=4``), or None: the model's dtype."""
        return split_cache_options(self.method)[1].get("kv_bits")


@dataclass(frozen=True)
class SettingFailure:
    """What a backend returns, in place of a setting's output, when that setting produced no
    valid output (e.g. the model's logits were not finite): the runner records the setting as
    ``status="failed"`` with ``reason`` and scores nothing, while the other settings of the call
    are recorded as usual."""

    reason: str


@runtime_checkable
class Backend(Protocol):
    """What the harness needs from a model. One backend = one model.

    String prompts/contexts are tokenized by the backend with the tokenizer's defaults (BOS added
    when the model uses one); ``token_ids`` given to :meth:`streaming_nll` are complete (the
    harness already put the BOS token first) and must not be changed.
    """

    tokenizer: Any  # HF tokenizer
    max_context: int  # the model's context length

    def generate(self, prompt: str, max_new_tokens: int, settings: list[Setting]) -> list[str]:
        """Greedy continuation of ``prompt`` (at most ``max_new_tokens`` tokens, stopping at EOS) for
        each setting, in the order of ``settings``; the prompt's cache is compressed to the
        setting's budget (ratio budgets are of the prompt length). One prefill may serve all
        settings (implementation detail). Returns only the generated text, not the prompt.

        A setting with ``prefill_question`` (question-aware chunked prefill) is given only when the
        item separates its question: the harness then passes ``question=`` (the prompt's final part,
        ``Item.question``) as a keyword, which a backend without such settings never receives."""
        ...

    def choice_loglikelihoods(
        self, context: str, continuations: list[str], settings: list[Setting]
    ) -> list[list[float]]:
        """Per setting, per continuation: sum of log p(continuation tokens | context), with the
        context's cache compressed to the setting's budget before the continuation is scored.
        The continuation is tokenized as ``tokens(context + continuation)[len(tokens(context)):]``
        (lm-eval-harness convention)."""
        ...

    def streaming_nll(self, token_ids: list[int], settings: list[Setting]) -> list[tuple[float, int]]:
        """Feed ``token_ids`` one by one keeping the cache at the setting's budget (an int number
        of tokens; the harness converts ratios before calling); returns per setting
        ``(sum of negative log-likelihoods, number of predicted tokens)`` where the predicted
        tokens are ``token_ids[1:]``. Given ``prefill_tokens=P`` (a keyword only tasks that ask for
        it pass), the first ``P`` tokens go in one forward (a prompt, compressed by the method's
        prefill decision) and the rest one by one; the predicted tokens are ``token_ids[P:]``."""
        ...

    # Optional: ``infeasible(setting, context_tokens) -> str | None`` says why a setting cannot run
    # on a context of that many tokens (e.g. a ratio resolving below the method's minimum budget);
    # the runner then records the setting as infeasible instead of calling the backend with it.
    # Optional: ``not_applicable(setting, context_tokens, streaming) -> str | None`` says why a
    # setting's method cannot keep its budget in the task's phase (a prefill-only method fed a
    # stream token by token, ``streaming=True``); the runner records it as ``not_applicable``.
    # Any output may be a :class:`SettingFailure` (recorded as ``failed``, never scored).
    # Optional: ``last_cache_sizes``, a list of dicts aligned with the settings of the last call
    # (e.g. ``{"mean_kept_per_head": ..., "final_kept_per_head": ...}``), stored as ``cache``.


# --------------------------------------------------------------------------- budgets


def validate_budget(budget: Any) -> float | int:
    """Return ``budget`` if valid, else raise ValueError naming ``budgets`` and the accepted range.

    The rules are :class:`kvhive.cache.budget.Budget`'s; here ints are token budgets and floats
    ratios (a float above 1, e.g. ``128.0``, is refused: use an int for a token budget).
    """
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise ValueError(f"budgets: {budget!r} is not a number; accepted: {ACCEPTED_BUDGETS}")
    try:
        parsed = Budget(tokens=budget) if isinstance(budget, int) else Budget(ratio=float(budget))
    except ValueError as error:
        hint = " (write token budgets as integers, e.g. 128)" if isinstance(budget, float) and budget > 1 else ""
        raise ValueError(f"budgets: {error}{hint}; accepted: {ACCEPTED_BUDGETS}") from None
    return parsed.tokens if parsed.tokens is not None else parsed.ratio


def validate_budgets(budgets: Sequence[Any]) -> list[float | int]:
    """Validate a list of budgets (see :func:`validate_budget`); duplicates are dropped, order kept."""
    if isinstance(budgets, (str, bytes)) or not isinstance(budgets, Sequence):
        raise ValueError(f"budgets: expected a list of budgets, got {budgets!r}; accepted: {ACCEPTED_BUDGETS}")
    out: list[float | int] = []
    for budget in budgets:
        budget = validate_budget(budget)
        if not any(budget_key(budget) == budget_key(b) for b in out):
            out.append(budget)
    return out


def parse_budget(text: str) -> float | int:
    """Parse one budget from the command line: ``"128"`` -> 128 tokens, ``"0.2"``/``"1.0"`` -> ratio."""
    text = text.strip()
    if re.fullmatch(r"[+-]?\d+", text):
        return validate_budget(int(text))
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"budgets: cannot parse {text!r}; accepted: {ACCEPTED_BUDGETS}") from None
    return validate_budget(value)


def parse_budgets(text: str) -> list[float | int]:
    """Parse a comma-separated budget list like ``"0.1,0.5,128"``."""
    items = [t for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"budgets: empty list; accepted: {ACCEPTED_BUDGETS}")
    return validate_budgets([parse_budget(t) for t in items])


def budget_key(budget: float | int) -> str:
    """Canonical string of a budget, stable through a JSON round trip: ``0.5`` -> "0.5", ``128`` -> "128"."""
    if isinstance(budget, bool):
        raise ValueError(f"budgets: {budget!r} is not a number")
    if isinstance(budget, int):
        return str(budget)
    return repr(float(budget))


def budget_to_tokens(budget: float | int, num_tokens: int) -> int:
    """Tokens kept for ``budget`` on a sequence of ``num_tokens`` (:meth:`Budget.resolve`)."""
    return Budget.parse(budget).resolve(num_tokens)


def compresses_sliding(method: str, budget: float | int, sliding_window: int | None) -> bool:
    """Whether a streamed (token-by-token) setting compresses the sliding-window layers too: a
    fixed token budget below the window (BUZZ Table 3's 50 and 100 tokens on Gemma's 512-token
    window) would otherwise leave those layers at their window. The full cache never does."""
    return method != FULL_METHOD and bool(sliding_window) and isinstance(budget, int) and budget < sliding_window
