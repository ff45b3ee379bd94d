"""Joining a running batch (continuous batching): a request prefilled alone joins a stacked cache
that is decoding (``KVHiveCache.add_rows``, ``KVHiveCache.stack`` of stacked caches), and
``kvhive.generate_batch(..., max_batch_size=N)`` keeps at most N rows decoding, each waiting prompt
joining as soon as a row leaves. Every row gives exactly what its prompt gives alone."""

from __future__ import annotations

import warnings

import pytest
import torch

import kvhive
from kvhive.cache import KVHiveCache
from kvhive.compat import cache_kwarg
from kvhive.methods.registry import method_names
from kvhive.models import tiny_model, tiny_tokenizer

from helpers import REFUSED_BATCH_METHODS as REFUSED
from helpers import batch_budget as _budget

# Cache level -----------------------------------------------------------------------------------
LENGTHS = (57, 40, 73, 45)  # rows 0 and 1 start; 2 (seen more than either) and 3 join later
STEPS_BEFORE, STEPS_AFTER = 6, 6


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", "gqa")


def _token_prompts(seed: int = 4):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (1, n), generator=generator) for n in LENGTHS]


def _prefilled(model, method, budget, prompt):
    cache = kvhive.make_cache(model, method, budget)
    with torch.no_grad():
        model(input_ids=prompt, **{cache_kwarg(model): cache}, use_cache=True)
    return cache


def _decode(model, cache, tokens: torch.Tensor) -> torch.Tensor:
    """Forced tokens ``[B, n]``, one per forward with each row's own position; ``[B, n, V]`` logits."""
    logits = []
    with torch.no_grad():
        for step in range(tokens.shape[1]):
            positions = torch.tensor(cache.row_tokens_seen())[:, None]
            out = model(
                input_ids=tokens[:, step : step + 1],
                position_ids=positions,
                **{cache_kwarg(model): cache},
                use_cache=True,
            )
            logits.append(out.logits[:, -1])
    return torch.stack(logits, dim=1)


CACHE_METHODS = [
    ("full", None),
    ("snapkv", 32),
    ("pyramidkv", 32),
    ("knorm", 32),
    ("h2o", 32),
    ("h2o", 48),  # prompts 40 and 45 below the budget: rows filling up beside rows that evict
    ("tova", 32),
    ("tova", 48),
    ("streamingllm", 32),
    ("subgen", 33),
    ("random", 32),
    ("ahakv", 32),
    ("ada-snapkv", 32),
    ("buzz", 32),
    ("buzz-logn", 32),
    ("buzz", 60),  # prompts 40 and 45 below the peak: rows that have not evicted yet beside ones that have
    ("bumblebee", 32),
    ("subgen-attention", 40),
]


