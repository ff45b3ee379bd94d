"""The masks of kvhive's attention: the model's mask over every original position, its rows at
the stored tokens' positions, the mask a layer builds itself where transformers gives none (a
static decode step, positions="cache", a prompt chunk over a growing layer), left padding recorded at
prefill (or refused where positions are re-indexed), and a method's per-row logit scale, which
counts the keys each query row may attend.

How a forward after the prefill masks the stored tokens of a layer whose heads hold equal counts
(:func:`dense_step_mask`): one new query in a static decode step (transformers' mask is a fixed
unused column, ``KVHiveCache.get_mask_sizes``) or without a model mask to gather (none needed, or
positions="cache") is masked by the layer itself, from left padding recorded at prefill and the
sliding window by position (no mask when neither applies). Several new queries (a prompt chunk)
without a model mask over a growing layer are causal by position: no mask, built one block of
queries at a time where it is needed (sdpa's blocks, the scoring's rows), never for the whole chunk
at once. Otherwise the model's mask is gathered at the stored positions (:func:`gather_mask`). A
fixed capacity's empty slots are masked on top.
"""

from __future__ import annotations

import torch

from kvhive.cache.options import CACHE_POSITIONS
from kvhive.cache.storage import PADDING_SCORE
from kvhive.methods.base import causal_mask


def attention_mask_for(cache, store, attention_mask, query: torch.Tensor, layer_index: int) -> torch.Tensor | None:
    """The mask the attention over ``store`` reads (``[B, 1, q, N]`` boolean over original positions),
    or None: causal over the stored tokens' positions, which the layer applies itself."""
    if cache.positions == CACHE_POSITIONS:
        # transformers built its mask over re-indexed positions, which says nothing of the stored
        # tokens' true positions. The prompt gets the causal mask over true positions (padding is
        # refused); later forwards get theirs from the stored positions alone (gather_mask), whose
        # size follows the kept tokens, not every token ever seen (a long stream stays flat).
        if not store.in_prefill:
            return None
        batch, _, num_queries, _ = query.shape
        mask = full_mask(None, batch, num_queries, store.tokens_seen, store.sliding_window, query.device)
        refuse_padding(model_mask(attention_mask), mask, layer_index)
        return mask
    if store.in_prefill or store.has_padding or not store.is_uniform:
        return model_mask(attention_mask)
    # After an unpadded prompt the model's mask says nothing the stored positions do not (causal
    # order, the window): kvhive masks by position, and transformers builds a chunk-sized mask
    # instead of one over every token seen (KVHiveCache.get_mask_sizes), so a long stream stays flat.
    return None


def model_mask(attention_mask):
    """The model's mask as boolean (True = may attend), or None."""
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask == 0
    return attention_mask


def full_mask(attention_mask, batch_size, num_queries, tokens_seen, sliding_window, device):
    """``[B, 1, q, N]`` boolean mask over every original position."""
    if attention_mask is not None:
        return model_mask(attention_mask)
    key_positions = torch.arange(tokens_seen, device=device)
    query_positions = key_positions[tokens_seen - num_queries :]
    allowed = key_positions[None, :] <= query_positions[:, None]
    if sliding_window is not None:
        allowed &= (query_positions[:, None] - key_positions[None, :]) < sliding_window
    return allowed[None, None].expand(batch_size, 1, num_queries, tokens_seen)


def gather_mask(mask: torch.Tensor | None, positions: torch.Tensor, store, num_queries: int) -> torch.Tensor | None:
    """The mask over the stored tokens: ``[B, H|1, q, L]``, or None when nothing is masked.

    The model's mask (padding, a window in reach) is gathered at the stored tokens' positions.
    Without one (no padding, no window in reach) a single new query sees every stored token
    (None, so sdpa keeps its fast kernels); several new queries are causal among themselves."""
    batch, heads, length = positions.shape
    if mask is None:
        if num_queries == 1:
            return None
        return stored_causal_rows(store, positions, num_queries, 0, num_queries)
    tokens_seen = store.tokens_seen
    if length == tokens_seen:  # nothing was ever evicted: the stored order is the original one
        return mask
    index = positions.long()[:, :, None, :].expand(batch, heads, num_queries, length)
    return mask.expand(batch, heads, num_queries, mask.shape[-1]).gather(3, index)


