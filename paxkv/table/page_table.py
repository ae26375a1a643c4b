"""The page table: which physical pages each sequence's logical blocks live in.

Pure, vectorised, jit-able functions over a frozen pytree. Every operation returns a new table
and a per-sequence ``ok`` flag; a sequence whose operation fails is left bit-identical, and no
operation raises inside jit. Page ids ``0 .. num_pages-1`` are real; ``num_pages`` is the
*sentinel* page that table padding points at (it exists in the pool but is never handed out)::

    block_tables [max_seqs, max_pages_per_seq]     ref_counts [num_pages]
    row 0: [ 4, 1, 7, S, S ]  lengths[0] = 37      page 1: 2  (shared by rows 0 and 2)
    row 1: [ S, S, S, S, S ]  lengths[1] = 0       page 3: 0  (free)
    row 2: [ 0, 1, S, S, S ]  lengths[2] = 20      ...

Invariants (checked by the state-machine tests after every operation): a page is free iff its
ref count is 0; a page's ref count equals the number of table entries pointing at it (plus any
external holder, such as the prefix index, that took a reference with :func:`retain`);
an inactive row is all sentinel with length 0; row ``b`` holds exactly
``ceil(lengths[b] / page_size)`` pages.

Allocation takes free pages in increasing id order with one cumsum over the pool (no per-page
loops); requests are granted first-come (by row) all-or-nothing per sequence. The accounting
(:func:`stats`, :func:`sharing_stats`) lives in :mod:`paxkv.table.stats`, the arithmetic of a
grant in :mod:`paxkv.table.alloc`, the rows that point at stored pages (:func:`reorder`,
:func:`attach`) in :mod:`paxkv.table.share`, and the state itself in :mod:`paxkv.table.state`;
all are re-exported here.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from paxkv.core.buckets import cdiv
from paxkv.table.alloc import (PoolUpdate, free_page_ids, grant, keepers,  # noqa: F401
                               place_new_pages, pool_update)
from paxkv.table.share import attach, reorder  # noqa: F401
from paxkv.table.state import PageTable, create  # noqa: F401
from paxkv.table.stats import SharingStats, TableStats, sharing_stats, stats  # noqa: F401


def reserve(table: PageTable, num_new: jax.Array, *, max_new: int,
            cow: jax.Array | None = None) -> tuple[PageTable, PoolUpdate, jax.Array]:
    """Makes room for ``num_new[b]`` more tokens in each sequence, all-or-nothing per row.

    Before a sequence writes into its partly filled last page while that page is shared
    (ref count > 1), the page is copied to a fresh one (copy-on-write); the copy is part of the
    same all-or-nothing request. A successful row with ``num_new > 0`` becomes active.

    Args:
      table: the page table.
      num_new: int32 ``[max_seqs]``: tokens to add per row (0 = leave the row alone).
      max_new: static bound on ``num_new`` (a step's token width); it sizes the allocation
        buffers, so a decode step (``max_new=1``) allocates through ``max_seqs`` slots.
      cow: optional bool ``[max_seqs]``: also privatise the shared partial last page of these
        rows even when ``num_new`` is 0 (that is :func:`copy_on_write`).

    Returns:
      ``(table, update, ok)``: ``ok`` bool ``[max_seqs]`` is False for rows that asked for
      more than ``max_new`` tokens, more than their block-table row can hold, or more pages
      than remain free once earlier rows are served; those rows are unchanged. ``update``
      lists the fresh pages and the copies the pool must apply (:func:`paxkv.cache.pool.apply`).
    """
    num_new = jnp.asarray(num_new, jnp.int32)
    held = table.pages_held()
    new_len = table.lengths + num_new
    last_page, needs_copy = _copies_needed(table, num_new, held, cow)
    need = cdiv(new_len, table.page_size) - held + needs_copy.astype(jnp.int32)  # [s]
    fits = (num_new >= 0) & (num_new <= max_new) & (new_len <= table.max_len)
    alloc_limit = min(table.num_pages, table.max_seqs * (cdiv(max_new, table.page_size) + 1))
    free_ids = free_page_ids(table.ref_counts, alloc_limit, table.num_pages + 1)
    ok, granted = grant(table.ref_counts, need, fits, alloc_limit)
    first_rank = jnp.cumsum(granted) - granted  # [s]: where each row's pages start in free_ids
    block_tables = place_new_pages(table.block_tables, free_ids, ok, granted, first_rank,
                                    held - needs_copy.astype(jnp.int32))
    update = pool_update(free_ids, ok & needs_copy, last_page, first_rank, jnp.sum(granted),
                          table.num_pages + 1)
    ref_counts = (table.ref_counts.at[update.fresh_pages].add(1, mode="drop")
                  .at[update.copy_src].add(-1, mode="drop"))
    new_table = dataclasses.replace(
        table, block_tables=block_tables, ref_counts=ref_counts,
        lengths=jnp.where(ok, new_len, table.lengths),
        active=table.active | (ok & (num_new > 0)))
    return new_table, update, ok


def _copies_needed(table: PageTable, num_new: jax.Array, held: jax.Array,
                   cow: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """Each row's last page and whether the row must copy it before writing (``[max_seqs]``)."""
    last_page = jnp.take_along_axis(
        table.block_tables, jnp.clip(held - 1, 0)[:, None], axis=1)[:, 0]
    partial = (table.lengths % table.page_size != 0) & (held > 0)
    wants_cow = (num_new > 0) if cow is None else ((num_new > 0) | cow)
    writes_last = wants_cow & partial
    refs = jnp.take(table.ref_counts, last_page, mode="fill", fill_value=0)
    keeps = keepers(last_page, writes_last, refs, table.lengths, num_pages=table.num_pages,
                    max_len=table.max_len) & (num_new > 0)  # explicit COW: every row copies
    return last_page, writes_last & (refs > 1) & ~keeps


def copy_on_write(table: PageTable, rows: jax.Array) -> tuple[PageTable, PoolUpdate, jax.Array]:
    """Gives each row in ``rows`` (bool ``[max_seqs]``) a private copy of its shared partial
    last page, so it can write there without disturbing the other holders.

    :func:`reserve` already does this for rows about to write; this is the explicit form.
    """
    zeros = jnp.zeros((table.max_seqs,), jnp.int32)
    return reserve(table, zeros, max_new=0, cow=jnp.asarray(rows, bool))


def release(table: PageTable, rows: jax.Array) -> tuple[PageTable, jax.Array]:
    """Finishes or cancels the rows in ``rows`` (bool ``[max_seqs]``).

    Their pages' ref counts drop at once; a page nobody else holds is free in the returned
    table. Returns ``(table, ok)`` with ``ok`` True for rows that were active.
    """
    rows = jnp.asarray(rows, bool)
    ok = rows & table.active
    dropped = jnp.where(ok[:, None], table.block_tables, table.num_pages + 1)
    ref_counts = table.ref_counts.at[dropped].add(-1, mode="drop")
    return dataclasses.replace(
        table, ref_counts=ref_counts,
        block_tables=jnp.where(ok[:, None], table.sentinel, table.block_tables),
        lengths=jnp.where(ok, 0, table.lengths),
        active=table.active & ~ok), ok


def fork(table: PageTable, parents: jax.Array, children: jax.Array) -> tuple[PageTable, jax.Array]:
    """Each ``children[i]`` row becomes a copy of ``parents[i]`` sharing all its pages.

    No KV moves: the child's block-table row points at the parent's pages and their ref counts
    go up. The shared partial last page is copied later, by whichever holder writes first.

    Args:
      parents, children: int32 ``[k]`` row ids. A pair fails (``ok[i]`` False) unless the
        parent is active, the child inactive and named by no other pair.

    Returns:
      ``(table, ok)`` with ``ok`` bool ``[k]``.
    """
    parents = jnp.asarray(parents, jnp.int32)
    children = jnp.asarray(children, jnp.int32)
    s = table.max_seqs
    in_range = (parents >= 0) & (parents < s) & (children >= 0) & (children < s)
    p = jnp.clip(parents, 0, s - 1)
    c = jnp.clip(children, 0, s - 1)
    child_uses = jnp.zeros((s,), jnp.int32).at[jnp.where(in_range, c, s)].add(1, mode="drop")
    ok = in_range & table.active[p] & ~table.active[c] & (child_uses[c] == 1)
    target = jnp.where(ok, c, s)  # failed pairs scatter out of range and are dropped
    block_tables = table.block_tables.at[target].set(table.block_tables[p], mode="drop")
    shared = jnp.where(ok[:, None], table.block_tables[p], table.num_pages + 1)
    ref_counts = table.ref_counts.at[shared].add(1, mode="drop")
    return dataclasses.replace(
        table, block_tables=block_tables, ref_counts=ref_counts,
        lengths=table.lengths.at[target].set(table.lengths[p], mode="drop"),
        active=table.active.at[target].set(True, mode="drop")), ok


def slide(table: PageTable, keep_from: jax.Array) -> tuple[PageTable, jax.Array]:
    """Releases, in every active row, the pages that lie wholly before position
    ``keep_from[b]`` (int32 ``[max_seqs]``): a sliding-window layer group's pages once no
    query of the row can see them again. Their block-table cells become the sentinel and their
    ref counts drop, so a page nobody else holds (a forked sibling, the prefix index) is free
    in the returned table, inside the same jitted step; the row's length is unchanged::

        window 6, page 4, lengths[b] = 14, next query at 14 sees keys 9..14: keep_from = 9
        row b: [ 4, 1, 7, 2 ]  ->  [ S, S, 7, 2 ]   (keys 0..7 are out of every future window)

    One pass over the block tables. Returns ``(table, released)``: int32 ``[max_seqs]`` cells
    each row gave up (0 for a row with nothing before ``keep_from``).
    """
    # Never past the row's end: a partial last page stays while the row can write into it.
    keep_from = jnp.minimum(jnp.asarray(keep_from, jnp.int32), table.lengths)
    block = jnp.arange(table.max_pages_per_seq, dtype=jnp.int32)[None, :]
    dead = ((block < (keep_from // table.page_size)[:, None]) & table.active[:, None]
            & (table.block_tables != table.sentinel))
    dropped = jnp.where(dead, table.block_tables, table.num_pages + 1)
    return dataclasses.replace(
        table, ref_counts=table.ref_counts.at[dropped].add(-1, mode="drop"),
        block_tables=jnp.where(dead, table.sentinel, table.block_tables)
    ), jnp.sum(dead, axis=1, dtype=jnp.int32)


def pages_referenced(table: PageTable) -> jax.Array:
    """int32 ``[max_seqs]``: block-table cells each row points at a real page. Equals
    :meth:`PageTable.pages_held` (``ceil(lengths / page_size)``) until :func:`slide` drops a
    row's leading pages; a window group's rows hold this many."""
    return jnp.sum(table.block_tables != table.sentinel, axis=1, dtype=jnp.int32)


def retain(table: PageTable, pages: jax.Array, delta: int = 1) -> PageTable:
    """Adds ``delta`` references to each page in ``pages`` (int32 ``[n]``; ids past the pool are
    ignored): how an external holder such as a prefix index keeps pages alive."""
    return dataclasses.replace(
        table, ref_counts=table.ref_counts.at[pages].add(delta, mode="drop"))


def slot_mapping(table: PageTable, positions: jax.Array,
                 rows: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Where each token is stored: positions int32 ``[batch, t]`` (-1 = padding) of table rows
    ``rows`` (int32 ``[batch]``; None = all rows in order) -> ``(pages, offsets)`` int32
    ``[batch, t]``; padding and unreserved positions map to the sentinel page, which nobody
    reads."""
    block_tables, lengths = table.block_tables, table.lengths
    if rows is not None:
        block_tables, lengths = block_tables[rows], lengths[rows]
    valid = positions >= 0
    block = jnp.where(valid, positions // table.page_size, 0)
    pages = jnp.take_along_axis(block_tables, jnp.clip(block, 0, table.max_pages_per_seq - 1),
                                axis=1)
    reserved = valid & (positions < lengths[:, None])
    pages = jnp.where(reserved, pages, table.sentinel)
    return pages, jnp.where(valid, positions % table.page_size, 0)
