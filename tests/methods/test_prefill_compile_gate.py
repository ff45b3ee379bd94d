"""The prefill selections' fixed-shape steps compile on a torch below kvhive's decode gate.

kvhive compiles a decode step only on torch >= ``static_step.COMPILE_MIN_TORCH`` (dynamo must trace
the attention switch). BumbleBee's greedy step and SubGen's farthest-point step are pure tensor
functions with no such switch: their backend (``submodular_graph.prefill_compile_backend``) is
inductor on every torch, e.g. the GPU image's 2.11. Only torch 2.13 runs here, so the older torch
is patched in (its version and the gate's flag) and the steps' compile calls are recorded."""

from __future__ import annotations

import torch
from torch.torch_version import TorchVersion

import kvhive.methods.subgen as subgen_module
import kvhive.methods.submodular_graph as submodular_graph
from kvhive import static_step
from kvhive.methods.submodular import Concave


def _older_torch(monkeypatch):
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.11.0"))
    monkeypatch.setattr(
        static_step, "TORCH_COMPILES_KVHIVE", TorchVersion(torch.__version__) >= static_step.COMPILE_MIN_TORCH
    )
    compiled = []

    def record(function, **options):
        compiled.append((function.__name__, options))
        return function

    monkeypatch.setattr(torch, "compile", record)
    return compiled


def test_the_decode_gate_is_closed_and_the_prefill_steps_still_compile(monkeypatch):
    compiled = _older_torch(monkeypatch)
    assert static_step.TORCH_COMPILES_KVHIVE is False and not static_step.compiles_kvhive()  # the decode gate
    assert submodular_graph.prefill_compile_backend() == "inductor"
    assert submodular_graph.fast_backend(True) == "inductor"  # BumbleBee's greedy step on CUDA
    with static_step.configured(prefill_kernels=False):  # SubGen's torch step instead of its kernel
        assert subgen_module._fast_backend(torch.randn(2, 40, 8)) == "inductor"
    submodular_graph._STEP_FUNCTIONS.clear()
    subgen_module._STEP_FUNCTIONS.clear()
    static = dict(width=16, sampled=False, any_full=False, lam=0.3, phi=Concave("log"))
    submodular_graph._step_function("inductor", ("gate-test",), count=8, **static)
    subgen_module._farthest_function("inductor", ("gate-test",))
    backends = [options["backend"] for _, options in compiled]
    assert backends == ["inductor", "inductor"], compiled
    assert all(options["fullgraph"] and options["dynamic"] is False for _, options in compiled)
    submodular_graph._STEP_FUNCTIONS.clear()
    subgen_module._STEP_FUNCTIONS.clear()


def test_prefill_compile_false_runs_the_steps_eagerly_on_any_torch(monkeypatch):
    _older_torch(monkeypatch)
    with static_step.configured(prefill_compile=False):
        assert submodular_graph.prefill_compile_backend() is None
        assert submodular_graph.fast_backend(True) is None
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.13.0"))
    monkeypatch.setattr(static_step, "TORCH_COMPILES_KVHIVE", True)
    assert submodular_graph.prefill_compile_backend() == "inductor"  # the same on a torch above the gate
