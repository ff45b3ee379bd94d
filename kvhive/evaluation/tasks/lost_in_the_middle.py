"""Lost in the Middle (Liu et al., 2023; nelson-liu/lost-in-the-middle): multi-document QA and
key-value retrieval.

``mdqa``: the upstream 10-document files (Contriever distractors) are not in the shared data (see
its README), so documents are built from ``nq-open-oracle.jsonl.gz`` **(choice)**: the question's
gold passage plus 9 distractors taken from OTHER questions' gold passages (seeded; a distractor
that contains one of the question's normalised answers, or shares the gold title, is never used),
gold at position 0, 4 or 9 (the paper's 10-document positions). The same distractors are used at
every gold position of a question, so only the position changes. Prompt: upstream ``qa.prompt``
with documents rendered ``Document [i](Title: {title}) {text}``. Metric: ``best_subspan_em`` on the
answer's first line (upstream ``evaluate_qa_responses.py``); ``max_new_tokens=100`` as upstream.

``kv_retrieval``: ``kv-retrieval-75_keys.jsonl.gz`` with upstream ``kv_retrieval.prompt`` and
record formatting (``get_kv_retrieval_prompt``); the queried pair is moved to each of
``positions`` (default first, middle, last, as the paper varies it). Metric: the value appears
(case-insensitively) in the answer's first line.
"""

from __future__ import annotations

import random
from typing import Any

from ..metrics import best_subspan_em, first_line, normalize_answer
from .base import MAX_GENERATED_TOKENS, Item, Parameter, Task, as_list, read_jsonl, require_fields, seeded_order, take

MAX_DOCUMENTS = 200  # distractors come from other questions' gold passages; far more than the paper's 30

QA_FILE = "lost_in_the_middle/nq-open-oracle.jsonl.gz"
KV_FILE = "lost_in_the_middle/kv-retrieval-75_keys.jsonl.gz"

QA_TEMPLATE = (
    "Write a high-quality answer for the given question using only the provided search results "
    "(some of which might be irrelevant).\n\n{search_results}\n\nQuestion: {question}\nAnswer:"
)
KV_TEMPLATE = (
    "Extract the value corresponding to the specified key in the JSON object below.\n\n"
    'JSON data:\n{formatted_kv_records}\n\nKey: "{key}"\nCorresponding value:'
)


def format_documents(documents: list[dict]) -> str:
    return "\n".join(f"Document [{i + 1}](Title: {d['title']}) {d['text']}" for i, d in enumerate(documents))


def qa_prompt(question: str, documents: list[dict]) -> str:
    return QA_TEMPLATE.format(search_results=format_documents(documents), question=question)


def format_kv_records(records: list[list[str]]) -> str:
    """Upstream formatting: ``{"k": "v",\\n "k": "v",\\n ... "k": "v"}``."""
    out = ""
    for index, (key, value) in enumerate(records):
        start = "{" if index == 0 else " "
        end = ",\n" if index != len(records) - 1 else "}"
        out += start + f'"{key}": "{value}"' + end
    return out


def kv_prompt(records: list[list[str]], key: str) -> str:
    return KV_TEMPLATE.format(formatted_kv_records=format_kv_records(records), key=key)


