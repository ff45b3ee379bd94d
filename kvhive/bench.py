"""Speed and memory benchmarks (numbers, not timed tests).

``run_benchmark`` measures, for one method at one context length and budget: prefill time with
an uncompressed kvhive cache, prefill + compression time with the method (compression time is
the difference), decode ms/token for both, cache bytes against the full cache, and the peak memory
of the prefill and of the decode phase for both (``kvhive.memory.PhaseMemory``: CUDA
``max_memory_allocated``, CPU the process's resident high-water mark, reset at each phase).
The search for the longest prompt or the largest batch whose run fits a memory limit is
``kvhive.capacity`` (its trials run :func:`timed_run`).
``variable_length_attention_benchmark`` compares the variable-length decode attention path with
dense sdpa over the same number of tokens.
"""

from __future__ import annotations

import importlib
import resource
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

from kvhive.api import compiling_attention, make_cache, static_decode_methods
from kvhive.compat import cache_kwarg
from kvhive.memory import PhaseMemory, format_bytes
from kvhive.models.embedded import EMBEDDED_MODELS

# "embedded" is the default embedded model; an embedded model's name picks that one.
SHAPES = ("embedded", *EMBEDDED_MODELS, "kv-heavy", "llama3-8b")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports KiB, macOS bytes) since it started
    or since the last reset of its high-water mark (``kvhive.memory.PhaseMemory.start``)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def load_shape(shape: str, num_layers: int | None = None, device: str = "cpu", dtype=torch.float32):
    """The model of a benchmark shape (random weights except ``embedded``)."""
    from kvhive import models

    if shape == "embedded" or shape in models.EMBEDDED_MODELS:
        model, _ = models.load_model(models.DEFAULT_MODEL if shape == "embedded" else shape, dtype=dtype)
    elif shape == "kv-heavy":
        model = models.kv_heavy_model(num_layers=4 if num_layers is None else num_layers, dtype=dtype)
    elif shape == "llama3-8b":
        from transformers import LlamaForCausalLM

        config = models.llama3_8b_shape_config(num_layers=32 if num_layers is None else num_layers)
        with torch.device(device):
            model = LlamaForCausalLM(config).to(dtype).eval()
    else:
        raise ValueError(f"invalid shape={shape!r}: expected one of {', '.join(SHAPES)}")
    return model.to(device)


def _synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed_run(model, input_ids, method: str, *args, compile: bool = False, **kwargs):
    """:func:`_timed_run_switched` (the same arguments), a compiled kvhive step inside ``compression``
    where the torch needs it (``kvhive.api.compiling_attention``; the full cache is then transformers'
    own)."""
    with compiling_attention(model, compile and method != "full"):
        return _timed_run_switched(model, input_ids, method, *args, compile=compile, **kwargs)


