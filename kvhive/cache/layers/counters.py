"""Counts a layer keeps twice: on the host, for host-side decisions, and on the device, for the
decode step.

A compiled or captured decode step may not read or change a Python int (the graph would guard on it
and recompile at every step), so inside one only the device count moves and the host copy is marked
stale; it is read back, once, the next time the host asks for it outside a step. A CUDA graph's
replays run no Python at all: a caller that replayed one re-reads every count (:meth:`Count.reread`,
``LayerStore.trust_the_device``). Every other change (an eager append, an eviction whose count the
host knows) moves both, so an eager decode step that evicts nothing reads nothing back.
"""

from __future__ import annotations

import torch

from kvhive import static_step


class Count:
    """One count: ``host`` (an int) and ``device`` (a 0-d int64 tensor, or None before the layer has a
    device), ``stale`` while the device moved alone."""

    def __init__(self, host=0, device: torch.Tensor | None = None) -> None:
        self.host = host
        self.device = device
        self.stale = False

    @property
    def value(self):
        """The host value (read back from the device, once, when stale)."""
        if self.stale:
            return self.refresh()
        return self.host

    def refresh(self):
        """Read the device value back (one host read) and return it."""
        self.host = self.read(self.device)
        self.stale = False
        return self.host

    def reread(self) -> None:
        """Trust the device: read it back now (after steps that may have moved it unseen)."""
        if self.device is not None:
            self.refresh()

    def mark_stale(self) -> None:
        self.stale = True

    def set(self, value) -> None:
        """Set both copies."""
        self.host = value
        self.stale = False
        if self.device is not None:
            self.device.fill_(value)

    def advance(self, count: int) -> None:
        """Add ``count`` on the device, and on the host unless a static step runs (or the host copy
        is stale already: it then stays stale, with no read)."""
        self.device.add_(count)
        if static_step.in_static_step() or self.stale:  # (first: a static step guards on no host flag)
            self.stale = True
        else:
            self.host = self.host + count

    @staticmethod
    def read(device: torch.Tensor):
        return int(device)


class RowCounts(Count):
    """A count per batch row: ``host`` a list of ints, ``device`` a ``[B]`` int64 tensor."""

    @staticmethod
    def read(device: torch.Tensor):
        return device.tolist()

    def set(self, value: list[int]) -> None:
        self.host = value
        self.stale = False
        self.device.copy_(torch.tensor(value, dtype=torch.int64))

    def advance(self, count: int, active: torch.Tensor | None = None, active_host: list[bool] | None = None) -> None:
        """Add ``count`` to every row (with ``active`` [B] bool on the device and ``active_host`` on the
        host, to the active rows only)."""
        if active is None:
            self.device.add_(count)
        else:
            self.device.add_(active.to(torch.int64) * count)
        if static_step.in_static_step() or self.stale:  # (first: a static step guards on no host flag)
            self.stale = True
            return
        running = active_host or [True] * len(self.host)
        self.host = [value + count if run else value for value, run in zip(self.host, running, strict=True)]

    def set_row(self, row: int, value: int) -> None:
        """Set row ``row`` of both copies."""
        host = self.value
        host[row] = value
        self.device[row].fill_(value)

    def select(self, rows: list[int], device_index: torch.Tensor) -> RowCounts:
        """The counts of batch rows ``rows`` (``device_index`` on the device), a new object."""
        host = self.value
        return RowCounts([host[row] for row in rows], self.device.index_select(0, device_index))


class SegmentLengths(Count):
    """A packed layer's tokens per segment: ``host`` a CPU ``[S]`` int64 tensor, ``device`` an ``[S]``
    int32 tensor; with the two host ints an append decides by, without touching a tensor: the
    longest segment and the least room any segment has left (``capacities`` minus its length)."""

    def __init__(self, host: torch.Tensor, device: torch.Tensor, capacities: torch.Tensor, empty_room: int) -> None:
        super().__init__(host, device)
        self.capacities = capacities
        self.empty_room = empty_room
        self._derive()

    def _derive(self) -> None:
        lengths = self.host
        self.longest = int(lengths.max()) if lengths.numel() else 0
        self.headroom = int((self.capacities - lengths).min()) if lengths.numel() else self.empty_room

    def refresh(self):
        self.host = self.device.cpu().long()
        self.stale = False
        self._derive()
        return self.host

    def room(self) -> int:
        """The least room left in any segment (host)."""
        if self.stale:
            self.refresh()
        return self.headroom

    def most(self) -> int:
        """The longest segment (host)."""
        if self.stale:
            self.refresh()
        return self.longest

    def advance(self, count: int) -> None:
        """After the device lengths moved by ``count`` each (the write does that): the host's too,
        unless a static step runs."""
        if static_step.in_static_step() or self.stale:  # (first: a static step guards on no host flag)
            self.stale = True
            return
        self.host = self.host + count
        self.headroom -= count
        self.longest += count
