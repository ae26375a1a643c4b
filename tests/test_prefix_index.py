"""The prefix index and the page table together, driven by a hypothesis state machine.

Random admissions (lookup -> evict for room -> attach the hit -> reserve and write the rest ->
index the full pages), extensions, forks, releases, evictions, a salt's drops and clears run on
the real jitted table ops and a tiny pool that stores token ids (1 layer, 1 kv head, head_dim
1: ``k`` holds the id, ``v`` the id + 0.5). After every operation:

* ref counts = block-table entries + one per page the index holds;
* every cached page holds exactly its tokens (a sharer's write never reaches it: copy-on-write),
  and its digest is the chain over its ancestors' tokens and its salt;
* every row reads back the tokens it holds;
* evictions only drop chain tails whose only holder is the index, never a protected page, and
  as many as ``PrefixIndex.evictable`` counted (the room a sharded engine routes by).

A small token alphabet makes prefixes collide all the time; two salts share nothing.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule, run_state_machine_as_test)

from paxkv.table import page_table as pt
from paxkv.cache import pool as kv_pool
from paxkv.prefix.index import PrefixIndex, salt_bytes

reserve_jit = jax.jit(pt.reserve, static_argnames="max_new")
attach_jit = jax.jit(pt.attach)
release_jit = jax.jit(pt.release)
fork_jit = jax.jit(pt.fork)
retain_jit = jax.jit(pt.retain, static_argnames="delta")
slot_mapping_jit = jax.jit(pt.slot_mapping)
apply_jit = jax.jit(kv_pool.apply)
write_jit = jax.jit(kv_pool.write)

MIN_OPS = 1_000
SALTS = (None, "tenant-b")


@dataclasses.dataclass(frozen=True)
class Sizes:
    num_pages: int
    page_size: int
    max_seqs: int
    max_pages_per_seq: int

    @property
    def max_len(self) -> int:
        return self.page_size * self.max_pages_per_seq


SIZES = (Sizes(10, 2, 4, 5), Sizes(8, 3, 3, 4), Sizes(9, 1, 3, 6))


class PrefixIndexMachine(RuleBasedStateMachine):
    ops = 0

    @initialize(sz=st.sampled_from(SIZES))
    def setup(self, sz: Sizes):
        self.sz = sz
        self.table = pt.create(num_pages=sz.num_pages, page_size=sz.page_size,
                               max_seqs=sz.max_seqs, max_pages_per_seq=sz.max_pages_per_seq)
        self.pool = kv_pool.create(num_layers=1, num_pages=sz.num_pages, num_kv_heads=1,
                                   page_size=sz.page_size, head_dim=1, fill=-1.0)
        self.index = PrefixIndex(sz.page_size)
        self.tokens: list[list[int] | None] = [None] * sz.max_seqs  # what each row holds
        self.salts: list[str | None] = [None] * sz.max_seqs
        self.history: list[list[int]] = []
        self.steps = 0  # this run's operations (preconditions must not read global state)

    # -- helpers ------------------------------------------------------------------------
    def _retain(self, pages: list[int], delta: int) -> None:
        width = self.sz.num_pages
        for i in range(0, len(pages), width):
            chunk = pages[i:i + width]
            padded = np.full(width, self.sz.num_pages, np.int32)
            padded[:len(chunk)] = chunk
            self.table = retain_jit(self.table, padded, delta=delta)

    def _free(self) -> int:
        return int(np.sum(np.asarray(self.table.ref_counts) == 0))

    def _evict(self, num: int, protect=()) -> list[int]:
        refs = np.asarray(self.table.ref_counts).copy()
        before = {e.page: e for e in self.index.entries()}
        can = self.index.evictable(refs, protect)  # the room a sharded engine routes by
        pages = self.index.evict(num, refs, protect)
        assert len(pages) == min(num, can) and len(set(pages)) == len(pages)
        for p in pages:
            assert refs[p] == 1, "evicted a page someone else still holds"
            assert p not in protect, "evicted a protected page"
            assert p in before and p not in self.index
        remaining = {e.parent_page for e in self.index.entries()}
        assert not remaining & set(pages), "evicted a page whose chain continues (not a tail)"
        self._retain(pages, -1)
        assert all(np.asarray(self.table.ref_counts)[pages] == 0)
        return pages

    def _grow(self, row: int, new: list[int]) -> bool:
        """Reserves and writes ``new`` tokens after what ``row`` holds (all-or-nothing)."""
        sz, held = self.sz, self.tokens[row] or []
        num_new = np.zeros(sz.max_seqs, np.int32)
        num_new[row] = len(new)
        self.table, update, ok = reserve_jit(self.table, num_new, max_new=sz.max_len)
        self.pool = apply_jit(self.pool, update)
        if not bool(ok[row]):
            return False
        positions = np.full((1, sz.max_len), -1, np.int32)
        positions[0, :len(new)] = np.arange(len(held), len(held) + len(new))
        values = np.zeros((1, sz.max_len, 1, 1), np.float32)
        values[0, :len(new), 0, 0] = new
        pages, offsets = slot_mapping_jit(self.table, positions, np.array([row], np.int32))
        self.pool = write_jit(self.pool, 0, values, values + 0.5, pages, offsets)
        self.tokens[row] = held + list(new)
        return True

    def _index_row(self, row: int) -> None:
        held, ps = self.tokens[row], self.sz.page_size
        full = len(held) // ps
        pages = np.asarray(self.table.block_tables)[row, :full]
        new = self.index.insert(held[:full * ps], pages.tolist(), self.salts[row])
        assert set(new) <= set(pages.tolist())
        self._retain(new, 1)

    def _seq(self, n_min: int, n_max: int):
        return st.lists(st.integers(1, 3), min_size=n_min, max_size=n_max)

    def _rows(self, active: bool) -> list[int]:
        return [b for b in range(self.sz.max_seqs) if (self.tokens[b] is not None) == active]

    # -- rules --------------------------------------------------------------------------
    @rule(data=st.data())
    def admit(self, data):
        sz = self.sz
        row = data.draw(st.integers(0, sz.max_seqs - 1))
        if self.tokens[row] is not None:  # a new request replaces this row's (indexed) one
            self._index_row(row)
            self.table, _ = release_jit(self.table, np.arange(sz.max_seqs) == row)
            self.tokens[row] = None
        salt = data.draw(st.sampled_from(SALTS))
        tokens = data.draw(self._seq(1, sz.max_len))
        if self.history and data.draw(st.booleans()):  # mostly a prefix seen before
            base = data.draw(st.sampled_from(self.history))
            tokens = (base[:data.draw(st.integers(0, len(base)))] + tokens)[:sz.max_len]
        self.history = (self.history + [tokens])[-8:]
        hit = self.index.match(tokens, salt, max_tokens=len(tokens) - 1)
        ps, m = sz.page_size, hit.num_tokens
        assert m <= len(tokens) - 1 and len(hit.pages) == -(-m // ps)
        k = np.asarray(self.pool.k)[0, :, 0, :, 0]
        for i, page in enumerate(hit.pages):  # a hit serves exactly the tokens asked for
            span = tokens[i * ps:min(m, (i + 1) * ps)]
            assert k[page, :len(span)].tolist() == span, "hit pages hold other tokens"
        need = -(-len(tokens) // ps) - -(-m // ps) + int(m % ps != 0)
        if need > self._free():
            self._evict(need - self._free(), protect=hit.pages)
        if m:
            pages = np.full((1, sz.max_pages_per_seq), sz.num_pages, np.int32)
            pages[0, :len(hit.pages)] = hit.pages
            self.table, ok = attach_jit(self.table, np.array([row], np.int32), pages,
                                        np.array([m], np.int32))
            assert bool(ok[0]), "attaching a live hit must succeed"
            self.tokens[row] = tokens[:m]
        self.salts[row] = salt
        if not self._grow(row, tokens[m:]):
            assert need > self._free(), "reserve failed although the pool had room"
            self.table, _ = release_jit(self.table, np.arange(sz.max_seqs) == row)
            self.tokens[row] = None
            return
        self._index_row(row)
        PrefixIndexMachine.ops += 1

    @precondition(lambda self: self._rows(active=True))
    @rule(data=st.data())
    def extend(self, data):
        row = data.draw(st.sampled_from(self._rows(active=True)))
        room = self.sz.max_len - len(self.tokens[row])
        if room:
            self._grow(row, data.draw(self._seq(1, room)))
        PrefixIndexMachine.ops += 1

    @precondition(lambda self: self._rows(active=True) and self._rows(active=False))
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self._rows(active=True)))
        child = data.draw(st.sampled_from(self._rows(active=False)))
        self.table, ok = fork_jit(self.table, np.array([parent], np.int32),
                                  np.array([child], np.int32))
        assert bool(ok[0])
        self.tokens[child], self.salts[child] = list(self.tokens[parent]), self.salts[parent]
        PrefixIndexMachine.ops += 1

    @precondition(lambda self: self._rows(active=True))
    @rule(data=st.data(), index_first=st.booleans())
    def release(self, data, index_first):
        row = data.draw(st.sampled_from(self._rows(active=True)))
        if index_first:
            self._index_row(row)
        self.table, ok = release_jit(self.table, np.arange(self.sz.max_seqs) == row)
        assert bool(ok[row])
        self.tokens[row] = None
        PrefixIndexMachine.ops += 1

    @rule(num=st.integers(0, 4))
    def evict(self, num):
        self._evict(num)
        PrefixIndexMachine.ops += 1

    @precondition(lambda self: len(self.index) and self.steps % 5 == 4)
    @rule(salt=st.sampled_from(SALTS))
    def drop_salt(self, salt):
        others = {e for e in self.index.entries() if e.salt != salt_bytes(salt)}
        self._retain(self.index.drop_salt(salt), -1)
        assert set(self.index.entries()) == others  # that salt's pages only, every one
        PrefixIndexMachine.ops += 1

    @precondition(lambda self: len(self.index) and self.steps % 7 == 6)
    @rule()
    def clear(self):
        self._retain(self.index.clear(), -1)
        assert len(self.index) == 0
        PrefixIndexMachine.ops += 1

    # -- invariants ---------------------------------------------------------------------
    @invariant()
    def ref_counts_are_rows_plus_index(self):
        self.steps += 1
        sz = self.sz
        bt, lengths = np.asarray(self.table.block_tables), np.asarray(self.table.lengths)
        cells = np.arange(sz.max_pages_per_seq)[None, :] < -(-lengths // sz.page_size)[:, None]
        expected = np.bincount(bt[cells], minlength=sz.num_pages)
        expected[self.index.pages()] += 1
        assert np.array_equal(np.asarray(self.table.ref_counts), expected)
        for b in range(sz.max_seqs):
            assert lengths[b] == len(self.tokens[b] or [])

    @invariant()
    def cached_pages_hold_their_tokens_and_chain(self):
        k = np.asarray(self.pool.k)[0, :, 0, :, 0]
        v = np.asarray(self.pool.v)[0, :, 0, :, 0]
        entries = {e.page: e for e in self.index.entries()}
        assert len(entries) == len(self.index)
        for e in entries.values():
            assert k[e.page].tolist() == list(e.tokens), "a cached page was overwritten"
            assert np.array_equal(v[e.page], np.add(e.tokens, 0.5))
            path, node = [], e
            while node is not None:
                path[:0] = node.tokens
                node = entries.get(node.parent_page)
            depth = len(path) // self.sz.page_size
            assert self.index.digests(path, e.salt)[depth - 1] == e.digest
            parent = entries.get(e.parent_page)
            assert parent is None if e.parent_page < 0 else parent.salt == e.salt

    @invariant()
    def rows_read_back_their_tokens(self):
        k = np.asarray(self.pool.k)[0, :, 0, :, 0]
        bt, ps = np.asarray(self.table.block_tables), self.sz.page_size
        for b, held in enumerate(self.tokens):
            if held:
                pos = np.arange(len(held))
                assert k[bt[b, pos // ps], pos % ps].tolist() == held, f"row {b}"

    def teardown(self):
        if not hasattr(self, "index"):
            return
        self._retain(self.index.clear(), -1)
        self.table, _ = release_jit(self.table, np.ones(self.sz.max_seqs, bool))
        assert self._free() == self.sz.num_pages


def test_prefix_index_state_machine():
    PrefixIndexMachine.ops = 0
    run_state_machine_as_test(PrefixIndexMachine, settings=settings(
        max_examples=45, stateful_step_count=40, deadline=None, database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
    print(f"prefix-index state machine: {PrefixIndexMachine.ops} operations")
    assert PrefixIndexMachine.ops >= MIN_OPS


def test_salts_and_partial_hits():
    index = PrefixIndex(4)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert index.insert(tokens, [7, 3], "a") == [7, 3]
    assert index.match(tokens, "b").pages == ()  # another tenant sees nothing
    hit = index.match(tokens, "a")
    assert (hit.pages, hit.num_tokens, hit.num_full) == ((7, 3), 8, 2)
    hit = index.match([1, 2, 3, 4, 5, 6, 0], "a")  # shares 2 tokens of the second page
    assert (hit.pages, hit.num_tokens, hit.partial) == ((7, 3), 6, True)
    assert index.match(tokens, "a", max_tokens=5).num_tokens == 5
    refs = np.zeros(8, np.int32)
    refs[[7, 3]] = 1
    assert index.evict(1, refs) == [3]  # the chain tail goes first
    assert index.evict(5, refs, protect=[7]) == []
    assert index.insert(tokens, [2, 5], "b") == [2, 5] and index.drop_salt("c") == []
    assert index.drop_salt("b") == [2, 5] and index.match(tokens, "b").pages == ()
    assert index.clear() == [7] and len(index) == 0


def test_attach_fails_cleanly():
    """Bad pairs change nothing; good pairs in the same call still attach."""
    table = pt.create(num_pages=6, page_size=2, max_seqs=4, max_pages_per_seq=3)
    table, _, ok = reserve_jit(table, np.array([3, 0, 0, 0], np.int32), max_new=6)
    assert bool(ok[0])
    held = np.asarray(table.block_tables)[0, :2]  # row 0 holds 3 tokens in 2 pages
    free_page = int(np.flatnonzero(np.asarray(table.ref_counts) == 0)[0])
    pages = np.full((5, 3), 6, np.int32)
    pages[:, :2] = held
    pages[2, 1] = free_page  # a page nobody holds
    rows = np.array([0, 1, 2, 3, 3], np.int32)  # row 0 is active; row 3 named twice
    lengths = np.array([3, 3, 3, 3, 3], np.int32)
    before = {k: np.asarray(getattr(table, k)) for k in ("block_tables", "lengths", "active")}
    after, ok = attach_jit(table, rows, pages, lengths)
    assert np.asarray(ok).tolist() == [False, True, False, False, False]
    bt = np.asarray(after.block_tables)
    assert bt[1].tolist() == [*held.tolist(), 6] and int(after.lengths[1]) == 3
    for row in (0, 2, 3):
        for name, value in before.items():
            assert np.array_equal(np.asarray(getattr(after, name))[row], value[row])
    refs = np.asarray(after.ref_counts)
    assert refs[held].tolist() == [2, 2] and refs[free_page] == 0
    _, ok = attach_jit(table, np.array([1, 2], np.int32), pages[:2],
                       np.array([0, 7], np.int32))  # empty; longer than a row holds
    assert not np.asarray(ok).any()


def test_evictable_skips_a_page_whose_chain_continues_in_a_page_in_use():
    """Sequence B cached page 7 for tokens [1, 2]; sequence A prefilled its own copy (page 0),
    so only its second page (5) was indexed, chained under 7. With B gone, 7 is held by the
    index alone but cannot go while A holds 5: counting every page of ref count 1 as room
    would promise a page eviction cannot free."""
    index = PrefixIndex(2)
    assert index.insert([1, 2], [7]) == [7]
    assert index.insert([1, 2, 3, 4], [0, 5]) == [5]
    refs = np.zeros(8, np.int32)
    refs[[0, 7]], refs[5] = 1, 2  # A holds 0 and 5; the index holds 7 and 5
    assert index.evictable(refs) == 0 and index.evict(8, refs) == []
    refs[[0, 5]] -= 1  # A released
    assert index.evictable(refs) == 2 and index.evictable(refs, protect=[7]) == 1
    assert index.evictable(refs, protect=[5]) == 0  # 7 waits for its protected tail
    assert index.evict(8, refs) == [5, 7]
