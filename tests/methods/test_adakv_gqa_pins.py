"""Two Ada-KV elements pinned by hand-computed cases, independently of the golden file and of the
authors' fixtures (issue 26 item 4): GQA mean-then-pool (the group's window weights averaged
before pooling, the authors' ``gqa_support``) and ``head_granularity="auto"`` (one stored copy
per query head on a model with one KV head, per KV head otherwise)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import kvhive
from kvhive.methods.registry import make_policy
from kvhive.models import tiny_model

from helpers import scoring_inputs

WINDOW, KERNEL = 2, 3


def _window_weights(queries, keys):
    """``[Hq, N]``: softmax weights of the last WINDOW queries summed over those rows, by hand."""
    n, d = keys.shape[2], keys.shape[3]
    group = queries.shape[1] // keys.shape[1]
    expanded = keys.repeat_interleave(group, dim=1)[0]  # [Hq, N, d]
    logits = queries[0] @ expanded.transpose(-1, -2) / d**0.5  # [Hq, w, N]
    rows = torch.arange(n - WINDOW, n)[:, None]
    logits = logits.masked_fill(torch.arange(n)[None, :] > rows, float("-inf"))
    return logits.softmax(dim=-1).sum(dim=1)


def _max_pool_prefix(weights):
    prefix = F.max_pool1d(weights[:, None, :-WINDOW], KERNEL, stride=1, padding=KERNEL // 2)[:, 0]
    return torch.cat([prefix, weights[:, -WINDOW:]], dim=-1)


def _peaked_case():
    """One KV head shared by two query heads: query head 0 attends to token 2, head 1 to token 4
    (10 tokens, window 2), so pooling before or after the group mean differs at token 3."""
    torch.manual_seed(0)
    d, n = 8, 10
    keys = torch.randn(1, 1, n, d) * 0.1
    keys[0, 0, 2, 0] = 6.0
    keys[0, 0, 4, 1] = 6.0
    queries = torch.zeros(1, 2, WINDOW, d)
    queries[0, 0, :, 0] = 3.0
    queries[0, 1, :, 1] = 3.0
    return queries, keys


def test_ada_snapkv_averages_the_group_before_pooling():
    queries, keys = _peaked_case()
    scoring = scoring_inputs(queries, keys, torch.zeros_like(keys))
    weights = _window_weights(queries, keys)  # [2 query heads, N]
    mean_then_pool = _max_pool_prefix(weights.mean(dim=0, keepdim=True))
    pool_then_mean = _max_pool_prefix(weights).mean(dim=0, keepdim=True)
    assert not torch.allclose(mean_then_pool, pool_then_mean, atol=1e-3)  # the case tells them apart
    ada = make_policy("ada-snapkv", window=WINDOW, kernel=KERNEL)
    # the scores its allocation ranks (AdaKV.select_prefill calls its scorer)
    torch.testing.assert_close(ada.scorer.score(scoring, 6, {})[0], mean_then_pool, atol=1e-6, rtol=1e-5)
    # SnapKV itself keeps kvpress's order (pool each query head, then average)
    snapkv = make_policy("snapkv", window=WINDOW, kernel=KERNEL)
    torch.testing.assert_close(snapkv.score(scoring, 6, {})[0], pool_then_mean, atol=1e-6, rtol=1e-5)


def _stored_heads(model, method, **parameters):
    cache = kvhive.make_cache(model, method, 8, **parameters)
    with torch.no_grad():
        model(input_ids=torch.arange(40, 80)[None], past_key_values=cache, use_cache=True)
    return {tuple(lengths.shape) for lengths in cache.kept_tokens().values()}, cache


def test_head_granularity_auto_stores_one_copy_per_query_head_only_with_one_kv_head():
    one_kv_head = tiny_model("llama", "gqa", num_key_value_heads=1)  # 4 query heads, 1 KV head
    heads, cache = _stored_heads(one_kv_head, "ada-snapkv", window=4)
    assert heads == {(1, 4)}  # per query head
    assert all(int(lengths.sum()) == 4 * 8 for lengths in cache.kept_tokens().values())  # b in each of 4 heads
    assert _stored_heads(one_kv_head, "snapkv", window=4)[0] == {(1, 1)}
    assert _stored_heads(one_kv_head, "ada-snapkv", window=4, head_granularity="kv")[0] == {(1, 1)}
    two_kv_heads = tiny_model("llama", "gqa")  # 4 query heads, 2 KV heads
    assert _stored_heads(two_kv_heads, "ada-snapkv", window=4)[0] == {(1, 2)}  # auto: per KV head
    assert _stored_heads(two_kv_heads, "ada-snapkv", window=4, head_granularity="query")[0] == {(1, 4)}
