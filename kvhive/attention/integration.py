"""The one place that touches transformers' attention and mask interfaces.

``kvhive`` is registered as an attention implementation (``AttentionInterface``) together with
its mask function (``AttentionMaskInterface``; without it transformers would silently drop the
sliding-window pattern). The attention function:

* runs the model's attention over what the layer stores (dense sdpa when every head holds the
  same number of tokens, a vectorised variable-length path otherwise),
* hands the policy what it needs (observation-window / accumulated / last-query attention,
  keys, values, queries after RoPE) through :class:`~kvhive.methods.base.ScoringInputs`,
* lets a method change the attention itself (logit scaling, an estimated extra term),
* and calls the cache right after each layer's attention, so a layer is cut as soon as its own
  prefill is done.
"""

from __future__ import annotations

import warnings

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvhive.cache.kv_cache import KVHiveCache, active_update
from kvhive.methods.base import DECODE, ScoringInputs

ATTENTION_NAME = "kvhive"

# The variable-length path relies on CSR sampled products; torch flags the API as beta.
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")


def kvhive_mask(*args, **kwargs):
    """transformers' sdpa mask, always materialised: kept tokens are gathered from it by position."""
    kwargs["allow_is_causal_skip"] = False
    kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(*args, **kwargs)


def register() -> None:
    """Make ``attn_implementation="kvhive"`` available (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, kvhive_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, kvhive_mask)


def _full_mask(attention_mask, batch_size, num_queries, tokens_seen, sliding_window, device):
    """``[B, 1, q, N]`` boolean mask over every original position."""
    if attention_mask is not None:
        if attention_mask.dtype != torch.bool:
            attention_mask = attention_mask == 0
        return attention_mask
    key_positions = torch.arange(tokens_seen, device=device)
    query_positions = key_positions[tokens_seen - num_queries:]
    allowed = key_positions[None, :] <= query_positions[:, None]
    if sliding_window is not None:
        allowed &= (query_positions[:, None] - key_positions[None, :]) < sliding_window
    return allowed[None, None].expand(batch_size, 1, num_queries, tokens_seen)


def _gather_mask(mask: torch.Tensor, positions: torch.Tensor, tokens_seen: int) -> torch.Tensor:
    """Columns of the model's mask at the stored tokens' positions: ``[B, H|1, q, L]``."""
    batch, heads, length = positions.shape
    if length == tokens_seen:  # nothing was ever evicted: the stored order is the original one
        return mask
    num_queries = mask.shape[2]
    index = positions.long()[:, :, None, :].expand(batch, heads, num_queries, length)
    return mask.expand(batch, heads, num_queries, mask.shape[-1]).gather(3, index)


def _row_logit_scale(policy, key_counts: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    scale = policy.logit_scale(key_counts)
    if scale is None:
        return queries
    return queries * scale.to(queries.dtype)[None, None, :, None]


def kvhive_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention over a :class:`KVHiveCache` layer; plain sdpa for any other cache."""
    cache, layer_index = active_update(key)
    if cache is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    store = cache.layers[layer_index]
    policy = cache.policy
    batch, _, num_queries, _ = query.shape
    if cache.positions == "cache":
        # transformers built its mask over re-indexed positions; rebuild it over true positions.
        attention_mask = None
    mask = _full_mask(attention_mask, batch, num_queries, store.tokens_seen, store.sliding_window, query.device)
    compressed = cache.is_compressed(layer_index)

    if store.tokens_seen == num_queries:
        return _prefill(module, cache, layer_index, query, key, value, mask, scaling, dropout, compressed, kwargs)
    if store.is_uniform:
        return _decode_dense(module, cache, layer_index, query, mask, scaling, dropout, compressed, kwargs)
    if compressed and policy.extra_attention(store.policy_state, query, scaling) is not None:
        raise RuntimeError(f"method {policy.name!r} adds estimated attention, which the variable-length "
                           "path does not support; keep its heads at equal lengths")
    return _decode_variable_length(cache, layer_index, query, mask, scaling)