@torch.no_grad()
def _timed_run_switched(
    model,
    input_ids,
    method: str,
    budget,
    decode_tokens: int,
    method_parameters: dict,
    memory: PhaseMemory | None = None,
    compile: bool = False,
    prefill_chunk: int | None = None,
    rows_alone: bool = False,
):
    """One prefill and ``decode_tokens`` greedy steps; with ``memory``, also each phase's memory at
    its start and its peak (``*_start_bytes``, ``*_peak_bytes``; the decode phase only if it ran).

    ``rows_alone``: each row of ``input_ids`` is prefilled alone (a batch of one, chunked with
    ``prefill_chunk``) and placed into fixed batch slots as it comes, then the rows decode together
    (what ``kvhive.generate_batch`` serves): the prefill holds one row's activations beside the
    compressed rows, not the whole batch's.

    ``prefill_chunk``: the prompt is fed in chunks of that many tokens, each compressed as it comes
    (``make_cache(prefill_chunk=...)``, budgets resolved on the whole prompt by ``plan_prompt``);
    the full cache then takes the same chunks uncompressed (stock chunked prefill).

    ``compile``: the decode step runs through ``torch.compile(fullgraph=True, dynamic=False)``
    (the steps that compile and record a CUDA graph are not timed: :func:`_untimed_steps`). The full
    cache is then transformers' ``StaticCache`` (the best stock compiled decode); a kvhive method must
    be compileable."""
    if rows_alone:
        return _timed_rows_alone(
            model, input_ids, method, budget, decode_tokens, method_parameters, memory, compile, prefill_chunk
        )
    if compile and method == "full":
        from transformers import StaticCache

        untimed = _untimed_steps(compile, input_ids.device)
        cache = StaticCache(config=model.config, max_cache_len=input_ids.shape[1] + decode_tokens + untimed)
    else:
        chunking = {} if prefill_chunk is None else {"prefill_chunk": prefill_chunk}
        cache = make_cache(model, method, budget, **method_parameters, **chunking)
        if prefill_chunk is not None:
            cache.plan_prompt(int(input_ids.shape[1]))
        if compile and cache.static_decode and not cache.is_compileable:  # the installed torch
            raise ValueError(f"--compile: {cache.compile_problem(int(input_ids.shape[1]))}")
        if compile and not cache.is_compileable:
            raise ValueError(
                f"--compile: the decode step of method {method!r} cannot compile to one graph (its layers change "
                "size from step to step); methods that can: " + ", ".join(static_decode_methods())
            )
    device = input_ids.device
    phases: dict[str, int | None] = {}
    if memory is not None:
        phases["prefill_start_bytes"] = memory.start()
    _synchronize(device)
    start = time.perf_counter()
    next_token = _prefill_greedy_token(model, cache, input_ids, prefill_chunk)
    _synchronize(device)
    prefill_seconds = time.perf_counter() - start
    if memory is not None:
        phases["prefill_peak_bytes"] = memory.peak()
        if decode_tokens:
            phases["decode_start_bytes"] = memory.start()
    step_seconds = _timed_decode(model, cache, next_token, input_ids.shape[1], decode_tokens, compile)
    if memory is not None and decode_tokens:
        phases["decode_peak_bytes"] = memory.peak()
    return cache, prefill_seconds, step_seconds, phases


def _timed_rows_alone(
    model, input_ids, method, budget, decode_tokens, method_parameters, memory, compile, prefill_chunk
):
    """:func:`timed_run` with ``rows_alone``: the first row's cache becomes a cache of ``B`` fixed
    batch slots (``KVHiveCache.stack(batch_slots=B)``), every later row joins its slot
    (``fill_slots``) right after its own prefill, and its single-row cache is dropped then."""
    from kvhive.cache import KVHiveCache

    batch, context = input_ids.shape
    chunking = {} if prefill_chunk is None else {"prefill_chunk": prefill_chunk}
    device = input_ids.device
    phases: dict[str, int | None] = {}
    if memory is not None:
        phases["prefill_start_bytes"] = memory.start()
    _synchronize(device)
    start = time.perf_counter()
    slotted, first_tokens = None, []
    room = decode_tokens + max(1, _untimed_steps(compile, device))  # the decode steps, untimed ones too
    for row in range(batch):
        cache = make_cache(model, method, budget, **method_parameters, **chunking)
        if prefill_chunk is not None:
            cache.plan_prompt(context)
        first_tokens.append(_prefill_greedy_token(model, cache, input_ids[row : row + 1], prefill_chunk))
        if slotted is None:
            slotted = KVHiveCache.stack(
                [cache],
                decode_capacity=room,
                batch_slots=batch,
                slot_capacity=context + room,
            )
        else:
            slotted.fill_slots([row], [cache])
        del cache
    _synchronize(device)
    prefill_seconds = time.perf_counter() - start
    if compile and not slotted.is_compileable:
        raise ValueError(
            f"--compile: the decode step of method {method!r} over fixed batch slots cannot compile to one graph"
        )
    if memory is not None:
        phases["prefill_peak_bytes"] = memory.peak()
        if decode_tokens:
            phases["decode_start_bytes"] = memory.start()

    # Every row has seen the context: its next position, as the slots' device counters say.
    step_seconds = _timed_decode(model, slotted, torch.cat(first_tokens), context, decode_tokens, compile)
    if memory is not None and decode_tokens:
        phases["decode_peak_bytes"] = memory.peak()
    return slotted, prefill_seconds, step_seconds, phases


