"""Kernels of one steady decode step as a CUDA graph captures it, per method, counted on the CPU.

A captured step is an eager step with ``in_static_step()`` forced True (as tests/cache/test_slot_capture.py
takes it); on a GPU its replay is launch-bound, each aten operation that is not a view one kernel
node that every replay runs. The tiny Llama-GQA model (2 layers), a 160-token prompt, budget 48,
after 6 decode steps. On the CPU the attention of a method that reads weights is the torch path
(~10 kernels a layer); on CUDA the split-K kernel returns them. ``--conditional``: the steps as a
replay runs them where torch records conditional nodes (``kvhive.static_step.run_if``): a method
that flags its eviction steps (``Policy.decode_eviction_due``) has its decision and compaction
skipped where the flag is False; counted over ``--steps`` captured steps (kernels -> steps).
It only counts; results/captured_step_kernels.md has the figures.

    python benchmarks/captured_step_ops.py [--methods buzz,snapkv] [--conditional --steps 80]
"""

from __future__ import annotations

import argparse
import collections
import importlib
import sys
import warnings
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

VIEWS = {
    "view",
    "_unsafe_view",
    "slice",
    "t",
    "transpose",
    "unsqueeze",
    "expand",
    "alias",
    "squeeze",
    "select",
    "as_strided",
    "permute",
    "detach",
    "_reshape_alias",
    "unbind",
    "split",
    "lift_fresh",
    "diagonal",
    "scalar_tensor",  # a Python scalar wrapped on the host: no kernel
}


class KernelCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.kernels = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            self.kernels[name] += 1
        return func(*args, **(kwargs or {}))


def _skipping_if_node(flags: list):
    def run_if(predicate, work):
        if predicate is None:
            work()
            return
        flags.append(bool(predicate))
        if flags[-1]:
            work()

    return run_if


def captured_steps(model, cache, token, steps: int, conditional: bool) -> list[tuple[int, tuple]]:
    """``(kernels, flags)`` of each of ``steps`` captured steps."""
    from test_slot_capture import STATIC_STEP_USERS

    modules = [importlib.import_module(name) for name in STATIC_STEP_USERS]
    compressor = importlib.import_module("kvhive.cache.compressor")
    counts = []
    for _ in range(steps):
        saved = [(module, module.in_static_step) for module in modules]
        saved_cache = (compressor.captures_conditional_nodes, compressor.run_if)
        flags: list = []
        for module in modules:
            module.in_static_step = lambda: True
        if conditional:
            compressor.captures_conditional_nodes, compressor.run_if = (lambda: True), _skipping_if_node(flags)
        try:
            with KernelCount() as count:
                token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        finally:
            for module, function in saved:
                module.in_static_step = function
            compressor.captures_conditional_nodes, compressor.run_if = saved_cache
        counts.append((sum(count.kernels.values()), tuple(flags)))
    return counts


def main() -> None:
    import kvhive
    from kvhive.models import tiny_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=",".join(kvhive.method_names()))
    parser.add_argument("--conditional", action="store_true")
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = tiny_model("llama", "gqa")
    prompt = torch.randint(3, model.config.vocab_size, (1, 160), generator=torch.Generator().manual_seed(0))
    for method in args.methods.split(","):
        cache = kvhive.make_cache(model, method, budget=None if method == "full" else 48)
        with torch.no_grad():
            token = model(input_ids=prompt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            for _ in range(6):
                token = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            counts = captured_steps(model, cache, token, args.steps, args.conditional)
        summary = ", ".join(
            f"{kernels} x {times}" for kernels, times in collections.Counter(k for k, _ in counts).items()
        )
        print(f"{method:<18} kernels per step: {summary}", flush=True)


if __name__ == "__main__":
    main()
