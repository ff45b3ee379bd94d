"""A decode step that compiles to one graph (issue 23): the CPU proxy of a CUDA-graph-capturable step.

``torch.compile(fullgraph=True, dynamic=False)`` with the ``aot_eager`` backend (which also checks
in-place buffer mutation) over one decode step, run through evictions with
``error_on_recompile``: no graph break, no recompilation, and logits equal to the eager step.
Every method that declares ``static_decode`` is held to it; ``model.generate`` with such a cache
takes transformers' compiled path end to end (on CPU that needs ``_compile_all_devices``).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import CompileConfig

import kvhive
from kvhive.api import compiling_attention
from kvhive.methods.base import Policy
from kvhive.methods.registry import method_names, policy_class
from kvhive.models.tiny import tiny_model, tiny_tokenizer

BUDGET = 32
STATIC_METHODS = [m for m in method_names() if policy_class(m).static_decode]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield
    torch._dynamo.reset()


def _model():
    torch.manual_seed(0)
    return tiny_model("llama", "gqa")


def _compiled(model, step, backend="aot_eager"):
    """``step`` through one's own ``torch.compile``, each call with the model's attention switched
    before it where the torch needs that (below 2.13: ``kvhive.compression``, kvhive.static_step; on
    the torch CI installs nothing changes), so this file runs on the GPU images' torch 2.11 too."""
    compiled = torch.compile(step, fullgraph=True, dynamic=False, backend=backend)

    def call(*args):
        with compiling_attention(model, True):
            return compiled(*args)

    return call


def _prompt(model, batch=1, length=96):
    return torch.randint(3, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(0))


def test_the_static_methods_are_the_decode_evicting_scorers():
    # Guards the list below against silently shrinking: these evict to the budget every step.
    assert {"tova", "h2o", "streamingllm", "local"} <= set(STATIC_METHODS)


@pytest.mark.parametrize("method", STATIC_METHODS)
def test_one_compiled_decode_step_serves_40_evicting_steps(method):
    model = _model()

    def step(token, position, cache):
        return model(input_ids=token, position_ids=position, past_key_values=cache, use_cache=True).logits

    compiled = _compiled(model, step, backend="aot_eager")
    prompt = _prompt(model)
    budget = max(BUDGET, policy_class(method)().minimum_budget())  # subgen needs recent + 1 = 33
    compiled_cache = kvhive.make_cache(model, method, budget=budget)
    eager_cache = kvhive.make_cache(model, method, budget=budget)
    assert compiled_cache.is_compileable
    with torch.no_grad():
        token = model(input_ids=prompt, past_key_values=compiled_cache).logits[:, -1:].argmax(-1)
        model(input_ids=prompt, past_key_values=eager_cache)
        position = torch.full((1, 1), prompt.shape[1])
        for index in range(40):
            compiled_logits = compiled(token, position, compiled_cache)
            eager_logits = step(token, position, eager_cache)
            torch.testing.assert_close(compiled_logits, eager_logits, atol=1e-5, rtol=1e-5, msg=f"step {index}")
            token, position = compiled_logits[:, -1:].argmax(-1), position + 1
    assert counters["stats"]["unique_graphs"] == 1
    assert compiled_cache.get_seq_length() == prompt.shape[1] + 40
    # What the eager cache holds: the layer's budget (subgen-attention's cache holds its exact window,
    # the structures the rest), or for a method whose kept size varies (BUZZ) the size its schedule
    # reached, within the fixed capacity it declared.
    lengths = [layer.dense_length for layer in compiled_cache.layers]
    assert lengths == [layer.dense_length for layer in eager_cache.layers]
    if type(compiled_cache.policy).fixed_decode_capacity is Policy.fixed_decode_capacity:
        assert lengths == [compiled_cache.layer_budgets[i] for i in range(len(lengths))]
    else:
        assert all(
            length < layer.buffers()[0].shape[2] for length, layer in zip(lengths, compiled_cache.layers, strict=True)
        )
    assert all(compiled_cache.layer_budgets[i] <= budget for i in range(len(compiled_cache.layers)))


