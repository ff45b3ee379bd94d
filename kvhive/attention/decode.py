"""Attention after the prefill: a decode step (one new query) or a prompt chunk (several) over what a
layer stores, then the cache's decision for the layer.

A layer whose heads hold equal counts (:func:`decode_dense`) takes one of six routes, chosen by what
the step must hand the method besides the output:

* nothing: sdpa in blocks of queries (:func:`attend_by_sdpa`), or kvhive's split-K kernel
  (:func:`dense_decode_by_kernel`), or, for a prompt chunk whose column sums the method reads, one
  pass that gives them with the output (``column_sums.chunk_attention_with_column_sums``);
* the new query's weights: the kernel with weights on CUDA (:func:`dense_decode_by_kernel`), else
  an explicit softmax (:func:`attend_by_explicit_softmax`), which also merges a method's estimated
  extra term and computes the key probes' products with the logits;
* the key probes' products alone: :func:`attention_with_key_probes`.

A layer whose heads hold different counts decodes packed (:func:`decode_packed`).
"""

from __future__ import annotations

import torch

from kvhive import static_step
from kvhive.attention.column_sums import chunk_attention_with_column_sums, plain_softmax_attention
from kvhive.attention.masks import dense_step_mask, full_mask, row_logit_scale, stored_causal_rows
from kvhive.attention.scoring import build_scoring, filled_count, question_scoring
from kvhive.attention.varlen import (
    kernel_runs_on,
    kernel_supports,
    varlen_attention,
    varlen_attention_kernel,
    varlen_attention_paged,
)
from kvhive.cache.storage import PADDING_SCORE, PAGE_TOKENS
from kvhive.methods.base import KeyProbes


def decode_dense(module, cache, layer_index, query, mask, scaling, dropout, compressed, kwargs):
    """New queries over equal head counts: the stored tokens' mask, the route (module docstring), the decision."""
    store = cache.layers[layer_index]
    policy, traits = cache.policy, cache.traits  # traits: the method's capabilities, read once
    keys, values, positions, token_scores, filled = store.decode_view()  # filled: a fixed capacity's slots
    num_queries = query.shape[2]
    stored_mask, causal_by_position, only_empty_slots = dense_step_mask(
        store, positions, token_scores, filled, mask, num_queries, cache.layout_plan.compileable
    )
    # The split-K kernel masks only past each row's length; a compiled step stays torch, for inductor.
    kernel_eligible = only_empty_slots and num_queries == 1 and not torch.compiler.is_compiling()
    # One new query's weights come with the attention; a prompt chunk's scoring computes its own.
    wants_weights = compressed and num_queries == 1 and traits.needs_decode_attention and traits.has_decode
    attends_outside = compressed and traits.attends_outside_cache  # SubGen's estimate of evicted keys
    extra = policy.extra_attention(store.policy_state, query, scaling) if attends_outside else None
    if traits.changes_attention_logits:  # every layer (BUZZ log n), compressed or not
        query = row_logit_scale(policy, stored_mask, keys.shape[2], query)
    last_weights = last_logits = accumulated = probes = None

    def make_scoring(phase: str):
        return build_scoring(
            cache,
            layer_index,
            phase,
            (keys, values, positions, token_scores),
            query,
            stored_mask,
            scaling,
            store.tokens_seen_device if static_step.in_static_step() else store.tokens_seen,
            last_query_weights=last_weights,
            last_query_logits=last_logits,
            accumulated_weights=accumulated,
            filled=filled_count(store),
            known_filled=store.layout.known_length,
            stored_in_order=store.stored_in_order,
            key_probes=probes,
        )

    # Key probes (SubGen, BumbleBee) join the logits' product on the CPU: the keys are read once this
    # step. Float32 only: the methods form float32 products, which a narrower attention product is not.
    if compressed and traits.takes_key_probes and traits.has_decode and num_queries == 1 and keys.device.type == "cpu":
        if keys.dtype == query.dtype == torch.float32:
            probes = cache.compressor.decode_key_probes(cache, layer_index, make_scoring)
    if wants_weights or extra is not None or probes is not None:
        by_kernel = None
        if wants_weights and kernel_eligible and extra is None and probes is None and kernel_runs_on(query):
            by_kernel = dense_decode_by_kernel(store, query, scaling, weights=True)
        if by_kernel is not None:  # on CUDA: the torch pass below is about ten kernels a layer
            output, last_weights, last_logits = by_kernel
        elif probes is not None and not wants_weights and extra is None and stored_mask is None:
            output = attention_with_key_probes(query, keys, values, scaling, probes)
        else:
            output, last_weights, last_logits = attend_by_explicit_softmax(
                query, keys, values, stored_mask, scaling, extra, probes, wants_weights
            )
    elif compressed and causal_by_position and plain_softmax_attention(dropout, kwargs):
        # The decision after these queries reads their column sums (H2O's chunk of a chunked prefill).
        sums_phase = cache.chunk_column_sums_phase(layer_index)
        if sums_phase is None:
            output = attend_by_sdpa(store, query, keys, values, positions, stored_mask, scaling, causal_by_position)
        else:
            output, accumulated = chunk_attention_with_column_sums(
                query, keys, values, positions, store.tokens_seen, scaling, sums_phase
            )
    else:
        output = None
        # "auto": a fixed capacity's empty slots would be an sdpa mask, which has no split-K decode path.
        if (
            kernel_eligible
            and (cache.dense_decode == "kernel" or (cache.dense_decode == "auto" and filled is not None))
            and kernel_runs_on(query)
        ):
            output = dense_decode_by_kernel(store, query, scaling)
        if output is None:
            output = attend_by_sdpa(store, query, keys, values, positions, stored_mask, scaling, causal_by_position)
    if cache.question_copy_tokens:  # a prompt chunk followed by a copy of the prompt's question
        make_scoring = question_scoring(cache, layer_index, query, stored_mask, scaling, make_scoring)
    cache.compressor.after_decode(cache, layer_index, make_scoring)
    return output, None


