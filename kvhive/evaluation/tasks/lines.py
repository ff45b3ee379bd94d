"""LongEval line retrieval (LongChat, DachengLi1/LongChat ``longeval``), used by SubGen (Table 1).

Prompts are the test cases' own ``prompt`` field (complete, ending with "... Tell me what is the
<REGISTER_CONTENT> in line <name>? I need the number."). Scoring as upstream
``longeval/utils.py``: greedy generation of up to 100 new tokens, the **last** integer of the
output compared with ``expected_number``.
"""

from __future__ import annotations

from typing import Any

from ..metrics import last_integer
from .base import MAX_GENERATED_TOKENS, Item, Parameter, Task, as_list, read_jsonl, require_fields, seeded_order, take

LINES_FILE = "longeval_lines/{n}_lines.jsonl.gz"
AVAILABLE_LENGTHS = (200, 300, 400, 500, 600, 680, 700, 800, 900, 1000, 1100, 1200, 1350)


class LineRetrievalTask(Task):
    name = "lines"
    kind = "generate"
    chance = 0.0
    main_metric = "accuracy"
    default_budgets = (0.5, 0.65)
    source = "DachengLi1/LongChat longeval (test cases, last-integer scoring, 100 new tokens)"

    @classmethod
    def default_params(cls) -> dict[str, Any]:
        return {"lengths": [200, 300], "max_new_tokens": 100}

    @classmethod
    def parameters(cls) -> dict[str, Parameter]:
        return {
            "lengths": Parameter("choice", many=True, choices=AVAILABLE_LENGTHS),
            "max_new_tokens": Parameter("int", 1, MAX_GENERATED_TOKENS),
        }

    @property
    def required_files(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(LINES_FILE.format(n=int(n)) for n in as_list(self.params["lengths"]))

    def load(self, data_dir, limit, seed, tokenizer) -> list[Item]:
        root = self.check_files(data_dir)
        per_length: list[list[Item]] = []
        for n in [int(x) for x in as_list(self.params["lengths"])]:
            path = root / LINES_FILE.format(n=n)
            cases = []
            for line_number, record in read_jsonl(path):
                require_fields(record, ("prompt", "expected_number", "random_idx"), path, line_number)
                cases.append(
                    Item(
                        id=f"lines{n}-{line_number}",
                        prompt=record["prompt"],
                        references=[str(record["expected_number"])],
                        max_new_tokens=int(self.params["max_new_tokens"]),
                        metadata={
                            "num_lines": n,
                            "line_position": int(record["random_idx"][1]),
                            "line": line_number,
                        },
                    )
                )
            per_length.append([cases[i] for i in seeded_order(len(cases), seed, f"lines{n}")])
        # interleave lengths so a small limit covers every length
        items = [
            group[i] for i in range(max(map(len, per_length), default=0)) for group in per_length if i < len(group)
        ]
        return take(items, limit)

    def score(self, item: Item, output: str) -> dict[str, float]:
        predicted = last_integer(output)
        return {"accuracy": float(predicted is not None and predicted == int(item.references[0]))}
