"""The largest run that fits a memory limit: ``kvhive bench --search context|batch``.

``search_largest`` is the bisection: it gallops from a start value (doubling while trials fit,
halving while they do not) and bisects the gap; a trial that runs out of memory is a "does not
fit", not a crash. ``capacity_search`` searches the longest prompt or the largest batch whose
prefill and decode fit; each of its trials (``capacity_trial``) runs in a fresh Python process
(``trial_in_subprocess``: ``python -m kvhive.capacity SPEC``), so allocator state left by one
trial never reaches the next and the process's own high-water mark is the trial's peak.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from kvhive.bench import DTYPES, check_prefill_chunk, highest_known, load_shape, timed_run
from kvhive.memory import PhaseMemory, format_bytes, is_out_of_memory, out_of_memory_reason, process_status


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
    """Run ``capacity_trial(**spec)`` in a fresh Python process and read its outcome.

    A trial the process reports as out of memory, or one the kernel kills (SIGKILL: the
    out-of-memory killer), does not fit; any other failure raises ``RuntimeError`` with the
    process's last lines, since it says nothing about memory.
    """
    command = [sys.executable, "-m", "kvhive.capacity", json.dumps(spec)]
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
    current = process_status()["VmSize"]
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = current + 2 * memory_limit
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))


def trial_main(argv: list[str]) -> int:
    """The trial process (``python -m kvhive.capacity SPEC``): run the trial, print its outcome as JSON."""
    spec = json.loads(argv[0])
    # Import the model code before the guard: its mappings are the process's, not the trial's.
    import transformers.models.llama.modeling_llama  # noqa: F401

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


SEARCHES = ("context", "batch")
SEARCH_DEFAULT_STEP = {"context": 256, "batch": 1}
SEARCH_DEFAULT_BATCH_MAXIMUM = 4096


@torch.no_grad()
def capacity_trial(
    search: str,
    shape: str,
    method: str,
    budget,
    context: int,
    batch_size: int,
    decode_tokens: int,
    num_layers: int | None,
    device: str,
    dtype: str,
    method_parameters: dict,
    memory_limit: int,
    prefill_chunk: int | None = None,
    rows_alone: bool = False,
) -> TrialOutcome:
    """One trial of ``capacity_search``, meant for a fresh process (``trial_in_subprocess`` runs it there):
    load the model, prefill ``batch_size`` prompts of ``context`` tokens with ``method``, decode
    ``decode_tokens`` tokens, and say whether it fit ``memory_limit`` bytes.

    CUDA: the caching allocator is capped at the limit (``set_per_process_memory_fraction``), so
    a run that needs more raises out-of-memory there; it fits when nothing ran out. The peak is
    ``max_memory_allocated`` (weights included; the CUDA context is outside the allocator).
    CPU: the peak is the process's resident high-water mark over the whole trial (interpreter,
    torch, weights, prompt, cache, activations); it fits when that peak is <= the limit and no
    allocation failed.
    """
    value = context if search == "context" else batch_size
    cuda = torch.device(device).type == "cuda"
    if cuda:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, memory_limit / total), device)
    # Importing torch may have peaked above what the process holds now; PhaseMemory resets the mark.
    imported_peak = None if cuda else _process_peak_bytes()
    memory = PhaseMemory(device)
    try:
        model = load_shape(shape, num_layers, device, dtype=DTYPES[dtype])
        vocab = model.config.get_text_config().vocab_size
        generator = torch.Generator().manual_seed(0)
        input_ids = torch.randint(3, vocab, (batch_size, context), generator=generator).to(device)
        loaded_peak = memory.peak() if cuda or memory.unavailable is None else None
        _, _, _, phases = timed_run(
            model,
            input_ids,
            method,
            budget,
            decode_tokens,
            method_parameters,
            None if memory.unavailable else memory,
            prefill_chunk=prefill_chunk,
            rows_alone=rows_alone,
        )
    except Exception as error:  # noqa: BLE001 - only out-of-memory is an outcome; the rest re-raised
        if not is_out_of_memory(error):
            raise
        return TrialOutcome(value, False, out_of_memory_reason(error))
    if memory.unavailable is None:
        peak = highest_known(
            [imported_peak, loaded_peak, phases.get("prefill_peak_bytes"), phases.get("decode_peak_bytes")]
        )
        details = {key: phases.get(key) for key in ("prefill_peak_bytes", "decode_peak_bytes")}
    elif not cuda and os.path.exists("/proc/self/status"):
        # No reset, so no phase peaks, but the never-reset high-water mark is the trial's peak.
        peak, details = _process_peak_bytes(), {"phase_peaks_unavailable": memory.unavailable}
    else:
        raise ValueError(f"cannot measure the peak memory of a trial: {memory.unavailable}")
    if peak > memory_limit:
        return TrialOutcome(
            value, False, f"peak {format_bytes(peak)} > limit {format_bytes(memory_limit)}", peak, details
        )
    return TrialOutcome(value, True, f"peak {format_bytes(peak)} <= limit {format_bytes(memory_limit)}", peak, details)


def _process_peak_bytes() -> int:
    return process_status()["VmHWM"]


def _max_positions(shape: str, num_layers: int | None) -> int:
    """The model's position limit, read from its config (without building the weights)."""
    from kvhive import models

    if shape == "kv-heavy":
        return models.kv_heavy_model_config(num_layers or 4).max_position_embeddings
    if shape == "llama3-8b":
        return models.llama3_8b_shape_config(num_layers or 32).max_position_embeddings
    from transformers import AutoConfig

    name = models.DEFAULT_MODEL if shape == "embedded" else shape
    config = AutoConfig.from_pretrained(models.converted_model_directory(models.embedded_model(name)))
    return config.get_text_config().max_position_embeddings


