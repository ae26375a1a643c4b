"""What the engine counts, and the records it reports (:meth:`paxkv.Engine.stats`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from paxkv.cache.grouped import GroupedPagedCache
from paxkv.core.compiles import CompileStats
from paxkv.prefix.host_tier import HostStats
from paxkv.prefix.index import Hit
from paxkv.scale.distributed import gather

# One jitted read of a page-sharing cache's accounting (any KVCache with ``stats`` and
# ``sharing_stats``: the paged cache, the sharded one).
_page_numbers = jax.jit(lambda cache: (cache.stats(), cache.sharing_stats()))


@dataclasses.dataclass
class Counters:
    """Running totals of an engine (host side)."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    peak_running: int = 0

    def reset(self) -> None:
        """Zeroes every total."""
        for field in dataclasses.fields(self):
            setattr(self, field.name, field.default)


@dataclasses.dataclass(frozen=True)
class SequenceStats:
    """One running (or held) sequence: ``tokens`` in its row, ``pages`` its row references,
    ``shared_pages`` of those with another holder (a row or the prefix index)."""

    tokens: int
    pages: int
    shared_pages: int


@dataclasses.dataclass(frozen=True)
class GroupStats:
    """One layer group's pages (:mod:`paxkv.cache.grouped`; a cache without groups is one
    group of every layer): its sliding ``window`` (None: global), its ``layers``, and its
    ``num_pages`` / ``used_pages`` / ``free_pages`` (pages per layer of the group)."""

    window: int | None
    layers: int | None
    num_pages: int
    used_pages: int
    free_pages: int


def kv_bytes_used(cache: Any, used_pages: int) -> int:
    """K/V bytes the cache holds now for rows and the prefix index, every layer and group,
    scales included: ``used_pages`` (group 0's; a dense cache's rows) times a page's bytes, or
    on a layer-grouped cache every group's pages (one device read)."""
    if isinstance(cache, GroupedPagedCache):
        return int(cache.layer_pages_used()) * cache.layer_page_bytes
    return used_pages * cache.kv_bytes_per_page


def group_stats(cache: Any, used_pages: int) -> tuple[GroupStats, ...]:
    """Every layer group's :class:`GroupStats`, group 0 (the global layers) first; a cache
    without groups is one group (``layers`` None when the cache does not say)."""
    if not isinstance(cache, GroupedPagedCache):
        pool = getattr(cache, "pool", None) or getattr(cache, "pools", None) or cache
        layers = getattr(getattr(pool, "k", None), "shape", (None,))[0]
        return (GroupStats(None, layers, cache.total_pages, used_pages,
                           cache.total_pages - used_pages),)
    stats = gather(_group_numbers(cache))
    return tuple(GroupStats(w, len(m), n, int(s.used_pages), int(s.free_pages))
                 for w, m, n, s in zip(cache.groups.windows, cache.groups.members,
                                       cache.groups.num_pages, stats))


_group_numbers = jax.jit(lambda cache: cache.group_stats())


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """Pool-wide accounting of an :class:`paxkv.engine.Engine` (a dense cache counts a row
    as a page).

    Attributes:
      num_pages, free_pages, used_pages: the pool (used includes the prefix index's pages).
      reclaimable_pages: used pages that only the prefix index holds (prompts of finished
        requests, kept for later hits), evicted on demand when a request needs room: not a
        leak. ``available_pages`` = free + reclaimable, what new requests can get now; once
        every request has ended it is ``num_pages``.
      shared_pages: pages with more than one holder.
      cached_pages: pages the prefix index holds.
      row_references: pages the rows would use if nothing were shared.
      row_pages: distinct pages the rows reference.
      prefix_lookup_tokens, prefix_hit_tokens, prefix_hit_rate: prompt tokens looked up in /
        served by the prefix cache (first admissions).
      cow_copies: copy-on-write page copies so far.
      prefill_tokens, decode_tokens: tokens computed by prefill / decode steps so far.
      peak_pages_used: the most pages in use after any step.
      peak_running: the most requests decoding in one step.
      preemptions, evictions: requests preempted, cached pages evicted.
      kv_bytes_per_page: K + V bytes of one page over all layers.
      kv_bytes_per_device: K/V bytes each device holds (the whole cache on one device; a
        sharded cache's ``1 / (data x model)``).
      kv_bytes_used, peak_kv_bytes_used: K/V bytes held now by rows and the prefix cache,
        every layer group, scales included; the most after any step.
      groups: each layer group's pages (:class:`GroupStats`; one group unless the model has
        sliding-window layers and the cache releases their pages). The page fields above
        are group 0's, the group admission counts.
      sequences: per request id, the rows' :class:`SequenceStats`.
      compiles: what the engine's calls paid for compiles (:mod:`paxkv.core.compiles`).
      host: the prefix cache's host tier (:class:`paxkv.prefix.host_tier.HostStats`: pages
        and bytes held, hit tokens, pages and seconds copied each way), None without one.
    """

    num_pages: int
    free_pages: int
    reclaimable_pages: int
    used_pages: int
    shared_pages: int
    cached_pages: int
    row_references: int
    row_pages: int
    prefix_lookup_tokens: int
    prefix_hit_tokens: int
    prefix_hit_rate: float
    cow_copies: int
    prefill_tokens: int
    decode_tokens: int
    peak_pages_used: int
    peak_running: int
    preemptions: int
    evictions: int
    kv_bytes_per_page: int
    kv_bytes_per_device: int
    kv_bytes_used: int
    peak_kv_bytes_used: int
    groups: tuple[GroupStats, ...]
    sequences: dict[int, SequenceStats]
    compiles: CompileStats = dataclasses.field(default_factory=CompileStats)
    host: HostStats | None = None

    @property
    def available_pages(self) -> int:
        """Pages a new request can get now: free ones plus those eviction would reclaim."""
        return self.free_pages + self.reclaimable_pages