def _prefill_greedy_token(model, cache, input_ids, prefill_chunk: int | None) -> torch.Tensor:
    """Feed ``input_ids`` to ``cache`` (in chunks of ``prefill_chunk`` tokens when given) and return
    the greedy next token ``[B, 1]``; only the last position's logits are computed."""
    chunk = input_ids.shape[1] if prefill_chunk is None else prefill_chunk
    for chunk_start in range(0, input_ids.shape[1], chunk):
        output = model(
            input_ids=input_ids[:, chunk_start : chunk_start + chunk],
            **{cache_kwarg(model): cache},
            use_cache=True,
            logits_to_keep=1,
        )
    return output.logits[:, -1:].argmax(-1)


def _untimed_steps(compile: bool, device) -> int:
    """Decode steps run before the timed ones: compiled, the step that compiles, and on CUDA the two
    that warm up and record the CUDA graph (cudagraph trees record at the third call)."""
    if not compile:
        return 0
    return 3 if torch.device(device).type == "cuda" else 1


def _timed_decode(model, cache, next_token, position: int, decode_tokens: int, compile: bool) -> list[float]:
    """``decode_tokens`` greedy steps from ``next_token`` ``[B, 1]`` at ``position``; each step's
    seconds. ``compile``: the step runs through ``torch.compile(fullgraph=True, dynamic=False)``
    (Inductor with CUDA graphs on CUDA, aot_eager elsewhere), and the :func:`_untimed_steps` first
    steps (compiling, recording the graph) run before the ``decode_tokens`` timed ones."""
    cache_key = cache_kwarg(model)
    device = next_token.device

    def step(token, positions):
        return model(input_ids=token, position_ids=positions, **{cache_key: cache}, use_cache=True).logits

    if compile:
        torch._dynamo.reset()  # each configuration compiles its own graph (not a recompile of the last one's)
        # On CUDA: inductor with CUDA graphs (mode "reduce-overhead"), as generate and generate_batch
        # compile (a compiled step without them still launches every kernel from the host).
        options = (
            {"backend": "inductor", "mode": "reduce-overhead"} if device.type == "cuda" else {"backend": "aot_eager"}
        )
        step = torch.compile(step, fullgraph=True, dynamic=False, **options)
    untimed = _untimed_steps(compile, device)
    positions = torch.full((next_token.shape[0], 1), position, dtype=torch.long, device=device)
    step_seconds = []
    for index in range(decode_tokens + untimed):
        start = time.perf_counter()
        logits = step(next_token, positions)
        _synchronize(device)
        if index >= untimed:  # compiling (and recording the CUDA graph) is not a decode step's time
            step_seconds.append(time.perf_counter() - start)
        next_token = logits[:, -1:].argmax(-1)
        positions = positions + 1
    return step_seconds


def check_prefill_chunk(prefill_chunk, compile: bool) -> None:
    if prefill_chunk is None:
        return
    if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
        raise ValueError(
            f"invalid prefill_chunk={prefill_chunk!r}: expected an integer >= 1 (tokens per chunk) or none"
        )
    if compile:
        raise ValueError(
            "prefill_chunk with compile: a chunked cache has no fixed decode capacity yet; chunk without compile"
        )


def _cache_bytes(cache) -> int:
    """Key/value bytes a cache holds: kvhive's own count, or a StaticCache's tokens seen x bytes per token
    (what a dynamic cache of those tokens would hold, not its preallocated length)."""
    if hasattr(cache, "nbytes"):
        return cache.nbytes()
    tokens = int(cache.get_seq_length())
    return sum(2 * layer.keys[:, :, :tokens].numel() * layer.keys.element_size() for layer in cache.layers)


def _weights_bytes(model) -> int:
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


def highest_known(values) -> int | None:
    """The largest of the values that are known (not None), or None when none is."""
    known = [v for v in values if v is not None]
    return max(known) if known else None