def _prefill(module, cache: KVHiveCache, layer_index, query, key, value, mask, scaling, dropout, compressed, kwargs):
    policy = cache.policy
    num_queries = query.shape[2]
    attended_queries = query
    if compressed:
        key_counts = torch.arange(1, num_queries + 1, device=query.device)
        attended_queries = _row_logit_scale(policy, key_counts, query)
    # A purely causal mask (no padding, no window in reach) lets sdpa use its causal kernels.
    causal_only = num_queries == key.shape[2] and torch.equal(
        mask, torch.ones(num_queries, num_queries, dtype=torch.bool, device=mask.device).tril().expand_as(mask))
    output, _ = sdpa_attention_forward(module, attended_queries, key, value, None if causal_only else mask,
                                       dropout=dropout, scaling=scaling, **kwargs)

    if cache.record_prefill:
        cache.prefill_records[layer_index] = (attended_queries, mask, scaling)
    # Policies score with the queries the model attended with (as in decode).
    cache.after_prefill(layer_index, _prefill_scoring(cache, layer_index, attended_queries, mask, scaling))
    return output, None


def _prefill_scoring(cache: KVHiveCache, layer_index: int, query, mask, scaling):
    """A factory of the :class:`ScoringInputs` of one layer right after its prefill."""
    store = cache.layers[layer_index]
    policy = cache.policy

    def make_scoring(phase: str) -> ScoringInputs:
        keys, values, positions, token_scores = store.dense()
        if policy.head_granularity == "query" and cache.num_query_heads != keys.shape[1]:
            factor = cache.num_query_heads // keys.shape[1]
            keys = keys.repeat_interleave(factor, dim=1)
            values = values.repeat_interleave(factor, dim=1)
            positions = positions.repeat_interleave(factor, dim=1)
        return ScoringInputs(
            keys=keys, values=values, queries=query, positions=positions, mask=mask, scaling=scaling,
            layer_index=layer_index, num_layers=len(cache.layers), sequence_length=store.tokens_seen,
            phase=phase, token_scores=dict(token_scores),
        )

    return make_scoring


def replay_prefill(recorded: KVHiveCache, target: KVHiveCache) -> None:
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
            raise ValueError("the recording cache evicted tokens; record with the 'full' method and compress_sliding=True")
        target.layers[layer_index].update(keys, values)
        query, mask, scaling = recorded.prefill_records[layer_index]
        target.after_prefill(layer_index, _prefill_scoring(target, layer_index, query, mask, scaling))


def _decode_dense(module, cache: KVHiveCache, layer_index, query, mask, scaling, dropout, compressed, kwargs):
    store = cache.layers[layer_index]
    policy = cache.policy
    keys, values, positions, token_scores = store.dense()
    stored_mask = _gather_mask(mask, positions, store.tokens_seen)
    batch, query_heads, num_queries, head_dim = query.shape
    heads = keys.shape[1]
    group = query_heads // heads
    wants_weights = compressed and DECODE in policy.phases and policy.needs_decode_attention
    extra = policy.extra_attention(store.policy_state, query, scaling) if compressed else None
    if compressed:
        key_counts = torch.full((num_queries,), keys.shape[2], device=query.device)
        query = _row_logit_scale(policy, key_counts, query)

    last_weights = None
    if not wants_weights and extra is None:
        sdpa_mask_ = stored_mask
        if sdpa_mask_.shape[1] not in (1, query_heads):
            sdpa_mask_ = sdpa_mask_.repeat_interleave(group, dim=1)
        if heads == query_heads and getattr(module, "num_key_value_groups", 1) > 1:
            # Stored per query head (Ada-KV on GQA): transformers would regroup the heads again.
            output = torch.nn.functional.scaled_dot_product_attention(
                query, keys, values, attn_mask=sdpa_mask_, scale=scaling).transpose(1, 2).contiguous()
        else:
            output, _ = sdpa_attention_forward(module, query, keys, values, sdpa_mask_, dropout=dropout,
                                               scaling=scaling, **kwargs)
    else:
        # [B, H, G*q, d] @ [B, H, d, L]: one matmul per stored head, keys and values read once.
        grouped = query.reshape(batch, heads, group * num_queries, head_dim)
        logits = torch.matmul(grouped, keys.transpose(-1, -2)) * scaling
        logits = logits.view(batch, heads, group, num_queries, -1)
        logits = logits.masked_fill(~stored_mask.unsqueeze(2), float("-inf"))
        row_max = logits.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(logits.dtype).min)
        exponentials = torch.exp(logits - row_max)
        denominator = exponentials.sum(dim=-1)
        numerator = torch.matmul(exponentials.view(batch, heads, group * num_queries, -1), values)
        numerator = numerator.view(batch, heads, group, num_queries, head_dim)
        if extra is not None:
            extra_numerator, extra_denominator, extra_max = (
                t.reshape(batch, heads, group, num_queries, *t.shape[3:]) for t in extra
            )
            common = torch.maximum(row_max.squeeze(-1), extra_max)
            exact_weight = torch.exp(row_max.squeeze(-1) - common)
            extra_weight = torch.exp(extra_max - common)
            numerator = numerator * exact_weight[..., None] + extra_numerator * extra_weight[..., None]
            denominator = denominator * exact_weight + extra_denominator * extra_weight
            output = numerator / denominator[..., None]
            weights = exponentials * (exact_weight / denominator)[..., None]
        else:
            output = numerator / denominator[..., None]
            weights = exponentials / denominator[..., None]
        output = output.reshape(batch, query_heads, num_queries, head_dim).transpose(1, 2).contiguous()
        last_weights = weights[:, :, :, -1].reshape(batch, query_heads, -1)

    def make_scoring(phase: str) -> ScoringInputs:
        return ScoringInputs(
            keys=keys, values=values, queries=query, positions=positions, mask=stored_mask, scaling=scaling,
            layer_index=layer_index, num_layers=len(cache.layers), sequence_length=store.tokens_seen,
            phase=phase, token_scores=dict(token_scores), last_query_weights=last_weights,
        )

    cache.after_decode(layer_index, make_scoring)
    return output, None


