"""Needle in a haystack (gkamradt/LLMTest_NeedleInAHaystack) and a multi-key variant.

Haystack: the Paul Graham essays of ``paul_graham_essays/essays/*.txt`` read in sorted (glob)
order and concatenated (repeated if needed) up to ``length`` tokens of the model's tokenizer, as
the upstream tester does; each repetition of a (length, depth) cell starts at a different essay
(chosen from the seed). The needle goes in at ``depth`` percent of the haystack, moved back to the
end of the previous sentence (upstream backs up to the previous "." token); depth 100 appends it.

Upstream needle / question (``needlehaystack/run.py``):
``"\\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\\n"``
and ``"What is the best thing to do in San Francisco?"``. Upstream grades with a GPT-4 judge; here
the metric is exact match **(choice)**: 1 if the normalised key phrase "eat a sandwich and sit in
Dolores Park" appears in the output's first line. The prompt ends with an answer prefix
("The best thing to do in San Francisco is") **(choice)** so a base model answers in place
(upstream adds "Here is the most relevant sentence in the context:" for Claude models).

``needle_multikey``: several needles "The special magic number for <key> is <7-digit number>."
(RULER's multi-key NIAH wording) at seeded depths, the queried one at the cell's depth; metric:
the queried number appears in the output's first line.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from ..metrics import best_subspan_em, first_line, normalize_answer
from .base import (
    MAX_GENERATED_TOKENS,
    MAX_PROMPT_TOKENS,
    Item,
    Parameter,
    Task,
    TaskDataError,
    as_list,
    decode,
    encode,
    read_text_file,
    take,
)

ESSAYS_DIR = "paul_graham_essays/essays"

NEEDLE = "\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\n"
QUESTION = "What is the best thing to do in San Francisco?"
ANSWER_PREFIX = "The best thing to do in San Francisco is"
ANSWER = "eat a sandwich and sit in Dolores Park"
ANSWER_WORDS = ("sandwich", "dolores", "park", "sunny")

DEFAULT_LENGTHS = (1000, 2000, 4000)
DEFAULT_DEPTHS = (0, 25, 50, 75, 100)

# words for multi-key needle keys (fixed list so keys are reproducible without any data file)
KEY_WORDS_A = (
    "amber",
    "brisk",
    "calm",
    "dusty",
    "eager",
    "faint",
    "gentle",
    "hollow",
    "icy",
    "jolly",
    "keen",
    "lively",
    "mellow",
    "noble",
    "olive",
    "proud",
    "quiet",
    "rustic",
    "silent",
    "tidy",
    "urban",
    "vivid",
    "witty",
    "young",
    "zesty",
)
KEY_WORDS_B = (
    "anchor",
    "badger",
    "canyon",
    "dagger",
    "ember",
    "falcon",
    "garden",
    "harbor",
    "island",
    "jigsaw",
    "kettle",
    "lantern",
    "meadow",
    "needle",
    "orchid",
    "pepper",
    "quarry",
    "raven",
    "saddle",
    "tunnel",
    "umbrella",
    "violin",
    "walrus",
    "yarrow",
    "zephyr",
)


def load_essays(data_dir: Path) -> list[str]:
    paths = sorted((data_dir / ESSAYS_DIR).glob("*.txt"))
    if not paths:
        raise FileNotFoundError(f"no essays (*.txt) in {data_dir / ESSAYS_DIR}")
    essays = [read_text_file(p) if p.stat().st_size else "" for p in paths]
    essays = [text for text in essays if text.strip()]
    if not essays:  # the haystack would never grow
        raise TaskDataError(f"{data_dir / ESSAYS_DIR}: every essay (*.txt) is empty")
    return essays


def build_haystack(essays: list[str], start: int, num_tokens: int, tokenizer: Any) -> str:
    """Concatenate essays from index ``start`` (cyclically) and cut to ``num_tokens`` tokens."""
    text = ""
    index = start
    # grow by characters first (cheap), then check with the tokenizer
    while True:
        while len(text) < 6 * num_tokens + 64:
            text += essays[index % len(essays)]
            index += 1
        ids = encode(tokenizer, text)
        if len(ids) >= num_tokens:
            return decode(tokenizer, ids[:num_tokens])
        text += essays[index % len(essays)]
        index += 1


def insert_at_depth(haystack: str, needle: str, depth_percent: float) -> tuple[str, int]:
    """Insert ``needle`` at ``depth_percent`` of ``haystack`` (in characters), moved back to just
    after the previous sentence end. Returns the new text and the insertion offset."""
    if depth_percent >= 100:
        offset = len(haystack)
    elif depth_percent <= 0:
        offset = 0
    else:
        target = int(len(haystack) * depth_percent / 100)
        period = haystack.rfind(".", 0, target)
        offset = period + 1 if period != -1 else 0
    return haystack[:offset] + needle + haystack[offset:], offset


def _cells(lengths: list[int], depths: list[float], limit: int | None) -> list[tuple[int, int, float]]:
    """(repetition, length, depth) in repetition-major order so a small limit covers all cells."""
    per_cell = len(lengths) * len(depths)
    repetitions = 1 if limit is None else max(1, -(-limit // per_cell))
    return [(r, length, depth) for r in range(repetitions) for length in lengths for depth in depths]


class NeedleTask(Task):
    name = "needle"
    kind = "generate"
    required_files = (ESSAYS_DIR,)
    chance = 0.0
    main_metric = "exact_match"
    default_budgets = (64, 128, 256)
    source = "gkamradt/LLMTest_NeedleInAHaystack (needle, question, haystack construction)"
    truncatable = "the haystack's end, before the needle goes in at its depth (as the upstream tester trims it)"

    @classmethod
    def default_params(cls) -> dict[str, Any]:
        return {"lengths": list(DEFAULT_LENGTHS), "depths": list(DEFAULT_DEPTHS), "max_new_tokens": 32}

    @classmethod
    def parameters(cls) -> dict[str, Parameter]:
        return {
            "lengths": Parameter("int", 1, MAX_PROMPT_TOKENS, many=True),
            "depths": Parameter("number", 0, 100, many=True),
            "max_new_tokens": Parameter("int", 1, MAX_GENERATED_TOKENS),
        }

    def _prompt(self, context: str, question: str, answer_prefix: str) -> str:
        return context + self._question(question, answer_prefix)

    @staticmethod
    def _question(question: str, answer_prefix: str) -> str:
        """The prompt's final part after the haystack (``Item.question``)."""
        return f"\n\nQuestion: {question} Answer using the text above.\nAnswer: {answer_prefix}"

    def load(self, data_dir, limit, seed, tokenizer) -> list[Item]:
        root = self.check_files(data_dir)
        essays = load_essays(root)
        lengths = [int(x) for x in as_list(self.params["lengths"])]
        depths = [float(x) for x in as_list(self.params["depths"])]
        items = []
        haystacks: dict[tuple[int, int], str] = {}
        for repetition, length, depth in _cells(lengths, depths, limit):
            start = random.Random(f"needle:{seed}:{repetition}").randrange(len(essays))
            if (start, length) not in haystacks:
                haystacks[(start, length)] = build_haystack(essays, start, length, tokenizer)
            item = self._make_item(haystacks[(start, length)], repetition, length, depth, seed)
            item.source = {"haystack": haystacks[(start, length)], "repetition": repetition, "seed": seed}
            items.append(item)
        return take(items, limit)

    def shorten(self, item: Item, tokenizer: Any, max_tokens: int) -> Item | None:
        """The item rebuilt from a haystack cut short at its end, the needle(s) then inserted at
        the same depth(s), as the upstream tester fits a haystack to a context: the needle, the
        question and every needle of the multi-key variant stay whole."""
        if not isinstance(item.source, dict):
            return None
        from .base import apply_chat_template

        haystack_ids = encode(tokenizer, item.source["haystack"])
        keep = len(haystack_ids)
        for _ in range(8):  # the cut is exact up to re-tokenisation at its edge: converge in a few steps
            excess = len(encode(tokenizer, item.prompt)) - max_tokens
            if excess <= 0:
                return item
            keep -= excess
            if keep < 1:
                return None
            haystack = decode(tokenizer, haystack_ids[:keep])
            rebuilt = self._make_item(
                haystack,
                item.source["repetition"],
                item.metadata["length"],
                item.metadata["depth"],
                item.source["seed"],
            )
            rebuilt = apply_chat_template([rebuilt], self.kind, tokenizer)[0]
            rebuilt.metadata["haystack_tokens"] = keep
            rebuilt.source = item.source
            item = rebuilt
        return item if len(encode(tokenizer, item.prompt)) <= max_tokens else None

    def _make_item(self, haystack: str, repetition: int, length: int, depth: float, seed: int) -> Item:
        context, offset = insert_at_depth(haystack, NEEDLE, depth)
        return Item(
            id=f"len{length}-depth{depth:g}-rep{repetition}",
            prompt=self._prompt(context, QUESTION, ANSWER_PREFIX),
            question=self._question(QUESTION, ANSWER_PREFIX),
            references=[ANSWER],
            max_new_tokens=int(self.params["max_new_tokens"]),
            metadata={
                "length": length,
                "depth": depth,
                "needle_offset_fraction": round(offset / max(1, len(haystack)), 4),
            },
        )

    def score(self, item: Item, output: str) -> dict[str, float]:
        answer_line = first_line(output)
        normalized = normalize_answer(answer_line)
        return {
            "exact_match": best_subspan_em(answer_line, item.references),
            "word_recall": sum(w in normalized.split() for w in ANSWER_WORDS) / len(ANSWER_WORDS),
        }


