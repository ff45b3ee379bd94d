"""``kvhive.generate_batch`` on a model whose sliding window exceeds the prompts (as Gemma 3's 512
does for most prompts): rows of different lengths below the window, or below the budget of a
method that evicts while decoding, decode together, each row giving what its prompt gives alone,
and a free slot takes a prompt of any length. The tiny Gemma 3 here slides on 3 of 4 layers with a
window of 64 tokens, over prompts of 23 to 80 tokens (one past the window)."""

from __future__ import annotations

import warnings

import pytest
import torch

import kvhive
from kvhive.cache import KVHiveCache
from kvhive.compat import cache_kwarg
from kvhive.models import tiny_model, tiny_tokenizer

WINDOW = 64
PROMPTS = (
    "Bees keep a colony warm in winter by",
    "The capital of France is",
    "A hive's bees cluster and shiver their wing muscles",
    "In winter the bees of the hive keep warm by clustering and shivering their muscles, the queen inside",
)
NEW_TOKENS = 20
BUDGET = 32  # above two of the prompts: rows that fill up beside rows that evict


@pytest.fixture(scope="module")
def model_and_tokenizer():
    model, tokenizer = tiny_model("gemma3", "gqa", sliding_window=WINDOW), tiny_tokenizer()
    lengths = [len(tokenizer(prompt)["input_ids"]) for prompt in PROMPTS]
    assert min(lengths) < BUDGET < max(lengths) - 10 and max(lengths) > WINDOW  # what the tests are about
    assert model.config.layer_types.count("sliding_attention") == 3
    return model, tokenizer


def _alone(model, tokenizer, method, budget, **options) -> list[str]:
    return [
        kvhive.generate(model, tokenizer, prompt, method, budget, max_new_tokens=NEW_TOKENS, **options)[0]
        for prompt in PROMPTS
    ]


CASES = [
    ("full", None, {}),
    ("snapkv", BUDGET, {}),
    ("tova", BUDGET, {}),
    ("h2o", BUDGET, {}),
    ("streamingllm", BUDGET, {}),
    ("buzz", BUDGET, {}),
    ("snapkv", BUDGET, {"compress_sliding": True}),
    ("h2o", BUDGET, {"compress_sliding": True}),
    ("full", None, {"compress_sliding": True}),
]


@pytest.mark.parametrize("method,budget,options", CASES)
def test_rows_below_the_window_equal_each_prompt_alone(model_and_tokenizer, method, budget, options):
    model, tokenizer = model_and_tokenizer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        texts = kvhive.generate_batch(
            model, tokenizer, list(PROMPTS), method, budget, max_new_tokens=NEW_TOKENS, **options
        )
        assert texts == _alone(model, tokenizer, method, budget, **options)
    assert len(set(texts)) > 1


@pytest.mark.parametrize("method,budget", [("full", None), ("snapkv", BUDGET), ("h2o", BUDGET), ("tova", BUDGET)])
@pytest.mark.parametrize("max_batch_size", [1, 2])
def test_a_free_slot_takes_a_prompt_of_any_length(model_and_tokenizer, method, budget, max_batch_size):
    """Prompts join as slots free up: a slot whose row held a long prompt (the window full, the
    budget reached) takes a short one, and the other way round."""
    model, tokenizer = model_and_tokenizer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        texts = kvhive.generate_batch(
            model, tokenizer, list(PROMPTS), method, budget, max_new_tokens=NEW_TOKENS, max_batch_size=max_batch_size
        )
        assert texts == _alone(model, tokenizer, method, budget)


def _prefilled(model, method, budget, prompt):
    cache = kvhive.make_cache(model, method, budget)
    with torch.no_grad():
        logits = model(input_ids=prompt, **{cache_kwarg(model): cache}, use_cache=True).logits[:, -1]
    return cache, logits