@pytest.mark.parametrize("method", ["h2o", "tova", "ada-snapkv"])
def test_generate_takes_the_compiled_path_on_a_padded_batch(method):
    # ada-snapkv: head-wise budgets (packed rows and heads of different counts), with a decode capacity.
    options = {"budget": BUDGET, "window": 4} if method == "ada-snapkv" else {"budget": BUDGET}
    capacity = {"decode_capacity": 25} if method == "ada-snapkv" else {}
    model = _model()
    prompt = _prompt(model, batch=2, length=60)
    attention_mask = torch.ones_like(prompt)
    attention_mask[1, :13] = 0  # left padding: the step masks it from the flags recorded at prefill
    config = CompileConfig(fullgraph=True, dynamic=False, backend="aot_eager")
    config._compile_all_devices = True  # transformers compiles only on accelerators otherwise
    compiled_cache = kvhive.make_cache(model, method, **options, **capacity)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # aot_eager ignores the default mode="reduce-overhead"
        compiled = model.generate(
            prompt,
            attention_mask=attention_mask,
            past_key_values=compiled_cache,
            max_new_tokens=24,
            do_sample=False,
            compile_config=config,
        )
    assert counters["stats"]["unique_graphs"] == 1, "generate did not compile its decode step once"
    if method == "ada-snapkv":
        assert any(not layer.is_uniform for layer in compiled_cache.layers)
    eager = model.generate(
        prompt,
        attention_mask=attention_mask,
        past_key_values=kvhive.make_cache(model, method, **options),
        max_new_tokens=24,
        do_sample=False,
        disable_compile=True,
    )
    assert torch.equal(compiled, eager)
    # Each row decodes as it would alone (the padding is masked, not attended).
    alone = model.generate(
        prompt[1:, 13:],
        past_key_values=kvhive.make_cache(model, method, **options),
        max_new_tokens=24,
        do_sample=False,
        disable_compile=True,
    )
    assert torch.equal(compiled[1:, 13:], alone)


GROWING_METHODS = ["full", "snapkv", "pyramidkv", "knorm"]
# Head-wise budgets (prefill only): each (row, KV head) keeps its own count, so the layer is packed.
ADA_METHODS = ["ada-snapkv", "ada-pyramidkv", "ada-ahakv"]
DECODE_CAPACITY = 48


def _growing_options(method, **extra):
    if method == "full":
        return {**extra}
    options = {"budget": BUDGET, **extra}
    if method in ADA_METHODS:
        # A window below the budget leaves room for the heads' budgets to differ (with a window of
        # the whole budget every head keeps exactly it, and the layer stays dense).
        options["recent" if method == "ada-ahakv" else "window"] = 4
    return options


@pytest.mark.parametrize("method", GROWING_METHODS + ADA_METHODS)
def test_a_growing_cache_compiles_with_a_fixed_decode_capacity(method):
    # The full cache and prefill-only methods add a token per step: with decode_capacity the
    # buffers have room for every step and attention runs over the capacity, empty slots masked.
    # Head-wise budgets (Ada-KV) too: each packed segment gets its room after the prefill and a step
    # appends at the device lengths, attention over every page with the slots past them masked.
    model = _model()

    def step(token, position, cache):
        return model(input_ids=token, position_ids=position, past_key_values=cache, use_cache=True).logits

    compiled = _compiled(model, step, backend="aot_eager")
    prompt = _prompt(model)
    options = _growing_options(method, decode_capacity=DECODE_CAPACITY)
    caches = [kvhive.make_cache(model, method, **options) for _ in range(2)]
    uncompiled_reference = kvhive.make_cache(
        model, method, **{k: v for k, v in options.items() if k != "decode_capacity"}
    )
    assert caches[0].is_compileable and not uncompiled_reference.is_compileable
    with torch.no_grad():
        token = model(input_ids=prompt, past_key_values=caches[0]).logits[:, -1:].argmax(-1)
        model(input_ids=prompt, past_key_values=caches[1])
        model(input_ids=prompt, past_key_values=uncompiled_reference)
        prefill_lengths = [layer.lengths_host for layer in caches[0].layers]
        if method in ADA_METHODS:
            # The head-wise layout is what is compiled here (heads keep different counts).
            assert any(not layer.is_uniform for layer in caches[0].layers)
            assert all(layer.fixed_capacity for layer in caches[0].layers)
        pointers = [(layer.buffers()[0].data_ptr(), layer.buffers()[1].data_ptr()) for layer in caches[0].layers]
        position = torch.full((1, 1), prompt.shape[1])
        for index in range(40):
            compiled_logits = compiled(token, position, caches[0])
            eager_logits = step(token, position, caches[1])
            reference_logits = step(token, position, uncompiled_reference)
            torch.testing.assert_close(compiled_logits, eager_logits, atol=1e-5, rtol=1e-5, msg=f"step {index}")
            torch.testing.assert_close(compiled_logits, reference_logits, atol=1e-5, rtol=1e-5, msg=f"step {index}")
            token, position = compiled_logits[:, -1:].argmax(-1), position + 1
    assert counters["stats"]["unique_graphs"] == 1
    assert [(layer.buffers()[0].data_ptr(), layer.buffers()[1].data_ptr()) for layer in caches[0].layers] == pointers
    # The host lengths, stale inside compiled steps, are right when read afterwards.
    assert caches[0].get_seq_length() == prompt.shape[1] + 40
    for layer, before in zip(caches[0].layers, prefill_lengths, strict=True):
        assert torch.equal(layer.lengths_host, before + 40)
        assert layer.max_length == int(before.max()) + 40
        assert layer.num_stored == int(before.sum()) + 40 * before.numel()
    assert caches[0].statistics()["kept_tokens_per_layer"] == uncompiled_reference.statistics()["kept_tokens_per_layer"]
    assert caches[0].nbytes() == uncompiled_reference.nbytes()
    # An eager step after the compiled ones continues from the device lengths (read back once).
    with torch.no_grad():
        torch.testing.assert_close(
            step(token, position, caches[0]), step(token, position, uncompiled_reference), atol=1e-5, rtol=1e-5
        )
    assert caches[0].statistics()["kept_tokens_per_layer"] == uncompiled_reference.statistics()["kept_tokens_per_layer"]


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_ada_storing_a_copy_per_query_head_compiles_too(kv_heads):
    # head_granularity "query" (the default "auto" on a model with one KV head, as Gemma-3-270M):
    # each query head stores its own copy, and a decode step repeats the new token's KV heads.
    torch.manual_seed(0)
    model = tiny_model("llama", "gqa", num_key_value_heads=kv_heads)

    def step(token, position, cache):
        return model(input_ids=token, position_ids=position, past_key_values=cache, use_cache=True).logits

    compiled = _compiled(model, step, backend="aot_eager")
    prompt = _prompt(model)
    options = _growing_options("ada-snapkv", **({} if kv_heads == 1 else {"head_granularity": "query"}))
    caches = [kvhive.make_cache(model, "ada-snapkv", decode_capacity=24, **options) for _ in range(2)]
    reference = kvhive.make_cache(model, "ada-snapkv", **options)
    assert caches[0].stores_query_heads and caches[0].is_compileable
    with torch.no_grad():
        token = model(input_ids=prompt, past_key_values=caches[0]).logits[:, -1:].argmax(-1)
        model(input_ids=prompt, past_key_values=caches[1])
        model(input_ids=prompt, past_key_values=reference)
        assert all(layer.num_heads == model.config.num_attention_heads for layer in caches[0].layers)
        assert any(not layer.is_uniform for layer in caches[0].layers)
        position = torch.full((1, 1), prompt.shape[1])
        for index in range(20):
            compiled_logits = compiled(token, position, caches[0])
            torch.testing.assert_close(
                compiled_logits, step(token, position, caches[1]), atol=1e-5, rtol=1e-5, msg=f"step {index}"
            )
            torch.testing.assert_close(
                compiled_logits, step(token, position, reference), atol=1e-5, rtol=1e-5, msg=f"step {index}"
            )
            token, position = compiled_logits[:, -1:].argmax(-1), position + 1
    assert counters["stats"]["unique_graphs"] == 1
    assert caches[0].statistics()["kept_tokens_per_layer"] == reference.statistics()["kept_tokens_per_layer"]