def attend_by_sdpa(store, query, keys, values, positions, stored_mask, scaling, causal_by_position: bool):
    """``[B, q, Hq, dv]``: sdpa over the stored tokens in blocks of queries (:func:`sdpa_in_query_blocks`);
    ``causal_by_position``: each block's mask is built from the stored positions (``stored_mask`` None)."""
    causal_rows = None
    if causal_by_position:
        num_queries = query.shape[2]

        def causal_rows(start: int, stop: int) -> torch.Tensor:
            return stored_causal_rows(store, positions, num_queries, start, stop)

    group = query.shape[1] // keys.shape[1]
    return sdpa_in_query_blocks(query, keys, values, stored_mask, scaling, group, causal_rows).transpose(1, 2)


def attend_by_explicit_softmax(query, keys, values, stored_mask, scaling, extra, probes, wants_weights: bool):
    """``(output [B, q, Hq, dv], newest query's weights [B, Hq, L] or None, logits [B, H, G, q, L])``
    of the queries over the stored tokens, one matmul per stored head (``[B, H, G*q, d] @ [B, H, d,
    L]``: keys and values read once). ``extra``: a method's estimated term ``(numerator, denominator,
    max)`` merged into the softmax (:func:`merge_estimate`); ``probes``: key probes whose products
    join the logits' product (their rows, unscaled, go to ``probes.products``)."""
    batch, query_heads, num_queries, head_dim = query.shape
    heads = keys.shape[1]
    group = query_heads // heads
    grouped = query.reshape(batch, heads, group * num_queries, head_dim)
    if keys.dtype == torch.float16:
        # fp16's range ends at 65504: a large q.k overflows before it is scaled (stock sdpa
        # accumulates in fp32 and stays finite), so the logits are formed in fp32. bf16 has
        # fp32's range and keeps the model's dtype.
        logits = torch.matmul(grouped.float(), keys.float().transpose(-1, -2)) * scaling
    else:
        rows = grouped if probes is None else torch.cat([grouped, probes.rows], dim=2)
        logits = torch.matmul(rows, keys.transpose(-1, -2))
        if probes is not None:  # the probes' products, unscaled; the queries' logits go on
            probes.products = logits[:, :, group * num_queries :]
            logits = logits[:, :, : group * num_queries]
        logits = (logits if logits.dtype == torch.float32 else logits.float()) * scaling
    # Before the mask (the select below is out of place), for a method that scores with other logits.
    last_logits = logits = logits.view(batch, heads, group, num_queries, -1)
    if stored_mask is not None:
        logits = torch.where(stored_mask.unsqueeze(2), logits, float("-inf"))
    row_max = logits.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(logits.dtype).min)
    exponentials = torch.exp(logits - row_max)
    denominator = exponentials.sum(dim=-1)
    # (No .to / .float() calls that change nothing: a float32 model's step skips four.)
    product = exponentials.view(batch, heads, group * num_queries, -1)
    numerator = torch.matmul(product if product.dtype == values.dtype else product.to(values.dtype), values)
    numerator = numerator.view(batch, heads, group, num_queries, head_dim)
    numerator = numerator if numerator.dtype == torch.float32 else numerator.float()
    last_weights = None
    if extra is not None:
        output, weights = merge_estimate(numerator, denominator, exponentials, row_max, extra)
        last_weights = weights[:, :, :, -1].reshape(batch, query_heads, -1)
    else:
        denominator = denominator.unsqueeze(-1)
        output = numerator / denominator
        # Only the newest query's weights are read (one query: all of them, no select); a method
        # here only for its key probes reads none.
        if probes is None or wants_weights:
            if num_queries == 1:
                last_weights = (exponentials / denominator).view(batch, query_heads, -1)
            else:
                last_weights = (exponentials[:, :, :, -1:] / denominator[:, :, :, -1:]).view(batch, query_heads, -1)
    output = output if output.dtype == query.dtype else output.to(query.dtype)
    output = output.reshape(batch, query_heads, num_queries, head_dim).transpose(1, 2)
    return output, last_weights, last_logits


