"""A layer's steady decode step: one route, chosen once, then taken at every eager step.

The first eager one-query step after a layer's transition (its prefill, a layout change, a prompt
chunk, a row selection: ``LayerStore.forget_decode_route``) runs the general attention
(``kvhive.attention.integration.attend``), then :func:`choose_route` stores the route the layer's
next steps take on ``LayerStore.decode_route``. Each route is the step itself, nothing re-decided:

* :func:`sdpa_route`: a layer the step only attends (the full cache, an uncompressed layer, a layer
  a prefill-only method cut at prefill): sdpa over the stored tokens, nothing masked;
* :func:`prefill_only_route`: the same for a layer a prefill-only method never cut, then the
  compressor's check that such a layer's growth past the budget is reported once;
* :func:`weights_route`: a layer its method evicts from with the new query's weights (TOVA, H2O): an
  explicit softmax whose weights and logits the method reads, then the compressor's decode step
  (``Compressor.evict_step``, the one place a layer's decode decision is taken);
* ``attend``, the general attention, for every other layer (a mask, a fixed capacity, packed
  heads, a sliding window, re-indexed positions, kernels, estimates, key probes).

A route needs no model mask: it is chosen only where the general attention would mask nothing (original
positions, no padding, no window). Compiled and captured steps take the general attention (device
counters; kvhive.static_step).
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvhive.attention.varlen import kernel_runs_on
from kvhive.cache.layers.growing import GrowingLayout
from kvhive.cache.options import ORIGINAL_POSITIONS
from kvhive.cache.storage import PADDING_SCORE
from kvhive.methods.base import DECODE, ScoringInputs

# kvhive picks its own sdpa backends: cuDNN's sdpa re-plans for every new key length (milliseconds
# of host time per call), so a decode step would depend on it.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

# Elsewhere sdpa picks as it does (one context, reused: it holds nothing).
ANY_BACKEND = contextlib.nullcontext()


def choose_route(cache, store, layer_index: int, query: torch.Tensor, general):
    """The route of ``store``'s next eager one-query steps (module docstring); ``general`` where no
    steady route serves the layer as it is now."""
    traits, compressor = cache.traits, cache.compressor
    if (
        type(store.layout) is not GrowingLayout
        or store.codec is not None
        or store.row_seen is not None
        or store.is_sliding
        or store.has_padding
        or cache.positions != ORIGINAL_POSITIONS
        or traits.changes_attention_logits
        or PADDING_SCORE in store.token_scores
    ):
        return general
    if layer_index not in compressor.compressed or not traits.compresses:
        plain = cache.dense_decode != "kernel" or not kernel_runs_on(query)
        return sdpa_route if plain else general
    if not traits.has_decode:
        if traits.attends_outside_cache or (cache.dense_decode == "kernel" and kernel_runs_on(query)):
            return general
        return sdpa_route if layer_index in cache.cut_at_prefill else prefill_only_route
    steady_eviction = (
        traits.needs_decode_attention
        and not traits.attends_outside_cache
        and not traits.takes_key_probes
        and layer_index in cache.layer_budgets
        and not kernel_runs_on(query)
    )
    return weights_route if steady_eviction else general


def sdpa_route(module, cache, store, layer_index, query, key, value, attention_mask, scaling, dropout, kwargs):
    """One new query over every stored token (``key``, ``value``: what the layer's update returned)."""
    with sdpa_kernel(SDPA_BACKENDS) if query.is_cuda else ANY_BACKEND:
        output = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, scale=scaling, enable_gqa=key.shape[1] != query.shape[1]
        )
    return output.transpose(1, 2), None


def prefill_only_route(module, cache, store, layer_index, query, key, value, attention_mask, scaling, dropout, kwargs):
    """:func:`sdpa_route`, then the once-per-cache report of a layer grown past its budget uncut."""
    result = sdpa_route(module, cache, store, layer_index, query, key, value, attention_mask, scaling, dropout, kwargs)
    cache.compressor.warn_budget_not_kept(cache, layer_index, store)
    return result


def weights_route(module, cache, store, layer_index, query, key, value, attention_mask, scaling, dropout, kwargs):
    """The new query's attention with its weights, then the method's decode step on them."""
    keys, values, positions, token_scores, _ = store.layout.decode_view()
    output, weights, logits = attend_one_query(query, keys, values, scaling)
    scoring = ScoringInputs(
        keys=keys,
        values=values,
        queries=query,
        positions=positions,
        mask=None,
        scaling=scaling,
        layer_index=layer_index,
        num_layers=len(cache.layers),
        sequence_length=store.tokens_seen,
        phase=DECODE,
        token_scores=dict(token_scores),
        last_query_weights=weights,
        last_query_logits=logits,
        stored_in_order=store.stored_in_order,
    )
    cache.compressor.evict_step(cache, layer_index, store, scoring)
    return output, None


def attend_one_query(query, keys, values, scaling):
    """``(output [B, 1, Hq, dv], weights [B, Hq, L], logits [B, H, G, 1, L])``: ``attend_by_explicit_softmax``
    of one query with nothing masked, op for op."""
    batch, query_heads, _, head_dim = query.shape
    heads = keys.shape[1]
    grouped = query.reshape(batch, heads, query_heads // heads, head_dim)
    if keys.dtype == torch.float16:  # fp16's range ends at 65504: the logits are formed in fp32
        logits = torch.matmul(grouped.float(), keys.float().transpose(-1, -2)) * scaling
    else:
        logits = torch.matmul(grouped, keys.transpose(-1, -2))
        logits = (logits if logits.dtype == torch.float32 else logits.float()) * scaling
    logits = logits.view(batch, heads, query_heads // heads, 1, -1)
    row_max = logits.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(logits.dtype).min)
    exponentials = torch.exp(logits - row_max)
    denominator = exponentials.sum(dim=-1).unsqueeze(-1)
    product = exponentials.view(batch, heads, query_heads // heads, -1)
    numerator = torch.matmul(product if product.dtype == values.dtype else product.to(values.dtype), values)
    numerator = numerator.view(batch, heads, query_heads // heads, 1, head_dim)
    output = (numerator if numerator.dtype == torch.float32 else numerator.float()) / denominator
    weights = (exponentials / denominator).view(batch, query_heads, -1)
    output = output if output.dtype == query.dtype else output.to(query.dtype)
    return output.reshape(batch, query_heads, 1, head_dim).transpose(1, 2), weights, logits
