"""Which data shard takes a new request: the least loaded one (host side, plain numpy).

A :class:`~paxkv.sharded_cache.ShardedPagedCache` groups its rows by shard (row ``r`` in shard
``r // rows_per_shard``) and a row draws pages only from its own shard, so the row a scheduler
picks decides whose pages a request uses. Taking the lowest free row fills shard 0 first and
leaves the others idle until its rows run out; :func:`pick_row` instead takes a free row of the
shard with the most headroom::

    headroom[s] = free_pages[s] - cdiv(queued_tokens[s], page_size)

where ``queued_tokens[s]`` counts the tokens the shard's running requests will still write
(prompt tokens not yet prefilled, tokens still to generate): pages already promised. Ties go
to the shard with more free rows, then to the lower shard, so equal shards fill round-robin.
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
