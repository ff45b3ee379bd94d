"""Models: embedded real models, tiny test models, benchmark shapes and ``model_summary``.

One module per job:

* :mod:`~kvhive.models.embedded` — the real models shipped as optional extras
  (``gemma-3-270m``, the default, and ``qwen2.5-0.5b``), ``DEFAULT_MODEL``, GGUF assembly.
* :mod:`~kvhive.models.loading` — ``load_model`` (embedded, tiny, local, cached hub ids) and the
  once-only GGUF -> fp32 conversion cache.
* :mod:`~kvhive.models.tiny` — tiny random models of every supported architecture and their
  byte-level tokenizer (tests, CLI smoke runs, cross-checks).
* :mod:`~kvhive.models.shapes` — random-weight benchmark shapes (``kv_heavy_model``,
  ``llama3_8b_shape_config``).
* :mod:`~kvhive.models.summary` — ``model_summary``.

Everything listed in ``__all__`` is importable from ``kvhive.models`` directly.
"""

from __future__ import annotations

from .embedded import (
    DEFAULT_MODEL,
    EMBEDDED_MODELS,
    EmbeddedModel,
    GGUFIntegrityError,
    MissingModelExtraError,
    assemble_gguf,
    embedded_model,
)
from .loading import converted_model_directory, kvhive_cache_dir, load_gguf, load_model
from .shapes import kv_heavy_model, kv_heavy_model_config, llama3_8b_shape_config
from .summary import model_summary
from .tiny import (
    TINY_ARCHITECTURES,
    TINY_ATTENTION_KINDS,
    TINY_MODEL_NAMES,
    TINY_VOCAB_SIZE,
    tiny_model,
    tiny_model_config,
    tiny_tokenizer,
)

__all__ = [
    "DEFAULT_MODEL",
    "EMBEDDED_MODELS",
    "TINY_ARCHITECTURES",
    "TINY_ATTENTION_KINDS",
    "TINY_MODEL_NAMES",
    "TINY_VOCAB_SIZE",
    "EmbeddedModel",
    "GGUFIntegrityError",
    "MissingModelExtraError",
    "assemble_gguf",
    "converted_model_directory",
    "embedded_model",
    "kv_heavy_model",
    "kv_heavy_model_config",
    "kvhive_cache_dir",
    "llama3_8b_shape_config",
    "load_gguf",
    "load_model",
    "model_summary",
    "tiny_model",
    "tiny_model_config",
    "tiny_tokenizer",
]
