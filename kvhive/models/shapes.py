"""Random-weight benchmark shapes whose KV cache (not the weights or the output layer) dominates memory."""

from __future__ import annotations

from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from .tiny import build_random_model

__all__ = ["kv_heavy_model", "kv_heavy_model_config", "llama3_8b_shape_config"]


def kv_heavy_model_config(num_layers: int = 4, **overrides: Any) -> LlamaConfig:
    """Config of ``kv_heavy_model`` (see there)."""
    settings: dict[str, Any] = {
        "vocab_size": 1024,
        "hidden_size": 1024,
        "intermediate_size": 1024,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    settings.update(overrides)
    return LlamaConfig(**settings)


def kv_heavy_model(
    num_layers: int = 4,
    seed: int = 0,
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    **overrides: Any,
) -> LlamaForCausalLM:
    """Random-weight Llama for CPU memory/speed benchmarks whose KV cache dominates memory.

    Shape: hidden 1024, 16 query heads and 8 KV heads of dim 128 (GQA group size 2, like
    Llama 3), intermediate 1024, vocabulary 1024, ``max_position_embeddings`` 32768, tied
    embeddings, ``num_layers`` layers (default 4).

    Memory: ~9.4 M parameters per layer plus 1 M for the embedding (38.8 M at 4 layers). The KV
    cache holds ``2 * 8 * 128 = 2048`` values per token per layer (``4 * 2048`` bytes in fp32),
    while the output layer's logits are only 1024 values per token — so compression savings show up
    directly in peak memory. Weights depend only on ``seed``; ``overrides`` are config
    attributes.
    """
    config = kv_heavy_model_config(num_layers, **overrides)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    return build_random_model(LlamaForCausalLM, config, seed=seed, dtype=dtype)


def llama3_8b_shape_config(num_layers: int = 32, **overrides: Any) -> LlamaConfig:
    """``LlamaConfig`` with Llama-3-8B dimensions, for GPU benchmarks with random weights.

    hidden 4096, 32 query heads and 8 KV heads of dim 128, intermediate 14336, vocabulary
    128256, RoPE theta 500000, ``max_position_embeddings`` 131072, untied embeddings,
    ``num_layers`` layers (32 in the real model; fewer to fit a smaller device). Building the
    model (device, dtype, meta init) is the caller's business.
    """
    settings: dict[str, Any] = {
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 131072,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    }
    settings.update(overrides)
    return LlamaConfig(**settings)
