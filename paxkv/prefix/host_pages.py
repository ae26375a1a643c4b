"""Where the host tier's pages live (:mod:`paxkv.prefix.host_tier` keeps the bookkeeping):
per page in an accelerator's pinned host memory, else in numpy arrays (the engine's choice:
:func:`paxkv.engine.setup.host_memory_kind`).

Both take a batch of pages gathered on the device (``[layers, n, ...]`` per pool array,
still being computed: :func:`paxkv.prefix.host_copies.gather_pages`) and start its transfer
without waiting; both give pages back as ``[layers, width, ...]`` per pool array, ready for
:func:`paxkv.prefix.host_copies.restore_pages`::

    PinnedPages   slot -> one array per pool array, memory_kind="pinned_host": the device
                  copies straight into it and back (DMA on a GPU); a page is its own buffer,
                  so nothing stale can be read and a dropped page frees its bytes at once
    NumpyPages    one [capacity, layers, ...] numpy array per pool array, a slot a page;
                  transfers land (``copy_to_host_async``, then a write into the slots) when
                  :meth:`NumpyPages.settle` finds them done or a read needs one
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(eq=False)  # found by identity: its arrays have no truth value
class _Copy:
    """One device-to-host transfer in flight: ``arrays[i][:, columns[j]]`` lands in
    ``slots[j]``."""

    arrays: tuple[Any, ...]
    slots: list[int]
    columns: list[int]


class PinnedPages:
    """Pages in pinned host memory, one buffer per page and pool array (one device)."""

    memory_kind = "pinned_host"

    def __init__(self, capacity: int):
        self.pages: dict[int, tuple[jax.Array, ...]] = {}

    def put(self, slots: Sequence[int], arrays: tuple[Any, ...], columns: Sequence[int]) -> None:
        device = [tuple(a[:, j] for a in arrays) for j in columns]  # dispatched, not waited on
        pinned = jax.device_put(device, device[0][0].sharding.with_memory_kind("pinned_host"))
        self.pages.update(zip(slots, pinned))

    def read(self, slots: Sequence[int], width: int) -> tuple[jax.Array, ...]:
        pages = [self.pages[s] for s in slots] + [self.pages[slots[0]]] * (width - len(slots))
        on_device = jax.device_put(pages, pages[0][0].sharding.with_memory_kind("device"))
        return tuple(jnp.stack([p[i] for p in on_device], axis=1) for i in range(len(pages[0])))

    def drop(self, slot: int) -> None:
        self.pages.pop(slot, None)

    def settle(self, block: bool = False) -> int:
        """Pages whose transfer is not yet done (JAX orders a read after them: nothing lands
        by hand)."""
        if block:
            jax.block_until_ready(list(self.pages.values()))
        return sum(not all(a.is_ready() for a in p) for p in self.pages.values())

    def clear(self) -> None:
        self.pages.clear()


class NumpyPages:
    """Pages in numpy arrays, ``[capacity, layers, ...]`` per pool array (allocated on the
    first put: ``arrays``, which tests may fill with NaN first)."""

    memory_kind = "numpy"

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.arrays: list[np.ndarray] | None = None
        self._pending: list[_Copy] = []
        self._waiting: dict[int, _Copy] = {}  # slot -> its copy in flight

    def put(self, slots: Sequence[int], arrays: tuple[Any, ...], columns: Sequence[int]) -> None:
        if self.arrays is None:
            self.arrays = [np.empty((self.capacity, a.shape[0]) + tuple(a.shape[2:]),
                                    np.dtype(a.dtype)) for a in arrays]
        for a in arrays:
            a.copy_to_host_async()
        copy = _Copy(arrays, list(slots), list(columns))
        self._pending.append(copy)
        self._waiting.update((s, copy) for s in slots)

    def read(self, slots: Sequence[int], width: int) -> tuple[np.ndarray, ...]:
        for copy in {id(self._waiting[s]): self._waiting[s] for s in slots
                     if s in self._waiting}.values():
            self._land(copy)
        padded = list(slots) + [slots[0]] * (width - len(slots))
        return tuple(np.moveaxis(a[padded], 0, 1) for a in self.arrays)

    def drop(self, slot: int) -> None:
        copy = self._waiting.get(slot)
        if copy is not None:
            self._land(copy)  # the slot is reused next: its old copy must land first

    def settle(self, block: bool = False) -> int:
        """Writes finished copies into the slots (every one with ``block``); returns how many
        pages are still in flight."""
        for copy in list(self._pending):
            if block or all(a.is_ready() for a in copy.arrays):
                self._land(copy)
        return sum(len(copy.slots) for copy in self._pending)

    def clear(self) -> None:
        self.settle(block=True)

    def _land(self, copy: _Copy) -> None:
        if copy not in self._pending:
            return
        self._pending.remove(copy)
        for host, device in zip(self.arrays, copy.arrays):
            host[copy.slots] = np.moveaxis(np.asarray(device)[:, copy.columns], 1, 0)
        for s in copy.slots:
            if self._waiting.get(s) is copy:
                del self._waiting[s]
