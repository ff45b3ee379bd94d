"""Decode steps on a GPU in one process under a time budget: every method eager, captured (``+graph``) and
compiled (``+compile``), beside stock transformers eager and ``StaticCache`` + compile, at each batch size.
The table ``scripts/gpu_quick.sh`` writes.

    PYTHONPATH=. python benchmarks/bench_gpu_steps.py --context 32768 --batches 1,8 --layers 3 --budget-s 330 \\
        --out results/gpu/steps.jsonl --table results/gpu/steps.md
    PYTHONPATH=. python benchmarks/bench_gpu_steps.py --device cpu --tiny --budget-s 120 --out /tmp/steps.jsonl \\
        --table /tmp/steps.md     # the CPU dry run (no +graph rows; +compile with aot_eager)

``benchmarks/bench_gpu.py`` measures one configuration per fresh process (peak memory valid, minutes
a row at 32 layers); this script builds the model once (``--layers`` of the Llama-3-8B shape; the
bandwidth bound is computed for the same layers) and measures, per batch size and method, one
prefill, then ``--steps`` eager steps after 3 warm-up steps, then the same cache's step captured as
a CUDA graph (``bench_gpu.capture_decode_step``) and replayed ``--steps`` times. The compiled rows come
after every eager and captured row (a compile costs tens of seconds), and the methods with the slowest
prefills (BumbleBee's, SubGen's; their loops captured, not compiled per shape) come last in each phase:
per batch size, the stock
``StaticCache`` compiled, then each method, each on a fresh prefill, compiled with inductor
(``mode="reduce-overhead"``, CUDA graphs, on CUDA; ``--compile-backend``), 3 untimed steps (the first
compiles), ``--steps`` timed. kvhive's compiled step runs inside ``kvhive.api.compiling_attention``
(on the GPU images' torch 2.11 the attention is switched before the compiled call). Rows that no
longer fit ``--budget-s`` (a compile is estimated as the longest one so far) are recorded as skipped,
so the run ends within its budget plus one row. Each row: ms per step, the bandwidth bound ((weights
+ KV bytes) / measured copy bandwidth) and its ratio, and for compiled rows the graphs dynamo made in
the timed steps (0 for a step that neither recompiles nor breaks).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
STOCK_EAGER = "stock"
STOCK_STATIC = "stock-static"
MODES = ("eager", "+graph", "+compile")
FIRST_COMPILE_ESTIMATE_S = 60.0  # the estimate of a compile before one has been timed
# Methods whose prefill selection loops take longest (measured last in each phase of rows).
SLOW_PREFILL = ("bumblebee", "bumblebee-power", "subgen", "subgen-attention")


def _bench_gpu():
    spec = importlib.util.spec_from_file_location("bench_gpu", HERE / "bench_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench_gpu = _bench_gpu()


class Budget:
    """Seconds left of ``--budget-s`` and the longest compile row so far (the estimate of the next)."""

    def __init__(self, seconds: float):
        self.deadline = time.perf_counter() + seconds
        self.longest_compile = FIRST_COMPILE_ESTIMATE_S

    def left(self) -> float:
        return self.deadline - time.perf_counter()


def _cache(model, method: str, budget: float, room: int):
    """The row's cache: stock DynamicCache / StaticCache, or kvhive's in a fixed decode capacity
    where its layers grow (a captured or compiled step keeps one shape)."""
    from transformers import DynamicCache, StaticCache

    import kvhive

    if method == STOCK_EAGER:
        return DynamicCache(config=model.config)
    if method == STOCK_STATIC:
        return StaticCache(config=model.config, max_cache_len=room)
    if method == "full":
        return kvhive.make_cache(model, "full", decode_capacity=room)
    cache = kvhive.make_cache(model, method, ratio=budget)
    if not cache.static_decode:
        cache = kvhive.make_cache(model, method, ratio=budget, decode_capacity=room)
    return cache


def _timed(decode, token, steps: int, device: str) -> tuple[torch.Tensor, float]:
    """``steps`` calls of ``decode`` launched back to back, one synchronisation at the end; ms per step."""
    bench_gpu.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        token = decode(token)
    bench_gpu.synchronize(device)
    return token, 1e3 * (time.perf_counter() - start) / steps


def measure_method(model, input_ids, method: str, settings: dict, modes: tuple[str, ...]) -> list[dict]:
    """One prefill of ``method``'s cache, then its rows of ``modes`` (eager and/or +graph; or +compile)."""
    from kvhive.api import compiling_attention
    from kvhive.compat import cache_kwarg

    device, steps = settings["device"], settings["steps"]
    key = cache_kwarg(model)
    context = input_ids.shape[1]
    room = 3 * (bench_gpu.WARM_UP_STEPS + steps) + 2
    compiled = "+compile" in modes
    rows = []
    with torch.no_grad(), compiling_attention(model, compiled and method not in (STOCK_EAGER, STOCK_STATIC)):
        if method in (STOCK_EAGER, STOCK_STATIC):
            model.set_attn_implementation("sdpa")
        cache = _cache(model, method, settings["budget"], context + room)
        bench_gpu.synchronize(device)
        start = time.perf_counter()
        output = model(input_ids=input_ids, **{key: cache}, use_cache=True, logits_to_keep=1)
        bench_gpu.synchronize(device)
        prefill_s = time.perf_counter() - start
        token = output.logits[:, -1:].argmax(-1)
        del output
        position = context
        step = model
        if compiled:
            options = (
                {"mode": "reduce-overhead"} if settings["compile_backend"] == "inductor" and device == "cuda" else {}
            )
            torch._dynamo.reset()
            step = torch.compile(model, backend=settings["compile_backend"], dynamic=False, **options)

        def decode(token):
            nonlocal position
            positions = torch.full_like(token, position)
            position += 1
            return (
                step(input_ids=token, position_ids=positions, **{key: cache}, use_cache=True).logits[:, -1:].argmax(-1)
            )

        start = time.perf_counter()
        for _ in range(bench_gpu.WARM_UP_STEPS):  # first appends; the first compiled call compiles
            token = decode(token)
        bench_gpu.synchronize(device)
        warm_up_s = time.perf_counter() - start
        for mode in modes:
            row = {"method": method, "mode": mode, "prefill_s": prefill_s, "warm_up_s": warm_up_s}
            if mode == "+graph":
                if device != "cuda" or not getattr(cache, "static_decode", False):
                    rows.append({**row, "skipped": "a CUDA graph needs --device cuda and a static cache"})
                    continue
                decode = bench_gpu.capture_decode_step(model, cache, key, token, position, f"{method}+graph")
            graphs_before = bench_gpu.dynamo_counts() if compiled else None
            token, ms = _timed(decode, token, steps, device)
            held = bench_gpu.kv_bytes(cache)
            bound_ms = 1e3 * (settings["weights_bytes"] + held) / settings["bandwidth"]
            row.update(decode_ms_per_token=ms, kv_bytes=held, bandwidth_bound_ms=bound_ms, x_bound=ms / bound_ms)
            if compiled:
                after = bench_gpu.dynamo_counts()
                row["graphs_compiled_in_decode"] = after["graphs"] - graphs_before["graphs"]
                row["graph_breaks_in_decode"] = after["graph_breaks"] - graphs_before["graph_breaks"]
            rows.append(row)
    return rows


