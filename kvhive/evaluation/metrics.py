"""Metrics and their aggregation over items.

Sources:
* ``normalize_answer`` / ``best_subspan_em``: the SQuAD normalisation as used by Lost in the Middle
  (``src/lost_in_the_middle/metrics.py``, nelson-liu/lost-in-the-middle): lowercase, drop
  punctuation, drop articles a/an/the, collapse whitespace; 1 if any normalised gold answer is a
  substring of the normalised prediction.
* ``first_line``: Lost in the Middle's evaluation keeps the model answer up to the first newline
  (otherwise a model could copy the context, which contains the answer).
* ``last_integer``: LongEval (LongChat ``longeval/utils.py``): ``re.findall(r"\\d+", output)[-1]``.
* ``rouge_scores``: the ``rouge-score`` package (Google), ``use_stemmer=True``, F1 of ROUGE-1/2/L as
  reported by H2O/HELM; ``rouge_mean`` is BUZZ's "Mean ROUGE", the geometric mean of the three
  (BUZZ §4.2.1, Table 2), computed on the item-averaged scores.
* ``choice_accuracy``: lm-eval-harness ``acc`` (argmax of the summed log-likelihood) and
  ``acc_norm`` (argmax of log-likelihood divided by the continuation's length in characters).
* perplexity: ``exp(total NLL / total predicted tokens)`` over all items (not a mean of per-item
  perplexities).
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD answer normalisation: lowercase, remove punctuation, articles, collapse whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def best_subspan_em(prediction: str, ground_truths: Iterable[str]) -> float:
    """1.0 if any normalised ground truth is a substring of the normalised prediction, else 0.0."""
    normalized_prediction = normalize_answer(prediction)
    for truth in ground_truths:
        if normalize_answer(truth) in normalized_prediction:
            return 1.0
    return 0.0


def first_line(text: str) -> str:
    """The output up to its first newline (leading newlines/spaces skipped), stripped."""
    return text.strip().split("\n")[0].strip()


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """Text before the earliest occurrence of any stop string (H2O cuts generations at "###")."""
    end = len(text)
    for stop in stops:
        index = text.find(stop)
        if index != -1:
            end = min(end, index)
    return text[:end]


def last_integer(text: str) -> int | None:
    """The last run of digits in ``text`` as an int (LongEval scoring), or None."""
    numbers = re.findall(r"\d+", text)
    return int(numbers[-1]) if numbers else None


def first_integer(text: str) -> int | None:
    numbers = re.findall(r"\d+", text)
    return int(numbers[0]) if numbers else None


@lru_cache(maxsize=1)
def _rouge_scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)


def rouge_scores(prediction: str, reference: str) -> dict[str, float]:
    """ROUGE-1/2/L F1 (rouge-score package, stemming on)."""
    scores = _rouge_scorer().score(reference, prediction)
    return {name: float(scores[name].fmeasure) for name in ("rouge1", "rouge2", "rougeL")}


def rouge_scores_multi(prediction: str, references: Sequence[str]) -> dict[str, float]:
    """ROUGE against several references: the best F1 per measure (LongBench takes the max)."""
    best = {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}
    for reference in references:
        for name, value in rouge_scores(prediction, reference).items():
            best[name] = max(best[name], value)
    return best


def choice_accuracy(loglikelihoods: Sequence[float], continuations: Sequence[str], label: int) -> dict[str, float]:
    """lm-eval-harness accuracy (argmax) and length-normalised accuracy (per character)."""
    if len(loglikelihoods) != len(continuations):
        raise ValueError(f"{len(loglikelihoods)} log-likelihoods for {len(continuations)} choices")
    if not all(math.isfinite(ll) for ll in loglikelihoods):
        # max() over NaN depends on the order of the choices: no accuracy can be read from it.
        raise ValueError(f"non-finite log-likelihoods {list(loglikelihoods)}: no choice can be scored")
    best = max(range(len(loglikelihoods)), key=lambda i: loglikelihoods[i])
    normalized = [ll / max(1, len(c)) for ll, c in zip(loglikelihoods, continuations, strict=True)]
    best_norm = max(range(len(normalized)), key=lambda i: normalized[i])
    return {"acc": float(best == label), "acc_norm": float(best_norm == label)}


def perplexity(nll_sum: float, n_tokens: int) -> float:
    return math.exp(nll_sum / n_tokens) if n_tokens > 0 else float("nan")


def aggregate_perplexity(items: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Corpus perplexity ``exp(sum NLL / sum tokens)`` from per-item ``nll_sum``/``n_tokens``."""
    total_nll = 0.0
    total_tokens = 0
    for metrics in items:
        total_nll += float(metrics["nll_sum"])
        total_tokens += int(metrics["n_tokens"])
    return {"ppl": perplexity(total_nll, total_tokens), "nll_sum": total_nll, "n_tokens": float(total_tokens)}


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def standard_error(values: Sequence[float]) -> float:
    """Standard error of the mean (sample std / sqrt(n)); NaN for fewer than 2 values."""
    n = len(values)
    if n < 2:
        return float("nan")
    mu = mean(values)
    variance = sum((v - mu) ** 2 for v in values) / (n - 1)
    return math.sqrt(variance / n)


def geometric_mean(values: Sequence[float]) -> float:
    if not values or any(v < 0 for v in values):
        return float("nan")
    if any(v == 0 for v in values):
        return 0.0
    return math.exp(sum(math.log(v) for v in values) / len(values))


def aggregate_item_metrics(kind: str, items: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Aggregate per-item metric dicts of one (task, method, budget).

    ``perplexity`` kind: corpus perplexity. Otherwise: the mean of every metric, plus
    ``<metric>_se`` (standard error), plus ``rouge_mean`` (geometric mean of the mean
    ROUGE-1/2/L) when ROUGE is present.
    """
    if not items:
        return {}
    if kind == "perplexity":
        return aggregate_perplexity(items)
    names: list[str] = []
    for metrics in items:
        for name in metrics:
            if name not in names:
                names.append(name)
    out: dict[str, float] = {}
    for name in names:
        values = [float(m[name]) for m in items if name in m and m[name] is not None]
        out[name] = mean(values)
        out[f"{name}_se"] = standard_error(values)
    if all(k in out for k in ("rouge1", "rouge2", "rougeL")):
        out["rouge_mean"] = geometric_mean([out["rouge1"], out["rouge2"], out["rougeL"]])
    return out
