"""Attention over segments of different lengths (head-wise budgets), without padding storage.

Layout (``kvhive.cache.layers.packed``): segment ``s = b * H + h`` holds ``segment_length[s]`` tokens
at ``keys[segment_start[s] : segment_start[s] + segment_length[s]]``. Each segment is attended by
``R = group * q`` query rows (the query heads of its group, times the new tokens).

Two implementations of one function:

* CUDA: a Triton split-K kernel in the style of flash-decoding. Program ``(s, j)`` reads only
  the ``j``-th chunk of segment ``s`` (work proportional to the kept tokens; programs past a
  short segment's end return at once) and keeps a running max / sum / weighted value in
  registers; a second kernel merges the chunks by log-sum-exp. No host synchronisation: the
  grid is sized from the host's mirror of the longest segment.
* everywhere else: a vectorised torch version over fixed-size blocks of each segment (one
  batched matmul per step, segment softmax by ``scatter_reduce``/``index_add``), which works
  in every dtype on every device and is the reference for the kernel.
"""

from __future__ import annotations

import math
import os

import torch

try:  # Triton ships with CUDA builds of PyTorch; CPU builds may lack it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None
    tl = None

TORCH_BLOCK = 64


def _segment_table(segment_start, segment_length_host, block):
    """Blocks of every segment: ``(segment_of_block [NB], token_index [NB, block], in_segment [NB, block])``."""
    device = segment_start.device
    blocks_per_segment = (segment_length_host + block - 1) // block
    segments = torch.arange(segment_length_host.numel(), device=device)
    counts = blocks_per_segment.to(device)
    # This path runs where the lengths live on the host (CPU), so the size is no device read.
    segment_of_block = torch.repeat_interleave(segments, counts)
    total_blocks = segment_of_block.numel()
    first_block = torch.cumsum(counts, 0) - counts
    block_in_segment = torch.arange(total_blocks, device=device) - first_block[segment_of_block]
    offset = block_in_segment[:, None] * block + torch.arange(block, device=device)[None, :]
    lengths = segment_length_host.to(device)
    in_segment = offset < lengths[segment_of_block][:, None]
    token_index = segment_start[segment_of_block][:, None] + torch.where(in_segment, offset, 0)
    return segment_of_block, token_index, in_segment