def merge_estimate(numerator, denominator, exponentials, row_max, extra):
    """``(output, weights)`` of a softmax whose exact part (``numerator`` ``[B, H, G, q, dv]`` and
    ``denominator`` of ``exponentials`` taken against ``row_max``) is merged with a method's estimate
    of the evicted tokens' share, ``extra = (numerator, denominator, max)``, on a common scale."""
    batch, heads, group, num_queries = denominator.shape
    extra_numerator, extra_denominator, extra_max = (
        t.reshape(batch, heads, group, num_queries, *t.shape[3:]).float() for t in extra
    )
    # An estimate whose denominator (the evicted tokens' estimated mass) is 0 contributes nothing: its
    # max must not set the common scale (exp of the gap would underflow the exact part to 0 and leave
    # 0 / 0, as fp16-sized logits showed).
    extra_max = torch.where(extra_denominator > 0, extra_max, float("-inf"))
    common = torch.maximum(row_max.squeeze(-1), extra_max)
    exact_weight = torch.exp(row_max.squeeze(-1) - common)
    extra_weight = torch.exp(extra_max - common)
    numerator = numerator * exact_weight[..., None] + extra_numerator * extra_weight[..., None]
    denominator = denominator * exact_weight + extra_denominator * extra_weight
    return numerator / denominator[..., None], exponentials * (exact_weight / denominator)[..., None]