def run_benchmark(
    shape: str = "kv-heavy",
    method: str = "snapkv",
    budget: int | float | str | None = 0.1,
    context: int = 8192,
    decode_tokens: int = 32,
    batch_size: int = 1,
    repeats: int = 1,
    num_layers: int | None = None,
    device: str = "cpu",
    method_parameters: dict | None = None,
    dtype: torch.dtype = torch.float32,
    compile: bool = False,
    prefill_chunk: int | None = None,
    rows_alone: bool = False,
    baseline: bool = True,
) -> dict[str, Any]:
    """Benchmark ``method`` against an uncompressed cache (``baseline=False``: the method alone, for
    a batch whose full cache would not fit; the full-cache fields are then None and
    ``full_cache_bytes`` is what it would hold); returns a dict of numbers. ``compile``:
    both decode steps compiled (the full cache as transformers' ``StaticCache``). ``prefill_chunk``:
    both prompts fed in chunks of that many tokens (the method's compressed as they come).
    ``rows_alone``: both prefill each row alone into fixed batch slots and decode the rows together
    (``kvhive.generate_batch``'s serving path; the full cache as kvhive's ``full`` in slots)."""
    if isinstance(context, bool) or not isinstance(context, int) or context < 2:
        raise ValueError(f"invalid context={context!r}: expected an integer >= 2 (prompt tokens)")
    if isinstance(decode_tokens, bool) or not isinstance(decode_tokens, int) or decode_tokens < 0:
        raise ValueError(f"invalid decode_tokens={decode_tokens!r}: expected an integer >= 0")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"invalid repeats={repeats!r}: expected an integer >= 1")
    if num_layers is not None and (isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1):
        raise ValueError(f"invalid num_layers={num_layers!r}: expected an integer >= 1 (or none for the shape's own)")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"invalid batch_size={batch_size!r}: expected an integer >= 1")
    # (Rows prefilled alone decode in fixed slots whatever the chunking: a compiled step serves them.)
    check_prefill_chunk(prefill_chunk, compile and not rows_alone)
    method_parameters = method_parameters or {}
    model = load_shape(shape, num_layers, device, dtype=dtype)
    limit = model.config.get_text_config().max_position_embeddings
    if context + decode_tokens > limit:
        raise ValueError(f"invalid context={context}: context + decode tokens exceed the model's {limit} positions")
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.get_text_config().vocab_size
    input_ids = torch.randint(3, vocab, (batch_size, context), generator=generator).to(device)

    timed_run(model, input_ids[:, : min(context, 64)], "full", None, 1, {})  # warm-up
    # Resetting the high-water mark per phase resets ru_maxrss (and CUDA's peak) too: keep the
    # peaks before it.
    process_peak = peak_rss_bytes()
    cuda = torch.device(device).type == "cuda"
    cuda_peak = torch.cuda.max_memory_allocated(device) if cuda else None
    memory = PhaseMemory(device)
    memory_baseline = memory.start()  # model and prompt held, nothing else
    full_prefill, full_steps, method_prefill, method_steps = [], [], [], []
    full_phases, method_phases = [], []
    full_bytes = None

    def timed(name: str, method_budget, parameters: dict):
        return timed_run(
            model,
            input_ids,
            name,
            method_budget,
            decode_tokens,
            parameters,
            memory,
            compile=compile,
            prefill_chunk=prefill_chunk,
            rows_alone=rows_alone,
        )

    for _ in range(repeats):
        if baseline:
            full_cache, prefill_seconds, steps, phases = timed("full", None, {})
            full_prefill.append(prefill_seconds)
            full_steps.extend(steps)
            full_phases.append(phases)
            full_bytes = _cache_bytes(full_cache)
            del full_cache
        cache, prefill_seconds, steps, phases = timed(method, budget, method_parameters)
        method_prefill.append(prefill_seconds)
        method_steps.extend(steps)
        method_phases.append(phases)
    kept = sum(int(v.sum()) for v in cache.kept_tokens().values())
    bytes_per_token = cache.layers[0].bytes_per_token()
    prefill = statistics.median(full_prefill) if full_prefill else None
    compressed_prefill = statistics.median(method_prefill)
    if full_bytes is None:
        full_bytes = cache.full_cache_nbytes()  # what the full cache would hold (not run)
    result = {
        "shape": shape,
        "device": device,
        "method": method,
        "budget": cache.budget_label(),
        "context": context,
        "batch_size": batch_size,
        "decode_tokens": decode_tokens,
        "prefill_seconds": prefill,
        "prefill_and_compress_seconds": compressed_prefill,
        "compression_seconds": compressed_prefill - prefill if prefill is not None else None,
        "prefill_ratio": compressed_prefill / prefill if prefill is not None else None,
        "baseline_run": baseline,
        "decode_ms_per_token_full": 1e3 * statistics.median(full_steps) if full_steps else None,
        "decode_ms_per_token": 1e3 * statistics.median(method_steps) if method_steps else None,
        "dtype": str(dtype).removeprefix("torch."),
        "cache_bytes": cache.nbytes(),
        "reserved_bytes": cache.reserved_nbytes(),
        "metadata_bytes": cache.metadata_nbytes(),
        "compiled_decode": compile,
        "prefill_chunk": prefill_chunk,
        "rows_alone": rows_alone,
        "decode_tokens_per_second": (batch_size / statistics.median(method_steps) if method_steps else None),
        "decode_tokens_per_second_full": batch_size / statistics.median(full_steps) if full_steps else None,
        "full_cache_bytes": full_bytes,
        "cache_fraction": cache.nbytes() / full_bytes if full_bytes else None,
        "kept_tokens": kept,
        "bytes_over_kept_tokens": cache.nbytes() / (kept * bytes_per_token) if kept else None,
        "peak_rss_bytes": None,  # below: the highest of every phase
        "weights_bytes": _weights_bytes(model),
        "memory_measure": memory.measure,
    }
    if memory.unavailable is not None:
        result["memory_unavailable"] = memory.unavailable
    # Peaks are highest over the repeats; the baseline is what the process (CPU) or the device
    # allocator (CUDA) held after the warm-up with the model and the prompt loaded.
    result["memory_baseline_bytes"] = memory_baseline
    for suffix, runs in (("_full", full_phases), ("", method_phases)):
        for phase in ("prefill", "decode"):
            result[f"{phase}_peak_bytes{suffix}"] = highest_known(run.get(f"{phase}_peak_bytes") for run in runs)
        # What the decode phase starts from: the cache the prefill left, with the weights.
        result[f"decode_start_bytes{suffix}"] = highest_known(run.get("decode_start_bytes") for run in runs)
    phase_peaks = [
        run.get(f"{phase}_peak_bytes") for run in full_phases + method_phases for phase in ("prefill", "decode")
    ]
    if cuda:
        result["peak_rss_bytes"] = highest_known([process_peak, peak_rss_bytes()])
        result["peak_cuda_bytes"] = highest_known([cuda_peak, torch.cuda.max_memory_allocated(device), *phase_peaks])
    else:
        result["peak_rss_bytes"] = highest_known([process_peak, peak_rss_bytes(), *phase_peaks])
    return result


