"""The prefix cache with a host tier under it: :class:`TieredPrefixes`, the engine's
:class:`~paxkv.engine.prefix_sharing.SharedPrefixes` whose evictions copy pages out to host
memory (:mod:`paxkv.prefix.host_tier`) and whose lookups copy them back
(:mod:`paxkv.prefix.host_copies`) instead of leaving a returning prefix to a prefill::

    lookup(prompt):  device chain d0 d1 | host d2 d3 | rest
                     attach d0 d1, restore d2 d3 into free pages (one batched copy), prefill rest
    evict(n):        the index drops n tails; their K/V is gathered and sent to host first

On a data mesh each shard keeps its own host tier (page ids are a shard's own), and a prompt
copies back into the shard whose two tiers serve the most of it. One process holds every
shard's tier: a mesh over several processes is refused (:func:`paxkv.engine.setup.prefix_cache`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import numpy as np

from paxkv.core import buckets
from paxkv.engine.cache_ops import CacheOps
from paxkv.engine.prefix_sharing import SharedPrefixes
from paxkv.engine.requests import Request
from paxkv.prefix import host_copies
from paxkv.prefix.host_tier import HostStats, HostTier
from paxkv.prefix.index import Hit, root_digest, salt_bytes


class TieredPrefixes(SharedPrefixes):
    """:class:`SharedPrefixes` with a host tier under each shard's index
    (:mod:`paxkv.prefix.host_tier`; ``hosts[s]`` shard ``s``'s): pages evicted for room are
    copied to host memory, and a lookup that runs past a shard's device chain into its host
    pages copies them back into that shard's free pages (evicting others for room) and indexes
    them, instead of leaving them to a prefill. Of several shards, the one whose two tiers
    serve the longest prefix copies back."""

    def __init__(self, ops: CacheOps, page_size: int, hosts: list[HostTier]):
        super().__init__(ops, page_size)
        self.hosts = hosts

    @property
    def host(self) -> HostTier:
        """A one-shard cache's host tier (a sharded cache has one per shard: :attr:`hosts`)."""
        if len(self.hosts) != 1:
            raise AttributeError(f"a cache of {len(self.hosts)} shards has one host tier per "
                                 "shard: read .hosts[s]")
        return self.hosts[0]

    def host_stats(self) -> HostStats:
        """Every shard's host tier, summed."""
        each = [dataclasses.asdict(h.stats()) for h in self.hosts]
        return HostStats(**{k: (sum(e[k] for e in each) if k != "memory_kind" else v)
                            for k, v in each[0].items()})

    def pin(self, tokens: Sequence[int], salt: str | bytes | None = None) -> list[bytes]:
        """:meth:`SharedPrefixes.pin` in both tiers, all or nothing: a pin past any host
        tier's budget raises before a device pin is set."""
        for host in self.hosts:
            host.check_pin(self.shards[0].digests(tokens, salt))
        digests = super().pin(tokens, salt)  # raises (past half the pool) before a host pin
        for host in self.hosts:
            host.pin(digests)  # never dropped from the host either
        return digests

    def unpin(self, tokens: Sequence[int], salt: str | bytes | None = None) -> list[bytes]:
        digests = super().unpin(tokens, salt)
        for host in self.hosts:
            host.unpin(digests)
        return digests

    def lookup(self, req: Request) -> tuple[list[Hit], list[bytes]]:
        hits, digests = super().lookup(req)
        root = root_digest(salt_bytes(req.salt))
        best, best_len, best_found = -1, max(h.num_tokens for h in hits), []
        for s, (host, hit) in enumerate(zip(self.hosts, hits)):
            host.settle()  # copies out that landed since
            parent = digests[hit.num_full - 1] if hit.num_full else root
            found = host.match(digests, req.tokens, self.page_size, hit.num_full, parent)
            if found and (hit.num_full + len(found)) * self.page_size > best_len:
                best, best_len, best_found = s, (hit.num_full + len(found)) * self.page_size, found
        if best >= 0 and self._copy_in(req, hits[best], best_found, best):
            hits[best] = self.shards[best].match(req.tokens, req.salt,
                                                 max_tokens=len(req.tokens) - 1)
        return hits, digests

    def _copy_in(self, req: Request, hit: Hit, found: list[bytes], shard: int) -> int:
        """Copies the host pages ``found`` (continuing ``hit``'s full chain in ``shard``) into
        free pages there and indexes them; returns how many came back (fewer when the shard
        has no room)."""
        start, ps, host, ops = time.perf_counter(), self.page_size, self.hosts[shard], self.ops
        data = host.read(found, buckets.pow2(len(found), 8))  # first: eviction may drop them
        if len(found) > ops.shard_free[shard]:
            self.evict(len(found) - int(ops.shard_free[shard]), protect=hit.pages, shard=shard)
        count = min(len(found), int(ops.shard_free[shard]))
        if count:
            if ops.num_shards == 1:
                ops.cache, ids = host_copies.restore_pages(ops.cache, data, np.int32(count))
            else:
                ops.cache, ids = host_copies.restore_shard_pages(ops.cache, data,
                                                                 np.int32(count), np.int32(shard))
            ids = [int(i) for i in np.asarray(ids)[:count]]
            ops.shard_free[shard] -= count
            full = hit.num_full + count
            new = self.shards[shard].insert(req.tokens[:full * ps],
                                            list(hit.pages[:hit.num_full]) + ids, req.salt)
            ops.retain([p for p in ids if p not in new], -1, shard)  # a collision cut the chain
            ops.shard_free[shard] += count - len(new)  # the index took restore's references
            host.copy_in_pages += count
            host.hit_tokens += len(new) * ps
        host.copy_in_s += time.perf_counter() - start
        return count

    def _dropping(self, pages: list[int], dropped: list, shard: int) -> None:
        cache = self.ops.cache
        if self.ops.num_shards == 1:
            pool, ids = cache.pool, host_copies.padded(pages, cache.num_pages)
        else:  # shard s's page p lies at s * (pages_per_shard + 1) + p of the pool's page axis
            base = shard * (cache.pages_per_shard + 1)
            pool, ids = cache.pools, base + host_copies.padded(pages, cache.pages_per_shard)
        arrays = host_copies.gather_pages(pool, ids)
        self.hosts[shard].put(dropped, arrays)  # starts the copies; nothing here waits

    def drop_salt(self, salt: str | bytes | None) -> int:
        for host in self.hosts:
            host.drop_salt(salt)
        return super().drop_salt(salt)

    def clear(self) -> int:
        for host in self.hosts:
            host.clear()
        return super().clear()
