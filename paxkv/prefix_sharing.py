"""The engine's prefix cache: the host-side index (:mod:`paxkv.prefix_cache`) kept in step with
the pages it holds references on (:class:`paxkv.cache_ops.CacheOps`).

A new request looks up its longest cached chain of full pages (plus a partial page) and
attaches it to its row, prefilling only the rest; a request's written full pages are indexed
when it finishes its prompt, is preempted or is released; cached pages nobody else holds are
evicted, chain tails first, when admission or a decode step needs room.
"""

from __future__ import annotations

import numpy as np

from paxkv.cache_ops import CacheOps
from paxkv.prefix_cache import Hit, PrefixIndex
from paxkv.requests import Request


class SharedPrefixes:
    """A :class:`PrefixIndex` whose every page holds one reference in ``ops``' cache."""

    def __init__(self, ops: CacheOps, page_size: int):
        self.ops, self.page_size = ops, page_size
        self.index = PrefixIndex(page_size)

    def lookup(self, req: Request) -> tuple[Hit, list[bytes]]:
        """The longest cached prefix (at most all but the last token) and the digests of the
        request's full pages."""
        limit = len(req.tokens) - 1
        return (self.index.match(req.tokens, req.salt, max_tokens=limit),
                self.index.digests(req.tokens[:limit], req.salt))

    def attach(self, req: Request, hit: Hit) -> None:
        """``req`` (placed in a row) starts from the hit's pages."""
        self.ops.attach(req.row, hit.pages, hit.num_tokens)
        req.cached = hit.num_tokens

    def index_rows(self, reqs: list[Request]) -> None:
        """Indexes the full pages each request has written (the index takes a reference)."""
        reqs = [r for r in reqs if r.row is not None and r.cached >= self.page_size]
        if not reqs:
            return
        tables = np.asarray(self.ops.cache.table.block_tables)
        new: list[int] = []
        for r in reqs:
            full = r.cached // self.page_size
            new += self.index.insert(r.tokens[:full * self.page_size], tables[r.row, :full],
                                     r.salt)
        self.ops.retain(new, 1)

    def evict(self, num: int, protect: tuple[int, ...] = ()) -> None:
        """Drops up to ``num`` cached pages only the index holds (never ``protect``)."""
        if not len(self.index):
            return
        ref_counts = np.asarray(self.ops.cache.table.ref_counts)
        pages = self.index.evict(num, ref_counts, protect)
        self.ops.retain(pages, -1)
        self.ops.free += len(pages)

    def clear(self) -> int:
        """Drops every cached page's reference; returns how many the index held."""
        pages = self.index.clear()
        self.ops.retain(pages, -1)
        self.ops.refresh_free()
        return len(pages)
