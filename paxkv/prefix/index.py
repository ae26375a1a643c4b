"""The prefix cache: a host-side index from chained page hashes to physical pages.

Each full page of a sequence is named by a digest chained over everything before it, with a
tenant salt mixed into every link (:mod:`paxkv.prefix.chain_hash`), so equal digests mean equal
prefixes of the same tenant. The index is a tree of such pages per salt; the token ids are kept
in each node and compared on every hit, so a hash collision can never serve another prefix's
KV::

    root(salt) -- d0:p4 -- d1:p9 -- d2:p1      one prompt's chain
                      \\-- d1':p12              another continuation of the same first page

The index holds one reference on every page it names (the caller's
:func:`paxkv.table.page_table.retain`), so cached pages outlive their writers. A lookup
returns the longest chain of full pages and, past it, optionally a *partial* hit: a cached
child page whose first ``r < page_size`` tokens match. A sequence attached to it owns only
those ``r`` slots and copies it before its first write (copy-on-write in
:func:`paxkv.table.page_table.reserve`): a shared prefix ending mid-page is reused to the token.

Eviction drops chain tails (leaves) whose only holder is the index, least recently used first
(:attr:`PrefixIndex.dropped` says what, for the host tier); :meth:`PrefixIndex.drop_salt`
forgets one salt's tree. Plain host Python; nothing traced.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Sequence

import numpy as np

from paxkv.prefix.chain_hash import chain, link, root_digest, salt_bytes


@dataclasses.dataclass(eq=False)
class _Node:
    digest: bytes
    page: int  # -1 for a root
    tokens: tuple[int, ...]
    parent: "_Node | None"
    depth: int  # 0 for a root, 1 for a first page
    salt: bytes = b""  # its tree's
    last_used: int = 0
    children: dict[bytes, "_Node"] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Hit:
    """A lookup's answer: attach ``pages`` (in order) to hold ``num_tokens`` tokens.

    Attributes:
      pages: the chain's full pages (``num_full`` of them), then the partial page if any.
      num_tokens: tokens the pages serve (``num_full * page_size`` plus the partial match).
    """

    pages: tuple[int, ...] = ()
    num_tokens: int = 0
    num_full: int = 0

    @property
    def partial(self) -> bool:
        return len(self.pages) > self.num_full


@dataclasses.dataclass(frozen=True)
class Entry:
    """One cached page (for tests): tokens, parent's page (-1: a first page), salt, link."""

    page: int
    tokens: tuple[int, ...]
    parent_page: int
    salt: bytes
    digest: bytes
    parent_digest: bytes


