"""Run SubGen's Triton farthest-point kernel (``kvhive.methods.farthest_kernel``) in Triton's CPU
interpreter (``TRITON_INTERPRET=1`` must be set before this module imports triton) against the eager
loop, the reference; prints JSON ``{case: {"equal": bool, "overlap": float, "launches_per_centre": float}}``. Used by
``test_farthest_kernel_interpreted.py``. Launches are counted by wrapping the kernel: every launch of
the call, over the centres it picks (all rows of the case at once).

Integer-valued keys make every product and sum exact in float32, in any order: there the kernel's
order must equal the eager loop's to the index, ties included (many distances tie on such keys,
which tests the first-maximiser rule across blocks). Gaussian keys (float32 and bf16) are summed in
another order than the loop's product: the kept sets (the first ``count`` picks) are compared.
"""

import json
import sys

import torch

import kvhive.methods.farthest_kernel as farthest_kernel
import kvhive.methods.subgen as subgen_module
from kvhive.methods.subgen import farthest_point_order

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


def main():
    generator = torch.Generator().manual_seed(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    farthest_kernel._farthest_step_kernel = _Counted(farthest_kernel._farthest_step_kernel)
    results = {}
    cases = [
        # name, rows, points, dim, count, integer keys, candidates thinned, positions
        ("integer-ties", 3, 300, 16, 60, True, False, False),
        ("integer-padded-positions", 2, 260, 24, 80, True, True, True),
        ("integer-exhausted", 2, 40, 8, 50, True, True, False),  # fewer candidates than count
        # 12 distinct keys among 200 points: after 12 picks every distance is 0, and the picked
        # points (-inf) must lose the ties to their duplicates.
        ("integer-duplicates", 2, 200, 8, 40, True, False, False),
        ("gaussian-f32", 2, 333, 32, 50, False, False, False),
        ("gaussian-bf16", 2, 333, 32, 50, False, True, True),
    ]
    for name, rows, points, dim, count, integer, thinned, with_positions in cases:
        if name == "integer-duplicates":
            distinct = torch.randint(-3, 4, (rows, 12, dim), generator=generator).float()
            keys = distinct.gather(1, torch.randint(0, 12, (rows, points, 1), generator=generator).expand(-1, -1, dim))
        elif integer:
            keys = torch.randint(-3, 4, (rows, points, dim), generator=generator).float()
        else:
            keys = torch.randn(rows, points, dim, generator=generator)
            if name.endswith("bf16"):
                keys = keys.bfloat16()
        candidates = torch.ones(rows, points, dtype=torch.bool)
        if thinned:
            candidates = torch.rand(rows, points, generator=generator) > (0.3 if points > 100 else 0.5)
        positions = None
        if with_positions:
            positions = torch.stack([torch.randperm(points, generator=generator) for _ in range(rows)])
        reference = farthest_point_order(keys, candidates, count, positions, fast=False)
        LAUNCHES["count"] = 0
        kernel = farthest_point_order(keys, candidates, count, positions, fast="triton")
        centres = min(count, points)  # the picks the loop takes (a row that ran out picks -1 after)
        assert subgen_module.last_farthest_path == "farthest-point kernel (triton)", subgen_module.last_farthest_path
        overlaps = []
        for row in range(rows):
            mine = set(kernel[row].tolist()) - {-1}
            theirs = set(reference[row].tolist()) - {-1}
            overlaps.append(len(mine & theirs) / max(1, len(theirs)))
        results[name] = {
            "equal": bool(torch.equal(kernel, reference)),
            "overlap": min(overlaps),
            "launches_per_centre": LAUNCHES["count"] / centres,
        }
    print(json.dumps(results))


if __name__ == "__main__":
    main()
