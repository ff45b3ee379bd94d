"""kvhive hands models their cache under the keyword the installed transformers declares (issue 23
item 8): ``cache`` from 5.24 on, ``past_key_values`` before. No kvhive forward warns about the old
spelling on the installed release, and the same code runs on the oldest release pyproject allows
(scripts/test_oldest.sh runs this file there)."""

from __future__ import annotations

import inspect
import re
import warnings

import pytest
import torch

import kvhive
from kvhive.api import shared_prefill
from kvhive.bench import run_benchmark
from kvhive.compat import CACHE, PAST_KEY_VALUES, cache_kwarg
from kvhive.evaluation.backend import Setting
from kvhive.evaluation.kvhive_backend import KVHiveBackend

# transformers' deprecation message names the old keyword; kvhive must never trigger it.
DEPRECATED_CACHE_KEYWORD = re.compile(r"`?past_key_values`? is deprecated")


def _cache_keyword_warnings(records) -> list[str]:
    return [str(record.message) for record in records if DEPRECATED_CACHE_KEYWORD.search(str(record.message))]


@pytest.fixture(scope="module")
def tiny():
    return kvhive.load_model("tiny-llama-gqa")


def test_the_keyword_is_the_one_the_installed_forward_declares(tiny):
    model, _ = tiny
    declared = inspect.signature(model.forward).parameters
    expected = CACHE if CACHE in declared else PAST_KEY_VALUES
    assert expected in declared
    assert cache_kwarg(model) == expected


class _OldForward(torch.nn.Module):
    def forward(self, input_ids, past_key_values=None, use_cache=None):
        return input_ids


class _NewForward(torch.nn.Module):
    def forward(self, input_ids, cache=None, use_cache=None):
        return input_ids


class _NoCacheForward(torch.nn.Module):
    def forward(self, input_ids):
        return input_ids


def test_both_spellings_are_recognised_whatever_the_installed_release():
    assert cache_kwarg(_OldForward()) == PAST_KEY_VALUES
    assert cache_kwarg(_NewForward()) == CACHE
    with pytest.raises(TypeError, match="_NoCacheForward.forward takes neither `cache` nor `past_key_values`"):
        cache_kwarg(_NoCacheForward())


def test_no_kvhive_forward_warns_about_the_cache_keyword(tiny):
    model, tokenizer = tiny
    # The pattern matches transformers' own message.
    transformers_message = "`past_key_values` is deprecated and will be removed in version 5.40.0 for `X.forward`."
    assert DEPRECATED_CACHE_KEYWORD.search(transformers_message)
    input_ids = torch.randint(3, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    backend = KVHiveBackend(model, tokenizer, share_prefill=False)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        text, cache = kvhive.generate(model, tokenizer, "bees keep warm", "h2o", budget=8, max_new_tokens=4)
        shared_prefill(model, input_ids, [kvhive.make_cache(model, "tova", budget=8)])
        backend.generate("bees keep warm", 3, [Setting("full", 1.0), Setting("snapkv", 32)])
        backend.choice_loglikelihoods("bees keep", [" warm in winter", " cold"], [Setting("knorm", 8)])
        backend.streaming_nll(input_ids[0, :12].tolist(), [Setting("streamingllm", 8)])
        run_benchmark("kv-heavy", "tova", budget=8, context=32, decode_tokens=2, num_layers=1)
    assert cache.get_seq_length() > 0
    assert _cache_keyword_warnings(records) == []


def test_the_warning_is_seen_when_the_old_keyword_is_used_on_a_release_that_deprecates_it(tiny):
    # The check above is not blind: where forward declares `cache`, passing `past_key_values`
    # warns and the filter catches it.
    model, _ = tiny
    if cache_kwarg(model) != CACHE:
        assert PAST_KEY_VALUES in inspect.signature(model.forward).parameters
        return  # the oldest releases know only the old keyword: nothing to warn about
    cache = kvhive.make_cache(model, "full")
    with warnings.catch_warnings(record=True) as records, torch.no_grad():
        warnings.simplefilter("always")
        model(input_ids=torch.tensor([[5, 6, 7]]), past_key_values=cache, use_cache=True)
    assert len(_cache_keyword_warnings(records)) == 1
