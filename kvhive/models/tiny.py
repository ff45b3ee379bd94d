"""Tiny random-initialised models of every supported architecture, with a byte-level tokenizer.

Built entirely offline, in well under a second, so tests, the CLI (``--model tiny-llama-gqa``),
the evaluation harness and the cross-checks run without downloading anything. ``load_model``
accepts their names (``TINY_MODEL_NAMES``).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

__all__ = [
    "TINY_ARCHITECTURES",
    "TINY_ATTENTION_KINDS",
    "TINY_MODEL_NAMES",
    "TINY_VOCAB_SIZE",
    "build_random_model",
    "parse_tiny_model_name",
    "tiny_model",
    "tiny_model_config",
    "tiny_tokenizer",
]

TINY_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma3")
"""Architectures that ``tiny_model`` can build."""

TINY_ATTENTION_KINDS = ("mha", "gqa")
"""``"mha"``: as many KV heads as query heads; ``"gqa"``: 4 query heads share 2 KV heads."""

TINY_MODEL_NAMES = tuple(
    f"tiny-{architecture}-{attention}" for architecture in TINY_ARCHITECTURES for attention in TINY_ATTENTION_KINDS
)
"""Names ``load_model`` accepts for tiny models, e.g. ``"tiny-llama-gqa"``."""

# Byte-level vocabulary: ids 0..255 are the raw bytes (so a token id *is* the byte value, which
# makes test failures easy to read), followed by the special tokens.
_TINY_PAD, _TINY_BOS, _TINY_EOS = "<pad>", "<bos>", "<eos>"
_TINY_SPECIAL_TOKENS = (_TINY_PAD, _TINY_BOS, _TINY_EOS)
TINY_VOCAB_SIZE = 256 + len(_TINY_SPECIAL_TOKENS)
_TINY_PAD_ID, _TINY_BOS_ID, _TINY_EOS_ID = 256, 257, 258

# Shared shape of every tiny model: hidden 64, 4 query heads of dim 16.
_TINY_HIDDEN_SIZE = 64
_TINY_QUERY_HEADS = 4
_TINY_GQA_KV_HEADS = 2
_TINY_HEAD_DIM = 16
_TINY_INTERMEDIATE_SIZE = 128
_TINY_NUM_LAYERS = 2
# Gemma3 needs at least one layer of each type; real Gemma 3 alternates 5 sliding : 1 full,
# the tiny one 3 : 1, with a window small enough that short test prompts overflow it.
_TINY_GEMMA3_LAYER_TYPES = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]
_TINY_GEMMA3_SLIDING_WINDOW = 8
_TINY_MAX_POSITIONS = 4096


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer for the tiny models, built offline with the ``tokenizers`` library.

    Vocabulary: ids 0..255 are the UTF-8 bytes, then ``<pad>`` (256), ``<bos>`` (257) and
    ``<eos>`` (258); ``TINY_VOCAB_SIZE`` (259) in all. There are no merges, so every byte is one
    token and ``decode(encode(text)) == text`` for any text. No special tokens are added when
    encoding (that is what keeps the round trip exact). ``padding_side`` is ``"left"``, as
    batched generation with a decoder-only model needs.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # ByteLevel maps each byte to a printable unicode character; the vocabulary is those 256
    # characters in byte order so that id == byte value.
    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = _gpt2_bytes_to_unicode()
    assert sorted(byte_alphabet) == sorted(byte_to_char.values())
    vocab = {byte_to_char[byte]: byte for byte in range(256)}
    for offset, token in enumerate(_TINY_SPECIAL_TOKENS):
        vocab[token] = 256 + offset

    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # use_regex=False: no word splitting is needed without merges, and add_prefix_space=False
    # keeps the round trip exact (no space is invented at the start).
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(_TINY_SPECIAL_TOKENS))

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=_TINY_PAD,
        bos_token=_TINY_BOS,
        eos_token=_TINY_EOS,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=_TINY_MAX_POSITIONS,
    )
    return tokenizer


def _gpt2_bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte -> printable character table that ``ByteLevel`` pre-tokenizers use."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    characters = printable[:]
    next_code_point = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            characters.append(256 + next_code_point)
            next_code_point += 1
    return {byte: chr(code_point) for byte, code_point in zip(printable, characters, strict=True)}


_TINY_CONFIG_AND_MODEL_CLASSES: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
}


def _check_choice(parameter: str, value: Any, accepted: tuple[str, ...]) -> None:
    if value not in accepted:
        raise ValueError(f"{parameter}={value!r} is not supported; accepted values: {', '.join(map(repr, accepted))}")


def tiny_model_config(architecture: str, attention: str = "gqa", **overrides: Any) -> PretrainedConfig:
    """Config of the tiny model ``tiny_model`` builds (see there for the shapes).

    ``overrides`` are config attributes (e.g. ``num_hidden_layers=3``, ``sliding_window=4``)
    applied on top of the tiny defaults.
    """
    _check_choice("architecture", architecture, TINY_ARCHITECTURES)
    _check_choice("attention", attention, TINY_ATTENTION_KINDS)
    config_class, _ = _TINY_CONFIG_AND_MODEL_CLASSES[architecture]

    num_key_value_heads = _TINY_QUERY_HEADS if attention == "mha" else _TINY_GQA_KV_HEADS
    settings: dict[str, Any] = {
        "vocab_size": TINY_VOCAB_SIZE,
        "hidden_size": _TINY_HIDDEN_SIZE,
        "intermediate_size": _TINY_INTERMEDIATE_SIZE,
        "num_hidden_layers": _TINY_NUM_LAYERS,
        "num_attention_heads": _TINY_QUERY_HEADS,
        "num_key_value_heads": num_key_value_heads,
        "max_position_embeddings": _TINY_MAX_POSITIONS,
        "pad_token_id": _TINY_PAD_ID,
        "bos_token_id": _TINY_BOS_ID,
        "eos_token_id": _TINY_EOS_ID,
        "tie_word_embeddings": True,
    }
    # Qwen2's config has no head_dim argument (it is always hidden / heads = 16 here).
    if architecture != "qwen2":
        settings["head_dim"] = _TINY_HEAD_DIM
    if architecture == "mistral":
        # Mistral slides over every layer when sliding_window is set; None makes the tiny one a
        # plain full-attention model (gemma3 is the tiny model that exercises sliding windows).
        settings["sliding_window"] = None
    if architecture == "gemma3":
        settings.update(
            num_hidden_layers=len(_TINY_GEMMA3_LAYER_TYPES),
            layer_types=list(_TINY_GEMMA3_LAYER_TYPES),
            sliding_window=_TINY_GEMMA3_SLIDING_WINDOW,
            # Gemma scales logits by query_pre_attn_scalar ** -0.5; the real models use head_dim.
            query_pre_attn_scalar=_TINY_HEAD_DIM,
        )
        if "num_hidden_layers" in overrides and "layer_types" not in overrides:
            # Keep the 3 sliding : 1 full pattern for another depth rather than failing on a
            # layer_types list of the wrong length.
            num_layers = overrides["num_hidden_layers"]
            settings["layer_types"] = [
                "full_attention" if (index + 1) % 4 == 0 else "sliding_attention" for index in range(num_layers)
            ]
    settings.update(overrides)
    return config_class(**settings)


def tiny_model(
    architecture: str,
    attention: str = "gqa",
    seed: int = 0,
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    **overrides: Any,
) -> PreTrainedModel:
    """A small random-initialised causal LM for tests, in eval mode.

    Shapes (all architectures): vocabulary ``TINY_VOCAB_SIZE`` = 259 (matches
    ``tiny_tokenizer()``), hidden 64, intermediate 128, 4 query heads of dim 16,
    ``max_position_embeddings`` 4096, tied embeddings.

    * ``attention="mha"``: 4 KV heads (one per query head); ``"gqa"``: 2 KV heads (group size 2).
    * llama, qwen2, qwen3, mistral: 2 layers, all full attention (mistral's
      ``sliding_window`` is ``None``, so it behaves exactly like a full-attention model).
    * gemma3 (``Gemma3ForCausalLM`` / ``Gemma3TextConfig``): 4 layers, ``layer_types`` =
      sliding, sliding, sliding, full, with ``sliding_window=8`` so that short test prompts
      already overflow the window.

    The weights depend only on ``seed`` (the global torch RNG is left untouched).
    ``overrides`` are config attributes applied on top of these defaults.
    """
    config = tiny_model_config(architecture, attention, **overrides)
    _, model_class = _TINY_CONFIG_AND_MODEL_CLASSES[architecture]
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    return build_random_model(model_class, config, seed=seed, dtype=dtype)


def build_random_model(
    model_class: type[PreTrainedModel], config: PretrainedConfig, *, seed: int, dtype: torch.dtype
) -> PreTrainedModel:
    """``model_class(config)`` with weights that depend only on ``seed``, cast to ``dtype``, in eval mode."""
    # fork_rng: seeding must make the weights reproducible without changing the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    return model.to(dtype=dtype).eval()


def parse_tiny_model_name(name: str) -> tuple[str, str] | None:
    """``"tiny-llama-gqa"`` -> ``("llama", "gqa")``; ``None`` for anything else."""
    if name not in TINY_MODEL_NAMES:
        return None
    _, architecture, attention = name.split("-")
    return architecture, attention
