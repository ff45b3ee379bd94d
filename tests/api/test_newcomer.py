"""What a newcomer meets first: the device option (``load_model(device=...)``, ``--device`` for
generate and eval), a missing extra said in one line by the command line, the expected duration of
a named suite, and progress bars only where stderr is a terminal."""

from __future__ import annotations

import io
import json
import sys

import pytest
import torch

import kvhive
from kvhive.cli import main
from kvhive.models import EMBEDDED_MODELS, MissingModelExtraError, load_model
from kvhive.progress import GenerationProgress, progress_wanted


def test_load_model_puts_the_model_on_the_device_asked_for():
    model, _ = load_model("tiny-llama-gqa", device="cpu")
    assert model.device == torch.device("cpu")
    model, _ = load_model("tiny-llama-gqa", device=torch.device("cpu"))
    assert model.device == torch.device("cpu")


# A GPU index past the last one: refused on any machine (no GPU at all on CI's).
BEYOND = f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}"
NO_SUCH_GPU = "sees no CUDA GPU; use device='cpu'" if not torch.cuda.is_available() else "CUDA GPU\\(s\\)"


@pytest.mark.parametrize(
    ("device", "message"),
    [
        (BEYOND, rf"invalid device='{BEYOND}': .*{NO_SUCH_GPU}"),
        ("gpu", r"invalid device='gpu': expected 'cpu', 'cuda', 'cuda:N'"),
        (7, r"invalid device=7: expected 'cpu', 'cuda', 'cuda:N'"),
    ],
)
def test_load_model_refuses_a_device_it_cannot_use(device, message):
    with pytest.raises(ValueError, match=message):
        load_model("tiny-llama-gqa", device=device)


def test_generate_and_eval_take_a_device(tmp_path, capsys):
    assert main(["generate", "--model", "tiny-llama-gqa", "--max-new-tokens", "3", "--device", "cpu", "Hello"]) == 0
    assert main(["generate", "--model", "tiny-llama-gqa", "--max-new-tokens", "3", "--device", BEYOND, "Hi"]) == 2
    assert f"kvhive generate: error: invalid device='{BEYOND}'" in capsys.readouterr().err
    out = tmp_path / "run"
    arguments = ["eval", "--model", "tiny-llama-gqa", "--tasks", "synthetic_recall", "--methods", "snapkv"]
    arguments += ["--budgets", "64", "--limit", "1", "--out", str(out), "--no-progress", "--no-report"]
    assert main([*arguments, "--device", BEYOND]) == 2
    assert f"kvhive eval: error: invalid device='{BEYOND}'" in capsys.readouterr().err
    assert main([*arguments, "--device", "cpu"]) == 0
    assert len((out / "results.jsonl").read_text().splitlines()) >= 1


def test_a_missing_extra_is_one_line_on_the_command_line(monkeypatch, capsys):
    entry = EMBEDDED_MODELS["qwen2.5-0.5b"]

    def missing():
        raise MissingModelExtraError(f"model={entry.name!r} needs its weight packages; install them with: pip x")

    monkeypatch.setattr(type(entry), "require_chunks", lambda self: missing())
    monkeypatch.setenv("KVHIVE_CACHE_DIR", "/nonexistent-kvhive-cache")
    assert main(["generate", "--model", "qwen2.5-0.5b", "--max-new-tokens", "2", "Hi"]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0  # one line, no traceback
    assert err.startswith("kvhive generate: error: model='qwen2.5-0.5b' needs") and "pip x" in err


def test_the_claims_suite_says_how_long_it_takes(tmp_path, capsys, monkeypatch):
    from kvhive.evaluation import cli as eval_cli

    monkeypatch.setattr(eval_cli, "run_eval", lambda *args, **kwargs: (_ for _ in ()).throw(KeyboardInterrupt))
    main(["eval", "--suite", "claims", "--model", "tiny-llama-gqa", "--out", str(tmp_path / "c"), "--no-report"])
    err = capsys.readouterr().err
    assert "kvhive eval: suite 'claims' takes hours on a CPU: about 2 h of one core for gemma-3-270m" in err


def test_progress_bars_only_on_a_terminal(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert not progress_wanted()
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert progress_wanted() and not progress_wanted(False)
    # The generation bar: the prompt first (the prefill), then one count per new token.
    bar = GenerationProgress(4)
    bar.put(torch.zeros(1, 300, dtype=torch.long))
    assert bar.bar.desc.startswith("prefill of 300 tokens") and bar.bar.n == 0
    for _ in range(4):
        bar.put(torch.zeros(1, dtype=torch.long))
    assert bar.bar.desc.startswith("decode") and bar.bar.n == 4
    bar.end()
    assert "prefill of 300 tokens" in sys.stderr.getvalue()


def test_generate_takes_a_streamer():
    model, tokenizer = load_model("tiny-llama-gqa")
    seen = []

    class Recorder:
        def put(self, value):
            seen.append(int(value.numel()))

        def end(self):
            seen.append("end")

    text, _ = kvhive.generate(model, tokenizer, "Hello there", "snapkv", 32, max_new_tokens=3, streamer=Recorder())
    assert seen[0] == len(tokenizer("Hello there")["input_ids"]) and seen[-1] == "end" and len(seen) == 5
    assert json.dumps(text)
