"""Memory you can see (issue 24 item 3): per-phase peaks in ``kvhive bench``, memory sizes, and the
search for the longest prompt / largest batch within a memory limit."""

from __future__ import annotations

import json

import pytest
import torch

from kvhive.bench import run_benchmark
from kvhive.capacity import TrialOutcome, capacity_search, search_largest
from kvhive.cli import main as kvhive_main
from kvhive.memory import PhaseMemory, parse_memory_size


# -- sizes -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, size",
    [("8GB", 8 * 10**9), ("512MiB", 512 * 2**20), ("1.5gib", int(1.5 * 2**30)), ("2000", 2000), ("64 kb", 64_000)],
)
def test_memory_sizes_read_decimal_and_binary_units(text, size):
    assert parse_memory_size(text) == size


@pytest.mark.parametrize("text, reason", [("0", "> 0"), ("0GB", "> 0"), ("-1GB", "> 0"), ("0.5", "> 0")])
def test_memory_sizes_at_or_below_zero_are_refused_naming_the_flag(text, reason):
    with pytest.raises(ValueError, match=rf"invalid --memory-limit .*{reason}"):
        parse_memory_size(text, "--memory-limit")


@pytest.mark.parametrize("text", ["8XB", "8 gigs", "8G", "GB", ""])
def test_unknown_units_are_refused_naming_the_flag(text):
    with pytest.raises(ValueError, match=r"invalid --memory-limit .*(unknown unit|expected)"):
        parse_memory_size(text, "--memory-limit")


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--search", "context", "--memory-limit", "0"], "--memory-limit"),
        (["--search", "context", "--memory-limit", "-2GB"], "--memory-limit"),
        (["--search", "batch", "--memory-limit", "8XB"], "unknown unit 'XB'"),
    ],
)
def test_bench_refuses_bad_memory_limits_naming_the_flag(arguments, message, capsys):
    with pytest.raises(SystemExit) as exited:
        kvhive_main(["bench", *arguments])
    error = capsys.readouterr().err
    assert exited.value.code == 2 and message in error and "Traceback" not in error


def test_bench_search_on_cpu_needs_a_limit_and_a_limit_needs_a_search(capsys):
    code = kvhive_main(["bench", "--search", "context", "--context", "256"])
    assert code == 2 and "--memory-limit" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--memory-limit belongs to a --search"):
        kvhive_main(["bench", "--memory-limit", "1GB"])


# -- the bisection -----------------------------------------------------------------------------------
def _threshold_trial(boundary: int, calls: list[int], failure=None):
    """Fits up to ``boundary``; above it returns "does not fit", or raises ``failure()`` if given."""

    def trial(value: int) -> TrialOutcome:
        calls.append(value)
        if value <= boundary:
            return TrialOutcome(value, True, "fits")
        if failure is not None:
            raise failure()
        return TrialOutcome(value, False, "too big")

    return trial


@pytest.mark.parametrize("start", [1, 7, 100, 1000, 4096])
@pytest.mark.parametrize("boundary", [1, 99, 100, 101, 2047, 4095, 4096])
def test_search_finds_the_boundary_from_any_start(start, boundary):
    calls: list[int] = []
    result = search_largest(_threshold_trial(boundary, calls), start, minimum=1, maximum=4096)
    assert result.largest == boundary
    assert result.smallest_failing == (None if boundary == 4096 else boundary + 1)
    assert [t.value for t in result.trials] == calls and len(set(calls)) == len(calls)
    assert len(calls) <= 2 * 13  # galloping and bisecting are both logarithmic


@pytest.mark.parametrize("boundary, largest", [(255, None), (256, 256), (1000, 768), (5000, 4864)])
def test_search_in_steps_returns_the_largest_multiple_that_fits(boundary, largest):
    result = search_largest(_threshold_trial(boundary, []), 1024, minimum=256, maximum=5000, step=256)
    assert result.largest == largest
    assert result.smallest_failing == (256 if largest is None else (largest + 256 if largest < 4864 else None))
    assert all(t.value % 256 == 0 and 256 <= t.value <= 4864 for t in result.trials)