def stored_causal_rows(store, positions: torch.Tensor, num_queries: int, start: int, stop: int) -> torch.Tensor:
    """``[B, H, stop - start, L]``: rows ``start..stop-1`` of the mask of ``num_queries`` new queries
    (the newest tokens seen) over the stored tokens when the model gives none: causal by the
    stored tokens' positions, and the window of a sliding layer."""
    first = store.tokens_seen - num_queries
    allowed = causal_mask(positions, first + start, first + stop)
    if store.is_sliding:  # positions="cache" gives no model mask: apply the window here
        query_positions = torch.arange(first + start, first + stop, device=positions.device)
        allowed &= (query_positions[None, None, :, None] - positions[:, :, None, :]) < store.sliding_window
    return allowed


def record_padding(store, mask: torch.Tensor | None) -> None:
    """Remember which prompt tokens are left padding (a compiled decode step masks them itself).
    One read per layer at prefill; nothing is stored for a batch without padding."""
    if mask is None:
        return
    padding = ~mask[:, 0].any(dim=-2)  # [B, N]: keys no query of the prompt may attend
    if bool(padding.any()):
        store.has_padding = True
        store.set_token_scores(PADDING_SCORE, padding[:, None, :].expand(-1, store.num_heads, -1).float())


def refuse_padding(given_mask: torch.Tensor | None, causal: torch.Tensor, layer_index: int) -> None:
    """positions="cache" re-indexes every row to the same contiguous positions, which has no
    place for padding: the rebuilt mask would let real tokens attend the padding (the padded
    row's logits were off by 0.24 even with the full cache). Refuse instead of answering wrong."""
    if given_mask is None:
        return
    masked = ~given_mask.expand_as(causal) & causal
    if bool(masked.any()):
        rows = sorted({int(r) for r in masked.nonzero()[:, 0].tolist()})
        raise ValueError(
            f"positions='cache' does not support padded batches: the attention mask hides tokens of row(s) {rows} "
            f"(layer {layer_index}); run rows of equal length without padding (or one at a time), or use "
            "positions='original'"
        )


def row_logit_scale(policy, mask: torch.Tensor | None, num_keys: int, queries: torch.Tensor) -> torch.Tensor:
    """Queries times the policy's logit multiplier. It gets ``[B, q]`` key counts: the keys each
    query row may attend in its own batch row (padding excluded, so a row's factor is what it
    would be alone); without a mask the queries are the newest ``q`` of ``num_keys`` causal keys."""
    batch, _, num_queries, _ = queries.shape
    if mask is None:
        newest = torch.arange(num_keys - num_queries + 1, num_keys + 1, device=queries.device)
        key_counts = newest.expand(batch, num_queries)
    else:
        key_counts = mask[:, 0].sum(dim=-1).expand(batch, num_queries)
    scale = policy.logit_scale(key_counts)
    if scale is None:
        return queries
    return queries * scale.to(queries.dtype)[:, None, :, None]


def dense_step_mask(store, positions, token_scores, filled, mask, num_queries: int, static_decode: bool):
    """``(stored mask [B, 1|H, q, L] or None, causal_by_position, only_empty_slots)`` of a step after the
    prefill over equal head counts (module docstring); ``filled``: a capacity's slots (``[C]``/``[B, C]``)."""
    causal_by_position = num_queries > 1 and mask is None and filled is None and not store.is_sliding
    if num_queries == 1 and (static_decode or mask is None):
        # From what the layer knows on the device: left padding recorded at prefill (aligned with
        # ``positions``), and the sliding window by the stored tokens' positions (the new token sits
        # at tokens_seen - 1; the window reaches back window - 1 tokens).
        allowed = None
        padding = token_scores.get(PADDING_SCORE)
        if padding is not None:
            allowed = padding == 0
        if store.is_sliding:
            seen = store.tokens_seen_device
            if store.row_tokens_seen_device is not None:  # stacked rows: each row its own count
                seen = store.row_tokens_seen_device[:, None, None]
            in_window = positions >= seen - store.sliding_window
            allowed = in_window if allowed is None else allowed & in_window
        stored_mask = None if allowed is None else allowed[:, :, None, :]
    elif causal_by_position:
        stored_mask = None
    else:
        stored_mask = gather_mask(mask, positions, store, num_queries)
    only_empty_slots = stored_mask is None
    if filled is not None:
        filled = filled.view(1, 1, 1, -1) if filled.dim() == 1 else filled[:, None, None, :]
        stored_mask = filled if stored_mask is None else stored_mask & filled
    return stored_mask, causal_by_position, only_empty_slots
