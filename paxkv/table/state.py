"""The page table's state: :class:`PageTable` (a frozen pytree with static sizes) and an
empty one. The operations on it live in :mod:`paxkv.table.page_table`, :mod:`~paxkv.table.share`
and :mod:`~paxkv.table.stats`; each imports this module, and nothing here imports them."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from paxkv.core.buckets import cdiv


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["block_tables", "lengths", "ref_counts", "active"],
                   meta_fields=["page_size", "num_pages"])
@dataclasses.dataclass(frozen=True)
class PageTable:
    """Block tables, lengths, ref counts and active rows; sizes are static.

    Attributes:
      block_tables: int32 ``[max_seqs, max_pages_per_seq]``; padding = ``num_pages`` (sentinel).
      lengths: int32 ``[max_seqs]``: tokens each sequence holds (reserved slots included).
      ref_counts: int32 ``[num_pages]``: holders of each page; 0 means free.
      active: bool ``[max_seqs]``: rows in use.
      page_size: tokens per page (static).
      num_pages: real pages in the pool (static); the pool has one more, the sentinel.
    """

    block_tables: jax.Array
    lengths: jax.Array
    ref_counts: jax.Array
    active: jax.Array
    page_size: int
    num_pages: int

    @property
    def max_seqs(self) -> int:
        return self.block_tables.shape[0]

    @property
    def max_pages_per_seq(self) -> int:
        return self.block_tables.shape[1]

    @property
    def sentinel(self) -> int:
        return self.num_pages

    @property
    def max_len(self) -> int:
        return self.max_pages_per_seq * self.page_size

    def pages_held(self) -> jax.Array:
        """int32 ``[max_seqs]``: each row's logical blocks, ``ceil(lengths / page_size)``: the
        pages it references until :func:`paxkv.table.page_table.slide` drops its leading ones
        (:func:`paxkv.table.page_table.pages_referenced` counts those left)."""
        return cdiv(self.lengths, self.page_size)


def create(*, num_pages: int, page_size: int, max_seqs: int,
           max_pages_per_seq: int) -> PageTable:
    """An empty table: every page free, every row inactive."""
    for name, value in (("num_pages", num_pages), ("page_size", page_size),
                        ("max_seqs", max_seqs), ("max_pages_per_seq", max_pages_per_seq)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    return PageTable(
        block_tables=jnp.full((max_seqs, max_pages_per_seq), num_pages, jnp.int32),
        lengths=jnp.zeros((max_seqs,), jnp.int32),
        ref_counts=jnp.zeros((num_pages,), jnp.int32),
        active=jnp.zeros((max_seqs,), bool),
        page_size=page_size, num_pages=num_pages)
