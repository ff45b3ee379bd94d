"""Whether the running step is recorded once and replayed: the one test for the device path.

A decode step that ``torch.compile`` traces, or that a CUDA graph captures (``torch.cuda.graph``,
as a server captures its decode step), runs once as Python and is then replayed without it: every
host value it reads (a Python count, a length mirrored on the host, a decision taken on the host)
is baked into all the replays. Such a step must take the device path, the one with device counters,
fixed shapes and every decision as tensor work, that the eager step may shortcut on the host (e.g.
BUZZ's eager step returns "nothing to evict" below its threshold). Under ``torch.compile`` dynamo
would guard on the host values and recompile; a CUDA graph has no guards, so a host shortcut taken
at capture would silently replay (the GPU run of 71b99e7 found it: BUZZ overran its capacity)."""

from __future__ import annotations

import torch
from torch.torch_version import TorchVersion

# torch.compile of a kvhive decode step needs torch >= 2.13: older dynamo does not trace the forward
# pre-hook's switch of the model's attention to kvhive's (config._attn_implementation), so a compiled
# step ran transformers' sdpa over kvhive's buffers, the empty slots of a fixed capacity included
# (44 of 59 tests/test_compiled_decode.py cases fail on torch 2.11; a bf16 bench on torch 2.11 on a
# GPU returned timings of that wrong step). Below it a cache says it does not compile
# (KVHiveCache.is_compileable), so transformers' generate decodes it eagerly; CUDA graphs of an
# eager step (no dynamo) still work.
COMPILE_MIN_TORCH = "2.13"
TORCH_COMPILES_KVHIVE = TorchVersion(torch.__version__) >= COMPILE_MIN_TORCH


def in_static_step() -> bool:
    """True while ``torch.compile`` traces the step or a CUDA graph captures it (see the module doc)."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# The prefill selections' fast path (issue 25): BumbleBee's greedy and SubGen's farthest-point order
# run each step as one fixed-shape function, compiled with inductor where torch compiles kvhive, the
# whole loop captured as one CUDA graph per shape and replayed for later layers of that shape (the
# same kept sets as the eager loops; docs/METHODS.md). None: on CUDA only (the CPU runs the eager
# loops, the reference); True / False: on every device / nowhere (benchmarks/bench_gpu.py
# --prefill-path sets it).
PREFILL_FAST_PATH: bool | None = None
# Whether the fast path compiles its step (inductor, where torch compiles kvhive). Compiling fuses a
# greedy step's ~170 kernels into a few, but costs a compile per new shape (prompt length, budget) and
# gain bucket, tens of seconds each; False captures the eager step as it is (no compile: more kernels
# per step, still one launch per layer).
PREFILL_COMPILE: bool = True


def prefill_fast_path(device: torch.device) -> bool:
    """Whether a prefill selection on ``device`` takes the fast path by default."""
    if PREFILL_FAST_PATH is not None:
        return PREFILL_FAST_PATH
    return torch.device(device).type == "cuda"