@pytest.mark.parametrize("method", ADA_METHODS)
def test_a_packed_layer_reserves_its_decode_capacity_per_segment(method):
    # Storage stays proportional to what each head keeps: every segment gets its kept tokens plus
    # the decode capacity, in whole pages, laid out once at prefill (nothing padded to the longest).
    from kvhive.cache.storage import PAGE_TOKENS

    model = _model()
    capacity = 100  # more than a page beyond the usual 32-token append reserve: the layout must differ
    cache = kvhive.make_cache(model, method, **_growing_options(method, decode_capacity=capacity))
    with torch.no_grad():
        model(input_ids=_prompt(model), past_key_values=cache)
    packed = [layer for layer in cache.layers if not layer.is_uniform]
    assert packed and all(layer.fixed_capacity for layer in packed)
    for layer in packed:
        kept = layer.lengths_host.reshape(-1)
        expected = (kept + capacity + PAGE_TOKENS - 1) // PAGE_TOKENS * PAGE_TOKENS
        assert torch.equal(layer.segment_capacity_host, expected)
        assert layer.capacity == int(expected.sum())
        assert layer.capacity < kept.numel() * int(expected.max()) or bool((expected == expected[0]).all())


@pytest.mark.parametrize("method", ADA_METHODS)
def test_a_packed_layer_decoded_past_its_capacity(method):
    # Eagerly, past the reserved capacity the layer re-lays out with a fresh reserve (as before);
    # a compiled step cannot, and refuses to write past a segment instead of overwriting the next.
    model = _model()
    options = _growing_options(method, decode_capacity=4)
    cache = kvhive.make_cache(model, method, **options)
    reference = kvhive.make_cache(model, method, **_growing_options(method))
    assert cache.is_compileable
    with torch.no_grad():
        token = model(input_ids=_prompt(model), past_key_values=cache).logits[:, -1:].argmax(-1)
        model(input_ids=_prompt(model), past_key_values=reference)
        packed = [layer for layer in cache.layers if not layer.is_uniform]
        room = min(int((layer.segment_capacity_host - layer.lengths_host.reshape(-1)).min()) for layer in packed)
        for _ in range(room + 3):
            logits = model(input_ids=token, past_key_values=cache).logits
            torch.testing.assert_close(
                logits, model(input_ids=token, past_key_values=reference).logits, atol=1e-5, rtol=1e-5
            )
            token = logits[:, -1:].argmax(-1)
    assert cache.statistics()["kept_tokens_per_layer"] == reference.statistics()["kept_tokens_per_layer"]

    def step(token, position, cache):
        return model(input_ids=token, position_ids=position, past_key_values=cache, use_cache=True).logits

    compiled = _compiled(model, step, backend="aot_eager")
    cache = kvhive.make_cache(model, method, **options)
    with torch.no_grad():
        token = model(input_ids=_prompt(model), past_key_values=cache).logits[:, -1:].argmax(-1)
        packed = [layer for layer in cache.layers if not layer.is_uniform]
        room = min(int((layer.segment_capacity_host - layer.lengths_host.reshape(-1)).min()) for layer in packed)
        position = torch.full((1, 1), _prompt(model).shape[1])
        for _ in range(room):
            token, position = compiled(token, position, cache)[:, -1:].argmax(-1), position + 1
        with pytest.raises(RuntimeError, match="decode_capacity"):
            compiled(token, position, cache)


