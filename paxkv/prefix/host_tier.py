"""The prefix cache's second tier: cached pages the device evicted, kept in host memory.

The device pool holds a fraction of what a workload of many idle histories (agents,
conversations, documents) has prefilled. When the device index (:mod:`paxkv.prefix.index`)
drops a page for room, its K/V (every layer, int8 scales included) is copied here, keyed by
the same chained, salted digest; a later prompt that runs past the device chain finds the next
pages here and gets them back with one copy into fresh device pages instead of a prefill::

    device index:  root(salt) -- d0:p4 -- d1:p9                  (d2, d3 evicted for room)
    host tier:                                 d2:s17 -- d3:s2    (slots of the host pool)
    a prompt with that prefix: d0, d1 attach; d2, d3 copy back into two free pages; the rest
    is prefilled

An entry names its parent's digest and keeps its tokens, compared on every hit: a collision
never serves another prefix, nor a chain another salt's (the salt is in every digest). Only
entries nothing on the host chains below are dropped, least recently used first: every entry
stays reachable from the device chain or a host parent.

Copies out are asynchronous: the evicting step gathers the pages into a buffer of their own on
the device (in program order, so a later write to those pages cannot reach it) and starts
their transfer to host without waiting; a read of a page whose copy is still in flight waits
for that copy. Where pages live, pinned host memory or numpy arrays, is
:mod:`paxkv.prefix.host_pages`.

Retention: least recently used entries go first; :meth:`HostTier.pin` marks a prefix's
digests (the engine's ``pin_prefix``, by its tokens and salt): a pinned entry is never dropped,
and the engine never evicts a pinned page from the device either. ``ttl_s`` drops entries
unused for that long; :meth:`HostTier.clear` forgets everything, pins too. The bookkeeping
here is host Python; the device side is :mod:`paxkv.prefix.host_copies`.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from typing import Any, Callable, Sequence

from paxkv.prefix.chain_hash import salt_bytes
from paxkv.prefix.host_pages import NumpyPages, PinnedPages


@dataclasses.dataclass(eq=False)
class _Entry:
    slot: int
    tokens: tuple[int, ...]
    parent: bytes  # the digest of the page before it (the salt's root for a first page)
    depth: int  # the page's position in its chain (0: a first page)
    salt: bytes  # its chain's tenant (:meth:`HostTier.drop_salt`)
    last_used: int
    touched: float  # clock seconds at the last use (for ``ttl_s``)


@dataclasses.dataclass(frozen=True)
class HostStats:
    """The host tier of an engine's prefix cache (:attr:`paxkv.engine.EngineStats.host`).

    Attributes:
      pages, bytes: entries held now and their K/V bytes (all layers, scales included);
      capacity_pages, capacity_bytes: the budget's (``Engine(host_cache_bytes=)``).
      pinned_pages: entries held now that a :meth:`HostTier.pin` keeps.
      hit_tokens: prompt tokens served from host pages (copied back instead of prefilled).
      copy_out_pages, copy_in_pages: pages copied device -> host / host -> device.
      copy_out_s, copy_in_s: host seconds spent starting copies out / copying back.
      dropped: entries dropped for room or by ``ttl_s``.
      in_flight: pages copied out whose copy has not landed yet (counted in pages on either
        ``memory_kind``, however many pool arrays or transfers carry them).
      memory_kind: where pages live: "pinned_host" or "numpy" (:mod:`paxkv.prefix.host_pages`).
    """

    pages: int
    bytes: int
    capacity_pages: int
    capacity_bytes: int
    pinned_pages: int
    hit_tokens: int
    copy_out_pages: int
    copy_in_pages: int
    copy_out_s: float
    copy_in_s: float
    dropped: int
    in_flight: int
    memory_kind: str = "numpy"


class HostTier:
    """A host-memory pool of evicted prefix pages within ``capacity_pages`` pages.

    Args:
      capacity_pages: pages the budget holds (``host_cache_bytes // page_bytes``).
      page_bytes: K/V bytes of one page, every layer (the pool's ``kv_bytes_per_page``).
      ttl_s: drop entries unused for this many seconds (None: never).
      clock: seconds, monotonic (tests pass their own).
      memory_kind: "pinned_host" (the backend's pinned memory, one device) or "numpy"
        (:mod:`paxkv.prefix.host_pages`).
    """

    def __init__(self, capacity_pages: int, page_bytes: int, *, ttl_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic, memory_kind: str = "numpy"):
        if capacity_pages < 1:
            raise ValueError(f"a host tier needs room for one page or more, got "
                             f"{capacity_pages} (raise host_cache_bytes past {page_bytes})")
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"host_ttl_s must be > 0 seconds or None, got {ttl_s!r}")
        self.capacity, self.page_bytes, self.ttl_s, self.clock = (capacity_pages, page_bytes,
                                                                   ttl_s, clock)
        kinds = dict(pinned_host=PinnedPages, numpy=NumpyPages)
        if memory_kind not in kinds:
            raise ValueError(f"memory_kind must be one of {sorted(kinds)}, got {memory_kind!r}")
        self.store = kinds[memory_kind](capacity_pages)
        self._entries: dict[bytes, _Entry] = {}
        self._kids: dict[bytes, int] = {}  # digest -> host entries naming it as their parent
        self._free = list(range(capacity_pages - 1, -1, -1))  # pop() gives slot 0 first
        self._heap: list[tuple[int, int, bytes]] = []  # (last_used, -depth, digest), lazy
        self.pinned: set[bytes] = set()
        self._tick = 0
        self.reset_counts()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._entries

    # -- lookups --------------------------------------------------------------------------
    def match(self, digests: Sequence[bytes], tokens: Sequence[int], page_size: int,
              start: int, parent: bytes) -> list[bytes]:
        """The digests of ``digests[start:]`` held here as one chain continuing from
        ``parent`` (the digest of page ``start - 1``, or the salt's root), each entry's tokens
        equal to the prompt's; touches them (LRU)."""
        self.expire()
        self._tick += 1
        out: list[bytes] = []
        for i in range(start, len(digests)):
            entry = self._entries.get(digests[i])
            chunk = tuple(tokens[i * page_size:(i + 1) * page_size])
            if entry is None or entry.parent != parent or entry.tokens != chunk:
                break
            self._touch(digests[i], entry)
            out.append(digests[i])
            parent = digests[i]
        return out

    def read(self, digests: Sequence[bytes], width: int | None = None) -> tuple[Any, ...]:
        """The pages of ``digests`` (held), ``[layers, width, ...]`` per pool array (the last
        columns repeat the first page): what :func:`paxkv.prefix.host_copies.restore_pages`
        writes back. Waits for a copy out still in flight for any of them."""
        slots = [self._entries[d].slot for d in digests]
        return self.store.read(slots, width or len(slots))

    # -- changes --------------------------------------------------------------------------
    def put(self, pages: Sequence[tuple[bytes, bytes, tuple[int, ...], int, bytes]],
            arrays: tuple[Any, ...]) -> list[int]:
        """Takes evicted device pages: ``pages[j] = (digest, parent digest, tokens, depth,
        salt)`` (:attr:`paxkv.prefix.index.PrefixIndex.dropped`) whose K/V is column ``j`` of
        ``arrays`` (``[layers, n >= len(pages), ...]`` per pool array, device arrays still
        being computed or copied). Entries already held are touched, not copied again; the
        rest get slots, dropping least recently used unpinned leaves for room. Returns the
        columns of ``arrays`` taken (an empty list: nothing to copy)."""
        start = time.perf_counter()
        self.expire()
        self._tick += 1
        columns, slots = [], []
        for j, (digest, parent, tokens, depth, salt) in enumerate(pages):
            entry = self._entries.get(digest)
            if entry is not None:
                self._touch(digest, entry)
                continue
            if not self._free and not self._drop_one(keep=parent):
                break  # everything held is pinned or an ancestor of this page
            slot = self._free.pop()
            entry = _Entry(slot, tuple(tokens), parent, depth, salt, self._tick, self.clock())
            self._entries[digest] = entry
            self._kids[parent] = self._kids.get(parent, 0) + 1
            self._push(entry.last_used, -depth, digest)
            columns.append(j)
            slots.append(slot)
        if columns:
            self.store.put(slots, arrays, columns)
            self.copy_out_pages += len(slots)
        self.copy_out_s += time.perf_counter() - start
        return columns

    def settle(self, block: bool = False) -> int:
        """Lands finished copies out (every one with ``block``); returns how many pages are
        still in flight."""
        return self.store.settle(block)

    def pin(self, digests: Sequence[bytes]) -> None:
        """Never drops these digests' entries until :meth:`unpin` or :meth:`clear`; raises
        (pinning nothing) where :meth:`check_pin` does."""
        self.check_pin(digests)
        self.pinned.update(digests)

    def check_pin(self, digests: Sequence[bytes]) -> None:
        """Raises ValueError if pinning ``digests`` would pin more than the budget holds;
        changes nothing."""
        if len(self.pinned | set(digests)) > self.capacity:
            raise ValueError(f"pinning {len(digests)} more pages would pin "
                             f"{len(self.pinned | set(digests))}, past the host tier's "
                             f"{self.capacity}: raise host_cache_bytes or unpin some first")

    def unpin(self, digests: Sequence[bytes]) -> None:
        for d in digests:
            self.pinned.discard(d)
            entry = self._entries.get(d)
            if entry is not None:  # droppable again
                self._push(entry.last_used, -entry.depth, d)

    def expire(self) -> None:
        """Drops entries unused for ``ttl_s`` seconds (leaves first, so a chain ages away
        from its tail)."""
        if self.ttl_s is None or not self._entries:
            return
        cutoff = self.clock() - self.ttl_s
        old = sorted((e.depth, d) for d, e in self._entries.items()
                     if e.touched < cutoff and d not in self.pinned)
        for _, digest in reversed(old):  # deepest first: children before their parent
            if not self._kids.get(digest):
                self._remove(digest)

    def drop_salt(self, salt: str | bytes | None) -> int:
        """Forgets ``salt``'s every entry (pinned too; the pins stay, as digests), deepest
        first; returns how many went. Other salts' entries stay as they were."""
        salt = salt_bytes(salt)
        mine = sorted((e.depth, d) for d, e in self._entries.items() if e.salt == salt)
        for _, digest in reversed(mine):  # children before their parent
            self._remove(digest)
        self.dropped -= len(mine)  # not dropped for room nor by age
        return len(mine)

    def clear(self) -> int:
        """Forgets every entry and pin (copies in flight land first); returns how many
        entries it held."""
        self.store.clear()
        held = len(self._entries)
        for part in (self._entries, self._kids, self._heap, self.pinned):
            part.clear()
        self._free = list(range(self.capacity - 1, -1, -1))
        return held

    def stats(self) -> HostStats:
        pinned = sum(d in self._entries for d in self.pinned)
        return HostStats(pages=len(self), bytes=len(self) * self.page_bytes,
                         capacity_pages=self.capacity,
                         capacity_bytes=self.capacity * self.page_bytes, pinned_pages=pinned,
                         hit_tokens=self.hit_tokens, copy_out_pages=self.copy_out_pages,
                         copy_in_pages=self.copy_in_pages, copy_out_s=self.copy_out_s,
                         copy_in_s=self.copy_in_s, dropped=self.dropped,
                         in_flight=self.settle(), memory_kind=self.store.memory_kind)

    def reset_counts(self) -> None:
        self.hit_tokens = self.copy_out_pages = self.copy_in_pages = self.dropped = 0
        self.copy_out_s = self.copy_in_s = 0.0  # the entries stay

    # -- internals ------------------------------------------------------------------------
    def _touch(self, digest: bytes, entry: _Entry) -> None:
        entry.last_used, entry.touched = self._tick, self.clock()
        self._push(entry.last_used, -entry.depth, digest)

    def _push(self, last_used: int, depth: int, digest: bytes) -> None:
        """Queues an entry for :meth:`_drop_one`. Stale items stay until popped, so past four
        per entry the queue is rebuilt from the entries (a long run's lookups stay bounded)."""
        heapq.heappush(self._heap, (last_used, depth, digest))
        if len(self._heap) > 4 * len(self._entries) + 64:
            self._heap = [(e.last_used, -e.depth, d) for d, e in self._entries.items()]
            heapq.heapify(self._heap)

    def _drop_one(self, keep: bytes) -> bool:
        """Drops the least recently used unpinned leaf (never ``keep``, the parent of the
        page being placed); False when none can go."""
        skipped = []
        while self._heap:
            used, depth, digest = heapq.heappop(self._heap)
            entry = self._entries.get(digest)
            if entry is None or entry.last_used != used or digest in self.pinned:
                continue  # stale, gone, or pinned (re-pushed when unpinned)
            if self._kids.get(digest) or digest == keep:
                skipped.append((used, depth, digest))  # a leaf again later
                continue
            self._remove(digest)
            for item in skipped:
                heapq.heappush(self._heap, item)
            return True
        for item in skipped:
            heapq.heappush(self._heap, item)
        return False

    def _remove(self, digest: bytes) -> None:
        entry = self._entries.pop(digest)
        self._kids[entry.parent] -= 1
        if not self._kids[entry.parent]:
            del self._kids[entry.parent]
            parent = self._entries.get(entry.parent)
            if parent is not None:  # a leaf now: droppable
                self._push(parent.last_used, -parent.depth, entry.parent)
        self.store.drop(entry.slot)
        self._free.append(entry.slot)
        self.dropped += 1
