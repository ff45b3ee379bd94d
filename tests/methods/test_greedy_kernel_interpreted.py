"""BumbleBee's Triton greedy step (two launches a step for all rows; ``kvhive.methods.greedy_kernel``),
run on CPU through Triton's interpreter against the eager loop: the same kept sets on float32 keys
(both concave functions, a padded row, steps that evaluate every element left, reruns with more
attempts), the overlap on bf16 keys, and the launches per greedy step counted.
``tests_gpu/test_cuda.py`` runs the compiled kernel on the GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton  # noqa: F401  - a test dependency (pyproject's "test" extra): missing it fails, not skips

from kvhive.methods import greedy_kernel
from kvhive.methods.submodular import Concave, Mixture, greedy_maximize, relu_cosine_similarity


def test_greedy_kernel_matches_the_eager_loop_in_the_interpreter():
    environment = {**os.environ, "TRITON_INTERPRET": "1"}
    root = Path(__file__).resolve().parents[2]
    environment["PYTHONPATH"] = os.pathsep.join([str(root), environment.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("greedy_kernel_check.py")), "0"],
        capture_output=True,
        text=True,
        env=environment,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(results) == {"log-f32", "power-f32-padded", "log-f32-exhausting", "log-f32-rejections", "log-bf16"}
    for case, found in results.items():
        # Every step of every run is the gains launch and the pick launch, all rows at once.
        assert found["launches_per_step"] == greedy_kernel.LAUNCHES_PER_STEP == 2, (case, found)
        if case.endswith("bf16"):
            assert found["overlap"] >= 0.99, (case, found)  # near-ties may resolve otherwise
        else:
            assert found["equal"], (case, found)
    assert results["log-f32-rejections"]["runs"] > 1  # the attempt scan of a rerun ran


def test_the_greedy_kernel_is_refused_by_name_where_it_cannot_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    keys = torch.randn(2, 30, 8)
    valid = torch.ones(2, 30, dtype=torch.bool)
    objective = Mixture(relu_cosine_similarity(keys, valid), torch.rand(2, 30), valid, 0.3, Concave("log"))
    assert not greedy_kernel.kernel_supports(objective.sim)
    with pytest.raises(ValueError, match="fast='triton'"):
        greedy_maximize(objective, 5, "stochastic", 1e-5, fast="triton")
