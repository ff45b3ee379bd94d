"""Column sums of causal softmax attention from the rows' log-sum-exp (Triton).

A policy that scores prompt tokens by accumulated attention (H2O, BUZZ, BumbleBee) needs, per
query head ``h`` and key ``n``, ``sum_i softmax(q_i K^T * scale)[n] = sum_i exp(q_i . k_n * scale
- lse_i)`` over the query rows ``i`` that may attend ``n``. A flash kernel returns ``lse`` (the
row log-sum-exp) with its output, so the column sums need no softmax of their own: this kernel
recomputes ``q . k`` block by block, exponentiates against ``lse`` and sums over query rows.

Program ``(j, b * H + h)`` loads key block ``j`` of stored head ``h`` once and walks the query
rows of every query head of its group (GQA without repeating keys) from the first row that may
see the block (causal: the queries are the newest ``q`` of ``N`` keys), accumulating in float32
registers. An optional boolean mask ``[B, 1, q, N]`` (the model's: padding, a window) is applied
on top of causality. Each key column is written once (no atomics).

The torch reference, and the path everywhere the kernel does not run, is
:meth:`kvhive.methods.base.ScoringInputs.attention_with_column_sums` (tests/attention/column_sums_check.py
runs this kernel in Triton's interpreter against it).

The passes the attention runs instead of sdpa where the method reads the column sums of the
queries' weights: :func:`prompt_attention_with_column_sums` (a prefill) and
:func:`chunk_attention_with_column_sums` (a prompt chunk over a layer's kept tokens).
"""

from __future__ import annotations

import os
import weakref

import torch

from kvhive.methods.base import PREFILL
from kvhive.methods.scoring import attention_with_column_sums as scoring_attention_with_column_sums

try:  # Triton ships with CUDA builds of PyTorch; CPU builds may lack it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None
    tl = None

_LOG2E = 1.4426950408889634