def _page_table(segment_capacity_host, segment_length_host, page, device, total_pages):
    """Pages of a paged buffer of ``total_pages`` pages (segments tile it in order, each capacity a
    multiple of ``page``): ``(segment_of_page [P], in_segment [P, page])``."""
    pages_per_segment = (segment_capacity_host // page).to(device)
    end_page = torch.cumsum(pages_per_segment, 0)
    # The buffer's size gives the number of pages: no read of the per-segment counts. (A search
    # rather than repeat_interleave, whose sync-free form, with output_size, tools that count
    # syncs by op name cannot tell from the syncing one.)
    page_index = torch.arange(total_pages, device=device)
    segment_of_page = torch.searchsorted(end_page, page_index, right=True)
    page_in_segment = page_index - (end_page - pages_per_segment)[segment_of_page]
    offset = page_in_segment[:, None] * page + torch.arange(page, device=device)[None, :]
    return segment_of_page, offset < segment_length_host.to(device)[segment_of_page][:, None]


def varlen_attention_torch(
    query_rows,
    keys,
    values,
    segment_start,
    segment_length_host,
    scaling,
    positions=None,
    mask=None,
    heads=1,
    num_queries=1,
    block=TORCH_BLOCK,
    segment_capacity_host=None,
):
    """Reference/CPU path. ``query_rows [S, R, d]`` → ``[S, R, dv]``.

    ``mask`` (optional) is the model's boolean mask ``[B, q, N]`` over original positions; row
    ``r`` of a segment is query ``r % num_queries`` and is masked at the stored tokens'
    ``positions``. With ``segment_capacity_host`` the buffer is paged (segments tile it in order,
    capacities multiples of ``block``): its pages are the blocks, viewed without a copy;
    otherwise each segment's blocks are gathered.
    """
    num_segments, rows, _ = query_rows.shape
    if segment_capacity_host is not None:
        if keys.shape[0] % block:
            raise ValueError(f"paged buffer of {keys.shape[0]} rows is not whole pages of {block}")
        pages = keys.shape[0] // block
        segment_of_block, in_segment = _page_table(
            segment_capacity_host.reshape(-1), segment_length_host.reshape(-1), block, keys.device, pages
        )
        block_keys = keys.view(pages, block, keys.shape[-1])  # [NB, block, d], no copy
        block_values = values.view(pages, block, values.shape[-1])
        token_index = torch.arange(pages * block, device=keys.device).view(pages, block)
    else:
        segment_of_block, token_index, in_segment = _segment_table(
            segment_start, segment_length_host.reshape(-1), block
        )
        flat_index = token_index.reshape(-1)  # index_select copies whole rows (much faster than keys[index])
        block_keys = keys.index_select(0, flat_index).view(*token_index.shape, keys.shape[-1])  # [NB, block, d]
        block_values = values.index_select(0, flat_index).view(*token_index.shape, values.shape[-1])
    allowed = in_segment[:, None, :]
    if mask is not None:
        batch_of_block = segment_of_block // heads
        query_index = torch.arange(rows, device=mask.device) % num_queries
        stored_positions = positions[token_index].long()  # [NB, block]
        allowed = (
            allowed & mask[batch_of_block[:, None, None], query_index[None, :, None], stored_positions[:, None, :]]
        )
    return _block_attention(query_rows, block_keys, block_values, segment_of_block, allowed, scaling)


def _block_attention(query_rows, block_keys, block_values, segment_of_block, allowed, scaling):
    """Each segment's query rows over its blocks (``allowed [NB, R|1, block]``), merged per segment
    by a segment-wise softmax: ``[S, R, dv]``."""
    num_segments, rows, _ = query_rows.shape
    block_queries = query_rows[segment_of_block]  # [NB, R, d]
    logits = torch.matmul(block_queries, block_keys.transpose(1, 2)).float() * scaling  # [NB, R, block]
    logits = logits.masked_fill(~allowed, float("-inf"))
    block_max = logits.amax(dim=-1)  # [NB, R]
    segment_max = torch.full((num_segments, rows), float("-inf"), device=logits.device)
    segment_max = segment_max.scatter_reduce(0, segment_of_block[:, None].expand(-1, rows), block_max, "amax")
    # A row that may see no key at all (only possible for masked prompt rows) stays finite.
    segment_max = torch.where(torch.isfinite(segment_max), segment_max, torch.zeros_like(segment_max))
    weights = torch.exp(logits - segment_max[segment_of_block][:, :, None])
    denominator = torch.zeros(num_segments, rows, device=logits.device).index_add_(0, segment_of_block, weights.sum(-1))
    partial = torch.matmul(weights.to(block_values.dtype), block_values).float()  # [NB, R, dv]
    numerator = torch.zeros(num_segments, rows, block_values.shape[-1], device=logits.device)
    numerator.index_add_(0, segment_of_block, partial)
    return (numerator / denominator[:, :, None]).to(query_rows.dtype)


def varlen_attention_paged(
    query_rows,
    keys,
    values,
    segment_start,
    segment_length,
    page_segment,
    page_offset,
    bound,
    scaling,
    allowed=None,
):
    """One decode step's attention over a packed layer with shapes that do not change from step to
    step (a compiled step; see ``LayerStore.packed_pages``): ``[S, R, d]`` -> ``[S, R, dv]``.

    Everything comes from the device: ``segment_length [S]`` (the lengths the step appended at),
    the fixed page table (``page_segment``, ``page_offset`` ``[P]``) and ``allowed [C]`` (slots that
    may be attended beside the length, e.g. not left padding; None: all). No host length is read.
    On CUDA the split-K kernel runs over each segment's stored tokens, its grid sized by ``bound``
    (the largest segment capacity, fixed by the layout; programs past a segment's length return at
    once); elsewhere every page is read in place and slots past a segment's length are masked
    (work proportional to the kept tokens plus the reserved room)."""
    if allowed is None and query_rows.is_cuda and kernel_supports(query_rows, keys, values):
        return varlen_attention_kernel(
            query_rows, keys, values, scaling, bound, segment_start=segment_start, segment_length=segment_length
        )
    pages = page_segment.shape[0]
    block = keys.shape[0] // pages
    block_keys = keys.view(pages, block, keys.shape[-1])  # no copy: segments tile the buffer by pages
    block_values = values.view(pages, block, values.shape[-1])
    offset = page_offset[:, None] + torch.arange(block, device=keys.device)[None, :]
    in_segment = offset < segment_length.long()[page_segment][:, None]
    if allowed is not None:
        in_segment = in_segment & allowed.view(pages, block)
    return _block_attention(query_rows, block_keys, block_values, page_segment, in_segment[:, None, :], scaling)


if triton is not None:

    @triton.jit
    def _split_kernel(
        query_ptr,
        key_ptr,
        value_ptr,
        start_ptr,
        length_ptr,
        part_out_ptr,
        part_max_ptr,
        part_sum_ptr,
        logits_ptr,
        scaling,
        rows,
        chunk,
        num_splits,
        uniform_stride,
        uniform_start,
        uniform_length,
        stride_qs,
        stride_qr,
        stride_k,
        stride_v,
        stride_ls,
        stride_lr,
        UNIFORM: tl.constexpr,
        STORE_LOGITS: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        VALUE_DIM: tl.constexpr,
    ):
        segment = tl.program_id(0)
        split = tl.program_id(1)
        if UNIFORM:
            start = segment.to(tl.int64) * uniform_stride + uniform_start
            length = uniform_length
        else:
            start = tl.load(start_ptr + segment)
            length = tl.load(length_ptr + segment)
        low = split * chunk
        high = tl.minimum(low + chunk, length)
        row = tl.arange(0, BLOCK_R)
        dim = tl.arange(0, HEAD_DIM)
        vdim = tl.arange(0, VALUE_DIM)
        row_ok = row < rows
        query = tl.load(
            query_ptr + segment.to(tl.int64) * stride_qs + row[:, None] * stride_qr + dim[None, :],
            mask=row_ok[:, None],
            other=0.0,
        )
        running_max = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        running_sum = tl.zeros([BLOCK_R], dtype=tl.float32)
        accumulator = tl.zeros([BLOCK_R, VALUE_DIM], dtype=tl.float32)
        token = tl.arange(0, BLOCK_N)
        for first in range(low, high, BLOCK_N):
            index = first + token
            valid = index < high
            address = start + index.to(tl.int64)
            key = tl.load(key_ptr + address[:, None] * stride_k + dim[None, :], mask=valid[:, None], other=0.0)
            logits = tl.dot(query, tl.trans(key)) * scaling
            logits = tl.where(valid[None, :], logits, float("-inf"))
            if STORE_LOGITS:  # the scaled logits of every key, for the weights (exp(logit - lse))
                tl.store(
                    logits_ptr + segment.to(tl.int64) * stride_ls + row[:, None] * stride_lr + index[None, :],
                    logits,
                    mask=row_ok[:, None] & valid[None, :],
                )
            new_max = tl.maximum(running_max, tl.max(logits, 1))
            correction = tl.exp(running_max - new_max)
            weights = tl.exp(logits - new_max[:, None])
            running_sum = running_sum * correction + tl.sum(weights, 1)
            value = tl.load(value_ptr + address[:, None] * stride_v + vdim[None, :], mask=valid[:, None], other=0.0)
            accumulator = accumulator * correction[:, None] + tl.dot(weights.to(value.dtype), value)
            running_max = new_max
        part = (segment * num_splits + split).to(tl.int64)
        tl.store(part_max_ptr + part * BLOCK_R + row, running_max)
        tl.store(part_sum_ptr + part * BLOCK_R + row, running_sum)
        tl.store(part_out_ptr + (part * BLOCK_R + row[:, None]) * VALUE_DIM + vdim[None, :], accumulator)

    @triton.jit
    def _merge_kernel(
        part_out_ptr,
        part_max_ptr,
        part_sum_ptr,
        out_ptr,
        lse_ptr,
        rows,
        num_splits,
        stride_os,
        stride_or,
        BLOCK_R: tl.constexpr,
        VALUE_DIM: tl.constexpr,
        STORE_LSE: tl.constexpr,
    ):
        segment = tl.program_id(0)
        row = tl.arange(0, BLOCK_R)
        vdim = tl.arange(0, VALUE_DIM)
        base = segment.to(tl.int64) * num_splits
        overall = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        for split in range(0, num_splits):
            overall = tl.maximum(overall, tl.load(part_max_ptr + (base + split) * BLOCK_R + row))
        overall = tl.where(overall == float("-inf"), 0.0, overall)
        total = tl.zeros([BLOCK_R], dtype=tl.float32)
        accumulator = tl.zeros([BLOCK_R, VALUE_DIM], dtype=tl.float32)
        for split in range(0, num_splits):
            part = base + split
            weight = tl.exp(tl.load(part_max_ptr + part * BLOCK_R + row) - overall)
            total += tl.load(part_sum_ptr + part * BLOCK_R + row) * weight
            accumulator += (
                tl.load(part_out_ptr + (part * BLOCK_R + row[:, None]) * VALUE_DIM + vdim[None, :]) * weight[:, None]
            )
        result = accumulator / total[:, None]
        tl.store(
            out_ptr + segment.to(tl.int64) * stride_os + row[:, None] * stride_or + vdim[None, :],
            result.to(out_ptr.dtype.element_ty),
            mask=(row < rows)[:, None],
        )
        if STORE_LSE:  # log-sum-exp of the row's logits over the whole segment
            tl.store(lse_ptr + segment.to(tl.int64) * BLOCK_R + row, overall + tl.log(total), mask=row < rows)


_SM_COUNT: dict[int, int] = {}
KERNEL_BLOCK = 64


def _target_programs(device: torch.device) -> int:
    """Programs to launch: four per multiprocessor on CUDA (a few for Triton's CPU interpreter)."""
    if device.type != "cuda":
        return 16
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return 4 * _SM_COUNT[index]


def kernel_runs_on(tensor: torch.Tensor) -> bool:
    """Whether the Triton kernel can run on ``tensor``'s device at all (before any shape check)."""
    # Triton's interpreter (TRITON_INTERPRET=1) runs the kernel on CPU tensors: that is how CI tests it.
    return triton is not None and (tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def kernel_supports(query_rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether the Triton kernel handles these shapes and dtypes."""
    if not kernel_runs_on(query_rows):
        return False
    d, dv = keys.shape[-1], values.shape[-1]
    power_of_two = lambda n: n >= 16 and n & (n - 1) == 0  # noqa: E731
    return (
        power_of_two(d)
        and power_of_two(dv)
        and d <= 256
        and dv <= 256
        and query_rows.shape[1] <= 64
        and query_rows.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and keys.stride(-1) == 1
        and values.stride(-1) == 1
        and query_rows.stride(-1) == 1
    )


def varlen_attention_kernel(
    query_rows,
    keys,
    values,
    scaling,
    max_length,
    *,
    segment_start=None,
    segment_length=None,
    uniform=None,
    return_weights=False,
):
    """Triton path (CUDA). ``uniform = (stride, start, length)`` reads segment ``s`` at
    ``s * stride + start`` with ``length`` tokens each (a dense buffer's slice) instead of the
    per-segment tensors. ``keys``/``values`` are 2-D ``[C, d]`` row views.

    ``return_weights``: ``(output, weights, logits)`` with the softmax weights and the scaled
    logits ``[S, R, max_length]`` (float32; past a segment's length, weight 0 and logit 0) from the
    same pass, for the methods that score by the new query's attention (TOVA, H2O, AhaKV,
    BumbleBee): the split kernel stores each key's scaled logit as it goes and the merge the row's
    log-sum-exp, so the weights are ``exp(logit - lse)``, one elementwise pass instead of a second
    ``QK^T`` (AhaKV takes the softmax of the logits times its gain)."""
    num_segments, rows, _ = query_rows.shape
    device = query_rows.device
    block_r = max(16, triton.next_power_of_2(rows))
    # Enough programs to fill the GPU a few times over; each chunk a whole number of blocks.
    max_blocks = max(1, math.ceil(max_length / KERNEL_BLOCK))
    num_splits = max(1, min(max_blocks, math.ceil(_target_programs(device) / max(1, num_segments))))
    chunk = math.ceil(max_blocks / num_splits) * KERNEL_BLOCK
    num_splits = max(1, math.ceil(max_length / chunk))
    value_dim = values.shape[-1]
    part_out = torch.empty(num_segments * num_splits * block_r * value_dim, device=device, dtype=torch.float32)
    part_max = torch.empty(num_segments * num_splits * block_r, device=device, dtype=torch.float32)
    part_sum = torch.empty_like(part_max)
    output = torch.empty(num_segments, rows, value_dim, device=device, dtype=query_rows.dtype)
    if return_weights:
        # Keys past a segment's length are never written: a finite 0 there, as an unmasked logit
        # is (a caller may multiply the logits before masking them), and a weight of 0 below.
        logits = torch.zeros(num_segments, rows, max_length, device=device, dtype=torch.float32)
        lse = torch.empty(num_segments, block_r, device=device, dtype=torch.float32)
    else:
        logits = lse = part_max  # unused
    if uniform is not None:
        stride, start, length = uniform
        start_tensor = length_tensor = part_max  # unused
    else:
        stride = start = length = 0
        start_tensor, length_tensor = segment_start, segment_length
    _split_kernel[(num_segments, num_splits)](
        query_rows,
        keys,
        values,
        start_tensor,
        length_tensor,
        part_out,
        part_max,
        part_sum,
        logits,
        scaling,
        rows,
        chunk,
        num_splits,
        stride,
        start,
        length,
        query_rows.stride(0),
        query_rows.stride(1),
        keys.stride(0),
        values.stride(0),
        rows * max_length if return_weights else 0,
        max_length if return_weights else 0,
        UNIFORM=uniform is not None,
        STORE_LOGITS=return_weights,
        BLOCK_R=block_r,
        BLOCK_N=KERNEL_BLOCK,
        HEAD_DIM=keys.shape[-1],
        VALUE_DIM=value_dim,
        num_warps=4,
        num_stages=2,
    )
    _merge_kernel[(num_segments,)](
        part_out,
        part_max,
        part_sum,
        output,
        lse,
        rows,
        num_splits,
        output.stride(0),
        output.stride(1),
        BLOCK_R=block_r,
        VALUE_DIM=value_dim,
        STORE_LSE=return_weights,
        num_warps=4,
    )
    if not return_weights:
        return output
    weights = torch.exp(logits - lse[:, :rows, None])
    if uniform is None:  # segments of different lengths: nothing past each one's end
        past_end = torch.arange(max_length, device=device) >= segment_length.to(device)[:, None, None]
        weights = weights.masked_fill_(past_end, 0.0)
    return output, weights, logits


def varlen_attention(
    query_rows,
    keys,
    values,
    segment_start,
    segment_length,
    segment_length_host,
    max_length,
    scaling,
    positions=None,
    mask=None,
    heads=1,
    num_queries=1,
    segment_capacity_host=None,
    page=TORCH_BLOCK,
):
    """``[S, R, d]`` query rows attending their own segment → ``[S, R, dv]`` (see module doc)."""
    if mask is None and kernel_supports(query_rows, keys, values):
        return varlen_attention_kernel(
            query_rows, keys, values, scaling, max_length, segment_start=segment_start, segment_length=segment_length
        )
    return varlen_attention_torch(
        query_rows,
        keys,
        values,
        segment_start,
        segment_length_host,
        scaling,
        positions=positions,
        mask=mask,
        heads=heads,
        num_queries=num_queries,
        block=page,
        segment_capacity_host=segment_capacity_host,
    )