class MultiDocQATask(Task):
    name = "mdqa"
    kind = "generate"
    required_files = (QA_FILE,)
    chance = 0.0
    main_metric = "best_subspan_em"
    default_budgets = (0.25, 64, 128, 256)
    source = "nelson-liu/lost-in-the-middle (qa.prompt, best_subspan_em, first-line answer)"

    @classmethod
    def default_params(cls) -> dict[str, Any]:
        return {"gold_positions": [0, 4, 9], "num_documents": 10, "max_new_tokens": 100}

    @classmethod
    def parameters(cls) -> dict[str, Parameter]:
        return {
            # an index into the documents (negative: from the end) or "middle"; range checked per count
            "gold_positions": Parameter("int", -MAX_DOCUMENTS, MAX_DOCUMENTS - 1, many=True, words=("middle",)),
            "num_documents": Parameter("int", 1, MAX_DOCUMENTS, many=True),
            "max_new_tokens": Parameter("int", 1, MAX_GENERATED_TOKENS),
        }

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        for count in as_list(self.params["num_documents"]):  # every gold position fits every count
            self._gold_positions(as_list(self.params["gold_positions"]), int(count))

    def load(self, data_dir, limit, seed, tokenizer) -> list[Item]:
        root = self.check_files(data_dir)
        path = root / QA_FILE
        records = []
        for line_number, record in read_jsonl(path):
            require_fields(record, ("question", "answers", "ctxs"), path, line_number)
            gold = [c for c in record["ctxs"] if c.get("isgold", True)] or record["ctxs"]
            if not gold:
                continue
            records.append((line_number, record, gold[0]))
        counts = [int(c) for c in as_list(self.params["num_documents"])]
        if not counts or any(c < 1 for c in counts):
            raise ValueError(f"task 'mdqa': num_documents {counts} must be integers >= 1")
        # Per document count: an index, a negative index from the end, or "middle".
        positions = {count: self._gold_positions(as_list(self.params["gold_positions"]), count) for count in counts}
        default_documents = int(self.default_params()["num_documents"])
        items = []
        per_question = sum(len(p) for p in positions.values())
        max_questions = None if limit is None else -(-limit // per_question)
        questions = 0
        for index in seeded_order(len(records), seed, "mdqa"):
            if max_questions is not None and questions >= max_questions:
                break
            line_number, record, gold = records[index]
            distractors = {count: self._distractors(records, index, count - 1, seed) for count in counts}
            if any(len(distractors[count]) < count - 1 for count in counts):
                continue
            questions += 1
            for count in counts:
                # Another document count is another item (mdqa at 2k and 4k tokens in one run).
                documents_tag = "" if count == default_documents else f"-docs{count}"
                for position in positions[count]:
                    documents = distractors[count][:position] + [gold] + distractors[count][position:]
                    items.append(
                        Item(
                            id=f"q{line_number}{documents_tag}-gold{position}",
                            prompt=qa_prompt(record["question"], documents),
                            question=f"\n\nQuestion: {record['question']}\nAnswer:",  # QA_TEMPLATE's end
                            references=list(record["answers"]),
                            max_new_tokens=int(self.params["max_new_tokens"]),
                            metadata={"gold_position": position, "num_documents": count, "line": line_number},
                        )
                    )
        return take(items, limit)

    @staticmethod
    def _gold_positions(spec: list, count: int) -> list[int]:
        resolved = []
        for raw in spec:
            if str(raw) == "middle":
                position = count // 2
            else:
                try:
                    position = int(raw)
                except ValueError:
                    raise ValueError(
                        f"task 'mdqa': gold_positions entry {raw!r} is not an integer index or 'middle'"
                    ) from None
                position = position + count if position < 0 else position
            if not 0 <= position < count:
                raise ValueError(
                    f"task 'mdqa': parameter 'gold_positions': {spec} outside 0..{count - 1} for {count} documents"
                )
            resolved.append(position)
        return resolved

    @staticmethod
    def _distractors(records: list, index: int, count: int, seed: int) -> list[dict]:
        _, record, gold = records[index]
        answers = [normalize_answer(a) for a in record["answers"]]
        answers = [a for a in answers if a]
        rng = random.Random(f"mdqa-distractors:{seed}:{index}")
        chosen: list[dict] = []
        titles = {gold.get("title", "")}
        for other in rng.sample(range(len(records)), min(len(records), 8 * count + 8)):
            if other == index:
                continue
            passage = records[other][2]
            if passage.get("title", "") in titles:
                continue
            text = normalize_answer(passage.get("text", ""))
            if any(a in text for a in answers):
                continue
            chosen.append({"title": passage.get("title", ""), "text": passage.get("text", "")})
            titles.add(passage.get("title", ""))
            if len(chosen) == count:
                break
        return chosen

    def score(self, item: Item, output: str) -> dict[str, float]:
        return {"best_subspan_em": best_subspan_em(first_line(output), item.references)}


class KVRetrievalTask(Task):
    name = "kv_retrieval"
    kind = "generate"
    required_files = (KV_FILE,)
    chance = 0.0
    main_metric = "accuracy"
    default_budgets = (0.25, 0.5)
    source = "nelson-liu/lost-in-the-middle (kv_retrieval.prompt, get_kv_retrieval_prompt)"

    @classmethod
    def default_params(cls) -> dict[str, Any]:
        # None = the file's own ordering; "first"/"middle"/"last" or an int index move the queried pair
        return {"positions": ["first", "middle", "last"], "max_new_tokens": 100}

    @classmethod
    def parameters(cls) -> dict[str, Parameter]:
        return {
            # an index among the other pairs (checked against each record's count at load)
            "positions": Parameter("int", 0, 10_000, many=True, optional=True, words=("first", "middle", "last")),
            "max_new_tokens": Parameter("int", 1, MAX_GENERATED_TOKENS),
        }

    def load(self, data_dir, limit, seed, tokenizer) -> list[Item]:
        root = self.check_files(data_dir)
        path = root / KV_FILE
        records = []
        for line_number, record in read_jsonl(path):
            require_fields(record, ("ordered_kv_records", "key", "value"), path, line_number)
            records.append((line_number, record))
        positions = self.params["positions"]
        positions = [None] if positions is None else as_list(positions)
        items = []
        max_records = None if limit is None else -(-limit // len(positions))
        for index in seeded_order(len(records), seed, "kv_retrieval")[:max_records]:
            line_number, record = records[index]
            pairs = [list(p) for p in record["ordered_kv_records"]]
            gold = [p for p in pairs if p[0] == record["key"]]
            if len(gold) != 1:
                raise ValueError(f"{path}: line {line_number}: queried key occurs {len(gold)} times in the records")
            for position in positions:
                ordered = pairs
                if position is not None:
                    rest = [p for p in pairs if p[0] != record["key"]]
                    at = {"first": 0, "middle": len(rest) // 2, "last": len(rest)}.get(position, position)
                    if not 0 <= int(at) <= len(rest):
                        raise ValueError(
                            f"task 'kv_retrieval': parameter 'positions': {position!r} is outside 0..{len(rest)} "
                            f"for the {len(pairs)} pairs of {path} line {line_number}"
                        )
                    ordered = rest[: int(at)] + gold + rest[int(at) :]
                at_index = ordered.index(gold[0])
                items.append(
                    Item(
                        id=f"kv{line_number}-pos{at_index}",
                        prompt=kv_prompt(ordered, record["key"]),
                        question=f'\n\nKey: "{record["key"]}"\nCorresponding value:',
                        references=[record["value"]],
                        max_new_tokens=int(self.params["max_new_tokens"]),
                        metadata={"gold_position": at_index, "num_pairs": len(ordered), "line": line_number},
                    )
                )
        return take(items, limit)

    def score(self, item: Item, output: str) -> dict[str, float]:
        return {"accuracy": float(item.references[0].lower() in first_line(output).lower())}