def _checked_memory_limit(memory_limit: int | None, device: str) -> int:
    """The limit a search fits in: ``memory_limit`` bytes, or on CUDA by default the device's memory."""
    cuda = torch.device(device).type == "cuda"
    if memory_limit is None:
        if not cuda:
            raise ValueError("--search on CPU needs --memory-limit (e.g. --memory-limit 8GB): the limit to fit in")
        return torch.cuda.get_device_properties(device).total_memory
    if isinstance(memory_limit, bool) or not isinstance(memory_limit, int) or memory_limit <= 0:
        raise ValueError(f"invalid --memory-limit {memory_limit!r}: must be > 0 bytes")
    if cuda and memory_limit > torch.cuda.get_device_properties(device).total_memory:
        total = torch.cuda.get_device_properties(device).total_memory
        raise ValueError(
            f"invalid --memory-limit {format_bytes(memory_limit)}: more than the device's {format_bytes(total)}"
        )
    return memory_limit


def _checked_maximum(search: str, maximum, step: int, shape: str, num_layers, decode_tokens: int) -> int:
    """The largest value a search tries: ``maximum``, by default the model's positions left after the
    decode tokens (context) or :data:`SEARCH_DEFAULT_BATCH_MAXIMUM` (batch)."""
    if search == "context":
        positions = _max_positions(shape, num_layers) - decode_tokens
        if maximum is None:
            maximum = positions
        elif maximum > positions:
            raise ValueError(
                f"invalid --search-max {maximum}: the model has {positions} positions left after the decode tokens"
            )
    elif maximum is None:
        maximum = SEARCH_DEFAULT_BATCH_MAXIMUM
    if isinstance(maximum, bool) or not isinstance(maximum, int) or maximum < step:
        raise ValueError(f"invalid --search-max {maximum!r}: expected an integer >= the step ({step})")
    return maximum


