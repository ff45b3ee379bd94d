"""Question-aware chunked prefill (issue 24): every chunk of a chunked prefill that holds only
context is fed followed by a copy of the prompt's question at the positions right after the chunk;
a prefill-only method scores the kept tokens and the chunk with the copy's queries, and the copy's
entries are dropped. The last chunk ends with the real question, as without a question.
"""

from __future__ import annotations

import pytest
import torch

import kvhive
from kvhive.api import prefill_prompt, prompt_chunks, question_token_count
from kvhive.methods.base import PREFILL, ScoringInputs
from kvhive.models.tiny import tiny_model, tiny_tokenizer

BUDGET = 48
CHUNK = 64
QUESTION = 20
LENGTH = 300
PARAMETERS = {"snapkv": {"window": 4}, "pyramidkv": {"window": 4}}
METHODS = ["snapkv", "pyramidkv", "knorm"]


def _model():
    torch.manual_seed(0)
    return tiny_model("llama", "gqa")


def _prompt_ids(model, length=LENGTH):
    return torch.randint(3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(1))


def _watch(model, cache):
    """Per forward: the positions the model was given (the rotary embedding's position ids) and,
    after it, each compressed layer's (tokens seen, kept per head, newest kept position, budget)."""
    forwards = []

    def rotary_hook(module, args, kwargs):
        position_ids = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        forwards.append({"positions": position_ids[0].tolist()})

    def after_forward(module, args, kwargs, output):
        forwards[-1]["layers"] = [
            (
                cache.layers[i].tokens_seen,
                cache.layers[i].max_length,
                int(cache.layers[i].dense()[2].max()),
                cache.layer_budgets[i],
            )
            for i in cache.compressed_layers
        ]

    handles = [
        model.model.rotary_emb.register_forward_pre_hook(rotary_hook, with_kwargs=True),
        model.register_forward_hook(after_forward, with_kwargs=True),
    ]
    return forwards, handles


@pytest.mark.parametrize("method", METHODS)
def test_one_chunk_covering_the_prompt_is_the_one_shot_prefill(method):
    model, tokenizer = _model(), tiny_tokenizer()
    question = " which word came first?"
    prompt = " ".join(f"word{i}" for i in range(60)) + question
    parameters = PARAMETERS.get(method, {})
    one_shot, one_shot_cache = kvhive.generate(model, tokenizer, prompt, method, BUDGET, max_new_tokens=6, **parameters)
    chunked, chunked_cache = kvhive.generate(
        model,
        tokenizer,
        prompt,
        method,
        BUDGET,
        max_new_tokens=6,
        prefill_chunk=100_000,
        question=question,
        **parameters,
    )
    assert chunked_cache.question_tokens == question_token_count(tokenizer, prompt, question) > 1
    assert chunked == one_shot
    for index in one_shot_cache.compressed_layers:
        keys, _, positions, _ = one_shot_cache.layers[index].dense()
        chunked_keys, _, chunked_positions, _ = chunked_cache.layers[index].dense()
        assert torch.equal(positions, chunked_positions)
        assert torch.equal(keys, chunked_keys)


def test_without_a_question_the_chunked_prefill_is_unchanged():
    model = _model()
    ids = _prompt_ids(model)
    results = []
    for question_tokens in (None, "unset"):
        options = {} if question_tokens == "unset" else {"question_tokens": None}
        cache = kvhive.make_cache(model, "snapkv", BUDGET, window=4, prefill_chunk=CHUNK, **options)
        logits = prefill_prompt(model, ids, cache)
        results.append((logits, [cache.layers[i].dense() for i in cache.compressed_layers]))
    assert torch.equal(results[0][0], results[1][0])
    for first, second in zip(results[0][1], results[1][1], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(first[:3], second[:3], strict=True))
    assert prompt_chunks(300, 64) == [(0, 64, 0), (64, 128, 0), (128, 192, 0), (192, 256, 0), (256, 300, 0)]