def test_a_reserved_capacity_holds_zeros_in_its_empty_slots():
    # Attention over the capacity gives the empty slots weight 0, and 0 x uninitialised memory can
    # be NaN (the compiled test above failed intermittently that way): they must hold zeros.
    from kvhive.cache.storage import LayerStore

    store = LayerStore(0)
    store.update(torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 4))
    store.update(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4))  # grows the buffer with a reserve
    keys, values = store.buffers()
    assert keys.shape[2] >= 41  # the reserve already covers what is asked below: no new buffer
    for buffer in (keys, values):
        buffer[:, :, 11:].fill_(float("nan"))  # what torch.empty may hand out
    store.reserve_decode(30)
    keys, values = store.buffers()
    assert store.fixed_capacity
    assert torch.equal(keys[:, :, 11:], torch.zeros_like(keys[:, :, 11:]))
    assert torch.equal(values[:, :, 11:], torch.zeros_like(values[:, :, 11:]))


def test_growing_caches_are_not_declared_compileable():
    # Without a decode capacity, a layer that grows by a token per step would be a new graph per
    # step: generate stays eager.
    model = _model()
    assert not kvhive.make_cache(model, "full").is_compileable
    assert not kvhive.make_cache(model, "snapkv", budget=BUDGET).is_compileable
    assert not kvhive.make_cache(model, "ada-snapkv", budget=BUDGET).is_compileable
    # Head-wise budgets (a packed layout) compile with a decode capacity (each segment gets its room)...
    assert kvhive.make_cache(model, "ada-snapkv", budget=BUDGET, decode_capacity=8).is_compileable
    # ... except in compressed sliding-window layers, whose packed heads drop tokens by host lengths.
    gemma = tiny_model("gemma3", "gqa")
    assert kvhive.make_cache(gemma, "ada-snapkv", budget=BUDGET, decode_capacity=8).is_compileable
    assert not kvhive.make_cache(
        gemma, "ada-snapkv", budget=BUDGET, decode_capacity=8, compress_sliding=True
    ).is_compileable
    assert not kvhive.make_cache(model, "h2o", budget=BUDGET, decode_slack=4).is_compileable
    assert not kvhive.make_cache(model, "h2o", budget=BUDGET, positions="cache").is_compileable


def test_generate_with_compile_refuses_a_step_that_cannot_compile():
    model, tokenizer = _model(), tiny_tokenizer()
    # Every method compiles now; a decode_slack (evicting every few steps) does not.
    with pytest.raises(
        ValueError, match=r"compile=True: the decode step of method 'h2o'.*decode_slack.*methods that can"
    ):
        kvhive.generate(model, tokenizer, "a prompt", "h2o", BUDGET, max_new_tokens=2, compile=True, decode_slack=4)
    with pytest.raises(ValueError, match=r"invalid compile='yes'"):
        kvhive.generate(model, tokenizer, "a prompt", "tova", BUDGET, max_new_tokens=2, compile="yes")


def test_bench_compiles_both_decode_steps():
    from kvhive import bench

    result = bench.run_benchmark(
        shape="kv-heavy", method="tova", budget=16, context=64, decode_tokens=3, num_layers=1, compile=True
    )
    assert result["compiled_decode"] is True
    assert result["decode_ms_per_token"] > 0 and result["decode_ms_per_token_full"] > 0
    # The StaticCache baseline counts the tokens it holds, not its preallocated length.
    assert result["cache_fraction"] == pytest.approx(16 / (64 + 4), rel=1e-6)
    with pytest.raises(ValueError, match=r"--compile: the decode step of method 'snapkv' cannot compile"):
        bench.run_benchmark(
            shape="kv-heavy", method="snapkv", budget=32, context=64, decode_tokens=2, num_layers=1, compile=True
        )


