"""kvhive's Triton column-sum kernel (``kvhive.attention.column_sums``), run on CPU through
Triton's interpreter against the torch path (``ScoringInputs.attention_with_column_sums``'s
sums) and a float64 reference: causal blocks skipped by row, GQA groups walked by one program,
a padding mask, queries that are the newest of more keys, a head dim that is not a power of 2.
``tests_gpu/test_cuda.py`` checks the compiled kernel in bf16 after flash attention's lse.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton  # noqa: F401  - a test dependency (pyproject's "test" extra): missing it fails, not skips


@pytest.mark.parametrize("seed", [0])
def test_column_sum_kernel_matches_the_torch_path_in_the_interpreter(seed):
    environment = {**os.environ, "TRITON_INTERPRET": "1"}
    root = Path(__file__).resolve().parents[2]
    environment["PYTHONPATH"] = os.pathsep.join([str(root), environment.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("column_sums_check.py")), str(seed)],
        capture_output=True,
        text=True,
        env=environment,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    errors = json.loads(result.stdout.strip().splitlines()[-1])
    cases = ("gqa-causal", "gqa-padded", "mha-newest-queries", "group4-dim24")
    expected = {f"{case}-torch.float32-{against}" for case in cases for against in ("reference", "torch")}
    expected |= {f"{case}-torch.float16-reference" for case in cases}
    # A left-padded batch row by row (flash attention's lse over each row's real tokens): output and sums.
    expected |= {f"{case}-{part}" for case in ("by-row-gqa", "by-row-mha-all-padding") for part in ("output", "sums")}
    assert set(errors) == expected
    # Column sums reach ~70 (70 query rows); float32 sums of that size differ by summation order
    # (~1e-6); float16 inputs are exact in the kernel's float32 products.
    for case, error in errors.items():
        assert error <= 2e-5, (case, error)
