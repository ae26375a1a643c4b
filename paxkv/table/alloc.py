"""The arithmetic of one grant of pages, shared by every :func:`paxkv.table.page_table.reserve`.

Each function is one vectorised pass over the rows or the pool: find the free pages, decide
which rows are served (first-come by row, all-or-nothing), write the granted pages into the
block tables, and describe what the pool must do (:class:`PoolUpdate`). They take arrays, not
the table, so each can be read and tested alone.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PoolUpdate:
    """What the pool must do after a table operation (ids past the pool are no-ops).

    Attributes:
      fresh_pages: int32 ``[alloc_limit]``: pages just handed out (to scrub before use).
      copy_src, copy_dst: int32 ``[max_seqs]``: copy-on-write copies, page ``src -> dst``.
    """

    fresh_pages: jax.Array
    copy_src: jax.Array
    copy_dst: jax.Array


def free_page_ids(ref_counts: jax.Array, size: int, fill: int) -> jax.Array:
    """The first ``size`` free page ids in increasing order, ``fill``-padded (one pass)."""
    return jnp.nonzero(ref_counts == 0, size=size, fill_value=fill)[0].astype(jnp.int32)


def keepers(last_page: jax.Array, writes_last: jax.Array, refs: jax.Array, lengths: jax.Array,
            *, num_pages: int, max_len: int) -> jax.Array:
    """bool ``[max_seqs]``: rows that may write into their shared partial last page in place.

    ``last_page``, ``writes_last``, ``refs`` (the last page's ref count) and ``lengths`` are
    per row, ``[max_seqs]``."""
    # When every holder of a shared partial page writes in this call and all hold the same
    # length, the highest row keeps the page and only the others copy (beam search: 4 beams
    # cost 3 copies, not 4). Equal lengths make this safe even if another holder's copy fails:
    # the keeper writes at a slot no other holder reads yet.
    page_or_oob = jnp.where(writes_last, last_page, num_pages + 1)
    rows = jnp.arange(lengths.shape[0], dtype=jnp.int32)
    empty = jnp.zeros((num_pages,), jnp.int32)
    writers = empty.at[page_or_oob].add(1, mode="drop")
    keeper = (empty - 1).at[page_or_oob].max(rows, mode="drop")
    len_lo = (empty + max_len + 1).at[page_or_oob].min(lengths, mode="drop")
    len_hi = (empty - 1).at[page_or_oob].max(lengths, mode="drop")
    at_last = functools.partial(jnp.take, indices=last_page, mode="fill", fill_value=-2)
    all_write = (at_last(writers) == refs) & (at_last(len_lo) == at_last(len_hi))
    return all_write & (at_last(keeper) == rows)


def grant(ref_counts: jax.Array, need: jax.Array, fits: jax.Array,
          alloc_limit: int) -> tuple[jax.Array, jax.Array]:
    """Rows served first-come by row: ``ok`` (bool) and pages granted (int32), ``[max_seqs]``."""
    num_free = jnp.minimum(jnp.sum(ref_counts == 0), alloc_limit)
    want = jnp.where(fits, need, 0)
    # NOTE: a row needing no page (num_new = 0, or room in its own last page) is never
    # blocked; a row needing pages is, once an earlier row's request no longer fits.
    ok = fits & ((need == 0) | (jnp.cumsum(want) <= num_free))
    return ok, jnp.where(ok, need, 0)


def place_new_pages(block_tables: jax.Array, free_ids: jax.Array, ok: jax.Array,
                    granted: jax.Array, first_rank: jax.Array,
                    first_cell: jax.Array) -> jax.Array:
    """The block tables with each granted row's new pages written in from ``first_cell``."""
    # Cell (b, m) receives free_ids[first_rank[b] + k] where k counts the row's new pages:
    # the copy (if any) takes k = 0 and lands in cell held-1; growth fills cells held.. .
    m = jnp.arange(block_tables.shape[1], dtype=jnp.int32)[None, :]
    first_cell = first_cell[:, None]
    new_cell = ok[:, None] & (m >= first_cell) & (m < first_cell + granted[:, None])
    rank = first_rank[:, None] + (m - first_cell)
    return jnp.where(new_cell, free_ids[jnp.clip(rank, 0, free_ids.shape[0] - 1)], block_tables)


def pool_update(free_ids: jax.Array, copy_ok: jax.Array, last_page: jax.Array,
                first_rank: jax.Array, total: jax.Array, oob: int) -> PoolUpdate:
    """The pages handed out (the first ``total`` of ``free_ids``) and the copies to make."""
    alloc_limit = free_ids.shape[0]
    copy_src = jnp.where(copy_ok, last_page, oob)
    copy_dst = jnp.where(copy_ok, free_ids[jnp.clip(first_rank, 0, alloc_limit - 1)], oob)
    fresh = jnp.where(jnp.arange(alloc_limit) < total, free_ids, oob)
    return PoolUpdate(fresh, copy_src, copy_dst)
