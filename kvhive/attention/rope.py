"""Re-rotating cached keys to new RoPE positions (``positions="cache"``, StreamingLLM-style).

Keys are cached after RoPE. Moving a key from position ``p`` to ``p + delta`` is one more
rotation by ``delta`` (rotations compose), so kept keys can be re-indexed to contiguous
positions and a stream can run past the model's trained length. Reads the inverse frequencies
from the model's rotary embedding module; assumes the ``rotate_half`` RoPE layout used by
Llama, Qwen, Mistral and Gemma.
"""

from __future__ import annotations

import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-second, first), dim=-1)


class KeyRotator:
    """Rotates a layer's cached keys by per-token position offsets."""

    def __init__(self, model) -> None:
        text_config = model.config.get_text_config(decoder=True)
        layer_types = getattr(text_config, "layer_types", None) or ["full_attention"] * text_config.num_hidden_layers
        rotary = next((m for name, m in model.named_modules() if name.endswith("rotary_emb")), None)
        if rotary is None:
            raise ValueError(
                "positions='cache' needs a model with rotary position embeddings (no rotary_emb module found)"
            )
        self.inverse_frequencies = []
        for layer_type in layer_types:
            frequencies = getattr(rotary, f"{layer_type}_inv_freq", None)
            if frequencies is None:
                frequencies = getattr(rotary, "inv_freq", None)
            if frequencies is None:
                raise ValueError(f"positions='cache': no inverse frequencies for layer type {layer_type!r}")
            self.inverse_frequencies.append(frequencies.detach().float())

    def rotate(self, layer_index: int, keys: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``keys[..., L, d]`` moved by ``delta[..., L]`` positions."""
        frequencies = self.inverse_frequencies[layer_index].to(keys.device)
        rotary_dim = 2 * frequencies.numel()
        angles = delta.to(torch.float32)[..., None] * frequencies
        cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(keys.dtype)
        sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(keys.dtype)
        rotated = keys[..., :rotary_dim] * cos + _rotate_half(keys[..., :rotary_dim]) * sin
        if rotary_dim == keys.shape[-1]:
            return rotated
        return torch.cat([rotated, keys[..., rotary_dim:]], dim=-1)