def memory_lines(result: dict[str, Any]) -> list[str]:
    """The phase peaks of a ``run_benchmark`` result for people: what is measured, then each peak
    and how far it rose above the baseline (the model and prompt loaded)."""
    if result.get("memory_unavailable"):
        return [f"peak memory per phase: not measured: {result['memory_unavailable']}"]
    baseline = result["memory_baseline_bytes"]
    lines = [
        f"peak memory per phase: {result['memory_measure']}",
        f"  baseline (model and prompt loaded, before the measured runs): {format_bytes(baseline)}"
        f" (weights {format_bytes(result['weights_bytes'])})",
    ]
    for phase in ("prefill", "decode"):
        cells = []
        for label, suffix in (("full", "_full"), (result["method"], "")):
            peak = result[f"{phase}_peak_bytes{suffix}"]
            if peak is None:
                cells.append(f"{label} not run")
            else:
                rise = peak - baseline
                sign = "+" if rise >= 0 else "-"
                cells.append(f"{label} {format_bytes(peak)} ({sign}{format_bytes(abs(rise))} against baseline)")
        lines.append(f"  {phase} peak: " + "; ".join(cells))
    starts = [result[f"decode_start_bytes{suffix}"] for suffix in ("_full", "")]
    if None not in starts:
        lines.append(
            f"  held when decoding starts: full {format_bytes(starts[0])}; {result['method']} {format_bytes(starts[1])}"
        )
    return lines


