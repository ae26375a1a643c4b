"""Memory accounting shared by the experiments: the oracle's contiguous arena, page maps of a
pool (one cell per page, for ``experiments.plots``), and a clock for time spent compiling."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from paxkv.table import page_table as pt

_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")


class Arena:
    """First-fit contiguous allocator over ``size`` slots (the dense-exact oracle's memory)."""

    def __init__(self, size: int):
        self.size, self.blocks = size, {}  # key -> (start, n)

    def holes(self) -> list[tuple[int, int]]:
        """Free ``(start, n)`` runs in address order."""
        out, at = [], 0
        for start, n in sorted(self.blocks.values()):
            if start > at:
                out.append((at, start - at))
            at = start + n
        return out + ([(at, self.size - at)] if at < self.size else [])

    def alloc(self, key: int, n: int) -> bool:
        for start, size in self.holes():
            if size >= n:
                self.blocks[key] = (start, n)
                return True
        return False

    def free(self, key: int) -> None:
        del self.blocks[key]

    @property
    def used(self) -> int:
        return sum(n for _, n in self.blocks.values())


class CompileClock:
    """Seconds spent tracing, lowering and compiling since creation (a context manager)."""

    def __init__(self):
        self.total = 0.0

    def _on(self, event: str, duration: float, **_: Any) -> None:
        if event in _COMPILE_EVENTS:
            self.total += duration

    def __enter__(self) -> "CompileClock":
        jax.monitoring.register_event_duration_secs_listener(self._on)
        return self

    def __exit__(self, *exc: Any) -> None:
        jax.monitoring.unregister_event_duration_listener(self._on)




# -- page maps: owner (-1 = free), slots filled and shared flag per page -------------------------
def paged_page_map(table: pt.PageTable) -> dict[str, Any]:
    """One cell per physical page: the lowest row holding it (-1 free), slots filled, and
    whether more than one holder shares it."""
    bt, lengths = np.asarray(table.block_tables), np.asarray(table.lengths)
    refs, ps = np.asarray(table.ref_counts), table.page_size
    owner = np.full(table.num_pages, -1)
    fill = np.zeros(table.num_pages, int)
    for row in np.flatnonzero(np.asarray(table.active))[::-1]:
        n = -(-int(lengths[row]) // ps)
        pages = bt[row, :n]
        owner[pages] = row
        fill[pages] = np.maximum(fill[pages], np.clip(lengths[row] - np.arange(n) * ps, 0, ps))
    return dict(page_size=ps, owner=owner.tolist(), fill=fill.tolist(),
                shared=(refs > 1).tolist())


def dense_page_map(lengths: np.ndarray, active: np.ndarray, max_len: int,
                   page_size: int) -> dict[str, Any]:
    """A dense cache cut into page-sized cells: row ``b`` owns its ``max_len`` slots."""
    cells = max_len // page_size
    owner = np.repeat(np.where(active, np.arange(len(active)), -1), cells)
    start = np.tile(np.arange(cells) * page_size, len(active))
    fill = np.clip(np.repeat(lengths, cells) - start, 0, page_size)
    return dict(page_size=page_size, owner=owner.tolist(), fill=fill.tolist(),
                shared=[False] * len(owner))


def arena_page_map(arena: Arena, held: dict[Any, int], page_size: int) -> dict[str, Any]:
    """The arena cut into page-sized cells: a cell's owner is the block at its first slot;
    ``held[key]`` tokens of each block are filled."""
    owner = np.full(arena.size, -1)
    filled = np.zeros(arena.size, int)
    for key, (start, n) in arena.blocks.items():
        owner[start: start + n] = key
        filled[start: start + max(held.get(key, 0), 0)] = 1
    return dict(page_size=page_size, owner=owner[::page_size].tolist(),
                fill=filled.reshape(-1, page_size).sum(1).tolist(),
                shared=[False] * (arena.size // page_size))

