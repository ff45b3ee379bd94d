"""Task base class, the ``Item`` record, and data-reading helpers shared by all tasks."""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import math
import random
import re
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from ..metrics import aggregate_item_metrics

KINDS = ("generate", "choice", "perplexity")
MAX_GENERATED_TOKENS = 65_536  # bound of every max_new_tokens parameter
MAX_PROMPT_TOKENS = 1_048_576  # bound of every length parameter (a 1M-token context)


class TaskDataError(ValueError):
    """A task's data file is malformed (the message names the file and line)."""


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


@dataclass(frozen=True)
class Parameter:
    """What a task parameter accepts, checked when the task is made (as method parameters are).

    ``kind``: ``"int"`` (an integer, not a bool), ``"number"`` (int or float, finite) or
    ``"choice"`` (one of ``choices``). Numbers must lie in ``[minimum, maximum]``. ``words``:
    strings a numeric parameter also accepts (mdqa's ``"middle"``). ``many``: a list of values
    (a single value is a list of one; no value twice, since each value makes its own items).
    ``optional``: ``None`` is accepted (the task's documented default behaviour)."""

    kind: str
    minimum: float | None = None
    maximum: float | None = None
    many: bool = False
    optional: bool = False
    choices: tuple = ()
    words: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.kind == "choice":
            text = f"one of {list(self.choices)}"
        else:
            text = "an integer" if self.kind == "int" else "a number"
            if self.minimum is not None and self.maximum is not None:
                text += f" in {_number(self.minimum)}..{_number(self.maximum)}"
            elif self.minimum is not None:
                text += f" >= {_number(self.minimum)}"
            if self.words:
                text += " or " + " or ".join(repr(w) for w in self.words)
        if self.many:
            text = f"{text}, or several joined by '+' (each once)"
        return text + (", or none" if self.optional else "")

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is not accepted, or None."""
        if value is None:
            return None if self.optional else "a value is required"
        values = list(value) if self.many and isinstance(value, (list, tuple)) else [value]
        if self.many and not values:
            return "no value given"
        for one in values:
            if self.kind == "choice":
                if isinstance(one, bool) or one not in self.choices:
                    return f"{one!r} is not accepted"
                continue
            if isinstance(one, str) and one in self.words:
                continue
            if isinstance(one, bool) or not isinstance(one, (int, float)):
                return f"{one!r} is not a number"
            if self.kind == "int" and not isinstance(one, int):
                return f"{one!r} is not an integer"
            if isinstance(one, float) and not math.isfinite(one):
                return f"{one!r} is not finite"
            if (self.minimum is not None and one < self.minimum) or (self.maximum is not None and one > self.maximum):
                return f"{one!r} is out of range"
        if len({json.dumps(v) for v in values}) != len(values):
            return "a value is given more than once"
        return None


@dataclass
class Item:
    """One evaluation example.

    * ``generate``: ``prompt``, ``references`` (gold answers / summaries), ``max_new_tokens``.
    * ``choice``: ``prompt`` is the context, ``choices`` the continuations, ``label`` the gold index.
    * ``perplexity``: ``token_ids`` (BOS first), scored with ``Backend.streaming_nll``.
    ``metadata`` holds what a breakdown needs (depth, length, gold position...); it is copied into
    every result record, so keep it small and JSON-serialisable.
    """

    id: str
    prompt: str = ""
    references: list[str] = field(default_factory=list)
    choices: list[str] = field(default_factory=list)
    label: int | None = None
    token_ids: list[int] = field(default_factory=list)
    max_new_tokens: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    # What the task needs to rebuild a shorter prompt (Task.shorten); not part of the item's
    # identity (the fingerprint) and never recorded.
    source: Any = field(default=None, repr=False, compare=False)
    # The prompt's final part that is its question (a suffix of ``prompt``; empty when the task
    # separates none): a question-aware chunked prefill scores every chunk with it. Not part of
    # the fingerprint (the prompt is: the split adds nothing the model sees).
    question: str = field(default="", compare=False)

    @property
    def context(self) -> str:
        """Alias of ``prompt`` for choice items."""
        return self.prompt

    def fingerprint(self) -> str:
        """Short hash of what the model sees and what is scored (detects stale results on resume)."""
        payload = json.dumps(
            [self.prompt, self.references, self.choices, self.label, self.token_ids, self.max_new_tokens],
            ensure_ascii=False,
        )
        return hashlib.sha1(payload.encode("utf-8")).hexdigest()[:16]


class Task:
    """Base class. Subclasses set the class attributes and implement ``load`` and ``score``.

    Constructor keyword arguments are task parameters (e.g. ``lengths`` for ``needle``); they
    must be JSON-serialisable and are recorded with the results.
    """

    name: ClassVar[str] = ""
    kind: ClassVar[str] = "generate"
    required_files: ClassVar[tuple[str, ...]] = ()  # relative to the data dir
    chance: float = 0.0  # expected main-metric score of a model that ignores the context
    main_metric: ClassVar[str] = ""
    higher_is_better: ClassVar[bool] = True
    default_budgets: ClassVar[tuple[float | int, ...]] = (0.2, 0.5)
    source: ClassVar[str] = ""  # where prompt format and metric come from
    # What Task.shorten may cut when a prompt is longer than the model's context (recorded with
    # every shortened item and shown in the report); None: nothing, such an item is "too_long".
    truncatable: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Every task's own ``load`` gets the chat-template step, so no task (and no caller of
        # ``load``) can forget it; a subclass that inherits ``load`` inherits the wrapped one.
        super().__init_subclass__(**kwargs)
        if "load" in cls.__dict__:
            cls.load = _rendering_chat_template(cls.__dict__["load"])

    def __init__(self, **params: Any) -> None:
        unknown = sorted(set(params) - set(self.default_params()))
        if unknown:
            raise ValueError(
                f"task {self.name!r}: unknown parameter(s) {unknown}; known: {sorted(self.default_params())}"
            )
        specs = self.parameters()
        for key, value in params.items():
            spec = specs.get(key)
            problem = spec.problem(value) if spec is not None else None
            if problem is not None:
                raise ValueError(
                    f"task {self.name!r}: parameter {key!r}: {problem}; expected {spec.describe()}, got {value!r}"
                )
        self.params: dict[str, Any] = {**self.default_params(), **params}

    @classmethod
    def default_params(cls) -> dict[str, Any]:
        return {}

    @classmethod
    def parameters(cls) -> dict[str, Parameter]:
        """What each parameter of :meth:`default_params` accepts (every one has an entry)."""
        return {}

    # -- to implement
    def load(self, data_dir: str | Path | None, limit: int | None, seed: int, tokenizer: Any) -> list[Item]:
        raise NotImplementedError

    def score(self, item: Item, output: Any) -> dict[str, float]:
        """Metrics of one output (main metric first). ``output`` is the generated text
        (generate), the list of log-likelihoods (choice) or ``(nll_sum, n_tokens)`` (perplexity)."""
        raise NotImplementedError

    def shorten(self, item: Item, tokenizer: Any, max_tokens: int) -> Item | None:
        """``item`` with a prompt of at most ``max_tokens`` tokens (without special tokens), cut
        only where :attr:`truncatable` says the answer cannot be, or None when that is not
        possible (then the runner records the item ``too_long``). By default nothing may be cut:
        a record, a document or a line removed could be the one asked about."""
        return None

    # -- shared
    def main_first(self, metrics: dict[str, float]) -> dict[str, float]:
        """``metrics`` reordered so that the main metric comes first."""
        if self.main_metric not in metrics:
            return metrics
        return {
            self.main_metric: metrics[self.main_metric],
            **{k: v for k, v in metrics.items() if k != self.main_metric},
        }

    def aggregate(self, item_metrics: Sequence[dict[str, float]]) -> dict[str, float]:
        return aggregate_item_metrics(self.kind, item_metrics)

    def check_files(self, data_dir: str | Path | None) -> Path:
        """Return the data dir as a Path; raise FileNotFoundError naming the task, data dir and the
        first missing file."""
        if not self.required_files:
            return Path(data_dir) if data_dir is not None else Path(".")
        if data_dir is None:
            raise FileNotFoundError(
                f"task {self.name!r} needs data files {list(self.required_files)} but no data dir was given"
            )
        root = Path(data_dir)
        for relative in self.required_files:
            path = root / relative
            if not path.exists():
                raise FileNotFoundError(
                    f"task {self.name!r}: missing data file {relative!r} in data dir {str(root)!r} "
                    f"(looked for {str(path)!r})"
                )
        return root

    def describe(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"{self.name}({params})"


# --------------------------------------------------------------------------- chat templates

CHAT_TEMPLATE_KINDS = ("generate", "choice")
"""Kinds whose prompt is text the model answers; perplexity items are raw token streams."""


def chat_template_of(tokenizer: Any) -> str | None:
    """The tokenizer's chat template (a Jinja string), or None when it has none."""
    template = getattr(tokenizer, "chat_template", None)
    return template if isinstance(template, str) and template.strip() else None


