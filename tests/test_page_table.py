"""The spec of the page table and the pool.

A hypothesis state machine drives thousands of random operations (reserve, write, fork,
reorder, copy-on-write, release, retain, slide) through the jitted ops against a plain-Python
model allocator, and after every one checks the table's invariants, the table against the
model, and that every sequence reads back, through its block table, exactly the tokens it wrote
in the blocks it still holds. ``slide`` (a sliding-window layer group dropping the pages before
each row's window) leaves rows whose first cells are the sentinel; the pages it frees are
poisoned with NaN in the pool, as are all pages any op frees, so a row reading a page it no
longer holds fails the read-back. The unit tests below pin down exhaustion (a failed request
leaves its rows bit-identical), scrubbing, slide, and eager == jitted.

The pool in these tests is tiny (1 layer, 1 kv head, head_dim 1), so each slot stores one token
id: ``k`` holds the id and ``v`` the id + 0.5. One of the machine's sizes is an int8 pool:
there a slot's code is +-127 and the id lives in its scale, so every read-back (scrub,
copy-on-write, fork, reorder, prefix-index retain) checks that scales move with their pages.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, rule,
                                 run_state_machine_as_test)

from experiments.table_ops import table_errors
from paxkv.table import page_table as pt
from paxkv.cache import pool as kv_pool
from pallas_kernels import quant

# Compiled once per shape and shared by every test in this file.
reserve_jit = jax.jit(pt.reserve, static_argnames="max_new")
copy_on_write_jit = jax.jit(pt.copy_on_write)
release_jit = jax.jit(pt.release)
fork_jit = jax.jit(pt.fork)
reorder_jit = jax.jit(pt.reorder)
retain_jit = jax.jit(pt.retain)
slide_jit = jax.jit(pt.slide)
pages_referenced_jit = jax.jit(pt.pages_referenced)
slot_mapping_jit = jax.jit(pt.slot_mapping)
stats_jit = jax.jit(pt.stats)
apply_jit = jax.jit(kv_pool.apply, static_argnames="scrub")
write_jit = jax.jit(kv_pool.write)
round_trip_jit = jax.jit(quant.round_trip, static_argnames="fmt")

UNWRITTEN = -1.0  # what the pool holds before anything is written or scrubbed
POISON = float("nan")  # what the machine writes over every page an op frees
MIN_OPS_PER_RUN = 5_000


@pytest.fixture(autouse=True)
def _strict_ranks():
    with jax.numpy_rank_promotion("raise"):
        yield


@dataclasses.dataclass(frozen=True)
class Sizes:
    num_pages: int
    page_size: int
    max_seqs: int
    max_pages_per_seq: int
    max_new: int  # static bound of every reserve (a step's token width)
    fork_pairs: int = 3
    retain_width: int = 3
    dtype: Any = jnp.float32  # the pool's K/V dtype

    @property
    def max_len(self) -> int:
        return self.page_size * self.max_pages_per_seq

    def table(self) -> pt.PageTable:
        return pt.create(num_pages=self.num_pages, page_size=self.page_size,
                         max_seqs=self.max_seqs, max_pages_per_seq=self.max_pages_per_seq)

    def pool(self, fill: float = UNWRITTEN) -> kv_pool.KVPool:
        return kv_pool.create(num_layers=1, num_pages=self.num_pages, num_kv_heads=1,
                              page_size=self.page_size, head_dim=1, fill=fill, dtype=self.dtype)

    def stored(self, x: np.ndarray) -> np.ndarray:
        """What the pool reads back for values ``x`` ``[..., head_dim]`` written to it."""
        fmt = quant.format_of(self.dtype)
        return x if fmt is None else np.asarray(round_trip_jit(x, fmt=fmt))


def pool_values(pool: kv_pool.KVPool) -> tuple[np.ndarray, np.ndarray]:
    """K and V ``[num_pages + 1, page_size]`` of the tiny pool as attention reads them (codes
    times their scales: IEEE float32 products, as the jitted readers compute them)."""
    k, v = np.asarray(pool.k)[0, :, 0, :, 0], np.asarray(pool.v)[0, :, 0, :, 0]
    if pool.scales is None:
        return k, v
    scales = np.asarray(pool.scales)[0, :, 0]  # [pages, 2, page_size]
    return k.astype(np.float32) * scales[:, 0], v.astype(np.float32) * scales[:, 1]


# Small pools so exhaustion, sharing and page reuse happen all the time.
SIZES = (Sizes(num_pages=12, page_size=4, max_seqs=6, max_pages_per_seq=5, max_new=6),
         Sizes(num_pages=7, page_size=2, max_seqs=5, max_pages_per_seq=6, max_new=3),
         Sizes(num_pages=9, page_size=3, max_seqs=5, max_pages_per_seq=5, max_new=4,
               dtype=jnp.int8))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def assert_equal(actual, desired, msg: str = ""):
    """``np.testing.assert_array_equal`` with a fast path (thousands of calls per run); NaN
    equals NaN (free pages are NaN-poisoned), as in ``assert_array_equal``."""
    if not np.array_equal(np.asarray(actual), np.asarray(desired), equal_nan=True):
        np.testing.assert_array_equal(actual, desired, msg)


@jax.jit
def _poison(pool: kv_pool.KVPool, nan_pool: kv_pool.KVPool,
            pages: jax.Array) -> kv_pool.KVPool:
    """``pool`` with ``pages`` (int32 ``[n]``, ids past the pool ignored) overwritten by
    ``nan_pool``'s (codes and NaN scales for a scaled pool): what a freed page may hold."""
    return kv_pool.KVPool(*[x.at[:, pages].set(nan[:, jnp.clip(pages, 0, x.shape[1] - 1)],
                                                 mode="drop")
                            for x, nan in zip(pool.arrays(), nan_pool.arrays())])


