"""``kvhive generate --kv-bits``: the cache stores its kept tokens quantized, and says so."""

from __future__ import annotations

import json

import pytest

from kvhive.cli import main

PROMPT = "The quick brown fox jumps over the lazy dog while the bees hum. " * 2
BASE = ["generate", "--model", "tiny-gemma3-gqa", "--method", "streamingllm", "--budget", "12", "--max-new-tokens", "3"]


def _statistics(capsys, *extra):
    assert main([*BASE, "--json", *extra, PROMPT]) == 0
    return json.loads(capsys.readouterr().out)


def test_kv_bits_stores_the_kept_tokens_in_fewer_bytes(capsys):
    plain = _statistics(capsys)
    int8 = _statistics(capsys, "--kv-bits", "8")
    int4 = _statistics(capsys, "--kv-bits", "4")
    assert int8["kv_bits"] == 8 and int4["kv_bits"] == 4 and plain.get("kv_bits") is None
    # float32 tiny model: 4 bytes a channel unquantized; 1 or 1/2 byte plus 8 bytes of scales per token.
    assert int8["cache_bytes"] < plain["cache_bytes"] / 2
    assert int4["cache_bytes"] < int8["cache_bytes"]


@pytest.mark.parametrize("bits", ["3", "16", "x"])
def test_kv_bits_outside_4_and_8_is_refused(bits, capsys):
    with pytest.raises(SystemExit):
        main([*BASE, "--kv-bits", bits, PROMPT])
    assert "--kv-bits" in capsys.readouterr().err


def test_bench_refuses_kv_bits_where_it_is_unused():
    with pytest.raises(SystemExit, match="--kv-bits applies to a method's benchmark"):
        main(["bench", "--varlen", "--kv-bits", "4"])
