"""Decode and prefill on a GPU, kvhive vs stock transformers, each configuration in a fresh process.

    PYTHONPATH=. python benchmarks/bench_gpu.py --context 32768 --batch 1 --compile
    PYTHONPATH=. python benchmarks/bench_gpu.py --device cpu --tiny --out runs/smoke.jsonl   # CPU smoke run

Model: Llama-3-8B shape (``--layers``, default 32, 32 query heads, 8 KV heads of 128), random bf16
weights, random token ids; ``--tiny`` takes kvhive's tiny Llama (2 layers, fp32) instead, for a
smoke run.

Every configuration runs in its own subprocess: a peak of CUDA memory is only valid in a process
that held nothing before (a cache kept alive by an earlier configuration, or the allocator's
cached blocks, would shift it). The worker appends one JSON line to ``--out`` (default
``results/gpu/bench_gpu.jsonl``); the driver skips every configuration that file already holds
without an error for the same commit and settings, so a killed run resumes where it stopped, and
records a line with the error when a worker dies (out of memory, killed, timed out).

Each line: prefill seconds (one forward over the prompt, compression included), decode ms/token
(``--decode-tokens`` steps after 3 warm-up steps, launched back to back with one synchronisation at
the end, as a serving loop runs), KV bytes held, peak CUDA memory above the weights in the prefill
and in the decode phase, and the bandwidth bound of a decode step ((weights + KV read) / measured
copy bandwidth) with its ratio to the measured step. On the CPU the peaks are not measured (torch
tracks peak memory only for CUDA) and the line says so.

Configurations (``--configs``, comma-separated):
* ``stock-cudnn-off``, ``stock-cudnn-on``: transformers' sdpa with its ``DynamicCache`` (cuDNN's sdpa
  re-plans at every key length; off is the better stock eager decode);
* ``stock-static``: transformers' ``StaticCache`` (cuDNN off);
* a kvhive method (``full``, ``snapkv``, ``tova``, ...), optionally ``@kernel`` / ``@sdpa`` to force
  kvhive's dense decode attention (``make_cache(dense_decode=...)``; unnamed: its default, ``"auto"``);
* any of these with ``+compile``: the decode step (the model's forward on one token) through
  ``torch.compile`` (``--compile-backend``, default inductor with mode ``reduce-overhead``, i.e.
  CUDA graphs, on CUDA; ``aot_eager`` on the CPU); the prefill stays eager, as in
  ``model.generate``. ``stock-static+compile`` is the best stock decode. ``--compile`` adds the
  ``+compile`` row of every configuration (``stock-static+compile`` for the stock ones). A compiled
  row also records how many graphs dynamo compiled during the timed decode steps (0 when the step
  neither recompiles nor breaks) and its graph breaks.

Prefill rows: ``prefill_s`` is one prefill over the prompt with its compression. BumbleBee's greedy
and SubGen's farthest-point order take their fast path (issue 25: a fixed-shape step compiled with
inductor, the whole selection loop captured as one CUDA graph per shape and replayed for the later
layers) or the eager loops: ``--prefill-path auto`` (the default) takes the fast path on CUDA, as
kvhive does (SubGen's pick there is one Triton kernel launch, ``kvhive.methods.farthest_kernel``;
BumbleBee's stochastic greedy step two, ``kvhive.methods.greedy_kernel``);
``fast`` forces it; ``compiled`` runs the torch steps compiled instead of the kernels; ``graph``
takes it without compiling the torch steps (captured as they are: no compile per shape, more kernels
per step); ``eager`` takes the eager loops. The fast path
compiles and captures at its first layer of a new shape, so every row first runs one untimed
prefill of the same prompt (``--no-prefill-warmup`` skips it; its time is ``prefill_first_s``):
``prefill_s`` is then what every later prompt of that length costs, for the stock rows as for
kvhive's. ``prefill_selection_path`` records the path each selection took (BumbleBee's greedy,
SubGen's order; absent for the methods that have neither), ``prefill_selection_kind`` what ran their
steps ("triton kernel", "compiled" or "eager"), with the torch version. ``--left-padding P`` left-pads every other
batch row (rows 1, 3, ...) by ``P`` tokens: the prefill runs with that attention mask, as a padded
batch does (issue 25: a left-padded batch's column sums from flash attention row by row), and each
decode step passes the mask grown by one column (eager rows only: not with ``+graph`` or
``+compile``).

``--profile CONFIG`` adds a ``torch.profiler`` trace of 5 decode steps to that configuration's line
(host time, GPU kernel time, device->host synchronisations per step); ``--varlen`` adds the
variable-length decode attention kernel against dense sdpa.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "results" / "gpu" / "bench_gpu.jsonl"
STOCK_DYNAMIC = ("stock-cudnn-on", "stock-cudnn-off")
STOCK_STATIC = "stock-static"
STOCK = (*STOCK_DYNAMIC, STOCK_STATIC)
COMPILE_SUFFIX = "+compile"
# One eager decode step captured as a CUDA graph (torch.cuda.graph, no dynamo) and replayed: what a
# server that captures its decode step gets; works on any torch, kvhive's static layout only.
GRAPH_SUFFIX = "+graph"
DENSE_DECODE_CHOICES = ("kernel", "sdpa")
WARM_UP_STEPS = 3
PROFILE_STEPS = 5
DEFAULT_CONFIGS = (
    "stock-cudnn-on,stock-cudnn-off,stock-static,full,full@kernel,snapkv,snapkv@kernel,"
    "ada-snapkv,pyramidkv,tova,knorm,streamingllm"
)
# The settings a result line is keyed by: a line with the same values (and no error) is not rerun.
SETTINGS = (
    "label",
    "commit",
    "device_kind",
    "tiny",
    "context",
    "batch",
    "budget",
    "layers",
    "decode_tokens",
    "compile_backend",
    "prefill_path",
    "prefill_warmup",
    "left_padding",
)
# A setting's value in the lines written before it existed.
SETTING_DEFAULTS = {"left_padding": 0}


# -- configuration names (checked by the driver before any process starts) -------------------------


def parse_config(config: str) -> dict:
    """``"snapkv@kernel+compile"`` -> its parts; a ValueError naming the accepted values otherwise."""
    from kvhive.methods.registry import method_names

    name, compiled = (config[: -len(COMPILE_SUFFIX)], True) if config.endswith(COMPILE_SUFFIX) else (config, False)
    name, graphed = (name[: -len(GRAPH_SUFFIX)], True) if name.endswith(GRAPH_SUFFIX) else (name, False)
    if compiled and graphed:
        raise ValueError(f"invalid config {config!r}: {GRAPH_SUFFIX} or {COMPILE_SUFFIX}, not both")
    base, _, dense_decode = name.partition("@")
    if base in STOCK:
        if dense_decode or graphed:
            raise ValueError(
                f"invalid config {config!r}: '@{dense_decode}'/{GRAPH_SUFFIX} apply to kvhive methods only"
            )
        return {
            "config": config,
            "stock": True,
            "method": None,
            "dense_decode": None,
            "compiled": compiled,
            "graph": False,
        }
    if base not in method_names():
        raise ValueError(
            f"invalid config {config!r}: expected one of {', '.join(STOCK)} or a kvhive method "
            f"({', '.join(method_names())}), optionally with @kernel/@sdpa and {COMPILE_SUFFIX}"
        )
    if dense_decode and dense_decode not in DENSE_DECODE_CHOICES:
        raise ValueError(f"invalid config {config!r}: expected @{' or @'.join(DENSE_DECODE_CHOICES)} after the method")
    return {
        "config": config,
        "stock": False,
        "method": base,
        "dense_decode": dense_decode or None,
        "compiled": compiled,
        "graph": graphed,
    }


def with_compiled_rows(configs: list[str]) -> list[str]:
    """``configs`` and, after them, the ``+compile`` row of each (one ``stock-static+compile`` for all stock ones)."""
    compiled = []
    for config in configs:
        if config.endswith(COMPILE_SUFFIX):
            continue
        row = STOCK_STATIC + COMPILE_SUFFIX if config.partition("@")[0] in STOCK else config + COMPILE_SUFFIX
        if row not in configs and row not in compiled:
            compiled.append(row)
    return configs + compiled


# -- the worker: one configuration, one process ----------------------------------------------------


def versions(device: str) -> dict:
    import torch
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
    }


def synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    import torch

    elements = 1 << (29 if device == "cuda" else 24)  # 1 GiB of bf16 on CUDA, 32 MiB on the CPU
    source = torch.randn(elements, device=device, dtype=torch.bfloat16)
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    synchronize(device)
    start = time.perf_counter()
    for _ in range(10):
        target.copy_(source)
    synchronize(device)
    seconds = (time.perf_counter() - start) / 10
    del source, target
    return 2 * elements * 2 / seconds


def build_model(num_layers: int, device: str, tiny: bool):
    import torch
    from transformers import LlamaForCausalLM

    from kvhive.models import llama3_8b_shape_config, tiny_model

    if tiny:
        return tiny_model("llama", "gqa").to(device).eval()
    config = llama3_8b_shape_config(num_layers=num_layers)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    return model


def kv_bytes(cache) -> int:
    if hasattr(cache, "nbytes"):
        return cache.nbytes()
    return sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)


def make_cache(model, parts: dict, budget: float, max_length: int, decode_tokens: int = 0, tokens: int | None = None):
    """The configuration's cache: stock, or kvhive's keeping ``budget`` of the prompt (a ratio; or
    ``tokens`` per head where given: the rows of a padded batch hold different real lengths, and a
    method that evicts while decoding keeps one count per layer)."""
    import torch
    from transformers import DynamicCache, StaticCache

    if parts["stock"]:
        base = parts["config"].partition("+")[0]
        if torch.cuda.is_available():
            torch.backends.cuda.enable_cudnn_sdp(base == "stock-cudnn-on")
        model.set_attn_implementation("sdpa")
        if base == STOCK_STATIC:
            return StaticCache(config=model.config, max_cache_len=max_length)
        return DynamicCache(config=model.config)
    if torch.cuda.is_available():
        torch.backends.cuda.enable_cudnn_sdp(True)  # kvhive chooses its own kernels whatever this says
    import kvhive

    # The dense decode attention is a per-cache option (make_cache's default unless "@kernel"/"@sdpa").
    dense_decode = parts["dense_decode"] or "auto"
    # A captured step needs one shape from step to step: growing layers get room for the decode
    # steps (attention then reads the kept tokens plus that room, empty slots masked).
    room = {"decode_capacity": decode_tokens} if parts.get("graph") else {}
    if parts["method"] == "full":
        return kvhive.make_cache(model, "full", dense_decode=dense_decode, **room)
    if tokens is not None:
        return kvhive.make_cache(model, parts["method"], budget=tokens, dense_decode=dense_decode, **room)
    return kvhive.make_cache(model, parts["method"], ratio=budget, dense_decode=dense_decode, **room)


def dynamo_counts() -> dict:
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values())}


def measure(settings: dict) -> dict:
    """One configuration's line (without the settings it was run with). A compiled kvhive row runs
    inside ``kvhive.compression`` where the torch needs it (below 2.13: ``kvhive.static_step``)."""
    import torch

    from kvhive.api import compiling_attention

    device, parts = settings["device_kind"], parse_config(settings["config"])
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(device)
    model = build_model(settings["layers"], device, settings["tiny"])
    with compiling_attention(model, parts["compiled"] and not parts["stock"]):
        return _measure(settings, parts, model, bandwidth)


def _measure(settings: dict, parts: dict, model, bandwidth: float) -> dict:
    import torch

    from kvhive.compat import cache_kwarg

    device = settings["device_kind"]
    weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    generator = torch.Generator().manual_seed(0)
    context, batch, decode_tokens = settings["context"], settings["batch"], settings["decode_tokens"]
    input_ids = torch.randint(3, model.config.vocab_size, (batch, context), generator=generator).to(device)
    # Every other row left-padded (--left-padding): the prompt's mask, grown by one column a decode step.
    padding = settings.get("left_padding", 0)
    masks = {}
    if padding:
        attention_mask = torch.ones(batch, context, dtype=torch.long, device=device)
        attention_mask[1::2, :padding] = 0
        input_ids[1::2, :padding] = 0
        masks["attention_mask"] = attention_mask
    # A padded batch keeps a token budget: the ratio of the whole prompt, the same count in every row.
    tokens = max(1, int(settings["budget"] * context)) if padding else None
    key = cache_kwarg(model)
    cuda = device == "cuda"
    path = settings.get("prefill_path", "auto")
    import kvhive.methods.subgen as subgen_module
    import kvhive.methods.submodular as submodular_module
    import kvhive.static_step

    kvhive.static_step.config.prefill_fast_path = {
        "auto": None,
        "fast": True,
        "compiled": True,
        "graph": True,
        "eager": False,
    }[path]
    kvhive.static_step.config.prefill_compile = path != "graph"
    kvhive.static_step.config.prefill_kernels = path in ("auto", "fast")
    steps = WARM_UP_STEPS + decode_tokens + PROFILE_STEPS
    prefill_first = None
    if settings.get("prefill_warmup", True):
        # The fast path compiles and captures at its first layer of a new shape: one untimed prefill
        # of the same prompt first (its cache dropped), so prefill_s is the steady-state cost; every
        # row, the stock ones included, so that their prefills compare warm against warm.
        held_before = torch.cuda.memory_allocated() if cuda else None
        warm_cache = make_cache(model, parts, settings["budget"], context + steps, steps, tokens)
        with torch.no_grad():
            synchronize(device)
            start = time.perf_counter()
            model(input_ids=input_ids, **masks, **{key: warm_cache}, use_cache=True, logits_to_keep=1)
            synchronize(device)
            prefill_first = time.perf_counter() - start
        del warm_cache
    held_by_fast_path = None
    if cuda and prefill_first is not None:
        torch.cuda.empty_cache()  # what stays: compiled steps' constants, captured graphs and their buffers
        held_by_fast_path = torch.cuda.memory_allocated() - held_before
    submodular_module.last_greedy_path = subgen_module.last_farthest_path = None
    if cuda:
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    cache = make_cache(model, parts, settings["budget"], context + steps, steps, tokens)
    step = model
    if parts["compiled"]:
        problem = getattr(cache, "compile_problem", lambda _: None)(context)
        if problem is not None:  # e.g. a torch whose dynamo does not trace kvhive's attention: refused
            raise RuntimeError(f"{settings['config']}: {problem}")
        backend = settings["compile_backend"]
        options = {"mode": "reduce-overhead"} if backend == "inductor" and cuda else {}
        step = torch.compile(model, backend=backend, dynamic=False, **options)
    with torch.no_grad():
        synchronize(device)
        start = time.perf_counter()
        output = model(input_ids=input_ids, **masks, **{key: cache}, use_cache=True, logits_to_keep=1)
        synchronize(device)
        prefill = time.perf_counter() - start
        token = output.logits[:, -1:].argmax(-1)
        del output
        peak_prefill = torch.cuda.max_memory_allocated() - base if cuda else None
        position = context

        def decode(token):
            nonlocal position
            # Positions passed as a tensor: the step's inputs are tensors only, as a compiled step needs.
            positions = torch.full_like(token, position)
            position += 1
            if masks:
                masks["attention_mask"] = torch.cat([masks["attention_mask"], torch.ones_like(token)], dim=1)
            return (
                step(input_ids=token, position_ids=positions, **masks, **{key: cache}, use_cache=True)
                .logits[:, -1:]
                .argmax(-1)
            )

        start = time.perf_counter()
        for _ in range(WARM_UP_STEPS):  # first appends, kernel and graph compilation
            token = decode(token)
        synchronize(device)
        warm_up = time.perf_counter() - start
        if parts.get("graph"):
            decode = capture_decode_step(model, cache, key, token, position, settings["config"])
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        compiled_before = dynamo_counts() if parts["compiled"] else None
        start = time.perf_counter()
        for _ in range(decode_tokens):
            token = decode(token)
        synchronize(device)
        decode_ms = 1e3 * (time.perf_counter() - start) / decode_tokens
    held = kv_bytes(cache)
    result = {
        "budget_applied": None if parts["stock"] or parts["method"] == "full" else settings["budget"],
        "budget_tokens": None if parts["stock"] or parts["method"] == "full" else tokens,
        "prefill_s": prefill,
        "warm_up_s": warm_up,
        "decode_ms_per_token": decode_ms,
        "kv_bytes": held,
        "reserved_bytes": cache.reserved_nbytes() if hasattr(cache, "reserved_nbytes") else held,
        "weights_bytes": weights_bytes,
        "copy_bandwidth_GBps": bandwidth / 1e9,
        "bandwidth_bound_ms": 1e3 * (weights_bytes + held) / bandwidth,
    }
    result["bound_over_measured"] = result["bandwidth_bound_ms"] / decode_ms
    result["prefill_path"] = path
    if prefill_first is not None:
        result["prefill_first_s"] = prefill_first
    selection = {
        name: value
        for name, value in (
            ("bumblebee_greedy", submodular_module.last_greedy_path),
            ("subgen_farthest_point", subgen_module.last_farthest_path),
        )
        if value is not None
    }
    if selection:
        result["prefill_selection_path"] = selection
        result["prefill_selection_kind"] = {name: selection_kind(value) for name, value in selection.items()}
        # The prefill steps compile on every torch; the decode step only above kvhive's gate.
        result["torch"] = torch.__version__
        result["decode_compiles_on_this_torch"] = kvhive.static_step.TORCH_COMPILES_KVHIVE
    if held_by_fast_path is not None:
        result["held_after_warmup_prefill_bytes"] = held_by_fast_path
    if cuda:
        result["peak_prefill_above_weights_bytes"] = peak_prefill
        result["peak_decode_above_weights_bytes"] = torch.cuda.max_memory_allocated() - base
    else:
        result["peak_memory"] = "not measured: torch tracks peak memory only on CUDA"
    if parts["compiled"]:
        after = dynamo_counts()
        result["compile_backend"] = settings["compile_backend"]
        result["graphs_compiled_in_decode"] = after["graphs"] - compiled_before["graphs"]
        result["graph_breaks_in_decode"] = after["graph_breaks"] - compiled_before["graph_breaks"]
        result["graphs_total"] = after["graphs"]
    if settings.get("profile"):
        result["profile"] = profile(lambda: decode(token), PROFILE_STEPS)
    return result


def capture_decode_step(model, cache, key: str, token, position: int, config: str):
    """``decode(token)`` replaying one decode step captured as a CUDA graph: the new token and its
    position are written into the captured inputs (the cache's buffers keep their addresses)."""
    import torch

    if not torch.cuda.is_available() or not token.is_cuda:
        raise RuntimeError(f"{config}: {GRAPH_SUFFIX} captures a CUDA graph: it needs --device cuda")
    if not getattr(cache, "static_decode", False):
        raise RuntimeError(f"{config}: this cache's decode step changes shape from step to step: nothing to capture")
    static_token = token.clone()
    static_position = torch.full_like(token, position)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.no_grad(), torch.cuda.graph(graph):
        logits = model(input_ids=static_token, position_ids=static_position, **{key: cache}, use_cache=True).logits
        static_next = logits[:, -1:].argmax(-1)
    next_position = position

    def decode(token):
        nonlocal next_position
        static_token.copy_(token)
        static_position.fill_(next_position)
        next_position += 1
        graph.replay()
        return static_next

    return decode


def profile(decode_step, steps: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize()
    with torch.no_grad(), torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            decode_step()
        host = time.perf_counter() - start
        torch.cuda.synchronize()
    events = prof.key_averages()
    syncs = sum(e.count for e in events if "Synchronize" in e.key or "synchronize" in e.key)
    device_to_host = sum(e.count for e in events if "DtoH" in e.key or "Memcpy DtoH" in e.key)
    kernel_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    # Kernel launches from the host (an eager step's cost when the GPU waits on the host).
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
    return {
        "steps": steps,
        "host_ms_per_step": 1e3 * host / steps,
        "gpu_kernel_ms_per_step": kernel_us / 1e3 / steps,
        "synchronize_calls_per_step": syncs / steps,
        "kernel_launches_per_step": launches / steps,
        "device_to_host_copies_per_step": device_to_host / steps,
        "top_host_ops": [(e.key, round(e.self_cpu_time_total / 1e3 / steps, 3)) for e in top],
    }


def varlen_rows(settings: dict) -> list[dict]:
    import torch

    from kvhive.bench import variable_length_attention_benchmark

    contexts = [256, 1024] if settings["tiny"] else [8192, 32768]
    return [
        variable_length_attention_benchmark(
            context=context,
            kv_heads=8,
            group_size=4,
            head_dim=128,
            batch_size=batch,
            repeats=50,
            device=settings["device_kind"],
            dtype=torch.bfloat16,
        )
        for batch in (1, 8)
        for context in contexts
    ]


def append_line(out: Path, row: dict) -> None:
    with out.open("a") as handle:
        handle.write(json.dumps(row) + "\n")


def worker(settings: dict, out: Path) -> int:
    """Measure one configuration and append its line; an exception is recorded as the result."""
    row = {**settings, **versions(settings["device_kind"])}
    try:
        if settings["config"] == "varlen":
            for varlen in varlen_rows(settings):
                append_line(out, {**row, "kind": "varlen", **varlen})
            return 0
        row.update(kind="e2e", **measure(settings))
    except Exception as error:  # noqa: BLE001 - a failing configuration is a result to record, not a crash
        row.update(kind="e2e", error=f"{type(error).__name__}: {error}"[:500])
    append_line(out, row)
    return 0


# -- the driver ------------------------------------------------------------------------------------


def commit() -> str | None:
    if os.environ.get("KVHIVE_COMMIT"):
        return os.environ["KVHIVE_COMMIT"]
    try:
        result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    except OSError:
        return None
    return result.stdout.strip() or None


def done(out: Path, settings: dict) -> bool:
    """Whether ``out`` holds an error-free line of this configuration with these settings."""
    if not out.exists():
        return False
    for line in out.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a killed run: not a result
            continue
        if (
            row.get("config") == settings["config"]
            and "error" not in row
            and all(row.get(name, SETTING_DEFAULTS.get(name)) == settings[name] for name in SETTINGS)
        ):
            return True
    return False


def run_in_fresh_process(settings: dict, out: Path, timeout: float) -> None:
    """One worker process; a worker that dies without writing its line gets one with the reason."""
    lines_before = len(out.read_text().splitlines()) if out.exists() else 0
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(settings), "--out", str(out)]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    try:
        finished = subprocess.run(command, env=environment, timeout=timeout, capture_output=True, text=True)
        reason = None if finished.returncode == 0 else f"worker exited {finished.returncode}: {finished.stderr[-400:]}"
    except subprocess.TimeoutExpired:
        reason = f"worker timed out after {timeout:g} s"
    lines_after = len(out.read_text().splitlines()) if out.exists() else 0
    if reason is not None or lines_after == lines_before:
        append_line(out, {**settings, "kind": "e2e", "error": reason or "worker wrote no line"})


def selection_kind(path: str) -> str:
    """ "triton kernel", "compiled" or "eager": what ran a prefill selection's steps, from the path it
    recorded (``submodular.last_greedy_path``, ``subgen.last_farthest_path``)."""
    if "(triton)" in path:
        return "triton kernel"
    if path.startswith("fixed-shape step (") and not path.startswith("fixed-shape step (eager)"):
        return "compiled"
    return "eager"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=None, help="prompt tokens (default 32768; 512 with --tiny)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--budget", type=float, default=0.1, help="ratio of the prompt kept")
    parser.add_argument("--decode-tokens", type=int, default=None, help="timed steps (default 32; 8 with --tiny)")
    parser.add_argument("--layers", type=int, default=None, help="layers of the Llama-3-8B shape (default 32)")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS)
    parser.add_argument("--compile", action="store_true", help="add the +compile row of every configuration")
    parser.add_argument(
        "--compile-backend", default=None, help="torch.compile backend (inductor on cuda, aot_eager on cpu)"
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="kvhive's tiny Llama instead of the Llama-3-8B shape")
    parser.add_argument("--profile", default="", help="comma-separated configs to profile (CUDA)")
    parser.add_argument("--varlen", action="store_true", help="also time variable-length vs dense attention")
    parser.add_argument(
        "--prefill-path",
        choices=("auto", "fast", "compiled", "graph", "eager"),
        default="auto",
        help="BumbleBee's greedy and SubGen's farthest-point order: kvhive's default (auto: the fast path on CUDA, "
        "the eager loops on the CPU), the fast path (SubGen's and BumbleBee's Triton kernels, BumbleBee's lazy greedy "
        "step compiled; captured as one CUDA graph per shape on CUDA), compiled (the fast path with the torch steps "
        "compiled instead of the kernels), graph (the torch steps not compiled: captured as they are) or the eager loops",
    )
    parser.add_argument(
        "--no-prefill-warmup",
        dest="prefill_warmup",
        action="store_false",
        help="time the first prefill (compiles and captures included) instead of one after an untimed warm-up",
    )
    parser.add_argument(
        "--left-padding",
        type=int,
        default=0,
        help="tokens of left padding in every other batch row (rows 1, 3, ...; needs --batch >= 2): the prefill "
        "and each decode step pass the attention mask; eager rows only (not +graph or +compile)",
    )
    parser.add_argument("--label", default="kvhive")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one configuration may take")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # the settings of one configuration (JSON)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker), args.out)
    from kvhive.models import tiny_model_config

    configs = [config for config in args.configs.split(",") if config]
    if args.compile:
        configs = with_compiled_rows(configs)
    for config in configs:
        try:
            parse_config(config)
        except ValueError as error:
            parser.error(str(error))
    if args.tiny and args.layers is not None:
        parser.error("invalid --layers with --tiny: the tiny model has its own 2 layers")
    profiled = set(filter(None, args.profile.split(",")))
    if profiled and args.device != "cuda":
        parser.error("invalid --profile: the profile counts CUDA kernels and synchronisations (--device cuda)")
    if not 0 < args.budget <= 1:
        parser.error(f"invalid --budget={args.budget}: expected a ratio in (0, 1]")
    context = args.context or (512 if args.tiny else 32768)
    if args.left_padding:
        if not 0 < args.left_padding < context:
            parser.error(f"invalid --left-padding={args.left_padding}: expected 0 (none) or 1 to {context - 1} tokens")
        if args.batch < 2:
            parser.error(f"invalid --left-padding with --batch={args.batch}: it pads every other row, so --batch >= 2")
        captured = [config for config in configs if any(parse_config(config)[part] for part in ("graph", "compiled"))]
        if captured:
            parser.error(
                f"invalid --left-padding with {', '.join(captured)}: a padded batch's decode passes a mask that grows "
                "each step (eager rows only, not +graph or +compile)"
            )
    common = {
        "label": args.label,
        "commit": commit(),
        "device_kind": args.device,
        "tiny": args.tiny,
        "context": context,
        "batch": args.batch,
        "budget": args.budget,
        "layers": tiny_model_config("llama", "gqa").num_hidden_layers if args.tiny else args.layers or 32,
        "decode_tokens": args.decode_tokens or (8 if args.tiny else 32),
        "compile_backend": args.compile_backend or ("inductor" if args.device == "cuda" else "aot_eager"),
        "prefill_path": args.prefill_path,
        "prefill_warmup": args.prefill_warmup,
        "left_padding": args.left_padding,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for config in (["varlen"] if args.varlen else []) + configs:
        settings = {**common, "config": config, "profile": config in profiled}
        if done(args.out, settings):
            print(f"{config}: already in {args.out}", flush=True)
            continue
        start = time.perf_counter()
        run_in_fresh_process(settings, args.out, args.timeout)
        row = json.loads(args.out.read_text().splitlines()[-1])
        shown = {
            k: row[k]
            for k in (
                "prefill_s",
                "prefill_selection_path",
                "decode_ms_per_token",
                "peak_decode_above_weights_bytes",
                "error",
            )
            if k in row
        }
        print(f"{config}: {json.dumps(shown)} ({time.perf_counter() - start:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
