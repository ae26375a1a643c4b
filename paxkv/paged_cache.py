"""The paged KV cache: a page pool plus a page table, behind the cache protocol.

The model calls :meth:`PagedCache.attend` once per layer; decode loops call ``reserve``,
``release`` and ``fork``. Every method returns a new cache (and a status where it can fail);
inside ``jax.jit`` with the cache donated the pool is updated in place.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from paxkv.attention import chunked
from paxkv.kv_storage import is_bits
from paxkv.attention.blocks import (attend_blocks, attend_blocks_with_prefix,
                                     attend_shared_pages, default_sm_scale)
from paxkv import page_table as pt
from paxkv import pool as kv_pool
from paxkv.step_info import StepInfo


@functools.partial(jax.tree_util.register_dataclass, data_fields=["pool", "table"],
                   meta_fields=["scrub", "window_pages", "prefix_pages", "decode_chunks"])
@dataclasses.dataclass(frozen=True)
class PagedCache:
    """Paged KV for ``max_seqs`` sequences.

    Attributes:
      pool: the K/V pages of every layer.
      table: block tables, lengths, ref counts.
      scrub: zero pages when they are handed out (static).
      window_pages: static bound on the pages attention reads per row (a context bucket: the
        XLA path gathers only this many table columns); None reads the whole row.
      prefix_pages: static hint that every live row's first ``prefix_pages`` table columns are
        the same pages (a shared system prompt, the prompt of beams or samples). The XLA path
        then checks it inside the step and, when it holds, reads those pages once for all rows
        (:func:`attend_blocks_with_prefix`); when it does not, it attends as without the hint.
        0: no hint.
      decode_chunks: static hint that a decode step's live rows need at most this many
        chunks of :data:`CHUNK_TOKENS` past the shared prefix (the XLA decode path's work list,
        :mod:`paxkv.attention.chunked`); the step checks it and falls back to every row's whole
        window when it does not hold. None: size the list for every row's whole window.
    """

    pool: kv_pool.KVPool
    table: pt.PageTable
    scrub: bool = True
    window_pages: int | None = None
    prefix_pages: int = 0
    decode_chunks: int | None = None

    # -- the cache protocol -------------------------------------------------------------
    @property
    def lengths(self) -> jax.Array:
        return self.table.lengths

    @property
    def active(self) -> jax.Array:
        return self.table.active

    @property
    def max_seqs(self) -> int:
        return self.table.max_seqs

    @property
    def max_len(self) -> int:
        return self.table.max_len

    def reserve(self, num_new: jax.Array, *, max_new: int) -> tuple["PagedCache", jax.Array]:
        """Room for ``num_new`` int32 ``[max_seqs]`` more tokens; ``ok`` bool ``[max_seqs]``."""
        table, update, ok = pt.reserve(self.table, num_new, max_new=max_new)
        pool = kv_pool.apply(self.pool, update, scrub=self.scrub)
        return dataclasses.replace(self, pool=pool, table=table), ok

    def release(self, rows: jax.Array) -> tuple["PagedCache", jax.Array]:
        """Frees rows (bool ``[max_seqs]``); their unshared pages are free at once."""
        table, ok = pt.release(self.table, rows)
        return dataclasses.replace(self, table=table), ok

    def fork(self, parents: jax.Array, children: jax.Array) -> tuple["PagedCache", jax.Array]:
        """Children share their parents' pages (no KV copied); ``ok`` bool ``[k]``."""
        table, ok = pt.fork(self.table, parents, children)
        return dataclasses.replace(self, table=table), ok

    def reorder(self, parents: jax.Array) -> tuple["PagedCache", jax.Array]:
        """Row ``b`` continues row ``parents[b]`` (int32 ``[max_seqs]``, -1 = drop): block-table
        rows and ref counts move, KV stays put (beam search)."""
        table, ok = pt.reorder(self.table, parents)
        return dataclasses.replace(self, table=table), ok

    def with_window(self, max_tokens: int | None) -> "PagedCache":
        """The same cache, attention reading at most ``max_tokens`` per row (static)."""
        pages = None if max_tokens is None else min(
            self.table.max_pages_per_seq, -(-max_tokens // self.table.page_size))
        return dataclasses.replace(self, window_pages=pages)

    def with_shared_prefix(self, num_pages: int) -> "PagedCache":
        """The same cache with the ``prefix_pages`` hint (static; see the class docstring)."""
        return dataclasses.replace(self, prefix_pages=max(0, int(num_pages)))

    def with_decode_chunks(self, num_chunks: int | None) -> "PagedCache":
        """The same cache with the ``decode_chunks`` hint, rounded up to the work list's
        length (:func:`paxkv.attention.chunked.list_shape`, so nearby counts share a compiled
        step); static, see the class docstring. A hint no shorter than every row's whole
        window (after the shared prefix) is dropped: it would change nothing but the compile
        cache's key (set the window and the shared prefix first)."""
        if num_chunks is not None:
            num_chunks = chunked.list_shape(num_chunks, TILE_CHUNKS)[0]
            pages = self.window_pages or self.table.max_pages_per_seq
            chunk = min(pages, self.chunk_pages)
            if num_chunks >= self.max_seqs * -(-(pages - self.prefix_pages) // chunk):
                num_chunks = None
        return dataclasses.replace(self, decode_chunks=num_chunks)

    @property
    def chunk_pages(self) -> int:
        """Pages per chunk of the XLA decode path's work list (:data:`CHUNK_TOKENS` tokens)."""
        return max(1, CHUNK_TOKENS // self.table.page_size)

    def stats(self) -> pt.TableStats:
        return pt.stats(self.table)

    def attend(self, layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
               step: StepInfo, *, impl: str = "xla") -> tuple["PagedCache", jax.Array]:
        """Writes this step's K/V for ``layer`` into their slots, then attends.

        Args:
          q: ``[batch, t, num_q_heads, head_dim]``; k, v: ``[batch, t, num_kv_heads, head_dim]``.
          step: positions of the tokens (``lengths`` must match the table after ``reserve``).
          impl: "xla" (gather + einsum reference) or "pallas" (the GPU kernels).
        Returns:
          ``(cache, out)`` with out ``[batch, t, num_q_heads, head_dim]``.
        """
        pages, offsets = pt.slot_mapping(self.table, step.positions, step.rows)
        block_tables = self.table.block_tables
        if step.rows is not None:
            block_tables = block_tables[step.rows]
        if self.window_pages is not None:
            block_tables = block_tables[:, : self.window_pages]
        if impl == "pallas":
            if is_bits(self.pool.k):
                raise ValueError(
                    "the Pallas kernels read typed pools; this pool stores bfloat16 K/V as bits "
                    "(a CPU pool, paxkv.kv_storage): use attention_impl='xla' here, or "
                    "kv_dtype=jnp.float32 to test the kernels")
            pool, out = _pallas_attend(self.pool, layer, q, k, v, pages, offsets, block_tables,
                                       step)
        elif impl == "xla":
            pool = kv_pool.write(self.pool, layer, k, v, pages, offsets)
            if q.shape[1] == 1:
                out = _xla_decode(pool, layer, q[:, 0], block_tables, step, self.prefix_pages,
                                  self.decode_chunks, self.table.page_size)[:, None]
            else:
                out = _xla_attend(pool, layer, q, block_tables, step, self.prefix_pages,
                                  self.table.page_size)
        else:
            raise ValueError(f"attention impl must be 'xla' or 'pallas', got {impl!r}")
        return dataclasses.replace(self, pool=pool), out


def prefix_bucket(num_pages: int) -> int:
    """The largest of 0, 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (powers of two and 1.5 x powers of
    two) <= ``num_pages``: callers round a shared-prefix hint down to it, so a changing prefix
    length compiles a handful of steps, not one per length."""
    if num_pages < 1:
        return 0
    p = 1 << (int(num_pages).bit_length() - 1)
    return int(3 * p // 2 if p >= 2 and 3 * p // 2 <= num_pages else p)


def _xla_attend(pool: kv_pool.KVPool, layer: jax.Array, q: jax.Array, block_tables: jax.Array,
                step: StepInfo, prefix_pages: int, page_size: int) -> jax.Array:
    """Gather + masked einsum over ``block_tables`` ``[b, window]``; with a ``prefix_pages``
    hint that holds this step, the shared pages are read once (cascade) instead of per row."""
    sm_scale = default_sm_scale(q.shape[-1], None)

    def per_row() -> jax.Array:
        if chunked.tiles_pay():
            return chunked.attend_in_query_tiles(q, pool.k, pool.v, block_tables,
                                                 step.positions, step.lengths,
                                                 sm_scale=sm_scale, layer=layer)
        return attend_blocks(q, *pool.read(layer, block_tables), step.positions, step.lengths,
                             sm_scale=sm_scale)

    if not 0 < prefix_pages < block_tables.shape[1]:
        return per_row()
    live = step.query_lengths > 0
    shared = block_tables[jnp.argmax(live), :prefix_pages]  # the first live row's prefix

    def cascade() -> jax.Array:
        rest = block_tables[:, prefix_pages:]
        return attend_blocks_with_prefix(q, *pool.read(layer, shared), *pool.read(layer, rest),
                                         step.positions, step.lengths, sm_scale=sm_scale)

    holds = _prefix_holds(block_tables, shared, live, step.positions, prefix_pages * page_size)
    return lax.cond(holds, cascade, per_row)


# The XLA decode path's work list (paxkv.attention.chunked): chunks of 128 tokens, 32 chunks a
# tile (K + V of a tile: 32 x 128 x kv_heads x head_dim x 8 bytes = 6 MB at SmolLM2's 3 x 64 in
# float32). 16 chunks kept the copies in L2 but ran the small products 10-20% slower in all.
CHUNK_TOKENS = 128
TILE_CHUNKS = 32


def decode_chunk_pages(width: int, page_size: int) -> int:
    """Pages per chunk of the XLA decode path over a ``width``-page window:
    :attr:`PagedCache.chunk_pages`, or the whole window when it is shorter (a chunk never reads
    past the window; either way a row within the window is one chunk, so a hint stays valid)."""
    return min(width, max(1, CHUNK_TOKENS // page_size))


def _xla_decode(pool: kv_pool.KVPool, layer: jax.Array, q: jax.Array, block_tables: jax.Array,
                step: StepInfo, prefix_pages: int, decode_chunks: int | None,
                page_size: int) -> jax.Array:
    """One query per row ``q [b, heads, d]`` -> ``[b, heads, d]`` through the chunk list.

    With a ``prefix_pages`` hint that holds, the shared pages are one product for all rows
    (cascade) and the list covers only the rest; with a ``decode_chunks`` hint that holds, the
    list is that long instead of every row's whole window. When a hint does not hold this step,
    the list covers every row's whole window from its first page (always enough)."""
    batch, width = block_tables.shape
    sm_scale = default_sm_scale(q.shape[-1], None)
    chunk_pages = decode_chunk_pages(width, page_size)
    live = step.query_lengths > 0
    cascade = 0 < prefix_pages < width
    start = prefix_pages if cascade else 0

    def partials(start_page: int, needed: int) -> chunked.Partial:
        num_chunks, tile = chunked.list_shape(needed, TILE_CHUNKS)
        if not chunked.tiles_pay():
            tile = num_chunks
        work = chunked.chunk_work(step.lengths, live, start_page=start_page,
                                  page_size=page_size, chunk_pages=chunk_pages,
                                  num_chunks=num_chunks)
        return chunked.chunk_partials(q, pool.k, pool.v, block_tables, step.lengths, work,
                                      chunk_pages=chunk_pages, tile_chunks=tile,
                                      sm_scale=sm_scale, layer=layer)

    def whole_rows(start_page: int) -> int:
        return batch * -(-(width - start_page) // chunk_pages)

    def safe() -> jax.Array:
        return chunked.finish(partials(0, whole_rows(0)), q.dtype)

    hinted = decode_chunks is not None and decode_chunks < whole_rows(start)
    if not (cascade or hinted):
        return safe()
    shared = block_tables[jnp.argmax(live), :prefix_pages]  # the first live row's prefix

    def fast() -> jax.Array:
        parts = partials(start, decode_chunks if hinted else whole_rows(start))
        if cascade:
            parts = chunked.merge(_shared_partial(pool, layer, q, shared, live, sm_scale), parts)
        return chunked.finish(parts, q.dtype)

    holds = (_prefix_holds(block_tables, shared, live, step.positions, prefix_pages * page_size)
             if cascade else jnp.any(live))
    if hinted:
        needed = chunked.chunks_needed(step.lengths, start_page=start, page_size=page_size,
                                       chunk_pages=chunk_pages)
        holds &= jnp.sum(jnp.where(live, needed, 0)) <= decode_chunks
    return lax.cond(holds, fast, safe)


def _prefix_holds(block_tables: jax.Array, shared: jax.Array, live: jax.Array,
                  positions: jax.Array, prefix_tokens: int) -> jax.Array:
    """Whether a shared-prefix hint holds this step (bool scalar): some row is live, every live
    row's table starts with the pages ``shared`` (int32 ``[prefix_pages]``), and every query
    (``positions [b, t]``, -1: padding) sits past the prefix, so none of the prefix's causal
    mask is partial."""
    return (jnp.any(live)
            & jnp.all((block_tables[:, :shared.shape[0]] == shared[None]) | ~live[:, None])
            & jnp.all((positions >= prefix_tokens) | (positions < 0)))


def _shared_partial(pool: kv_pool.KVPool, layer: jax.Array, q: jax.Array, shared: jax.Array,
                    live: jax.Array, sm_scale: float) -> chunked.Partial:
    """Softmax partials of every live row ``q [b, heads, d]`` over the same pages ``shared``
    (int32 ``[n]``), read once for all rows (cascade attention)."""
    batch, num_q_heads, head_dim = q.shape
    kv_heads = pool.k.shape[2]
    q_grouped = q.reshape(batch, kv_heads, num_q_heads // kv_heads, head_dim)
    return chunked.Partial(*attend_shared_pages(q_grouped, *pool.read(layer, shared), live,
                                                sm_scale=sm_scale))


def _pallas_attend(pool: kv_pool.KVPool, layer: jax.Array, q: jax.Array, k: jax.Array,
                   v: jax.Array, pages: jax.Array, offsets: jax.Array, block_tables: jax.Array,
                   step: StepInfo) -> tuple[kv_pool.KVPool, jax.Array]:
    """Writes K/V with the Pallas kernel, then routes to the decode or prefill kernel
    (interpret mode off GPU). -> ``(pool, out)``.

    NOTE: every kernel gets the whole 5-D pool plus ``layer`` and indexes the layer itself:
    ``pool.k[layer]`` here would be a dynamic slice that XLA materialises to feed the custom
    call, a copy of one layer's K/V per layer per step.
    """
    import pallas_kernels  # noqa: PLC0415 - the kernels are optional at import time

    interpret = jax.default_backend() != "gpu"
    pages = jnp.where(pages < pool.num_pages, pages, -1)  # padding -> sentinel: skip it
    k_pool, v_pool = pallas_kernels.write_kv(pool.k, pool.v, k, v, pages, offsets, layer=layer,
                                             interpret=interpret)
    if q.shape[1] == 1:
        out = pallas_kernels.paged_decode_attention(
            q[:, 0], k_pool, v_pool, block_tables, step.lengths, layer=layer,
            interpret=interpret)[:, None]
    else:
        out = pallas_kernels.paged_prefill_attention(
            q, k_pool, v_pool, block_tables, step.lengths, step.query_lengths, layer=layer,
            interpret=interpret)
    return kv_pool.KVPool(k=k_pool, v=v_pool), out


def create(*, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int,
           page_size: int, max_seqs: int, max_len: int, dtype: jnp.dtype = jnp.float32,
           scrub: bool = True, fill: float = 0.0) -> PagedCache:
    """An empty paged cache of ``num_pages`` pages of ``page_size`` tokens for ``max_seqs``
    sequences of at most ``max_len`` tokens each, K/V in ``dtype`` (bfloat16 on a CPU is
    stored as bits: :mod:`paxkv.kv_storage`)."""
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len!r}")
    max_pages_per_seq = -(-max_len // page_size)
    table = pt.create(num_pages=num_pages, page_size=page_size, max_seqs=max_seqs,
                      max_pages_per_seq=max_pages_per_seq)
    pool = kv_pool.create(num_layers=num_layers, num_pages=num_pages, num_kv_heads=num_kv_heads,
                          page_size=page_size, head_dim=head_dim, dtype=dtype, fill=fill)
    return PagedCache(pool=pool, table=table, scrub=scrub)