@pytest.mark.parametrize("method", METHODS)
def test_each_chunk_keeps_the_budget_and_no_entry_of_the_question(method):
    model = _model()
    ids = _prompt_ids(model)
    cache = kvhive.make_cache(
        model, method, BUDGET, prefill_chunk=CHUNK, question_tokens=QUESTION, **PARAMETERS.get(method, {})
    )
    forwards, handles = _watch(model, cache)
    try:
        prefill_prompt(model, ids, cache)
    finally:
        for handle in handles:
            handle.remove()
    # Chunks [0, 64) ... [192, 256) hold only context: each is followed by the question (the last
    # 20 tokens) at the positions right after it; the last chunk [256, 300) ends with the real one.
    chunks = prompt_chunks(LENGTH, CHUNK, QUESTION)
    assert [copy for _, _, copy in chunks] == [QUESTION] * 4 + [0]
    assert len(forwards) == len(chunks)
    for forward, (start, stop, copy) in zip(forwards, chunks, strict=True):
        assert forward["positions"] == list(range(start, stop + copy))
        for seen, kept, newest, budget in forward["layers"]:
            assert seen == stop  # the copy is forgotten: the next chunk continues at the chunk's end
            assert kept == min(budget, stop)  # the budget, none of it spent on the copy
            assert newest < stop  # no entry of the copy remains
            if method != "knorm":  # the others keep their recent window
                assert newest == stop - 1
    assert cache.get_seq_length() == LENGTH


def test_a_chunk_reaching_into_the_question_gets_no_copy():
    # The question (100 tokens) starts inside the chunk [192, 256): that chunk and the last are fed
    # as they are; a copy is appended only to chunks of context alone.
    assert prompt_chunks(300, 64, 100) == [(0, 64, 100), (64, 128, 100), (128, 192, 100), (192, 256, 0), (256, 300, 0)]
    assert prompt_chunks(300, 1000, 100) == [(0, 300, 0)]


@pytest.mark.parametrize("method", ["snapkv", "pyramidkv"])
def test_the_first_chunk_is_scored_with_the_question_queries_at_their_positions(method):
    # The first chunk's forward is the chunk followed by the question at positions 0..c+K-1, every
    # layer attending everything (a layer is cut after its attention): a full cache's prefill of
    # the same tokens records each layer's keys and queries. The question-aware decision must be
    # the method's choice among the chunk's keys scored by the question's queries.
    model = _model()
    ids = _prompt_ids(model)
    question = ids[:, -QUESTION:]
    cache = kvhive.make_cache(
        model, method, BUDGET, prefill_chunk=CHUNK, question_tokens=QUESTION, **PARAMETERS[method]
    )
    cache.plan_prompt(LENGTH)
    cache.question_copy_tokens = QUESTION
    with torch.no_grad():
        model(input_ids=torch.cat([ids[:, :CHUNK], question], dim=1), past_key_values=cache)
    cache.question_copy_tokens = 0
    recorder = kvhive.make_cache(model, "full", compress_sliding=True, record_prefill=True)
    with torch.no_grad():
        model(input_ids=torch.cat([ids[:, :CHUNK], question], dim=1), past_key_values=recorder)
    policy = cache.policy
    for index in cache.compressed_layers:
        keys, values, positions, _ = recorder.layers[index].dense()
        queries, _, scaling = recorder.prefill_records[index]
        scoring = ScoringInputs(
            keys=keys[:, :, :CHUNK],
            values=values[:, :, :CHUNK],
            queries=queries[:, :, -QUESTION:],
            positions=positions[:, :, :CHUNK],
            mask=torch.ones(1, 1, QUESTION, CHUNK, dtype=torch.bool),
            scaling=scaling,
            layer_index=index,
            num_layers=len(cache.layers),
            sequence_length=CHUNK + QUESTION,
            phase=PREFILL,
        )
        budget = cache.layer_budgets[index]
        keep = policy.select_prefill(scoring, budget, {})
        expected = positions[:, :, :CHUNK][keep].reshape(1, keys.shape[1], -1)
        kept_keys, _, kept_positions, _ = cache.layers[index].dense()
        assert torch.equal(kept_positions, expected)
        assert torch.allclose(kept_keys, keys[:, :, :CHUNK][keep].reshape(kept_keys.shape))


@pytest.mark.parametrize("method", ["snapkv", "pyramidkv"])
def test_the_question_changes_what_a_chunk_keeps(method):
    # Scored by the question's queries, not the chunk's own last ones: every compressed layer ends
    # with another selection (a test that fails if the copy were ignored).
    model = _model()
    ids = _prompt_ids(model)
    kept = {}
    for question_tokens in (None, QUESTION):
        cache = kvhive.make_cache(
            model, method, BUDGET, prefill_chunk=CHUNK, question_tokens=question_tokens, **PARAMETERS[method]
        )
        prefill_prompt(model, ids, cache)
        kept[question_tokens] = [cache.layers[i].dense()[2] for i in cache.compressed_layers]
    assert all(not torch.equal(a, b) for a, b in zip(kept[None], kept[QUESTION], strict=True))