# A prompt written for a base model ends with a cue line that starts the answer, e.g.
# "Answer: The value of key amber-anchor is". In a chat, that start belongs to the model's turn:
# left in the user's turn, an instruction model repeats it and runs out of tokens before the answer.
_ANSWER_CUE = re.compile(r"\n(?P<label>[A-Z][A-Za-z ]{0,30}):[ \t]*(?P<prefix>\S[^\n]*)\Z")


def render_chat_prompt(tokenizer: Any, prompt: str) -> str:
    """``prompt`` as the user turn of the tokenizer's chat template, followed by the opening of
    the assistant's turn, so an instruction model answers instead of continuing the text.

    When the prompt's last line is an answer cue with a prefix (``"Answer: The best thing to do
    in San Francisco is"``), the cue line leaves the user's turn and its prefix opens the
    assistant's turn, which the model then continues. A bare cue (``"Answer:"``) stays in the
    user's turn. The template's own beginning-of-sequence token is dropped when the tokenizer adds
    one while encoding (the backend encodes with special tokens), so the model never sees it twice.
    """
    cue = _ANSWER_CUE.search(prompt)
    if cue is None:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    else:
        messages = [
            {"role": "user", "content": prompt[: cue.start()]},
            {"role": "assistant", "content": cue.group("prefix")},
        ]
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    bos = getattr(tokenizer, "bos_token", None)
    if bos and rendered.startswith(bos) and _adds_bos_when_encoding(tokenizer):
        rendered = rendered[len(bos) :]
    return rendered


