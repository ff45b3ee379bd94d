"""Host reads: the CPU proxy for host-device synchronisation on a GPU.

On a GPU, a decode step stalls whenever the host waits for a device value (``item``, ``bool`` of a
tensor, ``nonzero``'s data-dependent size, ``.cpu()``...) and pays a blocking copy whenever Python
data is sent to the device. On the CPU none of this costs anything, so timings hide it; counting
the calls does not. :class:`HostReadCounter` counts them at two levels, because some reads never
reach the dispatcher on the CPU (``.cpu()`` of a CPU tensor is a no-op there):

* a ``TorchFunctionMode`` sees the Python-level calls: ``.cpu()``, ``.tolist()``, ``.item()``,
  ``.numpy()``, ``__bool__``/``__int__``/``__float__``/``__index__``, ``torch.equal``, and Python data
  turned into tensors (``torch.tensor(list)``, ``torch.as_tensor(list)``: a host-to-device copy on a GPU);
* a ``TorchDispatchMode`` sees the aten ops whose result the host must wait for:
  ``_local_scalar_dense``, ``nonzero``, ``masked_select``, ``unique``, boolean-mask indexing and
  ``repeat_interleave`` without ``output_size``.

A Python-level read that also dispatches (``item`` -> ``_local_scalar_dense``) is counted once,
at the Python level.

Host tensors. On the CPU every tensor is on "the device", so the counter keeps track of which tensors
a GPU run would hold in host memory: a ``.cpu()`` result (a copy of its own here, as on a GPU), a
tensor made from Python data or by a factory (``arange``, ``zeros``...) without a ``device``, and
whatever an op computes from host tensors alone. Reading a host tensor is host arithmetic, not a
synchronisation, and is not counted; sending one to a device (``.to(device)``, ``.cuda()``, ``torch.tensor(list,
device=...)``, or handing it to an op on device tensors, e.g. as an index) is a host-to-device copy
and is counted. Used by the tests (a steady decode step must make no host read) and by
``kvhive bench`` (host reads next to each timing).
"""

from __future__ import annotations

import collections
import threading
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# Python-level calls that read a device value on the host.
HOST_READ_METHODS = frozenset(
    {"cpu", "tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__", "equal"}
)
# Python data sent to the device (a blocking host-to-device copy on a GPU).
HOST_TO_DEVICE_FUNCTIONS = frozenset({"tensor", "as_tensor"})
# Python-level calls that move a tensor to the device (a host-to-device copy when it is a host tensor).
TO_DEVICE_METHODS = frozenset({"to", "cuda"})
# Python-level calls that make a tensor without tensor inputs: a host tensor unless given a device.
FACTORY_FUNCTIONS = frozenset(
    {"arange", "zeros", "ones", "full", "empty", "tensor", "as_tensor", "linspace", "eye", "randperm", "rand", "randn"}
)
# aten ops whose output size or value the host must wait for.
SYNCING_OPS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_consecutive"})


def _is_boolean_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(index, torch.Tensor) and index.dtype == torch.bool for index in indices or ())


