"""Which data shard takes a new request: the least loaded one (host side, plain numpy).

A :class:`~paxkv.scale.sharded_cache.ShardedPagedCache` groups its rows by shard (row ``r`` in shard
``r // rows_per_shard``) and a row draws pages only from its own shard, so the row a scheduler
picks decides whose pages a request uses. Taking the lowest free row fills shard 0 first and
leaves the others idle until its rows run out; :func:`pick_row` instead takes a free row of the
shard with the most headroom::

    headroom[s] = free_pages[s] - cdiv(queued_tokens[s], page_size)

where ``queued_tokens[s]`` counts the tokens the shard's running requests will still write
(prompt tokens not yet prefilled, tokens still to generate): pages already promised. Ties go
to the shard with more free rows, then to the lower shard, so equal shards fill round-robin.
A request whose prompt is cached in some shard's prefix index goes there instead when it can
(:func:`pick_row_for_hits`): page ids are shard-local, so only that shard's rows can use the
hit.
:func:`pick_shard` places a group of rows that must share pages (a scoring context and its
continuations) in one shard.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def headroom(free_pages: Sequence[int], queued_tokens: Sequence[int],
             page_size: int) -> np.ndarray:
    """int ``[data]``: each shard's free pages less those its queued tokens will take."""
    queued = np.asarray(queued_tokens, np.int64)
    return np.asarray(free_pages, np.int64) - (queued + page_size - 1) // page_size


def pick_row(free_rows: Sequence[int], rows_per_shard: int, free_pages: Sequence[int],
             queued_tokens: Sequence[int], page_size: int) -> int:
    """The lowest free row of the least loaded shard that has one.

    Args:
      free_rows: global row ids with no request (any order; at least one).
      rows_per_shard: rows of one shard (``ShardedPagedCache.rows_per_shard``).
      free_pages: int ``[data]``, ``ShardedPagedCache.shard_free_pages()``.
      queued_tokens: int ``[data]``, tokens the shard's running requests will still write.
    """
    if not free_rows:
        raise ValueError("pick_row needs at least one free row")
    rows = np.asarray(sorted(free_rows))
    shards = rows // rows_per_shard
    room = headroom(free_pages, queued_tokens, page_size)
    open_rows = np.bincount(shards, minlength=len(room))
    # lexsort: the last key is the primary one; the lowest shard wins the final tie
    order = np.lexsort((shards, -open_rows[shards], -room[shards]))
    return int(rows[order[0]])


def pick_shard(rows_left: Sequence[int], free_pages: Sequence[int], rows: int) -> int | None:
    """The shard a unit of ``rows`` rows that must share pages (a context and its forks) goes
    to: among those with ``rows`` free rows, the one with the most free pages (ties: the
    lower shard); None when no shard has the rows.

    Args:
      rows_left: int ``[data]``, free rows per shard.
      free_pages: int ``[data]``, free pages per shard.
    """
    fits = np.flatnonzero(np.asarray(rows_left) >= rows)
    if not fits.size:
        return None
    return int(fits[np.argmax(np.asarray(free_pages)[fits])])


def pick_row_for_hits(free_rows: Sequence[int], rows_per_shard: int,
                      free_pages: Sequence[int], queued_tokens: Sequence[int], page_size: int,
                      hit_tokens: Sequence[int], fits: Sequence[bool]) -> int:
    """The free row a request with prefix-cache hits takes: in the shard whose hit serves the
    most of its prompt, among those with a free row where it ``fits``; else :func:`pick_row`'s.

    Why the hit outranks the load: a hit's pages are ids of the shard that holds them, so
    only a row there can attach them, and attaching saves both the prefill of those tokens and
    the pages they would fill again; a request sent elsewhere recomputes its prefix and holds
    a second copy of it. Load still decides among equal hits (the most headroom, then the
    lower shard) and wherever no hit shard can take the request now (no free row, or it
    would not fit the shard's pages), so a popular prefix never piles every request onto a
    shard that is full: the least-loaded shard takes it and caches the prefix too.

    Args:
      free_rows, rows_per_shard, free_pages, queued_tokens, page_size: as :func:`pick_row`'s.
      hit_tokens: int ``[data]``, the tokens each shard's index serves the request (0: none).
      fits: bool ``[data]``, whether the request with that shard's hit fits its pages (the
        caller's admission rule, say :func:`paxkv.engine.policy.admits`).
    """
    if not free_rows:
        raise ValueError("pick_row_for_hits needs at least one free row")
    rows = np.asarray(sorted(free_rows))
    shards = rows // rows_per_shard
    room = headroom(free_pages, queued_tokens, page_size)
    hits = np.asarray(hit_tokens, np.int64)
    open_rows = np.bincount(shards, minlength=len(room)) > 0
    usable = np.flatnonzero((hits > 0) & open_rows & np.asarray(fits, bool))
    if not usable.size:
        return pick_row(free_rows, rows_per_shard, free_pages, queued_tokens, page_size)
    # lexsort: the last key is the primary one; the lowest shard wins the final tie
    best = usable[np.lexsort((usable, -room[usable], -hits[usable]))[0]]
    return int(rows[shards == best][0])