class NeedleMultiKeyTask(NeedleTask):
    name = "needle_multikey"
    source = "haystack as in gkamradt/LLMTest_NeedleInAHaystack; multi-key needles as in RULER (niah_multikey)"

    @classmethod
    def default_params(cls) -> dict[str, Any]:
        return {**super().default_params(), "num_needles": 4}

    @classmethod
    def parameters(cls) -> dict[str, Parameter]:
        # at most as many needles as distinct keys (the key loop would never end)
        return {**super().parameters(), "num_needles": Parameter("int", 1, len(KEY_WORDS_A) * len(KEY_WORDS_B))}

    def _make_item(self, haystack: str, repetition: int, length: int, depth: float, seed: int) -> Item:
        rng = random.Random(f"needle_multikey:{seed}:{repetition}:{length}:{depth}")
        num_needles = int(self.params["num_needles"])
        keys: list[str] = []
        while len(keys) < num_needles:
            key = f"{rng.choice(KEY_WORDS_A)}-{rng.choice(KEY_WORDS_B)}"
            if key not in keys:
                keys.append(key)
        numbers = [str(rng.randrange(1_000_000, 10_000_000)) for _ in keys]
        # queried needle first at the cell's depth, distractors at random other depths
        other_depths = [rng.uniform(0, 100) for _ in keys[1:]]
        placements = sorted(zip([depth] + other_depths, range(len(keys)), strict=True), key=lambda p: -p[0])
        context = haystack
        query_offset = None
        for needle_depth, index in placements:  # deepest first
            needle = f"\nThe special magic number for {keys[index]} is {numbers[index]}.\n"
            context, offset = insert_at_depth(context, needle, needle_depth)
            if index == 0:
                query_offset = offset
            elif query_offset is not None and offset <= query_offset:
                query_offset += len(needle)  # inserted before the queried needle: it moved right
        query_offset = query_offset or 0
        question = f"What is the special magic number for {keys[0]} mentioned in the text above?"
        prefix = f"The special magic number for {keys[0]} is"
        return Item(
            id=f"len{length}-depth{depth:g}-rep{repetition}",
            prompt=f"{context}\n\nQuestion: {question}\nAnswer: {prefix}",
            question=f"\n\nQuestion: {question}\nAnswer: {prefix}",
            references=[numbers[0]],
            max_new_tokens=int(self.params["max_new_tokens"]),
            metadata={
                "length": length,
                "depth": depth,
                "key": keys[0],
                "num_needles": num_needles,
                "needle_offset_fraction": round(query_offset / max(1, len(context)), 4),
            },
        )

    def score(self, item: Item, output: str) -> dict[str, float]:
        return {"exact_match": float(item.references[0] in first_line(output))}