@pytest.mark.parametrize("compress_sliding", [False, True])
def test_sliding_window_layers_compile_too(compress_sliding):
    # Gemma 3: sliding layers keep their window in place (drop_oldest moves it to the front), so
    # their decode step has one shape; with compress_sliding the method evicts there too.
    torch.manual_seed(0)
    model = tiny_model("gemma3", "gqa")
    window = model.config.sliding_window
    budget = window - 3 if compress_sliding else BUDGET

    def step(token, position, cache):
        return model(input_ids=token, position_ids=position, past_key_values=cache, use_cache=True).logits

    compiled = _compiled(model, step, backend="aot_eager")
    prompt = _prompt(model)
    caches = [kvhive.make_cache(model, "h2o", budget=budget, compress_sliding=compress_sliding) for _ in range(2)]
    assert caches[0].is_compileable
    with torch.no_grad():
        token = model(input_ids=prompt, past_key_values=caches[0]).logits[:, -1:].argmax(-1)
        model(input_ids=prompt, past_key_values=caches[1])
        position = torch.full((1, 1), prompt.shape[1])
        for index in range(24):
            compiled_logits = compiled(token, position, caches[0])
            torch.testing.assert_close(
                compiled_logits, step(token, position, caches[1]), atol=1e-5, rtol=1e-5, msg=f"step {index}"
            )
            token, position = compiled_logits[:, -1:].argmax(-1), position + 1
    assert counters["stats"]["unique_graphs"] == 1
    for layer in caches[0].layers:
        assert layer.dense_length == (min(budget, window - 1) if layer.is_sliding else budget)


VARYING_METHODS = ["buzz", "buzz-logn", "bumblebee", "bumblebee-power"]


def _kept(cache):
    """Original positions kept in every (row, head) of every layer, sorted (a host read)."""
    return [layer.dense()[2].sort(dim=-1).values.tolist() for layer in cache.layers]


@pytest.mark.parametrize("prompt_length", [96, 10])
@pytest.mark.parametrize("method", VARYING_METHODS)
def test_a_varying_kept_size_compiles_in_a_fixed_capacity_and_keeps_the_eager_positions(method, prompt_length):
    # BUZZ's size follows its schedule (grows to its peak, then an eviction cuts it) and BumbleBee's
    # fills up to its budget (a prompt of 10 tokens fit it, and its summary is built at the first
    # eviction): held in a fixed capacity, one compiled step serves 64 steps through several
    # eviction rounds, keeps at every step exactly the positions the eager step keeps, in the same
    # layout and in the growing layout the eager path used before (the method's fixed capacity
    # turned off), in buffers that never move, and an eager step in the capacity reads nothing back.
    from kvhive.diagnostics import HostReadCounter

    model = _model()

    def step(token, position, cache):
        return model(input_ids=token, position_ids=position, past_key_values=cache, use_cache=True).logits

    compiled = _compiled(model, step, backend="aot_eager")
    prompt = _prompt(model, length=prompt_length)
    budget = max(BUDGET, policy_class(method)().minimum_budget())
    compiled_cache, eager_cache, growing = (kvhive.make_cache(model, method, budget=budget) for _ in range(3))
    assert compiled_cache.is_compileable
    growing.layout_plan.reserve_decode = lambda cache, store: None  # the host path of before: no fixed capacity
    with torch.no_grad():
        token = model(input_ids=prompt, past_key_values=compiled_cache).logits[:, -1:].argmax(-1)
        model(input_ids=prompt, past_key_values=eager_cache)
        model(input_ids=prompt, past_key_values=growing)
        assert all(layer.fixed_capacity for layer in compiled_cache.layers)
        assert not any(layer.fixed_capacity for layer in growing.layers)
        pointers = [(layer.buffers()[0].data_ptr(), layer.buffers()[1].data_ptr()) for layer in compiled_cache.layers]
        position = torch.full((1, 1), prompt.shape[1])
        for index in range(64):
            compiled_logits = compiled(token, position, compiled_cache)
            with HostReadCounter() as reads:
                eager_logits = step(token, position, eager_cache)
            assert reads.total == 0, f"step {index}: {reads}"
            growing_logits = step(token, position, growing)
            torch.testing.assert_close(compiled_logits, eager_logits, atol=1e-5, rtol=1e-5, msg=f"step {index}")
            torch.testing.assert_close(eager_logits, growing_logits, atol=1e-5, rtol=1e-5, msg=f"step {index}")
            kept = _kept(compiled_cache)
            assert kept == _kept(eager_cache) == _kept(growing), f"step {index}"
            token, position = compiled_logits[:, -1:].argmax(-1), position + 1
        # Eager steps after compiled ones continue the same schedule (BUZZ's host mirror of it is
        # read back from the device counters once).
        for index in range(64, 64 + 24):
            logits = [step(token, position, cache)[:, -1:] for cache in (compiled_cache, eager_cache, growing)]
            assert _kept(compiled_cache) == _kept(eager_cache) == _kept(growing), f"step {index}"
            token, position = logits[0].argmax(-1), position + 1
    assert counters["stats"]["unique_graphs"] == 1
    assert [
        (layer.buffers()[0].data_ptr(), layer.buffers()[1].data_ptr()) for layer in compiled_cache.layers
    ] == pointers
    assert compiled_cache.get_seq_length() == prompt.shape[1] + 64 + 24
    assert compiled_cache.statistics()["kept_tokens_per_layer"] == growing.statistics()["kept_tokens_per_layer"]
    if method.startswith("buzz"):
        from kvhive.methods.buzz import EVICTIONS, kept_size_statistics

        # Two decode eviction rounds (besides the prefill's cut of the long prompt), counted on the
        # device, and the sizes held as the host path counts them.
        at_prefill = 1 if prompt_length > budget else 0
        assert all(int(layer.policy_state[EVICTIONS]) - at_prefill >= 2 for layer in compiled_cache.layers)
        assert kept_size_statistics(compiled_cache) == kept_size_statistics(growing)


