"""SubGen's Triton farthest-point kernel (one launch a pick; ``kvhive.methods.farthest_kernel``), run
on CPU through Triton's interpreter against the eager loop: the pick order to the index where every
sum is exact (integer keys: ties across blocks, padding and shuffled positions, rows that run out of
candidates), and the kept sets on Gaussian float32 / bf16 keys. ``tests_gpu/test_cuda.py`` runs the
compiled kernel, captured, on the GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton  # noqa: F401  - a test dependency (pyproject's "test" extra): missing it fails, not skips

from kvhive.methods import farthest_kernel
from kvhive.methods.subgen import farthest_point_order


def test_farthest_point_kernel_matches_the_eager_loop_in_the_interpreter():
    environment = {**os.environ, "TRITON_INTERPRET": "1"}
    root = Path(__file__).resolve().parents[2]
    environment["PYTHONPATH"] = os.pathsep.join([str(root), environment.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("farthest_kernel_check.py")), "0"],
        capture_output=True,
        text=True,
        env=environment,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(results) == {
        "integer-ties",
        "integer-padded-positions",
        "integer-exhausted",
        "integer-duplicates",
        "gaussian-f32",
        "gaussian-bf16",
    }
    for case, found in results.items():
        # One launch per centre for all rows (heads) of the call: the pick, the distance update and
        # the block maxima in one kernel.
        assert found["launches_per_centre"] == 1, (case, found)
        if case.startswith("integer"):
            assert found["equal"], case  # exact sums: the same picks, ties broken alike
        # Gaussian keys: distances ~2d apart from each other's ulps; the order came out equal on
        # every seed tried, the sets must at least (a kernel that skipped a block or an update
        # would lose many).
        assert found["overlap"] == 1.0, (case, found)


def test_the_kernel_is_refused_by_name_where_it_cannot_run(monkeypatch):
    # Without the interpreter on a CPU tensor the kernel does not run: asking for it is an error
    # naming the parameter, not a quiet fall back to another path.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    keys = torch.randn(2, 50, 8)
    assert not farthest_kernel.kernel_supports(keys)
    with pytest.raises(ValueError, match="fast='triton'"):
        farthest_point_order(keys, torch.ones(2, 50, dtype=torch.bool), 10, fast="triton")
