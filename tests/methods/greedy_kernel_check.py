"""Run BumbleBee's Triton greedy step (``kvhive.methods.greedy_kernel``) in Triton's CPU interpreter
(``TRITON_INTERPRET=1`` must be set before this module imports triton) against the eager loop, the
reference; prints JSON ``{case: {"equal": bool, "overlap": float, "launches_per_step": float}}``.
Used by ``test_greedy_kernel_interpreted.py``.

The kernel evaluates every drawn element and sums a gain's float32 terms in its own order: on
float32 keys the kept sets must equal the eager loop's; on bf16 keys (many near-duplicate keys, so
near-ties between gains) the overlap of the kept sets is reported. Launches are counted by wrapping
the two kernels: every step of every run (a rerun with more attempts included) is counted.
"""

import json
import sys

import torch

import kvhive.methods.greedy_kernel as greedy_kernel
import kvhive.methods.submodular as submodular
from kvhive.methods.submodular import Concave, Mixture, greedy_maximize, relu_cosine_similarity

LAUNCHES = {"count": 0}


class _Counted:
    """A kernel whose launches (``kernel[grid](...)``) are counted."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def counted(*args, **kwargs):
            LAUNCHES["count"] += 1
            return launch(*args, **kwargs)

        return counted


def _objective(generator, rows, n, dim, phi, dtype, padded):
    keys = torch.randn(rows, n, dim, generator=generator)
    # Near-duplicates, so facility location matters (as tests/methods/test_bumblebee.py's objective).
    keys[:, 1::3] = keys[:, 0::3][:, : keys[:, 1::3].shape[1]] + 0.1 * torch.randn(
        rows, keys[:, 1::3].shape[1], dim, generator=generator
    )
    keys = keys.to(dtype)
    weights = torch.rand(rows, n, generator=generator) ** 3 * 20
    valid = torch.ones(rows, n, dtype=torch.bool)
    if padded:
        valid[1, :7] = False
    return Mixture(relu_cosine_similarity(keys, valid), weights, valid, 0.3, phi)


def main():
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    generator = torch.Generator().manual_seed(seed)
    greedy_kernel._greedy_gains_kernel = _Counted(greedy_kernel._greedy_gains_kernel)
    greedy_kernel._greedy_pick_kernel = _Counted(greedy_kernel._greedy_pick_kernel)
    cases = [
        # name, rows, n, dim, k, phi, key dtype, padded (row 1), epsilon
        ("log-f32", 3, 300, 16, 24, Concave("log"), torch.float32, False, 1e-5),
        ("power-f32-padded", 3, 200, 16, 20, Concave("power"), torch.float32, True, 1e-5),
        # k close to n: late steps draw every element left (rows that evaluate everything), then
        # the padded row picks its padding.
        ("log-f32-exhausting", 2, 40, 8, 38, Concave("log"), torch.float32, True, 1e-5),
        # One draw per step from a shrinking pool: draws all taken, runs again with more attempts.
        ("log-f32-rejections", 2, 40, 8, 36, Concave("log"), torch.float32, False, 0.9),
        ("log-bf16", 3, 300, 16, 24, Concave("log"), torch.bfloat16, True, 1e-5),
    ]
    runs = _count_runs()
    results = {}
    for name, rows, n, dim, k, phi, dtype, padded, epsilon in cases:
        objective = _objective(generator, rows, n, dim, phi, dtype, padded)

        def generators(rows=rows):
            return [torch.Generator().manual_seed(1000 * seed + row) for row in range(rows)]

        reference = greedy_maximize(objective, k, "stochastic", epsilon, generators(), fast=False)
        LAUNCHES["count"] = runs["count"] = 0
        kernel = greedy_maximize(objective, k, "stochastic", epsilon, generators(), fast="triton")
        assert submodular.last_greedy_path == "greedy kernel (triton)", submodular.last_greedy_path
        overlaps = [
            (kernel[row] & reference[row]).sum().item() / max(1, reference[row].sum().item()) for row in range(rows)
        ]
        results[name] = {
            "equal": bool(torch.equal(kernel, reference)),
            "overlap": min(overlaps),
            "launches_per_step": LAUNCHES["count"] / (k * runs["count"]),
            "runs": runs["count"],
        }
    print(json.dumps(results))


def _count_runs():
    """Counts the kernel runs of greedy calls (a run where some row's draws were all taken reruns)."""
    runs = {"count": 0}
    original = submodular.kernel_greedy

    def counted(*args, **kwargs):
        runs["count"] += 1
        return original(*args, **kwargs)

    submodular.kernel_greedy = counted
    return runs


if __name__ == "__main__":
    main()
