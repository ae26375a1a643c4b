"""Rows that point at pages already stored: beam search's reorder and a prefix-cache hit's
attach. Neither copies KV; each moves block-table cells and ref counts only, in one pass over
the table, and follows :mod:`paxkv.table.page_table`'s rules (pure, jit-able, a per-row ``ok`` flag,
failed rows left bit-identical). Re-exported from :mod:`paxkv.table.page_table`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from paxkv.core.buckets import cdiv
from paxkv.table.state import PageTable


def reorder(table: PageTable, parents: jax.Array) -> tuple[PageTable, jax.Array]:
    """Row ``b`` becomes a copy of row ``parents[b]`` (beam search's reorder), moving only
    block-table rows and ref counts: no KV is copied. A row may be the parent of several rows
    or of none; rows with ``parents[b] == -1`` (or an inactive parent) are released.

    Args:
      parents: int32 ``[max_seqs]``.

    Returns:
      ``(table, ok)``: ``ok`` bool ``[max_seqs]`` marks rows that now copy an active parent.
      Pages no longer referenced are free in the returned table.
    """
    parents = jnp.asarray(parents, jnp.int32)
    s, oob = table.max_seqs, table.num_pages + 1
    p = jnp.clip(parents, 0, s - 1)
    ok = (parents >= 0) & (parents < s) & table.active[p]
    block_tables = jnp.where(ok[:, None], table.block_tables[p], table.sentinel)
    gained = jnp.where(ok[:, None], block_tables, oob)
    lost = jnp.where(table.active[:, None], table.block_tables, oob)
    ref_counts = (table.ref_counts.at[gained].add(1, mode="drop")
                  .at[lost].add(-1, mode="drop"))
    return dataclasses.replace(
        table, block_tables=block_tables, ref_counts=ref_counts,
        lengths=jnp.where(ok, table.lengths[p], 0), active=ok), ok


def attach(table: PageTable, rows: jax.Array, pages: jax.Array, lengths: jax.Array,
           first: jax.Array | None = None) -> tuple[PageTable, jax.Array]:
    """Each inactive ``rows[i]`` becomes a sequence of ``lengths[i]`` tokens already stored in
    pages that someone holds (a prefix-cache hit): no KV moves, the pages' ref counts go up.

    A partly filled last page stays shared until the row's first write copies it
    (:func:`paxkv.table.page_table.reserve`), so a hit may end mid-page::

        pages[i] = [ 4, 9, 1 ]   lengths[i] = 37, page_size 16  ->  row: [4, 9, 1, S, ...]
                                 slots 32..36 of page 1 are the row's; 37.. belong to others

    Args:
      rows: int32 ``[k]`` row ids.
      pages: int32 ``[k, w]`` (``w <= max_pages_per_seq``): the row's first pages in order;
        cells from ``ceil(lengths[i] / page_size)`` on are ignored.
      lengths: int32 ``[k]``.
      first: int32 ``[k]`` (default 0): the row's first held block. A sliding-window group's
        row holds only its window's pages (:func:`paxkv.table.page_table.slide`), so a hit
        attaches there with leading sentinels: cells before ``first[i]`` are ignored.

    Returns:
      ``(table, ok)``: ``ok[i]`` is True when the row was in range, inactive and named once,
      ``1 <= lengths[i] <= max_len``, and every page it needs is a real page with a holder;
      failed pairs change nothing.
    """
    rows = jnp.asarray(rows, jnp.int32)
    pages = jnp.asarray(pages, jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    s, w, oob = table.max_seqs, pages.shape[1], table.num_pages + 1
    if w > table.max_pages_per_seq:
        raise ValueError(f"pages has {w} columns but a row holds at most "
                         f"{table.max_pages_per_seq}")
    in_range = (rows >= 0) & (rows < s)
    r = jnp.clip(rows, 0, s - 1)
    uses = jnp.zeros((s,), jnp.int32).at[jnp.where(in_range, r, s)].add(1, mode="drop")
    first = jnp.zeros_like(lengths) if first is None else jnp.asarray(first, jnp.int32)
    block = jnp.arange(w, dtype=jnp.int32)[None, :]
    used = (block >= first[:, None]) & (block < cdiv(lengths, table.page_size)[:, None])
    real = (pages >= 0) & (pages < table.num_pages)
    held = jnp.take(table.ref_counts, jnp.clip(pages, 0, table.num_pages - 1)) > 0
    ok = (in_range & ~table.active[r] & (uses[r] == 1) & (lengths >= 1) & (first >= 0)
          & (first < cdiv(lengths, table.page_size))
          & (lengths <= jnp.minimum(table.max_len, w * table.page_size))
          & jnp.all(~used | (real & held), axis=1))
    cells = jnp.where(used, pages, table.sentinel)
    row_cells = jnp.full((rows.shape[0], table.max_pages_per_seq), table.sentinel, jnp.int32)
    row_cells = row_cells.at[:, :w].set(cells)
    target = jnp.where(ok, r, s)  # failed pairs scatter out of range and are dropped
    gained = jnp.where(ok[:, None] & used, pages, oob)
    return dataclasses.replace(
        table, block_tables=table.block_tables.at[target].set(row_cells, mode="drop"),
        ref_counts=table.ref_counts.at[gained].add(1, mode="drop"),
        lengths=table.lengths.at[target].set(lengths, mode="drop"),
        active=table.active.at[target].set(True, mode="drop")), ok
