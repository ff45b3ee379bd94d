"""Kernels of one compiled steady decode step per method, beside transformers' StaticCache: the CPU proxy of
the compiled GPU step.

The whole decode step (the model's forward on one token, with the cache's update, decision and fill)
goes through ``torch.compile(fullgraph=True, dynamic=False)`` with Inductor on the CPU, once per method,
after a few eager steps (a steady step: every method past its prefill). Counted over that one compile:
``torch._inductor.metrics.generated_kernel_count`` (the fused kernels Inductor generates; reset right
before the compile) and the extern calls of the generated wrapper (``extern_kernels.mm``, aten
fallbacks such as the CPU's sdpa; each a launch of its own on a GPU). Every kernel and extern call runs
once per step, so these are the step's launches before CUDA graphs. Transformers' ``StaticCache`` over
the same model, compiled the same way, is the reference (the issue's target: <= 1.3x its kernels).

Shape: the kv-heavy model of ``benchmarks/bench_decode_cpu.py`` (``--layers``, default 2), a 4k
prompt, 10% budget. Layers that grow while decoding (the full cache, prefill-only methods) decode in a
fixed capacity (``decode_capacity``), as a compiled step needs. ``--layers 2,4`` also prints the
kernels each added layer costs (the step's fixed part, embedding and logits, cancels out).

By default the generated C++ is not built (Inductor's code generation gives the counts; building takes
minutes a method on two cores): the compiled call stops at its first kernel. ``--build`` builds and runs
the compiled step and checks its logits against an eager twin of the cache. It only counts;
results/compiled_kernels_cpu.md has the figures.

    python benchmarks/compiled_kernels_cpu.py [--methods tova,snapkv] [--layers 2,4] [--build]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import re
import sys
import time
import types
from unittest import mock

import torch
import torch._inductor.config as inductor_config
import torch._inductor.metrics as inductor_metrics
from torch._inductor.async_compile import AsyncCompile
from torch._inductor.graph import GraphLowering

from kvhive.api import compiling_attention, make_cache
from kvhive.compat import cache_kwarg
from kvhive.methods.registry import method_names
from kvhive.models.shapes import kv_heavy_model

STOCK = "StaticCache"
EAGER_STEPS = 3  # steps before the compiled one: the step counted is a steady one
# A launch in the wrapper's call(): an extern kernel (mm, bmm, ...) or an aten/inductor op it falls back to.
EXTERN_CALL = re.compile(r"\b(extern_kernels\.\w+|(?:torch\.ops\.)?(?:aten|inductor_ops|inductor)\.\w+(?:\.\w+)?)\(")
NOT_LAUNCHES = ("reinterpret_tensor", "assert_size_stride", "assert_alignment", "_alloc_from_pool")


class NotBuilt(Exception):
    """Raised by a generated kernel that was not built (counting mode)."""


def _unbuilt_kernel(*_args, **_kwargs):
    raise NotBuilt


@contextlib.contextmanager
def counting_only():
    """Inductor generates its C++ kernels but builds none: each stands in as a function that raises."""
    with (
        mock.patch.object(AsyncCompile, "cpp_pybinding", lambda self, argtypes, source: _unbuilt_kernel),
        mock.patch.object(AsyncCompile, "cpp", lambda self, source: _unbuilt_kernel),
    ):
        yield


def extern_calls(wrapper_code: str) -> collections.Counter:
    """The extern calls in the ``call`` function of Inductor's generated wrapper, by name."""
    parts = re.split(r"\n\s*def call\(", wrapper_code, maxsplit=1)
    body = parts[-1].partition("\ndef ")[0] if len(parts) == 2 else ""  # up to the next top-level function
    calls = collections.Counter()
    for line in body.splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or stripped.startswith(NOT_LAUNCHES):
            continue
        for match in EXTERN_CALL.finditer(line):
            name = match.group(1).removeprefix("torch.ops.")
            if not name.endswith(NOT_LAUNCHES):
                calls[name] += 1
    return calls


def make_step_cache(model, method: str, budget: float, context: int, steps: int):
    """The method's cache for a compiled step; the stock row: transformers' StaticCache."""
    if method == STOCK:
        from transformers import StaticCache

        return StaticCache(config=model.config, max_cache_len=context + steps)
    if method == "full":
        return make_cache(model, "full", decode_capacity=steps)
    cache = make_cache(model, method, budget)
    if not cache.static_decode:  # a layer that grows while decoding: a fixed capacity for every step
        cache = make_cache(model, method, budget, decode_capacity=steps)
    return cache


def step_function(model, cache, key: str, name: str):
    """``(token [1, 1], position [1, 1]) -> logits [1, V]``, a code object of its own per method."""

    def step(token, position):
        return model(input_ids=token, position_ids=position, **{key: cache}, use_cache=True).logits[:, -1]

    code = step.__code__.replace(co_name="decode_step_" + re.sub(r"\W", "_", name))
    return types.FunctionType(code, step.__globals__, code.co_name, None, step.__closure__)


