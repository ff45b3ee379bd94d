"""``kvhive.generate_batch``: prompts prefilled separately, decoded together. Every registered
method either gives, row by row, exactly what ``kvhive.generate`` gives for that prompt alone, or
is refused by name (never a silently different text)."""

from __future__ import annotations

import warnings

import pytest

import kvhive
from kvhive.methods.registry import method_names
from kvhive.models import tiny_model, tiny_tokenizer

from helpers import REFUSED_BATCH_METHODS, batch_budget

TEXT = (
    "The bees of the hive keep warm in winter by clustering and shivering their wing muscles, rotating from the "
    "edge to the centre of the cluster."
)
LENGTHS = (40, 57, 73)  # tokens (the tiny tokenizer is byte-level)
NEW_TOKENS = 12
# Methods whose caches cannot be stacked, and why (the ValueError says it): none since BUZZ,
# BumbleBee and subgen-attention keep their state per row (issue 24).
REFUSED = REFUSED_BATCH_METHODS


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return tiny_model("llama", "gqa"), tiny_tokenizer()


_budget = batch_budget


def _prompts(tokenizer) -> list[str]:
    prompts = [TEXT[:n] for n in LENGTHS]
    assert [len(tokenizer(prompt)["input_ids"]) for prompt in prompts] == list(LENGTHS)
    return prompts