def _adds_bos_when_encoding(tokenizer: Any) -> bool:
    bos_id = getattr(tokenizer, "bos_token_id", None)
    with_special = tokenizer("a")["input_ids"]
    without_special = tokenizer("a", add_special_tokens=False)["input_ids"]
    return bos_id is not None and len(with_special) > len(without_special) and with_special[0] == bos_id


def apply_chat_template(items: list[Item], kind: str, tokenizer: Any) -> list[Item]:
    """Items whose prompts are rendered with the tokenizer's chat template (when it has one and
    the kind takes text prompts); ``items`` unchanged otherwise.

    The rendered text becomes ``Item.prompt``, so the item's fingerprint (``item_hash`` in the
    results) covers the template, and ``metadata["chat_template"]`` records a short hash of the
    template itself: results with and without a template (or with another one) never mix.
    """
    template = chat_template_of(tokenizer)
    if template is None or kind not in CHAT_TEMPLATE_KINDS:
        return items
    template_hash = hashlib.sha1(template.encode("utf-8")).hexdigest()[:12]
    rendered = []
    for item in items:
        prompt = render_chat_prompt(tokenizer, item.prompt)
        rendered.append(
            replace(
                item,
                prompt=prompt,
                question=_rendered_question(prompt, item.question),
                metadata={**item.metadata, "chat_template": template_hash},
            )
        )
    return rendered


