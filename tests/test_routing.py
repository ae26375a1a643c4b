"""The engine's shard decisions with no devices: where admission places a request on a sharded
cache, whose pages it is checked against, where forked samples go, and whom a dry shard
preempts.

The cache here is :class:`FakeShards`: the sizes and per-shard free counts of a two-shard
cache (:class:`paxkv.protocol.Shards`) and no arrays, which is all admission and branching
read (the jitted fork is recorded instead of run). The same decisions on real forced devices:
``tests/test_mesh.py``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from paxkv import policy
from paxkv.accounting import Counters
from paxkv.cache_ops import CacheOps
from paxkv.lifecycle import Lifecycle
from paxkv.protocol import Shards, shard_layout
from paxkv.requests import Request, RequestTable
from paxkv.rows import RowState
from paxkv.sampling import SamplingParams
from paxkv.scheduler import Scheduler


@dataclasses.dataclass
class FakeShards:
    """A paged cache's sizes split over ``num_shards`` shards; ``num_pages`` is one shard's."""

    num_shards: int = 2
    rows_per_shard: int = 2
    num_pages: int = 8
    page_size: int = 4
    max_len: int = 64
    shares_pages = True

    @property
    def max_seqs(self) -> int:
        return self.num_shards * self.rows_per_shard

    @property
    def total_pages(self) -> int:
        return self.num_shards * self.num_pages

    def shard_free_pages(self) -> np.ndarray:
        return np.full(self.num_shards, self.num_pages, np.int32)


class RecordingOps(CacheOps):
    """:class:`CacheOps` whose fork records ``(parent, children)`` instead of running."""

    forks: list[tuple[int, list[int]]]

    def fork(self, parent: int, children: list[int]) -> None:
        self.forks.append((parent, list(children)))


def _req(rid: int, prompt: int, max_new: int = 8, output: int = 0, **kw) -> Request:
    r = Request.make(rid, list(range(prompt)), SamplingParams(max_new_tokens=max_new),
                     frozenset(), np.zeros(2, np.uint32), **kw)
    r.output = list(range(output))
    return r


def _engine_parts(cache: FakeShards) -> tuple[Scheduler, RequestTable, RecordingOps]:
    table = RequestTable(cache.max_seqs)
    ops = RecordingOps(cache)
    ops.forks = []
    life = Lifecycle(None, table, RowState(table), ops, None, Counters(),
                     policy.Growth(start=0.0, floor=0.0))
    return Scheduler(life, prefill_chunk=16, prefill_tokens=64), table, ops


def _run(table: RequestTable, req: Request, row: int, cached: int) -> Request:
    """``req`` running in ``row`` with ``cached`` tokens written."""
    table.add(req)
    table.place(req, row)
    req.cached = cached
    return req


def test_the_one_shard_caches_and_the_fake_describe_their_shards():
    assert isinstance(FakeShards(), Shards) and shard_layout(FakeShards()) == (2, 2)
    ops = CacheOps(FakeShards(num_shards=3))
    assert ops.shard_free.tolist() == [8, 8, 8] and ops.free == 24
    ops.take(5, 3)  # row 5 is shard 2
    assert ops.shard_free.tolist() == [8, 8, 5] and ops.free == 21


def test_queued_tokens_count_each_shards_unwritten_prompt_and_output():
    table = RequestTable(4)
    _run(table, _req(0, 10, max_new=6), row=0, cached=4)  # 6 prompt + 5 output tokens
    _run(table, _req(1, 3, max_new=2, output=1), row=1, cached=3)  # decoding: its last token
    _run(table, _req(2, 5, max_new=4), row=3, cached=0)  # 5 + 3
    assert policy.tokens_to_write(table.rows[1]) == 1
    assert policy.queued_tokens(table.running(), 2, 2).tolist() == [12, 8]


def test_admission_spreads_new_requests_over_the_shards():
    """The lowest free row would fill shard 0 first (rows 0, 1, 2, 3); the least-loaded shard
    alternates."""
    sched, table, ops = _engine_parts(FakeShards())
    for i in range(4):
        req = _req(i, 7)  # 2 pages to admit, 14 tokens queued
        table.add(req)
        table.waiting.append(req)
    admitted = sched.admit()
    assert [r.row for r in admitted] == [0, 2, 1, 3]
    assert ops.shard_free.tolist() == [4, 4]


def test_a_request_must_fit_its_own_shard_not_the_pool():
    """Shard 1 has 10 free pages but no free row; the free row's shard has 1 page: a request
    of 2 pages waits (counted against the pool's 11 it would have been admitted)."""
    sched, table, ops = _engine_parts(FakeShards(num_pages=12))
    _run(table, _req(0, 2), row=0, cached=2)
    _run(table, _req(1, 2), row=2, cached=2)
    _run(table, _req(2, 2), row=3, cached=2)
    ops.shard_free[:] = [1, 10]
    new = _req(3, 5)
    table.add(new)
    table.waiting.append(new)
    assert sched.admit() == [] and list(table.waiting) == [new]
    ops.shard_free[0] = 2
    assert sched.admit() == [new] and new.row == 1


def test_a_shard_running_nothing_admits_a_request_larger_than_its_free_pages():
    sched, table, ops = _engine_parts(FakeShards())
    ops.shard_free[:] = [1, 1]
    req = _req(0, 7)
    table.add(req)
    table.waiting.append(req)
    assert sched.admit() == [req]  # alone in its shard: it gets its chance


def test_samples_fork_only_into_rows_of_the_parents_shard():
    """A parent in row 2 (shard 1) with free rows 0, 1 (shard 0) and 3: one child keeps its
    row, one forks into row 3, the third waits at the queue front (to be recomputed)."""
    _, table, ops = _engine_parts(FakeShards())
    life = Lifecycle(None, table, RowState(table), ops, None, Counters(), policy.Growth())
    parent = _run(table, _req(0, 6), row=2, cached=5)
    parent.n = 3
    kids = [_req(i, 6, sample_of=0) for i in (1, 2, 3)]
    for k in kids:
        table.add(k)
    life.branch(parent, kids)
    assert ops.forks == [(2, [3])]
    assert [k.row for k in kids] == [2, 3, None] and list(table.waiting) == [kids[2]]


def test_a_dry_shard_preempts_only_its_own_requests():
    """Rows 0, 1 in shard 0, rows 2, 3 in shard 1; the pool-wide cheapest recompute (row 2)
    lives in a shard whose rows all got their page."""
    reqs = [_req(i, n) for i, n in enumerate([9, 12, 2, 20])]
    for i, r in enumerate(reqs):
        r.row, r.admitted_at = i, 1
    assert policy.preemption_victim(reqs, 4, cached=False) is reqs[2]
    assert policy.preemption_victims(reqs, [0, 1], 2, 4, cached=False) == [reqs[0]]
    assert policy.preemption_victims(reqs, [3, 1], 2, 4, cached=False) == [reqs[0], reqs[2]]
    assert policy.preemption_victims(reqs, [], 2, 4, cached=False) == []
    # one shard of every row: the old single-pool choice
    assert policy.preemption_victims(reqs, [3], 4, 4, cached=False) == [reqs[2]]


def test_a_scoring_context_goes_whole_to_the_roomiest_shard_with_its_rows():
    from paxkv.shard_routing import pick_shard  # noqa: PLC0415

    assert pick_shard([4, 4], [3, 9], rows=2) == 1
    assert pick_shard([1, 4], [9, 3], rows=2) == 1  # shard 0 lacks the rows
    assert pick_shard([2, 2], [5, 5], rows=2) == 0  # ties: the lower shard
    assert pick_shard([1, 1], [5, 5], rows=2) is None