def _decode_variable_length(cache: KVHiveCache, layer_index, query, mask, scaling):
    """Attention when heads hold different numbers of tokens, without padding them.

    Each (query row, head) attends its own segment of the flat buffers: the logits are a
    sampled dense-dense product on a CSR pattern (only stored entries are computed), the
    softmax is a segment reduction, and the output a sparse-dense product.
    """
    store = cache.layers[layer_index]
    batch, query_heads, num_queries, head_dim = query.shape
    heads = store.num_heads
    group = query_heads // heads
    per_segment = group * num_queries
    segment_lengths = store.lengths.reshape(-1)
    offsets = store.segment_offsets()
    row_lengths = segment_lengths.repeat_interleave(per_segment)
    num_rows = row_lengths.numel()
    row_starts = torch.cat([row_lengths.new_zeros(1), row_lengths.cumsum(0)])
    nonzeros = int(row_starts[-1])
    row_of_entry = torch.repeat_interleave(torch.arange(num_rows, device=query.device), row_lengths)
    segment_of_entry = row_of_entry // per_segment
    columns = offsets[segment_of_entry] + torch.arange(nonzeros, device=query.device) - row_starts[row_of_entry]

    query_rows = query.reshape(batch, heads, group, num_queries, head_dim).reshape(num_rows, head_dim)
    pattern = torch.sparse_csr_tensor(row_starts, columns, query_rows.new_zeros(nonzeros),
                                      size=(num_rows, store.num_stored), check_invariants=False)
    logits = torch.sparse.sampled_addmm(pattern, query_rows, store.keys.T, beta=0.0, alpha=scaling).values()
    if not bool(mask.all()):  # decode without padding sees every stored token: skip the gather
        batch_of_entry = segment_of_entry // heads
        query_of_entry = row_of_entry % num_queries
        allowed = mask[batch_of_entry, 0, query_of_entry, store.positions[columns].long()]
        logits = logits.masked_fill(~allowed, float("-inf"))
    row_max = torch.segment_reduce(logits, "max", lengths=row_lengths).clamp_min(torch.finfo(logits.dtype).min)
    exponentials = torch.exp(logits - row_max.repeat_interleave(row_lengths))
    denominator = torch.segment_reduce(exponentials, "sum", lengths=row_lengths)
    weights = exponentials / denominator.repeat_interleave(row_lengths)
    weight_matrix = torch.sparse_csr_tensor(row_starts, columns, weights, size=(num_rows, store.num_stored),
                                            check_invariants=False)
    output = (weight_matrix @ store.values).reshape(batch, query_heads, num_queries, head_dim)
    return output.transpose(1, 2).contiguous(), None
