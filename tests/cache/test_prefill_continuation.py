"""WikiText perplexity of a prompt and its continuation (``ppl:prefill_tokens=P``, issue 26): the
first P tokens of a window in one forward (the method's prefill decision applies, e.g. BUZZ's
Remark 2 thinning), then the rest teacher-forced one at a time."""

from __future__ import annotations

import pytest
import torch
from fake_backend import FakeBackend, FakeTokenizer

from kvhive.evaluation import read_results, run_eval
from kvhive.evaluation.backend import Setting
from kvhive.evaluation.cli import default_data_dir
from kvhive.evaluation.kvhive_backend import KVHiveBackend
from kvhive.evaluation.tasks import get_task
from kvhive.models import tiny_model

DATA_DIR = default_data_dir()


def test_prefill_tokens_reach_the_backend_and_only_the_continuation_is_scored(tmp_path):
    backend = FakeBackend()
    run_eval(
        backend,
        ["ppl:num_tokens=96:window=32:prefill_tokens=20"],
        ["local"],
        [8],
        3,
        DATA_DIR,
        tmp_path,
        progress=False,
    )
    records = read_results(tmp_path)
    assert {r["item_id"] for r in records} == {"tokens0-32:prefill20", "tokens32-64:prefill20", "tokens64-96:prefill20"}
    # 32 tokens + BOS per window, the first 20 prefilled: 13 predicted.
    assert {r["metrics"]["n_tokens"] for r in records} == {13}
    assert all(r["metadata"]["prefill_tokens"] == 20 and r["task_params"]["prefill_tokens"] == 20 for r in records)


def test_without_prefill_tokens_every_window_is_streamed_as_before(tmp_path):
    backend = FakeBackend()
    run_eval(backend, ["ppl:num_tokens=64:window=32"], ["local"], [8], 2, DATA_DIR, tmp_path, progress=False)
    records = read_results(tmp_path)
    assert {r["item_id"] for r in records} == {"tokens0-32", "tokens32-64"}
    assert {r["metrics"]["n_tokens"] for r in records} == {32}


def test_prefill_tokens_leaving_nothing_to_predict_are_refused():
    task = get_task("ppl", num_tokens=64, window=32, prefill_tokens=33)
    with pytest.raises(
        ValueError, match=r"prefill_tokens=33 leaves nothing to predict .* expected prefill_tokens < 33"
    ):
        task.load(DATA_DIR, 2, 0, FakeTokenizer())
    with pytest.raises(ValueError, match="prefill_tokens"):
        get_task("ppl", prefill_tokens=0)


class _Tokenizer:
    bos_token_id, eos_token_id = 1, 2


@pytest.fixture(scope="module")
def backend():
    model = tiny_model("llama", "gqa")
    return KVHiveBackend(model, _Tokenizer())


def _tokens(backend, n=120, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [1] + torch.randint(3, backend.model.config.vocab_size, (n - 1,), generator=generator).tolist()


def test_full_cache_prefill_scores_the_same_tokens_as_the_stream(backend):
    """With the full cache a prompt in one forward and the same tokens fed one by one give the same
    predictions; the prefill run scores token_ids[P:] only."""
    ids = _tokens(backend)
    full = [Setting("full", 1.0)]
    ((streamed, count),) = backend.streaming_nll(ids, full)
    ((prefilled, scored),) = backend.streaming_nll(ids, full, prefill_tokens=len(ids) - 30)
    assert (count, scored) == (len(ids) - 1, 30)
    # The stream's NLL of the last 30 tokens: the whole stream less the stream of the prompt alone.
    ((first, _),) = backend.streaming_nll(ids[: len(ids) - 30], full)
    assert prefilled == pytest.approx(streamed - first, rel=1e-4)


@pytest.mark.parametrize("share_prefill,share_decode", [(True, True), (False, True), (True, False)])
def test_buzz_readings_after_a_prefill_are_the_same_shared_or_not(backend, share_prefill, share_decode):
    """The two readings of Remark 2 on one prompt: one shared prefill and rows of one batch give
    what each setting gets alone; the literal reading holds more after the prompt."""
    ids = _tokens(backend, n=200, seed=1)
    settings = [Setting("buzz", 30), Setting("buzz:prefill_fit=peak", 30)]
    backend.share_prefill, backend.share_decode = share_prefill, share_decode
    try:
        together = backend.streaming_nll(ids, settings, prefill_tokens=150)
        sizes = backend.last_cache_sizes
    finally:
        backend.share_prefill, backend.share_decode = True, True
    alone = [backend.streaming_nll(ids, [setting], prefill_tokens=150)[0] for setting in settings]
    for (nll, count), (nll_alone, count_alone) in zip(together, alone, strict=True):
        assert count == count_alone == 50 and nll == pytest.approx(nll_alone, rel=1e-5)
    # Mean form, C = 30: layout (4, 6, 31); 150 tokens: 28 samples, 38 held (literal) against 20.
    assert sizes[1]["kv_entries_mean"] > sizes[0]["kv_entries_mean"]
    assert sizes[1]["peak_kept_per_head"] >= 38


@pytest.mark.parametrize("prefill_tokens", [0, 120, 1.5, True])
def test_backend_refuses_prefill_tokens_that_leave_nothing_to_predict(backend, prefill_tokens):
    with pytest.raises(ValueError, match="prefill_tokens"):
        backend.streaming_nll(_tokens(backend), [Setting("full", 1.0)], prefill_tokens=prefill_tokens)
