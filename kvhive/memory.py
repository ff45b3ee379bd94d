"""Peak memory per phase, memory sizes, and which errors mean "out of memory".

Two measures, one per device kind:

* CUDA: ``torch.cuda.max_memory_allocated``, reset at the start of each phase; a phase's peak
  counts everything allocated on the device (weights included), its baseline is what was
  allocated when the phase began.
* CPU: the process's resident high-water mark (``VmHWM`` in ``/proc/self/status``), reset at the
  start of each phase by writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0). tracemalloc
  does not see torch's allocations, and ``ru_maxrss`` cannot be reset, so it is this or nothing:
  where the kernel refuses the reset, :class:`PhaseMemory` says why and reports no phase peaks.
  Freed memory the C allocator keeps (glibc's arenas) would count as resident in the next phase,
  so each phase starts after ``gc.collect()`` and ``malloc_trim(0)`` (``kvhive.heap``).

The search for the largest run that fits a limit (``kvhive bench --search``) is
``kvhive.capacity``; its names stay readable here (``search_largest``, ``TrialOutcome``, ...).
"""

from __future__ import annotations

import importlib
import math
import os
import re
from typing import Any

import torch

from kvhive.heap import release_free_memory, trim_heap

__all__ = [
    "PhaseMemory",
    "format_bytes",
    "is_out_of_memory",
    "out_of_memory_reason",
    "parse_memory_size",
    "process_status",
    "release_free_memory",
    "trim_heap",
]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_memory_size(text: str | int | float, flag: str = "--memory-limit") -> int:
    """A size with a unit in bytes (``<n>GB`` is n·10⁹ bytes, ``<n>MiB`` n·2²⁰); a bare number is
    bytes. Units: B, KB, MB, GB, TB (powers of 1000) and KiB, MiB, GiB, TiB (powers of 1024), any case. A size <= 0, a
    size under one byte, or another unit is refused with a ``ValueError`` naming ``flag``."""
    accepted = "a positive size such as 8GB, 512MiB or 2000000000 (bytes); units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
    if isinstance(text, bool):
        raise ValueError(f"invalid {flag} {text!r}: expected {accepted}")
    match = _SIZE.match(str(text))
    if match is None:
        if re.match(r"^\s*-", str(text)):
            raise ValueError(f"invalid {flag} {text!r}: must be > 0; expected {accepted}")
        raise ValueError(f"invalid {flag} {text!r}: expected {accepted}")
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit not in _UNITS:
        raise ValueError(f"invalid {flag} {text!r}: unknown unit {match.group(2)!r}; expected {accepted}")
    size = number * _UNITS[unit]
    if not math.isfinite(size) or size < 1:
        raise ValueError(f"invalid {flag} {text!r}: must be > 0 (at least one byte); expected {accepted}")
    return int(size)


def format_bytes(size: int | None) -> str:
    """``size`` in the largest of GB, MB, KB it reaches, three significant digits, or in bytes (powers
    of 1000, as sizes are usually quoted for memory limits); ``"n/a"`` for None."""
    if size is None:
        return "n/a"
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if abs(size) >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size} B"


def process_status() -> dict[str, int]:
    """``VmHWM``, ``VmRSS``, ``VmSize`` of this process in bytes (``/proc/self/status`` says kB)."""
    values = {}
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            name, _, rest = line.partition(":")
            if name in ("VmHWM", "VmRSS", "VmSize"):
                values[name] = int(rest.split()[0]) * 1024
    return values


_CPUS = os.cpu_count() or 1
# The largest error of the kernel's approximate RSS read: three counters (file, anon, shmem), each
# off by up to its per-CPU batch, max(32, 2 x CPUs) pages, on every CPU.
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096  # (only Linux reads VmHWM)
_RSS_COUNTER_SLACK = max(2**16, 3 * max(32, 2 * _CPUS) * _CPUS * _PAGE)


def _reset_high_water_mark() -> str | None:
    """Reset this process's ``VmHWM`` to its current RSS; the reason it could not, else None."""
    tries = 5
    for _ in range(tries):
        before = process_status()
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as clear_refs:
                clear_refs.write("5")
        except OSError as error:
            return f"the kernel refused the reset of the resident high-water mark (/proc/self/clear_refs: {error})"
        after = process_status()
        # The kernel sets VmHWM to the RSS at the reset, which lies between the RSS read before it
        # and the one read after it unless memory was allocated and freed in between; well above
        # both means it did not reset (or that happened: tried again). "Well": the reset reads the
        # RSS counters approximately (per-CPU counters, up to a batch of pages per CPU each for the
        # file, anon and shmem counts) where /proc/self/status sums them exactly, so a good reset
        # can land that far above: the slack allows for it (a smaller one refused good resets on a
        # 2-core machine with two test workers). A kernel that does not reset leaves the process's
        # earlier peak, far above.
        if after["VmHWM"] <= max(before["VmRSS"], after["VmRSS"]) + _RSS_COUNTER_SLACK:
            return None
    return f"writing 5 to /proc/self/clear_refs did not reset VmHWM on this kernel ({tries} tries)"


class PhaseMemory:
    """Peak memory of successive phases on one device (see the module docstring for the measure).

    ``start()`` releases freed memory and resets the peak; ``peak()`` is the highest memory since
    the last ``start()`` (bytes); ``current()`` what is held now. Where no per-phase peak can be
    measured, ``unavailable`` says why and ``peak()`` returns None.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.unavailable: str | None = None
        if self.device.type == "cuda":
            self.measure = "torch.cuda.max_memory_allocated (reset at the start of each phase)"
        elif self.device.type == "cpu":
            self.measure = "process resident high-water mark, VmHWM (reset at the start of each phase)"
            if not os.path.exists("/proc/self/status"):
                self.unavailable = "no /proc/self/status on this system: the resident high-water mark cannot be read"
            else:
                self.unavailable = _reset_high_water_mark()
        else:
            self.measure = "none"
            self.unavailable = f"no peak-memory measure for device type {self.device.type!r}"

    def current(self) -> int | None:
        if self.unavailable is not None:
            return None
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return process_status()["VmRSS"]

    def start(self) -> int | None:
        """Begin a phase: release freed memory, reset the peak; returns the memory held now."""
        release_free_memory(self.device)
        if self.unavailable is not None:
            return None
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            reason = _reset_high_water_mark()
            if reason is not None:
                self.unavailable = reason
                return None
        return self.current()

    def peak(self) -> int | None:
        if self.unavailable is not None:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        return process_status()["VmHWM"]


_OUT_OF_MEMORY = re.compile(r"out of memory|can't allocate memory|bad_alloc|cannot allocate memory", re.IGNORECASE)


def is_out_of_memory(error: BaseException) -> bool:
    """True for the errors an allocation that does not fit raises: ``torch.OutOfMemoryError`` (CUDA),
    ``MemoryError``, and the CPU allocator's ``RuntimeError`` (``can't allocate memory``)."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and bool(_OUT_OF_MEMORY.search(str(error)))


def out_of_memory_reason(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"out of memory: {lines[0][:200] if lines else type(error).__name__}"


# The capacity search's names, read here before they moved to kvhive.capacity. Resolved on first
# use, so this module imports nothing above it (kvhive.capacity runs the benchmark, which measures
# with this module).
_MOVED_TO_CAPACITY = frozenset({"SearchResult", "TrialOutcome", "search_largest", "trial_in_subprocess"})


def __getattr__(name: str) -> Any:
    if name in _MOVED_TO_CAPACITY:
        return getattr(importlib.import_module("kvhive.capacity"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
