"""Run kvhive's Triton column-sum kernel in Triton's CPU interpreter (``TRITON_INTERPRET=1`` must
be set before this module imports triton) against the torch path
(``ScoringInputs.attention_with_column_sums``) and a float64 reference; prints JSON
``{case: largest absolute error}``. Used by ``test_column_sums_kernel_interpreted.py``.

bf16 is left out here (the interpreter's ``tl.dot`` on bf16 operands is wrong, see
``triton_kernel_check.py``); ``tests_gpu/test_cuda.py`` checks bf16 on a GPU.
"""

import json
import sys

import torch

import kvhive.attention.column_sums as column_sums_module
from kvhive.attention.column_sums import (
    column_sums,
    flash_attention_with_column_sums_by_row,
    kernel_supports,
    left_padding,
)
from kvhive.methods.base import ScoringInputs


def reference(q, k, allowed, scaling):
    """float64 (lse [B, Hq, q], column sums [B, Hq, N]) with ``allowed`` [B, 1, q, N]."""
    group = q.shape[1] // k.shape[1]
    logits = q.double() @ k.double().repeat_interleave(group, dim=1).transpose(-1, -2) * scaling
    logits = logits.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    return lse, weights.sum(dim=2)


def torch_path(q, k, mask, scaling):
    batch, heads, n, _ = k.shape
    positions = torch.arange(n).expand(batch, heads, n)
    scoring = ScoringInputs(k, k, q, positions, mask, scaling, 0, 1, n, "prefill")
    return scoring.summed_attention(0)


def main():
    generator = torch.Generator().manual_seed(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    errors = {}
    cases = [
        # name, batch, query heads, heads, queries, keys, dim, padding of row 1
        ("gqa-causal", 2, 4, 2, 70, 70, 32, 0),
        ("gqa-padded", 2, 4, 2, 70, 70, 32, 9),
        ("mha-newest-queries", 1, 2, 2, 30, 75, 16, 0),
        ("group4-dim24", 1, 8, 2, 45, 45, 24, 0),
    ]
    scaling = 0.3
    for dtype in (torch.float32, torch.float16):
        for name, batch, query_heads, heads, num_queries, num_keys, dim, padding in cases:
            q = torch.randn(batch, query_heads, num_queries, dim, generator=generator).to(dtype)
            k = torch.randn(batch, heads, num_keys, dim, generator=generator).to(dtype)
            causal = torch.ones(num_keys, num_keys, dtype=torch.bool).tril()[num_keys - num_queries :]
            allowed = causal[None, None].repeat(batch, 1, 1, 1)
            mask = None
            if padding:
                allowed[1, :, :, :padding] = False
                mask = allowed
            assert kernel_supports(q, k, mask)
            lse, expected = reference(q, k, allowed, scaling)
            sums = column_sums(q, k, lse.float(), scaling, mask)
            errors[f"{name}-{dtype}-reference"] = float((sums.double() - expected).abs().max())
            if dtype == torch.float32:
                errors[f"{name}-{dtype}-torch"] = float((sums - torch_path(q, k, mask, scaling)).abs().max())
    errors.update(by_row_errors(generator, scaling))
    print(json.dumps(errors))


def cpu_flash_with_lse(query, key, value, scaling):
    """The CPU's flash attention, which returns the row log-sum-exp as CUDA's does (keys repeated
    per query head: the CPU kernel takes no groups)."""
    group = query.shape[1] // key.shape[1]
    key, value = (tensor.repeat_interleave(group, dim=1) for tensor in (key, value))
    output, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, True, scale=scaling
    )
    return output, lse


def by_row_errors(generator, scaling):
    """``flash_attention_with_column_sums_by_row`` (a left-padded batch row by row: flash attention
    over each row's real tokens, then the kernel) against the torch path over the same mask, float32:
    the largest error of the output and of the sums, per case."""
    errors = {}
    column_sums_module.flash_attention_with_lse = cpu_flash_with_lse  # the CUDA kernel's CPU twin
    # name, batch, query heads, heads, tokens, dim, padding per row
    cases = [("by-row-gqa", 3, 4, 2, 40, 16, (0, 7, 39)), ("by-row-mha-all-padding", 2, 2, 2, 24, 8, (24, 5))]
    for name, batch, query_heads, heads, n, dim, padding in cases:
        q = torch.randn(batch, query_heads, n, dim, generator=generator)
        k = torch.randn(batch, heads, n, dim, generator=generator)
        v = torch.randn(batch, heads, n, dim, generator=generator)
        position = torch.arange(n)
        real = position[None, :] >= torch.tensor(padding)[:, None]
        mask = ((position[None, :] <= position[:, None])[None] & real[:, None, :] & real[:, :, None])[:, None]
        assert left_padding(mask) == list(padding), left_padding(mask)
        output, sums = flash_attention_with_column_sums_by_row(q, k, v, mask, scaling)
        positions = torch.arange(n).expand(batch, heads, n)
        scoring = ScoringInputs(k, v, q, positions, mask, scaling, 0, 1, n, "prefill")
        expected_output, expected_sums = scoring.attention_with_column_sums()
        errors[f"{name}-output"] = float((output - expected_output).abs().max())
        errors[f"{name}-sums"] = float((sums - expected_sums).abs().max())
    return errors


if __name__ == "__main__":
    main()
