"""Streaming perplexity on WikiText-2 (raw test split), as in BUZZ Table 3 (fixed cache sizes).

The first ``num_tokens`` tokens of ``wikitext2/wiki.test.raw`` (the file as-is, i.e. the
canonical raw text) are cut into windows of ``window`` tokens; each window is one item, fed token
by token (``Backend.streaming_nll``) with the cache kept at the budget. Each window starts with
the tokenizer's BOS token (when it has one), so every window token is predicted. The task's
metric is corpus perplexity ``exp(sum NLL / sum tokens)`` over all windows, aggregated in the
report from the per-item ``nll_sum`` and ``n_tokens``. Budgets are cache sizes in tokens (BUZZ
uses 50 and 100); a ratio budget is converted to ``round(ratio * window)`` tokens by the runner.

``prefill_tokens=P`` (default None: every token streamed) makes each window a prompt and its
continuation instead: the first ``P`` tokens of the window (BOS included) go through the model in
one forward, so the method's prefill decision applies (BUZZ's Remark 2 thinning), then the rest
is teacher-forced one token at a time with the cache kept by the method's decode rule; the NLL is
summed over the continuation, ``token_ids[P:]`` (the prompt's last logits predict the first of
them). Windows of ``P`` tokens or fewer (a short last one) are left out; the item ids name ``P``.
"""

from __future__ import annotations

from typing import Any

from ..metrics import perplexity
from .base import MAX_PROMPT_TOKENS, Item, Parameter, Task, encode, read_text_file, take

WIKITEXT_FILE = "wikitext2/wiki.test.raw"


class WikiTextPerplexityTask(Task):
    name = "ppl"
    kind = "perplexity"
    required_files = (WIKITEXT_FILE,)
    chance = float("nan")  # set at load: the vocabulary size (perplexity of a uniform guess)
    main_metric = "ppl"
    higher_is_better = False
    default_budgets = (50, 100, 200)
    source = "WikiText-2 raw test (Merity et al., 2016); BUZZ Table 3 streaming perplexity"

    @classmethod
    def default_params(cls) -> dict[str, Any]:
        return {"num_tokens": 1024, "window": 512, "prefill_tokens": None}

    @classmethod
    def parameters(cls) -> dict[str, Parameter]:
        return {
            "num_tokens": Parameter("int", 2, MAX_PROMPT_TOKENS),
            "window": Parameter("int", 2, MAX_PROMPT_TOKENS),
            "prefill_tokens": Parameter("int", 1, MAX_PROMPT_TOKENS, optional=True),
        }

    def load(self, data_dir, limit, seed, tokenizer) -> list[Item]:
        root = self.check_files(data_dir)
        num_tokens = int(self.params["num_tokens"])
        window = int(self.params["window"])
        if num_tokens < 2 or window < 2:
            raise ValueError(f"task 'ppl': num_tokens and window must be >= 2, got {num_tokens}, {window}")
        text = read_text_file(root / WIKITEXT_FILE)
        # tokenize a prefix generous enough for num_tokens (about 4 characters per token), else all
        ids = encode(tokenizer, text[: 12 * num_tokens + 1000])
        if len(ids) < num_tokens:
            ids = encode(tokenizer, text)
        ids = ids[:num_tokens]
        bos = getattr(tokenizer, "bos_token_id", None)
        prefix = [int(bos)] if bos is not None else []
        self.chance = float(len(tokenizer))
        prefill = self.params.get("prefill_tokens")
        if prefill is not None and prefill >= len(prefix) + window:
            raise ValueError(
                f"task 'ppl': prefill_tokens={prefill} leaves nothing to predict in a window of {window} tokens"
                f"{' plus BOS' if prefix else ''}; expected prefill_tokens < {len(prefix) + window}"
            )
        items = []
        for _index, start in enumerate(range(0, len(ids), window)):
            chunk = ids[start : start + window]
            if len(prefix) + len(chunk) < 2 or (prefill is not None and len(prefix) + len(chunk) <= prefill):
                continue
            metadata = {"start_token": start, "window": len(chunk)}
            suffix = ""
            if prefill is not None:
                metadata["prefill_tokens"] = int(prefill)
                suffix = f":prefill{prefill}"
            items.append(
                Item(id=f"tokens{start}-{start + len(chunk)}{suffix}", token_ids=prefix + chunk, metadata=metadata)
            )
        return take(items, limit)

    def score(self, item: Item, output: tuple[float, int]) -> dict[str, float]:
        nll_sum, n_tokens = output
        return {"ppl": perplexity(float(nll_sum), int(n_tokens)), "nll_sum": float(nll_sum), "n_tokens": int(n_tokens)}
