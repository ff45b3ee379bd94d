"""The run-time switches of the recorded paths are one object, ``kvhive.static_step.config``, and
whether a step is recorded once is asked through the module, so one change reaches every reader."""

from __future__ import annotations

import pytest
import torch

from kvhive import static_step


def test_configured_changes_fields_for_the_block_and_restores_them():
    before = static_step.StepConfig(**vars(static_step.config))
    with static_step.configured(prefill_fast_path=True, prefill_compile=False) as config:
        assert config is static_step.config
        assert config.prefill_fast_path is True and config.prefill_compile is False
        assert static_step.prefill_fast_path(torch.device("cpu"))
    assert static_step.config == before
    assert static_step.prefill_fast_path(torch.device("cpu")) is False


def test_configured_restores_after_an_error_and_refuses_unknown_fields():
    with pytest.raises(RuntimeError), static_step.configured(prefill_kernels=False):
        raise RuntimeError("inside")
    assert static_step.config.prefill_kernels is True
    with pytest.raises(TypeError, match="unknown StepConfig field.*PREFILL_COMPILE"):
        with static_step.configured(PREFILL_COMPILE=False):
            pass


def test_conditional_eviction_off_records_no_if_node():
    with static_step.configured(conditional_eviction=False):
        assert static_step.captures_conditional_nodes() is False


def test_the_methods_ask_the_module_whether_a_step_is_recorded(monkeypatch):
    from kvhive.methods import bumblebee, buzz, subgen, submodular

    for module in (bumblebee, buzz, subgen, submodular):
        assert not hasattr(module, "in_static_step"), module.__name__
    monkeypatch.setattr(static_step, "in_static_step", lambda: True)
    assert buzz.static_step.in_static_step() is True
