"""``kvhive.generate(compile=True)`` on a prompt shorter than the budget, for every method (issue 23).

Such a prompt leaves every layer below its budget: the layer fills up to it while decoding, then
evicts. The compiled decode must give the eager text in one graph (no recompilation), or refuse
before the prefill with an error naming the method and why; it must never crash mid-generation
(TOVA, H2O and the other per-step evictors used to fail inside the compiled step).
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import kvhive
from kvhive.methods.registry import method_names, policy_class
from kvhive.models.tiny import tiny_model, tiny_tokenizer

PROMPT = "a prompt"  # 9 tokens
BUDGET = 40
NEW_TOKENS = 48  # past the budget: the fill, then evictions


@pytest.mark.parametrize("method", method_names())
def test_compiled_generate_on_a_short_prompt_equals_eager_or_is_refused_by_name(method):
    torch.manual_seed(0)
    model, tokenizer = tiny_model("llama", "gqa"), tiny_tokenizer()
    budget = None if method == "full" else BUDGET
    eager, eager_cache = kvhive.generate(
        model, tokenizer, PROMPT, method, budget, max_new_tokens=NEW_TOKENS, compile=False
    )
    torch._dynamo.reset()
    counters.clear()
    policy = policy_class(method)
    refused = policy.static_decode and not policy.compiles_below_budget
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            if refused:
                with pytest.raises(ValueError, match=rf"compile=True with method '{method}'.*first eviction"):
                    kvhive.generate(model, tokenizer, PROMPT, method, budget, max_new_tokens=NEW_TOKENS, compile=True)
                return
            text, cache = kvhive.generate(
                model, tokenizer, PROMPT, method, budget, max_new_tokens=NEW_TOKENS, compile=True
            )
    finally:
        torch._dynamo.reset()
    assert text == eager
    assert counters["stats"]["unique_graphs"] >= 1  # the decode did compile
    assert cache.get_seq_length() == eager_cache.get_seq_length() > BUDGET  # through the evictions
    assert cache.statistics()["kept_tokens_per_layer"] == eager_cache.statistics()["kept_tokens_per_layer"]