def count_one(model, prompt, method: str, budget: float, build: bool) -> dict:
    """Prefill, ``EAGER_STEPS`` eager steps, then one compiled step: its kernels and extern calls."""
    key = cache_kwarg(model)
    context = prompt.shape[1]
    steps = EAGER_STEPS + 2
    cache = make_step_cache(model, method, budget, context, steps)
    twin = make_step_cache(model, method, budget, context, steps) if build else None
    with torch.inference_mode(), compiling_attention(model, method != STOCK):
        token = model(input_ids=prompt, **{key: cache}, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)
        step = step_function(model, cache, key, method)
        if build:
            model(input_ids=prompt, **{key: twin}, use_cache=True, logits_to_keep=1)
        position = context
        for _ in range(EAGER_STEPS):
            logits = step(token, torch.tensor([[position]]))
            if build:
                step_function(model, twin, key, method)(token, torch.tensor([[position]]))
            token, position = logits.argmax(-1, keepdim=True), position + 1
        codes: list[str] = []
        torch._dynamo.reset()
        inductor_metrics.reset()
        start = time.perf_counter()
        compiled = torch.compile(step, fullgraph=True, dynamic=False, backend="inductor")
        with mock.patch.object(GraphLowering, "save_output_code", codes.append):
            with contextlib.nullcontext() if build else counting_only():
                try:
                    compiled_logits = compiled(token, torch.tensor([[position]]))
                except NotBuilt:
                    compiled_logits = None
        seconds = time.perf_counter() - start
        kernels = inductor_metrics.generated_kernel_count
        row = {"method": method, "kernels": kernels, "compile_s": round(seconds, 1)}
        if build:
            eager_logits = step_function(model, twin, key, method)(token, torch.tensor([[position]]))
            row["max_abs_diff_vs_eager"] = float((compiled_logits - eager_logits).abs().max())
    if len(codes) != 1:
        row["error"] = f"{len(codes)} graphs compiled (expected one)"
    externs = sum((extern_calls(code) for code in codes), collections.Counter())
    row.update(extern_calls=sum(externs.values()), externs=dict(sorted(externs.items())))
    row["launches"] = row["kernels"] + row["extern_calls"]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=",".join(method_names()), help="kvhive methods (default: every one)")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--budget", type=float, default=0.1, help="ratio of the prompt kept")
    parser.add_argument("--layers", default="2", help="layers of the kv-heavy model; two values (2,4): per added layer")
    parser.add_argument("--build", action="store_true", help="build and run the compiled step, checked against eager")
    parser.add_argument("--json", default=None, help="append one JSON line per method and layer count")
    args = parser.parse_args()
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in method_names()]
    if unknown:
        parser.error(f"--methods: unknown {unknown}; known: {', '.join(method_names())}")
    layer_counts = [int(value) for value in args.layers.split(",") if value]
    if (
        not 1 <= len(layer_counts) <= 2
        or any(n < 1 for n in layer_counts)
        or len(set(layer_counts)) != len(layer_counts)
    ):
        parser.error(f"invalid --layers={args.layers!r}: one or two distinct layer counts >= 1")
    if not 0 < args.budget <= 1:
        parser.error(f"invalid --budget={args.budget}: expected a ratio in (0, 1]")
    inductor_config.force_disable_caches = True  # a cached graph would generate no kernels to count
    inductor_config.compile_threads = 1  # no pool of compile workers (nothing is built by default)
    rows: dict[int, dict[str, dict]] = {}
    for layers in layer_counts:
        torch.manual_seed(0)
        model = kv_heavy_model(num_layers=layers)
        prompt = torch.randint(
            3, model.config.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0)
        )
        rows[layers] = {}
        for method in [STOCK, *methods]:
            try:
                row = count_one(model, prompt, method, args.budget, args.build)
            except Exception as error:  # noqa: BLE001 - a method that does not compile is a result to print
                row = {"method": method, "error": f"{type(error).__name__}: {error}"[:300]}
            row.update(layers=layers, context=args.context, budget=args.budget, torch=torch.__version__)
            rows[layers][method] = row
            print(json.dumps(row), file=sys.stderr, flush=True)
            if args.json:
                with open(args.json, "a") as handle:
                    handle.write(json.dumps(row) + "\n")
    print_table(rows, [STOCK, *methods], layer_counts, args)
    return 0


def print_table(rows: dict, methods: list[str], layer_counts: list[int], args) -> None:
    first = layer_counts[0]
    stock = rows[first][STOCK]
    print(
        f"kv-heavy, {args.context} tokens, budget {args.budget}, torch {torch.__version__}, Inductor on the CPU, "
        f"one steady decode step compiled (fullgraph, static shapes){'' if args.build else ', C++ not built'}"
    )
    header = f"| method | kernels ({first} layers) | x {STOCK} | extern calls | launches | x {STOCK} |"
    if len(layer_counts) == 2:
        header += " kernels per added layer | x " + STOCK + " |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for method in methods:
        row = rows[first][method]
        if "error" in row and "kernels" not in row:
            print(f"| {method} | error: {row['error']} |")
            continue
        cells = [
            method,
            str(row["kernels"]),
            f"{row['kernels'] / stock['kernels']:.2f}",
            str(row["extern_calls"]),
            str(row["launches"]),
            f"{row['launches'] / stock['launches']:.2f}",
        ]
        if len(layer_counts) == 2:
            second = layer_counts[1]
            added = (rows[second][method].get("kernels", float("nan")) - row["kernels"]) / (second - first)
            stock_added = (rows[second][STOCK]["kernels"] - stock["kernels"]) / (second - first)
            cells += [f"{added:g}", f"{added / stock_added:.2f}"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
