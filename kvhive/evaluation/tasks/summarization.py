"""Summarisation: XSum and CNN/DailyMail (H2O/HELM 0-shot prompts) and LongBench multi_news.

* ``xsum`` / ``cnn_dailymail``: the records' ``article`` field is the complete prompt
  ("###\\nArticle: ...\\n\\nSummarize the above article in N sentence(s)."), ``summary_gt`` the
  reference, ``max_tokens`` the generation length (64 / 128). As H2O's ``run_summarization.py``
  the generation is cut at the first ``"###"`` (the request's ``stop``); H2O samples with
  temperature 0.3, this harness decodes greedily. CNN/DailyMail's duplicated item is dropped.
* ``multi_news``: LongBench prompt (KVCache-Factory ``run_longbench.py``), 512 new tokens, no stop
  string; the context is used as stored (with its ``NEWLINE_CHAR`` markers, as LongBench does).
Metric: ROUGE-1/2/L F1 (rouge-score, stemming); the report also shows ``rouge_mean``, BUZZ's
geometric mean of the three. Chance level **(choice)**: the ROUGE-L of an unrelated article's
reference summary (computed from the data at load), since common words alone score above 0.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..metrics import cut_at_stop, rouge_scores_multi
from .base import (
    MAX_GENERATED_TOKENS,
    Item,
    Parameter,
    Task,
    decode,
    encode,
    read_jsonl,
    require_fields,
    seeded_order,
    take,
)

CHANCE_SAMPLE = 30
_CHANCE_CACHE: dict[tuple[str, str], float] = {}


def cached_chance(path, references: list[list[str]], metric: str) -> float:
    key = (str(path), metric)
    if key not in _CHANCE_CACHE:
        _CHANCE_CACHE[key] = unrelated_summary_score(references, metric)
    return _CHANCE_CACHE[key]


def unrelated_summary_score(references: list[list[str]], metric: str = "rougeL") -> float:
    """Chance level of a summarisation task: the mean ROUGE of a summary of an UNRELATED article
    (each of the first ``CHANCE_SAMPLE`` references scored against the next one's), i.e. the score
    that common words alone give a model that ignores the article."""
    sample = references[:CHANCE_SAMPLE]
    if len(sample) < 2:
        return 0.0
    scores = [rouge_scores_multi(sample[(i + 1) % len(sample)][0], sample[i])[metric] for i in range(len(sample))]
    return sum(scores) / len(scores)


def middle_truncated(item: Item, tokenizer: Any, max_tokens: int) -> Item | None:
    """LongBench's truncation: the first and last ``max_tokens / 2`` tokens of the prompt (the
    instructions at both ends stay, the middle of a long article goes)."""
    ids = encode(tokenizer, item.prompt)
    if len(ids) <= max_tokens:
        return item
    if max_tokens < 2:
        return None
    half = max_tokens // 2
    return replace(item, prompt=decode(tokenizer, ids[:half] + ids[len(ids) - (max_tokens - half) :]))


MULTI_NEWS_TEMPLATE = (
    "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\n"
    "Now, write a one-page summary of all the news.\n\nSummary:"
)


class _H2OSummarizationTask(Task):
    kind = "generate"
    chance = 0.0  # replaced at load by unrelated_summary_score
    main_metric = "rougeL"
    default_budgets = (0.1, 0.2, 0.4, 0.6)
    file = ""
    default_max_new_tokens = 64
    truncatable = "the middle of the article (LongBench's middle truncation)"

    def shorten(self, item: Item, tokenizer: Any, max_tokens: int) -> Item | None:
        return middle_truncated(item, tokenizer, max_tokens)

    @classmethod
    def default_params(cls) -> dict[str, Any]:
        return {"max_new_tokens": None}  # None: the record's max_tokens

    @classmethod
    def parameters(cls) -> dict[str, Parameter]:
        return {"max_new_tokens": Parameter("int", 1, MAX_GENERATED_TOKENS, optional=True)}

    def load(self, data_dir, limit, seed, tokenizer) -> list[Item]:
        root = self.check_files(data_dir)
        path = root / self.file
        items: list[Item] = []
        seen_articles: set[str] = set()
        for line_number, record in read_jsonl(path):
            require_fields(record, ("article", "summary_gt"), path, line_number)
            if record["article"] in seen_articles:
                continue
            seen_articles.add(record["article"])
            max_new = self.params["max_new_tokens"] or int(record.get("max_tokens", self.default_max_new_tokens))
            items.append(
                Item(
                    id=f"line{line_number}",
                    prompt=record["article"],
                    references=[record["summary_gt"]],
                    max_new_tokens=int(max_new),
                    metadata={"line": line_number, "stop": list(record.get("stop", ["###"]))},
                )
            )
        self.chance = cached_chance(path, [item.references for item in items], self.main_metric)
        return take([items[i] for i in seeded_order(len(items), seed, self.name)], limit)

    def score(self, item: Item, output: str) -> dict[str, float]:
        summary = cut_at_stop(output, item.metadata.get("stop", ["###"])).strip()
        return self.main_first(rouge_scores_multi(summary, item.references))


class XSumTask(_H2OSummarizationTask):
    name = "xsum"
    required_files = ("xsum/xsum_0shot.jsonl.gz",)
    file = "xsum/xsum_0shot.jsonl.gz"
    default_max_new_tokens = 64
    source = "FMInference/H2O h2o_hf/data/summarization_data/xsum_0shot.jsonl, run_summarization.py"


class CNNDailyMailTask(_H2OSummarizationTask):
    name = "cnn_dailymail"
    required_files = ("cnn_dailymail/cnn_dailymail_0shot.jsonl.gz",)
    file = "cnn_dailymail/cnn_dailymail_0shot.jsonl.gz"
    default_max_new_tokens = 128
    source = "Kyriection/mamba data/cnn_dailymail_0shot.jsonl (H2O/HELM format); H2O run_summarization.py"


class MultiNewsTask(Task):
    name = "multi_news"
    kind = "generate"
    required_files = ("longbench/multi_news.jsonl.gz",)
    chance = 0.0  # replaced at load by unrelated_summary_score
    main_metric = "rougeL"
    default_budgets = (0.1, 0.2, 0.4)
    source = "LongBench v1 multi_news via Zefan-Cai/KVCache-Factory (prompt, 512 new tokens, ROUGE-L)"
    truncatable = "the middle of the news passages (LongBench's middle truncation)"

    def shorten(self, item: Item, tokenizer: Any, max_tokens: int) -> Item | None:
        return middle_truncated(item, tokenizer, max_tokens)

    @classmethod
    def default_params(cls) -> dict[str, Any]:
        return {"max_new_tokens": 512}

    @classmethod
    def parameters(cls) -> dict[str, Parameter]:
        return {"max_new_tokens": Parameter("int", 1, MAX_GENERATED_TOKENS)}

    def load(self, data_dir, limit, seed, tokenizer) -> list[Item]:
        root = self.check_files(data_dir)
        path = root / self.required_files[0]
        items = []
        for line_number, record in read_jsonl(path):
            require_fields(record, ("context", "answers"), path, line_number)
            items.append(
                Item(
                    id=str(record.get("_id", f"line{line_number}")),
                    prompt=MULTI_NEWS_TEMPLATE.format(context=record["context"]),
                    references=list(record["answers"]),
                    max_new_tokens=int(self.params["max_new_tokens"]),
                    metadata={"line": line_number, "words": record.get("length")},
                )
            )
        self.chance = cached_chance(path, [item.references for item in items], self.main_metric)
        return take([items[i] for i in seeded_order(len(items), seed, self.name)], limit)

    def score(self, item: Item, output: str) -> dict[str, float]:
        return self.main_first(rouge_scores_multi(output.strip(), item.references))
