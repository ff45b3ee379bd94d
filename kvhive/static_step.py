"""Whether the running step is recorded once and replayed: the one test for the device path.

A decode step that ``torch.compile`` traces, or that a CUDA graph captures (``torch.cuda.graph``,
as a server captures its decode step), runs once as Python and is then replayed without it: every
host value it reads (a Python count, a length mirrored on the host, a decision taken on the host)
is baked into all the replays. Such a step must take the device path, the one with device counters,
fixed shapes and every decision as tensor work, that the eager step may shortcut on the host (e.g.
BUZZ's eager step returns "nothing to evict" below its threshold). Under ``torch.compile`` dynamo
would guard on the host values and recompile; a CUDA graph has no guards, so a host shortcut taken
at capture would silently replay (BUZZ would overrun its capacity)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator

import torch
from torch.torch_version import TorchVersion

# torch.compile traces kvhive's forward pre-hook, which switches the model's attention to kvhive's
# (config._attn_implementation) for a forward given a kvhive cache, from torch 2.13 on. Older dynamo
# reads a transformers config as constants of the object before the call (it does not see a switch
# made inside the trace): a compiled step ran transformers' sdpa over kvhive's buffers, the empty slots
# of a fixed capacity included (44 of 59 tests/cache/test_compiled_decode.py cases failed on torch
# 2.11; kvhive's attention guard now refuses such a step by name). There the route is chosen outside
# the graph: the attention is switched before the compiled call starts. transformers' generate
# compiles the model's forward through model.get_compiled_call, which kvhive wraps to switch before
# each compiled call given a kvhive cache (kvhive.attention.hooks), so model.generate compiles a
# kvhive cache's decode step on every torch (KVHiveCache.is_compileable). A step compiled by one's
# own torch.compile runs inside kvhive.compression(model) there, as kvhive's own compiled paths do
# (generate(compile=True), generate_batch(compile=...), kvhive bench --compile,
# benchmarks/bench_gpu.py's +compile rows; checked on torch 2.11: every method's compiled step equal
# to eager, one graph). Inside that block the model runs kvhive's attention for every call (plain
# sdpa for other caches), so two threads should not use the model, one compiling, at once there.
COMPILE_MIN_TORCH = "2.13"
TORCH_COMPILES_KVHIVE = TorchVersion(torch.__version__) >= COMPILE_MIN_TORCH
# How many kvhive.compression blocks this thread (or task) is in: the attention switched before the call.
_ATTENTION_SWITCHED = contextvars.ContextVar("kvhive_attention_switched", default=0)


def compiles_kvhive() -> bool:
    """Whether a decode step compiled now by one's own ``torch.compile`` runs kvhive's attention: on a
    torch whose dynamo traces the forward pre-hook's switch, or inside :func:`attention_switched`
    (``kvhive.compression``, and transformers' compiled forward of an attached model). Inside a trace
    it is: a step compiling without the switch is refused by the pre-hook itself (dynamo cannot read
    the context variable)."""
    return TORCH_COMPILES_KVHIVE or torch.compiler.is_compiling() or _ATTENTION_SWITCHED.get() > 0


@contextlib.contextmanager
def attention_switched() -> Iterator[None]:
    """Mark the block as one whose model already runs kvhive's attention (``kvhive.compression``)."""
    token = _ATTENTION_SWITCHED.set(_ATTENTION_SWITCHED.get() + 1)
    try:
        yield
    finally:
        _ATTENTION_SWITCHED.reset(token)


def in_static_step() -> bool:
    """True while ``torch.compile`` traces the step or a CUDA graph captures it (see the module doc)."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@dataclasses.dataclass
class StepConfig:
    """The run-time switches of the recorded paths, one object (``kvhive.static_step.config``) that
    benchmarks and tests change in one place, preferably through :func:`configured`.

    ``prefill_fast_path``: whether the prefill selections (BumbleBee's greedy, SubGen's
    farthest-point order) run each step as one fixed-shape function, the whole loop captured as one
    CUDA graph per shape and replayed for later layers of that shape (the same kept sets as the
    eager loops; docs/METHODS.md). None: on CUDA only (the CPU runs the eager loops, the
    reference); True / False: on every device / nowhere.

    ``prefill_compile``: whether the fast path compiles its step with inductor. Compiling fuses a
    greedy step's many kernels into a few but costs a compile per new shape (prompt length, budget)
    and gain bucket; False captures the eager step as it is (more kernels per step, still one
    launch per layer).

    ``prefill_kernels``: whether the fast path runs a method's own Triton kernel where it has one
    and Triton runs (SubGen's farthest-point pick: ``kvhive.methods.farthest_kernel``, one launch a
    pick reading the keys in their dtype) instead of its torch step; False: the torch step
    (compiled where ``prefill_compile``).

    ``conditional_eviction``: whether a captured decode step records a method's eviction as a CUDA
    graph conditional node, so the replay runs the decision's and the compaction's kernels only at
    the steps the method flags (``Policy.decode_eviction_due``). None: where the running torch
    records them (built with CUDA >= 12.4); False: never (every replayed step runs the decision,
    which keeps every token at a step that evicts nothing).
    """

    prefill_fast_path: bool | None = None
    prefill_compile: bool = True
    prefill_kernels: bool = True
    conditional_eviction: bool | None = None


config = StepConfig()
_CONFIG_LOCK = threading.Lock()


@contextlib.contextmanager
def configured(**changes: bool | None) -> Iterator[StepConfig]:
    """Change fields of :data:`config` for the block and restore them after it; an unknown field
    is refused with a ``TypeError`` naming the fields. The config is process-wide: every thread
    sees the change while the block runs."""
    fields = {field.name for field in dataclasses.fields(StepConfig)}
    unknown = sorted(set(changes) - fields)
    if unknown:
        raise TypeError(
            f"unknown StepConfig field(s) {', '.join(unknown)}: expected some of {', '.join(sorted(fields))}"
        )
    with _CONFIG_LOCK:
        saved = {name: getattr(config, name) for name in changes}
        for name, value in changes.items():
            setattr(config, name, value)
    try:
        yield config
    finally:
        with _CONFIG_LOCK:
            for name, value in saved.items():
                setattr(config, name, value)


def prefill_fast_path(device: torch.device) -> bool:
    """Whether a prefill selection on ``device`` takes the fast path by default."""
    if config.prefill_fast_path is not None:
        return config.prefill_fast_path
    return torch.device(device).type == "cuda"


def captures_conditional_nodes() -> bool:
    """True while a CUDA graph captures the step (not a trace) on a build that records conditional
    nodes (``CUDAGraph.begin_capture_to_if_node``, CUDA >= 12.4), unless ``config.conditional_eviction``
    is False."""
    if config.conditional_eviction is False or torch.compiler.is_compiling():
        return False
    if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return False
    return _records_conditional_nodes()


@functools.cache
def _records_conditional_nodes() -> bool:
    if torch.version.cuda is None or not hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node"):
        return False
    major, minor = (int(part) for part in torch.version.cuda.split(".")[:2])
    return (major, minor) >= (12, 4)


def run_if(predicate: torch.Tensor | None, work: Callable[[], None]) -> None:
    """Run ``work``, device work in place with no result; given a ``predicate`` (a 0-d bool tensor
    on the capturing device, only while :func:`captures_conditional_nodes`), record it inside an
    if-node of the capturing CUDA graph, so that each replay runs its kernels only where the
    predicate holds then. ``work`` must change nothing where the predicate is False: eager and
    compiled steps run it unconditionally (tests/cache/test_conditional_eviction.py runs the captured step
    skipping it on the host where the predicate is False, against eager steps)."""
    if predicate is None:
        work()
        return
    graph = torch.cuda.CUDAGraph.get_currently_capturing_graph()
    try:
        graph.begin_capture_to_if_node(predicate)
    except RuntimeError as error:
        # Refused before anything was recorded (its checks come first: e.g. the allocator's
        # graph_capture_record_stream_reuse, which conditional nodes do not support yet): the work is
        # recorded unconditionally, as in an eager step (the same results, every replay paying for it).
        warnings.warn(
            f"kvhive: a CUDA graph if-node was refused ({error}); the work runs at every replay", stacklevel=2
        )
        work()
        return
    try:
        work()
    finally:
        graph.end_capture_to_conditional_node()


class BoundedCache:
    """At most ``held`` entries, the oldest made dropped first (prompt lengths come and go), shared by
    the process's threads: each entry is made once, under a lock, and none is lost to a race."""

    def __init__(self, held: int):
        self.entries: dict = {}
        self.held = held
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key, make: Callable[[int], object]):
        """The entry at ``key``, made by ``make(number)`` if absent (``number``: how many entries
        were held then, a name suffix for a compiled function's code object)."""
        with self._lock:
            value = self.entries.get(key)
            if value is None:
                value = make(len(self.entries))
                while len(self.entries) >= self.held:
                    self.entries.pop(next(iter(self.entries)))
                self.entries[key] = value
            return value

    def clear(self) -> None:
        with self._lock:
            self.entries.clear()


