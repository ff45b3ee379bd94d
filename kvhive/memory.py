"""Peak memory per phase, memory sizes, and the search for the largest run that fits a limit.

Two measures, one per device kind:

* CUDA: ``torch.cuda.max_memory_allocated``, reset at the start of each phase; a phase's peak
  counts everything allocated on the device (weights included), its baseline is what was
  allocated when the phase began.
* CPU: the process's resident high-water mark (``VmHWM`` in ``/proc/self/status``), reset at the
  start of each phase by writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0). tracemalloc
  does not see torch's allocations, and ``ru_maxrss`` cannot be reset, so it is this or nothing:
  where the kernel refuses the reset, :class:`PhaseMemory` says why and reports no phase peaks.
  Freed memory the C allocator keeps (glibc's arenas) would count as resident in the next phase,
  so each phase starts after ``gc.collect()`` and ``malloc_trim(0)``.

``search_largest`` is the bisection of ``kvhive bench --search``: it gallops from a start value
(doubling while trials fit, halving while they do not) and bisects the gap; a trial that runs out
of memory is a "does not fit", not a crash. ``trial_in_subprocess`` runs one trial in a fresh
Python process (``python -m kvhive.memory``), so allocator state left by one trial never reaches the
next and the process's own high-water mark is the trial's peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import math
import os
import re
import resource
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

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
    """``"8GB"`` → 8·10⁹ bytes, ``"512MiB"`` → 512·2²⁰; a bare number is bytes. Units: B, KB, MB,
    GB, TB (powers of 1000) and KiB, MiB, GiB, TiB (powers of 1024), any case. A size <= 0, a
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
    """``1.23 GB`` (powers of 1000, as sizes are usually quoted for memory limits)."""
    if size is None:
        return "n/a"
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if abs(size) >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size} B"


def _process_status() -> dict[str, int]:
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
        before = _process_status()
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as clear_refs:
                clear_refs.write("5")
        except OSError as error:
            return f"the kernel refused the reset of the resident high-water mark (/proc/self/clear_refs: {error})"
        after = _process_status()
        # The kernel sets VmHWM to the RSS at the reset, which lies between the RSS read before it
        # and the one read after it unless memory was allocated and freed in between; well above
        # both means it did not reset (or that happened: tried again). "Well": the reset reads the
        # RSS counters approximately (per-CPU counters, up to a batch of pages per CPU each for the
        # file, anon and shmem counts) where /proc/self/status sums them exactly, so a good reset
        # can land that far above; a 64 KiB slack refused good resets in two CI runs on this
        # 2-core machine with two test workers. A kernel that does not reset leaves the process's
        # earlier peak, far above.
        if after["VmHWM"] <= max(before["VmRSS"], after["VmRSS"]) + _RSS_COUNTER_SLACK:
            return None
    return f"writing 5 to /proc/self/clear_refs did not reset VmHWM on this kernel ({tries} tries)"


_LIBC = None


def release_free_memory(device: torch.device | str | None = None) -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc ``malloc_trim``), so the
    memory a finished phase freed does not count as resident in the next one."""
    gc.collect()
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        return
    trim_heap()


def trim_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc ``malloc_trim``; nothing elsewhere).

    glibc serves blocks below its mmap threshold (which rises, up to 32 MB, to the largest block
    freed) from its heap and keeps them resident once freed: a prompt chunk's temporaries of 8 to
    17 MB (its queries, keys and values, the attention's logits) stayed resident into the next
    step and stacked up on top of what it holds live (issue 24: +70 to +150 MB at 16k in chunks of
    2,048). Cheap (it walks the free lists), no garbage collection."""
    global _LIBC
    if not sys.platform.startswith("linux"):
        return
    if _LIBC is None:
        _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:  # glibc; musl has no arenas to trim
        trim(0)


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
        return _process_status()["VmRSS"]

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
        return _process_status()["VmHWM"]


_OUT_OF_MEMORY = re.compile(r"out of memory|can't allocate memory|bad_alloc|cannot allocate memory", re.IGNORECASE)