@pytest.mark.parametrize("method,budget", CACHE_METHODS)
def test_rows_joining_a_decoding_batch_decode_as_alone(model, method, budget):
    """Rows 0 and 1 decode some steps, row 2 (a longer prompt: it becomes the most-seen row) joins
    with add_rows, then row 3 joins through stack([running, new]); every row's logits at every step
    equal its prompt decoded alone with the same forced tokens."""
    prompts = _token_prompts()
    tokens = torch.randint(
        3, 250, (len(prompts), STEPS_BEFORE + STEPS_AFTER), generator=torch.Generator().manual_seed(1)
    )
    running = KVHiveCache.stack([_prefilled(model, method, budget, p) for p in prompts[:2]], decode_capacity=2)
    first = _decode(model, running, tokens[:2, :STEPS_BEFORE])
    running.batch_select_indices(torch.tensor([1, 0]))  # rows may leave and reorder before a join
    joining = _prefilled(model, method, budget, prompts[2])
    running.add_rows([joining])
    assert running.row_tokens_seen() == [LENGTHS[1] + STEPS_BEFORE, LENGTHS[0] + STEPS_BEFORE, LENGTHS[2]]
    order = [1, 0, 2]
    middle = _decode(model, running, tokens[order, STEPS_BEFORE : STEPS_BEFORE + 3])
    running = KVHiveCache.stack([running, _prefilled(model, method, budget, prompts[3])])
    order.append(3)
    # Row 3 gets the first forced tokens, the others go on with theirs.
    late = torch.cat([tokens[[1, 0, 2], STEPS_BEFORE + 3 :], tokens[3:, : STEPS_AFTER - 3]])
    last = _decode(model, running, late)
    assert running.row_tokens_seen() == [
        LENGTHS[1] + STEPS_BEFORE + STEPS_AFTER,
        LENGTHS[0] + STEPS_BEFORE + STEPS_AFTER,
        LENGTHS[2] + STEPS_AFTER,
        LENGTHS[3] + STEPS_AFTER - 3,
    ]

    def alone(prompt_index: int, forced: torch.Tensor) -> torch.Tensor:
        cache = _prefilled(model, method, budget, prompts[prompt_index])
        return _decode(model, cache, forced[None])[0]

    for prompt_index in (0, 1):
        row_before = first[prompt_index]
        row_after = torch.cat([middle[order.index(prompt_index)], last[order.index(prompt_index)]])
        expected = alone(prompt_index, tokens[prompt_index])
        torch.testing.assert_close(torch.cat([row_before, row_after]), expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(
        torch.cat([middle[2], last[2]]), alone(2, tokens[2, STEPS_BEFORE:]), rtol=1e-4, atol=1e-5
    )
    torch.testing.assert_close(last[3], alone(3, tokens[3, : STEPS_AFTER - 3]), rtol=1e-4, atol=1e-5)


def test_ahakv_padding_follows_the_most_seen_row(model):
    """AhaKV's n of Eq. 12 is each row's tokens seen; a stacked layer stores it as padding relative
    to the most any row has seen. A joining row that has seen more moves that count: every row's
    padding must follow."""
    prompts = _token_prompts()
    running = KVHiveCache.stack([_prefilled(model, "ahakv", 32, p) for p in prompts[:2]])
    _decode(model, running, torch.ones(2, 3, dtype=torch.long))
    running.add_rows([_prefilled(model, "ahakv", 32, prompts[2]), _prefilled(model, "ahakv", 32, prompts[3])])
    for layer in running.layers:
        most = layer.tokens_seen
        assert most == LENGTHS[2]
        assert layer.policy_state["ahakv_row_padding"] == [most - seen for seen in layer.row_tokens_seen]


def test_random_keeps_each_rows_first_real_position(model):
    """random keeps each row's first real position (its left padding) as state: a joining row,
    here one prefilled with 3 padding tokens, brings its own."""
    from kvhive.methods.random_local import FIRST_REAL_POSITION

    prompts = _token_prompts()
    running = KVHiveCache.stack([_prefilled(model, "random", 32, p) for p in prompts[:2]])
    joining = kvhive.make_cache(model, "random", 32)
    mask = torch.ones(1, LENGTHS[2], dtype=torch.long)
    mask[0, :3] = 0
    with torch.no_grad():
        model(input_ids=prompts[2], attention_mask=mask, **{cache_kwarg(model): joining}, use_cache=True)
    running.add_rows([joining])
    for layer in running.layers:
        first = layer.policy_state[FIRST_REAL_POSITION]
        assert first.shape[0] == 3
        assert [sorted(set(row.reshape(-1).tolist())) for row in first] == [[0], [0], [3]]


def test_joining_row_shorter_than_the_budget_is_refused(model):
    """A method that builds its state at its first eviction holds one length per layer: a joiner
    that kept fewer tokens (its prompt is shorter than the budget) is refused, naming the method and
    why, the running batch left as it was."""
    prompts = _token_prompts()
    running = KVHiveCache.stack([_prefilled(model, "subgen", 48, p) for p in (prompts[0], prompts[2])])
    before = running.row_tokens_seen()
    with pytest.raises(ValueError, match="different numbers of tokens.*'subgen' builds its state at its first"):
        running.add_rows([_prefilled(model, "subgen", 48, prompts[1])])  # 40 tokens < 48
    assert running.row_tokens_seen() == before
    with pytest.raises(ValueError, match="non-empty list"):
        running.add_rows([])


# generate_batch(max_batch_size=...) ------------------------------------------------------------
TEXT = (
    "The bees of the hive keep warm in winter by clustering and shivering their wing muscles, rotating from the "
    "edge to the centre of the cluster, while the queen stays warm inside."
)
PROMPT_LENGTHS = (40, 66, 53, 92, 79)  # tokens (byte-level tokenizer), >= 13 apart: > NEW_TOKENS
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return tiny_model("llama", "gqa"), tiny_tokenizer()


def _text_prompts(tokenizer) -> list[str]:
    prompts = [TEXT[:n] for n in PROMPT_LENGTHS]
    assert [len(tokenizer(prompt)["input_ids"]) for prompt in prompts] == list(PROMPT_LENGTHS)
    return prompts


def _cut_at_stop(tokenizer, text: str, stops: list[str]) -> str:
    """What a row stopped by ``stops`` returns: its text alone up to the first token whose text
    contains a stop string (byte-level tokens: the text's bytes)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    for count in range(1, len(ids) + 1):
        prefix = tokenizer.decode(ids[:count], skip_special_tokens=True)
        if any(stop in prefix for stop in stops):
            return prefix
    return text


def _stops_at_different_steps(alone: list[str]) -> list[list[str]]:
    """Per-row stop strings taken from each text alone: prompts 0, 2 and 3 stop early (a stop string
    that is the start of its text, so it first appears at its last character: after 3, 6 and 9
    characters), prompts 1 and 4 run to max_new_tokens."""
    cuts = {0: 3, 2: 6, 3: 9}
    return [[alone[row][: cuts[row]]] if row in cuts else [] for row in range(len(alone))]


@pytest.mark.parametrize("name", method_names())
def test_max_batch_size_rows_equal_each_prompt_alone(model_and_tokenizer, name):
    model, tokenizer = model_and_tokenizer
    prompts = _text_prompts(tokenizer)
    budget = _budget(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name in REFUSED:
            with pytest.raises(ValueError, match=f"method '{name}' cannot stack caches.*{REFUSED[name]}"):
                kvhive.generate_batch(model, tokenizer, prompts, name, budget, NEW_TOKENS, max_batch_size=2)
            return
        alone = [kvhive.generate(model, tokenizer, p, name, budget, max_new_tokens=NEW_TOKENS)[0] for p in prompts]
        stops = _stops_at_different_steps(alone)
        texts = kvhive.generate_batch(
            model, tokenizer, prompts, name, budget, NEW_TOKENS, stop_strings=stops, max_batch_size=2
        )
    expected = [_cut_at_stop(tokenizer, text, row_stops) for text, row_stops in zip(alone, stops, strict=True)]
    assert texts == expected
    assert len({len(text) for text in texts}) > 1  # rows stopped at different steps
    assert len(set(texts)) > 1  # the rows said different things (not one row copied)


def _record_decode_steps(model) -> tuple[list[list[int]], object]:
    """A forward pre-hook recording, for every decode forward (one token per row), each row's
    position: prompts whose lengths are more than max_new_tokens apart are told apart by it."""
    steps: list[list[int]] = []

    def hook(module, args, kwargs):
        input_ids = kwargs.get("input_ids")
        if input_ids is not None and input_ids.shape[1] == 1 and kwargs.get("position_ids") is not None:
            # The batch has fixed slots: a free slot decodes a placeholder; only running rows count.
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            running = cache.active_slots
            positions = kwargs["position_ids"][:, 0].tolist()
            steps.append([position for position, active in zip(positions, running, strict=True) if active])

    return steps, model.register_forward_pre_hook(hook, with_kwargs=True)


def _prompt_of(position: int) -> int:
    """The prompt whose row decodes at ``position`` (its length up to its length + NEW_TOKENS)."""
    (match,) = [i for i, n in enumerate(PROMPT_LENGTHS) if n <= position < n + NEW_TOKENS]
    return match


@pytest.mark.parametrize("name", ["h2o", "snapkv", "full"])
def test_prompts_join_while_the_first_rows_decode(model_and_tokenizer, name):
    """With max_batch_size=2 and 5 prompts: no decode step runs more than 2 rows, and a waiting
    prompt decodes in the same step as a row of the first batch (it joined mid-decode, not after
    the whole first batch ended)."""
    model, tokenizer = model_and_tokenizer
    prompts = _text_prompts(tokenizer)
    budget = _budget(name)
    alone = [kvhive.generate(model, tokenizer, p, name, budget, max_new_tokens=NEW_TOKENS)[0] for p in prompts]
    stops = _stops_at_different_steps(alone)
    steps, handle = _record_decode_steps(model)
    try:
        texts = kvhive.generate_batch(
            model, tokenizer, prompts, name, budget, NEW_TOKENS, stop_strings=stops, max_batch_size=2
        )
    finally:
        handle.remove()
    assert texts == [_cut_at_stop(tokenizer, t, s) for t, s in zip(alone, stops, strict=True)]
    batches = [sorted(_prompt_of(position) for position in step) for step in steps]
    assert max(len(batch) for batch in batches) == 2
    assert batches[0] == [0, 1]
    mixed = [batch for batch in batches if 1 in batch and any(prompt >= 2 for prompt in batch)]
    assert mixed, f"no waiting prompt decoded beside row 1 of the first batch: {batches}"
    # Every prompt decoded as many steps as it generated tokens after its first (from its prefill).
    for prompt_index, text in enumerate(texts):
        decoded = sum(prompt_index in batch for batch in batches)
        assert decoded == len(tokenizer(text, add_special_tokens=False)["input_ids"]) - 1


def test_max_batch_size_one_and_larger_than_the_prompts(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    prompts = _text_prompts(tokenizer)[:3]
    together = kvhive.generate_batch(model, tokenizer, prompts, "tova", 32, max_new_tokens=6)
    assert kvhive.generate_batch(model, tokenizer, prompts, "tova", 32, max_new_tokens=6, max_batch_size=1) == together
    assert kvhive.generate_batch(model, tokenizer, prompts, "tova", 32, max_new_tokens=6, max_batch_size=9) == together


def test_joining_prompt_is_prefilled_in_chunks(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    prompts = _text_prompts(tokenizer)
    texts = kvhive.generate_batch(
        model, tokenizer, prompts, "snapkv", 32, max_new_tokens=8, prefill_chunk=16, max_batch_size=2
    )
    alone = [kvhive.generate(model, tokenizer, p, "snapkv", 32, max_new_tokens=8, prefill_chunk=16)[0] for p in prompts]
    assert texts == alone


def test_prompt_ending_at_its_first_token_never_joins(model_and_tokenizer):
    """A waiting prompt whose first token (from its prefill) is an end token is done: the next one
    takes the slot. Rows end at their own end token as alone."""
    model, tokenizer = model_and_tokenizer
    prompts = _text_prompts(tokenizer)
    alone = [kvhive.generate(model, tokenizer, p, "h2o", 32, max_new_tokens=8)[0] for p in prompts]
    eos = tokenizer(alone[3], add_special_tokens=False)["input_ids"][0]  # prompt 3 ends at once
    texts = kvhive.generate_batch(model, tokenizer, prompts, "h2o", 32, 8, eos_token_id=eos, max_batch_size=2)
    for text, full in zip(texts, alone, strict=True):
        ids = tokenizer(full, add_special_tokens=False)["input_ids"]
        cut = ids.index(eos) + 1 if eos in ids else len(ids)
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == ids[:cut]
    assert len(tokenizer(texts[3], add_special_tokens=False)["input_ids"]) == 1


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True])
def test_invalid_max_batch_size(model_and_tokenizer, value):
    model, tokenizer = model_and_tokenizer
    with pytest.raises(ValueError, match=r"max_batch_size.*integer >= 1"):
        kvhive.generate_batch(model, tokenizer, ["a b c"], "h2o", 32, max_batch_size=value)


@pytest.mark.parametrize("name", ["full", "h2o", "snapkv", "ahakv"])
def test_sliding_window_layers_join(name):
    """Gemma 3's sliding-window layers (window 8 in the tiny model): a joining row's window sits at
    its own positions."""
    model, tokenizer = tiny_model("gemma3", "gqa"), tiny_tokenizer()
    prompts = _text_prompts(tokenizer)
    budget = _budget(name)
    texts = kvhive.generate_batch(model, tokenizer, prompts, name, budget, max_new_tokens=8, max_batch_size=2)
    assert texts == [kvhive.generate(model, tokenizer, p, name, budget, max_new_tokens=8)[0] for p in prompts]


def test_cli_max_batch_size(tmp_path, capsys):
    import json

    from kvhive.cli import main

    model, tokenizer = tiny_model("llama", "gqa"), tiny_tokenizer()
    prompts = _text_prompts(tokenizer)
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(prompts) + "\n", encoding="utf-8")
    base = ["generate", "--model", "tiny-llama-gqa", "--method", "h2o", "--budget", "32", "--max-new-tokens", "5"]
    assert main([*base, "--prompts-file", str(path), "--max-batch-size", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    expected = [kvhive.generate(model, tokenizer, p, "h2o", 32, max_new_tokens=5)[0] for p in prompts]
    assert [json.loads(line) for line in lines] == expected
    with pytest.raises(SystemExit):
        main([*base, "--prompts-file", str(path), "--max-batch-size", "0"])
    assert "--max-batch-size must be an integer >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="applies to --prompts-file"):
        main([*base, "--max-batch-size", "2", "a prompt"])
