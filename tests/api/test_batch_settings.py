"""``kvhive.generate_batch`` and the settings around it: the model's generation config applied to
every row as ``model.generate`` (``kvhive.generate``) applies it, or refused by name; and clear
errors, naming the parameter and what it accepts, for arguments that would fail obscurely or change
nothing."""

from __future__ import annotations

import warnings

import pytest
import torch

import kvhive
from kvhive.models import tiny_model, tiny_tokenizer

TEXT = "The bees of the hive keep warm in winter by clustering and shivering their wing muscles"
PROMPTS = [TEXT[:40], TEXT[:57], TEXT[:73]]
NEW_TOKENS = 12


@pytest.fixture
def model():
    # A fresh model per test: the tests change its generation config. Untied embeddings: its greedy
    # text varies, so a setting that is not applied shows.
    return tiny_model("llama", "gqa", tie_word_embeddings=False)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def _alone(model, tokenizer, prompts, method="h2o", budget=32, new_tokens=NEW_TOKENS):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [kvhive.generate(model, tokenizer, p, method, budget, max_new_tokens=new_tokens)[0] for p in prompts]


def _batch(model, tokenizer, prompts, method="h2o", budget=32, new_tokens=NEW_TOKENS, **options):
    return kvhive.generate_batch(model, tokenizer, prompts, method, budget, new_tokens, **options)


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("repetition_penalty", 2.0),
        ("no_repeat_ngram_size", 2),
        ("suppress_tokens", [239, 117]),
        ("begin_suppress_tokens", [239, 17]),
    ],
)
def test_generation_config_logits_settings_apply_as_in_generate(model, tokenizer, setting, value):
    plain = _batch(model, tokenizer, PROMPTS)
    setattr(model.generation_config, setting, value)
    batch = _batch(model, tokenizer, PROMPTS, max_batch_size=2)
    assert batch == _alone(model, tokenizer, PROMPTS)
    assert batch != plain  # the setting changed the text: a batch that ignored it would differ


def test_min_new_tokens_holds_back_the_end_of_sequence_as_in_generate(model, tokenizer):
    encoded = tokenizer(PROMPTS[0], return_tensors="pt")
    with torch.no_grad():
        ids = model.generate(**encoded, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    end = int(ids[0, encoded["input_ids"].shape[1] + 1])  # the second token the first prompt generates
    model.generation_config.eos_token_id = end
    short = _batch(model, tokenizer, PROMPTS)
    model.generation_config.min_new_tokens = 8
    batch = _batch(model, tokenizer, PROMPTS)
    assert batch == _alone(model, tokenizer, PROMPTS)
    assert len(tokenizer(batch[0])["input_ids"]) >= 8 > len(tokenizer(short[0])["input_ids"])


@pytest.mark.parametrize(
    ("setting", "value"),
    [("bad_words_ids", [[5]]), ("num_beams", 2), ("forced_eos_token_id", 5), ("sequence_bias", {(5,): 1.0})],
)
def test_generation_config_settings_not_applied_are_refused_by_name(model, tokenizer, setting, value):
    setattr(model.generation_config, setting, value)
    with pytest.raises(ValueError, match=f"generation config sets {setting}=.*which generate_batch does not apply"):
        _batch(model, tokenizer, PROMPTS[:2])


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"eos_token_id": "</s>"}, r"invalid eos_token_id='</s>': expected a token id \(an integer in \[0, 259\)\)"),
        ({"eos_token_id": [1, "x"]}, r"invalid eos_token_id=\[1, 'x'\]: expected a token id"),
        ({"eos_token_id": 259}, r"invalid eos_token_id=259: expected a token id \(an integer in \[0, 259\)\)"),
        ({"eos_token_id": []}, r"invalid eos_token_id=\[\]: .*non-empty list"),
        ({"do_sample": True, "seed": 2**64}, r"invalid seed=18446744073709551616: expected .*< 2\*\*64"),
        ({"do_sample": True, "seed": [1, -5]}, r"invalid seed\[1\]=-5: expected an integer >= 0 and < 2\*\*64"),
        ({"temperature": 0.7}, r"temperature=0.7 is given but do_sample is False for every prompt"),
        ({"top_k": [5, None]}, r"top_k\[0\]=5 is given but do_sample is False for every prompt"),
        ({"top_p": 0.9, "do_sample": [False, False]}, r"top_p=0.9 is given but do_sample is False"),
    ],
)
def test_unclear_arguments_are_refused_naming_the_parameter(model, tokenizer, arguments, message):
    with pytest.raises(ValueError, match=message):
        _batch(model, tokenizer, PROMPTS[:2], **arguments)


def test_the_largest_seed_is_taken_and_sampling_rows_take_shared_settings(model, tokenizer):
    largest = _batch(model, tokenizer, PROMPTS[:1], do_sample=True, seed=2**64 - 1)
    assert largest == _batch(model, tokenizer, PROMPTS[:1], do_sample=True, seed=2**64 - 1)
    # One temperature for every row, some rows greedy: the sampling rows take it.
    mixed = _batch(model, tokenizer, PROMPTS[:2], do_sample=[True, False], temperature=0.7, seed=1)
    assert mixed[1] == _alone(model, tokenizer, PROMPTS[1:2])[0]


def test_an_empty_prompt_among_many_is_named_by_its_index(model, tokenizer):
    with pytest.raises(ValueError, match=r"prompts\[2\]: invalid prompt: expected a non-empty string"):
        _batch(model, tokenizer, [PROMPTS[0], PROMPTS[1], "  ", PROMPTS[2]])


def test_a_forward_given_two_different_caches_is_refused(model):
    # (model.generate given both warns itself, naming both, and passes on cache= alone.)
    ids = torch.randint(3, 200, (1, 30), generator=torch.Generator().manual_seed(0))
    first, second = kvhive.make_cache(model, "full"), kvhive.make_cache(model, "snapkv", budget=32)
    with pytest.raises(ValueError, match=r"given two different caches, cache= and past_key_values="):
        model(input_ids=ids, cache=first, past_key_values=second)
    assert first.get_seq_length() == 0 and second.get_seq_length() == 0  # refused before anything was stored
    with torch.no_grad():
        model(input_ids=ids, cache=first, past_key_values=first)  # the same cache under both names is one cache
    assert first.get_seq_length() == 30
