"""Refusals of a cache used by a model it was not made for, or continued by inputs it cannot serve.

A :class:`~kvhive.cache.kv_cache.KVHiveCache` is built from one model's shape (:func:`model_shape`)
and filled by that model's attention modules. These checks name the mismatch (another model, another
batch size, a prompt that does not extend what the cache holds) instead of letting it surface as an
obscure shape error or, worse, as a silently wrong answer. ``KVHiveCache`` binds the checks as its
methods (``check_model``, ``check_attention_module``, ``check_generation_inputs``): the ones that run
at every decode step then cost no extra call.

:func:`check_model` compares a model's shape with the cache's: its layers' kinds and windows, heads
and head dimension are what the cache's layers, budgets and accounting were built from, so an empty
cache refuses another model too. It runs before each forward of a model kvhive attached to, and when
kvhive's attention first sees a layer's module; a config already matched is not compared again.
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache, get_layer_types_and_kwargs


def model_shape(config) -> dict:
    """What a cache depends on in the model it is made for (host-side ints, read from the config):
    the layer count, each layer's kind (its sliding window, or None for full attention), query
    heads, KV heads and head dimension. A cache refuses a model whose shape differs."""
    text_config = config.get_text_config(decoder=True)
    layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
    query_heads = text_config.num_attention_heads
    return {
        "layers": len(layer_types),
        "sliding windows": tuple(
            kwargs.get("sliding_window") if "sliding" in layer_type else None
            for layer_type, kwargs in zip(layer_types, layer_kwargs, strict=True)
        ),
        "query heads": query_heads,
        "KV heads": getattr(text_config, "num_key_value_heads", None) or query_heads,
        "head dimension": getattr(text_config, "head_dim", None) or text_config.hidden_size // query_heads,
    }


def describe_windows(windows: tuple) -> str:
    """``(8, 8, 8, None)`` -> ``"3 sliding (window 8), 1 full"``, in order of first appearance."""
    counts: dict = {}
    for window in windows:
        counts[window] = counts.get(window, 0) + 1
    return ", ".join(f"{n} full" if w is None else f"{n} sliding (window {w})" for w, n in counts.items())


def refuse_encoder_decoder(config) -> None:
    """kvhive's caches serve decoder-only models: an encoder-decoder model (T5, BART) holds a
    cross-attention cache beside the self-attention one, which no method here compresses."""
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"encoder-decoder models are not supported (this is a {type(config).__name__}): kvhive compresses "
            "the KV cache of decoder-only causal LMs (Llama, Qwen, Mistral, Gemma, ...)"
        )


def check_reuse(cache: Cache, key_states: torch.Tensor, layer_idx: int) -> None:
    """Refuse new tokens that cannot continue what the cache holds (another batch size, another
    model's shapes) with a message naming the mismatch, instead of an obscure shape error."""
    if layer_idx >= len(cache.layers):
        raise ValueError(
            f"this cache was made for a model with {len(cache.layers)} layers; layer {layer_idx} "
            "does not exist in it: another model is using it (make a cache per model)"
        )
    store = cache.layers[layer_idx]
    if not store.is_initialized:
        return
    if key_states.shape[0] != store.batch_size:
        raise ValueError(
            f"this cache holds a batch of {store.batch_size} row(s); the new input has "
            f"{key_states.shape[0]}: make a new cache for another batch size"
        )
    heads = store.num_heads // store.heads_per_kv_head
    buffers = store.layout.buffers
    head_dim = buffers.keys.shape[-1] if buffers is not None else key_states.shape[3]
    if store.codec is not None and buffers is not None:  # byte rows: the head size is the codec's
        head_dim = store.codec.key_dim
    if key_states.shape[1] != heads or key_states.shape[3] != head_dim:
        raise ValueError(
            f"this cache holds {heads} KV heads of dimension {head_dim} in layer {layer_idx}; "
            f"the new input has {key_states.shape[1]} of {key_states.shape[3]}: another model is using "
            "it (make a cache per model)"
        )


def check_model(cache: Cache, config) -> None:
    """Refuse a model other than the one this cache was made for, empty or filled (module docstring)."""
    if cache.matching_config is not None and cache.matching_config() is config:
        return
    actual = model_shape(config)
    if actual != cache.model_shape:
        expected = cache.model_shape
        differences = [
            f"{name}: {describe_windows(expected[name])} here, {describe_windows(actual[name])} in that model"
            if name == "sliding windows"
            else f"{name}: {expected[name]} here, {actual[name]} in that model"
            for name in expected
            if expected[name] != actual[name]
        ]
        raise ValueError(
            "this cache was made for another model (" + "; ".join(differences) + "): make a cache per model "
            "with kvhive.make_cache(model, ...)"
        )
    cache.matching_config = weakref.ref(config)


def check_attention_module(cache: Cache, layer_index: int, module) -> None:
    """Called by kvhive's attention for the layer just updated. Refuses a cache filled by one
    model's attention layers being continued by another's (shapes may agree, so the modules
    themselves are compared)."""
    cache.unattended_update = None
    known = cache.attention_modules.get(layer_index)
    if known is None:
        first_attention_module(cache, layer_index, module)
    elif known() is not module:
        raise ValueError(
            f"this cache was filled by another model (layer {layer_index} belongs to a different "
            "module): make a cache per model"
        )


def first_attention_module(cache: Cache, layer_index: int, module) -> None:
    """:func:`check_attention_module` the first time it sees the layer's module: the module's model
    must be the cache's; the module is then the one the layer is continued by."""
    config = getattr(module, "config", None)
    if config is not None:
        try:
            check_model(cache, config)
        except ValueError:
            # The layer held nothing before this update (its module is seen for the first
            # time): drop the other model's tokens, so nothing counts them.
            cache.layers[layer_index].reset()
            raise
    cache.attention_modules[layer_index] = weakref.ref(module)


def check_generation_inputs(
    cache: Cache, input_ids: torch.Tensor | None, first_step: bool, new_tokens: int | None
) -> None:
    """Called by ``generate`` (through ``kvhive.attention``) before each step with the sequence
    it was given and how many of its tokens are new (None: only new tokens were passed, with
    the full attention mask). A reused cache must be continued by a sequence that starts with
    the tokens it holds; otherwise transformers would silently treat them as its prefix."""
    if input_ids is None or input_ids.dim() != 2:
        return
    store = cache.layers[0]
    seen = store.tokens_seen if store.is_initialized else 0
    if first_step and seen:
        if input_ids.shape[0] != store.batch_size:
            raise ValueError(
                f"this cache holds a batch of {store.batch_size} row(s); the new prompt has "
                f"{input_ids.shape[0]}: make a new cache for another batch size"
            )
        if new_tokens is not None and new_tokens < 1:
            raise ValueError(
                f"the prompt of {input_ids.shape[1]} tokens does not extend the {seen} tokens this "
                "cache holds: pass the previous tokens followed by the new ones, or make a new cache"
            )
        recorded = cache.generated_ids
        if new_tokens is not None and recorded is not None and recorded.shape == (input_ids.shape[0], seen):
            if not torch.equal(recorded.to(input_ids.device), input_ids[:, :seen]):
                raise ValueError(
                    f"the prompt does not start with the {seen} tokens this cache holds: it would be "
                    "answered as if they were its beginning; make a new cache for an unrelated prompt"
                )
    # A reference, not a copy: generate appends to a new tensor, it never edits in place.
    cache.generated_ids = input_ids if new_tokens is not None or not seen else None
