"""Task registry (chance = score of a model that ignores the context; summarisation: ROUGE-L of an
unrelated article's reference, computed at load): ``get_task(name, **params)`` / ``parse_task_spec("needle:lengths=256+512")``.

| name              | kind       | data                                   | chance |
| ----------------- | ---------- | -------------------------------------- | ------ |
| needle            | generate   | paul_graham_essays                     | 0      |
| needle_multikey   | generate   | paul_graham_essays                     | 0      |
| mdqa              | generate   | lost_in_the_middle (NQ oracle)         | 0      |
| kv_retrieval      | generate   | lost_in_the_middle (75 keys)           | 0      |
| lines             | generate   | longeval_lines                         | 0      |
| ppl               | perplexity | wikitext2                              | vocab  |
| xsum              | generate   | xsum                                   | ~0.08  |
| cnn_dailymail     | generate   | cnn_dailymail                          | ~0.08  |
| multi_news        | generate   | longbench                              | ~0.11  |
| piqa              | choice     | piqa                                   | 0.5    |
| openbookqa        | choice     | openbookqa                             | 0.25   |
| synthetic_recall  | generate   | none                                   | 0      |
"""

from __future__ import annotations

import json
from typing import Any

from .base import Item, Task, TaskDataError
from .lines import LineRetrievalTask
from .lost_in_the_middle import KVRetrievalTask, MultiDocQATask
from .multiple_choice import OpenBookQATask, PIQATask
from .needle import NeedleMultiKeyTask, NeedleTask
from .summarization import CNNDailyMailTask, MultiNewsTask, XSumTask
from .synthetic import SyntheticRecallTask
from .wikitext import WikiTextPerplexityTask

TASKS: dict[str, type[Task]] = {
    cls.name: cls
    for cls in (
        NeedleTask,
        NeedleMultiKeyTask,
        MultiDocQATask,
        KVRetrievalTask,
        LineRetrievalTask,
        WikiTextPerplexityTask,
        XSumTask,
        CNNDailyMailTask,
        MultiNewsTask,
        PIQATask,
        OpenBookQATask,
        SyntheticRecallTask,
    )
}

__all__ = ["TASKS", "Item", "Task", "TaskDataError", "get_task", "available_tasks", "parse_task_spec"]


def available_tasks() -> list[str]:
    return list(TASKS)


def get_task(name: str, **params: Any) -> Task:
    """Instantiate a registered task; unknown names raise ValueError listing the known tasks."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    return TASKS[name](**params)


def _parse_value(text: str) -> Any:
    if text.lower() in ("none", "null"):
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_task_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"needle:lengths=256+512:depths=0+50"`` -> ``("needle", {"lengths": [256, 512], "depths": [0, 50]})``.

    Values separated by ``+`` become lists; numbers are parsed as JSON numbers.
    """
    name, *parts = spec.strip().split(":")
    params: dict[str, Any] = {}
    for part in parts:
        if "=" not in part:
            raise ValueError(f"task spec {spec!r}: expected key=value after ':', got {part!r}")
        key, value = part.split("=", 1)
        values = [_parse_value(v) for v in value.split("+")]
        params[key.strip()] = values if "+" in value else values[0]
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    return name, params
