"""The attention-relevant shape of a model, read from its config."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig, PreTrainedModel

__all__ = ["model_summary"]


def model_summary(model: PreTrainedModel | PretrainedConfig) -> dict[str, Any]:
    """Attention-relevant shape of a model (or config), read from its text config.

    Returns ``num_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
    ``layer_types`` (one of ``"full_attention"`` / ``"sliding_attention"`` per layer),
    ``sliding_window`` (the window of the sliding layers, ``None`` when no layer slides) and
    ``max_position_embeddings``.
    """
    config = model if isinstance(model, PretrainedConfig) else model.config
    text_config = config.get_text_config()

    num_layers = int(text_config.num_hidden_layers)
    num_attention_heads = int(text_config.num_attention_heads)
    num_key_value_heads = getattr(text_config, "num_key_value_heads", None) or num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // num_attention_heads
    sliding_window = getattr(text_config, "sliding_window", None)

    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is None:
        # Configs without layer_types (Llama, Mistral) slide on every layer iff sliding_window
        # is set; Qwen-style configs also gate it behind use_sliding_window.
        slides = sliding_window is not None and getattr(text_config, "use_sliding_window", True)
        layer_types = ["sliding_attention" if slides else "full_attention"] * num_layers
    layer_types = [str(layer_type) for layer_type in layer_types]
    if "sliding_attention" not in layer_types:
        sliding_window = None

    return {
        "num_layers": num_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": int(num_key_value_heads),
        "head_dim": int(head_dim),
        "layer_types": layer_types,
        "sliding_window": None if sliding_window is None else int(sliding_window),
        "max_position_embeddings": getattr(text_config, "max_position_embeddings", None),
    }
