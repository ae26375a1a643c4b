"""The page table's invariant checker, and random page-table traffic with cancellations
(part 1 of ``experiments.cancel``).

:func:`table_errors` is the one checker of a table's invariants (the page-table tests use it
too). :func:`random_ops` runs jitted ``reserve`` / ``release`` / ``fork`` / ``retain`` on a
small table with a plain-Python record of what each row is doing, and after every cancel
counts the free pages before and after the one ``release`` call against the pages only that
row held.
"""

from __future__ import annotations

import collections
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from paxkv.table import page_table as pt

_reserve = jax.jit(pt.reserve, static_argnames=("max_new",))
_release = jax.jit(pt.release)
_fork = jax.jit(pt.fork)
_retain = jax.jit(pt.retain)
_stats = jax.jit(pt.stats)
_referenced = jax.jit(pt.pages_referenced)


def host_table(table: pt.PageTable) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    return (np.asarray(table.block_tables), np.asarray(table.lengths),
            np.asarray(table.ref_counts), np.asarray(table.active))


def table_errors(table: pt.PageTable, external: Mapping[int, int] | None = None,
                 stats: pt.TableStats | None = None) -> list[str]:
    """What is wrong with ``table`` (nothing: ``[]``), given the references ``external``
    holders took with ``retain`` (page -> count, e.g. a prefix index). The invariants:

    * row ``b``'s cells are the sentinel before its first live block ``dead_b`` (0 unless a
      window group slid it: :func:`~paxkv.table.page_table.slide`), real pages (each once)
      from there to ``ceil(lengths[b] / page_size)``, the sentinel after; an inactive row
      holds nothing; no row is longer than ``max_len``;
    * a page's ref count = the live cells naming it + its external holds: nothing leaks
      and nothing is counted twice;
    * no row names a free page (ref count 0); ``pages_referenced`` counts each row's live
      cells; ``page_table.stats`` counts free + used = all pages, free = the pages with ref
      count 0.

    The one checker of the table: ``tests/test_page_table.py``'s state machine asserts it after
    every operation, and ``experiments.cancel`` checks it under random traffic.
    """
    bt, lengths, refs, active = host_table(table)
    n, width = table.num_pages, table.max_pages_per_seq
    held = -(-lengths // table.page_size)
    real = bt != table.sentinel
    # dead_b: the first real cell, or held when the row names no page (all slid, or empty)
    dead = np.minimum(np.where(real.any(axis=1), np.argmax(real, axis=1), width), held)
    m = np.arange(width)[None, :]
    live = (m >= dead[:, None]) & (m < held[:, None])
    named = bt[live]
    errors = []
    if not np.all((named >= 0) & (named < n)):
        errors.append("a live cell points outside the pool (or is the sentinel)")
    if not np.all(bt[~live] == table.sentinel):
        errors.append(f"rows {np.flatnonzero((~live & real).any(axis=1))} have real cells "
                      "before their first live block or past ceil(length / page_size)")
    if np.any(lengths[~active] != 0) or np.any(lengths < 0) or np.any(lengths > table.max_len):
        errors.append("an inactive row has a length, or a length is out of range")
    expected = np.bincount(np.clip(named, 0, n), minlength=n + 1)[:n]
    for page, count in (external or {}).items():
        expected[page] += count
    if np.any(refs != expected):
        errors.append(f"ref counts differ from holders at pages {np.flatnonzero(refs != expected)}")
    if np.any(refs < 0) or np.any(refs[np.clip(named, 0, n - 1)] <= 0):
        errors.append("a negative ref count, or a row names a free page")
    twice = [b for b in range(table.max_seqs)
             if len(set(bt[b, dead[b]:held[b]])) != held[b] - dead[b]]
    if twice:
        errors.append(f"rows {twice} hold a page twice")
    referenced = np.asarray(_referenced(table))
    if not np.array_equal(referenced, held - dead):
        errors.append(f"pages_referenced {referenced} != live cells {held - dead}")
    stats = jax.device_get(_stats(table)) if stats is None else stats
    if int(stats.free_pages) + int(stats.used_pages) != n or (
            int(stats.free_pages) != int(np.sum(refs == 0))):
        errors.append(f"stats: {int(stats.free_pages)} free + {int(stats.used_pages)} used, "
                      f"{int(np.sum(refs == 0))} pages with ref count 0, {n} pages")
    return errors


class TableWorld:
    """A page table under random traffic, with the plain-Python state each op needs."""

    def __init__(self, *, max_seqs: int, num_pages: int, page_size: int, max_len: int,
                 chunk: int, seed: int):
        self.table = pt.create(num_pages=num_pages, page_size=page_size, max_seqs=max_seqs,
                               max_pages_per_seq=-(-max_len // page_size))
        self.rng, self.chunk, self.max_len = np.random.default_rng(seed), chunk, max_len
        self.prompt_left = np.zeros(max_seqs, int)  # > 0: mid-prompt
        self.target = np.zeros(max_seqs, int)  # length at which a decoding row finishes
        self.holds: collections.Counter = collections.Counter()  # the prefix index's pages
        self.forked = np.zeros(max_seqs, bool)  # took part in a fork
        self.cancels: list[dict[str, Any]] = []

    def active(self) -> np.ndarray:
        return np.asarray(self.table.active)

    def _grow(self, num_new: np.ndarray) -> np.ndarray:
        self.table, _, ok = _reserve(self.table, jnp.asarray(num_new, jnp.int32),
                                     max_new=self.chunk)
        return np.asarray(ok)

    def admit(self) -> None:
        idle = np.flatnonzero(~self.active())
        if idle.size:
            row = self.rng.choice(idle)
            self.prompt_left[row] = self.rng.integers(1, self.max_len // 2)
            self.target[row] = self.prompt_left[row] + self.rng.integers(1, self.max_len // 2)
            self.forked[row] = False
            self.feed(row)

    def feed(self, row: int | None = None) -> None:
        """One chunk of a (random) mid-prompt row."""
        if row is None:
            rows = np.flatnonzero(self.prompt_left > 0)
            if not rows.size:
                return
            row = self.rng.choice(rows)
        num_new = np.zeros(self.table.max_seqs, int)
        num_new[row] = min(self.chunk, self.prompt_left[row])
        if self._grow(num_new)[row]:
            self.prompt_left[row] -= num_new[row]

    def decode(self) -> None:
        rows = self.active() & (self.prompt_left == 0)
        self._grow(rows.astype(int))
        done = np.flatnonzero(rows & (np.asarray(self.table.lengths) >= self.target))
        for row in done:
            self.cancel(row, kind="finished")

    def fork(self) -> None:
        parents = np.flatnonzero(self.active() & (self.prompt_left == 0))
        idle = np.flatnonzero(~self.active())
        if parents.size and idle.size:
            p, c = int(self.rng.choice(parents)), int(self.rng.choice(idle))
            self.table, ok = _fork(self.table, jnp.array([p]), jnp.array([c]))
            if bool(ok[0]):
                self.target[c], self.forked[[p, c]], self.prompt_left[c] = self.target[p], True, 0

    def hold_prefix(self) -> None:
        """The prefix index takes a reference on a decoding row's full pages."""
        bt, lengths, _, active = host_table(self.table)
        rows = np.flatnonzero(active & (self.prompt_left == 0) & (lengths >= self.table.page_size))
        if rows.size:
            row = self.rng.choice(rows)
            pages = bt[row, : lengths[row] // self.table.page_size]
            self.table = _retain(self.table, jnp.asarray(pages), 1)
            self.holds.update(pages.tolist())

    def drop_prefix(self) -> None:
        if self.holds:
            page = int(self.rng.choice(list(self.holds)))
            self.table = _retain(self.table, jnp.asarray([page]), -1)
            self.holds[page] -= 1
            self.holds += collections.Counter()  # drops zero counts

    def cancel(self, row: int | None = None, kind: str | None = None) -> None:
        """Releases one row; records free pages before/after and what it should have freed."""
        if row is None:
            rows = np.flatnonzero(self.active())
            if not rows.size:
                return
            row = int(self.rng.choice(rows))
        bt, lengths, refs, _ = host_table(self.table)
        pages = bt[row, : -(-int(lengths[row]) // self.table.page_size)]
        if kind is None:
            kind = ("mid_prompt" if self.prompt_left[row] > 0 else
                    "sharing_prefix" if any(self.holds[int(p)] for p in pages) else
                    "forked" if (refs[pages] > 1).any() or self.forked[row] else "mid_decode")
        before = int(np.sum(refs == 0))
        mask = np.zeros(self.table.max_seqs, bool)
        mask[row] = True
        self.table, _ = _release(self.table, jnp.asarray(mask))
        after = int(np.sum(np.asarray(self.table.ref_counts) == 0))
        self.cancels.append(dict(kind=kind, freed=after - before,
                                 expected=int(np.sum(refs[pages] == 1))))
        self.prompt_left[row] = 0


OPS = dict(admit=3, feed=3, decode=6, fork=1, hold_prefix=1, drop_prefix=1, cancel=2)


def summarize_cancels(cancels: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per kind: how many, pages freed, and how many freed other than expected."""
    out: dict[str, dict[str, int]] = {}
    for c in cancels:
        s = out.setdefault(c["kind"], dict(n=0, pages_freed=0, wrong=0))
        s["n"] += 1
        s["pages_freed"] += c["freed"]
        s["wrong"] += c["freed"] != c["expected"]
    return out


def random_ops(n_ops: int, *, seed: int = 0, max_seqs: int = 16, num_pages: int = 48,
               page_size: int = 4, max_len: int = 64, chunk: int = 8,
               check_every: int = 100) -> dict[str, Any]:
    """Part 1: ``n_ops`` random operations, then everything dropped; see the module doc."""
    world = TableWorld(max_seqs=max_seqs, num_pages=num_pages, page_size=page_size,
                       max_len=max_len, chunk=chunk, seed=seed)
    names = list(OPS)
    weights = np.array([OPS[n] for n in names], float) / sum(OPS.values())
    counts: collections.Counter = collections.Counter()
    errors: list[str] = []
    peak_used = 0
    for k in range(n_ops):
        op = names[world.rng.choice(len(names), p=weights)]
        getattr(world, op)()
        counts[op] += 1
        if (k + 1) % check_every == 0:
            errors += [f"op {k}: {e}" for e in table_errors(world.table, world.holds)]
            free = int(np.sum(np.asarray(world.table.ref_counts) == 0))
            peak_used = max(peak_used, num_pages - free)
    for row in np.flatnonzero(world.active()):
        world.cancel(int(row), kind="drain")
    pages = np.array(sorted(world.holds), np.int32)
    deltas = np.array([world.holds[p] for p in pages], np.int32)
    for p, d in zip(pages, deltas):
        world.table = _retain(world.table, jnp.asarray([p]), -int(d))
    free = int(np.sum(np.asarray(world.table.ref_counts) == 0))
    errors += table_errors(world.table)
    by_kind = summarize_cancels(world.cancels)
    return dict(ops=n_ops, op_counts=dict(counts), cancels=by_kind,
                all_freed_in_same_call=all(s["wrong"] == 0 for s in by_kind.values()),
                pages_leaked=num_pages - free, invariant_errors=errors[:20],
                peak_pages_used=peak_used,
                config=dict(max_seqs=max_seqs, num_pages=num_pages, page_size=page_size,
                            max_len=max_len, chunk=chunk, seed=seed))