def attention_with_key_probes(query, keys, values, scaling: float, probes: KeyProbes) -> torch.Tensor:
    """One new query's attention output ``[B, 1, Hq, d]`` over every stored token (nothing masked),
    the key probes' products computed with its logits: ``[G queries; P probes] @ keysᵀ`` per stored
    head, so the keys are read once (``probes.products`` ``[B, H, P, N]``, unscaled), then a softmax
    and the product with the values: what sdpa computes, in the few operations of a one-row
    attention (a method that reads no weights needs no separate exponentials and sums)."""
    batch, query_heads, _, head_dim = query.shape
    heads = keys.shape[1]
    group = query_heads // heads
    rows = torch.cat([query.reshape(batch, heads, group, head_dim), probes.rows], dim=2)
    products = torch.matmul(rows, keys.transpose(-1, -2))
    probes.products = products[:, :, group:]
    weights = torch.softmax(products[:, :, :group] * scaling, dim=-1)
    output = torch.matmul(weights, values)  # [B, H, G, d]: query head h * G + g at [:, h, g]
    return output.reshape(batch, query_heads, 1, head_dim).transpose(1, 2)


QUERY_BLOCK = 256


def sdpa_in_query_blocks(query, keys, values, mask, scaling, group: int, block_mask=None) -> torch.Tensor:
    """sdpa of a prompt chunk's queries over the stored tokens, ``QUERY_BLOCK`` queries at a time.

    With a mask, sdpa's CPU path (and CUDA's math fallback) materialises [B, H, q, L] scores and
    their softmax, which for a long chunk is the whole prefill peak of a chunked prompt. Blocks of
    queries bound it to a block's share; a decode step (one query) is one block.
    ``block_mask(start, stop)``: the mask of query rows ``start..stop-1``, built for each block
    (``mask`` is then None), so no mask of the whole chunk exists at once."""
    heads, query_heads, num_queries = keys.shape[1], query.shape[1], query.shape[2]
    outputs = []
    for start in range(0, num_queries, QUERY_BLOCK):
        block_mask_rows = mask
        if block_mask is not None:
            block_mask_rows = block_mask(start, min(num_queries, start + QUERY_BLOCK))
        elif mask is not None and mask.shape[2] != 1:
            block_mask_rows = mask[:, :, start : start + QUERY_BLOCK]
        if block_mask_rows is not None and block_mask_rows.shape[1] not in (1, query_heads):
            block_mask_rows = block_mask_rows.repeat_interleave(group, dim=1)
        # Stored heads may be query heads (Ada-KV on GQA): sdpa regroups by its own head counts.
        outputs.append(
            torch.nn.functional.scaled_dot_product_attention(
                query[:, :, start : start + QUERY_BLOCK],
                keys,
                values,
                attn_mask=block_mask_rows,
                scale=scaling,
                enable_gqa=heads != query_heads,
            )
        )
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)


