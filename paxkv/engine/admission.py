"""Where a new request goes and whether it fits there: the page side of admission.

A row draws only on its data shard's pages (:class:`paxkv.core.protocol.Shards`; a cache without
shards is one shard), so both questions are a shard's: :func:`route` picks the free row (in a
held prefix's shard; else in the shard whose prefix index serves the most of the prompt, when
it fits there; else in the least-loaded shard) and :func:`fits` checks the request's pages
against that shard's free pages less the growth its running requests are projected to take
(:class:`paxkv.engine.policy.Growth`), evicting the shard's cached prefix pages for room first.
:class:`Admission` is handed exactly the parts it reads (the request table, the cache
operations, the prefix cache, the growth projection) and changes nothing but the prefix
index's evictions; :class:`paxkv.engine.scheduler.Scheduler` acts on its answers.
"""

from __future__ import annotations

from paxkv.engine import policy
from paxkv.scale import routing as shard_routing
from paxkv.engine.cache_ops import CacheOps
from paxkv.engine.prefix_sharing import SharedPrefixes
from paxkv.engine.requests import Request, RequestTable
from paxkv.prefix.index import Hit


class Admission:
    """The page side of admission for one engine: reads its parts, decides, evicts."""

    def __init__(self, table: RequestTable, ops: CacheOps, prefixes: SharedPrefixes | None,
                 growth: policy.Growth):
        self.table, self.ops, self.prefixes, self.growth = table, ops, prefixes, growth

    def route(self, req: Request, holder: Request | None, hits: list[Hit]) -> int | None:
        """The free row a new request takes: in its held prefix's shard (a fork shares pages, so
        it cannot cross shards; None when that shard has no free row), else in the shard whose
        prefix index serves the most of it, if it fits there, else in the least-loaded shard
        (:func:`paxkv.engine.routing.pick_row_for_hits`; one shard: the lowest free row).

        Args:
          hits: the request's prefix-cache hit in each shard (``[]`` without a prefix cache).
        Pages only an index holds count as free: eviction makes them room.
        """
        free_rows, ops = self.table.free_rows(), self.ops
        if holder is not None:
            mine = [r for r in free_rows if ops.shard_of(r) == ops.shard_of(holder.row)]
            return mine[0] if mine else None
        if ops.num_shards == 1:
            return free_rows[0]
        queued = policy.queued_tokens(self.table.running(), ops.rows_per_shard, ops.num_shards)
        free, ps = ops.shard_free.copy(), ops.cache.page_size
        if not hits:  # no prefix cache
            return shard_routing.pick_row(free_rows, ops.rows_per_shard, free, queued, ps)
        free += self.prefixes.reclaimable(hits)
        fit = []
        for shard, hit in enumerate(hits):
            ahead, busy = self.pages_ahead(shard)
            need = policy.pages_to_admit(len(req.tokens), hit.num_tokens, ps)
            fit.append(policy.admits(need, int(free[shard]) - ahead, busy))
        return shard_routing.pick_row_for_hits(free_rows, ops.rows_per_shard, free, queued, ps,
                                               [h.num_tokens for h in hits], fit)


    def pages_ahead(self, shard: int) -> tuple[int, bool]:
        """Pages ``shard``'s running requests are projected to grow into
        (:meth:`paxkv.engine.policy.Growth.pages_ahead`), and whether it runs any."""
        mine = [r for r in self.table.running() if self.ops.shard_of(r.row) == shard]
        return self.growth.pages_ahead(mine, self.ops.cache.page_size), bool(mine)


    def fits(self, row: int, need: int, hit: Hit) -> bool:
        """Whether ``need`` pages fit ``row``'s shard beside the growth its running requests are
        projected to take, evicting that shard's cached pages (all but ``hit``'s) for room first;
        a shard running nothing admits anyway (:func:`paxkv.engine.policy.admits`)."""
        ops = self.ops
        shard = ops.shard_of(row)
        ahead, busy = self.pages_ahead(shard)
        short = need + ahead - int(ops.shard_free[shard])
        if short > 0 and self.prefixes is not None:
            self.prefixes.evict(short, protect=hit.pages, shard=shard)
        return policy.admits(need, int(ops.shard_free[shard]) - ahead, busy)

    def make_room(self, req: Request) -> None:
        """Evicts cached pages of ``req``'s shard until its row (already placed: an extended
        held row) can take the tokens it has yet to feed; a row the pool still cannot hold is
        preempted by its prefill, as any prefill's."""
        need = policy.pages_to_admit(len(req.tokens), req.cached, self.ops.cache.page_size)
        shard = self.ops.shard_of(req.row)
        short = need - int(self.ops.shard_free[shard])
        if short > 0 and self.prefixes is not None:
            self.prefixes.evict(short, shard=shard)