# Every CapturedLoops alive (release_captured_loops walks them; the forward hook skips the walk when empty).
LIVE_CAPTURED_LOOPS: weakref.WeakSet = weakref.WeakSet()
# One lock for every CapturedLoops: a capture in one thread (BumbleBee's) never overlaps another
# thread's capture or replay (SubGen's) either.
_CAPTURED_LOOPS_LOCK = threading.RLock()


def capture_stream() -> torch.cuda.Stream:
    """A stream of its own for one capture: ``torch.cuda.graph``'s default is one side stream shared
    by the whole process, which a capture in another thread (a server capturing its decode step)
    may be recording into at the same time."""
    return torch.cuda.Stream()


# Captured prefill loops whose input buffers hold more than this many bytes are dropped at the end of
# the forward that used them (kvhive's forward hook calls release_captured_loops with it): kept, they
# would hold BumbleBee's R x n x n similarity matrix through the decode it compressed the cache for
# (R x n x n float32: sixteen times larger at a 32k prompt than at 8k). Smaller ones stay for the next
# prompt of their shapes (one capture's host time saved per prompt).
HELD_LOOP_BYTES = 4 << 30


def release_captured_loops(larger_than: int | None = None, wait: bool = True) -> int:
    """Drop the prefill loops kvhive captured as CUDA graphs (BumbleBee's greedy, SubGen's
    farthest-point order: :class:`CapturedLoops`), with their graph memory and input buffers (the
    largest: BumbleBee's ``R x n x n`` float32 similarity matrix). They are kept after a prefill so that the next prompt of the same shapes replays them
    instead of capturing again; a server that decodes long after its prefills, or moves on to other
    prompt lengths, frees that memory here (``torch.cuda.empty_cache()`` then hands it back to the
    device). The next prefill of a shape captures again. ``larger_than``: only the loops whose input
    buffers hold more bytes; ``wait=False``: skip the loops another thread is using. Returns how many
    graphs were dropped."""
    return sum(loops.release(larger_than, wait) for loops in list(LIVE_CAPTURED_LOOPS))