@pytest.mark.parametrize(
    "failure",
    [
        lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 14.00 GiB"),
        lambda: MemoryError(),
        lambda: RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 4194304 bytes"),
    ],
    ids=["cuda", "MemoryError", "cpu-allocator"],
)
def test_an_out_of_memory_trial_is_a_does_not_fit_and_the_search_goes_on(failure):
    seen: list[TrialOutcome] = []
    result = search_largest(_threshold_trial(300, [], failure), 64, minimum=1, maximum=1024, report=seen.append)
    assert result.largest == 300 and result.smallest_failing == 301
    failed = [t for t in result.trials if not t.fits]
    assert failed and all(t.reason.startswith("out of memory") for t in failed)
    assert seen == result.trials  # every trial reported as it came


def test_a_trial_failing_for_another_reason_stops_the_search():
    def trial(value: int) -> TrialOutcome:
        raise ValueError("a bug, not memory")

    with pytest.raises(ValueError, match="a bug"):
        search_largest(trial, 4, minimum=1, maximum=8)


def test_capacity_search_hands_the_trial_multiples_of_the_step_up_to_the_positions():
    calls: list[int] = []
    result = capacity_search(
        "context", memory_limit=10**9, num_layers=1, context=1000, decode_tokens=32, trial=_threshold_trial(9000, calls)
    )
    # kv-heavy has 32768 positions; 32 go to decode, so the largest multiple of 256 tried is 32512.
    assert result["largest_fitting"] == 8960 and result["smallest_failing"] == 9216
    assert max(calls) <= 32768 - 32 and all(value % 256 == 0 for value in calls)
    with pytest.raises(ValueError, match="--search-max 40000"):
        capacity_search("context", memory_limit=10**9, num_layers=1, maximum=40000, trial=_threshold_trial(1, []))
    with pytest.raises(ValueError, match="--memory-limit"):
        capacity_search("batch", memory_limit=0, trial=_threshold_trial(1, []))
    batches = capacity_search("batch", memory_limit=10**9, batch_size=3, trial=_threshold_trial(37, []))
    assert batches["largest_fitting"] == 37 and batches["smallest_failing"] == 38


# -- real measurements -------------------------------------------------------------------------------
def test_phase_memory_sees_a_torch_allocation_and_forgets_it_at_the_next_phase():
    memory = PhaseMemory("cpu")
    assert memory.unavailable is None, memory.unavailable  # Linux >= 4.0 resets VmHWM through clear_refs
    start = memory.start()
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    del block
    assert memory.peak() - start >= 60 * 2**20
    second = memory.start()
    assert memory.peak() - second < 16 * 2**20


@pytest.fixture(scope="module")
def benchmarks():
    """kv-heavy, 2 layers: H2O at 10% (against the full cache) at a long and a short prompt."""
    shared = {"shape": "kv-heavy", "num_layers": 2, "decode_tokens": 2, "budget": 0.1, "method": "h2o"}
    return {context: run_benchmark(context=context, **shared) for context in (256, 1024)}


def test_bench_reports_prefill_and_decode_peaks_with_what_they_measure(benchmarks):
    result = benchmarks[1024]
    assert "VmHWM" in result["memory_measure"] and "memory_unavailable" not in result
    baseline = result["memory_baseline_bytes"]
    for key in ("prefill_peak_bytes", "decode_peak_bytes", "prefill_peak_bytes_full", "decode_peak_bytes_full"):
        assert result[key] >= baseline - 2**20, key
    assert result["peak_rss_bytes"] >= max(result["prefill_peak_bytes"], result["prefill_peak_bytes_full"])
    # The full cache holds 16 MiB at 1024 tokens; H2O at 10% holds a tenth of it while decoding.
    assert result["decode_peak_bytes"] + 8 * 2**20 < result["decode_peak_bytes_full"]
    json.dumps(result)


