"""The engine's shard decisions with no devices: where admission places a request on a sharded
cache, whose pages it is checked against, where forked samples go, and whom a dry shard
preempts.

The cache here is :class:`FakeShards`: the sizes and per-shard free counts of a two-shard
cache (:class:`paxkv.core.protocol.Shards`) and, for the prefix cache, numpy block tables and ref
counts in place of the device's (the jitted fork, attach and retain are recorded, and applied
to those counts, instead of run). The same decisions on real forced devices:
``tests/test_mesh.py``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from paxkv.prefix import holds as page_holds

from paxkv.engine import policy

from paxkv.scale import routing as shard_routing
from paxkv.engine.accounting import Counters
from paxkv.engine.cache_ops import CacheOps
from paxkv.engine.lifecycle import Lifecycle
from paxkv.engine.prefix_sharing import SharedPrefixes
from paxkv.core.protocol import Shards, shard_layout
from paxkv.engine.requests import Request, RequestTable
from paxkv.engine.requests import RowState
from paxkv.core.sampling import SamplingParams
from paxkv.engine.scheduler import Scheduler


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

    def __post_init__(self) -> None:
        # what page_holds reads of a real cache: [data, num_pages], [max_seqs, pages a row]
        self.refs = np.zeros((self.num_shards, self.num_pages), np.int64)
        self.block_tables = np.full((self.max_seqs, self.max_len // self.page_size),
                                    self.num_pages, np.int64)


class RecordingOps(CacheOps):
    """:class:`CacheOps` whose fork, attach and retain record their arguments instead of
    running (retain also counts into the fake's ref counts)."""

    forks: list[tuple[int, list[int]]]
    attaches: list[tuple[int, list[int], int]]
    retains: list[tuple[list[list[int]], int]]

    def fork(self, parent: int, children: list[int]) -> None:
        self.forks.append((parent, list(children)))

    def attach(self, row: int, pages: list[int], num_tokens: int) -> None:
        self.attaches.append((row, list(pages), num_tokens))

    def retain_shards(self, pages_by_shard: list[list[int]], delta: int) -> None:
        self.retains.append(([list(map(int, p)) for p in pages_by_shard], delta))
        for shard, pages in enumerate(pages_by_shard):
            np.add.at(self.cache.refs[shard], np.asarray(pages, np.int64), delta)


@pytest.fixture
def fake_reads(monkeypatch):
    """The prefix cache reads a :class:`FakeShards`' numpy tables (a real cache's live on the
    device)."""
    monkeypatch.setattr(page_holds, "ref_counts", lambda cache: cache.refs)
    monkeypatch.setattr(page_holds, "block_tables", lambda cache: cache.block_tables)


def _req(rid: int, prompt: int, max_new: int = 8, output: int = 0, **kw) -> Request:
    r = Request.make(rid, list(range(prompt)), SamplingParams(max_new_tokens=max_new),
                     frozenset(), np.zeros(2, np.uint32), **kw)
    r.output = list(range(output))
    return r


def _engine_parts(cache: FakeShards,
                  cached: bool = False) -> tuple[Scheduler, RequestTable, RecordingOps]:
    """A scheduler over ``cache`` (with a prefix index per shard when ``cached``) admitting
    whatever fits now."""
    table = RequestTable(cache.max_seqs)
    ops = RecordingOps(cache)
    ops.forks, ops.attaches, ops.retains = [], [], []
    prefixes = SharedPrefixes(ops, cache.page_size) if cached else None
    rows, counters, growth = RowState(table), Counters(), policy.Growth(start=0.0, floor=0.0)
    life = Lifecycle(None, table, rows, ops, prefixes, counters, growth)
    return Scheduler(model=None, table=table, rows=rows, ops=ops, prefixes=prefixes,
                     counters=counters, growth=growth, life=life, prefill_chunk=16,
                     prefill_tokens=64), table, ops


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
    from paxkv.scale.routing import pick_shard  # noqa: PLC0415

    assert pick_shard([4, 4], [3, 9], rows=2) == 1
    assert pick_shard([1, 4], [9, 3], rows=2) == 1  # shard 0 lacks the rows
    assert pick_shard([2, 2], [5, 5], rows=2) == 0  # ties: the lower shard
    assert pick_shard([1, 1], [5, 5], rows=2) is None


# -- the prefix cache on shards ------------------------------------------------------------
PROMPT = list(range(100, 110))  # 2 full pages of 4 and 2 tokens


def test_routing_prefers_the_shard_whose_hit_is_longest_when_it_fits():
    route = shard_routing.pick_row_for_hits
    # least loaded: shard 0 (more free pages); the hit lives in shard 1
    assert shard_routing.pick_row([0, 1, 2, 3], 2, [8, 6], [0, 0], 4) == 0
    assert route([0, 1, 2, 3], 2, [8, 6], [0, 0], 4, [0, 8], [True, True]) == 2
    assert route([0, 1, 2, 3], 2, [8, 6], [0, 0], 4, [4, 8], [True, True]) == 2  # longest
    assert route([0, 3], 2, [2, 6], [0, 0], 4, [8, 8], [True, True]) == 3  # ties: headroom
    assert route([0, 3], 2, [6, 6], [0, 0], 4, [8, 8], [True, True]) == 0  # then lower shard
    # the hit shard has no free row, or the request does not fit it: least loaded
    assert route([0, 1], 2, [8, 6], [0, 0], 4, [0, 8], [True, True]) == 0
    assert route([0, 1, 2, 3], 2, [8, 1], [0, 0], 4, [0, 8], [True, False]) == 0
    # no hit anywhere: pick_row's choice
    assert route([0, 1, 2, 3], 2, [5, 6], [0, 0], 4, [0, 0], [True, True]) == 2
    with pytest.raises(ValueError, match="at least one free row"):
        route([], 2, [1, 1], [0, 0], 4, [0, 0], [True, True])


def _cache_prompt(sched: Scheduler, shard: int, tokens: list[int], pages: list[int]) -> None:
    """``tokens`` cached in ``shard``'s index on ``pages`` (held by the index alone)."""
    new = sched.prefixes.shards[shard].insert(tokens, pages)
    sched.ops.retain(new, 1, shard)
    sched.ops.shard_free[shard] -= len(new)


def _queue(table: RequestTable, *reqs: Request) -> None:
    for r in reqs:
        table.add(r)
        table.waiting.append(r)


def _prompt_req(rid: int, prompt: list[int] = PROMPT) -> Request:
    return Request.make(rid, prompt, SamplingParams(max_new_tokens=4), frozenset(),
                        np.zeros(2, np.uint32))


def test_a_request_goes_to_the_shard_holding_its_prefix(fake_reads):
    """The hit lives in shard 1, the least-loaded shard is 0: the request takes row 2 and
    attaches shard 1's pages (their ids mean other pages in shard 0)."""
    sched, table, ops = _engine_parts(FakeShards(), cached=True)
    _cache_prompt(sched, 1, PROMPT[:8], [5, 6])
    assert ops.shard_free.tolist() == [8, 6] and ops.cache.refs[1, [5, 6]].tolist() == [1, 1]
    req = _prompt_req(0)
    _queue(table, req)
    assert sched.admit() == [req] and req.row == 2
    assert ops.attaches == [(2, [5, 6], 8)]
    assert req.num_cached_tokens == 8 and sched.prefixes.hit_tokens == 8
    assert ops.shard_free.tolist() == [8, 5]  # 1 page: the rest of its prompt and a token
    assert len(sched.prefixes) == 2 and sched.prefixes.lookup_tokens == 10
    with pytest.raises(AttributeError, match="one prefix index per shard"):
        sched.prefixes.index  # noqa: B018


def test_a_hit_shard_without_a_free_row_or_room_sends_the_request_elsewhere(fake_reads):
    sched, table, ops = _engine_parts(FakeShards(), cached=True)
    _cache_prompt(sched, 1, PROMPT[:8], [5, 6])
    _run(table, _req(10, 3), row=2, cached=3)
    _run(table, _req(11, 3), row=3, cached=3)
    req = _prompt_req(0)
    _queue(table, req)
    assert sched.admit() == [req] and req.row == 0 and ops.attaches == []
    assert req.num_cached_tokens == 0
    # a row is free again, but shard 1 is busy and out of pages (the hit's own pages cannot
    # be evicted for it): shard 0 again
    sched, table, ops = _engine_parts(FakeShards(), cached=True)
    _cache_prompt(sched, 1, PROMPT[:8], [5, 6])
    _run(table, _req(10, 3), row=3, cached=3)
    ops.shard_free[1] = 0
    req = _prompt_req(0)
    _queue(table, req)
    assert sched.admit() == [req] and req.row == 0 and ops.attaches == []


def test_eviction_for_a_hit_frees_pages_in_the_hits_shard_only(fake_reads):
    """Shard 1 holds the hit (pages 5, 6) and another prompt's pages 1, 2; shard 0 holds a
    third prompt on its own pages 1, 2. Shard 1 has no free page, but evicting makes room
    there: the request goes to shard 1, which drops its own chain tail (page 2), never the
    hit's pages, and shard 0's index is left alone."""
    sched, table, ops = _engine_parts(FakeShards(), cached=True)
    _cache_prompt(sched, 1, PROMPT[:8], [5, 6])
    _cache_prompt(sched, 1, list(range(50, 58)), [1, 2])
    _cache_prompt(sched, 0, list(range(70, 78)), [1, 2])
    _run(table, _req(10, 3), row=3, cached=3)
    ops.shard_free[1] = 0
    req = _prompt_req(0)
    _queue(table, req)
    assert sched.admit() == [req] and req.row == 2 and ops.attaches == [(2, [5, 6], 8)]
    assert ops.retains[-1] == ([[], [2]], -1)
    assert sched.prefixes.shards[0].pages() == [1, 2]
    assert sched.prefixes.shards[1].pages() == [1, 5, 6]
    assert ops.cache.refs[0, [1, 2]].tolist() == [1, 1] and ops.cache.refs[1, 2] == 0
    assert ops.shard_free.tolist() == [6, 0]  # evicted 1, took 1
    # its written pages go to its shard's index, under shard 1's ids
    ops.cache.block_tables[2, :3] = [5, 6, 3]
    req.output, req.cached = [1, 2], 12
    sched.prefixes.index_rows([req])
    assert ops.retains[-1] == ([[], [3]], 1)
    assert sched.prefixes.shards[1].pages() == [1, 3, 5, 6]
    assert sched.prefixes.shards[0].pages() == [1, 2]


def test_one_prompt_prefills_once_per_shard_in_a_round(fake_reads):
    """Three requests of one uncached prompt: the first two start in different shards (each
    shard prefills its own copy), the third waits for the next round, when it hits."""
    sched, table, _ = _engine_parts(FakeShards(), cached=True)
    reqs = [_prompt_req(i) for i in range(3)]
    _queue(table, *reqs)
    assert sched.admit() == reqs[:2] and [r.row for r in reqs[:2]] == [0, 2]
    assert list(table.waiting) == [reqs[2]]


def test_the_engine_steps_the_model_it_placed_on_the_mesh():
    """The engine places the model's weights on its mesh once; its step must run that placed
    model, not the caller's (whose weights would move to the mesh inside every step)."""
    import jax  # noqa: PLC0415
    from jax.sharding import NamedSharding  # noqa: PLC0415

    import paxkv  # noqa: PLC0415
    from paxkv.scale import mesh as pmesh  # noqa: PLC0415
    from tiny import tiny_lm  # noqa: PLC0415

    lm = tiny_lm()
    engine = paxkv.Engine(lm, mesh=pmesh.make_mesh(data=1), max_seqs=2, max_len=32,
                          page_size=4)
    for stepped in (engine.scheduler.model, engine.lifecycle.model):
        assert stepped is engine.model and stepped is not lm
        assert all(isinstance(x.sharding, NamedSharding)
                   for x in jax.tree.leaves(stepped.params))
    rid = engine.submit([5, 6, 7], max_new_tokens=3)
    assert len(engine.run()[rid].token_ids) == 3