FILLING_METHODS = [m for m in STATIC_METHODS if m not in VARYING_METHODS and policy_class(m).compiles_below_budget]


def test_the_methods_that_fill_a_capacity_are_the_scorers():
    assert {"tova", "h2o", "streamingllm", "local", "random", "ahakv"} <= set(FILLING_METHODS)


@pytest.mark.parametrize("method", FILLING_METHODS)
def test_a_prompt_shorter_than_the_budget_fills_a_fixed_capacity_in_one_graph(method):
    # A 10-token prompt leaves every layer below its budget: the layer grows token by token up to
    # it, then evicts one token a step. Held in a capacity of its budget plus the new token, one
    # compiled step serves both, keeps at every step the positions the growing layout keeps (its
    # capacity turned off), in buffers that never move, and an eager step reads nothing back.
    from kvhive.diagnostics import HostReadCounter

    model = _model()

    def step(token, position, cache):
        return model(input_ids=token, position_ids=position, past_key_values=cache, use_cache=True).logits

    compiled = _compiled(model, step, backend="aot_eager")
    prompt = _prompt(model, length=10)
    budget = max(BUDGET, policy_class(method)().minimum_budget())
    compiled_cache, eager_cache, growing = (kvhive.make_cache(model, method, budget=budget) for _ in range(3))
    growing.layout_plan.reserve_decode = lambda cache, store: None  # the growing layout of before
    with torch.no_grad():
        token = model(input_ids=prompt, past_key_values=compiled_cache).logits[:, -1:].argmax(-1)
        model(input_ids=prompt, past_key_values=eager_cache)
        model(input_ids=prompt, past_key_values=growing)
        assert compiled_cache.is_compileable
        assert all(layer.fixed_capacity and layer.fills_to_budget for layer in compiled_cache.layers)
        assert not any(layer.fixed_capacity for layer in growing.layers)
        pointers = [(layer.buffers()[0].data_ptr(), layer.buffers()[1].data_ptr()) for layer in compiled_cache.layers]
        position = torch.full((1, 1), prompt.shape[1])
        for index in range(budget + 12):  # past the fill, into the evictions
            compiled_logits = compiled(token, position, compiled_cache)
            with HostReadCounter() as reads:
                eager_logits = step(token, position, eager_cache)
            assert reads.total == 0, f"step {index}: {reads}"
            growing_logits = step(token, position, growing)
            torch.testing.assert_close(compiled_logits, eager_logits, atol=1e-5, rtol=1e-5, msg=f"step {index}")
            torch.testing.assert_close(eager_logits, growing_logits, atol=1e-5, rtol=1e-5, msg=f"step {index}")
            assert _kept(compiled_cache) == _kept(eager_cache) == _kept(growing), f"step {index}"
            token, position = compiled_logits[:, -1:].argmax(-1), position + 1
    assert counters["stats"]["unique_graphs"] == 1
    assert [
        (layer.buffers()[0].data_ptr(), layer.buffers()[1].data_ptr()) for layer in compiled_cache.layers
    ] == pointers
    assert [layer.dense_length for layer in compiled_cache.layers] == [layer.dense_length for layer in growing.layers]


@pytest.mark.parametrize("method", ["tova", "h2o"])
def test_generate_compiles_a_budget_far_above_the_prompt(method):
    # The layer fills a capacity of the prompt plus the decode room kvhive.generate asks for, not of
    # the whole budget: one graph, the text of the eager decode.
    model, tokenizer = _model(), tiny_tokenizer()
    eager_text, _ = kvhive.generate(model, tokenizer, "a prompt", method, 1000, max_new_tokens=12, compile=False)
    text, cache = kvhive.generate(model, tokenizer, "a prompt", method, 1000, max_new_tokens=12, compile=True)
    assert text == eager_text
    assert counters["stats"]["unique_graphs"] == 1
    assert all(layer.buffers()[0].shape[2] < 64 for layer in cache.layers)


def test_generate_with_compile_refuses_a_fixed_capacity_far_above_the_prompt_before_the_prefill():
    model, tokenizer = _model(), tiny_tokenizer()
    with pytest.raises(ValueError, match=r"bumblebee.*budget of 10000 tokens is far above.*at most \d+ tokens"):
        kvhive.generate(model, tokenizer, "a prompt", "bumblebee", 10000, max_new_tokens=4, compile=True)
    text, _ = kvhive.generate(model, tokenizer, "a prompt", "bumblebee", 10000, max_new_tokens=4, compile=False)
    assert isinstance(text, str)