# -- the model ------------------------------------------------------------------------------
class ModelAllocator:
    """Plain-Python allocator: each sequence is a list of page ids, a length and the token ids
    it has written; ref counts are derived from the page lists plus external holders.

    A row's list has ``ceil(length / page_size)`` cells; a cell :meth:`slide` released is
    None (the sentinel in the real table), and those are always a prefix of the row.
    """

    def __init__(self, sizes: Sizes):
        self.sz = sizes
        s = sizes.max_seqs
        self.pages: list[list[int | None]] = [[] for _ in range(s)]
        self.lengths = [0] * s
        self.tokens: list[list[int]] = [[] for _ in range(s)]  # written prefix of each row
        self.active = [False] * s
        self.external: collections.Counter[int] = collections.Counter()

    def ref_counts(self) -> list[int]:
        counts = [0] * self.sz.num_pages
        for row in self.pages:
            for page in row:
                if page is not None:
                    counts[page] += 1
        for page, n in self.external.items():
            counts[page] += n
        return counts

    def free_pages(self) -> list[int]:
        return [p for p, n in enumerate(self.ref_counts()) if n == 0]

    def pending(self, b: int) -> int:
        """Reserved slots not yet written."""
        return self.lengths[b] - len(self.tokens[b])

    def dead(self, b: int) -> int:
        """Leading cells of row ``b`` that :meth:`slide` released (its first live block)."""
        row = self.pages[b]
        return next((m for m, page in enumerate(row) if page is not None), len(row))

    def live_pages(self, b: int) -> list[int]:
        return [page for page in self.pages[b] if page is not None]

    def _needs_copy(self, writes_last: list[bool], num_new: list[int]) -> list[bool]:
        """Copy-on-write rule: a row writing into a shared partial last page copies it, except
        that when every holder writes tokens (not an explicit copy-on-write) and all have the
        same length, the highest row keeps it."""
        refs = self.ref_counts()
        # A row whose partial last page was slid away holds the sentinel there: nothing to
        # copy (its writes into that block land on the sentinel, which nobody reads).
        writers = collections.defaultdict(list)
        for b, w in enumerate(writes_last):
            if w and self.pages[b][-1] is not None:
                writers[self.pages[b][-1]].append(b)
        out = []
        for b, w in enumerate(writes_last):
            page = self.pages[b][-1] if w else None
            if page is None or refs[page] == 1:
                out.append(False)
                continue
            group = writers[page]
            keeps = (len(group) == refs[page] and len({self.lengths[g] for g in group}) == 1
                     and b == max(group) and num_new[b] > 0)
            out.append(not keeps)
        return out

    def reserve(self, num_new: list[int], cow: list[bool], max_new: int):
        """Returns ``(ok, fresh_pages, copies {row: (src, dst)})`` and updates the model.

        Pages are handed out in increasing id order, rows served first-come: a row that needs
        pages gets them only if the pages wanted by it and every earlier row that fits (granted
        or not) are free, so a later row never overtakes an earlier one; a row that needs no
        page (or asks for no token) is never blocked.
        """
        ps, max_len = self.sz.page_size, self.sz.max_len
        free = self.free_pages()
        writes_last = [(n > 0 or c) and length % ps != 0
                       for n, c, length in zip(num_new, cow, self.lengths)]
        needs_copy = self._needs_copy(writes_last, num_new)
        ok, fresh, copies, queued = [], [], {}, 0
        for b, n in enumerate(num_new):
            length = self.lengths[b]
            fits = 0 <= n <= max_new and length + n <= max_len
            growth = _cdiv(length + n, ps) - len(self.pages[b]) if fits else 0
            need = growth + int(needs_copy[b]) if fits else 0
            queued += need
            granted = fits and (need == 0 or queued <= len(free))
            ok.append(granted)
            if not granted:
                continue
            new = free[len(fresh): len(fresh) + need]
            fresh += new
            if needs_copy[b]:
                copies[b] = (self.pages[b][-1], new[0])
                self.pages[b][-1] = new[0]
                new = new[1:]
            self.pages[b] += new
            self.lengths[b] += n
            self.active[b] |= n > 0
        return ok, fresh, copies

    def release(self, rows: list[bool]) -> list[bool]:
        ok = [r and a for r, a in zip(rows, self.active)]
        for b, o in enumerate(ok):
            if o:
                self.pages[b], self.lengths[b], self.tokens[b] = [], 0, []
                self.active[b] = False
        return ok

    def fork(self, parents: list[int], children: list[int]) -> list[bool]:
        s = self.sz.max_seqs
        in_range = [0 <= p < s and 0 <= c < s for p, c in zip(parents, children)]
        uses = collections.Counter(c for c, r in zip(children, in_range) if r)
        ok = [r and self.active[p] and not self.active[c] and uses[c] == 1
              for p, c, r in zip(parents, children, in_range)]
        for p, c, o in zip(parents, children, ok):
            if o:
                self.pages[c] = list(self.pages[p])
                self.lengths[c] = self.lengths[p]
                self.tokens[c] = list(self.tokens[p])
                self.active[c] = True
        return ok

    def reorder(self, parents: list[int]) -> list[bool]:
        """Row ``b`` becomes a copy of row ``parents[b]`` as it was before the call (pages,
        length, tokens); a row whose parent is out of range or inactive is released."""
        s = self.sz.max_seqs
        ok = [0 <= p < s and self.active[p] for p in parents]
        old = (self.pages, self.lengths, self.tokens)
        self.pages = [list(old[0][p]) if o else [] for p, o in zip(parents, ok)]
        self.lengths = [old[1][p] if o else 0 for p, o in zip(parents, ok)]
        self.tokens = [list(old[2][p]) if o else [] for p, o in zip(parents, ok)]
        self.active = list(ok)
        return ok

    def slide(self, keep_from: list[int]) -> list[int]:
        """Each active row releases its cells wholly before ``keep_from[b]``, never past its
        length (they become None, the sentinel); the length stays. Returns the cells each row
        gave up."""
        released = []
        for b, keep in enumerate(keep_from):
            row, gone, keep = self.pages[b], 0, min(keep, self.lengths[b])
            if self.active[b]:
                for m in range(min(max(keep // self.sz.page_size, 0), len(row))):
                    gone += row[m] is not None
                    row[m] = None
            released.append(gone)
        return released

    def block_tables(self) -> np.ndarray:
        bt = np.full((self.sz.max_seqs, self.sz.max_pages_per_seq), self.sz.num_pages, np.int32)
        for b, row in enumerate(self.pages):
            bt[b, :len(row)] = [self.sz.num_pages if page is None else page for page in row]
        return bt

    def stats(self) -> dict:
        ps, refs = self.sz.page_size, self.ref_counts()
        page_fill = [0] * self.sz.num_pages
        for b, row in enumerate(self.pages):
            for m, page in enumerate(row):
                if page is not None:
                    page_fill[page] = max(page_fill[page], min(ps, self.lengths[b] - m * ps))
        used = sum(n > 0 for n in refs)
        filled = sum(page_fill)
        return dict(free_pages=self.sz.num_pages - used, used_pages=used,
                    shared_pages=sum(n > 1 for n in refs), tokens_held=sum(self.lengths),
                    slots_filled=filled, active_seqs=sum(self.active),
                    internal_fragmentation=1.0 - filled / (used * ps) if used else 0.0)


# -- invariants on a real table -------------------------------------------------------------
def assert_table_invariants(table: pt.PageTable, external: collections.Counter | None = None):
    """The table's invariants (``experiments.table_ops.table_errors``, the one checker the
    cancellation experiment runs too, slid rows included); returns the table's stats."""
    stats = jax.device_get(stats_jit(table))
    errors = table_errors(table, external, stats)
    assert not errors, errors
    return stats


# -- the state machine ----------------------------------------------------------------------
class PageTableMachine(RuleBasedStateMachine):
    """Random operations on the real table + pool and on the model, compared after each."""

    ops = 0  # operations run across all examples of one test run
    op_mix: collections.Counter[str] = collections.Counter()
    # How often the run met the cases slide adds (asserted non-zero at the end of the test).
    coverage: collections.Counter[str] = collections.Counter()

    def _done(self, op: str):
        PageTableMachine.ops += 1
        PageTableMachine.op_mix[op] += 1

    @initialize(sizes=st.sampled_from(SIZES))
    def setup(self, sizes: Sizes):
        self.sz = sizes
        self.model = ModelAllocator(sizes)
        self.table = sizes.table()
        self.pool = sizes.pool()
        self.nan_pool = sizes.pool(fill=POISON)
        self.free = set(range(sizes.num_pages))  # free pages as of the last poisoning
        self.slid_free: set[int] = set()  # pages a slide freed that no reserve took since
        self.readback: dict[int, tuple[float, float]] = {}  # token -> (k, v) as stored
        self.next_token = 1
        self.write_width = sizes.max_len  # one write can flush any row's pending slots

    # -- helpers ------------------------------------------------------------------------
    def _row_mask(self):
        row = st.sampled_from([False, False, True])
        return st.lists(row, min_size=self.sz.max_seqs, max_size=self.sz.max_seqs)

    def _pool_np(self) -> tuple[np.ndarray, np.ndarray]:
        return pool_values(self.pool)

    def _check_update(self, update, ok, model_ok, fresh, copies, k_before, v_before):
        n = self.sz.num_pages
        assert_equal(np.asarray(ok), model_ok)
        got_fresh = np.asarray(update.fresh_pages)
        assert_equal(got_fresh[:len(fresh)], fresh)
        assert np.all(got_fresh[len(fresh):] == n + 1), "unused allocation slots must be no-ops"
        src = np.full(self.sz.max_seqs, n + 1)
        dst = np.full(self.sz.max_seqs, n + 1)
        for b, (s, d) in copies.items():
            src[b], dst[b] = s, d
        assert_equal(np.asarray(update.copy_src), src)
        assert_equal(np.asarray(update.copy_dst), dst)
        # Scrub, then copy: fresh pages are zeroed, copies equal their source, nothing else moves.
        k_exp, v_exp = k_before.copy(), v_before.copy()
        k_exp[fresh], v_exp[fresh] = 0.0, 0.0
        for s, d in copies.values():
            k_exp[d], v_exp[d] = k_before[s], v_before[s]
        k_after, v_after = self._pool_np()
        assert_equal(k_after, k_exp)
        assert_equal(v_after, v_exp)

    def _reserve(self, num_new: list[int], cow: list[bool] | None):
        k_before, v_before = self._pool_np()
        if cow is None:
            self.table, update, ok = reserve_jit(self.table, np.asarray(num_new, np.int32),
                                                 max_new=self.sz.max_new)
            model_ok, fresh, copies = self.model.reserve(
                num_new, [False] * self.sz.max_seqs, self.sz.max_new)
        else:
            self.table, update, ok = copy_on_write_jit(self.table, np.asarray(cow))
            model_ok, fresh, copies = self.model.reserve([0] * self.sz.max_seqs, cow, 0)
        self.pool = apply_jit(self.pool, update)
        self._check_update(update, ok, model_ok, fresh, copies, k_before, v_before)
        reused = self.slid_free & set(fresh)
        PageTableMachine.coverage["reserve_reused_a_page_slide_freed"] += len(reused)
        self.slid_free -= reused
        PageTableMachine.coverage["copy_on_write_in_a_slid_row"] += sum(
            self.model.dead(b) > 0 for b in copies)

    def _write(self, counts: list[int]):
        """Writes ``counts[b]`` new tokens after each row's written prefix; positions past the
        reserved length must land on the sentinel and change nothing."""
        s, w, ps, n = self.sz.max_seqs, self.write_width, self.sz.page_size, self.sz.num_pages
        positions = np.full((s, w), -1, np.int32)
        values = np.zeros((s, w, 1, 1), np.float32)
        k_exp, v_exp = self._pool_np()
        k_exp, v_exp = k_exp.copy(), v_exp.copy()
        expected_pages = np.full((s, w), n, np.int32)
        for b, count in enumerate(counts):
            start = len(self.model.tokens[b])
            for t in range(count):
                pos, token = start + t, self.next_token
                self.next_token += 1
                positions[b, t], values[b, t] = pos, token
        k_vals, v_vals = self.sz.stored(values), self.sz.stored(values + 0.5)
        for b, count in enumerate(counts):
            start = len(self.model.tokens[b])
            for t in range(count):
                pos, token = start + t, int(values[b, t, 0, 0])
                self.readback[token] = float(k_vals[b, t, 0, 0]), float(v_vals[b, t, 0, 0])
                if pos < self.model.lengths[b]:
                    page = self.model.pages[b][pos // ps]
                    if page is not None:  # else a slid block: the sentinel takes the write
                        expected_pages[b, t] = page
                        k_exp[page, pos % ps], v_exp[page, pos % ps] = self.readback[token]
                    self.model.tokens[b].append(token)
        pages, offsets = slot_mapping_jit(self.table, positions)
        assert_equal(np.asarray(pages), expected_pages)
        assert_equal(np.asarray(offsets), np.where(positions >= 0, positions % ps, 0))
        self.pool = write_jit(self.pool, 0, values, values + 0.5, pages, offsets)
        k_after, v_after = self._pool_np()
        # Every real page is exactly as expected; only the sentinel absorbs stray writes.
        assert_equal(k_after[:n], k_exp[:n])
        assert_equal(v_after[:n], v_exp[:n])

    # -- operations ---------------------------------------------------------------------
    # One rule draws the operation from a fixed mix (hypothesis would otherwise switch whole
    # rules off per example, and most examples would never fork a live row).
    MIX = (("reserve",) * 5 + ("write",) * 4 + ("fork",) * 3 + ("release",) * 3
           + ("slide",) * 3 + ("copy_on_write",) * 2 + ("retain",) * 2 + ("reorder",) * 2)

    @rule(data=st.data())
    def step(self, data):
        op = data.draw(st.sampled_from(self.MIX), label="operation")
        getattr(self, f"_op_{op}")(data)
        self._poison_freed()
        self._done(op)

    def _poison_freed(self):
        """Overwrites every page the op freed with NaN (a free page may hold anything: the next
        reserve scrubs it), so a row that still reads one fails the read-back."""
        free = set(self.model.free_pages())
        freed = sorted(free - self.free)
        self.free = free
        if freed:
            n = self.sz.num_pages
            pages = np.asarray(freed + [n + 1] * (n - len(freed)), np.int32)  # fixed width
            self.pool = _poison(self.pool, self.nan_pool, pages)

    def _op_reserve(self, data):
        sz = self.sz
        one = st.sampled_from([0, 0, 0, 1, 1, 1, 2, *range(1, sz.max_new + 1), -1,
                               sz.max_new + 1, sz.max_len, 10**6])
        num_new = data.draw(st.lists(one, min_size=sz.max_seqs, max_size=sz.max_seqs))
        self._reserve(num_new, cow=None)

    def _op_write(self, data):
        one = st.sampled_from([0, 0, *range(1, self.sz.max_new + 1), self.write_width])
        counts = data.draw(st.lists(one, min_size=self.sz.max_seqs, max_size=self.sz.max_seqs))
        self._write(counts)

    def _op_copy_on_write(self, data):
        self._reserve([0] * self.sz.max_seqs, cow=data.draw(self._row_mask()))

    def _op_fork(self, data):
        s, k = self.sz.max_seqs, self.sz.fork_pairs
        active = [b for b in range(s) if self.model.active[b]]
        idle = [b for b in range(s) if not self.model.active[b]]
        anything = st.integers(-1, s)  # -1 and s are out of range

        def mostly(rows):
            return st.one_of(*[st.sampled_from(rows)] * 3, anything) if rows else anything
        parents = data.draw(st.lists(mostly(active), min_size=k, max_size=k))
        children = data.draw(st.lists(mostly(idle), min_size=k, max_size=k))
        # NOTE: forks happen between steps, after a step has written its reserved slots (a
        # child shares the parent's partial page, so pending writes would reach both).
        self._write([self.model.pending(b) if b in parents else 0 for b in range(s)])
        slid = [self.model.dead(p) > 0 if 0 <= p < s else False for p in parents]
        self.table, ok = fork_jit(self.table, np.asarray(parents, np.int32),
                                  np.asarray(children, np.int32))
        model_ok = self.model.fork(parents, children)
        assert_equal(np.asarray(ok), model_ok)
        PageTableMachine.coverage["fork_of_a_slid_row"] += sum(
            o and d for o, d in zip(model_ok, slid))

    def _op_reorder(self, data):
        """Beam search's reorder: each row continues a (mostly live) parent, itself, or is
        dropped (-1, or a parent out of range or idle); several rows may share a parent."""
        s = self.sz.max_seqs
        active = [b for b in range(s) if self.model.active[b]]
        pick = [st.sampled_from(active)] * 4 if active else []
        parents = [data.draw(st.one_of(*pick, st.just(b), st.just(-1), st.integers(-1, s)))
                   for b in range(s)]
        # NOTE: as for fork, a parent's reserved slots are written before its pages are shared.
        self._write([self.model.pending(b) if b in parents else 0 for b in range(s)])
        slid = [self.model.dead(b) > 0 for b in range(s)]
        self.table, ok = reorder_jit(self.table, np.asarray(parents, np.int32))
        model_ok = self.model.reorder(parents)
        assert_equal(np.asarray(ok), model_ok)
        PageTableMachine.coverage["reorder_onto_a_slid_parent"] += sum(
            o and slid[p] for o, p in zip(model_ok, parents))

    def _op_slide(self, data):
        """A sliding-window layer group drops each row's pages before ``keep_from[b]``: mostly
        ``length - window + 1`` for one window per op (the next query's window), else any
        position up to the length, now and then one past it or negative; inactive rows get
        values too, which slide must ignore."""
        sz, m = self.sz, self.model
        if data.draw(st.booleans()):
            window = data.draw(st.integers(1, sz.max_len + 1))
            base = m.lengths if data.draw(st.booleans()) else [len(t) for t in m.tokens]
            keep_from = [max(0, length - window + 1) for length in base]
        else:
            keep_from = [data.draw(st.one_of(
                *[st.integers(0, m.lengths[b])] * 6, st.integers(-2, m.lengths[b] + sz.page_size),
                st.just(10**6))) for b in range(sz.max_seqs)]
        pages_before = [list(row) for row in m.pages]
        free_before = set(m.free_pages())
        self.table, released = slide_jit(self.table, np.asarray(keep_from, np.int32))
        assert_equal(np.asarray(released), m.slide(keep_from))
        freed = set(m.free_pages()) - free_before
        self.slid_free |= freed
        refs = m.ref_counts()
        dropped = [p for old, new in zip(pages_before, m.pages)
                   for p, q in zip(old, new) if p is not None and q is None]
        cov = PageTableMachine.coverage
        cov["slide_freed_a_page"] += len(freed)
        cov["slide_dropped_a_page_another_holder_keeps"] += sum(refs[p] > 0 for p in dropped)
        partial = [length % sz.page_size != 0 and new and old[-1] is not None
                   for length, old, new in zip(m.lengths, pages_before, m.pages)]
        assert all(new[-1] is not None for p, new in zip(partial, m.pages) if p), \
            "slide dropped a partial last page the row may still write into"
        cov["slide_past_the_end_kept_a_partial_last_page"] += sum(
            p and keep > length for p, keep, length in zip(partial, keep_from, m.lengths))

    def _op_release(self, data):
        rows = data.draw(self._row_mask())
        slid = [self.model.dead(b) > 0 for b in range(self.sz.max_seqs)]
        self.table, ok = release_jit(self.table, np.asarray(rows))
        model_ok = self.model.release(rows)
        assert_equal(np.asarray(ok), model_ok)
        PageTableMachine.coverage["release_of_a_slid_row"] += sum(
            o and d for o, d in zip(model_ok, slid))

    def _op_retain(self, data):
        """An external holder (a prefix index) takes references to pages rows hold, or drops
        some it took; ids past the pool are ignored. It keeps at most a third of the pool."""
        r, n = self.sz.retain_width, self.sz.num_pages
        held = sorted(self.model.external.elements())
        in_rows = sorted({p for b in range(self.sz.max_seqs) for p in self.model.live_pages(b)})
        if held and (len(held) >= n // 3 or data.draw(st.booleans())):
            pages = data.draw(st.lists(st.sampled_from(held), max_size=r)
                              .filter(lambda ps: all(ps.count(p) <= held.count(p) for p in ps)))
            delta = -1
        else:
            pages = data.draw(st.lists(st.sampled_from([*in_rows, n, n + 1]), max_size=r))
            delta = 1
        pages += [n + 1] * (r - len(pages))
        self.table = retain_jit(self.table, np.asarray(pages, np.int32), delta)
        self.model.external.update({p: delta * pages.count(p) for p in set(pages) if p < n})
        self.model.external += collections.Counter()  # drop zero counts

    # -- checked after every step -------------------------------------------------------
    @invariant()
    def table_matches_model(self):
        m = self.model
        got = assert_table_invariants(self.table, m.external)
        assert_equal(np.asarray(self.table.block_tables), m.block_tables())
        assert_equal(np.asarray(self.table.lengths), m.lengths)
        assert_equal(np.asarray(self.table.active), m.active)
        assert_equal(np.asarray(self.table.ref_counts), m.ref_counts())
        for name, value in m.stats().items():
            assert abs(float(getattr(got, name)) - value) <= 1e-6, (name, getattr(got, name), value)

    @invariant()
    def every_sequence_reads_its_tokens(self):
        """Through the real block table (not the model's pages), from each row's first live
        block on (a slid block is the sentinel: nobody reads it). A row's live slots hold its
        tokens, never a poisoned (freed) page's NaN."""
        k, v = self._pool_np()
        ps, block_tables = self.sz.page_size, np.asarray(self.table.block_tables)
        # Attention reads a row's live pages whole (slots past the length masked, and NaN * 0
        # is NaN): no slot of a page a row holds may be poisoned.
        live = np.unique(block_tables[block_tables < self.sz.num_pages])
        assert not np.isnan(k[live]).any() and not np.isnan(v[live]).any(), "a held page is NaN"
        for b, tokens in enumerate(self.model.tokens):
            first = self.model.dead(b) * ps
            pos = np.arange(first, max(first, len(tokens)))
            pages = block_tables[b, pos // ps]
            assert np.all(pages < self.sz.num_pages), f"row {b} reads the sentinel"
            stored = np.array([self.readback[t] for t in tokens[first:]],
                              np.float32).reshape(-1, 2)
            assert_equal(k[pages, pos % ps], stored[:, 0], f"row {b} keys")
            assert_equal(v[pages, pos % ps], stored[:, 1], f"row {b} values")

    def teardown(self):
        if not hasattr(self, "model"):
            return
        ext, r = sorted(self.model.external.elements()), self.sz.retain_width
        for i in range(0, len(ext), r):  # fixed width: no recompiles
            chunk = ext[i:i + r] + [self.sz.num_pages + 1] * (r - len(ext[i:i + r]))
            self.table = retain_jit(self.table, np.asarray(chunk, np.int32), -1)
        self.table, _ = release_jit(self.table, np.ones((self.sz.max_seqs,), bool))
        empty = self.sz.table()
        for name in ("block_tables", "lengths", "ref_counts", "active"):
            assert_equal(np.asarray(getattr(self.table, name)),
                                          np.asarray(getattr(empty, name)), name)
        assert int(stats_jit(self.table).free_pages) == self.sz.num_pages


SLIDE_CASES = ("slide_freed_a_page", "slide_dropped_a_page_another_holder_keeps",
               "slide_past_the_end_kept_a_partial_last_page", "reserve_reused_a_page_slide_freed",
               "copy_on_write_in_a_slid_row", "fork_of_a_slid_row", "reorder_onto_a_slid_parent",
               "release_of_a_slid_row")


def test_state_machine_against_model_allocator():
    """At least MIN_OPS_PER_RUN random operations, each followed by every check above."""
    PageTableMachine.ops = 0
    PageTableMachine.op_mix.clear()
    PageTableMachine.coverage.clear()
    while PageTableMachine.ops < MIN_OPS_PER_RUN:  # examples vary in length: top up if short
        examples = (MIN_OPS_PER_RUN - PageTableMachine.ops) // 40 + 5
        run_state_machine_as_test(PageTableMachine, settings=settings(
            max_examples=examples, stateful_step_count=50, deadline=None, database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
    print(f"page-table state machine: {PageTableMachine.ops} operations",
          dict(PageTableMachine.op_mix), dict(PageTableMachine.coverage))
    assert PageTableMachine.ops >= MIN_OPS_PER_RUN
    # The run met every case slide adds: freed pages reused, slid rows forked, reordered,
    # released and copied on write, pages kept alive by another holder, partial pages slid.
    missing = [case for case in SLIDE_CASES if not PageTableMachine.coverage[case]]
    assert not missing, (missing, dict(PageTableMachine.coverage))


# -- exhaustion -----------------------------------------------------------------------------
def _table_np(table: pt.PageTable) -> dict[str, np.ndarray]:
    return {name: np.asarray(getattr(table, name))
            for name in ("block_tables", "lengths", "ref_counts", "active")}


def _assert_no_op_update(update: pt.PoolUpdate, num_pages: int):
    for name in ("fresh_pages", "copy_src", "copy_dst"):
        assert np.all(np.asarray(getattr(update, name)) == num_pages + 1), name


def _reserve_all(table: pt.PageTable, *requests: list[int]) -> pt.PageTable:
    for num_new in requests:
        table, _, ok = reserve_jit(table, np.asarray(num_new, np.int32), max_new=6)
        assert np.all(np.asarray(ok))
    return table


# The tests below share SIZES[0] (12 pages of 4 tokens, 6 rows of at most 20 tokens, a step
# of at most 6): one compile of each op for the whole file.
def test_exhausted_pool_leaves_everything_bit_identical():
    sz = SIZES[0]
    table = _reserve_all(sz.table(), [6] * 6)  # every page used, every row ends partial
    assert int(stats_jit(table).free_pages) == 0
    pool = sz.pool(fill=3.0)
    new, update, ok = reserve_jit(table, np.array([3, 6, 3, 5, 4, 0], np.int32), max_new=6)
    assert_equal(np.asarray(ok), [False] * 5 + [True])
    for name, value in _table_np(table).items():
        assert_equal(_table_np(new)[name], value, name)
    _assert_no_op_update(update, sz.num_pages)
    assert_equal(apply_jit(pool, update).k, pool.k)


def test_row_needing_no_page_is_never_blocked():
    """Regression: a row denied for lack of pages used to deny every later row too, even rows
    asking for 0 tokens or writing into the room left in their own last page."""
    sz = SIZES[0]
    table = _reserve_all(sz.table(), [6] * 6)
    new, update, ok = reserve_jit(table, np.array([4, 0, 1, 2, 3, 0], np.int32), max_new=6)
    assert_equal(np.asarray(ok), [False, True, True, True, False, True])
    assert_equal(np.asarray(new.lengths), [6, 6, 7, 8, 6, 6])
    assert_equal(np.asarray(new.block_tables), np.asarray(table.block_tables))
    _assert_no_op_update(update, sz.num_pages)


def test_failed_copy_on_write_leaves_both_holders_intact():
    sz = SIZES[0]
    table = _reserve_all(sz.table(), [6, 6, 6, 6, 6, 0], [0, 0, 0, 6, 6, 0])  # 12 pages used
    table, ok = fork_jit(table, np.array([0, 0, 0], np.int32), np.array([5, 9, 9], np.int32))
    assert_equal(np.asarray(ok), [True, False, False])
    before = _table_np(table)
    rows_0_5 = np.array([True, False, False, False, False, True])
    for new, update, ok in (
            reserve_jit(table, np.array([0, 0, 0, 0, 0, 1], np.int32), max_new=6),
            copy_on_write_jit(table, np.array([False] * 5 + [True])),
            copy_on_write_jit(table, rows_0_5)):
        # Row 5 (or row 0, when both ask) must copy the shared partial page: none is free.
        assert not np.all(np.asarray(ok)[rows_0_5])
        for name, value in before.items():
            assert_equal(_table_np(new)[name], value, name)
        _assert_no_op_update(update, sz.num_pages)
    # Both holders write with equal lengths: the highest row keeps the page; row 0 cannot
    # copy, fails and stays exactly as it was, while row 5 goes on in the page it kept.
    new, _, ok = reserve_jit(table, np.array([1, 0, 0, 0, 0, 1], np.int32), max_new=6)
    assert_equal(np.asarray(ok), [False] + [True] * 5)
    after = _table_np(new)
    assert_equal(after["block_tables"], before["block_tables"])
    assert_equal(after["lengths"], [6, 6, 6, 12, 12, 7])
    assert_equal(after["ref_counts"], before["ref_counts"])


def _write_tokens(table, pool, rows_positions: dict[int, list[int]], token: float):
    """Writes ``token`` at the given positions of each row (through slot_mapping)."""
    positions = np.full((table.max_seqs, table.max_len), -1, np.int32)
    for b, pos in rows_positions.items():
        positions[b, :len(pos)] = pos
    values = np.full((table.max_seqs, table.max_len, 1, 1), token, np.float32)
    return write_jit(pool, 0, values, values, *slot_mapping_jit(table, positions))


def _read_tokens(table, pool, b: int) -> np.ndarray:
    pos = np.arange(int(table.lengths[b]))
    pages = np.asarray(table.block_tables)[b, pos // table.page_size]
    return np.asarray(pool.k)[0, pages, 0, pos % table.page_size, 0]


def test_keeper_never_writes_a_slot_another_holder_reads():
    """A shared partial page is kept (not copied) by a writer only when every holder writes
    and all have the same length; otherwise a short keeper would overwrite a slot that a
    longer holder, whose copy failed for lack of pages, still reads."""
    sz = SIZES[0]
    table = _reserve_all(sz.table(), [0, 5, 0, 0, 0, 0])
    pool = _write_tokens(table, sz.pool(), {1: list(range(5))}, 1.0)
    table, ok = fork_jit(table, np.array([1, 1, 1], np.int32), np.array([0, 0, 0], np.int32))
    assert not np.any(np.asarray(ok))  # row 0 named three times
    table, ok = fork_jit(table, np.array([1, 9, 9], np.int32), np.array([0, 9, 9], np.int32))
    assert_equal(np.asarray(ok), [True, False, False])
    table = _reserve_all(table, [0, 0, 0, 6, 6, 6], [0, 0, 0, 6, 6, 0], [0, 0, 0, 6, 0, 0])
    assert int(stats_jit(table).free_pages) == 0
    # Rows 0 and 1 (length 5) both write: row 1 keeps the page, row 0 cannot copy.
    table, _, ok = reserve_jit(table, np.array([1, 1, 0, 0, 0, 0], np.int32), max_new=6)
    assert_equal(np.asarray(ok), [False] + [True] * 5)
    pool = _write_tokens(table, pool, {1: [5]}, 2.0)
    table, ok = fork_jit(table, np.array([0, 9, 9], np.int32), np.array([2, 9, 9], np.int32))
    assert_equal(np.asarray(ok), [True, False, False])
    # Rows 0, 2 (length 5) and 1 (length 6) all write: with unequal lengths nobody may keep.
    new, update, ok = reserve_jit(table, np.array([1, 1, 1, 0, 0, 0], np.int32), max_new=6)
    assert_equal(np.asarray(ok), [False, False, False, True, True, True])
    _assert_no_op_update(update, sz.num_pages)
    pool = _write_tokens(new, pool, {0: [5], 1: [6], 2: [5]}, 3.0)
    assert_equal(_read_tokens(new, pool, 1), [1.0] * 5 + [2.0])
    assert_equal(_read_tokens(new, pool, 0), [1.0] * 5)


def test_first_come_by_row():
    sz = SIZES[0]
    table = _reserve_all(sz.table(), [0, 0, 0, 6, 6, 6], [0, 0, 0, 6, 6, 6])  # 9 pages used
    # Rows 0-2 ask 2, 2, 1 pages of the 3 free: row 1 does not fit after row 0, and row 2 may
    # not overtake it; row 3 asks nothing; row 4 is over max_new and holds nothing up.
    new, update, ok = reserve_jit(table, np.array([6, 5, 1, 0, 7, 0], np.int32), max_new=6)
    assert_equal(np.asarray(ok), [True, False, False, True, False, True])
    assert_equal(np.asarray(new.block_tables)[0, :2], [9, 10])
    assert_equal(np.asarray(update.fresh_pages)[:3], [9, 10, sz.num_pages + 1])
    new, _, ok = reserve_jit(new, np.array([0, 4, 0, 0, 0, 0], np.int32), max_new=6)
    assert_equal(np.asarray(ok), [True] * 6)
    assert_equal(np.asarray(new.block_tables)[1, :2], [11, sz.num_pages])
    assert_table_invariants(new)


def test_max_new_and_max_len_violations_fail_cleanly():
    sz = SIZES[0]
    table = _reserve_all(sz.table(), *[[0, 0, 0, 6, 0, 0]] * 3)  # row 3: 18 of 20 tokens
    # over max_new, negative, a huge int, past max_len; rows 4 and 5 are fine.
    new, update, ok = reserve_jit(table, np.array([7, -1, 10**9, 3, 5, 0], np.int32), max_new=6)
    assert_equal(np.asarray(ok), [False, False, False, False, True, True])
    assert_equal(np.asarray(new.lengths), [0, 0, 0, 18, 5, 0])
    assert_equal(np.asarray(update.fresh_pages)[:3], [5, 6, sz.num_pages + 1])
    assert_table_invariants(new)


@settings(max_examples=40, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_failed_rows_are_bit_identical_and_no_page_in_use_is_handed_out(data):
    sz = SIZES[0]
    s, k, n = sz.max_seqs, sz.fork_pairs, sz.num_pages
    table = sz.table()
    grow = st.lists(st.integers(0, sz.max_new), min_size=s, max_size=s)
    rows = st.lists(st.integers(0, s - 1), min_size=k, max_size=k)
    for _ in range(data.draw(st.integers(0, 4))):
        table, _, _ = reserve_jit(table, np.asarray(data.draw(grow), np.int32), max_new=sz.max_new)
        table, _ = fork_jit(table, np.asarray(data.draw(rows), np.int32),
                            np.asarray(data.draw(rows), np.int32))
    ask = st.sampled_from([0, 1, 2, 4, 5, sz.max_new, sz.max_new + 1, sz.max_len, -1])
    num_new = np.asarray(data.draw(st.lists(ask, min_size=s, max_size=s)), np.int32)
    new, update, ok = reserve_jit(table, num_new, max_new=sz.max_new)
    before, after, ok = _table_np(table), _table_np(new), np.asarray(ok)
    for name in ("block_tables", "lengths", "active"):
        assert_equal(after[name][~ok], before[name][~ok], name)
    fresh = np.asarray(update.fresh_pages)
    fresh = fresh[fresh < n]
    assert len(set(fresh.tolist())) == len(fresh)
    assert np.all(before["ref_counts"][fresh] == 0), "handed out a page in use"
    src = np.asarray(update.copy_src)
    copied_away = np.bincount(src[src < n], minlength=n)
    expected = before["ref_counts"] - copied_away
    expected[fresh] += 1
    assert_equal(after["ref_counts"], expected)
    # A failing row's pages lose only the holders that copied away from them.
    held = before["block_tables"][~ok]
    held = held[held < n]
    assert_equal(after["ref_counts"][held], (before["ref_counts"] - copied_away)[held])
    assert_table_invariants(new)


# -- scrubbing ------------------------------------------------------------------------------
@pytest.mark.parametrize("scrub", [True, False])
def test_fresh_pages_are_scrubbed(scrub):
    sz = SIZES[0]
    marker = 7.0
    pool = sz.pool(fill=marker)
    table, update, ok = reserve_jit(sz.table(), np.array([5, 0, 1, 0, 0, 0], np.int32),
                                    max_new=sz.max_new)
    new_pool = apply_jit(pool, update, scrub=scrub)
    k, v = np.asarray(new_pool.k), np.asarray(new_pool.v)
    fresh = [0, 1, 2]
    assert_equal(np.asarray(update.fresh_pages)[:3], fresh)
    expected = 0.0 if scrub else marker
    assert np.all(k[:, fresh] == expected) and np.all(v[:, fresh] == expected)
    assert np.all(k[:, 3:] == marker) and np.all(v[:, 3:] == marker), "touched other pages"


def test_released_pages_come_back_scrubbed():
    """No sequence sees the tokens of the sequence that held its pages before."""
    sz = SIZES[0]
    table, update, _ = reserve_jit(sz.table(), np.array([6, 0, 0, 0, 0, 0], np.int32),
                                   max_new=sz.max_new)
    pool = apply_jit(sz.pool(), update)
    positions = np.where(np.arange(6)[None] < np.array([6, 0, 0, 0, 0, 0])[:, None],
                         np.arange(6)[None], -1).astype(np.int32)
    tokens = np.full((6, 6, 1, 1), 42.0, np.float32)
    pool = write_jit(pool, 0, tokens, tokens, *slot_mapping_jit(table, positions))
    assert np.sum(np.asarray(pool.k)[0, :2] == 42.0) == 6
    table, _ = release_jit(table, np.array([True] + [False] * 5))
    table, update, _ = reserve_jit(table, np.array([0, 6, 0, 0, 0, 0], np.int32),
                                   max_new=sz.max_new)
    assert_equal(np.asarray(table.block_tables)[1, :2], [0, 1])  # the same pages, reused
    pool = apply_jit(pool, update)
    assert np.all(np.asarray(pool.k)[0, :2] == 0.0) and np.all(np.asarray(pool.v)[0, :2] == 0.0)


# -- slide ---------------------------------------------------------------------------------
@jax.jit
def _slide_then_reserve(table, pool, keep_from, num_new):
    """One step of a sliding-window group: drop what left the window, then grow."""
    table, released = pt.slide(table, keep_from)
    table, update, ok = pt.reserve(table, num_new, max_new=6)
    return table, kv_pool.apply(pool, update), update, released, ok


def test_slide_frees_pages_inside_the_jitted_step_and_the_next_reserve_reuses_them():
    sz = SIZES[0]
    n = S = sz.num_pages
    table = _reserve_all(sz.table(), [6] * 6)  # row b: pages [2b, 2b + 1], 6 tokens each
    assert int(stats_jit(table).free_pages) == 0
    pool = sz.pool(fill=3.0)  # every page holds something
    keep_from = np.array([4, 0, 6, 3, 0, 0], np.int32)  # rows 0, 2 drop block 0; row 3 not yet
    num_new = np.array([0, 6, 0, 6, 0, 0], np.int32)  # rows 1, 3 need one page each
    # Without the slide the pool is full and both requests fail.
    assert_equal(np.asarray(reserve_jit(table, num_new, max_new=6)[2]),
                 [True, False, True, False, True, True])
    new, new_pool, update, released, ok = _slide_then_reserve(table, pool, keep_from, num_new)
    assert_equal(np.asarray(released), [1, 0, 1, 0, 0, 0])
    assert_equal(np.asarray(ok), [True] * 6)
    # The pages the slide released (0 and 4) are the ones this reserve hands out, in id order.
    fresh = np.asarray(update.fresh_pages)
    assert_equal(fresh[:2], [0, 4])
    assert np.all(fresh[2:] == n + 1)
    assert np.all(np.asarray(update.copy_src) == n + 1)
    assert np.all(np.asarray(update.copy_dst) == n + 1)
    # Nothing else changed.
    expected = np.asarray(table.block_tables).copy()
    expected[0, 0] = expected[2, 0] = S
    expected[1, 2], expected[3, 2] = 0, 4
    assert_equal(np.asarray(new.block_tables), expected)
    assert_equal(np.asarray(new.lengths), [6, 12, 6, 12, 6, 6])
    assert_equal(np.asarray(new.active), [True] * 6)
    assert_equal(np.asarray(new.ref_counts), [1] * n)
    assert_equal(np.asarray(pages_referenced_jit(new)), [1, 3, 1, 3, 2, 2])
    k, v = np.asarray(new_pool.k)[0, :, 0, :, 0], np.asarray(new_pool.v)[0, :, 0, :, 0]
    scrubbed = np.isin(np.arange(n + 1), [0, 4])
    assert np.all(k[scrubbed] == 0.0) and np.all(v[scrubbed] == 0.0)
    assert np.all(k[~scrubbed] == 3.0) and np.all(v[~scrubbed] == 3.0), "touched other pages"
    assert_table_invariants(new)
    # The same as the ops one call after another (the file's jitted ops).
    slid, one_by_one_released = slide_jit(table, keep_from)
    one_by_one, one_by_one_update, one_by_one_ok = reserve_jit(slid, num_new, max_new=6)
    _assert_trees_equal(
        (one_by_one, apply_jit(pool, one_by_one_update), one_by_one_update,
         one_by_one_released, one_by_one_ok),
        (new, new_pool, update, released, ok))


def test_slide_on_a_forked_pair_frees_a_page_only_when_both_holders_slid_past_it():
    sz = SIZES[0]
    n = S = sz.num_pages
    rest = [0] * 4  # rows 2..5 stay inactive: slide must ignore their keep_from

    def slide(table, keep_from, released):
        new, got = slide_jit(table, np.asarray(keep_from, np.int32))
        assert_equal(np.asarray(got), released)
        return new

    def free(table):
        assert_table_invariants(table, external)
        return set(np.flatnonzero(np.asarray(table.ref_counts) == 0).tolist())

    table = _reserve_all(sz.table(), [6] + [0] * 5, [4] + [0] * 5)  # row 0: pages 0, 1, 2
    table, ok = fork_jit(table, np.array([0, 9, 9], np.int32), np.array([1, 9, 9], np.int32))
    assert_equal(np.asarray(ok), [True, False, False])
    table = retain_jit(table, np.array([1, n + 1, n + 1], np.int32), 1)  # a prefix index: page 1
    external = collections.Counter({1: 1})
    idle = set(range(3, n))
    assert free(table) == idle
    # Row 0 slides past pages 0 and 1: row 1 still holds them, nothing is freed.
    table = slide(table, [8, 0, 20, 20, 20, 20], [2, 0] + rest)
    assert_equal(np.asarray(table.block_tables)[:2, :3], [[S, S, 2], [0, 1, 2]])
    assert_equal(np.asarray(table.ref_counts)[:3], [1, 2, 2])
    assert free(table) == idle
    # Sliding again is a no-op (slid cells are not dropped twice), as is a keep_from behind.
    before = _table_np(table)
    for keep in ([8, 0], [4, 0], [-1, -1]):
        again = slide(table, keep + [99] * 4, [0, 0] + rest)
        for name, value in before.items():
            assert_equal(_table_np(again)[name], value, name)
    # Row 1 slides past page 0: both holders have, so page 0 is free.
    table = slide(table, [8, 4, 0, 0, 0, 0], [0, 1] + rest)
    assert free(table) == idle | {0}
    # Both rows slid past page 1, but the prefix index holds it: still in use until it drops it.
    table = slide(table, [0, 9, 0, 0, 0, 0], [0, 1] + rest)
    assert_equal(np.asarray(table.block_tables)[:2, :3], [[S, S, 2], [S, S, 2]])
    assert_equal(np.asarray(table.ref_counts)[:3], [0, 1, 2])
    assert free(table) == idle | {0}
    table = retain_jit(table, np.array([1, n + 1, n + 1], np.int32), -1)
    external.clear()
    assert free(table) == idle | {0, 1}
    # The shared partial page 2 (10 tokens, page 4) is copied when row 1 writes, into page 0:
    # the lowest free page, one the slides released.
    table, update, ok = reserve_jit(table, np.array([0, 1, 0, 0, 0, 0], np.int32), max_new=6)
    assert_equal(np.asarray(ok), [True] * 6)
    assert_equal(np.asarray(update.copy_src)[:2], [n + 1, 2])
    assert_equal(np.asarray(update.copy_dst)[:2], [n + 1, 0])
    assert_equal(np.asarray(table.block_tables)[:2, :3], [[S, S, 2], [S, S, 0]])
    assert free(table) == idle | {1}
    # Releasing a slid row drops its live cells only.
    table, ok = release_jit(table, np.array([True] + [False] * 5))
    assert_equal(np.asarray(table.ref_counts)[:3], [1, 0, 0])
    assert free(table) == idle | {1, 2}
    # Three holders (two forks of row 0): two slide past page 0 in one call, then the third.
    table = _reserve_all(sz.table(), [6] + [0] * 5, [2] + [0] * 5)  # row 0: pages 0, 1 full
    table, ok = fork_jit(table, np.array([0, 0, 9], np.int32), np.array([1, 2, 9], np.int32))
    assert_equal(np.asarray(ok), [True, True, False])
    table = slide(table, [4, 4, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0])
    assert_equal(np.asarray(table.ref_counts)[:2], [1, 3])
    assert free(table) == set(range(2, n))
    table = slide(table, [0, 0, 5, 0, 0, 0], [0, 0, 1, 0, 0, 0])
    assert free(table) == {0} | set(range(2, n))


# -- eager == jitted, donation, validation --------------------------------------------------
def _assert_trees_equal(eager, jitted):
    leaves_e, tree_e = jax.tree.flatten(eager)
    leaves_j, tree_j = jax.tree.flatten(jitted)
    assert tree_e == tree_j
    for a, b in zip(leaves_e, leaves_j):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape
        if np.issubdtype(a.dtype, np.floating):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=0)
        else:
            assert_equal(a, b)


def _busy_state(sz: Sizes) -> pt.PageTable:
    """Shared partial pages, a retained page, a released row, ragged lengths, and rows that
    slid past a page their fork still holds."""
    table, _, _ = reserve_jit(sz.table(), np.array([5, 3, 6, 0, 1, 0], np.int32), max_new=6)
    table, _ = fork_jit(table, np.array([0, 2, 4], np.int32), np.array([3, 5, 4], np.int32))
    table = retain_jit(table, np.array([1, 1, 99], np.int32), 1)
    table, _ = release_jit(table, np.array([False, True, False, False, False, False]))
    table, released = slide_jit(table, np.array([4, 0, 0, 0, 0, 6], np.int32))
    assert_equal(np.asarray(released), [1, 0, 0, 0, 0, 1])
    assert_table_invariants(table, collections.Counter({1: 2}))
    return table


def test_eager_and_jitted_ops_agree():
    sz = SIZES[0]
    table = _busy_state(sz)
    num_new = np.array([1, 4, 6, 1, 2, 0], np.int32)
    cow = np.array([False, False, True, True, False, True])
    parents, children = np.array([0, 2, 7], np.int32), np.array([1, 1, 0], np.int32)
    beams = np.array([2, 2, -1, 0, 1, 6], np.int32)
    retained = np.array([0, 3, 12], np.int32)
    keep_from = np.array([5, 4, 9, 8, -1, 10**6], np.int32)
    positions = np.full((6, sz.max_len), -1, np.int32)  # the state machine's write width
    positions[:, :3] = [[4, 5, -1], [0, 1, 2], [6, 7, 8], [-1, -1, -1], [5, 6, 7], [30, 2, 3]]
    _, update, _ = pt.reserve(table, num_new, max_new=6, cow=cow)
    pool = sz.pool(fill=5.0)
    pages, offsets = pt.slot_mapping(table, positions)
    values = np.arange(positions.size, dtype=np.float32).reshape(6, sz.max_len, 1, 1)
    # (eager op, its jitted form): the jitted forms are the ones compiled for the whole file.
    cases = [
        (lambda: pt.reserve(table, num_new, max_new=6),
         lambda: reserve_jit(table, num_new, max_new=6)),
        (lambda: pt.copy_on_write(table, cow), lambda: copy_on_write_jit(table, cow)),
        (lambda: pt.release(table, cow), lambda: release_jit(table, cow)),
        (lambda: pt.fork(table, parents, children), lambda: fork_jit(table, parents, children)),
        (lambda: pt.reorder(table, beams), lambda: reorder_jit(table, beams)),
        (lambda: pt.retain(table, retained, 1), lambda: retain_jit(table, retained, 1)),
        (lambda: pt.slide(table, keep_from), lambda: slide_jit(table, keep_from)),
        (lambda: pt.pages_referenced(table), lambda: pages_referenced_jit(table)),
        (lambda: pt.slot_mapping(table, positions), lambda: slot_mapping_jit(table, positions)),
        (lambda: pt.stats(table), lambda: stats_jit(table)),
        (lambda: kv_pool.apply(pool, update), lambda: apply_jit(pool, update)),
        (lambda: kv_pool.apply(pool, update, scrub=False),
         lambda: apply_jit(pool, update, scrub=False)),
        (lambda: kv_pool.write(pool, 0, values, -values, pages, offsets),
         lambda: write_jit(pool, 0, values, -values, pages, offsets)),
    ]
    for eager, jitted in cases:
        _assert_trees_equal(eager(), jitted())


def test_jitted_pool_updates_donate_the_pool():
    sz = SIZES[0]
    table, update, _ = reserve_jit(sz.table(), np.array([5, 0, 0, 0, 0, 0], np.int32),
                                   max_new=6)
    pool = sz.pool()
    new = jax.jit(kv_pool.apply, donate_argnums=0)(pool, update)
    assert pool.k.is_deleted() and pool.v.is_deleted()
    pages, offsets = pt.slot_mapping(table, np.zeros((6, 1), np.int32))
    ones = np.ones((6, 1, 1, 1), np.float32)
    newer = jax.jit(kv_pool.write, donate_argnums=0)(new, 0, ones, ones, pages, offsets)
    assert new.k.is_deleted() and new.v.is_deleted()
    assert float(newer.k[0, 0, 0, 0, 0]) == 1.0


@pytest.mark.parametrize("bad", ["num_pages", "page_size", "max_seqs", "max_pages_per_seq"])
def test_create_rejects_bad_sizes(bad):
    sizes = dict(num_pages=4, page_size=4, max_seqs=2, max_pages_per_seq=2)
    with pytest.raises(ValueError, match=bad):
        pt.create(**{**sizes, bad: 0})
