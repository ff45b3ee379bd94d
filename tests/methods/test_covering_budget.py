"""A budget far above the prompt (10**9 tokens: everything fits) costs what the tokens held cost:
every method keeps every token, gives the full cache's logits and texts, and allocates no tensor
sized by the budget. The largest tensor any op produces is measured with a torch dispatch mode; a
state sized ``budget`` (or ``budget**2``) either fails to allocate or shows up there."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import kvhive
from kvhive.methods.registry import method_names
from kvhive.models import tiny_model, tiny_tokenizer

from helpers import left_padded_batch, prefill_and_decode

COVERING_BUDGET = 10**9
STEPS = 6
# The tiny models' largest tensors are the logits of a prompt ([2, 40, vocab] floats, about 80 kB)
# and their weights; a state sized by the budget takes gigabytes.
LARGEST_TENSOR_BYTES = 1 << 20
FACTORY_OPS = {"empty", "zeros", "ones", "full", "empty_strided", "new_empty", "new_zeros", "new_ones", "new_full"}


class LargestTensor(TorchDispatchMode):
    """The bytes of the largest tensor storage any op returns while active. A factory op asked for
    more than ``LARGEST_TENSOR_BYTES`` elements fails before it allocates (a budget-sized buffer
    would otherwise take the machine's memory before the test could fail)."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0
        self.op = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        size = args[1] if func.__name__.startswith("new_") else args[0] if args else None
        if func.__name__.split(".")[0] in FACTORY_OPS and isinstance(size, (list, tuple)):
            elements = math.prod(int(extent) for extent in size)
            assert elements <= LARGEST_TENSOR_BYTES, f"{func} asked for a tensor of {elements} elements"
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor) and item.untyped_storage().nbytes() > self.nbytes:
                self.nbytes, self.op = item.untyped_storage().nbytes(), func
        return out


_MODELS: dict = {}


def _model(architecture: str):
    if architecture not in _MODELS:
        model = tiny_model(architecture, "gqa")
        input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=40, pad=5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            full = prefill_and_decode(model, kvhive.make_cache(model, "full"), input_ids, attention_mask, STEPS)
        _MODELS[architecture] = model, input_ids, attention_mask, full
    return _MODELS[architecture]


@pytest.mark.parametrize("method", method_names())
@pytest.mark.parametrize("architecture", ["llama", "gemma3"])
def test_a_covering_budget_costs_only_the_tokens_held(method, architecture):
    model, input_ids, attention_mask, full = _model(architecture)
    with warnings.catch_warnings(), LargestTensor() as largest:
        warnings.simplefilter("ignore")
        cache = kvhive.make_cache(model, method, budget=COVERING_BUDGET)
        logits = prefill_and_decode(model, cache, input_ids, attention_mask, STEPS)
    assert largest.nbytes <= LARGEST_TENSOR_BYTES, f"{largest.op} made a tensor of {largest.nbytes} bytes"
    if method != "buzz-logn":  # rescales the attention logits by design (tests/methods/test_buzz.py)
        assert (logits - full).abs().max() <= 1e-5


@pytest.mark.parametrize("method", method_names())
def test_a_covering_budget_in_a_batch_costs_only_the_tokens_held(method):
    model, tokenizer = tiny_model("llama", "gqa"), tiny_tokenizer()
    # Prompts of one length (the tiny tokenizer is byte-level): rows below the budget keep one length.
    prompts = ["The bees of the hive keep warm in winter", "In winter the cluster rotates from the e"]
    assert len({len(tokenizer(prompt)["input_ids"]) for prompt in prompts}) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = kvhive.generate_batch(model, tokenizer, prompts, "full", max_new_tokens=STEPS)
        with LargestTensor() as largest:
            texts = kvhive.generate_batch(model, tokenizer, prompts, method, COVERING_BUDGET, max_new_tokens=STEPS)
    assert largest.nbytes <= LARGEST_TENSOR_BYTES, f"{largest.op} made a tensor of {largest.nbytes} bytes"
    if method != "buzz-logn":
        assert texts == full
