"""A deterministic scripted stand-in for a model, used only by the evaluation tests.

Moved out of the public package (``kvhive/evaluation/backend.py``): it is test scaffolding, not
an API.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Sequence
from typing import Any

from kvhive.evaluation.backend import FULL_METHOD, Setting, budget_to_tokens

_WORD_RE = re.compile(r"\S+\s*")


def _norm_word(word: str) -> str:
    return re.sub(r"[^0-9a-z]", "", word.lower())


class FakeTokenizer:
    """Word-level tokenizer (one token per whitespace-separated word plus its trailing space).

    The vocabulary grows as text is seen, so ``decode(encode(text)) == text`` for any text that
    does not start with whitespace. Ids 0-2 are reserved (pad, bos, eos).
    """

    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2
    name_or_path = "fake-word-tokenizer"

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._words: list[str] = ["<pad>", "<bos>", "<eos>"]

    def __len__(self) -> int:
        return len(self._words)

    def _id(self, piece: str) -> int:
        if piece not in self._ids:
            self._ids[piece] = len(self._words)
            self._words.append(piece)
        return self._ids[piece]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self._id(piece) for piece in _WORD_RE.findall(text)]
        return ([self.bos_token_id] if add_special_tokens else []) + ids

    def __call__(self, text: str, add_special_tokens: bool = True, **_: Any) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(self._words[i] for i in ids if i >= 3)  # special tokens decode to nothing


class FakeBackend:
    """Deterministic scripted "model" for tests; quality depends on method and budget in a known way.

    The prompt is split into words; a setting keeps ``k`` of them (all for ``full``; ``budget``
    words for an int budget; ``round(budget * n)`` for a ratio):

    * ``local``: the last ``k`` words; ``streamingllm``: the first 4 + the last ``k - 4``;
      ``random``: a seeded random half + the most recent half;
    * any other method ("query-aware"): words near a rare word of the prompt's last 12 words score
      high (a crude SnapKV), the top ``k`` by score are kept, ties broken by recency.

    ``generate`` is an induction-head copier: it finds the longest suffix (2..8 words) of the
    prompt that also occurs earlier among the kept words and copies the kept words that follow;
    ``"unknown"`` when nothing matches. So retrieval tasks succeed exactly when the compression
    kept the needle. ``choice_loglikelihoods`` scores each continuation word -0.5 if it occurs in
    the kept context, -2.0 otherwise. ``streaming_nll`` charges 0.5 nats for a token present in
    the kept cache, 3.0 otherwise (full cache keeps all previous tokens).

    ``delay`` seconds of sleep per call (to test killing a run mid-grid); ``calls`` records
    ``(kind, settings)`` of every call. ``minimum_budgets`` ({method: tokens}) makes a setting whose
    budget resolves below its method's minimum infeasible, as a real method's window would.
    """

    model_name = "fake"

    def __init__(
        self,
        delay: float = 0.0,
        max_context: int = 1_000_000,
        tokenizer: Any = None,
        minimum_budgets: dict[str, int] | None = None,
    ) -> None:
        self.tokenizer = tokenizer if tokenizer is not None else FakeTokenizer()
        self.max_context = max_context
        self.delay = delay
        self.minimum_budgets = dict(minimum_budgets or {})
        self.calls: list[tuple[str, list[Setting]]] = []

    def infeasible(self, setting: Setting, context_tokens: int) -> str | None:
        minimum = self.minimum_budgets.get(setting.method)
        if minimum is None or setting.method == FULL_METHOD:
            return None
        tokens = budget_to_tokens(setting.budget, context_tokens)
        if tokens < minimum:
            return f"budget {tokens} tokens < {setting.method}'s minimum {minimum}"
        return None

    def _check_feasible(self, settings: list[Setting], context_tokens: int) -> None:
        for setting in settings:
            reason = self.infeasible(setting, context_tokens)
            if reason:
                raise ValueError(f"FakeBackend called with an infeasible setting {setting.label}: {reason}")

    # -- helpers
    def _record(self, kind: str, settings: list[Setting]) -> None:
        self.calls.append((kind, list(settings)))
        if self.delay:
            time.sleep(self.delay)

    @staticmethod
    def _kept_count(budget: float | int, n: int, method: str) -> int:
        if method == FULL_METHOD:
            return n
        return min(n, budget_to_tokens(budget, n))

    def _kept_positions(self, words: list[str], setting: Setting) -> list[int]:
        n = len(words)
        k = self._kept_count(setting.budget, n, setting.method)
        if k >= n:
            return list(range(n))
        method = setting.method
        if method == "local":
            return list(range(n - k, n))
        if method == "streamingllm":
            sink = min(4, k)
            return list(range(sink)) + list(range(n - (k - sink), n)) if k > sink else list(range(sink))
        if method == "random":
            recent = k - k // 2
            rng = random.Random(f"{n}-{k}")
            older = sorted(rng.sample(range(n - recent), k // 2))
            return older + list(range(n - recent, n))
        # query-aware: rarity-weighted match with the last 12 words, spread to a window around it
        normed = [_norm_word(w) for w in words]
        counts: dict[str, int] = {}
        for w in normed:
            counts[w] = counts.get(w, 0) + 1
        query = set(normed[-12:]) - {""}
        base = [1.0 / counts[w] if w in query else 0.0 for w in normed]
        score = [max(base[max(0, i - 8) : i + 3]) for i in range(n)]
        order = sorted(range(n), key=lambda i: (score[i], i), reverse=True)
        return sorted(order[:k])

    def _generate_one(self, prompt: str, max_new_tokens: int, setting: Setting) -> str:
        words = prompt.split()
        if not words:
            return "unknown"
        kept = self._kept_positions(words, setting)
        kept_words = [words[i] for i in kept]
        normed = [_norm_word(w) for w in kept_words]
        target = [_norm_word(w) for w in words]
        for length in range(min(8, len(words) - 1), 1, -1):
            suffix = target[-length:]
            # search occurrences that end before the prompt's own suffix (the last `length` kept words)
            for start in range(len(normed) - length - 1, -1, -1):
                if normed[start : start + length] == suffix:
                    follow = kept_words[start + length : start + length + max_new_tokens]
                    if follow:
                        return " " + " ".join(follow)
        return " unknown"

    # -- Backend protocol
    def generate(self, prompt: str, max_new_tokens: int, settings: list[Setting]) -> list[str]:
        self._record("generate", settings)
        self._check_feasible(settings, len(self.tokenizer.encode(prompt)))
        return [self._generate_one(prompt, max_new_tokens, s) for s in settings]

    def choice_loglikelihoods(
        self, context: str, continuations: list[str], settings: list[Setting]
    ) -> list[list[float]]:
        self._record("choice", settings)
        self._check_feasible(settings, len(self.tokenizer.encode(context)))
        words = context.split()
        out = []
        for setting in settings:
            kept = {_norm_word(words[i]) for i in self._kept_positions(words, setting)}
            out.append([sum(-0.5 if _norm_word(w) in kept else -2.0 for w in cont.split()) for cont in continuations])
        return out

    def streaming_nll(
        self, token_ids: list[int], settings: list[Setting], prefill_tokens: int = 1
    ) -> list[tuple[float, int]]:
        self._record("streaming", settings)
        self._check_feasible(settings, len(token_ids))
        out = []
        for setting in settings:
            nll = 0.0
            for i in range(prefill_tokens, len(token_ids)):
                history = token_ids[:i]
                if setting.method == FULL_METHOD:
                    cache = history
                else:
                    k = min(len(history), budget_to_tokens(setting.budget, len(token_ids)))
                    if setting.method in ("local", "streamingllm", "random"):
                        sink = 4 if setting.method == "streamingllm" else 0
                        cache = history[: min(sink, k)] + history[len(history) - max(0, k - sink) :]
                    else:  # heavy hitters: most frequent tokens + recent half
                        recent = history[len(history) - (k - k // 2) :] if k - k // 2 > 0 else []
                        freq: dict[int, int] = {}
                        for t in history:
                            freq[t] = freq.get(t, 0) + 1
                        heavy = sorted(freq, key=lambda t: (freq[t], t), reverse=True)[: k // 2]
                        cache = recent + heavy
                nll += 0.5 if token_ids[i] in set(cache) else 3.0
            out.append((nll, len(token_ids) - prefill_tokens))
        return out
