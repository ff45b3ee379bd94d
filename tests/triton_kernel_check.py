"""Run kvhive's Triton decode kernel in Triton's CPU interpreter (``TRITON_INTERPRET=1`` must be
set before this module imports triton) against a float64 per-segment reference; prints JSON
``{case: relative error}``. Used by ``test_triton_kernel_interpreted.py``.

bf16 is left out here: the interpreter computes ``tl.dot`` on bf16 operands wrongly (numpy has
no bf16; a plain bf16 16x16 product already differs by 1e10), so bf16 can only be checked on a
GPU (``test_dtypes_and_decode_path.py::test_triton_varlen_kernel_matches_reference``).
"""

import json
import sys

import torch

from kvhive.attention.varlen import varlen_attention_kernel


def relative(actual, expected):
    return float((actual.double() - expected).norm() / expected.norm())


def dense_layer_error(generator):
    """The attention's dense-decode glue: a real sliding LayerStore whose stored tokens are a
    slice of a larger buffer (its rows strided by the capacity, the oldest tokens dropped and the
    window moved to the front), one GQA query, kernel vs float64 reference."""
    from kvhive.attention.integration import _dense_decode_by_kernel
    from kvhive.cache.storage import LayerStore

    store = LayerStore(0, sliding_window=40)
    store.update(torch.randn(2, 2, 50, 16, generator=generator), torch.randn(2, 2, 50, 16, generator=generator))
    store.update(torch.randn(2, 2, 1, 16, generator=generator), torch.randn(2, 2, 1, 16, generator=generator))
    store.drop_oldest(store.dense_length - 40)
    assert store.buffers()[0].shape[2] > store.dense_length  # the kernel reads a strided slice
    query = torch.randn(2, 4, 1, 16, generator=generator)
    output = _dense_decode_by_kernel(store, query, 0.25)  # [B, 1, Hq, d]
    keys, values, _, _ = store.dense()
    keys = keys.repeat_interleave(2, dim=1).double()
    values = values.repeat_interleave(2, dim=1).double()
    expected = torch.softmax(query.double() @ keys.transpose(-1, -2) * 0.25, -1) @ values  # [B, Hq, 1, d]
    return relative(output.transpose(1, 2), expected)


def main():
    generator = torch.Generator().manual_seed(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    errors = {}
    lengths = [1, 63, 64, 65, 300, 3, 700, 128]
    dim = 32
    starts = torch.tensor([sum(lengths[:i]) + 7 * i for i in range(len(lengths))])
    capacity = sum(lengths) + 7 * len(lengths)
    for dtype in (torch.float32, torch.float16):
        keys = torch.randn(capacity, dim, generator=generator).to(dtype)
        values = torch.randn(capacity, dim, generator=generator).to(dtype)
        rows = torch.randn(len(lengths), 4, dim, generator=generator).to(dtype)
        expected = []
        for s, length in enumerate(lengths):
            k = keys[starts[s] : starts[s] + length].double()
            v = values[starts[s] : starts[s] + length].double()
            expected.append(torch.softmax(rows[s].double() @ k.T * 0.2, -1) @ v)
        output = varlen_attention_kernel(
            rows,
            keys,
            values,
            0.2,
            max(lengths),
            segment_start=starts,
            segment_length=torch.tensor(lengths, dtype=torch.int32),
        )
        errors[f"segments-{dtype}"] = relative(output, torch.stack(expected))
    # A dense buffer's slice [start, start + length) of every row, read in place.
    batch, heads, capacity, length, start = 2, 3, 50, 37, 5
    keys = torch.randn(batch, heads, capacity, dim, generator=generator)
    values = torch.randn(batch, heads, capacity, dim, generator=generator)
    rows = torch.randn(batch * heads, 2, dim, generator=generator)
    output = varlen_attention_kernel(
        rows, keys.view(-1, dim), values.view(-1, dim), 0.3, length, uniform=(capacity, start, length)
    )
    k = keys[:, :, start : start + length].reshape(batch * heads, length, dim).double()
    v = values[:, :, start : start + length].reshape(batch * heads, length, dim).double()
    errors["uniform-float32"] = relative(output, torch.softmax(rows.double() @ k.transpose(1, 2) * 0.3, -1) @ v)
    errors["dense-layer-float32"] = dense_layer_error(generator)
    print(json.dumps(errors))


if __name__ == "__main__":
    main()
