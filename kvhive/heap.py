"""Handing freed memory back to the operating system between phases.

The chunked prefill and the per-phase memory measure both need the memory a finished step freed to
leave the process: glibc keeps freed blocks below its mmap threshold resident in its arenas, so
they would count as held by whatever runs next. This module depends on nothing else in kvhive, so
the attention and the measuring modules can both use it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import sys

import torch


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library, loaded once."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def trim_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc ``malloc_trim``; nothing elsewhere).

    glibc serves blocks below its mmap threshold (which rises, up to glibc's cap, to the largest block
    freed) from its heap and keeps them resident once freed: a prompt chunk's temporaries (its
    queries, keys and values, the attention's logits) would stay resident into the next step and
    stack up on top of what it holds live. Cheap (it walks the free lists), no garbage collection."""
    if not sys.platform.startswith("linux"):
        return
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:  # glibc; musl has no arenas to trim
        trim(0)


def release_free_memory(device: torch.device | str | None = None) -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc ``malloc_trim``), so the
    memory a finished phase freed does not count as resident in the next one. On CUDA: wait for
    the device instead (its allocator's memory is measured by the allocator itself)."""
    gc.collect()
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        return
    trim_heap()
