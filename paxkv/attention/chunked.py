"""Paged attention for the CPU (XLA) path, in pieces that stay in cache.

Decode runs over a ragged list of fixed-size chunks; prefill runs one (row, query tile) at a
time in :mod:`paxkv.attention.query_tiles`.

The per-row form (:func:`paxkv.attention.blocks.attend_blocks` over gathered pages) pads every
row to one window, the longest row's, and runs the whole batch as one pass over arrays larger
than a CPU's cache. Both cost more than the arithmetic: at batch 32 with rows of 128-576 tokens
a 768-token window reads 2.1x the live keys, and a batch of 64 rows x 512 tokens (25 MB of keys
per layer) runs 2x slower as one pass than as two halves one after the other (the second half
finds the pool's pages and the products' buffers still in cache). So decode attention here is
split the way flash-decoding splits a GPU kernel's work:

* **Work list.** Each live row's keys from ``start_page`` on are cut into chunks of
  ``chunk_pages`` pages; chunk ``j`` of the flat list belongs to row ``row[j]``. The list has a
  static length ``num_chunks`` (a bucket the caller picks from the rows' lengths, so a handful of
  shapes compile); chunks past the real total are padding and read nothing that matters. The
  work is the live keys rounded up to a chunk per row, not rows x window::

      row 0: 300 tokens  -> chunks (0, 0) (0, 1) (0, 2)          span = chunk_pages * page_size
      row 1: 100 tokens  -> chunk  (1, 0)                        (here 128 tokens)
      row 2: idle        -> none
      flat list: [(0,0), (0,1), (0,2), (1,0), pad, pad, ...]      num_chunks static

* **Tiles.** On a CPU (:func:`tiles_pay`) the list runs ``tile_chunks`` chunks at a time under
  ``lax.map``, so each gather and its two products work on a few MB that stay in cache. A
  tile's keys are gathered already transposed for the score product (:func:`keys_partial`).
* **Merge.** Each chunk yields a softmax partial (max, sum of exponentials, unnormalised output);
  a row's partials are merged with ``segment_max`` / ``segment_sum`` (log-sum-exp rescaling), so
  the result equals one softmax over the row's keys. A caller with more partials for the same
  rows (cascade attention's shared pages) merges them with :func:`merge`.

Masking follows :mod:`paxkv.attention.blocks`: keys past a row's length are excluded with
``where`` (never multiplied by zero), so NaN in free pages or behind table padding cannot reach
an output, and everything accumulates in float32. Scores take the model's settings
(``sm_scale``, ``logit_soft_cap``) through :func:`paxkv.attention.blocks.scale_scores`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.kv_storage import read_pages
from paxkv.attention.blocks import default_sm_scale, in_window
from paxkv.attention.partials import (Partial, finish, finite, keys_partial, merge,  # noqa: F401
                                      read_in_range)
from paxkv.core.plan import chunks_needed, list_shape  # noqa: F401  (the list's arithmetic)


class ChunkWork(NamedTuple):
    """The flat work list (all int32 / bool ``[num_chunks]`` but ``total``).

    Attributes:
      row: the row each chunk belongs to (clipped into range for padding chunks).
      first_page: the chunk's first block-table column.
      valid: False for padding chunks past the total.
      total: int32 scalar: chunks the rows need (``> num_chunks``: the list is too short).
    """

    row: jax.Array
    first_page: jax.Array
    valid: jax.Array
    total: jax.Array


def tiles_pay() -> bool:
    """Whether to run attention in cache-sized tiles: on a CPU, yes; a GPU runs ``lax.map``'s
    iterations one after the other and wants one wide pass (its own path is the Pallas
    kernels; the XLA path there is a comparison)."""
    return jax.default_backend() == "cpu"


def chunk_work(lengths: jax.Array, live: jax.Array, *, start_page: int, page_size: int,
               chunk_pages: int, num_chunks: int) -> ChunkWork:
    """The work list of live rows (see the module docstring).

    Args:
      lengths: int32 ``[b]``: tokens in each row's context.
      live: bool ``[b]``: rows that attend this step (idle rows get no chunk).
      start_page: the first block-table column the list covers (cascade attention reads the
        columns before it once for all rows).
      num_chunks: static length of the list.
    """
    batch = lengths.shape[0]
    per_row = jnp.where(live, chunks_needed(lengths, start_page=start_page, page_size=page_size,
                                            chunk_pages=chunk_pages), 0).astype(jnp.int32)
    ends = jnp.cumsum(per_row)
    j = jnp.arange(num_chunks, dtype=jnp.int32)
    # compare_all: one [num_chunks, b] comparison; the default method is a while loop, which
    # runs again in every layer (XLA does not hoist it out of the layer scan).
    row = jnp.searchsorted(ends, j, side="right", method="compare_all")
    row = jnp.minimum(row, batch - 1).astype(jnp.int32)
    index_in_row = j - (ends[row] - per_row[row])
    return ChunkWork(row=row, first_page=start_page + index_in_row * chunk_pages,
                     valid=j < ends[-1], total=ends[-1])


def chunk_partials(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                   block_tables: jax.Array, lengths: jax.Array, work: ChunkWork, *,
                   chunk_pages: int, tile_chunks: int, sm_scale: float,
                   logit_soft_cap: float | None = None, window: jax.Array | None = None,
                   layer: jax.Array | None = None, scales: jax.Array | None = None) -> Partial:
    """Softmax partials of every row's chunks, merged per row.

    Args:
      q: ``[b, num_q_heads, head_dim]``: one query per row, at position ``lengths - 1``.
      k_pages, v_pages: ``[num_pages, kv_heads, page_size, head_dim]``, or a whole pool
        ``[num_layers, num_pages, ...]`` with ``layer`` (indexed inside the gather: slicing a
        layer out first would copy it); any float dtype, or bfloat16 bits
        (:mod:`pallas_kernels.kv_storage`), or 8-bit codes with ``scales``.
      block_tables: int32 ``[b, pages_per_row]``.
      lengths: int32 ``[b]``.
      work: from :func:`chunk_work`; ``num_chunks`` must be a multiple of ``tile_chunks``.
      sm_scale, logit_soft_cap: the model's score settings
        (:func:`paxkv.attention.blocks.scale_scores`).
      window: int32 scalar or None: the query sees only the row's last ``window`` keys.
      scales: float32 ``[(num_layers,) num_pages, kv_heads, 2, page_size]`` of codes
        (:class:`paxkv.cache.pool.KVPool`), else None: each tile is dequantised in its gather.

    Returns:
      the rows' :class:`Partial` (rows without chunks: max -inf, zeros).
    """
    q, k_pages, v_pages, block_tables, lengths = map(
        jnp.asarray, (q, k_pages, v_pages, block_tables, lengths))
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = k_pages.shape[-3], k_pages.shape[-2]
    group = num_q_heads // num_kv_heads
    num_chunks = work.row.shape[0]
    if num_chunks % tile_chunks:
        raise ValueError(f"num_chunks ({num_chunks}) must be a multiple of tile_chunks "
                         f"({tile_chunks})")
    q_grouped = q.reshape(batch, num_kv_heads, group, head_dim)
    slot = jnp.arange(chunk_pages)[:, None] * page_size + jnp.arange(page_size)[None]  # [c, s]

    def tile(args: tuple[jax.Array, ...]) -> Partial:
        row, first, valid = args  # [T]
        pages = tile_pages(block_tables, row, first, chunk_pages)
        key_pos = first[:, None, None] * page_size + slot[None]  # [T, c, s]
        key_live = (key_pos < lengths[row][:, None, None]) & valid[:, None, None]
        if window is not None:  # the query sits at lengths - 1
            key_live &= in_window(key_pos, lengths[row][:, None, None] - 1, window)

        k, v = read_kv(k_pages, v_pages, scales, pages, layer)  # [T, c, k, s, d] each
        n = k.shape[0]
        # One transpose each (two in a row fuse into a copy that runs 2x slower here).
        k_t = k.transpose(0, 2, 4, 1, 3).reshape(n, num_kv_heads, head_dim, -1)  # [T, k, d, cs]
        v = v.transpose(0, 2, 1, 3, 4).reshape(n, num_kv_heads, -1, head_dim)  # [T, k, cs, d]
        return keys_partial(q_grouped[row], k_t, v, key_live.reshape(n, -1), sm_scale=sm_scale,
                            logit_soft_cap=logit_soft_cap)

    tiles = num_chunks // tile_chunks
    split = lambda x: x.reshape((tiles, tile_chunks) + x.shape[1:])  # noqa: E731
    parts = lax.map(tile, (split(work.row), split(work.first_page), split(work.valid)))
    parts = jax.tree.map(lambda x: x.reshape((num_chunks,) + x.shape[2:]), parts)
    return _merge_rows(parts, work, batch)


def _merge_rows(parts: Partial, work: ChunkWork, batch: int) -> Partial:
    """The chunks' partials (``[num_chunks, ...]``) -> each row's (``[batch, ...]``): one
    log-sum-exp merge per row with ``segment_max`` / ``segment_sum``; padding chunks go to an
    extra segment that is dropped."""
    segment = jnp.where(work.valid, work.row, batch)
    seg = dict(segment_ids=segment, num_segments=batch + 1, indices_are_sorted=True)
    row_max = jax.ops.segment_max(parts.max, **seg)[:batch]
    scale = jnp.exp(parts.max - finite(row_max)[jnp.minimum(segment, batch - 1)])
    scale = jnp.where(jnp.isfinite(parts.max), scale, 0.0)
    return Partial(row_max,
                   jax.ops.segment_sum(scale * parts.sum, **seg)[:batch],
                   jax.ops.segment_sum(scale[..., None] * parts.out, **seg)[:batch])


def tile_pages(block_tables: jax.Array, row: jax.Array, first: jax.Array,
               chunk_pages: int) -> jax.Array:
    """The page ids of a tile's chunks: int32 ``[T, chunk_pages]`` from ``block_tables``
    ``[b, width]`` and the chunks' rows and first columns (``[T]`` each; columns past the
    window read its last entry, behind the row's length). Materialised: fused into the K/V
    copies, their arithmetic would run once per copied element."""
    cols = jnp.minimum(first[:, None] + jnp.arange(chunk_pages)[None], block_tables.shape[1] - 1)
    return lax.optimization_barrier(jnp.take_along_axis(block_tables[row], cols, axis=1))


def read_kv(k_pages: jax.Array, v_pages: jax.Array, scales: jax.Array | None,
            pages: jax.Array, layer: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """K and V of the pages ``pages`` (any shape ``[...]``) of one layer's pool, or of layer
    ``layer`` of a whole pool, as attention reads them: ``[..., kv_heads, page_size,
    head_dim]`` each (:func:`pallas_kernels.kv_storage.readable`; codes times their gathered scales)."""
    index = (pages,) if layer is None else (layer, pages)
    return read_pages(k_pages, v_pages, scales, index, lambda x, i: read_in_range(x, *i))


def paged_decode_attention_chunked(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    num_chunks: int,
    chunk_pages: int,
    tile_chunks: int,
    sm_scale: float | None = None,
    logit_soft_cap: float | None = None,
    layer: jax.Array | None = None,
    scales: jax.Array | None = None,
) -> jax.Array:
    """:func:`pallas_kernels.reference.paged_decode_attention_reference` as a chunk list.

    Args:
      q: ``[b, num_q_heads, head_dim]``.
      k_pages, v_pages: ``[num_pages, kv_heads, page_size, head_dim]`` (or a pool with
        ``layer``).
      block_tables: int32 ``[b, pages_per_row]``; lengths: int32 ``[b]`` (0: idle row).
      num_chunks: static list length, a multiple of ``tile_chunks``; it must cover
        ``sum(chunks_needed(lengths))`` (callers that cannot promise it check
        ``chunk_work(...).total`` first, as :mod:`paxkv.cache.paged` does).
      sm_scale: the softmax scale (None: ``head_dim ** -0.5``); logit_soft_cap: None (off) or
        the Gemma-2 cap (:func:`paxkv.attention.blocks.scale_scores`).
      scales: the pages' scales when they hold 8-bit codes (:func:`chunk_partials`).

    Returns:
      ``[b, num_q_heads, head_dim]`` in ``q.dtype``.
    """
    page_size = k_pages.shape[-2]
    lengths = jnp.asarray(lengths)
    work = chunk_work(lengths, lengths > 0, start_page=0, page_size=page_size,
                      chunk_pages=chunk_pages, num_chunks=num_chunks)
    parts = chunk_partials(q, k_pages, v_pages, block_tables, lengths, work,
                           chunk_pages=chunk_pages, tile_chunks=tile_chunks,
                           sm_scale=default_sm_scale(q.shape[-1], sm_scale),
                           logit_soft_cap=logit_soft_cap, layer=layer, scales=scales)
    return finish(parts, q.dtype)
