"""Every registered method keeps exactly the positions recorded in
``tests/fixtures/golden_kept_positions.json`` (see ``tests/golden_kept.py`` for the cases and
how an intended change re-records its entries)."""

from __future__ import annotations

import golden_kept
import pytest

from kvhive.methods.registry import method_names

GOLDEN = golden_kept.load()
TINY = dict(golden_kept.tiny_cases(method_names()))
GEMMA = dict(golden_kept.gemma_cases(method_names()))


def test_every_case_is_recorded():
    missing = sorted((set(TINY) | set(GEMMA)) - set(GOLDEN))
    assert not missing, f"cases without a golden entry (record them with tests/golden_kept.py): {missing[:5]}"


def _compare(key, thunk):
    got = thunk()
    expected = GOLDEN[key]
    assert got.keys() == expected.keys()
    for step, snap in expected.items():
        assert got[step]["layer_budgets"] == snap["layer_budgets"], f"{key} step {step}: layer budgets"
        for layer, rows in snap["kept"].items():
            assert got[step]["kept"][layer] == rows, f"{key} step {step} layer {layer}: kept positions differ"


@pytest.mark.parametrize("method", method_names())
def test_tiny_models_keep_the_golden_positions(method):
    cases = [(key, thunk) for key, thunk in TINY.items() if key.split("|")[1] == method]
    assert cases
    for key, thunk in cases:
        _compare(key, thunk)


def test_embedded_model_keeps_the_golden_positions():
    for key, thunk in GEMMA.items():
        _compare(key, thunk)