def test_question_aware_prefill_in_generate_continues_to_decode():
    model, tokenizer = _model(), tiny_tokenizer()
    question = " which word came first?"
    prompt = " ".join(f"word{i}" for i in range(60)) + question
    text, cache = kvhive.generate(
        model, tokenizer, prompt, "snapkv", BUDGET, max_new_tokens=6, prefill_chunk=32, question=question, window=4
    )
    assert isinstance(text, str) and len(text) > 0
    prompt_tokens = tokenizer(prompt, return_tensors="pt").input_ids.shape[1]
    assert cache.get_seq_length() == prompt_tokens + 5
    positions = [cache.layers[i].dense()[2] for i in cache.compressed_layers]
    assert all(int(p.max()) == prompt_tokens + 4 for p in positions)
    assert all(cache.layers[i].max_length <= BUDGET + 5 for i in cache.compressed_layers)
    # The same through the cache option (question_tokens) gives the same text.
    again, _ = kvhive.generate(
        model,
        tokenizer,
        prompt,
        "snapkv",
        BUDGET,
        max_new_tokens=6,
        prefill_chunk=32,
        question_tokens=cache.question_tokens,
        window=4,
    )
    assert again == text


def test_invalid_question_inputs_are_refused():
    model, tokenizer = _model(), tiny_tokenizer()
    for bad in (0, -3, True, 2.0, "5"):
        with pytest.raises(ValueError, match=r"invalid question_tokens=.*expected an integer >= 1"):
            kvhive.make_cache(model, "snapkv", 32, window=4, prefill_chunk=64, question_tokens=bad)
    with pytest.raises(ValueError, match="question_tokens=8 needs prefill_chunk"):
        kvhive.make_cache(model, "snapkv", 32, window=4, question_tokens=8)
    with pytest.raises(ValueError, match="method 'h2o' evicts by its decode rule"):
        kvhive.make_cache(model, "h2o", 32, prefill_chunk=64, question_tokens=8)
    with pytest.raises(ValueError, match="method 'full' never evicts"):
        kvhive.make_cache(model, "full", prefill_chunk=64, question_tokens=8)
    cache = kvhive.make_cache(model, "snapkv", 32, window=4, prefill_chunk=64, question_tokens=60)
    with pytest.raises(ValueError, match=r"invalid question_tokens=60: expected fewer than the prompt's 60 tokens"):
        cache.plan_prompt(60)
    prompt = " ".join(f"word{i}" for i in range(30)) + " which?"
    with pytest.raises(ValueError, match="the prompt does not end with it"):
        kvhive.generate(model, tokenizer, prompt, "snapkv", 32, prefill_chunk=16, question=" what?", window=4)
    with pytest.raises(ValueError, match=r"invalid question=''"):
        kvhive.generate(model, tokenizer, prompt, "snapkv", 32, prefill_chunk=16, question="", window=4)
    with pytest.raises(ValueError, match="question needs prefill_chunk"):
        kvhive.generate(model, tokenizer, prompt, "snapkv", 32, question=" which?", window=4)
    with pytest.raises(ValueError, match="either question .* or question_tokens"):
        kvhive.generate(
            model, tokenizer, prompt, "snapkv", 32, prefill_chunk=16, question=" which?", question_tokens=3, window=4
        )
    with pytest.raises(ValueError, match="expected at least one token and some context before it"):
        question_token_count(tokenizer, prompt, prompt)


# -- the evaluation harness ----------------------------------------------------------------------


def test_the_prefill_question_cache_option():
    from kvhive.evaluation.backend import Setting, split_cache_options, with_cache_options

    spec = "snapkv:window=4:prefill_chunk=64:prefill_question=true"
    assert split_cache_options(spec) == ("snapkv:window=4", {"prefill_chunk": 64, "prefill_question": True})
    assert split_cache_options("snapkv:prefill_chunk=64:prefill_question=false") == ("snapkv", {"prefill_chunk": 64})
    assert with_cache_options("snapkv:window=4", {"prefill_question": True, "prefill_chunk": 64}) == spec
    assert Setting(spec, 0.2).prefill_question and not Setting("snapkv:prefill_chunk=64", 0.2).prefill_question
    with pytest.raises(ValueError, match="prefill_question must be true or false, got '1'"):
        split_cache_options("snapkv:prefill_chunk=64:prefill_question=1")
    with pytest.raises(
        ValueError, match="prefill_question=true makes a chunked prefill question-aware; give prefill_chunk"
    ):
        split_cache_options("snapkv:prefill_question=true")


