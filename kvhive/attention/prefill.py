"""A layer's prefill: the prompt's attention (sdpa, or one pass that also gives the column sums a
method scores with), then the cache cuts the layer right away; and a recorded prefill replayed
into another cache."""

from __future__ import annotations

from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvhive.attention import column_sums
from kvhive.attention.masks import record_padding, row_logit_scale
from kvhive.attention.scoring import prefill_scoring, question_scoring


def prefill(module, cache, layer_index, query, key, value, mask, scaling, dropout, compressed, kwargs):
    """The prompt's attention over layer ``layer_index`` (its keys and values just stored), then the
    cache's decision for the layer (``KVHiveCache.after_prefill``). Returns transformers' pair."""
    policy = cache.policy
    attended_queries = query
    if policy.changes_attention_logits:  # every layer (BUZZ log n), compressed or not
        attended_queries = row_logit_scale(policy, mask, key.shape[2], query)
    accumulated = None
    if (
        compressed
        and policy.prefill_column_sums
        and fusable(module, attended_queries, key, value, mask, dropout, kwargs)
    ):
        # The policy scores by the prompt's column sums: one pass computes them with the output.
        output, accumulated = column_sums.prompt_attention_with_column_sums(attended_queries, key, value, mask, scaling)
    else:
        # No mask (no padding, no window in reach): transformers' sdpa runs its causal kernels.
        output, _ = sdpa_attention_forward(
            module, attended_queries, key, value, mask, dropout=dropout, scaling=scaling, **kwargs
        )

    record_padding(cache.layers[layer_index], mask)
    if cache.record_prefill:
        cache.prefill_records[layer_index] = (attended_queries, mask, scaling)
    # Policies score with the queries the model attended with (as in decode).
    make_scoring = prefill_scoring(cache, layer_index, attended_queries, mask, scaling, accumulated)
    cache.after_prefill(
        layer_index, question_scoring(cache, layer_index, attended_queries, mask, scaling, make_scoring)
    )
    return output, None


def fusable(module, query, key, value, mask, dropout, kwargs) -> bool:
    """Whether the prefill attention may be computed by kvhive's pass with column sums: plain
    causal softmax attention (what sdpa_attention_forward computes for these arguments) with the
    queries the newest of the keys, no dropout, nothing that changes the logits."""
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    num_queries, num_keys = query.shape[2], key.shape[2]
    return (
        bool(is_causal)
        and num_queries > 1
        # Without a mask sdpa's causal kernels align the queries with the first keys: only a
        # prompt over exactly its own keys reads the same both ways.
        and (mask is not None or num_keys == num_queries)
        and (mask is None or (mask.dim() == 4 and mask.shape[-2:] == (num_queries, num_keys)))
        and query.shape[1] % key.shape[1] == 0
        and key.shape[1] == value.shape[1]
        and column_sums.plain_softmax_attention(dropout, kwargs)
    )


def replay_prefill(recorded, target) -> None:
    """Fill ``target`` as if it had run the prefill that ``recorded`` ran.

    Prefill-phase compression does not change the prefill forward pass (a layer is cut after its
    own attention ran), so one recorded prefill (keys, values, queries, masks of every layer)
    serves every method and budget whose decision is made from the prefill. Methods that change
    the attention itself (``logit_scale``) cannot share a prefill.
    """
    if not recorded.record_prefill:
        raise ValueError("the source cache did not record its prefill (make it with record_prefill=True)")
    for layer_index, source in enumerate(recorded.layers):
        keys, values, _, _ = source.dense()
        if source.tokens_seen != keys.shape[2]:
            raise ValueError(
                "the recording cache evicted tokens; record with the 'full' method and compress_sliding=True"
            )
        target.layers[layer_index].update(keys, values)
        query, mask, scaling = recorded.prefill_records[layer_index]
        target.after_prefill(layer_index, prefill_scoring(target, layer_index, query, mask, scaling))
