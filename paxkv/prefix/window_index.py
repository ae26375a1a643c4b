"""The prefix cache of a layer-grouped cache (:mod:`paxkv.cache.grouped`): one chain of page
hashes, and for each cached block one page per layer group, where that group still held it.

A window group's row keeps only its window's pages, so what the index can hold of a cached
prompt in a window group is what the row held when it was indexed (the engine indexes a
prompt after every prefill chunk, so each chunk's window is caught before it slides out). A
hit of ``L`` tokens needs, in each group::

    global group:        every block        0 .. ceil(L / ps) - 1
    window-w group:      the blocks         (L - w + 1) // ps .. ceil(L / ps) - 1

so a lookup walks the chain as :class:`paxkv.prefix.index.PrefixIndex` does (the longest run of
matching full pages, then a partial page) and then searches right to left for the longest
``L`` every group can serve (vLLM searches its window groups the same way)::

    block            0  1  2  3  4  5  6        page 4, window 8, tokens matched: 28
    global           x  x  x  x  x  x  x
    window 8         .  .  .  x  x  .  x        L = 28: blocks 5..6: block 5 gone
                                                L = 24: blocks 4..5: block 5 gone
                                                L = 20: blocks 3..4: held -> a hit of 20

Every page named here holds one reference in its group (the caller retains and releases
the pages each change returns, per group). The global group's pages are evicted chain tails
first, as the plain index does, when admission needs room; a window group's pages are
dropped least recently used first whenever that group holds more than ``budget`` of them
(:func:`paxkv.cache.layer_groups.prefix_index_pages`: the cache sized every window group
``budget`` pages past what its rows need, so a row never waits for a page the index keeps).
A model whose every layer slides has no global group: its group 0 is then a window group,
evicted page by page on admission's demand. Plain Python on the host; nothing is traced.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from paxkv.core.buckets import cdiv
from paxkv.prefix.index import Hit, PrefixIndex

Pages = list[list[int]]  # per group, page ids


@dataclasses.dataclass(frozen=True)
class GroupHit(Hit):
    """A :class:`~paxkv.prefix.index.Hit` in every group.

    Attributes:
      groups: per group, the pages of blocks ``0 .. ceil(num_tokens / ps) - 1`` (``-1`` before
        ``first[g]``: keys no query of the row will see); ``pages`` is group 0's.
      first: per group, the first block the row holds.
    """

    groups: tuple[tuple[int, ...], ...] = ()
    first: tuple[int, ...] = ()


class WindowPrefixIndex:
    """The prefix index of a layer-grouped cache (see the module docstring).

    Args:
      page_size: tokens per page.
      windows: each group's window (None: global), group 0 first.
      budget: most pages the index holds in each window group past group 0.

    ``len``, ``pages``, ``inserted`` and ``evicted`` count group 0's pages (the pages
    admission counts); :meth:`group_pages` lists any group's.
    """

    def __init__(self, page_size: int, windows: Sequence[int | None], budget: int):
        self.chain = PrefixIndex(page_size)  # its "pages" are this index's node ids
        self.page_size, self.windows, self.budget = page_size, tuple(windows), budget
        self._held: dict[int, list[int]] = {}  # node -> page per group (-1: none)
        self._owner: list[dict[int, int]] = [{} for _ in self.windows]  # group: page -> node
        self._used: dict[int, tuple[int, int]] = {}  # node -> (last use, block index)
        self._next = self._clock = 0
        self.inserted = self.evicted = 0

    # -- counters, as PrefixIndex's ---------------------------------------------------------
    def __len__(self) -> int:
        return len(self._owner[0])

    def __contains__(self, page: int) -> bool:
        return page in self._owner[0]

    def pages(self) -> list[int]:
        return sorted(self._owner[0])

    def group_pages(self, group: int) -> list[int]:
        return sorted(self._owner[group])

    def digests(self, tokens: Sequence[int], salt: str | bytes | None = None) -> list[bytes]:
        return self.chain.digests(tokens, salt)

    def record(self, looked_up: int, hit: int) -> None:
        self.chain.record(looked_up, hit)

    lookup_tokens = property(lambda self: self.chain.lookup_tokens)
    hit_tokens = property(lambda self: self.chain.hit_tokens)
    hit_rate = property(lambda self: self.chain.hit_rate)

    # -- lookups ----------------------------------------------------------------------------
    def first_block(self, group: int, num_tokens: int) -> int:
        """The first block a row of ``num_tokens`` tokens holds in ``group``."""
        w = self.windows[group]
        return 0 if w is None else max(num_tokens - w + 1, 0) // self.page_size

    def match(self, tokens: Sequence[int], salt: str | bytes | None = None, *,
              max_tokens: int | None = None) -> GroupHit:
        """The longest cached prefix of ``tokens[:max_tokens]`` that every group can serve
        (the right-to-left search of the module docstring); touches what it returns."""
        walk = self.chain.match(tokens, salt, max_tokens=max_tokens)
        nodes, ps = walk.pages, self.page_size
        if not nodes:
            return GroupHit()
        held = np.array([self._held[n] for n in nodes]).T >= 0  # [groups, blocks]
        gone = np.concatenate([np.zeros((len(self.windows), 1), np.int64),
                               np.cumsum(~held, axis=1)], axis=1)  # missing among blocks < b
        ends = [walk.num_tokens] + [b * ps for b in range(walk.num_full, 0, -1)
                                    if b * ps < walk.num_tokens]
        for length in ends:
            blocks = cdiv(length, ps)
            first = [self.first_block(g, length) for g in range(len(self.windows))]
            if all(gone[g, blocks] == gone[g, f] for g, f in enumerate(first)):
                self._touch(nodes[:blocks])
                groups = tuple(tuple(self._held[n][g] if b >= first[g] else -1
                                     for b, n in enumerate(nodes[:blocks]))
                               for g in range(len(self.windows)))
                return GroupHit(groups[0], length, min(walk.num_full, length // ps), groups,
                                tuple(first))
        return GroupHit()

    # -- changes ----------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], pages: Sequence[Sequence[int]],
               salt: str | bytes | None = None) -> tuple[Pages, Pages]:
        """Indexes a row's full pages: ``pages[g][i]`` holds block ``i`` in group ``g`` (-1:
        the row no longer holds it). A block already cached keeps its pages and takes the
        row's where it had none. Returns ``(taken, dropped)`` per group: retain each taken
        page once, release each dropped one (window pages past the budget) once."""
        ps = self.page_size
        full = min(len(tokens) // ps, min(len(p) for p in pages))
        tokens = [int(t) for t in tokens[:full * ps]]
        known = list(self.chain.match(tokens, salt, partial=False).pages)
        fresh = list(range(self._next, self._next + full - len(known)))
        self._next += len(fresh)
        added = set(self.chain.insert(tokens, known + fresh, salt))
        taken: Pages = [[] for _ in self.windows]
        for i, node in enumerate(known + fresh):
            if i >= len(known) and node not in added:
                break  # the chain stopped (a digest collision): nothing past it is cached
            held = self._held.setdefault(node, [-1] * len(self.windows))
            for g, owner in enumerate(self._owner):
                page = int(pages[g][i])
                if held[g] < 0 and page >= 0 and page not in owner:
                    held[g], owner[page] = page, node
                    taken[g].append(page)
            self._used[node] = (self._clock + 1, i)
        self._clock += 1
        self.inserted += len(taken[0])
        dropped: Pages = [[] for _ in self.windows]
        for g, w in enumerate(self.windows):
            if g and w is not None:
                extra = len(self._owner[g]) - self.budget
                dropped[g] = self._drop_window_pages(g, extra, lambda page: True)
        for node in added:
            if node in self._held and all(p < 0 for p in self._held[node]):
                self._prune(node)  # (a pruned block's parent may be pruned with it)
        return taken, dropped

    def evict(self, num: int, ref_counts: Sequence[np.ndarray],
              protect: Sequence[int] = ()) -> Pages:
        """Drops up to ``num`` group-0 pages only the index holds (``ref_counts[0][p] == 1``),
        never one in ``protect`` (group-0 ids): chain tails first with every group's page of
        the block when group 0 is global, else least recently used pages. Returns the pages
        dropped per group (release each once)."""
        refs, protect = np.asarray(ref_counts[0]), {int(p) for p in protect}
        dropped: Pages = [[] for _ in self.windows]
        if self.windows[0] is not None:
            dropped[0] = self._drop_window_pages(
                0, num, lambda page: int(refs[page]) == 1 and page not in protect)
            self.evicted += len(dropped[0])
            return dropped
        for node in self.chain.evict(num, self._node_refs(refs), self._nodes(protect)):
            for g, page in enumerate(self._forget(node)):
                if page >= 0:
                    dropped[g].append(page)
        self.evicted += len(dropped[0])
        return dropped

    def evictable(self, ref_counts: Sequence[np.ndarray], protect: Sequence[int] = ()) -> int:
        """How many group-0 pages :meth:`evict` could free now (as
        :meth:`paxkv.prefix.index.PrefixIndex.evictable`)."""
        refs, protect = np.asarray(ref_counts[0]), {int(p) for p in protect}
        if self.windows[0] is not None:
            return sum(int(refs[p]) == 1 and p not in protect for p in self._owner[0])
        return self.chain.evictable(self._node_refs(refs), self._nodes(protect))

    def drop_salt(self, salt: str | bytes | None) -> Pages:
        """Forgets every block of ``salt``'s (not counted as evicted); returns their pages per
        group (release each once). Other salts' blocks stay as they were."""
        dropped: Pages = [[] for _ in self.windows]
        for node in self.chain.drop_salt(salt):
            for g, page in enumerate(self._forget(node)):
                if page >= 0:
                    dropped[g].append(page)
        return dropped

    def clear(self) -> Pages:
        """Forgets everything; returns every page held, per group (release each once)."""
        pages = [self.group_pages(g) for g in range(len(self.windows))]
        self.chain.clear()
        self._held.clear()
        self._used.clear()
        for owner in self._owner:
            owner.clear()
        return pages

    # -- inside -----------------------------------------------------------------------------
    def _touch(self, nodes: Sequence[int]) -> None:
        self._clock += 1
        for node in nodes:
            self._used[node] = (self._clock, self._used[node][1])

    def _node_refs(self, refs: np.ndarray) -> dict[int, int]:
        """Per live node id: 1 when its group-0 page has no holder but the index (what the
        chain's eviction reads as "only the index"), else 2. A mapping over the live nodes:
        ids are never reused, so an array over every id ever made would grow with the
        engine's lifetime."""
        return {node: 1 if held[0] >= 0 and int(refs[held[0]]) == 1 else 2
                for node, held in self._held.items()}

    def _nodes(self, pages: set[int]) -> list[int]:
        return [self._owner[0][p] for p in pages if p in self._owner[0]]

    def _forget(self, node: int) -> list[int]:
        """Drops a node the chain already removed; returns its pages per group."""
        held = self._held.pop(node)
        self._used.pop(node)
        for g, page in enumerate(held):
            if page >= 0:
                del self._owner[g][page]
        return held

    def _drop_window_pages(self, group: int, num: int, may: Callable[[int], bool]) -> list[int]:
        """Drops up to ``num`` of ``group``'s pages that ``may(page)`` allows, least recently
        used first (then the earliest block), pruning blocks left with no page."""
        if num <= 0:
            return []
        order = sorted((self._used[n], p) for p, n in self._owner[group].items() if may(p))
        out = [p for _, p in order[:num]]
        for page in out:
            node = self._owner[group].pop(page)
            self._held[node][group] = -1
            if all(p < 0 for p in self._held[node]):
                self._prune(node)
        return out

    def _prune(self, node: int) -> None:
        """Forgets blocks that hold no page and have nothing chained below, up the chain."""
        while node >= 0 and all(p < 0 for p in self._held[node]):
            parent = self.chain.drop_leaf(node)
            if parent is None:
                return
            self._forget(node)
            node = parent