def test_prefill_peak_grows_with_the_prompt(benchmarks):
    short, long = benchmarks[256], benchmarks[1024]
    rise = {c: r["prefill_peak_bytes_full"] - r["memory_baseline_bytes"] for c, r in benchmarks.items()}
    # 768 more tokens: 12 MiB more KV, and the activations of 768 more tokens of hidden size 1024.
    assert rise[1024] > rise[256] + 12 * 2**20, rise
    assert long["prefill_peak_bytes"] > short["prefill_peak_bytes"]


def test_rows_prefilled_alone_into_slots_peak_at_one_rows_activations():
    # A batch prefilled at once peaks at the whole batch's activations; rows prefilled one at a time
    # into fixed batch slots (kvhive bench --rows-alone) at one row's beside the compressed rows.
    shared = {"shape": "kv-heavy", "num_layers": 2, "decode_tokens": 2, "budget": 0.1, "method": "h2o"}
    shared |= {"context": 1024, "batch_size": 6, "baseline": False}
    rise = {}
    for rows_alone in (False, True):
        result = run_benchmark(rows_alone=rows_alone, **shared)
        assert result["rows_alone"] is rows_alone and result["prefill_peak_bytes_full"] is None
        rise[rows_alone] = result["prefill_peak_bytes"] - result["memory_baseline_bytes"]
    assert rise[True] < 0.6 * rise[False], rise


def test_search_in_fresh_processes_finds_the_boundary_and_survives_out_of_memory():
    shared = {"shape": "kv-heavy", "method": "full", "budget": None, "num_layers": 1, "decode_tokens": 1}
    # A trial whose allocations fail (1 MB: the address-space guard stops the model's first tensors).
    starved = capacity_search("context", memory_limit=10**6, context=256, maximum=256, **shared)
    assert starved["largest_fitting"] is None and starved["trials"][0]["reason"].startswith("out of memory")
    # Calibrate: the peak at 2048 tokens, then a limit above it and well below 4096 tokens' peak.
    calibration = capacity_search("context", memory_limit=10**12, context=2048, step=2048, maximum=2048, **shared)
    peak_2048 = calibration["trials"][0]["peak_bytes"]
    limit = peak_2048 + 32 * 2**20
    result = capacity_search("context", memory_limit=limit, context=2048, step=2048, maximum=4096, **shared)
    assert result["largest_fitting"] == 2048 and result["smallest_failing"] == 4096, result["trials"]
    over = result["trials"][-1]
    assert over["peak_bytes"] > limit and "> limit" in over["reason"]
    assert result["trials"][0]["details"]["prefill_peak_bytes"] <= result["trials"][0]["peak_bytes"]


def test_a_chunked_prefill_peaks_at_a_chunk_not_at_the_prompt():
    # H2O at 10% of 2,048 tokens: unchunked, the prefill holds the whole prompt's cache and its
    # scoring attention; in chunks of 256 each chunk is compressed as it comes (issue 24 item 1).
    shared = {"shape": "kv-heavy", "num_layers": 2, "decode_tokens": 2, "budget": 0.1, "method": "h2o", "context": 2048}
    whole, chunked = run_benchmark(**shared), run_benchmark(**shared, prefill_chunk=256)
    rise = {
        name: result["prefill_peak_bytes"] - result["memory_baseline_bytes"]
        for name, result in (("whole", whole), ("chunked", chunked))
    }
    assert chunked["prefill_chunk"] == 256 and whole["prefill_chunk"] is None
    assert rise["chunked"] < 0.5 * rise["whole"], rise
    assert chunked["kept_tokens"] == whole["kept_tokens"]  # the same budget, resolved on the whole prompt


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--prefill-chunk", "0"], "invalid prefill_chunk=0: expected an integer >= 1"),
        (["--prefill-chunk", "64", "--compile", "--method", "h2o"], "prefill_chunk with compile"),
    ],
)
def test_bench_refuses_a_bad_prefill_chunk_naming_it(arguments, message, capsys):
    status = kvhive_main(["bench", "--context", "64", "--num-layers", "1", "--decode-tokens", "1", *arguments])
    error = capsys.readouterr().err
    assert status != 0 and message in error and "Traceback" not in error