@pytest.mark.parametrize("method", ["subgen", "subgen-attention"])
def test_generate_with_compile_refuses_a_short_prompt_for_a_method_whose_state_starts_at_its_first_eviction(method):
    model, tokenizer = _model(), tiny_tokenizer()
    with pytest.raises(ValueError, match=rf"{method}.*below its budget of \d+ tokens.*first eviction"):
        kvhive.generate(model, tokenizer, "a prompt", method, 64, max_new_tokens=4, compile=True)
    long_prompt = "a prompt " * 12  # above the budget: compiles
    text, _ = kvhive.generate(model, tokenizer, long_prompt, method, 64, max_new_tokens=4, compile=True)
    assert text == kvhive.generate(model, tokenizer, long_prompt, method, 64, max_new_tokens=4, compile=False)[0]


def test_a_torch_that_does_not_trace_the_attention_switch_compiles_with_the_switch_made_before_the_call(monkeypatch):
    # Below torch 2.13 dynamo does not see the switch kvhive's forward pre-hook makes inside a trace
    # (kvhive.static_step): a compiled step must start with the attention already switched. The cache
    # says it compiles (transformers' generate compiles it through the model's get_compiled_call, which
    # kvhive wraps to switch before each compiled call), and model.generate compiles its decode step
    # once, equal to eager, with the model's own attention back after it. A step compiled by one's own
    # torch.compile outside kvhive.compression(model) is refused by name; kvhive's own compiled paths
    # (generate, generate_batch, the benchmarks) enter the block and compile. (Checked on torch 2.11
    # itself outside CI, which installs 2.13 and newer: every method's compiled step through
    # model.generate equal to eager in one graph.)
    from kvhive import static_step

    monkeypatch.setattr(static_step, "TORCH_COMPILES_KVHIVE", False)
    model, tokenizer = _model(), tiny_tokenizer()
    cache = kvhive.make_cache(model, "tova", budget=BUDGET)
    assert cache.static_decode and cache.is_compileable
    assert "kvhive.compression(model)" in cache.compile_problem(96)
    with kvhive.compression(model):
        assert cache.is_compileable and cache.compile_problem(96) is None
    assert model.config._attn_implementation != "kvhive"

    def step(token, position, cache):
        return model(input_ids=token, position_ids=position, past_key_values=cache, use_cache=True).logits

    prompt = _prompt(model)
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=cache)
        position = torch.full((1, 1), prompt.shape[1])
        compiled = torch.compile(step, fullgraph=True, dynamic=False, backend="aot_eager")
        with pytest.raises(Exception, match=r"only with kvhive's attention switched before the compiled call"):
            compiled(prompt[:, -1:], position, cache)

    text = "a prompt " * 20
    compiled_text, _ = kvhive.generate(model, tokenizer, text, "tova", BUDGET, max_new_tokens=6, compile=True)
    assert compiled_text == kvhive.generate(model, tokenizer, text, "tova", BUDGET, max_new_tokens=6, compile=False)[0]
    assert counters["stats"]["unique_graphs"] >= 1  # transformers compiled the decode step
    batch = kvhive.generate_batch(
        model, tokenizer, [text, "another prompt " * 15], "tova", BUDGET, 5, compile="aot_eager"
    )
    assert batch == kvhive.generate_batch(model, tokenizer, [text, "another prompt " * 15], "tova", BUDGET, 5)
    assert model.config._attn_implementation != "kvhive"  # each block restored the model's own
    from kvhive import bench

    result = bench.run_benchmark(
        shape="kv-heavy", method="tova", budget=16, context=64, decode_tokens=3, num_layers=1, compile=True
    )
    assert result["compiled_decode"] is True and result["decode_ms_per_token"] > 0

    # transformers' own compiled path, outside any kvhive block.
    torch._dynamo.reset()
    counters.clear()
    config = CompileConfig(fullgraph=True, dynamic=False, backend="aot_eager")
    config._compile_all_devices = True  # transformers compiles only on accelerators otherwise
    prompt = _prompt(model, length=60)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # aot_eager ignores the default mode="reduce-overhead"
        compiled_ids = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            past_key_values=kvhive.make_cache(model, "tova", budget=BUDGET),
            max_new_tokens=24,
            do_sample=False,
            compile_config=config,
        )
    assert counters["stats"]["unique_graphs"] == 1, "generate did not compile its decode step once"
    assert model.config._attn_implementation != "kvhive"  # the switch ended with each compiled call
    eager_ids = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        past_key_values=kvhive.make_cache(model, "tova", budget=BUDGET),
        max_new_tokens=24,
        do_sample=False,
        disable_compile=True,
    )
    assert torch.equal(compiled_ids, eager_ids)


