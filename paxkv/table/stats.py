"""Accounting over a page table: how full the pool is and what sharing saves.

Pure, jit-able reads of a :class:`paxkv.table.page_table.PageTable` (which re-exports them as
``page_table.stats`` / ``page_table.sharing_stats``); nothing here changes a table.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from paxkv.table.state import PageTable


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TableStats:
    """Pool-wide accounting (all int32 scalars except the fraction)."""

    free_pages: jax.Array
    used_pages: jax.Array
    shared_pages: jax.Array
    tokens_held: jax.Array
    slots_filled: jax.Array
    internal_fragmentation: jax.Array  # float32: empty slots in used pages / their slots
    active_seqs: jax.Array


def stats(table: PageTable) -> TableStats:
    """Free / used / shared pages, tokens held and internal fragmentation.

    ``slots_filled`` counts each physical slot once however many sequences share it, so the
    fragmentation figure is about memory, not logical tokens.
    """
    ps = table.page_size
    m = jnp.arange(table.max_pages_per_seq, dtype=jnp.int32)[None, :]
    fill = jnp.clip(table.lengths[:, None] - m * ps, 0, ps)  # tokens in cell (b, m)
    page_fill = jnp.zeros((table.num_pages,), jnp.int32).at[table.block_tables].max(
        fill, mode="drop")
    used = jnp.sum(table.ref_counts > 0)
    filled = jnp.sum(page_fill)
    return TableStats(
        free_pages=table.num_pages - used, used_pages=used,
        shared_pages=jnp.sum(table.ref_counts > 1),
        tokens_held=jnp.sum(table.lengths), slots_filled=filled,
        internal_fragmentation=_fragmentation(filled, used * ps),
        active_seqs=jnp.sum(table.active))


def _fragmentation(filled: jax.Array, capacity: jax.Array) -> jax.Array:
    """float32: the share of ``capacity`` slots (of pages in use) that hold no token."""
    return jnp.where(capacity > 0, 1.0 - filled / jnp.maximum(capacity, 1),
                     0.0).astype(jnp.float32)


def total(s: TableStats, page_size: int) -> TableStats:
    """One table's accounting from per-shard stats (each field ``[data]``, one entry per
    data shard's table): counts summed, fragmentation over all shards' used pages."""
    used, filled = jnp.sum(s.used_pages), jnp.sum(s.slots_filled)
    return TableStats(
        free_pages=jnp.sum(s.free_pages), used_pages=used,
        shared_pages=jnp.sum(s.shared_pages), tokens_held=jnp.sum(s.tokens_held),
        slots_filled=filled, internal_fragmentation=_fragmentation(filled, used * page_size),
        active_seqs=jnp.sum(s.active_seqs))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SharingStats:
    """Who shares what (int32).

    Attributes:
      pages_held: ``[max_seqs]``: pages each row references.
      shared_held: ``[max_seqs]``: of those, pages with another holder too (a row or an
        external holder such as the prefix index).
      row_references: scalar: block-table entries over all rows, i.e. the pages the rows
        would use if nothing were shared.
      row_pages: scalar: distinct pages the rows reference.
    """

    pages_held: jax.Array
    shared_held: jax.Array
    row_references: jax.Array
    row_pages: jax.Array


def sharing_stats(table: PageTable) -> SharingStats:
    """Per-row shared pages and what sharing saves (see :class:`SharingStats`)."""
    blocks = jnp.arange(table.max_pages_per_seq, dtype=jnp.int32)[None, :]
    cells = ((blocks < table.pages_held()[:, None])  # a slid row's released cells: sentinel
             & (table.block_tables != table.sentinel))
    held = jnp.sum(cells, axis=1, dtype=jnp.int32)
    refs = jnp.take(table.ref_counts, table.block_tables, mode="fill", fill_value=0)
    row_refs = jnp.zeros((table.num_pages,), jnp.int32).at[
        jnp.where(cells, table.block_tables, table.num_pages + 1)].add(1, mode="drop")
    return SharingStats(pages_held=held, shared_held=jnp.sum(cells & (refs > 1), axis=1),
                        row_references=jnp.sum(held), row_pages=jnp.sum(row_refs > 0))


def total_sharing(s: SharingStats) -> SharingStats:
    """Per-shard sharing stats (per-row fields ``[data, rows_per_shard]``, totals ``[data]``)
    as one table's: rows in global order (shard-major), totals summed."""
    return SharingStats(pages_held=s.pages_held.reshape(-1),
                        shared_held=s.shared_held.reshape(-1),
                        row_references=jnp.sum(s.row_references),
                        row_pages=jnp.sum(s.row_pages))
