"""Run kvhive's Triton decode kernel in Triton's CPU interpreter (``TRITON_INTERPRET=1`` must be
set before this module imports triton) against a float64 per-segment reference; prints JSON
``{case: relative error}``. Used by ``test_triton_kernel_interpreted.py``.

bf16 is left out here: the interpreter computes ``tl.dot`` on bf16 operands wrongly (numpy has
no bf16; a plain bf16 16x16 product already differs by 1e10), so bf16 can only be checked on a
GPU (``test_dtypes_and_decode_path.py::test_triton_varlen_kernel_matches_reference``).
"""

import contextlib
import json
import sys

import torch

from kvhive.attention.varlen import varlen_attention_kernel


def relative(actual, expected):
    return float((actual.double() - expected).norm() / expected.norm())


@contextlib.contextmanager
def counting_kernel_calls():
    """The decode attention's calls of the kernel while inside, one ``return_weights`` flag each."""
    import kvhive.attention.decode as decode

    calls = []
    original = decode.varlen_attention_kernel

    def counting(*args, **kwargs):
        calls.append(kwargs.get("return_weights", False))
        return original(*args, **kwargs)

    decode.varlen_attention_kernel = counting
    try:
        yield calls
    finally:
        decode.varlen_attention_kernel = original


def dense_layer_error(generator):
    """The attention's dense-decode glue: a real sliding LayerStore whose stored tokens are a
    slice of a larger buffer (its rows strided by the capacity, the oldest tokens dropped and the
    window moved to the front), one GQA query, kernel vs float64 reference."""
    from kvhive.attention.decode import dense_decode_by_kernel
    from kvhive.cache.storage import LayerStore

    store = LayerStore(0, sliding_window=40)
    store.update(torch.randn(2, 2, 50, 16, generator=generator), torch.randn(2, 2, 50, 16, generator=generator))
    store.update(torch.randn(2, 2, 1, 16, generator=generator), torch.randn(2, 2, 1, 16, generator=generator))
    store.drop_oldest(store.dense_length - 40)
    assert store.buffers()[0].shape[2] > store.dense_length  # the kernel reads a strided slice
    query = torch.randn(2, 4, 1, 16, generator=generator)
    output = dense_decode_by_kernel(store, query, 0.25)  # [B, 1, Hq, d]
    keys, values, _, _ = store.dense()
    keys = keys.repeat_interleave(2, dim=1).double()
    values = values.repeat_interleave(2, dim=1).double()
    expected = torch.softmax(query.double() @ keys.transpose(-1, -2) * 0.25, -1) @ values  # [B, Hq, 1, d]
    return relative(output.transpose(1, 2), expected)


def weights_errors(generator):
    """``return_weights``: output and softmax weights of segments of different lengths (0 past a
    segment's end) against float64."""
    lengths = [1, 64, 65, 130, 7]
    dim, rows, scaling = 32, 3, 0.2
    capacity = 140
    keys = torch.randn(len(lengths) * capacity, dim, generator=generator)
    values = torch.randn(len(lengths) * capacity, dim, generator=generator)
    queries = torch.randn(len(lengths), rows, dim, generator=generator)
    starts = torch.arange(len(lengths)) * capacity
    output, weights, logits = varlen_attention_kernel(
        queries,
        keys,
        values,
        scaling,
        max(lengths),
        segment_start=starts,
        segment_length=torch.tensor(lengths),
        return_weights=True,
    )
    expected_weights = torch.zeros(len(lengths), rows, max(lengths), dtype=torch.float64)
    expected_logits = torch.zeros_like(expected_weights)  # 0 past a segment's end (an unmasked logit)
    expected_output = []
    for s, length in enumerate(lengths):
        k = keys[starts[s] : starts[s] + length].double()
        expected_logits[s, :, :length] = queries[s].double() @ k.T * scaling
        w = torch.softmax(expected_logits[s, :, :length], -1)
        expected_weights[s, :, :length] = w
        expected_output.append(w @ values[starts[s] : starts[s] + length].double())
    return {
        "weights-output-float32": relative(output, torch.stack(expected_output)),
        "weights-float32": relative(weights, expected_weights),
        "logits-float32": relative(logits, expected_logits),
    }


