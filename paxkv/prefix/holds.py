"""The prefix cache's hold on pages, on a one-device paged cache or per data shard of a
sharded one: cached pages attached to a row, the index's own references added or dropped, and
the host-side reads the index needs (block tables, ref counts).

Page ids are a shard's own (:mod:`paxkv.scale.sharded_cache`), so every page here travels with its
shard: a hit's pages attach only to a row of the shard that holds them, and a reference is
added in one shard's ref counts. A one-device cache is shard 0::

    pages_by_shard = [[4, 9], [], [4]]    page 4 of shard 0 and page 4 of shard 2: two pages

Each jitted operation donates the cache and takes fixed-width arrays, so it compiles once per
cache shape; on a sharded cache it runs the single-device table op per shard
(:meth:`~paxkv.scale.sharded_cache.ShardedPagedCache.attach`, ``.retain``): no collective.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Iterator, Sequence

import jax
import numpy as np

from paxkv.cache.grouped import GroupedPagedCache
from paxkv.scale.distributed import gather
from paxkv.scale.sharded_cache import ShardedPagedCache
from paxkv.table import page_table as pt

CHUNK = 256  # most pages per shard of one retain call (a wider list runs in several)


@functools.partial(jax.jit, donate_argnames=("cache",))
def attach_rows(cache: Any, rows: jax.Array, pages: jax.Array,
                lengths: jax.Array) -> tuple[Any, jax.Array]:
    """``page_table.attach`` on a one-device paged cache (rows ``[k]``, pages ``[k, w]``,
    lengths ``[k]``); ``ok`` bool ``[k]``."""
    table, ok = pt.attach(cache.table, rows, pages, lengths)
    return dataclasses.replace(cache, table=table), ok


@functools.partial(jax.jit, donate_argnames=("cache",))
def retain_pages(cache: Any, pages: jax.Array, delta: jax.Array | int) -> Any:
    """Adds ``delta`` references to ``pages`` (int32 ``[n]``; ids past the pool ignored).
    ``delta`` is traced: taking (+1) and dropping (-1) references are one program, so the
    first eviction or clear of a warm engine (a weight update's) compiles nothing."""
    return dataclasses.replace(cache, table=pt.retain(cache.table, pages, delta))


@functools.partial(jax.jit, donate_argnames=("cache",))
def attach_shard_rows(cache: ShardedPagedCache, pages: jax.Array,
                      lengths: jax.Array) -> tuple[ShardedPagedCache, jax.Array]:
    """:meth:`ShardedPagedCache.attach` (pages ``[max_seqs, w]``, lengths ``[max_seqs]``)."""
    return cache.attach(pages, lengths)


@functools.partial(jax.jit, donate_argnames=("cache",))
def retain_shard_pages(cache: ShardedPagedCache, pages: jax.Array,
                       delta: jax.Array | int) -> ShardedPagedCache:
    """:meth:`ShardedPagedCache.retain` (pages int32 ``[data, n]``, shard-local ids)."""
    return cache.retain(pages, delta)


@functools.partial(jax.jit, donate_argnames=("cache",))
def attach_group_rows(cache: GroupedPagedCache, rows: jax.Array, pages: jax.Array,
                      lengths: jax.Array, first: jax.Array) -> tuple[GroupedPagedCache, jax.Array]:
    """:meth:`GroupedPagedCache.attach` (pages ``[groups, k, w]``, first ``[groups, k]``)."""
    return cache.attach(rows, pages, lengths, first)


@functools.partial(jax.jit, donate_argnames=("cache",))
def retain_group_pages(cache: GroupedPagedCache, pages: jax.Array,
                       delta: jax.Array | int) -> GroupedPagedCache:
    """:meth:`GroupedPagedCache.retain` (pages int32 ``[groups, n]``, group-local ids)."""
    return cache.retain(pages, delta)


def attach_groups(cache: GroupedPagedCache, row: int, pages: Sequence[Sequence[int]],
                  first: Sequence[int], num_tokens: int) -> tuple[GroupedPagedCache, bool]:
    """:func:`attach` on a layer-grouped cache: ``pages[g]`` (group ``g``'s ids, -1 before
    block ``first[g]``) in every group, all or none."""
    width = cache.table.block_tables.shape[-1]
    cells = np.full((len(pages), 1, width), -1, np.int32)
    for g, group_pages in enumerate(pages):
        cells[g, 0, :len(group_pages)] = group_pages
    cache, ok = attach_group_rows(cache, np.array([row], np.int32), cells,
                                  np.array([num_tokens], np.int32),
                                  np.array(first, np.int32)[:, None])
    return cache, bool(ok[0])


def retain_groups(cache: GroupedPagedCache, pages: Sequence[Sequence[int]],
                  delta: int) -> GroupedPagedCache:
    """``cache`` with ``delta`` more references on each group's pages (``pages[g]``)."""
    past = max(cache.groups.num_pages) + 1  # past every group's pool: ignored
    for padded in _padded_chunks(pages, past):
        cache = retain_group_pages(cache, padded, np.int32(delta))
    return cache


def _padded_chunks(pages: Sequence[Sequence[int]], fill: int) -> Iterator[np.ndarray]:
    """int32 ``[len(pages), CHUNK]`` arrays of at most :data:`CHUNK` ids of each list, padded
    with ``fill``: one compiled width (a scatter of 256 ids costs no more than one of 8 to
    dispatch; a width per power of two compiled 3 more programs for an unseen lm-eval task)."""
    longest = max((len(p) for p in pages), default=0)
    for start in range(0, longest, CHUNK):
        chunks = [list(p[start:start + CHUNK]) for p in pages]
        padded = np.full((len(chunks), CHUNK), fill, np.int32)
        for i, chunk in enumerate(chunks):
            padded[i, :len(chunk)] = chunk
        yield padded


def group_block_tables(cache: GroupedPagedCache) -> np.ndarray:
    """int32 ``[groups, max_seqs, max_pages_per_seq]``, -1 where a row holds no page (a
    window group's slid-out blocks, past its length)."""
    tables = gather(tuple(t.block_tables for t in cache.tables))
    return np.stack([np.where(t == n, -1, t) for t, n in zip(tables, cache.groups.num_pages)])


def group_ref_counts(cache: GroupedPagedCache) -> list[np.ndarray]:
    """Per group, int32 ``[num_pages_g]``: its references per page."""
    return list(gather(tuple(t.ref_counts for t in cache.tables)))


def attach(cache: Any, row: int, pages: Sequence[int], num_tokens: int) -> tuple[Any, bool]:
    """``(cache, ok)``: ``cache`` (donated) with row ``row`` holding ``pages`` (its shard's
    ids, a prefix-cache hit) for ``num_tokens`` tokens; ``ok`` False if the table refused
    (nothing changed)."""
    sharded = isinstance(cache, ShardedPagedCache)
    # NOTE: a stacked table's max_pages_per_seq reads its rows axis; the last axis is the width
    width = (cache.tables if sharded else cache.table).block_tables.shape[-1]
    cells = np.full((cache.max_seqs if sharded else 1, width), cache.num_pages, np.int32)
    cells[row if sharded else 0, :len(pages)] = pages
    if sharded:
        lengths = np.zeros(cache.max_seqs, np.int32)
        lengths[row] = num_tokens
        cache, ok = attach_shard_rows(cache, cells, lengths)
        ok = ok[row]
    else:
        cache, ok = attach_rows(cache, np.array([row], np.int32), cells,
                                np.array([num_tokens], np.int32))
        ok = ok[0]
    return cache, bool(ok)


def retain(cache: Any, pages_by_shard: Sequence[Sequence[int]], delta: int) -> Any:
    """``cache`` with ``delta`` more references on each shard's pages (``pages_by_shard[s]``:
    shard ``s``'s ids; a one-device cache takes one list)."""
    for padded in _padded_chunks(pages_by_shard, cache.num_pages):  # past the pool: ignored
        if isinstance(cache, ShardedPagedCache):
            cache = retain_shard_pages(cache, padded, np.int32(delta))
        else:
            cache = retain_pages(cache, padded[0], np.int32(delta))
    return cache


def block_tables(cache: Any) -> np.ndarray:
    """int32 ``[max_seqs, max_pages_per_seq]``: every row's pages (its shard's ids), global
    row order."""
    if isinstance(cache, ShardedPagedCache):
        bt = gather(cache.tables.block_tables)
        return bt.reshape(-1, bt.shape[-1])
    return gather(cache.table.block_tables)


def ref_counts(cache: Any) -> np.ndarray:
    """int32 ``[num_shards, num_pages]``: each shard's references per page."""
    if isinstance(cache, ShardedPagedCache):
        return gather(cache.tables.ref_counts)
    return gather(cache.table.ref_counts)[None]