def is_out_of_memory(error: BaseException) -> bool:
    """True for the errors an allocation that does not fit raises: ``torch.OutOfMemoryError`` (CUDA),
    ``MemoryError``, and the CPU allocator's ``RuntimeError`` (``can't allocate memory``)."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and bool(_OUT_OF_MEMORY.search(str(error)))


@dataclass
class TrialOutcome:
    """One trial of a capacity search: the value tried, whether it fit, why, and what it measured."""

    value: int
    fits: bool
    reason: str
    peak_bytes: int | None = None
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class SearchResult:
    """``largest`` is the largest value that fit (None if even ``minimum`` did not);
    ``smallest_failing`` the smallest that did not (None if ``maximum`` fit)."""

    largest: int | None
    smallest_failing: int | None
    trials: list[TrialOutcome]

    def as_dict(self) -> dict[str, Any]:
        return {
            "largest_fitting": self.largest,
            "smallest_failing": self.smallest_failing,
            "trials": [asdict(trial) for trial in self.trials],
        }


def _run_trial(trial: Callable[[int], TrialOutcome], value: int) -> TrialOutcome:
    try:
        return trial(value)
    except Exception as error:  # noqa: BLE001 - only out-of-memory is an outcome; the rest re-raised
        if not is_out_of_memory(error):
            raise
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return TrialOutcome(value, False, out_of_memory_reason(error))


def out_of_memory_reason(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"out of memory: {lines[0][:200] if lines else type(error).__name__}"


def search_largest(
    trial: Callable[[int], TrialOutcome],
    start: int,
    minimum: int,
    maximum: int,
    step: int = 1,
    report: Callable[[TrialOutcome], None] | None = None,
) -> SearchResult:
    """The largest multiple of ``step`` in ``[minimum, maximum]`` for which ``trial`` fits,
    assuming fitting is monotone (what fits at n fits below n).

    From ``start`` (rounded to a multiple of ``step``), doubles while trials fit and halves while
    they do not, then bisects between the largest fitting and the smallest failing value until
    they are one ``step`` apart. A trial that raises an out-of-memory error (``is_out_of_memory``)
    is a "does not fit"; any other error propagates. ``report`` sees each outcome as it comes.
    """
    for name, value in (("start", start), ("minimum", minimum), ("maximum", maximum), ("step", step)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"invalid search {name}={value!r}: expected an integer >= 1")
    low = -(-minimum // step) * step
    high = maximum // step * step
    if low > high:
        raise ValueError(f"invalid search range [{minimum}, {maximum}]: no multiple of step {step} in it")
    trials: list[TrialOutcome] = []
    outcomes: dict[int, bool] = {}

    def fits(value: int) -> bool:
        outcome = _run_trial(trial, value)
        trials.append(outcome)
        outcomes[value] = outcome.fits
        if report is not None:
            report(outcome)
        return outcome.fits

    value = min(max(round(start / step) * step, low), high)
    largest: int | None = None
    failing: int | None = None
    if fits(value):
        largest = value
        while largest < high:
            value = min(largest * 2, high)
            if not fits(value):
                failing = value
                break
            largest = value
    else:
        failing = value
        while failing > low:
            value = max(failing // 2 // step * step, low)
            if fits(value):
                largest = value
                break
            failing = value
    if largest is not None and failing is not None:
        while failing - largest > step:
            middle = (largest + failing) // 2 // step * step
            if fits(middle):
                largest = middle
            else:
                failing = middle
    return SearchResult(largest, failing, trials)


def trial_in_subprocess(spec: dict[str, Any], timeout: float | None = None) -> TrialOutcome:
    """Run ``kvhive.bench.capacity_trial(**spec)`` in a fresh Python process and read its outcome.

    A trial the process reports as out of memory, or one the kernel kills (SIGKILL: the
    out-of-memory killer), does not fit; any other failure raises ``RuntimeError`` with the
    process's last lines, since it says nothing about memory.
    """
    command = [sys.executable, "-m", "kvhive.memory", json.dumps(spec)]
    process = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    value = spec["context"] if spec.get("search") == "context" else spec["batch_size"]
    if process.returncode == -signal.SIGKILL:
        return TrialOutcome(value, False, "killed by SIGKILL (the kernel's out-of-memory killer)")
    lines = [line for line in process.stdout.splitlines() if line.startswith("{")]
    if process.returncode != 0 or not lines:
        tail = "\n".join((process.stderr or process.stdout).strip().splitlines()[-8:])
        raise RuntimeError(f"capacity trial at {value} failed (exit status {process.returncode}):\n{tail}")
    return TrialOutcome(**json.loads(lines[-1]))


def _guard_address_space(memory_limit: int) -> None:
    """CPU trials: cap the address space at what the process maps now plus twice the limit, so a
    trial far past the limit fails with an allocation error instead of pushing the machine into
    swap or the OOM killer. The answer comes from the measured peak; the guard only trips where
    new mappings exceed 2× the limit, i.e. where the resident peak is past the limit anyway."""
    current = _process_status()["VmSize"]
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = current + 2 * memory_limit
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))


def _trial_main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    # Import the model code before the guard: its mappings are the process's, not the trial's.
    import transformers.models.llama.modeling_llama  # noqa: F401

    from kvhive.bench import capacity_trial

    value = spec["context"] if spec["search"] == "context" else spec["batch_size"]
    if torch.device(spec["device"]).type == "cpu":
        _guard_address_space(int(spec["memory_limit"]))
    try:
        outcome = capacity_trial(**spec)
    except Exception as error:  # noqa: BLE001 - out-of-memory anywhere in the trial is an outcome
        if not is_out_of_memory(error):
            raise
        outcome = TrialOutcome(value, False, out_of_memory_reason(error))
    print(json.dumps(asdict(outcome)), flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover - exercised through trial_in_subprocess
    raise SystemExit(_trial_main(sys.argv[1:]))