def decode_weights_errors():
    """TOVA, H2O and AhaKV decode on the tiny GQA model (float32) with their new query's weights
    (AhaKV: logits) from the kernel against the torch pass, 12 steps: the kept positions are the
    same and the model's logits agree (their relative difference; ``inf`` when a kept set differs).
    TOVA: a prompt past its budget (the stored slice, evicting at every step); H2O and AhaKV: a
    prompt below the budget in a fixed decode capacity (the filled slots by the device length, the
    empty ones masked; full after 8 steps, then evicting)."""
    import kvhive
    import kvhive.attention.decode as decode
    from kvhive.models import tiny_model

    model = tiny_model("llama", "gqa")
    errors = {}
    cases = (("tova", 40, 24, {}), ("h2o", 16, 24, {"decode_capacity": 12}), ("ahakv", 30, 38, {"decode_capacity": 12}))
    for method, length, budget, options in cases:
        prompt = torch.randint(3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(3))
        runs = []
        for use_kernel in (True, False):
            supported = decode.kernel_supports
            if not use_kernel:
                decode.kernel_supports = lambda *args: False
            try:
                with counting_kernel_calls() as calls:
                    cache = kvhive.make_cache(model, method, budget=budget, **options)
                    logits = []
                    with torch.no_grad():
                        out = model(input_ids=prompt, past_key_values=cache, use_cache=True)
                        for _ in range(12):
                            token = out.logits[:, -1:].argmax(-1)
                            out = model(input_ids=token, past_key_values=cache, use_cache=True)
                            logits.append(out.logits[:, -1])
            finally:
                decode.kernel_supports = supported
            kept = [layer.dense()[2].sort(dim=-1).values for layer in cache.layers]
            runs.append((torch.stack(logits), kept, calls, [layer.fixed_capacity for layer in cache.layers]))
        (with_kernel, kept_kernel, calls, fixed), (reference, kept_reference, _, _) = runs
        # Every decode step of every layer took the kernel with weights, in the fixed capacity.
        assert calls and all(calls) and len(calls) == 12 * len(cache.layers), (method, calls)
        assert all(fixed) == bool(options), (method, fixed)
        same = all(torch.equal(a, b) for a, b in zip(kept_kernel, kept_reference, strict=True))
        errors[f"decode-{method}-float32"] = relative(with_kernel, reference.double()) if same else float("inf")
    return errors


def decode_auto_errors(device: str = "cpu", dtype: torch.dtype = torch.float32):
    """``dense_decode="auto"`` (make_cache's default) on the tiny GQA model, 10 decode steps of the
    full cache and SnapKV (layers that only grow while decoding) fed the same tokens: in a fixed
    decode capacity every step of every layer takes the kernel (without weights), whose logits
    agree with sdpa's (``dense_decode="sdpa"``, which never takes it); without a capacity (a growing
    slice, unmasked) "auto" takes sdpa. ``inf`` when a count is wrong. On the CPU through Triton's
    interpreter (float32); ``tests_gpu`` runs it on CUDA in bf16."""
    import kvhive
    from kvhive.compat import cache_kwarg
    from kvhive.models import tiny_model

    model = tiny_model("llama", "gqa", dtype=dtype).to(device)
    key = cache_kwarg(model)
    generator = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, model.config.vocab_size, (1, 64), generator=generator).to(device)
    # The same decode tokens for every run (a run's own argmax could differ in bf16 and feed it other ones).
    tokens = torch.randint(3, model.config.vocab_size, (10, 1, 1), generator=generator).to(device)
    suffix = str(dtype).removeprefix("torch.")
    errors = {}
    for method, options in (("full", {}), ("snapkv", {"budget": 40})):
        runs = {}
        for dense_decode, capacity in (("auto", 12), ("sdpa", 12), ("auto", None)):
            with counting_kernel_calls() as calls:
                room = {} if capacity is None else {"decode_capacity": capacity}
                cache = kvhive.make_cache(model, method, **options, **room)
                assert cache.dense_decode == "auto" or dense_decode == "sdpa"
                cache.dense_decode = dense_decode
                logits = []
                with torch.no_grad():
                    model(input_ids=prompt, **{key: cache}, use_cache=True)
                    for token in tokens:
                        logits.append(model(input_ids=token, **{key: cache}, use_cache=True).logits[:, -1].float())
            fixed = [layer.fixed_capacity for layer in cache.layers]
            runs[(dense_decode, capacity)] = (torch.stack(logits), calls, fixed)
        kernel, calls, fixed = runs[("auto", 12)]
        reference, sdpa_calls, _ = runs[("sdpa", 12)]
        unmasked, growing_calls, growing_fixed = runs[("auto", None)]
        counts_right = (
            all(fixed)
            and not any(growing_fixed)
            and len(calls) == 10 * len(fixed)
            and not any(calls)
            and not sdpa_calls
            and not growing_calls
        )
        errors[f"decode-auto-{method}-{suffix}"] = (
            relative(kernel, reference.double()) if counts_right else float("inf")
        )
        errors[f"decode-auto-{method}-growing-{suffix}"] = relative(unmasked, reference.double())
    return errors


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
    errors.update(weights_errors(generator))
    errors.update(decode_weights_errors())
    errors.update(decode_auto_errors())
    print(json.dumps(errors))


if __name__ == "__main__":
    main()