class PrefixIndex:
    """Chained-hash index of full pages (see the module docstring).

    Args:
      page_size: tokens per page.

    Counters: ``lookup_tokens``, ``hit_tokens`` (looked up, served), ``inserted``, ``evicted``.
    """

    def __init__(self, page_size: int):
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        self.page_size = page_size
        self._roots: dict[bytes, _Node] = {}
        self._nodes: dict[bytes, _Node] = {}  # digest -> node
        self._by_page: dict[int, _Node] = {}
        self._clock = self.lookup_tokens = self.hit_tokens = self.inserted = self.evicted = 0

    def __len__(self) -> int:
        """Pages the index holds (one reference each)."""
        return len(self._by_page)

    def __contains__(self, page: int) -> bool:
        return page in self._by_page

    def pages(self) -> list[int]:
        return sorted(self._by_page)

    def page_of(self, digest: bytes) -> int | None:
        node = self._nodes.get(digest)
        return None if node is None else node.page

    # -- hashing --------------------------------------------------------------------------
    def _root(self, salt: bytes, create: bool) -> _Node | None:
        root = self._roots.get(salt)
        if root is None and create:
            root = _Node(root_digest(salt), -1, (), None, 0, salt)
            self._roots[salt] = root
        return root

    def digests(self, tokens: Sequence[int], salt: str | bytes | None = None) -> list[bytes]:
        """The chained digests of every full page of ``tokens``."""
        return chain(tokens, salt, self.page_size)

    # -- lookups --------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], salt: str | bytes | None = None, *,
              max_tokens: int | None = None, partial: bool = True) -> Hit:
        """The longest cached prefix of ``tokens[:max_tokens]``; touches the pages it returns
        (LRU). Pure lookup: the caller attaches the pages and records the hit
        (:meth:`record`)."""
        salt, ps = salt_bytes(salt), self.page_size
        limit = len(tokens) if max_tokens is None else min(len(tokens), max_tokens)
        node = self._root(salt, create=False)
        if node is None or limit <= 0:
            return Hit()
        self._clock += 1
        pages: list[int] = []
        while (len(pages) + 1) * ps <= limit:
            start = len(pages) * ps
            chunk = tuple(tokens[start:start + ps])
            child = self._nodes.get(link(node.digest, salt, chunk))
            if child is None or child.parent is not node or child.tokens != chunk:
                break
            node = child
            node.last_used = self._clock
            pages.append(node.page)
        num_full, num_tokens = len(pages), len(pages) * ps
        if partial and num_tokens < limit:
            rest = tuple(tokens[num_tokens:min(limit, num_tokens + ps)])
            best, best_len = None, 0
            for child in node.children.values():
                n = _common_prefix(child.tokens, rest)
                if n > best_len:
                    best, best_len = child, n
            if best is not None:
                best.last_used = self._clock
                pages.append(best.page)
                num_tokens += best_len
        return Hit(tuple(pages), num_tokens, num_full)

    def record(self, looked_up: int, hit: int) -> None:
        """Counts one admitted lookup: ``looked_up`` prompt tokens, ``hit`` of them cached."""
        self.lookup_tokens, self.hit_tokens = self.lookup_tokens + looked_up, self.hit_tokens + hit

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    # -- changes --------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], pages: Sequence[int],
               salt: str | bytes | None = None) -> list[int]:
        """Indexes the full pages of a sequence: ``pages[i]`` holds ``tokens[i*ps:(i+1)*ps]``.

        Pages whose prefix is already cached are skipped (the cached copy stays); the chain
        stops at a page the index already names elsewhere. Returns the pages newly indexed:
        the caller must ``retain`` each once.
        """
        salt, ps = salt_bytes(salt), self.page_size
        node = self._root(salt, create=True)
        self._clock += 1
        new = []
        for i in range(min(len(tokens) // ps, len(pages))):
            chunk = tuple(int(t) for t in tokens[i * ps:(i + 1) * ps])
            digest = link(node.digest, salt, chunk)
            child = self._nodes.get(digest)
            if child is None:
                page = int(pages[i])
                if page in self._by_page or page < 0:
                    break
                child = _Node(digest, page, chunk, node, node.depth + 1, salt)
                node.children[digest] = child
                self._nodes[digest] = child
                self._by_page[page] = child
                new.append(page)
            elif child.parent is not node or child.tokens != chunk:
                break  # a digest collision: never chain through it
            child.last_used = self._clock
            node = child
        self.inserted += len(new)
        return new

    def evict(self, num: int, ref_counts: np.ndarray, protect: Sequence[int] = ()) -> list[int]:
        """Drops up to ``num`` pages whose only holder is the index (``ref_counts[p] == 1``),
        chain tails first, least recently used first; never a page in ``protect``. Returns the
        pages dropped: the caller must release the index's reference on each (``retain``
        with -1)."""
        protect = set(int(p) for p in protect)

        def evictable(n: _Node) -> bool:
            return (n.page >= 0 and not n.children and int(ref_counts[n.page]) == 1
                    and n.page not in protect)

        heap = [(n.last_used, -n.depth, n.page, n) for n in self._by_page.values()
                if evictable(n)]
        heapq.heapify(heap)
        out: list[int] = []
        self.dropped = []  # (digest, parent digest, tokens, position, salt) per page dropped
        while heap and len(out) < num:
            node = heapq.heappop(heap)[-1]
            self._remove(node)
            out.append(node.page)
            self.dropped.append((node.digest, node.parent.digest, node.tokens, node.depth - 1,
                                 node.salt))
            parent = node.parent
            if parent is not None and evictable(parent):
                heapq.heappush(heap, (parent.last_used, -parent.depth, parent.page, parent))
        self.evicted += len(out)
        return out

    def evictable(self, ref_counts: np.ndarray, protect: Sequence[int] = ()) -> int:
        """How many pages :meth:`evict` could drop now, rounds of tails included: only the
        index holds them (``ref_counts[p] == 1``), not in ``protect``, nothing held or
        protected below them (a chain may go on in another's page). Evicts nothing."""
        refs, protect = ref_counts, set(int(p) for p in protect)  # an array, or a mapping
        order, stack = [], list(self._roots.values())
        while stack:  # pre-order: each node before its children
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        droppable: dict[int, bool] = {}  # id(node) -> its whole subtree can go
        for node in reversed(order):  # children first
            droppable[id(node)] = (all(droppable[id(c)] for c in node.children.values())
                                   and (node.page < 0 or (int(refs[node.page]) == 1
                                                          and node.page not in protect)))
        return sum(droppable[id(n)] for n in order if n.page >= 0)

    def clear(self) -> list[int]:
        """Forgets everything; returns every page the index held (release each once)."""
        pages = self.pages()
        self._roots.clear()
        self._nodes.clear()
        self._by_page.clear()
        return pages

    def drop_salt(self, salt: str | bytes | None) -> list[int]:
        """Forgets every page of ``salt``'s tree (another's holds aside; not counted as
        evicted); returns them (release each once). Other salts' pages stay as they were."""
        root = self._roots.pop(salt_bytes(salt), None)
        stack, out = [] if root is None else list(root.children.values()), []
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            del self._nodes[node.digest], self._by_page[node.page]
            out.append(node.page)
        return sorted(out)

    def drop_leaf(self, page: int) -> int | None:
        """Forgets ``page`` if no cached page chains below it; returns its parent's page (-1:
        it was a first page), or None when it has children (kept)."""
        node = self._by_page[page]
        if node.children:
            return None
        self._remove(node)
        return node.parent.page

    def _remove(self, node: _Node) -> None:
        del node.parent.children[node.digest]
        del self._nodes[node.digest]
        del self._by_page[node.page]
        root = node.parent
        while root.parent is not None:
            root = root.parent
        if not root.children:
            self._roots = {s: r for s, r in self._roots.items() if r is not root}

    # -- inspection -----------------------------------------------------------------------
    def entries(self) -> list[Entry]:
        """Every cached page with its chain link (for invariant checks)."""
        out = []
        for salt, root in self._roots.items():
            stack = [root]
            while stack:
                node = stack.pop()
                for child in node.children.values():
                    out.append(Entry(child.page, child.tokens, node.page, salt, child.digest,
                                     node.digest))
                    stack.append(child)
        return out


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