def dense_decode_by_kernel(store, query, scaling, weights: bool = False):
    """One new query over a dense layer through kvhive's split-K kernel, reading the buffer's
    stored slice in place (a fixed capacity: its filled slots, by the device lengths, no host
    read); None when the kernel does not handle these shapes/dtypes or does not run on this device
    (the attention asks :func:`kernel_runs_on` first, so a CPU step makes no views for nothing). Returns the output
    ``[B, 1, Hq, dv]``; with ``weights``: ``(output, weights [B, Hq, L], logits [B, H, G, 1, L])``,
    the new query's softmax weights over the slots the attention reads (the stored tokens; a fixed
    capacity's every slot, 0 on the empty ones), and their logits before any mask (0 on the empty
    slots)."""
    batch, query_heads, _, head_dim = query.shape
    segments = batch * store.num_heads
    rows = query.reshape(segments, query_heads // store.num_heads, head_dim)
    buffer_keys, buffer_values = store.buffers()
    keys, values = buffer_keys.view(-1, head_dim), buffer_values.view(-1, buffer_values.shape[-1])
    if not kernel_supports(rows, keys, values):
        return None
    capacity = buffer_keys.shape[2]
    if store.fixed_capacity:
        if store.row_lengths_device is not None:  # stacked rows: each row its own length, all its heads
            lengths = store.row_lengths_device.repeat_interleave(store.num_heads, output_size=segments)
        else:
            lengths = store.length_device.expand(segments).contiguous()  # the kernel reads one per segment
        starts = torch.arange(segments, device=query.device) * capacity
        result = varlen_attention_kernel(
            rows, keys, values, scaling, capacity, segment_start=starts, segment_length=lengths, return_weights=weights
        )
    else:
        length = store.dense_length
        result = varlen_attention_kernel(
            rows, keys, values, scaling, length, uniform=(capacity, store.slice_start, length), return_weights=weights
        )
    output = (result[0] if weights else result).view(batch, query_heads, 1, -1).transpose(1, 2)
    if not weights:
        return output
    _, kernel_weights, logits = result
    heads = store.num_heads
    return output, kernel_weights.view(batch, query_heads, -1), logits.view(batch, heads, query_heads // heads, 1, -1)


def decode_packed(cache, layer_index, query, mask, scaling, compressed: bool):
    """Attention over a layer whose heads hold different counts (no policy step: the cache keeps a
    compressed sliding layer within its window after it). Returns transformers' pair."""
    policy = cache.policy
    if policy.changes_attention_logits:
        raise RuntimeError(
            f"method {policy.name!r} scales the attention logits, which the variable-length path "
            "does not support; keep its heads at equal lengths"
        )
    if compressed and policy.extra_attention(cache.layers[layer_index].policy_state, query, scaling) is not None:
        raise RuntimeError(
            f"method {policy.name!r} adds estimated attention, which the variable-length "
            "path does not support; keep its heads at equal lengths"
        )
    if query.shape[2] == 1 and cache.static_decode:
        # A static decode step (transformers' mask is a fixed unused column, get_mask_sizes): shapes
        # fixed by the layout, the layer masks its tokens itself.
        output = decode_packed_static(cache, layer_index, query, scaling)
    else:
        output = decode_variable_length(cache, layer_index, query, mask, scaling)
    cache.after_variable_length_decode(layer_index)
    return output, None


def decode_packed_static(cache, layer_index, query, scaling):
    """One new query over a packed layer (heads holding different counts) with shapes that do not
    change from step to step, so a compiled step serves every later one: attention reads every page
    of the buffers (or, on CUDA, each segment up to the largest capacity) and masks the slots past
    each segment's device length, and the left padding recorded at prefill. No host value is read."""
    store = cache.layers[layer_index]
    batch, query_heads, _, head_dim = query.shape
    heads = store.num_heads
    keys, values, _, segment_start, segment_length, slot_scores = store.packed_buffers()
    page_segment, page_offset, bound = store.packed_pages()
    padding = slot_scores.get(PADDING_SCORE)  # [C], aligned with the buffers' slots (0 when empty)
    output = varlen_attention_paged(
        query.reshape(batch * heads, query_heads // heads, head_dim),
        keys,
        values,
        segment_start,
        segment_length,
        page_segment,
        page_offset,
        bound,
        scaling,
        allowed=None if padding is None else padding == 0,
    )
    return output.reshape(batch, query_heads, 1, -1).transpose(1, 2)


def decode_variable_length(cache, layer_index, query, mask, scaling):
    """Attention when heads hold different numbers of tokens, without padding them: each
    (batch, head) segment is attended by its group's query rows (``kvhive.attention.varlen``)."""
    store = cache.layers[layer_index]
    batch, query_heads, num_queries, head_dim = query.shape
    heads = store.num_heads
    group = query_heads // heads
    keys, values, positions, segment_start, segment_length, max_length = store.packed()
    rows = query.reshape(batch, heads, group, num_queries, head_dim).reshape(
        batch * heads, group * num_queries, head_dim
    )
    if mask is None and num_queries > 1:
        mask = full_mask(None, batch, num_queries, store.tokens_seen, None, query.device)
    flat_mask = None if mask is None else mask[:, 0]
    output = varlen_attention(
        rows,
        keys,
        values,
        segment_start,
        segment_length,
        store.lengths_host.reshape(-1),
        max_length,
        scaling,
        positions=positions,
        mask=flat_mask,
        heads=heads,
        num_queries=num_queries,
        segment_capacity_host=store.segment_capacity_host,
        page=PAGE_TOKENS,
    )
    output = output.reshape(batch, query_heads, num_queries, -1)
    return output.transpose(1, 2)