def _rendered_question(prompt: str, question: str) -> str:
    """The question of a rendered prompt: from the question's first line (and the blank lines
    before it) to the prompt's end, since the template closes the user's turn after the question
    and may open the assistant's with the answer prefix; empty when the line is not found."""
    first_line = question.strip().split("\n", 1)[0] if question.strip() else ""
    start = prompt.rfind(first_line) if first_line else -1
    if start <= 0:
        return ""
    lead = question[: len(question) - len(question.lstrip())]
    if lead and prompt[:start].endswith(lead) and start > len(lead):
        start -= len(lead)
    return prompt[start:]


def _rendering_chat_template(load: Callable[..., list[Item]]) -> Callable[..., list[Item]]:
    @functools.wraps(load)
    def load_with_chat_template(self: Task, data_dir, limit, seed, tokenizer) -> list[Item]:
        items = load(self, data_dir, limit, seed, tokenizer)
        if not items and limit != 0:  # an empty task would "run" and score nothing
            raise TaskDataError(f"task {self.name!r}: no items with parameters {self.params} from data dir {data_dir}")
        return apply_chat_template(items, self.kind, tokenizer)

    return load_with_chat_template


# --------------------------------------------------------------------------- helpers


def open_text(path: Path):
    """Open a text file, transparently gunzipping ``*.gz``."""
    if str(path).endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def read_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    """Yield ``(line_number, record)`` (1-based) from a JSON Lines file (``.gz`` allowed).

    Blank lines are skipped; a malformed line raises :class:`TaskDataError` naming file and line,
    and so do a file that cannot be read to its end (a truncated ``.gz``) and one without records.
    """
    records = 0
    line_number = 0
    try:
        with open_text(path) as handle:
            for line_number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise TaskDataError(f"{path}: line {line_number}: malformed JSON ({error.msg})") from None
                if not isinstance(record, dict):
                    raise TaskDataError(f"{path}: line {line_number}: expected a JSON object")
                records += 1
                yield line_number, record
    except (EOFError, OSError, UnicodeDecodeError, zlib.error) as error:
        raise TaskDataError(
            f"{path}: cannot be read past line {line_number} ({type(error).__name__}: {error}): "
            "the file is truncated or corrupt; download it again"
        ) from None
    if records == 0:
        raise TaskDataError(f"{path}: holds no records (an empty file?)")


def read_text_file(path: Path) -> str:
    """The text of a data file; an unreadable or empty file raises :class:`TaskDataError` naming it."""
    try:
        with open_text(path) as handle:
            text = handle.read()
    except (EOFError, OSError, UnicodeDecodeError, zlib.error) as error:
        raise TaskDataError(f"{path}: cannot be read ({type(error).__name__}: {error})") from None
    if not text.strip():
        raise TaskDataError(f"{path}: is empty")
    return text


def require_fields(record: dict, fields: Sequence[str], path: Path, line_number: int) -> None:
    missing = [f for f in fields if f not in record]
    if missing:
        raise TaskDataError(f"{path}: line {line_number}: missing field(s) {missing}")


def seeded_order(n: int, seed: int, salt: str) -> list[int]:
    """A deterministic permutation of ``range(n)`` from ``seed`` (and a per-task salt)."""
    order = list(range(n))
    random.Random(f"{salt}:{seed}").shuffle(order)
    return order


def take(items: list[Item], limit: int | None) -> list[Item]:
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    return items if limit is None else items[:limit]


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids))


def as_list(value: Any) -> list:
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]