def test_tasks_separate_their_question():
    from kvhive.evaluation.cli import default_data_dir
    from kvhive.evaluation.tasks import get_task, parse_task_spec

    tokenizer = tiny_tokenizer()
    for spec in ("needle:lengths=300:depths=50", "needle_multikey:lengths=300:depths=50", "mdqa", "kv_retrieval"):
        name, params = parse_task_spec(spec)
        task = get_task(name, **params)
        item = task.load(default_data_dir(), 1, 0, tokenizer)[0]
        assert item.question and item.prompt.endswith(item.question) and item.question.startswith("\n\n")


def test_a_question_aware_setting_runs_in_the_harness(tmp_path):
    from kvhive.cli import main as kvhive_main
    from kvhive.evaluation import read_results
    from kvhive.evaluation.cli import default_data_dir

    out = tmp_path / "question"
    methods = (
        "snapkv:window=4,snapkv:window=4:prefill_chunk=100000:prefill_question=true,"
        "snapkv:window=4:prefill_chunk=64:prefill_question=true,h2o:prefill_chunk=64:prefill_question=true"
    )
    tasks = "needle:lengths=300:depths=50:max_new_tokens=6,synthetic_recall:num_pairs=6"
    arguments = ["eval", "--model", "tiny-llama-gqa", "--tasks", tasks, "--methods", methods, "--budgets", "0.3"]
    arguments += ["--limit", "1", "--data-dir", str(default_data_dir()), "--out", str(out), "--no-progress"]
    assert kvhive_main(arguments) == 0
    by_key = {(r["task"], r["setting"]): r for r in read_results(out)}
    one_shot = by_key[("needle", "snapkv:window=4@0.3")]
    whole = by_key[("needle", "snapkv:window=4:prefill_chunk=100000:prefill_question=true@0.3")]
    chunked = by_key[("needle", "snapkv:window=4:prefill_chunk=64:prefill_question=true@0.3")]
    assert whole["output"] == one_shot["output"] and whole["cache"] == one_shot["cache"]
    assert chunked["status"] == "ok" and chunked["prefill_question"] is True and chunked["prefill_chunk"] == 64
    assert "prefill_question" not in one_shot
    # A method that evicts while decoding takes no question; a task without one has none to give.
    h2o = by_key[("needle", "h2o:prefill_chunk=64:prefill_question=true@0.3")]
    assert h2o["status"] == "not_applicable" and "evicts by its decode rule" in h2o["reason"]
    recall = by_key[("synthetic_recall", "snapkv:window=4:prefill_chunk=64:prefill_question=true@0.3")]
    assert recall["status"] == "not_applicable" and "separates no question" in recall["reason"]


def test_the_cli_flag_needs_a_chunked_prefill():
    from kvhive.cli import main as kvhive_main

    with pytest.raises(SystemExit, match="--prefill-question applies to a chunked prefill; give --prefill-chunk N"):
        kvhive_main(["generate", "--model", "tiny-llama-gqa", "--prefill-question", " which?", "some text which?"])


def test_a_question_aware_cache_refuses_plain_chunks_and_works_after_prefill_prompt():
    # model.generate(prefill_chunk_size=...) feeds plain chunks: the question would score none of them.
    model = _model()
    ids = _prompt_ids(model)
    cache = kvhive.make_cache(model, "snapkv", BUDGET, prefill_chunk=CHUNK, question_tokens=QUESTION, window=4)
    with pytest.raises(ValueError, match=r"made with question_tokens=20 .*model.generate\(prefill_chunk_size=\.\.\.\)"):
        model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False, prefill_chunk_size=CHUNK)
    with pytest.raises(ValueError, match=r"made with question_tokens=20"), torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
    assert cache.get_seq_length() == 0  # refused before anything was stored
    # The recipe the refusal names: the context chunks through prefill_prompt, then generate.
    prefill_prompt(model, ids, cache, last_chunk=False)
    output = model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
    reference = kvhive.make_cache(model, "snapkv", BUDGET, prefill_chunk=CHUNK, question_tokens=QUESTION, window=4)
    logits = prefill_prompt(model, ids, reference)
    assert int(output[0, LENGTH]) == int(logits[0].argmax())
