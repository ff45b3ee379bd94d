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


def in_static_step() -> bool:
    """True while ``torch.compile`` traces the step or a CUDA graph captures it (see the module doc)."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