def run(settings: dict, methods: list[str], out: Path, table_path: Path) -> list[dict]:
    """Every row, eager and captured first, then compiled, within the budget; appended to ``out``, the
    table rewritten after each row (a run killed at its hard limit keeps what it measured)."""
    import kvhive.static_step

    # BumbleBee's and SubGen's prefill loops captured as they are, not compiled per shape: the table
    # measures decode steps, and a prefill compile costs minutes of a short lease.
    kvhive.static_step.config.prefill_compile = False
    methods = sorted(methods, key=lambda method: method in SLOW_PREFILL)  # those last within each phase
    device = settings["device"]
    torch.manual_seed(0)
    settings["bandwidth"] = bench_gpu.copy_bandwidth(device)
    model = bench_gpu.build_model(settings["layers"], device, settings["tiny"])
    settings["weights_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = Budget(settings["budget_s"])
    plan = [(batch, method, ("eager",)) for batch in settings["batches"] for method in [STOCK_EAGER]]
    plan += [(batch, method, ("eager", "+graph")) for batch in settings["batches"] for method in methods]
    plan += [(batch, method, ("+compile",)) for batch in settings["batches"] for method in [STOCK_STATIC, *methods]]
    rows = []
    prompts = {}
    for batch, method, modes in plan:
        if batch not in prompts:
            generator = torch.Generator().manual_seed(0)
            prompts[batch] = torch.randint(
                3, model.config.vocab_size, (batch, settings["context"]), generator=generator
            ).to(device)
        compiled = modes == ("+compile",)
        common = {"batch": batch, "context": settings["context"], "layers": settings["layers"]}
        if budget.left() < (budget.longest_compile if compiled else 0):
            new = [{"method": method, "mode": mode, "skipped": "time budget"} for mode in modes]
        else:
            start = time.perf_counter()
            try:
                new = measure_method(model, prompts[batch], method, settings, modes)
            except Exception as error:  # noqa: BLE001 - a failing row is a result to record
                new = [
                    {"method": method, "mode": mode, "error": f"{type(error).__name__}: {error}"[:400]}
                    for mode in modes
                ]
            if compiled:
                budget.longest_compile = max(budget.longest_compile, time.perf_counter() - start)
            gc.collect()  # the row's cache and compiled step, before the next prefill
            if device == "cuda":
                torch.cuda.empty_cache()
        for row in new:
            row = {**common, **row, **{k: settings[k] for k in ("budget", "commit", "compile_backend")}}
            row.update(bench_gpu.versions(device))
            rows.append(row)
            with out.open("a") as handle:
                handle.write(json.dumps(row) + "\n")
            shown = row.get("decode_ms_per_token", row.get("skipped", row.get("error")))
            print(f"batch {batch} {method}{'' if row['mode'] == 'eager' else row['mode']}: {shown}", flush=True)
        table_path.write_text(table(rows, settings))
    return rows


def table(rows: list[dict], settings: dict) -> str:
    """Markdown: per batch size, one line per method, ms per step and x the bound, eager / +graph / +compile."""
    first = next((row for row in rows if "device" in row), {})
    lines = [
        f"# Decode steps, {settings['context']} tokens, budget {settings['budget']}, {settings['layers']} layers "
        f"({'tiny Llama' if settings['tiny'] else 'Llama-3-8B shape'})",
        "",
        f"{first.get('device', '?')}, torch {first.get('torch', '?')}, transformers {first.get('transformers', '?')}, "
        f"triton {first.get('triton', '?')}; commit {settings['commit']}; compile backend {settings['compile_backend']}. "
        "ms per decode step (x the bandwidth bound of the same layers: weights + KV bytes over the measured copy "
        "bandwidth). Stock eager is transformers' DynamicCache with sdpa; stock compiled, its StaticCache.",
    ]
    by_key = {(row["batch"], row["method"], row["mode"]): row for row in rows}
    methods = list(dict.fromkeys([STOCK_EAGER, STOCK_STATIC, *(row["method"] for row in rows)]))

    def cell(row: dict | None) -> str:
        if row is None:
            return ""
        if "error" in row:
            return "error"
        if "skipped" in row:
            return "skipped" if row["skipped"] == "time budget" else "n/a"
        return f"{row['decode_ms_per_token']:.2f} ({row['x_bound']:.2f}x)"

    for batch in settings["batches"]:
        lines += [
            "",
            f"## batch {batch}",
            "",
            "| method | eager | +graph | +compile | bound ms |",
            "|---|---|---|---|---|",
        ]
        for method in methods:
            cells = [by_key.get((batch, method, mode)) for mode in MODES]
            if not any(cells):
                continue
            if method == STOCK_STATIC:
                name, cells = "stock StaticCache", [None, None, cells[2]]
            elif method == STOCK_EAGER:
                name = "stock DynamicCache"
            else:
                name = method
            bound = next((row["bandwidth_bound_ms"] for row in cells if row and "bandwidth_bound_ms" in row), None)
            lines.append(
                f"| {name} | "
                + " | ".join(cell(row) for row in cells)
                + f" | {'' if bound is None else f'{bound:.2f}'} |"
            )
    errors = [row for row in rows if "error" in row]
    if errors:
        lines += ["", "Errors:", ""] + [f"- batch {r['batch']} {r['method']} {r['mode']}: {r['error']}" for r in errors]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from kvhive.methods.registry import method_names

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=None, help="prompt tokens (default 32768; 512 with --tiny)")
    parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--budget", type=float, default=0.1, help="ratio of the prompt kept")
    parser.add_argument("--layers", type=int, default=3, help="layers of the Llama-3-8B shape")
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per row")
    parser.add_argument("--methods", default=",".join(method_names()), help="kvhive methods (default: every one)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="kvhive's tiny Llama (2 layers, fp32): a dry run")
    parser.add_argument("--compile-backend", default=None, help="inductor on cuda (default), aot_eager on cpu")
    parser.add_argument("--budget-s", type=float, default=330.0, help="seconds for the rows (model build excluded)")
    parser.add_argument("--out", type=Path, required=True, help="JSON lines, one per row (appended)")
    parser.add_argument("--table", type=Path, required=True, help="the markdown table (written)")
    args = parser.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in method_names()]
    if unknown:
        parser.error(f"invalid --methods: unknown {unknown}; known: {', '.join(method_names())}")
    try:
        batches = [int(b) for b in args.batches.split(",") if b]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        parser.error(f"invalid --batches={args.batches!r}: comma-separated integers >= 1")
    if not 0 < args.budget <= 1:
        parser.error(f"invalid --budget={args.budget}: expected a ratio in (0, 1]")
    if args.steps < 1 or args.layers < 1 or args.budget_s <= 0:
        parser.error("invalid --steps/--layers/--budget-s: each must be >= 1 (seconds > 0)")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU (--device cpu --tiny is the dry run)")
    settings = {
        "device": args.device,
        "tiny": args.tiny,
        "context": args.context or (512 if args.tiny else 32768),
        "batches": batches,
        "budget": args.budget,
        "layers": 2 if args.tiny else args.layers,
        "steps": args.steps,
        "compile_backend": args.compile_backend or ("inductor" if args.device == "cuda" else "aot_eager"),
        "budget_s": args.budget_s,
        "commit": bench_gpu.commit(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.table.parent.mkdir(parents=True, exist_ok=True)
    run(settings, methods, args.out, args.table)
    print(args.table.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