def capacity_search(
    search: str,
    memory_limit: int | None = None,
    shape: str = "kv-heavy",
    method: str = "snapkv",
    budget: int | float | str | None = 0.1,
    context: int = 8192,
    batch_size: int = 1,
    decode_tokens: int = 32,
    num_layers: int | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    method_parameters: dict | None = None,
    step: int | None = None,
    maximum: int | None = None,
    report=None,
    trial=None,
    prefill_chunk: int | None = None,
    rows_alone: bool = False,
) -> dict[str, Any]:
    """The longest prompt (``search="context"``, at ``batch_size``) or the largest batch
    (``search="batch"``, at ``context``) whose prefill + ``decode_tokens`` decode steps with
    ``method`` fit ``memory_limit`` bytes (CUDA: default the device's memory; CPU: required).

    Bisection (``search_largest``) from the given context or batch size, in
    multiples of ``step`` (context 256, batch 1), up to ``maximum`` (context: the model's
    positions minus the decode tokens; batch: 4096). Each trial runs in a fresh process
    (``capacity_trial``); ``trial`` replaces that (a function of the value). ``report`` sees each
    trial's outcome as it comes. ``prefill_chunk``: each trial feeds its prompts in chunks of that
    many tokens (compressed as they come), so the prompt's activations are a chunk's, not its own.
    ``rows_alone``: each trial prefills its rows one at a time into fixed batch slots (the serving
    path of ``kvhive.generate_batch``), so a batch's prefill holds one row's activations.
    """
    check_prefill_chunk(prefill_chunk, False)
    if search not in SEARCHES:
        raise ValueError(f"invalid --search {search!r}: expected one of {', '.join(SEARCHES)}")
    cuda = torch.device(device).type == "cuda"
    memory_limit = _checked_memory_limit(memory_limit, device)
    step = SEARCH_DEFAULT_STEP[search] if step is None else step
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"invalid --search-step {step!r}: expected an integer >= 1")
    if isinstance(decode_tokens, bool) or not isinstance(decode_tokens, int) or decode_tokens < 0:
        raise ValueError(f"invalid decode_tokens={decode_tokens!r}: expected an integer >= 0")
    for name, value in (("context", context), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"invalid {name}={value!r}: expected an integer >= 1")
    maximum = _checked_maximum(search, maximum, step, shape, num_layers, decode_tokens)
    spec = {
        "search": search,
        "shape": shape,
        "method": method,
        "budget": budget,
        "context": context,
        "batch_size": batch_size,
        "decode_tokens": decode_tokens,
        "num_layers": num_layers,
        "device": device,
        "dtype": dtype,
        "method_parameters": method_parameters or {},
        "memory_limit": memory_limit,
        "prefill_chunk": prefill_chunk,
        "rows_alone": rows_alone,
    }
    if trial is None:

        def trial(value: int) -> TrialOutcome:
            return trial_in_subprocess({**spec, search if search == "context" else "batch_size": value})

    start = context if search == "context" else batch_size
    result: SearchResult = search_largest(trial, start, minimum=step, maximum=maximum, step=step, report=report)
    if cuda:
        measure = (
            "torch.cuda.max_memory_allocated over the whole trial; fits = no out-of-memory with the caching "
            "allocator capped at the limit (the CUDA context is outside it)"
        )
    else:
        measure = (
            "process resident high-water mark (VmHWM) over the whole trial, each trial a fresh process "
            "(interpreter, torch and weights included); fits = peak <= limit and no allocation failed"
        )
    return {
        "search": search,
        "memory_limit_bytes": memory_limit,
        "measure": measure,
        "shape": shape,
        "method": method,
        "budget": budget,
        "context": None if search == "context" else context,
        "batch_size": None if search == "batch" else batch_size,
        "decode_tokens": decode_tokens,
        "num_layers": num_layers,
        "device": device,
        "dtype": dtype,
        "step": step,
        "maximum": maximum,
        "prefill_chunk": prefill_chunk,
        "rows_alone": rows_alone,
        **result.as_dict(),
    }


if __name__ == "__main__":  # pragma: no cover - exercised through trial_in_subprocess
    raise SystemExit(trial_main(sys.argv[1:]))
