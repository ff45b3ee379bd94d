"""What kvhive refuses instead of answering wrong (issue 9 items 1 (API), 10, 11, 12; issue 13
item 5): a reused cache that does not fit the new input, a missing budget, an ignored budget,
a prefill-only method streamed past its budget, malformed options, and CLI faults."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import kvhive
from kvhive.cache import BudgetNotKeptWarning
from kvhive.cli import main as kvhive_main
from kvhive.models import tiny_model

REPO = Path(__file__).resolve().parents[2]


def _ids(length: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 250, (batch, length), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, cache, new: int = 3):
    return model.generate(
        ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=new, do_sample=False
    )


# -- item 11: reusing a cache ------------------------------------------------------------------------
def test_reused_cache_continues_a_prompt_that_extends_it():
    model = tiny_model("llama", "gqa")
    cache = kvhive.make_cache(model, "h2o", budget=8)
    first = _generate(model, _ids(20), cache)
    follow_up = torch.cat([first, _ids(4, seed=1)], dim=1)
    second = _generate(model, follow_up, cache)
    assert second.shape[1] == follow_up.shape[1] + 3
    assert cache.layers[0].tokens_seen == second.shape[1] - 1  # the last generated token is never fed


def test_reused_cache_refuses_an_unrelated_prompt():
    # transformers slices the prompt at the cache's length: an unrelated longer prompt used to be
    # answered as if the cached tokens were its beginning.
    model = tiny_model("llama", "gqa")
    cache = kvhive.make_cache(model, "h2o", budget=8)
    _generate(model, _ids(20), cache)
    with pytest.raises(ValueError, match="does not start with the 22 tokens this cache holds"):
        _generate(model, _ids(40, seed=5), cache)
    with pytest.raises(ValueError, match="prompt of 5 tokens does not extend the 22 tokens"):
        _generate(model, _ids(5), cache)


def test_reused_cache_refuses_another_batch_size():
    model = tiny_model("llama", "gqa")
    cache = kvhive.make_cache(model, "h2o", budget=8)
    _generate(model, _ids(20), cache)
    with pytest.raises(ValueError, match="batch of 1 row.*has 2"):
        _generate(model, _ids(40, batch=2), cache)
    with pytest.raises(ValueError, match="batch of 1 row.*has 2"):  # a direct forward, not generate
        model(input_ids=_ids(1, batch=2), past_key_values=cache, use_cache=True)


def test_reused_cache_refuses_another_model():
    model, other = tiny_model("llama", "gqa"), tiny_model("llama", "gqa")
    cache = kvhive.make_cache(model, "h2o", budget=8)
    kvhive.make_cache(other, "h2o", budget=8)  # the other model runs kvhive attention too
    ids = _ids(20)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        with pytest.raises(ValueError, match="filled by another model"):
            other(input_ids=_ids(1), past_key_values=cache, use_cache=True)
    smaller = tiny_model("llama", "gqa", num_hidden_layers=1)
    cache = kvhive.make_cache(smaller, "h2o", budget=8)
    with torch.no_grad(), pytest.raises(ValueError, match="another model"):
        model(input_ids=ids, past_key_values=cache, use_cache=True)


def test_cache_refuses_a_model_not_running_kvhive_attention():
    # Without kvhive attention nothing is ever compressed: the cache used to grow silently. A model
    # of the same shape never given to kvhive runs its own attention with the cache.
    model, other = tiny_model("llama", "gqa"), tiny_model("llama", "gqa")
    cache = kvhive.make_cache(model, "h2o", budget=8)
    with torch.no_grad(), pytest.raises(ValueError, match="kvhive's attention did not run"):
        other(input_ids=_ids(20), past_key_values=cache, use_cache=True)


# -- item 10 / issue 13 item 5: budgets a user did not give, or gave for nothing ---------------------
def test_an_evicting_method_needs_a_budget():
    # The old default (a ratio of 1.0 of the prompt) kept H2O at the prompt length while decoding.
    model = tiny_model("llama", "gqa")
    with pytest.raises(ValueError, match="method 'h2o' needs a budget and none was given"):
        kvhive.make_cache(model, "h2o")
    full = kvhive.make_cache(model, "full")
    assert full.statistics()["budget"] == "none (keeps every token)"


def test_full_method_notes_an_ignored_budget():
    model = tiny_model("llama", "gqa")
    with pytest.warns(UserWarning, match="method 'full' keeps every token: budget=64 is ignored"):
        kvhive.make_cache(model, "full", budget=64)


def test_statistics_print_ratios_as_ratios():
    model = tiny_model("llama", "gqa")
    assert kvhive.make_cache(model, "h2o", budget=1).statistics()["budget"] == "1 tok"
    assert kvhive.make_cache(model, "h2o", ratio=1.0).statistics()["budget"] == "ratio 1"
    assert kvhive.make_cache(model, "h2o", budget=0.25).statistics()["budget"] == "ratio 0.25"


def test_ratio_resolving_below_one_token_is_refused_naming_the_ratio():
    # 1e-9 used to be raised silently to 1 token; a short prompt's ratio named "budget=9".
    model = tiny_model("llama", "gqa")
    cache = kvhive.make_cache(model, "h2o", budget=1e-9)
    with torch.no_grad(), pytest.raises(ValueError, match=r"ratio=1e-09 of a 20-token prompt is 0 tokens"):
        model(input_ids=_ids(20), past_key_values=cache, use_cache=True)
    cache = kvhive.make_cache(model, "snapkv", ratio=0.5)
    with (
        torch.no_grad(),
        pytest.raises(ValueError, match=r"ratio=0.5 of a 20-token prompt is 10 tokens.*'snapkv' needs at least 32"),
    ):
        model(input_ids=_ids(20), past_key_values=cache, use_cache=True)


# -- item 1 (API): a prefill-only method streamed past its budget --------------------------------------
def test_streaming_a_prefill_only_method_warns_once():
    model = tiny_model("llama", "gqa")
    cache = kvhive.make_cache(model, "knorm", budget=6)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for token in _ids(12)[0]:
            model(input_ids=token.view(1, 1), past_key_values=cache, use_cache=True)
    budget_warnings = [w for w in caught if issubclass(w.category, BudgetNotKeptWarning)]
    assert len(budget_warnings) == 1 and "compresses only in phase(s) prefill" in str(budget_warnings[0].message)
    # A prompt the method did compress, then a few decoded tokens: the method's normal use, no warning.
    cache = kvhive.make_cache(model, "knorm", budget=6)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BudgetNotKeptWarning)
        _generate(model, _ids(20), cache, new=4)


# -- item 12: malformed options ------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["no", 0, 1, None])
def test_compress_sliding_must_be_a_bool(value):
    model = tiny_model("gemma3", "gqa")
    with pytest.raises(ValueError, match="compress_sliding"):
        kvhive.make_cache(model, "h2o", budget=8, compress_sliding=value)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--repeats", "0"], "invalid repeats=0"),
        (["--num-layers", "0"], "invalid num_layers=0"),
        (["--batch-size", "0"], "invalid batch_size=0"),
    ],
)
def test_bench_refuses_degenerate_runs_in_one_line(arguments, message, capsys):
    code = kvhive_main(["bench", "--context", "16", "--decode-tokens", "1", *arguments])
    error = capsys.readouterr().err
    assert code == 2 and message in error and "Traceback" not in error


def test_generate_names_the_missing_budget_and_notes_an_ignored_one(capsys):
    with pytest.raises(SystemExit, match="--method h2o needs --budget"):
        kvhive_main(["generate", "--model", "tiny-llama-gqa", "--method", "h2o", "hello"])
    assert (
        kvhive_main(
            [
                "generate",
                "--model",
                "tiny-llama-gqa",
                "--method",
                "full",
                "--budget",
                "64",
                "--max-new-tokens",
                "2",
                "hello",
            ]
        )
        == 0
    )
    assert "note: --method full keeps every token; --budget 64 is ignored" in capsys.readouterr().err


def test_generate_refuses_a_directory_as_prompt_file(tmp_path):
    with pytest.raises(SystemExit, match="cannot read --prompt-file .*Is a directory"):
        kvhive_main(["generate", "--model", "tiny-llama-gqa", "--prompt-file", str(tmp_path)])


def _eval_arguments(out: Path) -> list[str]:
    return [
        "eval",
        "--model",
        "tiny-llama-gqa",
        "--tasks",
        "synthetic_recall:num_pairs=2",
        "--methods",
        "local",
        "--budgets",
        "8",
        "--limit",
        "1",
        "--out",
        str(out),
        "--no-progress",
        "--no-report",
    ]


def test_eval_on_a_locked_output_folder_is_a_one_line_error(tmp_path, capsys):
    from kvhive.evaluation.results import ResultsWriter

    with ResultsWriter(tmp_path / "run"):  # another run holds the folder
        code = kvhive_main(_eval_arguments(tmp_path / "run"))
    error = capsys.readouterr().err
    assert code == 2 and "another evaluation run is writing to" in error


def test_eval_on_a_read_only_folder_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    import errno

    from kvhive.evaluation import results

    def read_only(*_args, **_kwargs):  # as os.open fails in a read-only folder (root ignores chmod)
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(tmp_path / "run" / "results.jsonl"))

    monkeypatch.setattr(results.os, "open", read_only)
    code = kvhive_main(_eval_arguments(tmp_path / "run"))
    error = capsys.readouterr().err
    assert code == 2 and "Permission denied" in error and "Traceback" not in error


def test_eval_on_a_full_disk_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    import errno

    from kvhive.evaluation import results

    def full_disk(*_):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(results.os, "write", full_disk)
    code = kvhive_main(_eval_arguments(tmp_path / "run"))
    error = capsys.readouterr().err
    assert code == 2 and "No space left on device" in error and "Traceback" not in error


def test_importing_kvhive_installs_no_warnings_filter():
    script = (
        "import warnings, torch, transformers, accelerate.scheduler, transformers.masking_utils, transformers.cache_utils\n"
        "def seen(): return {(a, getattr(m, 'pattern', m), c, getattr(n, 'pattern', n)) for a, m, c, n, _ in warnings.filters}\n"
        "before = seen()\n"
        "import kvhive, kvhive.attention.integration, kvhive.cli, kvhive.evaluation.kvhive_backend, kvhive.bench\n"
        "added = seen() - before\n"
        "assert not added, added\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


# -- issue 27 item 4: a cache remembers the model it was made for ------------------------------------
@pytest.mark.parametrize(
    "made_for,used_by,named",
    [
        (("gemma3", "gqa", {}), ("llama", "gqa", {}), r"layers: 4 here, 2 in that model; sliding windows: 3 sliding "),
        (("gemma3", "gqa", {}), ("llama", "gqa", {"num_hidden_layers": 4}), r"sliding windows: 3 sliding \(window 8\)"),
        (("llama", "gqa", {}), ("llama", "mha", {}), r"KV heads: 2 here, 4 in that model"),
        (("llama", "gqa", {}), ("llama", "gqa", {"head_dim": 8}), r"head dimension: 16 here, 8 in that model"),
    ],
)
def test_an_empty_cache_refuses_another_model_naming_the_mismatch(made_for, used_by, named):
    # An empty cache from tiny Gemma-3 used by tiny Llama treated Llama's full-attention layers as
    # sliding (window 8) and reported the full cache's bytes for Gemma's shape.
    architecture, attention, overrides = made_for
    cache = kvhive.make_cache(tiny_model(architecture, attention, **overrides), "h2o", budget=16)
    architecture, attention, overrides = used_by
    other = tiny_model(architecture, attention, **overrides)
    kvhive.make_cache(other, "h2o", budget=16)  # the other model runs kvhive attention too
    with torch.no_grad(), pytest.raises(ValueError, match=rf"made for another model \({named}.*make a cache per model"):
        other.generate(_ids(20), attention_mask=torch.ones(1, 20, dtype=torch.long), past_key_values=cache)
    with torch.no_grad(), pytest.raises(ValueError, match=named):
        other(input_ids=_ids(20), past_key_values=cache, use_cache=True)
    statistics = cache.statistics()  # nothing of the other model was stored or counted
    assert (statistics["tokens_seen"], statistics["cache_bytes"], statistics["full_cache_bytes"]) == (0, 0, 0)


def test_an_empty_cache_refuses_a_model_of_another_shape_under_kvhive_attention_alone():
    # Through kvhive.compression on the base model (no forward hook), kvhive's attention checks
    # the layer's module the first time it sees it (a filled cache also refuses other KV shapes
    # before storing anything, test_reused_cache_refuses_another_model).
    model = tiny_model("llama", "gqa")
    cache = kvhive.make_cache(model, "h2o", budget=8)
    other = tiny_model("llama", "mha")
    with torch.no_grad(), kvhive.compression(other), pytest.raises(ValueError, match=r"KV heads: 2 here, 4"):
        other.model(input_ids=_ids(20), past_key_values=cache, use_cache=True)
    statistics = cache.statistics()  # the layer it had stored into was emptied again
    assert (statistics["tokens_seen"], statistics["cache_bytes"], statistics["full_cache_bytes"]) == (0, 0, 0)
    with torch.no_grad():  # and the cache still serves its own model
        model(input_ids=_ids(20), past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == 20


def test_encoder_decoder_models_are_refused_as_such():
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=4, decoder_start_token_id=0)
    model = T5ForConditionalGeneration(config)
    with pytest.raises(ValueError, match="encoder-decoder models are not supported"):
        kvhive.make_cache(model, "h2o", budget=8)
    with pytest.raises(ValueError, match="encoder-decoder models are not supported"):
        kvhive.KVHiveCache(config, kvhive.make_policy("h2o"), 8)


# -- issue 27 item 6: a budget that would apply to no layer --------------------------------------------
def test_a_model_whose_every_layer_slides_needs_compress_sliding_for_a_budget():
    # Mistral with sliding_window set slides in every layer; the budget applied to none of them and
    # the API said nothing (kvhive generate printed "budget applied to 0 of 2 layers").
    model = tiny_model("mistral", "gqa", sliding_window=16)
    with pytest.raises(
        ValueError, match=r"would compress no layer.*all 2 layers are sliding.*window 16.*compress_sliding=True"
    ):
        kvhive.make_cache(model, "h2o", budget=8)
    cache = kvhive.make_cache(model, "h2o", budget=8, compress_sliding=True)
    with torch.no_grad():
        model(input_ids=_ids(40), past_key_values=cache, use_cache=True)
    assert cache.compressed_layers == [0, 1]
    assert all(int(layer.lengths_host.max()) == 8 for layer in cache.layers)
    assert kvhive.make_cache(model, "full").compressed_layers == []  # nothing to apply: no budget


def test_cli_generate_refuses_a_budget_that_applies_to_no_layer(monkeypatch, capsys):
    model = tiny_model("mistral", "gqa", sliding_window=16)
    monkeypatch.setattr(kvhive, "load_model", lambda *args, **kwargs: (model, _tokenizer()))
    assert kvhive_main(["generate", "--method", "h2o", "--budget", "8", "--max-new-tokens", "2", "x" * 30]) == 2
    assert "would compress no layer" in capsys.readouterr().err
    assert kvhive_main(["generate", "--method", "h2o", "--budget", "8", "--compress-sliding", "x" * 30]) == 0
    assert "budget applied to 2 of 2 layers" in capsys.readouterr().err


def _tokenizer():
    from kvhive.models.tiny import tiny_tokenizer

    return tiny_tokenizer()


# -- issue 27: errors that say what to do ---------------------------------------------------------------
def test_a_method_that_is_not_a_name_is_refused_listing_the_names():
    model = tiny_model("llama", "gqa")
    for method in (None, 3, kvhive.make_policy):
        with pytest.raises(ValueError, match=r"invalid method=.*expected a method name, one of full, local, .*snapkv"):
            kvhive.make_cache(model, method, budget=8)


def test_numpy_numbers_are_budgets_like_the_numbers_they_hold():
    import numpy as np

    model = tiny_model("llama", "gqa")
    for given, expected in ((np.int64(16), "16 tok"), (np.int32(4), "4 tok"), (np.float64(0.25), "ratio 0.25")):
        assert kvhive.make_cache(model, "h2o", budget=given).statistics()["budget"] == expected
    assert kvhive.make_cache(model, "h2o", budget=np.float32(0.5)).budget.ratio == 0.5
    assert kvhive.make_cache(model, "h2o", ratio=np.float64(0.5)).budget.ratio == 0.5
    assert kvhive.KVHiveCache(model.config, kvhive.make_policy("h2o"), np.int64(8)).budget.tokens == 8
    with pytest.raises(ValueError, match=r"invalid budget=0: expected tokens per head"):
        kvhive.make_cache(model, "h2o", budget=np.int64(0))
    with pytest.raises(ValueError, match=r"invalid budget=True"):
        kvhive.make_cache(model, "h2o", budget=True)


def test_a_filled_cache_refuses_pickling_saying_what_to_do_and_deep_copies():
    import copy
    import pickle

    model = tiny_model("llama", "gqa")
    cache = kvhive.make_cache(model, "h2o", budget=8)
    with torch.no_grad():
        model(input_ids=_ids(20), past_key_values=cache, use_cache=True)
    with pytest.raises(TypeError, match=r"cannot be pickled.*copy.deepcopy\(cache\).*kvhive.make_cache"):
        pickle.dumps(cache)
    # The prompt-reuse pattern: a filled prefix copied for each continuation, independent of it.
    copied = copy.deepcopy(cache)
    with torch.no_grad():
        original = model(input_ids=_ids(1, seed=3), past_key_values=cache, use_cache=True).logits
        from_copy = model(input_ids=_ids(1, seed=3), past_key_values=copied, use_cache=True).logits
        model(input_ids=_ids(1, seed=4), past_key_values=copied, use_cache=True)
    assert torch.equal(original, from_copy)
    assert (cache.get_seq_length(), copied.get_seq_length()) == (21, 22)
    with torch.no_grad(), pytest.raises(ValueError, match="another model"):
        tiny_model("llama", "mha")(input_ids=_ids(1), past_key_values=copied, use_cache=True)


def test_crop_refuses_naming_assisted_and_speculative_decoding():
    model = tiny_model("llama", "gqa")
    cache = kvhive.make_cache(model, "h2o", budget=8)
    with torch.no_grad():
        model(input_ids=_ids(20), past_key_values=cache, use_cache=True)
    with pytest.raises(
        ValueError, match=r"cannot be rolled back.*assisted or speculative decoding.*compresses only the prompt"
    ):
        cache.crop(18)
    assert cache.get_seq_length() == 20  # nothing was removed
    with torch.no_grad(), pytest.raises(ValueError, match="[Aa]ssisted decoding"):
        model.generate(
            _ids(20),
            attention_mask=torch.ones(1, 20, dtype=torch.long),
            past_key_values=cache,
            assistant_model=tiny_model("llama", "gqa"),
            max_new_tokens=4,
            do_sample=False,
        )


def test_the_equivalence_warning_is_given_once_when_threads_race(monkeypatch):
    # Two threads checked "already warned?" before either recorded it: both warned. The set is made
    # to hold both threads inside the check until each has looked (or 0.5 s passed).
    import threading

    from kvhive import api

    barrier = threading.Barrier(2, timeout=0.5)

    class RacingSet(set):
        def __contains__(self, key):
            found = super().__contains__(key)
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.wait()
            return found

    given = []
    monkeypatch.setattr(api, "EQUIVALENCE_WARNINGS", api.FirstTimes(RacingSet()))
    monkeypatch.setattr(warnings, "warn", lambda message, *args, **kwargs: given.append(message))
    model = tiny_model("llama", "gqa", num_key_value_heads=1)
    policy = kvhive.make_policy("ada-snapkv", head_granularity="kv")
    threads = [
        threading.Thread(target=api.warn_if_allocation_cannot_differ, args=(policy, model.config)) for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(given) == 1, given


def test_cli_generate_accepts_method_options_as_eval_does(capsys):
    # snapkv needs a budget of at least its window (32 by default): budget 8 runs only if window=4 applied.
    prompt = "x" * 30
    arguments = ["generate", "--model", "tiny-llama-gqa", "--budget", "8", "--max-new-tokens", "2", prompt]
    assert kvhive_main([*arguments, "--method", "snapkv:window=4"]) == 0
    assert "kvhive: snapkv at budget 8 tok" in capsys.readouterr().err
    assert kvhive_main([*arguments, "--method", "snapkv"]) == 2
    assert "needs at least 32 tokens per head" in capsys.readouterr().err
    assert kvhive_main([*arguments, "--method", "snapkv:window=4", "--param", "window=8"]) == 2
    assert "option 'window' is already given in --method snapkv:window=4" in capsys.readouterr().err
