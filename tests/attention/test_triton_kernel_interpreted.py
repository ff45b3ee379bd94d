"""kvhive's Triton split-K decode kernel, run on CPU through Triton's interpreter.

CI has no GPU; the interpreter executes the kernel's program logic (segment bounds, split-K
chunking, the running max/sum rescaling, the log-sum-exp merge, uniform slice addressing) on
CPU tensors, so a wrong index or merge fails here. The GPU test in
``test_dtypes_and_decode_path.py`` covers bf16 and the compiled kernel where a GPU exists.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton  # noqa: F401  - a test dependency (pyproject's "test" extra): missing it fails, not skips


@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_matches_float64_reference_in_the_interpreter(seed):
    environment = {**os.environ, "TRITON_INTERPRET": "1"}
    root = Path(__file__).resolve().parents[2]
    environment["PYTHONPATH"] = os.pathsep.join([str(root), environment.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("triton_kernel_check.py")), str(seed)],
        capture_output=True,
        text=True,
        env=environment,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    errors = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(errors) == {
        "segments-torch.float32",
        "segments-torch.float16",
        "uniform-float32",
        "dense-layer-float32",
        "weights-output-float32",
        "weights-float32",
        "decode-tova-float32",
        "decode-h2o-float32",
        "decode-ahakv-float32",
        "logits-float32",
        "decode-auto-full-float32",
        "decode-auto-full-growing-float32",
        "decode-auto-snapkv-float32",
        "decode-auto-snapkv-growing-float32",
    }
    # The new query's weights from the kernel's own pass (issue 23 item 2), and TOVA/H2O deciding
    # on them in a fixed decode capacity: the kept positions of the torch pass, the same logits.
    assert errors["weights-output-float32"] <= 1e-5
    assert errors["weights-float32"] <= 1e-5
    assert errors["decode-tova-float32"] <= 1e-4
    assert errors["decode-h2o-float32"] <= 1e-4
    assert errors["decode-ahakv-float32"] <= 1e-4
    assert errors["logits-float32"] <= 1e-5
    # dense_decode="auto": the kernel over a fixed capacity (every step, every layer), sdpa over a
    # growing slice; the same logits as sdpa over the masked capacity.
    assert errors["decode-auto-full-float32"] <= 1e-4
    assert errors["decode-auto-snapkv-float32"] <= 1e-4
    assert errors["decode-auto-full-growing-float32"] <= 1e-4
    assert errors["decode-auto-snapkv-growing-float32"] <= 1e-4
    assert errors["dense-layer-float32"] <= 1e-5
    assert errors["segments-torch.float32"] <= 1e-5
    assert errors["uniform-float32"] <= 1e-5
    assert errors["segments-torch.float16"] <= 2e-3
