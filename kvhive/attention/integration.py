"""kvhive's attention function: the one transformers calls for every attention layer of a forward
that runs ``attn_implementation="kvhive"`` (:mod:`kvhive.attention.hooks` registers it and switches
a model to it for the forwards given a kvhive cache).

A steady eager decode step takes the route its layer chose (:mod:`kvhive.attention.routes`) after
one guard, that the module is the one that filled the layer (the cache's update checked the rest).
Otherwise, over a :class:`KVHiveCache` layer, it dispatches by phase and layout (:func:`attend`): the prefill
(:mod:`kvhive.attention.prefill`: the attention, then the layer is cut right away), later forwards
over a layer whose heads hold equal counts (:func:`kvhive.attention.decode.decode_dense`) or
different counts (:func:`kvhive.attention.decode.decode_packed`). The method gets what it scores
with through :class:`~kvhive.methods.base.ScoringInputs` (:mod:`kvhive.attention.scoring`) and may
change the attention itself (logit scaling, an estimated extra term). Any other cache gets plain sdpa.

A chunk of a chunked prefill on CPU returns the heap's free pages to the OS before the attention,
after it, and at the end of the model's forward (the forward hook, told through the cache), so the
temporaries of one step (the projections and RoPE, the attention, the MLP) do not stay resident on
top of what the next holds (``kvhive.heap.trim_heap``). (No hook on the model's modules: kvhive
leaves them as found.)

This module also re-exports the names other modules and tests import from it.
"""

from __future__ import annotations

import torch
from torch.nn.attention import sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from kvhive import static_step
from kvhive.attention import hooks
from kvhive.attention.column_sums import prompt_attention_with_column_sums
from kvhive.attention.decode import (
    QUERY_BLOCK,
    attention_with_key_probes,
    decode_dense,
    decode_packed,
    decode_packed_static,
    decode_variable_length,
    dense_decode_by_kernel,
    sdpa_in_query_blocks,
)
from kvhive.attention.hooks import ATTENTION_NAME, kvhive_mask, mark_prompt_chunk_on_cpu
from kvhive.attention.masks import attention_mask_for
from kvhive.attention.prefill import prefill, replay_prefill
from kvhive.attention.quantized_decode import decode_quantized
from kvhive.attention.routes import ANY_BACKEND, SDPA_BACKENDS, choose_route
from kvhive.cache.handoff import active_update
from kvhive.cache.rows import CacheRows
from kvhive.heap import trim_heap

__all__ = [
    "ATTENTION_NAME",
    "SDPA_BACKENDS",
    "QUERY_BLOCK",
    "attach",
    "attention_by_row",
    "kvhive_attention",
    "kvhive_mask",
    "register",
    "replay_prefill",
    "sdpa_backends",
]


def sdpa_backends(device: torch.device):
    """The context in which kvhive's sdpa calls run on ``device`` (:data:`SDPA_BACKENDS` on CUDA)."""
    return sdpa_kernel(SDPA_BACKENDS) if device.type == "cuda" else ANY_BACKEND


def register() -> None:
    """Make ``attn_implementation="kvhive"`` available (idempotent). The mask function is read
    through :mod:`~kvhive.attention.hooks` at each call, so a replaced ``hooks.kvhive_mask`` counts."""
    AttentionInterface.register(ATTENTION_NAME, kvhive_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, hooks.kvhive_mask)


def attach(model) -> None:
    """Register kvhive's attention and let ``model`` run it for the calls given a kvhive cache
    (:func:`kvhive.attention.hooks.attach`). Idempotent."""
    register()
    hooks.attach(model)


def kvhive_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention over a :class:`KVHiveCache` layer (module docstring); plain sdpa for any other cache."""
    cache, layer_index = active_update(key, kwargs)
    if cache is None:
        with sdpa_backends(query.device):
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
            )
    if isinstance(cache, CacheRows):
        return attention_by_row(module, cache, layer_index, query, key, value, attention_mask, scaling, dropout, kwargs)
    store = cache.layers[layer_index]
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    route = store.decode_route
    if not static_step.in_static_step() and route is not None and cache.attention_modules[layer_index]() is module:
        cache.unattended_update = None
        return route(module, cache, store, layer_index, query, key, value, attention_mask, scaling, dropout, kwargs)
    cache.check_attention_module(layer_index, module)
    result = attend(module, cache, store, layer_index, query, key, value, attention_mask, scaling, dropout, kwargs)
    if not static_step.in_static_step() and query.shape[2] == 1 and not store.in_prefill and store.decode_route is None:
        store.decode_route = choose_route(cache, store, layer_index, query, attend)
    return result


def attend(module, cache, store, layer_index, query, key, value, attention_mask, scaling, dropout, kwargs):
    """The general attention over a layer, by phase and layout (module docstring)."""
    mask = attention_mask_for(cache, store, attention_mask, query, layer_index)
    compressed = layer_index in cache.compressor.compressed
    # A chunk of a chunked prefill on CPU trims the heap around its attention (module docstring).
    chunk_on_cpu = query.shape[2] > 1 and query.device.type == "cpu" and cache.takes_prompt_chunks
    if chunk_on_cpu:
        mark_prompt_chunk_on_cpu(cache)
        trim_heap()
    if store.codec is not None and not store.in_prefill:  # quantized storage (kv_bits)
        return decode_quantized(module, cache, layer_index, query, mask, scaling, dropout, compressed, kwargs)
    if not (store.in_prefill or store.is_uniform):
        return decode_packed(cache, layer_index, query, mask, scaling, compressed)
    with sdpa_kernel(SDPA_BACKENDS) if query.is_cuda else ANY_BACKEND:  # sdpa_backends, inline: every step
        if store.in_prefill:
            result = prefill(module, cache, layer_index, query, key, value, mask, scaling, dropout, compressed, kwargs)
        else:
            result = decode_dense(module, cache, layer_index, query, mask, scaling, dropout, compressed, kwargs)
    if chunk_on_cpu:
        trim_heap()
    return result


def attention_by_row(module, rows: CacheRows, layer_index, query, key, value, attention_mask, scaling, dropout, kwargs):
    """Row ``i`` of the batch through its own cache: the cache stores the row's new tokens and its
    method runs as if the row were alone. The projections before and after attention (the cost of
    a small model's decode step) ran once for all rows."""
    outputs = []
    for row, cache in enumerate(rows.caches):
        row_kwargs = dict(kwargs)
        row_keys, row_values = cache.update(key[row : row + 1], value[row : row + 1], layer_index, kwargs=row_kwargs)
        # Every row sees the same positions (CacheRows checks it), so a mask shared by the batch
        # (first dimension 1) serves each row as it is.
        row_mask = attention_mask
        if attention_mask is not None and attention_mask.shape[0] > 1:
            row_mask = attention_mask[row : row + 1]
        output, _ = kvhive_attention(
            module, query[row : row + 1], row_keys, row_values, row_mask, scaling=scaling, dropout=dropout, **row_kwargs
        )
        outputs.append(output)
    return torch.cat(outputs, dim=0), None


# The names this module held before the attention was split by phase, for the modules and tests that
# import them from here.
_backends = sdpa_backends
_attention_by_row = attention_by_row
_attention_with_column_sums = prompt_attention_with_column_sums
_attention_with_key_probes = attention_with_key_probes
_decode_dense = decode_dense
_decode_packed_static = decode_packed_static
_decode_variable_length = decode_variable_length
_dense_decode_by_kernel = dense_decode_by_kernel
_prefill = prefill
_sdpa_in_query_blocks = sdpa_in_query_blocks
