"""Shared pages in the engine: jitted, donated cache operations, the :class:`Sharing` half of
the scheduler (prefix-cache lookups and inserts, eviction, forks) and the accounting records.

The engine calls these between steps: ``attach_rows`` (a prefix-cache hit becomes a row),
``retain_pages`` (the prefix index takes or drops its reference), ``fork_rows`` (children share
a parent's pages), and the copy-on-write probe (``shared_partial_pages`` before a step,
``count_copies`` after it). Every array argument has a fixed width (``pad``), so each compiles
once per cache shape.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from paxkv import page_table as pt
from paxkv import steps
from paxkv.prefix_cache import Hit
from paxkv.request import Request


def pad(values: Sequence[int], width: int, fill: int) -> np.ndarray:
    """int32 ``[width]``: ``values`` then ``fill``."""
    out = np.full(width, fill, np.int32)
    out[:len(values)] = values
    return out


def bucket_width(n: int, lo: int = 8) -> int:
    """The power of two >= max(n, lo): a handful of compiled widths."""
    return max(lo, 1 << max(0, n - 1).bit_length())


@functools.partial(jax.jit, donate_argnames=("cache",))
def attach_rows(cache: Any, rows: jax.Array, pages: jax.Array,
                lengths: jax.Array) -> tuple[Any, jax.Array]:
    """``page_table.attach`` on a paged cache (rows ``[k]``, pages ``[k, w]``, lengths
    ``[k]``); ``ok`` bool ``[k]``."""
    table, ok = pt.attach(cache.table, rows, pages, lengths)
    return dataclasses.replace(cache, table=table), ok


@functools.partial(jax.jit, donate_argnames=("cache",), static_argnames=("delta",))
def retain_pages(cache: Any, pages: jax.Array, *, delta: int) -> Any:
    """Adds ``delta`` references to ``pages`` (int32 ``[n]``; ids past the pool ignored)."""
    return dataclasses.replace(cache, table=pt.retain(cache.table, pages, delta))


@functools.partial(jax.jit, donate_argnames=("cache",))
def fork_rows(cache: Any, parents: jax.Array, children: jax.Array) -> tuple[Any, jax.Array]:
    """``cache.fork`` (paged: share pages; dense: copy rows); pairs out of range are no-ops."""
    return cache.fork(parents, children)


@jax.jit
def shared_partial_pages(table: pt.PageTable) -> tuple[jax.Array, jax.Array]:
    """Before a step: each row's last cell and, where that page is partly filled and shared,
    its page id (``num_pages + 1`` elsewhere). int32 ``[max_seqs]`` each."""
    held = table.pages_held()
    cell = jnp.clip(held - 1, 0)
    page = jnp.take_along_axis(table.block_tables, cell[:, None], axis=1)[:, 0]
    refs = jnp.take(table.ref_counts, page, mode="fill", fill_value=0)
    shared = (held > 0) & (table.lengths % table.page_size != 0) & (refs > 1)
    return cell, jnp.where(shared, page, table.num_pages + 1)


@jax.jit
def count_copies(table: pt.PageTable, cell: jax.Array, page: jax.Array) -> jax.Array:
    """After a step: rows whose shared partial page was replaced by a private copy."""
    now = jnp.take_along_axis(table.block_tables, cell[:, None], axis=1)[:, 0]
    return jnp.sum((page <= table.num_pages) & (now != page))


table_stats = jax.jit(pt.stats)
sharing_stats = jax.jit(pt.sharing_stats)


@dataclasses.dataclass(frozen=True)
class SequenceStats:
    """One running (or held) sequence: ``tokens`` in its row, ``pages`` its row references,
    ``shared_pages`` of those with another holder (a row or the prefix index)."""

    tokens: int
    pages: int
    shared_pages: int


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """Pool-wide accounting of an :class:`paxkv.engine.Engine` (a dense cache counts a row
    as a page).

    Attributes:
      num_pages, free_pages, used_pages: the pool (used includes the prefix index's pages).
      shared_pages: pages with more than one holder.
      cached_pages: pages the prefix index holds.
      row_references: pages the rows would use if nothing were shared.
      row_pages: distinct pages the rows reference.
      prefix_lookup_tokens, prefix_hit_tokens, prefix_hit_rate: prompt tokens looked up in /
        served by the prefix cache (first admissions).
      cow_copies: copy-on-write page copies so far.
      prefill_tokens, decode_tokens: tokens computed by prefill / decode steps so far.
      peak_pages_used: the most pages in use after any step.
      preemptions, evictions: requests preempted, cached pages evicted.
      kv_bytes_per_page: K + V bytes of one page over all layers.
      sequences: per request id, the rows' :class:`SequenceStats`.
    """

    num_pages: int
    free_pages: int
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
    preemptions: int
    evictions: int
    kv_bytes_per_page: int
    sequences: dict[int, SequenceStats]


class Sharing:
    """The scheduler's sharing half (mixed into :class:`paxkv.scheduler.Scheduler`, whose
    state it uses): prefix-cache lookups, attach, indexing, eviction, forks, copy counting."""

    def _lookup(self, req: Request) -> tuple[Hit, list[bytes]]:
        """The longest cached prefix (at most all but the last token) and the digests of the
        request's full pages."""
        if self.index is None:
            return Hit(), []
        tokens = req.tokens
        limit = len(tokens) - 1
        return (self.index.match(tokens, req.salt, max_tokens=limit),
                self.index.digests(tokens[:limit], req.salt))

    def _holder(self, req: Request) -> Request | None:
        """The held prefix ``req`` forks at admission; ``req`` itself while that prefix is
        still waiting or prefilling; None without one (or once it was released)."""
        if req.prefix_of is None:
            return None
        holder = self._requests[req.prefix_of]
        if holder.finish_reason is None:
            return req
        return holder if holder.finish_reason == "prefilled" and holder.row is not None else None

    def _fork_prefix(self, holder: Request, req: Request) -> None:
        """``req``'s row shares every page of the held prefix (its partial last page too)."""
        self.cache, ok = fork_rows(self.cache, jnp.asarray(pad([holder.row], self.max_seqs, -1)),
                                   jnp.asarray(pad([req.row], self.max_seqs, -1)))
        if not bool(ok[0]):
            raise RuntimeError(f"forking prefix row {holder.row} into row {req.row} failed")
        req.cached = holder.cached
        self._shares = True

    def _attach(self, req: Request, hit: Hit) -> None:
        width = self.cache.table.max_pages_per_seq
        pages = pad(hit.pages, width, self.num_pages)[None, :]
        self.cache, ok = attach_rows(self.cache, jnp.asarray([req.row], jnp.int32),
                                     jnp.asarray(pages), jnp.asarray([hit.num_tokens]))
        if not bool(ok[0]):
            raise RuntimeError(f"attaching cached pages {hit.pages} to row {req.row} failed")
        req.cached = hit.num_tokens
        self._shares = True

    def _cache_pages(self, reqs: list[Request]) -> None:
        """Indexes the full pages each request has written (the index takes a reference)."""
        reqs = [r for r in reqs if r.row is not None and r.cached >= self.page_size]
        if self.index is None or not reqs:
            return
        tables = np.array(self.cache.table.block_tables)
        new: list[int] = []
        for r in reqs:
            full = r.cached // self.page_size
            new += self.index.insert(r.tokens[:full * self.page_size], tables[r.row, :full],
                                     r.salt)
        self._retain(new, 1)

    def _retain(self, pages: list[int], delta: int) -> None:
        for i in range(0, len(pages), 256):
            chunk = pages[i:i + 256]
            padded = pad(chunk, bucket_width(len(chunk)), self.num_pages)
            self.cache = retain_pages(self.cache, jnp.asarray(padded), delta=delta)

    def _evict(self, num: int, protect: tuple[int, ...] = ()) -> None:
        if self.index is None or not len(self.index):
            return
        ref_counts = np.array(self.cache.table.ref_counts)
        pages = self.index.evict(num, ref_counts, protect)
        self._retain(pages, -1)
        self._free += len(pages)

    def _spawn(self, parent: Request, k: int, **settings: Any) -> list[Request]:
        """``k`` child requests continuing ``parent``; child i samples from
        ``fold_in(parent key, i)``."""
        parent_key = jax.random.wrap_key_data(jnp.asarray(parent.key_data))
        children = []
        for i in range(k):
            key = np.asarray(jax.random.key_data(jax.random.fold_in(parent_key, i)), np.uint32)
            fields = dict(max_new_tokens=parent.max_new_tokens, stop_ids=parent.stop_ids,
                          temperature=parent.temperature, top_k=parent.top_k,
                          top_p=parent.top_p, salt=parent.salt, hold=parent.hold)
            fields.update({name: v for name, v in settings.items() if v is not None})
            child = Request(self._next_id, parent.tokens, key_data=key, **fields)
            self._next_id += 1
            self._requests[child.id] = child
            children.append(child)
        parent.children = [c.id for c in children]
        return children

    def _branch(self, parent: Request, children: list[Request]) -> None:
        """Child 0 takes over the parent's row; the others fork into free rows sharing its pages
        (no KV moves; each child's first decode feeds the pending last token). Children left
        without a row wait at the queue front and are recomputed."""
        if parent.finish_reason is None:
            parent.finish_reason = "forked"
        if parent.row is None or not parent.cached:
            self._release([parent])
            self._waiting.extendleft(reversed(children))
            return
        row, cached = parent.row, parent.cached
        kids = [i for i, r in enumerate(self._rows) if r is None][:len(children) - 1]
        if kids:
            self.cache, ok = fork_rows(
                self.cache, jnp.asarray(pad([row] * len(kids), self.max_seqs, -1)),
                jnp.asarray(pad(kids, self.max_seqs, -1)))
            if not np.asarray(ok)[:len(kids)].all():
                raise RuntimeError(f"forking row {row} into rows {kids} failed")
            self._shares = True
        parent.row = None
        for child, r in zip(children, [row] + kids):
            self._place(child, r)
            child.cached = child.num_cached_tokens = cached
            self._last_token[r] = child.tokens[-1]
        self._waiting.extendleft(reversed(children[1 + len(kids):]))
        if self.kind == "dense":
            self._free = int(steps.free_pages(self.cache))

    def _cow_probe(self):
        if not self._shares or self.kind != "paged":
            return None
        return shared_partial_pages(self.cache.table)

    def _count_copies(self, probe) -> None:
        if probe is not None:
            self.num_cow_copies += int(count_copies(self.cache.table, *probe))
