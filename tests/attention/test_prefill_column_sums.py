"""Accumulated attention without a second pass (issue 25 item 1).

H2O, BUZZ and BumbleBee score prompt tokens by the column sums of the prefill's causal softmax
attention. A compressed layer of such a method (``Policy.prefill_column_sums``) computes its
attention output and the column sums in one pass over query chunks
(``ScoringInputs.attention_with_column_sums``) instead of sdpa followed by a second ``QK^T``
pass for the scoring. These tests hold it to the two-pass results (the column sums bit for bit:
the same chunks of the same ``attention_weights``), to sdpa's output, and to one ``QK^T``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kvhive
from kvhive.compat import cache_kwarg
from kvhive.methods import scoring as scoring_module
from kvhive.models import tiny_model

HEAD_DIM = 16  # the tiny models' head dimension (their hidden size is 64)


def random_attention(dtype, batch=2, query_heads=4, heads=2, tokens=37, dim=HEAD_DIM, padding=5, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, query_heads, tokens, dim, generator=generator).to(dtype)
    k = torch.randn(batch, heads, tokens, dim, generator=generator).to(dtype)
    v = torch.randn(batch, heads, tokens, dim, generator=generator).to(dtype)
    mask = None
    if padding:
        mask = torch.ones(tokens, tokens, dtype=torch.bool).tril()[None, None].repeat(batch, 1, 1, 1)
        mask[1, :, :, :padding] = False  # row 1 is left-padded: nothing attends its first tokens
    return q, k, v, mask


def dense_reference(q, k, v, mask, scaling):
    """float64 softmax attention over the whole matrix: (output [B, Hq, q, d], column sums [B, Hq, N])."""
    group = q.shape[1] // k.shape[1]
    keys = k.double().repeat_interleave(group, dim=1)
    values = v.double().repeat_interleave(group, dim=1)
    logits = q.double() @ keys.transpose(-1, -2) * scaling
    n = k.shape[2]
    allowed = torch.ones(n, n, dtype=torch.bool).tril()[None, None] if mask is None else mask
    logits = logits.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a fully masked (padding) row: 0
    return weights @ values, weights.sum(dim=2)


class _ModuleLike:
    num_key_value_groups = 2
    is_causal = True


@pytest.mark.parametrize("padded", [False, True], ids=["causal", "left-padded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_pass_equals_the_two_pass_scoring_and_sdpa(dtype, padded, monkeypatch):
    """GQA (4 query heads over 2), batch 2, chunks of 5 query rows (so several chunks, the last
    one short): the column sums are the two-pass scoring's bit for bit, close to a float64
    reference, and the output is sdpa's.

    Tolerances: float32 differs from sdpa and the reference by summation order only (1e-5);
    bfloat16 forms the logits and the output in bf16 (8 mantissa bits, relative step 2**-8),
    so the output (|o| < 4, a bf16 step of 1.6e-2 at 2..4) is within two such steps of sdpa's
    and a column sum (up to 37 weights, each off by ~1% through its bf16 logit) within 0.1 of
    float64."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from kvhive.attention.column_sums import prompt_attention_with_column_sums
    from kvhive.methods.base import ScoringInputs

    q, k, v, mask = random_attention(dtype, padding=5 if padded else 0)
    batch, query_heads, tokens, _ = q.shape
    monkeypatch.setattr(scoring_module, "_CHUNK_ELEMENTS", 5 * batch * query_heads * tokens)
    scaling = 0.3
    output, sums = prompt_attention_with_column_sums(q, k, v, mask, scaling)  # [B, q, Hq, d], [B, Hq, N]

    positions = torch.arange(tokens).expand(batch, k.shape[1], tokens)
    two_pass = ScoringInputs(k, v, q, positions, mask, scaling, 0, 1, tokens, "prefill").summed_attention(0)
    assert sums.dtype == torch.float32
    assert torch.equal(sums, two_pass)

    expected_output, expected_sums = dense_reference(q, k, v, mask, scaling)
    stock, _ = sdpa_attention_forward(_ModuleLike(), q, k, v, mask, scaling=scaling)
    assert output.dtype == dtype and output.shape == stock.shape
    output_atol, sums_atol = (1e-5, 1e-5) if dtype == torch.float32 else (3.2e-2, 0.1)
    torch.testing.assert_close(output.float(), stock.float(), atol=output_atol, rtol=0)
    torch.testing.assert_close(output.double().transpose(1, 2), expected_output, atol=output_atol, rtol=0)
    torch.testing.assert_close(sums.double(), expected_sums, atol=sums_atol, rtol=0)
    if padded:  # padding keys get nothing, padding queries add nothing and attend nothing
        assert (sums[1, :, :5] == 0).all()
        assert (output[1, :5] == 0).all()