if triton is not None:

    @triton.jit
    def _column_sums_kernel(
        query,
        key,
        lse,
        mask,
        out,
        stride_qb,
        stride_qh,
        stride_qm,
        stride_kb,
        stride_kh,
        stride_kn,
        stride_lb,
        stride_lh,
        stride_mb,
        stride_mm,
        stride_mn,
        stride_ob,
        stride_oh,
        num_heads,
        num_queries,
        num_keys,
        scale_log2,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        HAS_MASK: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        block = tl.program_id(0)
        pair = tl.program_id(1)
        b = pair // num_heads
        h = pair % num_heads
        n = block * BLOCK_N + tl.arange(0, BLOCK_N)
        d = tl.arange(0, BLOCK_D)
        in_keys = n < num_keys
        k = tl.load(
            key + b * stride_kb + h * stride_kh + n[:, None] * stride_kn + d[None, :],
            mask=in_keys[:, None] & (d[None, :] < HEAD_DIM),
            other=0.0,
        )
        offset = num_keys - num_queries  # query row r sits at position offset + r
        # The first query row that may see this block's first key (rows before it see none of it).
        first_row = tl.maximum(block * BLOCK_N - offset, 0)
        first_row = (first_row // BLOCK_M) * BLOCK_M
        for g in range(GROUP):
            head = h * GROUP + g
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for start in range(first_row, num_queries, BLOCK_M):
                r = start + tl.arange(0, BLOCK_M)
                in_rows = r < num_queries
                q = tl.load(
                    query + b * stride_qb + head * stride_qh + r[:, None] * stride_qm + d[None, :],
                    mask=in_rows[:, None] & (d[None, :] < HEAD_DIM),
                    other=0.0,
                )
                row_lse = tl.load(lse + b * stride_lb + head * stride_lh + r, mask=in_rows, other=0.0)
                if IEEE:
                    logits = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    logits = tl.dot(q, tl.trans(k))
                allowed = in_rows[:, None] & in_keys[None, :] & (n[None, :] <= offset + r[:, None])
                if HAS_MASK:
                    allowed &= (
                        tl.load(
                            mask + b * stride_mb + r[:, None] * stride_mm + n[None, :] * stride_mn,
                            mask=in_rows[:, None] & in_keys[None, :],
                            other=0,
                        )
                        != 0
                    )
                # A fully masked row (left padding) has lse -inf: where() drops its NaN.
                weights = tl.where(allowed, tl.exp2(logits * scale_log2 - row_lse[:, None] * 1.4426950408889634), 0.0)
                acc += tl.sum(weights, axis=0)
            tl.store(out + b * stride_ob + head * stride_oh + n, acc, mask=in_keys)


def kernel_supports(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None = None) -> bool:
    """Whether :func:`column_sums` runs on these tensors: Triton on a CUDA device (or its CPU
    interpreter), float32/16/bf16, head dim <= 256, queries the newest of the keys, query heads a
    multiple of key heads, a mask (if any) ``[B, 1, q, N]`` boolean."""
    if triton is None or not (query.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    batch, query_heads, num_queries, dim = query.shape
    return (
        query.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and key.dtype == query.dtype
        and key.shape[0] == batch
        and key.shape[-1] == dim <= 256
        and query_heads % key.shape[1] == 0
        and key.shape[2] >= num_queries
        and query.stride(-1) == 1
        and key.stride(-1) == 1
        and (
            mask is None
            or (
                mask.dtype == torch.bool
                and mask.dim() == 4
                and mask.shape[1] == 1
                and mask.shape[-2:] == (num_queries, key.shape[2])
            )
        )
    )


def column_sums(
    query: torch.Tensor, key: torch.Tensor, lse: torch.Tensor, scaling: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Column sums ``[B, Hq, N]`` (float32) of ``softmax(query key^T * scaling)`` over the causal
    keys of each query row (and ``mask`` ``[B, 1, q, N]``, True = may attend, if given).

    ``query`` ``[B, Hq, q, d]`` (the newest ``q`` of the ``N`` keys), ``key`` ``[B, H, N, d]``,
    ``lse`` ``[B, Hq, >= q]`` float32: the natural log-sum-exp of each row's scaled logits over the
    keys it attends (what flash attention returns; ``-inf`` for a row that attends nothing)."""
    batch, query_heads, num_queries, dim = query.shape
    heads, num_keys = key.shape[1], key.shape[2]
    out = torch.zeros(batch, query_heads, num_keys, dtype=torch.float32, device=query.device)
    # The kernel walks a row's queries at stride 1 (the CPU's flash attention lays its lse out [B, q, H]).
    lse = lse.float().contiguous()
    block_d = max(16, triton.next_power_of_2(dim))
    block_n = 64 if block_d <= 128 else 32
    block_m = 64 if block_d <= 128 else 32
    if mask is not None:
        mask_arg, mask_strides = mask, (mask.stride(0), mask.stride(2), mask.stride(3))
    else:
        mask_arg, mask_strides = out, (0, 0, 0)  # never read (HAS_MASK False)
    grid = (triton.cdiv(num_keys, block_n), batch * heads)
    _column_sums_kernel[grid](
        query,
        key,
        lse,
        mask_arg,
        out,
        query.stride(0),
        query.stride(1),
        query.stride(2),
        key.stride(0),
        key.stride(1),
        key.stride(2),
        lse.stride(0),
        lse.stride(1),
        *mask_strides,
        out.stride(0),
        out.stride(1),
        heads,
        num_queries,
        num_keys,
        scaling * _LOG2E,
        GROUP=query_heads // heads,
        HEAD_DIM=dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        HAS_MASK=mask is not None,
        IEEE=query.dtype == torch.float32,
    )
    return out


def flash_runs_on(query: torch.Tensor) -> bool:
    """Whether :func:`flash_attention_with_lse` may run on these queries: CUDA, float16/bfloat16, a
    head dim of at most 256 (asked first where reaching it costs work, e.g. :func:`left_padding`)."""
    return query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] <= 256


def flash_attention_with_lse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float):
    """Causal attention ``(output [B, Hq, q, d], lse [B, Hq, q] float32)`` by sdpa's flash kernel
    (CUDA, float16/bfloat16, no mask, ``q == N``), which returns the row log-sum-exp with its output;
    None where it does not run. Keys and values are given per stored head (flash attention reads
    a group's keys once); where the kernel refuses that, they are repeated per query head."""
    if not flash_runs_on(query):
        return None
    if key.shape[2] != query.shape[2]:
        return None
    flash = torch.ops.aten._scaled_dot_product_flash_attention
    try:
        result = flash(query, key, value, 0.0, True, False, scale=scaling)
    except RuntimeError:
        group = query.shape[1] // key.shape[1]
        if group == 1:
            return None
        key = key.repeat_interleave(group, dim=1)
        value = value.repeat_interleave(group, dim=1)
        try:
            result = flash(query, key, value, 0.0, True, False, scale=scaling)
        except RuntimeError:
            return None
    return result[0], result[1]


# Elements of the [B, rows, N] comparison left_padding makes at once (bounds its temporaries).
_MASK_CHECK_ELEMENTS = 1 << 27
# left_padding's answer per mask tensor (and its version): transformers builds one mask per forward
# and hands the same tensor to every layer, so the check and its host read run once a forward, not
# once a layer. By the mask's id, held by a weak reference whose callback removes the entry when the
# mask is freed (a WeakKeyDictionary would compare two masks with ==, which is elementwise on tensors).
# Each access is one dict operation (atomic under the interpreter lock): threads need no lock, and a
# callback run by a collection in the middle of another access takes none.
_LEFT_PADDING: dict[int, tuple[weakref.ref, int, list[int] | None]] = {}


def left_padding(mask: torch.Tensor) -> list[int] | None:
    """Each batch row's padding ``p`` where ``mask`` ``[B, 1, N, N]`` (True = may attend) is exactly
    what transformers builds for a left-padded prompt: causal over the row's real tokens (its last
    ``N - p`` positions), its ``p`` padding queries attending nothing. None for any other mask (a
    window, packed documents, padding queries that attend something). One host read, the padding
    and the check together, once per mask (the later layers of a forward reuse the answer)."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != mask.shape[3]:
        return None
    key = id(mask)
    known = _LEFT_PADDING.get(key)
    if known is not None and known[0]() is mask and known[1] == mask._version:  # (an in-place change: again)
        return known[2]
    padding = _check_left_padding(mask)

    def forget(_, key=key):
        _LEFT_PADDING.pop(key, None)

    _LEFT_PADDING[key] = (weakref.ref(mask, forget), mask._version, padding)
    return padding


def _check_left_padding(mask: torch.Tensor) -> list[int] | None:
    """:func:`left_padding` computed (no memo)."""
    batch, _, n, _ = mask.shape
    # The last query sees every real token of its row: the padding is what it may not see.
    padding = n - mask[:, 0, -1].sum(dim=-1)
    position = torch.arange(n, device=mask.device)
    real = position[None, :] >= padding[:, None]  # [B, N]
    matches = torch.ones((), dtype=torch.bool, device=mask.device)
    rows = max(1, _MASK_CHECK_ELEMENTS // max(1, batch * n))
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        causal = position[None, :] <= position[start:stop, None]  # [rows, N]
        # (A padding query i < p then attends nothing: every key it may see, j <= i, is padding.)
        expected = causal[None] & real[:, None, :]
        matches &= torch.eq(mask[:, 0, start:stop], expected).all()
    report = torch.cat([matches.long().view(1), padding.long()]).tolist()
    return report[1:] if report[0] else None


def flash_attention_with_column_sums_by_row(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(output [B, Hq, N, dv], column sums [B, Hq, N] float32)`` of a left-padded prompt's causal
    attention (``mask`` as :func:`left_padding` recognises it), one batch row at a time over its real
    tokens: flash attention returns the output with each row's log-sum-exp (it takes no mask, and a
    row's real tokens are a suffix, so none is needed) and :func:`column_sums` sums ``exp(q.k *
    scale - lse)`` per key. Padding queries get output 0 and padding keys sum 0, as in the torch path
    (:meth:`kvhive.methods.base.ScoringInputs.attention_with_column_sums`), which stays the route
    where this returns None: any other mask, or flash attention not running on these tensors."""
    padding = left_padding(mask)
    if padding is None:
        return None
    batch, query_heads, n, _ = query.shape
    output = query.new_zeros(batch, query_heads, n, value.shape[-1])
    sums = torch.zeros(batch, query_heads, n, dtype=torch.float32, device=query.device)
    for row, pad in enumerate(padding):
        if pad >= n:  # every token padding: nothing attends, nothing is attended
            continue
        real = [tensor[row : row + 1, :, pad:] for tensor in (query, key, value)]
        flash = flash_attention_with_lse(*real, scaling)
        if flash is None:
            return None
        row_output, lse = flash
        output[row : row + 1, :, pad:] = row_output
        sums[row : row + 1, :, pad:] = column_sums(real[0], real[1], lse, scaling)
    return output, sums


# Keywords of transformers' attention call that change what sdpa computes: with any of them set,
# the attention runs sdpa and the scoring computes its column sums itself.
ATTENTION_CHANGES = ("softcap", "position_bias", "s_aux", "sinks", "head_mask")


def plain_softmax_attention(dropout, kwargs) -> bool:
    """Whether transformers asked for plain softmax attention (what kvhive's passes with column sums
    compute): no dropout, nothing that changes the logits."""
    return dropout == 0.0 and all(kwargs.get(name) is None for name in ATTENTION_CHANGES)


def prompt_attention_with_column_sums(query, key, value, mask, scaling):
    """``(output [B, q, Hq, dv], column sums [B, Hq, N] float32)`` of causal softmax attention
    over ``mask`` (None: causal). The computation is :meth:`ScoringInputs.attention_with_column_sums`
    (chunked: every chunk's softmax exact, the output ``P V`` and the sums ``P`` from one ``QK^T``),
    except on CUDA in half precision without a mask or with a left-padded batch's: there sdpa's
    flash kernel gives the output with each row's log-sum-exp (a padded batch row by row over its
    real tokens) and the Triton kernel sums ``exp(q.k * scale - lse)`` per key (its reference is the
    torch path)."""
    if flash_runs_on(query) and kernel_supports(query, key):
        if mask is None:
            flash = flash_attention_with_lse(query, key, value, scaling)
            if flash is not None:
                output, lse = flash
                return output.transpose(1, 2).contiguous(), column_sums(query, key, lse, scaling)
        else:  # a left-padded batch: row by row over each row's real tokens (None: another mask)
            by_row = flash_attention_with_column_sums_by_row(query, key, value, mask, scaling)
            if by_row is not None:
                output, sums = by_row
                return output.transpose(1, 2).contiguous(), sums
    batch, heads, num_keys, _ = key.shape
    positions = torch.arange(num_keys, device=key.device).expand(batch, heads, num_keys)
    output, sums = scoring_attention_with_column_sums(query, key, value, positions, mask, scaling, num_keys, PREFILL)
    return output.to(query.dtype).transpose(1, 2).contiguous(), sums


def chunk_attention_with_column_sums(query, keys, values, positions, tokens_seen: int, scaling, phase: str):
    """``(output [B, q, Hq, dv], column sums [B, Hq, L] float32)`` of ``q`` new queries (the newest
    of the ``L`` stored tokens, stored oldest first) over a dense layer's stored tokens, causal by
    their positions, from one pass of query chunks (:meth:`ScoringInputs.attention_with_column_sums`).

    ``phase`` is the phase of the scoring that reads the sums (``KVHiveCache.chunk_column_sums_phase``):
    its chunks and key ranges are the ones that scoring would use for itself, so the sums are its own
    bit for bit and the kept tokens are those of sdpa followed by a second ``QK^T`` pass."""
    output, sums = scoring_attention_with_column_sums(query, keys, values, positions, None, scaling, tokens_seen, phase)
    return output.to(query.dtype).transpose(1, 2), sums