class _FunctionLevel(TorchFunctionMode):
    def __init__(self, counter: HostReadCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        counter = self.counter
        tensors = [
            value for value in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(value, torch.Tensor)
        ]
        from_host = bool(tensors) and all(counter.is_host(tensor) for tensor in tensors)
        if name in HOST_READ_METHODS:
            if from_host:  # host arithmetic on a value read back earlier
                with counter._python_read():
                    return func(*args, **kwargs)
            counter._record(name)
            with counter._python_read():
                result = func(*args, **kwargs)
            if name == "cpu":
                # A copy of its own, as on a GPU (on the CPU .cpu() returns the tensor itself).
                result = result.clone() if result is args[0] else result
                counter._mark_host(result)
            return result
        if name in TO_DEVICE_METHODS and from_host and _names_a_device(args[1:], kwargs, name):
            counter._record(f"{name}(host tensor)")
            with counter._python_read():
                result = func(*args, **kwargs)
            return result.clone() if result is args[0] else result  # a device copy: not a host tensor
        if name in HOST_TO_DEVICE_FUNCTIONS and args and not isinstance(args[0], torch.Tensor):
            if kwargs.get("device") is not None:
                counter._record(f"{name}(python data)")
                return func(*args, **kwargs)
        if not from_host and any(counter.is_host(tensor) and tensor.dim() > 0 for tensor in tensors):
            # A host tensor (not a 0-d one, which a device op takes as a scalar) in an op on device
            # tensors, e.g. as an index: the op copies it to the device first.
            counter._record(f"{name}(host tensor on the device)")
            with counter._python_read():
                return func(*args, **kwargs)
        result = func(*args, **kwargs)
        made_on_host = not tensors and name in FACTORY_FUNCTIONS and kwargs.get("device") is None
        if from_host or made_on_host:
            for output in torch.utils._pytree.tree_leaves(result):
                if isinstance(output, torch.Tensor):
                    counter._mark_host(output)
        return result


def _names_a_device(args, kwargs, name: str) -> bool:
    """Whether a ``.to`` / ``.cuda`` call moves the tensor to a device (not only a dtype change)."""
    if name == "cuda":
        return True
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(value, (str, torch.device)) for value in args) or any(
        isinstance(value, torch.Tensor) for value in args
    )


class _DispatchLevel(TorchDispatchMode):
    def __init__(self, counter: HostReadCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if not self.counter._inside_python_read() and not self.counter._all_host(args, kwargs):
            if name in SYNCING_OPS:
                self.counter._record(name)
            elif name == "index" and _is_boolean_index(args):
                self.counter._record("index(boolean mask)")
            elif name == "repeat_interleave" and kwargs.get("output_size") is None:
                self.counter._record("repeat_interleave(no output_size)")
        return func(*args, **kwargs)


class HostReadCounter:
    """Context manager counting host reads (see the module docstring).

    ``counter.total`` is the number of reads, ``counter.reads`` a ``Counter`` by kind. Counts are
    per thread of use: enter it on the thread that runs the code being measured.
    """

    def __init__(self) -> None:
        self.reads: collections.Counter[str] = collections.Counter()
        self._local = threading.local()
        self._modes: list = []
        # The tensors a GPU run would hold in host memory (see the module docstring), by identity (a
        # tensor's == is elementwise, so no WeakSet): id -> weak reference, dropped with the tensor.
        self._host: dict[int, weakref.ref] = {}

    def is_host(self, tensor: torch.Tensor) -> bool:
        reference = self._host.get(id(tensor))
        return reference is not None and reference() is tensor

    def _mark_host(self, tensor: torch.Tensor) -> None:
        key = id(tensor)
        host = self._host

        def forget(_reference, key=key):
            if host.get(key) is _reference:
                del host[key]

        host[key] = weakref.ref(tensor, forget)

    def _all_host(self, args, kwargs) -> bool:
        tensors = [
            value for value in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(value, torch.Tensor)
        ]
        return bool(tensors) and all(self.is_host(tensor) for tensor in tensors)

    @property
    def total(self) -> int:
        return sum(self.reads.values())

    def _record(self, kind: str) -> None:
        self.reads[kind] += 1

    def _inside_python_read(self) -> bool:
        return getattr(self._local, "depth", 0) > 0

    def _python_read(self):
        counter = self

        class _Scope:
            def __enter__(self):
                counter._local.depth = getattr(counter._local, "depth", 0) + 1

            def __exit__(self, *exc):
                counter._local.depth -= 1

        return _Scope()

    def __enter__(self) -> HostReadCounter:
        self._modes = [_FunctionLevel(self), _DispatchLevel(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []

    def __repr__(self) -> str:
        return f"HostReadCounter(total={self.total}, reads={dict(self.reads)})"
