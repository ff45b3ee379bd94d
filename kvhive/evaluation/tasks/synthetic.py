"""``synthetic_recall``: key/value recall on generated text; needs no data dir (CI on a tiny model).

Each item lists ``num_pairs`` (default 16) lines "The value of key <word>-<word> is <5-digit
number>." (keys with distinct first words) and asks for one value (its position varies over
items): the prompt ends with
"Question: What is the value of key X?\\nAnswer: The value of key X is". Metric: the first integer
of the output equals the value. Everything is generated from the seed.
"""

from __future__ import annotations

import random
from typing import Any

from ..metrics import first_integer
from .base import MAX_GENERATED_TOKENS, Item, Parameter, Task, take
from .needle import KEY_WORDS_A, KEY_WORDS_B


class SyntheticRecallTask(Task):
    name = "synthetic_recall"
    kind = "generate"
    required_files = ()
    chance = 0.0
    main_metric = "accuracy"
    default_budgets = (0.25, 0.5)
    source = "generated in kvhive (no external data)"

    @classmethod
    def default_params(cls) -> dict[str, Any]:
        return {"num_pairs": 16, "num_items": 20, "max_new_tokens": 8}

    @classmethod
    def parameters(cls) -> dict[str, Parameter]:
        return {
            "num_pairs": Parameter("int", 1, len(KEY_WORDS_A)),
            "num_items": Parameter("int", 1, 1_000_000),
            "max_new_tokens": Parameter("int", 1, MAX_GENERATED_TOKENS),
        }

    def load(self, data_dir, limit, seed, tokenizer) -> list[Item]:
        num_pairs = int(self.params["num_pairs"])
        if not 1 <= num_pairs <= len(KEY_WORDS_A):
            raise ValueError(f"task 'synthetic_recall': num_pairs must be in 1..{len(KEY_WORDS_A)}, got {num_pairs}")
        count = int(self.params["num_items"]) if limit is None else int(limit)
        items = []
        for index in range(count):
            rng = random.Random(f"synthetic_recall:{seed}:{index}")
            # distinct first words: keys sharing a first word confuse small models (gemma-3-270m
            # full cache: 1/6 correct with shared words and 24 pairs, 7/8 with distinct words and 16)
            keys = [f"{first}-{rng.choice(KEY_WORDS_B)}" for first in rng.sample(KEY_WORDS_A, num_pairs)]
            values = [rng.randrange(10_000, 100_000) for _ in keys]
            queried = rng.randrange(num_pairs)
            records = "\n".join(f"The value of key {k} is {v}." for k, v in zip(keys, values, strict=True))
            prompt = (
                "Remember the following records.\n"
                f"{records}\n\n"
                f"Question: What is the value of key {keys[queried]}?\n"
                f"Answer: The value of key {keys[queried]} is"
            )
            items.append(
                Item(
                    id=f"item{index}",
                    prompt=prompt,
                    references=[str(values[queried])],
                    max_new_tokens=int(self.params["max_new_tokens"]),
                    metadata={"num_pairs": num_pairs, "position": queried},
                )
            )
        return take(items, limit)

    def score(self, item: Item, output: str) -> dict[str, float]:
        predicted = first_integer(output)
        return {"accuracy": float(predicted is not None and str(predicted) == item.references[0])}