def _one_layer_cache(kv_heads: int, group_size: int, head_dim: int):
    """A one-layer uncompressing :class:`KVHiveCache` of that attention shape (no model built)."""
    from transformers import LlamaConfig

    from kvhive.cache import KVHiveCache
    from kvhive.cache.budget import Budget
    from kvhive.methods.registry import make_policy

    config = LlamaConfig(
        num_hidden_layers=1,
        num_attention_heads=kv_heads * group_size,
        num_key_value_heads=kv_heads,
        hidden_size=kv_heads * group_size * head_dim,
        head_dim=head_dim,
        intermediate_size=16,
        vocab_size=16,
    )
    return KVHiveCache(config, make_policy("full"), Budget(ratio=1.0))


@torch.no_grad()
def variable_length_attention_benchmark(
    context: int = 8192,
    kv_heads: int = 8,
    group_size: int = 2,
    head_dim: int = 128,
    batch_size: int = 1,
    spread: float = 0.5,
    repeats: int = 20,
    device: str = "cpu",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """Decode attention over heads holding different token counts (mean ``context``, counts
    uniform in ``context·(1 ± spread)``) vs dense sdpa over ``context`` tokens per head."""
    generator = torch.Generator().manual_seed(seed)
    segments = batch_size * kv_heads
    low, high = int(context * (1 - spread)), int(context * (1 + spread))
    lengths = torch.randint(low, high + 1, (segments,), generator=generator)
    lengths = lengths - (lengths.sum() - context * segments) // segments  # same total as dense
    total = int(lengths.sum())
    longest = int(lengths.max())
    cache = _one_layer_cache(kv_heads, group_size, head_dim)
    store = cache.layers[0]
    store.update(
        torch.randn(batch_size, kv_heads, longest, head_dim, generator=generator).to(device, dtype),
        torch.randn(batch_size, kv_heads, longest, head_dim, generator=generator).to(device, dtype),
    )
    keep = torch.arange(longest)[None, :] < lengths[:, None]
    store.keep(keep.view(batch_size, kv_heads, longest).to(device), lengths.view(batch_size, kv_heads))
    store.tokens_seen = longest + 1

    query = torch.randn(batch_size, kv_heads * group_size, 1, head_dim, generator=generator).to(device, dtype)
    dense_keys = torch.randn(batch_size, kv_heads, total // segments, head_dim, generator=generator).to(device, dtype)
    dense_values = torch.randn_like(dense_keys)

    def timed(function) -> float:
        function()
        _synchronize(device)
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            function()
            _synchronize(device)
            samples.append(time.perf_counter() - start)
        return 1e3 * statistics.median(samples)

    from kvhive.attention.decode import decode_variable_length
    from kvhive.attention.integration import sdpa_backends as attention_backends

    variable_ms = timed(lambda: decode_variable_length(cache, 0, query, None, head_dim**-0.5))

    def dense():
        with attention_backends(query.device):  # the best sdpa backends (cuDNN re-plans per length)
            return F.scaled_dot_product_attention(query, dense_keys, dense_values, enable_gqa=True)

    dense_ms = timed(dense)
    return {
        "context": context,
        "kv_heads": kv_heads,
        "group_size": group_size,
        "head_dim": head_dim,
        "batch_size": batch_size,
        "min_length": int(lengths.min()),
        "max_length": int(lengths.max()),
        "variable_length_ms": variable_ms,
        "dense_sdpa_ms": dense_ms,
        "slowdown": variable_ms / dense_ms,
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
    }


# The capacity search's names, read here before they moved to kvhive.capacity. Resolved on first
# use: kvhive.capacity runs this module's timing runners, so this module imports nothing of it.
_MOVED_TO_CAPACITY = frozenset(
    {"SEARCHES", "SEARCH_DEFAULT_BATCH_MAXIMUM", "SEARCH_DEFAULT_STEP", "capacity_search", "capacity_trial"}
)


def __getattr__(name: str) -> Any:
    if name in _MOVED_TO_CAPACITY:
        return getattr(importlib.import_module("kvhive.capacity"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