def _held_bytes(graph) -> int:
    """Bytes of a captured loop's input buffers (``inputs``: a dict or a sequence of tensors; a view
    counts its whole storage, buffers shared by captures count in each)."""
    inputs = graph.inputs.values() if isinstance(graph.inputs, dict) else graph.inputs
    return sum(tensor.untyped_storage().nbytes() for tensor in inputs)


def per_thread_attributes(module_name: str, *names: str) -> None:
    """Make each of ``names`` an attribute of module ``module_name`` whose value is the calling
    thread's own (None until that thread sets it), read and written as a plain module attribute
    (``module.name``): a diagnostic such as "which path the last call took" then answers for the
    thread that asks, not for whichever thread ran last. Code in the module itself writes it
    through the module object (``sys.modules[__name__].name = ...``), as a ``global`` assignment
    would bypass it. A later call adds its names to those of an earlier one (the module's class is
    extended, not replaced)."""
    module = sys.modules[module_name]
    local = threading.local()

    def attribute(name: str) -> property:
        return property(lambda _: getattr(local, name, None), lambda _, value: setattr(local, name, value))

    namespace = {name: attribute(name) for name in names}
    module.__class__ = type(f"PerThread_{module_name.replace('.', '_')}", (type(module),), namespace)


class CapturedLoops:
    """Prefill loops captured as CUDA graphs (BumbleBee's greedy, SubGen's farthest-point order),
    shared by every thread of the process: at most ``held``, the least recently used dropped first.

    A captured graph reads fixed input buffers that each call overwrites with its layer's inputs
    (captures of one shape may share them, and BumbleBee computes a layer's similarity matrix straight
    into one), then replays and copies its results out. Two threads doing that at once would replay
    on each other's inputs. So every use of the graphs and their buffers runs inside :meth:`using`:
    one thread at a time (a reentrant lock: a caller that writes into a buffer holds it over the
    replay that reads it), and on the GPU the work a thread enqueued there, on whatever stream, is
    finished before the next thread's work there starts (an event recorded on leaving, waited for
    by the next stream on entering: no host wait). The lock is shared by every instance. The
    captures themselves run on a stream of their own (:func:`capture_stream`) with
    ``capture_error_mode="thread_local"`` (as torch's own cudagraph trees do), so a capture in one
    thread does not fail another thread's CUDA calls."""

    def __init__(self, held: int):
        self.graphs: dict = {}  # key -> captured loop, most recently used last
        self.held = held
        self._lock = _CAPTURED_LOOPS_LOCK
        self._depth = 0  # nesting of the owning thread's using() (changed only under the lock)
        self._finished: dict[torch.device, torch.cuda.Event] = {}
        LIVE_CAPTURED_LOOPS.add(self)

    def release(self, larger_than: int | None = None, wait: bool = True) -> int:
        """Drop every graph, or those whose input buffers hold more than ``larger_than`` bytes
        (waiting for a thread using them to finish, or, with ``wait=False``, dropping none while one
        is; and for the device to finish the work enqueued with them: their memory may be reused at
        once); how many were dropped."""
        if not self._lock.acquire(blocking=wait):
            return 0
        try:
            doomed = [
                key for key, graph in self.graphs.items() if larger_than is None or _held_bytes(graph) > larger_than
            ]
            if doomed:
                for finished in self._finished.values():
                    finished.synchronize()
            for key in doomed:
                del self.graphs[key]
            return len(doomed)
        finally:
            self._lock.release()

    @contextlib.contextmanager
    def using(self, device: torch.device | str) -> Iterator[dict]:
        """Hold the graphs (yielded: the dict itself) for this thread, stream-ordered after the last
        holder's work on ``device``."""
        device = torch.device(device)
        with self._lock:
            outermost = self._depth == 0
            # Not while a caller's capture records this stream (it cannot wait for an event recorded
            # outside it): the caller's graph then replays on its own stream order.
            ordered = outermost and device.type == "cuda" and not torch.cuda.is_current_stream_capturing()
            self._depth += 1
            try:
                if ordered and device in self._finished:
                    torch.cuda.current_stream(device).wait_event(self._finished[device])
                yield self.graphs
            finally:
                self._depth -= 1
                if ordered:
                    finished = torch.cuda.Event()
                    finished.record(torch.cuda.current_stream(device))
                    self._finished[device] = finished

    def take(self, key):
        """The graph at ``key``, removed (None if absent); put it back with :meth:`put`."""
        return self.graphs.pop(key, None)

    def make_room(self) -> None:
        """Drop the least recently used graphs until one more fits."""
        while len(self.graphs) >= self.held:
            self.graphs.pop(next(iter(self.graphs)))

    def put(self, key, graph) -> None:
        self.graphs[key] = graph  # most recently used last
