"""One launch per center of SubGen's farthest-point order (Triton: SubGen's prefill on a GPU).

:func:`kvhive.methods.subgen.farthest_point_order` picks ``count`` centers per row, each the point
farthest from the centers before it; each pick needs one pass over the row's keys (the distances
to the newest center), so at a 32k prompt and 10% a layer makes ~3,200 passes over 8 x 32k x 128
keys. Its fixed-shape torch step (compiled or not) reads them as a float32 copy, twice the model's
bf16 bytes, and splits a pick into several dependent kernels (the gather of the center, the
product, the distance update, the argmax, the record). Here one kernel does a whole pick and reads
the keys in their stored dtype (a bf16 key converted to float32 is exact, so the inputs are the
same numbers):

Program ``(block j, row r)`` of step ``s``

1. finds the step's center: the argmax of the previous step's per-block maxima ``(value, first
   index)``, kept in a two-slot buffer by step parity (every program of step ``s`` reads slot
   ``s - 1``, all written by the previous launch, and writes slot ``s``), the first maximiser on
   ties as ``torch.argmax``; step 0 takes the given first center;
2. records it in ``order[r, s]`` (block 0) and loads its key and squared norm;
3. for its block of points: ``|x|^2 - 2 x.c + |c|^2`` clamped at 0 (the torch step's order of
   additions, float32), the running minimum ``nearest``, the center itself set to ``-inf`` (chosen,
   no longer eligible);
4. writes the block's maximum and its first index for the next step.

The dot products are summed in the kernel's order rather than cuBLAS's (a rounding of the last
bits): near-ties between distances may resolve differently from the torch step's, so the centers
are the exact greedy's up to such ties (tests_gpu reports the overlap of the kept sets). With
integer-valued keys every sum is exact and the order equals the torch step's to the index
(``tests/methods/farthest_kernel_check.py`` in Triton's CPU interpreter, ties included).
"""

from __future__ import annotations

import os

import torch

try:  # Triton ships with CUDA builds of PyTorch; CPU builds may lack it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None
    tl = None


if triton is not None:
    # The step is a runtime value (not specialised: one compiled kernel serves every step).
    @triton.jit(do_not_specialize=["step"])
    def _farthest_step_kernel(
        keys,
        keys_sq,
        nearest,
        first,
        order,
        best_value,
        best_index,
        step,
        num_points,
        num_blocks,
        stride_kr,
        stride_kn,
        stride_order,
        HEAD_DIM: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_P: tl.constexpr,
    ):
        block = tl.program_id(0)
        row = tl.program_id(1)
        beyond = num_points  # an index after every point: loses every tie of the first-index rule
        if step == 0:
            chosen = tl.load(first + row).to(tl.int32)
        else:
            slots = tl.arange(0, BLOCK_P)
            previous = ((step - 1) % 2) * tl.num_programs(1) * num_blocks + row * num_blocks
            values = tl.load(best_value + previous + slots, mask=slots < num_blocks, other=float("-inf"))
            indices = tl.load(best_index + previous + slots, mask=slots < num_blocks, other=beyond)
            top = tl.max(values, axis=0)
            chosen = tl.min(tl.where(values == top, indices, beyond), axis=0)
        if block == 0:
            tl.store(order + row * stride_order + step, chosen.to(tl.int64))
        d = tl.arange(0, BLOCK_D)
        in_dim = d < HEAD_DIM
        row_keys = keys + row.to(tl.int64) * stride_kr
        center = tl.load(row_keys + chosen.to(tl.int64) * stride_kn + d, mask=in_dim, other=0.0).to(tl.float32)
        center_sq = tl.load(keys_sq + row * num_points + chosen)
        n = block * BLOCK_N + tl.arange(0, BLOCK_N)
        in_points = n < num_points
        points = tl.load(
            row_keys + n.to(tl.int64)[:, None] * stride_kn + d[None, :],
            mask=in_points[:, None] & in_dim[None, :],
            other=0.0,
        ).to(tl.float32)
        dots = tl.sum(points * center[None, :], axis=1)
        points_sq = tl.load(keys_sq + row * num_points + n, mask=in_points, other=0.0)
        # The torch step's order: (|x|^2 + (-2) x.c) + |c|^2, then the clamp.
        distance = tl.maximum((points_sq + (-2.0) * dots) + center_sq, 0.0)
        held = tl.load(nearest + row * num_points + n, mask=in_points, other=float("-inf"))
        updated = tl.minimum(held, distance)
        updated = tl.where(n == chosen, float("-inf"), updated)
        tl.store(nearest + row * num_points + n, updated, mask=in_points)
        updated = tl.where(in_points, updated, float("-inf"))
        top = tl.max(updated, axis=0)
        here = (step % 2) * tl.num_programs(1) * num_blocks + row * num_blocks + block
        tl.store(best_value + here, top)
        tl.store(best_index + here, tl.min(tl.where(updated == top, n, beyond), axis=0))


def kernel_supports(keys: torch.Tensor) -> bool:
    """Whether :func:`farthest_point_steps` runs on ``keys [R, N, d]``: Triton on a CUDA device (or
    its CPU interpreter), float32/16/bf16 keys, head dim <= 256, fewer than 2^31 points."""
    if triton is None or not (keys.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    return (
        keys.dim() == 3
        and keys.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and keys.shape[-1] <= 256
        and keys.shape[1] < 2**31 - 1
    )


def farthest_point_steps(
    keys: torch.Tensor,
    keys_sq: torch.Tensor,
    nearest: torch.Tensor,
    first: torch.Tensor,
    order: torch.Tensor,
    steps: int,
) -> torch.Tensor:
    """``steps`` picks of the greedy k-center order, one launch each; ``order [R, >= steps]`` (long)
    gets the centers in its first ``steps`` columns and is returned.

    ``keys [R, N, d]`` in their stored dtype (the last dimension contiguous), ``keys_sq [R, N]`` their
    float32 squared norms, ``nearest [R, N]`` float32 (``inf`` for a candidate, ``-inf`` for a point
    never eligible; updated in place), ``first [R]`` the first centers. No host read: a CUDA graph
    captures the whole loop (``subgen._FarthestGraph``)."""
    rows, num_points, dim = keys.shape
    if keys.stride(-1) != 1:
        keys = keys.contiguous()
    keys_sq = keys_sq.contiguous()
    if not (nearest.is_contiguous() and nearest.dtype == torch.float32):
        raise ValueError("nearest must be a contiguous float32 [rows, points] tensor (it is updated in place)")
    block_d = max(16, triton.next_power_of_2(dim))
    block_n = 128 if block_d <= 128 else 64
    num_blocks = triton.cdiv(num_points, block_n)
    best_value = torch.empty(2, rows, num_blocks, dtype=torch.float32, device=keys.device)
    best_index = torch.empty(2, rows, num_blocks, dtype=torch.int32, device=keys.device)
    grid = (num_blocks, rows)
    for step in range(steps):
        _farthest_step_kernel[grid](
            keys,
            keys_sq,
            nearest,
            first,
            order,
            best_value,
            best_index,
            step,
            num_points,
            num_blocks,
            keys.stride(0),
            keys.stride(1),
            order.stride(0),
            HEAD_DIM=dim,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
            BLOCK_P=max(2, triton.next_power_of_2(num_blocks)),
            num_warps=8 if block_n * block_d >= 128 * 128 else 4,
        )
    return order