def engine_stats(ops: Any, table: Any, counters: Counters, index: Any,
                 compiles: CompileStats | None = None) -> EngineStats:
    """The :class:`EngineStats` of an engine's parts now: ``ops`` (its
    :class:`~paxkv.engine.cache_ops.CacheOps`), ``table`` (its request table), ``index`` (its
    :class:`~paxkv.prefix.index.PrefixIndex` or None)."""
    cache = ops.cache
    rows = {r.id: r for r in table.rows if r is not None}
    if cache.shares_pages:
        ts, sh = gather(_page_numbers(cache))
        used, shared = int(ts.used_pages), int(ts.shared_pages)
        refs, distinct = int(sh.row_references), int(sh.row_pages)
        seqs = {i: SequenceStats(r.cached, int(sh.pages_held[r.row]), int(sh.shared_held[r.row]))
                for i, r in rows.items()}
    else:
        shared, used = 0, len(rows)
        refs = distinct = used
        seqs = {i: SequenceStats(r.cached, 1, 0) for i, r in rows.items()}
    counts = (dict(cached_pages=len(index), prefix_lookup_tokens=index.lookup_tokens,
                   prefix_hit_tokens=index.hit_tokens, prefix_hit_rate=index.hit_rate,
                   evictions=index.evicted) if index is not None else
              dict(cached_pages=0, prefix_lookup_tokens=0, prefix_hit_tokens=0,
                   prefix_hit_rate=0.0, evictions=0))
    num_pages = cache.total_pages
    return EngineStats(
        num_pages=num_pages, free_pages=num_pages - used,
        reclaimable_pages=reclaimable(index), used_pages=used,
        shared_pages=shared, row_references=refs, row_pages=distinct,
        cow_copies=ops.cow_copies, prefill_tokens=counters.prefill_tokens,
        decode_tokens=counters.decode_tokens, peak_pages_used=ops.peak_used,
        peak_running=counters.peak_running, preemptions=counters.preemptions, **counts,
        kv_bytes_per_page=cache.kv_bytes_per_page,
        kv_bytes_per_device=cache.kv_bytes_per_device,
        kv_bytes_used=kv_bytes_used(cache, used),
        peak_kv_bytes_used=max(ops.peak_kv_bytes, kv_bytes_used(cache, used)),
        groups=group_stats(cache, used), sequences=seqs,
        compiles=dataclasses.replace(compiles or CompileStats()),
        host=index.host_stats() if hasattr(index, "hosts") else None)


def reclaimable(index: Any) -> int:
    """Pages ``index`` (a :class:`~paxkv.engine.prefix_sharing.SharedPrefixes` or None) could
    evict now in every shard of its cache: those only it holds, chains' tails included
    (:meth:`~paxkv.prefix.index.PrefixIndex.evictable`)."""
    if index is None or not len(index):
        return 0
    return int(index.reclaimable([Hit()] * len(index.shards)).sum())


def reset_totals(counters: Counters, ops: Any, prefixes: Any) -> None:
    """The engine's counters, peaks and host-tier totals from now (compiles kept)."""
    counters.reset()
    ops.reset_counts()
    for host in getattr(prefixes, "hosts", ()):
        host.reset_counts()