def test_sliding_rows_keep_their_own_window(model_and_tokenizer):
    """Each stacked row of a sliding layer holds what it holds alone (its tokens, at most the window
    less one) at every step, in a capacity of the window that no step reallocates: rows below the
    window grow, the row past it slides, and a row crossing the window starts to slide."""
    model, tokenizer = model_and_tokenizer
    prompts = [tokenizer(prompt, return_tensors="pt")["input_ids"] for prompt in PROMPTS]
    caches = [_prefilled(model, "full", None, prompt)[0] for prompt in prompts]
    alone = [_prefilled(model, "full", None, prompt)[0] for prompt in prompts]
    stacked = KVHiveCache.stack(caches)
    sliding = [layer for layer in stacked.layers if layer.is_sliding]
    addresses = [layer.buffers()[0].data_ptr() for layer in sliding]
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _ in range(WINDOW // 2):
            tokens = torch.randint(3, 250, (len(prompts), 1), generator=generator)
            got = model(
                input_ids=tokens,
                position_ids=stacked.next_position_ids(),
                **{cache_kwarg(model): stacked},
                use_cache=True,
            ).logits[:, -1]
            for row, cache in enumerate(alone):
                expected = model(input_ids=tokens[row : row + 1], **{cache_kwarg(model): cache}, use_cache=True)
                torch.testing.assert_close(got[row], expected.logits[0, -1], rtol=1e-4, atol=1e-5)
                for layer, own in zip(stacked.layers, cache.layers, strict=True):
                    assert layer.lengths_host[row].tolist() == own.lengths_host[0].tolist()
    assert [layer.buffers()[0].data_ptr() for layer in sliding] == addresses
    assert all(layer.buffers()[0].shape[2] == WINDOW for layer in sliding)


def test_sliding_rows_step_makes_no_host_read(model_and_tokenizer):
    """A decode step of stacked rows keeping their own windows reads nothing back
    (tests/cache/test_decode_host_reads.py)."""
    from kvhive.diagnostics import HostReadCounter

    model, tokenizer = model_and_tokenizer
    prompts = [tokenizer(prompt, return_tensors="pt")["input_ids"] for prompt in PROMPTS]
    stacked = KVHiveCache.stack([_prefilled(model, "tova", BUDGET, prompt)[0] for prompt in prompts])
    tokens = torch.ones(len(prompts), 1, dtype=torch.long)
    with torch.no_grad():
        for step in range(3):
            positions = stacked.next_position_ids()
            with HostReadCounter() as reads:
                model(input_ids=tokens, position_ids=positions, **{cache_kwarg(model): stacked}, use_cache=True)
            if step:
                assert reads.total == 0, reads


def test_the_remaining_refusal_names_what_limits(model_and_tokenizer):
    """A method that builds its state at its first eviction keeps one length per layer: rows below
    its budget beside rows above it are refused, naming the method, the layer's budget and why."""
    model, tokenizer = model_and_tokenizer
    with pytest.raises(ValueError, match="budget of 33.*'subgen' builds its state at its first eviction"):
        kvhive.generate_batch(model, tokenizer, list(PROMPTS), "subgen", 33, max_new_tokens=2)


@pytest.mark.parametrize("max_batch_size", [None, 1])
@pytest.mark.parametrize("name", ["ada-snapkv", "ada-pyramidkv", "ada-h2o"])
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_ada_kv_rows_equal_alone_or_are_refused_by_name(name, kv_heads, max_batch_size):
    """Ada-KV's rows keep different counts per head once the prompt is cut (a packed layer, no dense
    row to stack): generate_batch gives each prompt's text alone where the rows stack (one KV head,
    copies per query head; prompts within the budget), and refuses by name where they do not."""
    model = tiny_model("gemma3", "gqa", sliding_window=WINDOW, num_key_value_heads=kv_heads)
    tokenizer = tiny_tokenizer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            texts = kvhive.generate_batch(
                model, tokenizer, list(PROMPTS), name, BUDGET, max_new_tokens=8, max_batch_size=max_batch_size
            )
        except ValueError as error:
            assert f"method '{name}'" in str(error) and "head-wise budgets" in str(error)
            return
        expected = [kvhive.generate(model, tokenizer, prompt, name, BUDGET, max_new_tokens=8)[0] for prompt in PROMPTS]
    assert texts == expected
