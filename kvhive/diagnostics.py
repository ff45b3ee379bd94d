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
at the Python level. Used by the tests (a steady decode step must make no host read) and by
``kvhive bench`` (host reads next to each timing).
"""

from __future__ import annotations

import collections
import threading

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# Python-level calls that read a device value on the host.
HOST_READ_METHODS = frozenset(
    {"cpu", "tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__", "equal"}
)
# Python data sent to the device (a blocking host-to-device copy on a GPU).
HOST_TO_DEVICE_FUNCTIONS = frozenset({"tensor", "as_tensor"})
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
        name = getattr(func, "__name__", "")
        if name in HOST_READ_METHODS:
            self.counter._record(name)
            with self.counter._python_read():
                return func(*args, **(kwargs or {}))
        if name in HOST_TO_DEVICE_FUNCTIONS and args and not isinstance(args[0], torch.Tensor):
            self.counter._record(f"{name}(python data)")
        return func(*args, **(kwargs or {}))


class _DispatchLevel(TorchDispatchMode):
    def __init__(self, counter: HostReadCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if not self.counter._inside_python_read():
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