def test_first_false_is_right_under_inductor():
    # Inductor's CPU code (torch 2.13) answers 0 for an argmin over 8-bit integers once a row is long
    # enough to vectorise, the old way the compaction found the freed slot (mask.to(int8).argmin):
    # first_false is a min over slot indices, right under every backend, and the last slot (a no-op
    # move) where nothing is False.
    from kvhive.cache.storage import first_false

    torch.manual_seed(0)
    masks = torch.rand(12, 40) < 0.8
    masks[0] = True  # nothing False: the last slot
    masks[1, :33] = True  # the first False late in the row
    masks[1, 33:] = False
    expected = torch.where(masks.all(dim=-1), 39, (~masks).to(torch.int64).argmax(dim=-1))
    compiled = torch.compile(first_false, fullgraph=True, dynamic=False, backend="inductor")
    assert torch.equal(first_false(masks), expected)
    assert torch.equal(first_false(masks, keepdim=True), expected[:, None])
    assert torch.equal(compiled(masks), expected)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_bumblebee_fills_the_freed_slot_the_same_compiled_from_a_short_prompt(backend):
    # A 9-token prompt fits BumbleBee's budget of 32: the layer fills its capacity, its first
    # eviction (step 23) builds the summary inside the graph, and from then on each eviction writes
    # the newest token into the freed slot (the stored order is no longer the positions' order). The
    # compiled step keeps, at each of 64 steps, the same positions in the same slots as the eager
    # one, and the same logits. Under inductor the freed slot was once found by an int8 argmin that
    # the CPU code gets wrong: the newest token went into slot 0 at the first step.
    model = _model()

    def step(token, position, cache):
        return model(input_ids=token, position_ids=position, past_key_values=cache, use_cache=True).logits

    compiled = _compiled(model, step, backend=backend)
    prompt = _prompt(model, length=9)
    compiled_cache, eager_cache = (kvhive.make_cache(model, "bumblebee", budget=BUDGET) for _ in range(2))
    with torch.no_grad():
        token = model(input_ids=prompt, past_key_values=compiled_cache).logits[:, -1:].argmax(-1)
        model(input_ids=prompt, past_key_values=eager_cache)
        assert compiled_cache.is_compileable
        position = torch.full((1, 1), prompt.shape[1])
        for index in range(64):
            compiled_logits = compiled(token, position, compiled_cache)
            eager_logits = step(token, position, eager_cache)
            slots = [layer.dense()[2].tolist() for layer in compiled_cache.layers]
            assert slots == [layer.dense()[2].tolist() for layer in eager_cache.layers], f"step {index}"
            if backend == "aot_eager":
                assert torch.equal(compiled_logits, eager_logits), f"step {index}"
            else:  # inductor fuses the float arithmetic (its own rounding)
                torch.testing.assert_close(compiled_logits, eager_logits, atol=1e-5, rtol=1e-5, msg=f"step {index}")
            token, position = eager_logits[:, -1:].argmax(-1), position + 1
    assert counters["stats"]["unique_graphs"] == 1
    for layer in compiled_cache.layers:
        positions = layer.dense()[2]
        assert layer.dense_length == BUDGET
        assert not torch.equal(positions, positions.sort(dim=-1).values)  # freed slots took the newest


@pytest.mark.parametrize("padded", [False, True])
def test_an_eager_static_decode_step_builds_no_mask(monkeypatch, padded):
    # A compileable cache asks transformers for a fixed one-column mask in a decode step
    # (get_mask_sizes); kvhive's attention masks the stored tokens itself, so the column is not built
    # eagerly either (ten ops a step). Logits still equal the step with the column built and handed
    # over, padded rows included.
    import transformers.masking_utils

    from kvhive.attention import hooks, integration

    model = _model()
    prompt = _prompt(model, batch=2)
    attention_mask = torch.ones_like(prompt)
    if padded:
        attention_mask[1, :5] = 0
    built = []

    def counting_mask(*args, **kwargs):
        mask = transformers.masking_utils.sdpa_mask(*args, **kwargs)
        if kwargs.get("q_length") == 1:
            built.append(mask)
        return mask

    logits = {}
    for skip in (True, False):
        if not skip:  # the previous behaviour: every call reaches transformers' sdpa_mask
            monkeypatch.setattr(hooks, "kvhive_mask", lambda *a, **k: counting_mask(*a, **k))
            integration.register()
        monkeypatch.setattr(hooks, "sdpa_mask", counting_mask)
        cache = kvhive.make_cache(model, "tova", budget=BUDGET)
        assert cache.is_compileable
        built.clear()
        with torch.no_grad():
            mask = attention_mask
            token = model(input_ids=prompt, attention_mask=mask, past_key_values=cache).logits[:, -1:].argmax(-1)
            steps = []
            for _ in range(3):
                mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
                position = (mask.cumsum(-1) - 1)[:, -1:]
                step = model(input_ids=token, attention_mask=mask, position_ids=position, past_key_values=cache).logits
                steps.append(step)
                token = step[:, -1:].argmax(-1)
        logits[skip] = torch.cat(steps, dim=1)
        if skip:
            assert built == [], "an eager static decode step built a mask"
        else:
            assert len(built) == 3 and all(mask is not None for mask in built)
    monkeypatch.undo()
    integration.register()
    torch.testing.assert_close(logits[True], logits[False], atol=0, rtol=0)
