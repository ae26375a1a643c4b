"""The engine's prefix cache: one host-side index (:mod:`paxkv.prefix.index`) per shard of the
cache, kept in step with the pages it holds references on (:class:`paxkv.engine.cache_ops.CacheOps`).

A new request looks up its longest cached chain of full pages (plus a partial page) and
attaches it to its row, prefilling only the rest; a request's written full pages are indexed
when it finishes its prompt, is preempted or is released; cached pages nobody else holds are
evicted, chain tails first, when admission or a decode step needs room.

Page ids are shard-local on a sharded cache (:mod:`paxkv.scale.sharded_cache`), so each shard has
its own index, and a hit serves only a row of the shard that holds it::

    shard 0 index: sys-prompt p0 -> p3 -> p7        shard 1 index: sys-prompt p0 -> p5
    a request with that prompt: hits [3 pages in shard 0, 2 pages in shard 1]

A lookup answers per shard and the scheduler picks the row (:mod:`paxkv.engine.routing`);
indexing, eviction and holds work in the shard of the row concerned. A one-device cache is
one shard.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from paxkv.engine.cache_ops import CacheOps
from paxkv.engine.requests import Request
from paxkv.prefix import holds as page_holds
from paxkv.prefix.index import Hit, PrefixIndex
from paxkv.prefix.window_index import GroupHit, WindowPrefixIndex


class SharedPrefixes:
    """One :class:`PrefixIndex` per shard of ``ops``' cache, each page holding one reference
    there. Its counters (``len``, ``lookup_tokens``, ``hit_tokens``, ``hit_rate``,
    ``inserted``, ``evicted``) sum the shards' (what :func:`paxkv.engine.accounting.engine_stats`
    reads)."""

    each_chunk = False  # index a prompt's pages after every prefill chunk, not only its end

    def __init__(self, ops: CacheOps, page_size: int):
        self.ops, self.page_size = ops, page_size
        self.shards: list = [PrefixIndex(page_size) for _ in range(ops.num_shards)]
        self.pinned: set[bytes] = set()  # digests :meth:`pin` keeps from eviction

    def pin(self, tokens: Sequence[int], salt: str | bytes | None = None) -> list[bytes]:
        """Keeps the full pages of ``tokens`` (``salt``'s; cached now or later) from eviction
        until :meth:`unpin` or :meth:`clear`; returns their digests."""
        digests = self.shards[0].digests(tokens, salt)
        room = self.ops.cache.num_pages // 2
        if len(self.pinned | set(digests)) > room:
            raise ValueError(f"pinning {len(digests)} pages would pin "
                             f"{len(self.pinned | set(digests))}, past half the pool ({room}):"
                             " raise num_pages or unpin a prefix first")
        self.pinned.update(digests)
        return digests

    def unpin(self, tokens: Sequence[int], salt: str | bytes | None = None) -> list[bytes]:
        """Lets the pages :meth:`pin` kept be evicted again; returns their digests."""
        digests = self.shards[0].digests(tokens, salt)
        self.pinned.difference_update(digests)
        return digests

    def _protected(self, shard: int, protect: Sequence[int]) -> list[int]:
        """``protect`` plus ``shard``'s pages of pinned prefixes."""
        ix = self.shards[shard]
        return list(protect) + [p for p in map(ix.page_of, self.pinned) if p is not None]

    @property
    def index(self) -> PrefixIndex:
        """A one-shard cache's index (a sharded cache has one per shard: :attr:`shards`)."""
        if len(self.shards) != 1:
            raise AttributeError(f"a cache of {len(self.shards)} shards has one prefix index "
                                 "per shard: read .shards[s]")
        return self.shards[0]

    def lookup(self, req: Request) -> tuple[list[Hit], list[bytes]]:
        """Each shard's longest cached prefix (at most all but the last token) and the digests
        of the request's full pages."""
        limit = len(req.tokens) - 1
        return ([ix.match(req.tokens, req.salt, max_tokens=limit) for ix in self.shards],
                self.shards[0].digests(req.tokens[:limit], req.salt))

    def attach(self, req: Request, hit: Hit) -> None:
        """``req`` (placed in a row of the shard whose index gave ``hit``) starts from the
        hit's pages."""
        self.ops.attach(req.row, hit.pages, hit.num_tokens)
        req.cached = hit.num_tokens

    def record(self, shard: int, looked_up: int, hit: int) -> None:
        """Counts one admitted lookup in ``shard``: ``looked_up`` tokens, ``hit`` cached."""
        self.shards[shard].record(looked_up, hit)

    def index_rows(self, reqs: list[Request]) -> None:
        """Indexes the full pages each request has written in its row's shard (the index
        takes a reference)."""
        reqs = [r for r in reqs if r.row is not None and r.cached >= self.page_size]
        if not reqs:
            return
        tables = page_holds.block_tables(self.ops.cache)  # [max_seqs, max_pages_per_seq]
        new: list[list[int]] = [[] for _ in self.shards]
        for r in reqs:
            full, shard = r.cached // self.page_size, self.ops.shard_of(r.row)
            new[shard] += self.shards[shard].insert(r.tokens[:full * self.page_size],
                                                    tables[r.row, :full], r.salt)
        self.ops.retain_shards(new, 1)

    def evict(self, num: int, protect: Sequence[int] = (), shard: int = 0) -> None:
        """Drops up to ``num`` cached pages of ``shard`` only its index holds (never
        ``protect``, that shard's ids)."""
        if not len(self.shards[shard]):
            return
        ref_counts = page_holds.ref_counts(self.ops.cache)[shard]
        pages = self.shards[shard].evict(num, ref_counts, self._protected(shard, protect))
        if pages:
            self._dropping(pages, self.shards[shard].dropped, shard)
        self.ops.retain(pages, -1, shard)
        self.ops.shard_free[shard] += len(pages)

    def _dropping(self, pages: list[int], dropped: list, shard: int) -> None:
        """Called with ``shard``'s pages eviction drops (``dropped``: their index entries) while the
        index still holds them: a host tier copies them out here."""

    def reclaimable(self, hits: Sequence[Hit]) -> np.ndarray:
        """int64 ``[num_shards]``: the pages :meth:`evict` could free in each shard for a
        request attaching ``hits[s]`` there (:meth:`PrefixIndex.evictable`), evicting
        nothing."""
        if not len(self):
            return np.zeros(len(self.shards), np.int64)
        refs = page_holds.ref_counts(self.ops.cache)
        return np.array([ix.evictable(refs[s], self._protected(s, hits[s].pages))
                         for s, ix in enumerate(self.shards)], np.int64)

    def drop_salt(self, salt: str | bytes | None) -> int:
        """Drops ``salt``'s cached pages in every shard (pages nobody else holds are free at
        once; pins stay); returns how many the indexes held."""
        pages = [ix.drop_salt(salt) for ix in self.shards]
        self.ops.retain_shards(pages, -1)
        self.ops.refresh_free()
        return sum(map(len, pages))

    def clear(self) -> int:
        """Drops every cached page's reference in every shard, pins too; returns how many the
        indexes held."""
        self.pinned.clear()
        pages = [ix.clear() for ix in self.shards]
        self.ops.retain_shards(pages, -1)
        self.ops.refresh_free()
        return sum(map(len, pages))

    # -- counters over every shard (accounting) ---------------------------------------------
    def __len__(self) -> int:
        return sum(len(ix) for ix in self.shards)

    @property
    def lookup_tokens(self) -> int:
        return sum(ix.lookup_tokens for ix in self.shards)

    @property
    def hit_tokens(self) -> int:
        return sum(ix.hit_tokens for ix in self.shards)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    @property
    def inserted(self) -> int:
        return sum(ix.inserted for ix in self.shards)

    @property
    def evicted(self) -> int:
        return sum(ix.evicted for ix in self.shards)


class WindowPrefixes(SharedPrefixes):
    """The prefix cache of a layer-grouped cache (:mod:`paxkv.cache.grouped`, one device): one
    :class:`~paxkv.prefix.window_index.WindowPrefixIndex` holding a page per group of each
    cached block. A window group's row drops its pages as its window moves on, so a prompt is
    indexed after every prefill chunk, catching each chunk's window pages before they slide
    out: a later prompt sharing any prefix of it finds the window layers' keys at its end.

    It keeps no pins (:meth:`pin` refuses): a window group holds at most its budget of cached
    pages, dropping the least recently used past it, so no prompt can be kept whole."""

    each_chunk = True

    def __init__(self, ops: CacheOps, page_size: int):
        cache = ops.cache
        self.ops, self.page_size = ops, page_size
        self.shards = [WindowPrefixIndex(page_size, cache.groups.windows, cache.index_pages)]

    def pin(self, tokens: Sequence[int], salt: str | bytes | None = None) -> list[bytes]:
        raise ValueError(
            "prefix pins (pin_prefix, unpin_prefix) need a model without sliding-window "
            "layers: a window layer's prefix cache keeps at most a budget of cached window "
            "pages (least recently used go first), so a pinned prompt could not be kept whole. "
            "Hold the prompt in a row instead (submit_prefix, then submit(..., prefix=id)), or "
            "leave it to the cache")

    def unpin(self, tokens: Sequence[int], salt: str | bytes | None = None) -> list[bytes]:
        return self.pin(tokens, salt)

    def attach(self, req: Request, hit: GroupHit) -> None:  # type: ignore[override]
        self.ops.attach_groups(req.row, hit.groups, hit.first, hit.num_tokens)
        req.cached = hit.num_tokens

    def index_rows(self, reqs: list[Request]) -> None:
        reqs = [r for r in reqs if r.row is not None and r.cached >= self.page_size]
        if not reqs:
            return
        tables = page_holds.group_block_tables(self.ops.cache)  # [groups, max_seqs, width]
        taken: list[list[int]] = [[] for _ in tables]
        dropped: list[list[int]] = [[] for _ in tables]
        for r in reqs:
            full = r.cached // self.page_size
            took, drop = self.index.insert(r.tokens[:full * self.page_size],
                                           tables[:, r.row, :full], r.salt)
            for g in range(len(tables)):
                taken[g] += took[g]
                dropped[g] += drop[g]
        self.ops.retain_groups(taken, 1)  # before the drops: a page may be taken and dropped
        self.ops.retain_groups(dropped, -1)

    def evict(self, num: int, protect: Sequence[int] = (), shard: int = 0) -> None:
        if not len(self.index):
            return
        refs = page_holds.group_ref_counts(self.ops.cache)
        self.ops.retain_groups(self.index.evict(num, refs, protect), -1)
        self.ops.refresh_free()

    def reclaimable(self, hits: Sequence[Hit]) -> np.ndarray:
        if not len(self.index):
            return np.zeros(1, np.int64)
        refs = page_holds.group_ref_counts(self.ops.cache)
        return np.array([self.index.evictable(refs, hits[0].pages)], np.int64)

    def drop_salt(self, salt: str | bytes | None) -> int:
        pages = self.index.drop_salt(salt)
        self.ops.retain_groups(pages, -1)
        self.ops.refresh_free()
        return len(pages[0])

    def clear(self) -> int:
        pages = self.index.clear()
        self.ops.retain_groups(pages, -1)
        self.ops.refresh_free()
        return len(pages[0])
