"""Contexts sharing pages across a scoring call: the prefix index kept in step with the cache.

Every full page of a prefilled context is indexed (the index holds one reference), so a later
context with the same first pages (few-shot examples, a shared instruction) attaches them and
prefills only the rest. At the end of a call :meth:`SharedContexts.clear` drops every
reference: scoring leaves the pool entirely free.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from paxkv.engine.cache_ops import CacheOps
from paxkv.prefix.index import Hit, PrefixIndex


class SharedContexts:
    """A :class:`PrefixIndex` whose every page holds one reference in ``ops``' cache."""

    def __init__(self, ops: CacheOps):
        self.ops = ops
        self.index = PrefixIndex(ops.cache.page_size)

    def lookup(self, ctx: Sequence[int]) -> tuple[Hit, list[bytes]]:
        """The longest cached prefix of all but the last token (whose logits are needed) and
        the digests of the context's full pages."""
        limit = len(ctx) - 1
        return self.index.match(ctx, max_tokens=limit), self.index.digests(ctx[:limit])

    def attach(self, row: int, ctx: Sequence[int], hit: Hit) -> None:
        """Row ``row`` starts from the hit's pages."""
        self.ops.attach(row, hit.pages, hit.num_tokens)
        self.index.record(len(ctx), hit.num_tokens)

    def insert(self, rows: Sequence[int], contexts: Sequence[Sequence[int]]) -> None:
        """Indexes the full pages each row's context has written."""
        ps = self.ops.cache.page_size
        tables = np.asarray(self.ops.cache.table.block_tables)
        new: list[int] = []
        for row, ctx in zip(rows, contexts):
            full = len(ctx) // ps
            new += self.index.insert(ctx[:full * ps], tables[row, :full])
        self.ops.retain(new, 1)

    def evict(self, num: int, protect: Sequence[int]) -> int:
        """Drops up to ``num`` cached pages only the index holds; returns how many."""
        pages = self.index.evict(num, np.asarray(self.ops.cache.table.ref_counts), protect)
        self.ops.retain(pages, -1)
        self.ops.free += len(pages)
        return len(pages)

    def clear(self) -> None:
        self.ops.retain(self.index.clear(), -1)