@pytest.mark.parametrize("name", method_names())
def test_rows_equal_each_prompt_alone(model_and_tokenizer, name):
    model, tokenizer = model_and_tokenizer
    prompts = _prompts(tokenizer)
    budget = _budget(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name in REFUSED:
            with pytest.raises(ValueError, match=f"method '{name}' cannot stack caches.*{REFUSED[name]}"):
                kvhive.generate_batch(model, tokenizer, prompts, name, budget, max_new_tokens=NEW_TOKENS)
            return
        texts = kvhive.generate_batch(model, tokenizer, prompts, name, budget, max_new_tokens=NEW_TOKENS)
        alone = [kvhive.generate(model, tokenizer, p, name, budget, max_new_tokens=NEW_TOKENS)[0] for p in prompts]
    assert texts == alone
    assert len(set(texts)) > 1  # the rows said different things (not one row copied)


def test_prefill_chunk_is_honoured(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    prompts = _prompts(tokenizer)
    texts = kvhive.generate_batch(model, tokenizer, prompts, "snapkv", 32, max_new_tokens=8, prefill_chunk=16)
    alone = [kvhive.generate(model, tokenizer, p, "snapkv", 32, max_new_tokens=8, prefill_chunk=16)[0] for p in prompts]
    assert texts == alone


def test_rows_end_at_their_own_eos_and_stop_strings(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    prompts = _prompts(tokenizer)
    full = kvhive.generate_batch(model, tokenizer, prompts, "h2o", 32, max_new_tokens=10)
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in full]
    # Row 1 ends at its 4th token (taken as the end-of-sequence token), the others run on unless they
    # produce that token too; model.generate ends the same way.
    eos = ids[1][3]
    ended = kvhive.generate_batch(model, tokenizer, prompts, "h2o", 32, max_new_tokens=10, eos_token_id=eos)
    for row, text in enumerate(ended):
        row_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        cut = ids[row].index(eos) + 1 if eos in ids[row] else len(ids[row])
        assert row_ids == ids[row][:cut]
    assert len(ended[1]) < len(full[1])
    # Per-row stop strings: a row stops once its text contains one of its strings.
    stops = [[full[0][2:4]], [], [full[2][:1]]]
    stopped = kvhive.generate_batch(model, tokenizer, prompts, "h2o", 32, max_new_tokens=10, stop_strings=stops)
    assert stopped[1] == full[1]
    for row in (0, 2):
        assert stops[row][0] in stopped[row] and full[row].startswith(stopped[row])
        assert stops[row][0] not in stopped[row][:-1]


def test_invalid_arguments(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    with pytest.raises(ValueError, match="prompts"):
        kvhive.generate_batch(model, tokenizer, "one prompt", "h2o", 32)
    with pytest.raises(ValueError, match="prompts"):
        kvhive.generate_batch(model, tokenizer, [], "h2o", 32)
    with pytest.raises(ValueError, match="max_new_tokens"):
        kvhive.generate_batch(model, tokenizer, ["a b c"], "h2o", 32, max_new_tokens=0)
    with pytest.raises(ValueError, match="stop_strings"):
        kvhive.generate_batch(model, tokenizer, ["a b c", "d e f"], "h2o", 32, stop_strings=[["x"]])
    with pytest.raises(ValueError, match="prompt"):
        kvhive.generate_batch(model, tokenizer, ["a b c", "  "], "h2o", 32)
    with pytest.raises(ValueError, match="invalid compile=1: expected True, False or a torch.compile backend"):
        kvhive.generate_batch(model, tokenizer, ["a b c"], "h2o", 32, compile=1)
    with pytest.raises(ValueError, match="decode_capacity is not accepted"):
        kvhive.generate_batch(model, tokenizer, ["a b c"], "h2o", 32, decode_capacity=8)
    with pytest.raises(ValueError, match="compile=True with prefill_chunk"):
        kvhive.generate_batch(model, tokenizer, ["a b c"], "h2o", 32, compile=True, prefill_chunk=16)


def test_one_prompt_equals_generate(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    prompt = _prompts(tokenizer)[2]
    assert kvhive.generate_batch(model, tokenizer, [prompt], "tova", 32, max_new_tokens=6) == [
        kvhive.generate(model, tokenizer, prompt, "tova", 32, max_new_tokens=6)[0]
    ]


@pytest.mark.parametrize("name", ["full", "h2o", "snapkv", "ahakv"])
def test_sliding_window_layers(name):
    """Gemma 3's sliding-window layers (window 8 in the tiny model) mask each row by its own
    position: rows equal each prompt alone there too."""
    model, tokenizer = tiny_model("gemma3", "gqa"), tiny_tokenizer()
    prompts = _prompts(tokenizer)
    budget = _budget(name)
    texts = kvhive.generate_batch(model, tokenizer, prompts, name, budget, max_new_tokens=8)
    assert texts == [kvhive.generate(model, tokenizer, p, name, budget, max_new_tokens=8)[0] for p in prompts]


def test_cli_prompts_file(tmp_path, capsys):
    import json

    from kvhive.cli import main

    model, tokenizer = tiny_model("llama", "gqa"), tiny_tokenizer()
    prompts = _prompts(tokenizer)
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(prompts) + "\n\n", encoding="utf-8")
    base = ["generate", "--model", "tiny-llama-gqa", "--method", "snapkv", "--budget", "32", "--max-new-tokens", "5"]
    assert main([*base, "--prompts-file", str(path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    expected = [kvhive.generate(model, tokenizer, p, "snapkv", 32, max_new_tokens=5)[0] for p in prompts]
    assert [json.loads(line) for line in lines] == expected
    assert main([*base, "--json", "--prompts-file", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["texts"] == expected
    sampling = ["--sample", "--temperature", "0.8", "--top-k", "10", "--seed", "5"]
    assert main([*base, "--json", "--prompts-file", str(path), *sampling]) == 0
    sampled = kvhive.generate_batch(
        model, tokenizer, prompts, "snapkv", 32, 5, do_sample=True, temperature=0.8, top_k=10, seed=5
    )
    assert json.loads(capsys.readouterr().out)["texts"] == sampled
    with pytest.raises(SystemExit, match="apply to --prompts-file"):
        main([*base, "--sample", "a prompt"])
    assert main([*base, "--prompts-file", str(path), "--sample", "--temperature", "-1"]) == 2
    assert "invalid temperature=-1.0: expected a number > 0" in capsys.readouterr().err
    # subgen at 48 tokens: the 40-token prompt keeps fewer tokens than the others in a layer that
    # evicts, and subgen builds its state at its first eviction (h2o fills that row to its budget)
    assert main([*base, "--method", "subgen", "--budget", "48", "--prompts-file", str(path)]) == 2
    assert "cannot stack these caches" in capsys.readouterr().err
    assert main([*base, "--method", "h2o", "--budget", "48", "--prompts-file", str(path)]) == 0
    texts = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert texts == [kvhive.generate(model, tokenizer, p, "h2o", 48, max_new_tokens=5)[0] for p in prompts]
    with pytest.raises(SystemExit, match="exactly one"):
        main([*base, "--prompts-file", str(path), "a prompt"])
    (tmp_path / "empty.txt").write_text("\n \n", encoding="utf-8")
    with pytest.raises(SystemExit, match="holds no prompt"):
        main([*base, "--prompts-file", str(tmp_path / "empty.txt")])


def test_rows_sample_with_their_own_settings_as_alone(model_and_tokenizer):
    """Per-row sampling: each row draws from its own generator with its own settings, so it gives in
    the batch (joining a running one too) what its prompt gives alone with the same seed; a greedy
    row beside them equals kvhive.generate."""
    model, tokenizer = model_and_tokenizer
    prompts = _prompts(tokenizer)
    prompts = (prompts * 2)[:4]
    settings = {
        "do_sample": [True, True, False, True],
        "temperature": [0.7, 1.3, 1.0, 1.0],
        "top_k": [20, None, None, 5],
        "top_p": [None, 0.9, None, None],
        "seed": [1, 2, 3, 4],
    }
    batch = kvhive.generate_batch(model, tokenizer, prompts, "h2o", 32, 10, max_batch_size=3, **settings)
    for row, prompt in enumerate(prompts):
        alone = kvhive.generate_batch(
            model, tokenizer, [prompt], "h2o", 32, 10, **{name: values[row] for name, values in settings.items()}
        )
        assert batch[row] == alone[0], f"row {row}"
    assert batch[2] == kvhive.generate(model, tokenizer, prompts[2], "h2o", 32, max_new_tokens=10)[0]
    # The draws depend on the seed (the test above would pass for a sampler that ignored it otherwise).
    reseeded = kvhive.generate_batch(model, tokenizer, [prompts[1]], "h2o", 32, 10, do_sample=True, seed=99)
    assert (
        reseeded[0] != batch[1]
        or kvhive.generate_batch(model, tokenizer, [prompts[1]], "h2o", 32, 10, do_sample=True, seed=98)[0] != batch[1]
    )
    greedy = kvhive.generate(model, tokenizer, prompts[1], "h2o", 32, max_new_tokens=10)[0]
    assert batch[1] != greedy


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"do_sample": 1}, "invalid do_sample=1: expected True or False"),
        ({"temperature": 0}, "invalid temperature=0: expected a number > 0"),
        ({"top_k": [5, 0]}, r"invalid top_k\[1\]=0: expected an integer >= 1"),
        ({"top_p": 1.5}, r"invalid top_p=1.5: expected a number in \(0, 1\]"),
        ({"seed": -1}, "invalid seed=-1: expected an integer >= 0"),
        ({"seed": [1]}, r"invalid seed=\[1\]: a list needs one value per prompt \(2\)"),
    ],
)
def test_invalid_sampling_arguments(model_and_tokenizer, arguments, message):
    model, tokenizer = model_and_tokenizer
    with pytest.raises(ValueError, match=message):
        kvhive.generate_batch(model, tokenizer, ["a b c", "d e f"], "h2o", 32, **arguments)