def _prefill(model, method, input_ids, attention_mask, **parameters):
    cache = kvhive.make_cache(model, method, budget=12, **parameters)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, **{cache_kwarg(model): cache}).logits
    return cache, logits


@pytest.mark.parametrize("method", ["h2o", "buzz", "bumblebee", "ada-h2o"])
def test_a_model_keeps_what_the_two_pass_scoring_keeps(method, monkeypatch):
    """A left-padded batch of two through a tiny GQA Llama: logits equal sdpa's (full cache) and
    the kept positions and running scores equal those of the two-pass scoring (the policy made
    to not declare its column sums). fp32: logits within 1e-5 (summation order)."""
    from helpers import left_padded_batch

    model = tiny_model("llama", "gqa")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=40, pad=5)
    if method == "buzz":  # BUZZ refuses rows of different lengths: no padding
        attention_mask = torch.ones_like(attention_mask)
    _, stock = _prefill(model, "full", input_ids, attention_mask)
    fused_cache, fused = _prefill(model, method, input_ids, attention_mask)
    assert type(fused_cache.policy).prefill_column_sums
    monkeypatch.setattr(type(fused_cache.policy), "prefill_column_sums", False)
    two_pass_cache, two_pass = _prefill(model, method, input_ids, attention_mask)
    real = attention_mask.bool()
    torch.testing.assert_close(fused[real], stock[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(fused[real], two_pass[real], atol=1e-5, rtol=0)
    for fused_layer, two_pass_layer in zip(fused_cache.layers, two_pass_cache.layers, strict=True):
        _, _, fused_positions, fused_scores = fused_layer.dense()
        _, _, two_pass_positions, two_pass_scores = two_pass_layer.dense()
        assert torch.equal(fused_positions, two_pass_positions)
        assert fused_scores.keys() == two_pass_scores.keys()
        for name in fused_scores:
            torch.testing.assert_close(fused_scores[name], two_pass_scores[name], atol=1e-5, rtol=0)


class _QueryKeyProducts(TorchDispatchMode):
    """Counts the query rows multiplied with keys: every (batch, head, query row) of a product
    whose inner dimension is the head dimension (the model's projections have inner dimension
    64 or 128, a ``P V`` product the number of keys), and every query row of a fused sdpa kernel.
    Also counts the sdpa kernels."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = 0
        self.sdpa_calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name.startswith("_scaled_dot_product") and not name.endswith("_backward"):
            self.sdpa_calls += 1
            query = args[0]
            self.rows += query.shape[0] * query.shape[1] * query.shape[2]
        elif name in ("bmm", "mm", "baddbmm", "addmm"):
            left, right = (args[1], args[2]) if name.startswith(("baddbmm", "addmm")) else (args[0], args[1])
            if left.shape[-1] == HEAD_DIM and right.shape[-2] == HEAD_DIM:
                self.rows += left.numel() // HEAD_DIM
        return func(*args, **kwargs)


@pytest.mark.parametrize("method", ["h2o", "buzz", "bumblebee"])
def test_the_prefill_multiplies_queries_and_keys_once(method):
    """Prefill of 40 tokens at budget 12 on a 2-layer GQA Llama (4 query heads of dim 16): every
    (query head, query row) of every layer meets the keys once; the two-pass scoring met them twice
    (sdpa, then the scoring's chunks). BumbleBee's own key-similarity products (keys x keys,
    inner dimension 16 too) are left out by counting its rows only up to the attention."""
    model = tiny_model("llama", "gqa")
    assert model.config.head_dim == HEAD_DIM and model.config.hidden_size != HEAD_DIM
    tokens = 40
    input_ids = torch.randint(3, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1))
    cache = kvhive.make_cache(model, method, budget=12)
    counter = _QueryKeyProducts()
    if method == "bumblebee":  # its summary's similarity products are not attention
        policy_class = type(cache.policy)
        original = policy_class.select_prefill

        def select_prefill(self, *args, **kwargs):
            with torch.utils._python_dispatch._disable_current_modes():
                return original(self, *args, **kwargs)

        policy_class.select_prefill = select_prefill
    try:
        with torch.no_grad(), counter:
            model(input_ids=input_ids, **{cache_kwarg(model): cache})
    finally:
        if method == "bumblebee":
            policy_class.select_prefill = original
    layers = model.config.num_hidden_layers
    assert all(cache.is_compressed(index) for index in range(layers))
    assert counter.rows == layers * model.config.num_attention_heads * tokens
    assert counter.sdpa_calls == 0


@pytest.mark.filterwarnings("ignore:method 'full' keeps every token")
def test_other_methods_keep_sdpa():
    """SnapKV (observation-window scores) and the full cache run the model's sdpa at prefill."""
    model = tiny_model("llama", "gqa")
    input_ids = torch.randint(3, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    for method in ("full", "snapkv"):
        cache = kvhive.make_cache(model, method, budget=34)  # SnapKV's least: its window, 32
        counter = _QueryKeyProducts()
        with torch.no_grad(), counter:
            model(input_ids=input_ids, **{cache_kwarg(model): cache})
        assert counter.sdpa_calls == model.config.num_hidden_layers, method


def _chunked_prefill(model, method, input_ids, chunk, counter=None, **parameters):
    cache = kvhive.make_cache(model, method, budget=12, prefill_chunk=chunk, **parameters)
    cache.plan_prompt(input_ids.shape[1])
    with torch.no_grad(), counter if counter is not None else contextlib.nullcontext():
        for start in range(0, input_ids.shape[1], chunk):
            model(input_ids=input_ids[:, start : start + chunk], **{cache_kwarg(model): cache})
    return cache


@pytest.mark.parametrize("method", ["h2o", "buzz", "bumblebee"])
def test_a_chunked_prefill_multiplies_queries_and_keys_once(method, monkeypatch):
    """60 tokens in chunks of 20 at budget 12 (so every later chunk attends 12 kept + 20 new keys):
    H2O's later chunks get their output and the column sums it adds to its scores from one pass
    (``Policy.chunk_column_sums``), so every (query head, query row) meets the keys once, as in a
    one-shot prefill; sdpa and a second pass over the chunk's queries met them twice. BUZZ and
    BumbleBee read only the newest query's weights of a later chunk (as a decode step does): sdpa,
    plus that one row per query head. BumbleBee's key-similarity products are left out."""
    model = tiny_model("llama", "gqa")
    tokens, chunk = 60, 20
    input_ids = torch.randint(3, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1))
    if method == "bumblebee":  # its summary's similarity products are not attention
        policy_class = type(kvhive.make_policy(method))
        for name in ("select_prefill", "select_decode"):
            original = getattr(policy_class, name)

            def outside_the_count(self, *args, _original=original, **kwargs):
                with torch.utils._python_dispatch._disable_current_modes():
                    return _original(self, *args, **kwargs)

            monkeypatch.setattr(policy_class, name, outside_the_count)
    counter = _QueryKeyProducts()
    cache = _chunked_prefill(model, method, input_ids, chunk, counter)
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    assert all(cache.is_compressed(index) for index in range(layers))
    later_chunks = tokens // chunk - 1
    if method == "h2o":
        assert counter.rows == layers * heads * tokens
        assert counter.sdpa_calls == 0
    else:
        assert counter.rows == layers * heads * (tokens + later_chunks)
        assert counter.sdpa_calls == layers * later_chunks


def test_a_chunked_prefill_keeps_what_the_two_pass_scoring_keeps(monkeypatch):
    """H2O over a prompt in chunks (a tiny GQA Llama, 130 tokens in chunks of 32): the same kept
    positions as sdpa followed by the scoring's own pass over each chunk (the policy made to not
    declare its chunk sums); layer 0's running scores bit for bit (the same chunks of the same
    ``attention_weights``), later layers' within 1e-5 (their inputs went through the pass's
    ``P V`` instead of sdpa: summation order)."""
    model = tiny_model("llama", "gqa")
    input_ids = torch.randint(3, model.config.vocab_size, (2, 130), generator=torch.Generator().manual_seed(1))
    fused = _chunked_prefill(model, "h2o", input_ids, 32)
    monkeypatch.setattr(type(fused.policy), "chunk_column_sums", False)
    two_pass = _chunked_prefill(model, "h2o", input_ids, 32)
    for index, (fused_layer, two_pass_layer) in enumerate(zip(fused.layers, two_pass.layers, strict=True)):
        _, _, fused_positions, fused_scores = fused_layer.dense()
        _, _, two_pass_positions, two_pass_scores = two_pass_layer.dense()
        assert torch.equal(fused_positions, two_pass_positions)
        for name in two_pass_scores:
            if index == 0:
                assert torch.equal(fused_scores[name], two_pass_scores[name])
            torch.testing.assert_close(fused_scores[name], two_pass_scores[name], atol=1e-5, rtol=0)


@pytest.mark.parametrize("model_name", ["llama", "gemma3"])
def test_transformers_mask_of_a_left_padded_batch_is_recognised_and_no_other(model_name, monkeypatch):
    """On CUDA a left-padded batch takes flash attention row by row over each row's real tokens
    (``column_sums.flash_attention_with_column_sums_by_row``; tests/attention/column_sums_check.py checks it
    against the torch path in Triton's interpreter). What it rests on, checked here on the masks the
    installed transformers builds: ``left_padding`` gives each row's padding for a left-padded
    prompt and refuses every other mask (a window in reach, a padding query that attends something,
    a hole, a future key), where the torch path stays."""
    from kvhive.attention import column_sums as column_sums_module
    from kvhive.attention.column_sums import left_padding

    from helpers import left_padded_batch

    model = tiny_model(model_name)
    masks = []
    one_pass = column_sums_module.prompt_attention_with_column_sums

    def record(query, key, value, mask, scaling):
        masks.append(mask)
        return one_pass(query, key, value, mask, scaling)

    monkeypatch.setattr(column_sums_module, "prompt_attention_with_column_sums", record)
    tokens, pad = 24, 5
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=tokens, pad=pad)
    cache = kvhive.make_cache(model, "h2o", budget=8)
    with torch.no_grad():
        model(input_ids=input_ids, attention_mask=attention_mask, **{cache_kwarg(model): cache}, use_cache=True)
    position = torch.arange(tokens)
    real = position[None, :] >= torch.tensor([0, pad])[:, None]
    left_padded = ((position[None, :] <= position[:, None])[None] & real[:, None, :] & real[:, :, None])[:, None]
    # Each layer that takes the pass gets the plain mask of a left-padded prompt.
    assert masks and all(mask.equal(left_padded) for mask in masks)
    assert all(left_padding(mask) == [0, pad] for mask in masks)
    mask = masks[0]
    windowed = mask & (position[:, None] - position[None, :] < 8)  # a sliding window in reach
    attends = mask.clone()
    attends[1, 0, 2, 0] = True  # a padding query that attends a padding key
    hole = mask.clone()
    hole[0, 0, 20, 3] = False  # a real query that skips one real key
    future = mask.clone()
    future[0, 0, 10, 11] = True  # a real query that sees the next token
    for other in (windowed, attends, hole, future, mask.float(), mask[:, :, 1:]):
        assert left_padding(other) is None
    # The check compares a few query rows at a time on a long prompt: the same answers in pieces
    # (fresh copies: an answer is kept per mask tensor).
    monkeypatch.setattr(column_sums_module, "_MASK_CHECK_ELEMENTS", 3 * 2 * tokens)
    assert left_padding(mask.clone()) == [0, pad]
    assert all(left_padding(other.clone()) is None for other in (windowed, attends, hole, future))


def test_left_padding_checks_a_mask_once_until_it_changes_and_forgets_it_when_it_goes(monkeypatch):
    """Every layer of a forward gets the same mask tensor: its check (and host read) runs once; a mask
    changed in place is checked again; a freed mask leaves no entry behind."""
    from kvhive.attention import column_sums as column_sums_module
    from kvhive.attention.column_sums import left_padding

    checks = []
    check = column_sums_module._check_left_padding
    monkeypatch.setattr(column_sums_module, "_check_left_padding", lambda mask: checks.append(1) or check(mask))
    position = torch.arange(10)
    real = position[None, :] >= torch.tensor([0, 3])[:, None]
    mask = ((position[None, :] <= position[:, None])[None] & real[:, None, :])[:, None]
    held = len(column_sums_module._LEFT_PADDING)
    assert [left_padding(mask) for _ in range(4)] == [[0, 3]] * 4 and len(checks) == 1
    mask[0, 0, 5, 2] = False  # in place: a hole
    assert left_padding(mask) is None and left_padding(mask) is None and len(checks) == 2
    assert len(column_sums_module._LEFT_PADDING) == held + 1
    del mask
    assert len(column_sums_module._LEFT_PADDING) == held
