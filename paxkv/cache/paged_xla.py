"""The paged cache's XLA attention (every backend; the fast path on a CPU).

Prefill (``t > 1`` queries a row) runs per (row, query tile) (:mod:`.query_tiles`); decode (one
query a row) over a ragged list of chunks of the rows' own keys (:mod:`.chunked`). Both use the
step's :class:`~paxkv.core.plan.AttentionPlan` where it holds and check it here, inside the
step: a shared prefix must be the same pages in every live row with every query past it, and a
decode chunk list must cover every live row's keys. When a hint fails, the step attends per row
over the whole window (always right; only slower). The window itself is checked by the caller
(:meth:`paxkv.cache.paged.PagedCache.attend`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from paxkv.attention import chunked, partials
from paxkv.attention.blocks import attend_blocks, attend_blocks_with_prefix, attend_shared_pages
from paxkv.attention.query_tiles import attend_in_query_tiles
from paxkv.cache import pool as kv_pool
from paxkv.core.buckets import cdiv
from paxkv.core.plan import TILE_CHUNKS, AttentionPlan, chunk_pages
from paxkv.core.step_info import StepInfo


def attend(pool: kv_pool.KVPool, layer: jax.Array, q: jax.Array, block_tables: jax.Array,
           step: StepInfo, plan: AttentionPlan, *, page_size: int, sm_scale: float,
           logit_soft_cap: float | None, window: jax.Array | None = None) -> jax.Array:
    """``q [b, t, H, Dh]`` over the pages of ``block_tables`` int32 ``[b, width]`` (every live
    row's keys lie inside the width) -> ``[b, t, H, Dh]``. ``window``: the layer's sliding
    window (int32 scalar, or None for a model with none); a windowed model's rows each read
    their own keys (the plan's shared-prefix hint, whose pages every query sees whole, is
    not taken)."""
    scores = dict(sm_scale=sm_scale, logit_soft_cap=logit_soft_cap, window=window)
    if window is not None:
        plan = dataclasses.replace(plan, prefix_pages=0)
    if q.shape[1] == 1:
        return _decode(pool, layer, q[:, 0], block_tables, step, plan, page_size,
                       scores)[:, None]
    return _prefill(pool, layer, q, block_tables, step, plan.prefix_pages, page_size, scores)


def _prefill(pool: kv_pool.KVPool, layer: jax.Array, q: jax.Array, block_tables: jax.Array,
             step: StepInfo, prefix_pages: int, page_size: int, scores: dict) -> jax.Array:
    """Gather + masked softmax per (row, query tile); with a ``prefix_pages`` hint that holds,
    the shared pages are read once (cascade) instead of per row."""

    def per_row() -> jax.Array:
        if chunked.tiles_pay():
            return attend_in_query_tiles(q, pool.k, pool.v, block_tables, step.positions,
                                         step.lengths, layer=layer, scales=pool.scales,
                                         **scores)
        return attend_blocks(q, *pool.read(layer, block_tables), step.positions, step.lengths,
                             **scores)

    if not 0 < prefix_pages < block_tables.shape[1]:
        return per_row()
    live = step.query_lengths > 0
    shared = block_tables[jnp.argmax(live), :prefix_pages]  # the first live row's prefix

    def cascade() -> jax.Array:
        rest = block_tables[:, prefix_pages:]
        return attend_blocks_with_prefix(q, *pool.read(layer, shared), *pool.read(layer, rest),
                                         step.positions, step.lengths, **_whole(scores))

    holds = prefix_holds(block_tables, shared, live, step.positions, prefix_pages * page_size)
    return lax.cond(holds, cascade, per_row)


def _decode(pool: kv_pool.KVPool, layer: jax.Array, q: jax.Array, block_tables: jax.Array,
            step: StepInfo, plan: AttentionPlan, page_size: int, scores: dict) -> jax.Array:
    """One query per row ``q [b, H, Dh]`` -> ``[b, H, Dh]`` through the chunk list.

    With a prefix hint that holds, the shared pages are one product for all rows (cascade) and
    the list covers only the rest; with a chunk-count hint that holds, the list is that long
    instead of every row's whole window. Otherwise the list covers every row's whole window
    from its first page (always enough)."""
    batch, width = block_tables.shape
    per_chunk = chunk_pages(page_size, width)
    live = step.query_lengths > 0
    cascade = 0 < plan.prefix_pages < width
    start = plan.prefix_pages if cascade else 0

    def row_partials(start_page: int, needed: int) -> partials.Partial:
        num_chunks, tile = chunked.list_shape(needed, TILE_CHUNKS)
        if not chunked.tiles_pay():
            tile = num_chunks
        work = chunked.chunk_work(step.lengths, live, start_page=start_page,
                                  page_size=page_size, chunk_pages=per_chunk,
                                  num_chunks=num_chunks)
        return chunked.chunk_partials(q, pool.k, pool.v, block_tables, step.lengths, work,
                                      chunk_pages=per_chunk, tile_chunks=tile, layer=layer,
                                      scales=pool.scales, **scores)

    def whole_rows(start_page: int) -> int:
        return batch * cdiv(width - start_page, per_chunk)

    def safe() -> jax.Array:
        return partials.finish(row_partials(0, whole_rows(0)), q.dtype)

    hinted = plan.decode_chunks is not None and plan.decode_chunks < whole_rows(start)
    if not (cascade or hinted):
        return safe()
    shared = block_tables[jnp.argmax(live), :plan.prefix_pages]  # the first live row's prefix

    def fast() -> jax.Array:
        parts = row_partials(start, plan.decode_chunks if hinted else whole_rows(start))
        if cascade:
            parts = partials.merge(_shared_partial(pool, layer, q, shared, live, scores), parts)
        return partials.finish(parts, q.dtype)

    holds = (prefix_holds(block_tables, shared, live, step.positions,
                          plan.prefix_pages * page_size) if cascade else jnp.any(live))
    if hinted:
        needed = chunked.chunks_needed(step.lengths, start_page=start, page_size=page_size,
                                       chunk_pages=per_chunk)
        holds &= jnp.sum(jnp.where(live, needed, 0)) <= plan.decode_chunks
    return lax.cond(holds, fast, safe)


def prefix_holds(block_tables: jax.Array, shared: jax.Array, live: jax.Array,
                 positions: jax.Array, prefix_tokens: int) -> jax.Array:
    """Whether a shared-prefix hint holds this step (bool scalar): some row is live, every live
    row's table starts with the pages ``shared`` (int32 ``[prefix_pages]``), and every query
    (``positions [b, t]``, -1: padding) sits past the prefix, so none of the prefix's causal
    mask is partial."""
    return (jnp.any(live)
            & jnp.all((block_tables[:, :shared.shape[0]] == shared[None]) | ~live[:, None])
            & jnp.all((positions >= prefix_tokens) | (positions < 0)))


def _shared_partial(pool: kv_pool.KVPool, layer: jax.Array, q: jax.Array, shared: jax.Array,
                    live: jax.Array, scores: dict) -> partials.Partial:
    """Softmax partials of every live row ``q [b, H, Dh]`` over the same pages ``shared``
    (int32 ``[n]``), read once for all rows (cascade attention)."""
    batch, num_q_heads, head_dim = q.shape
    kv_heads = pool.k.shape[2]
    q_grouped = q.reshape(batch, kv_heads, num_q_heads // kv_heads, head_dim)
    return partials.Partial(*attend_shared_pages(q_grouped, *pool.read(layer, shared), live,
                                                **_whole(scores)))


def _whole(scores: dict) -> dict:
    """The score settings for cascade attention's shared pages, which every query sees whole:
    taken only when no layer slides (:func:`attend` drops the hint otherwise)."""
    assert scores["window"] is None, "cascade over a sliding-window layer"
    return {k: v for k, v in scores.items() if k != "window"}
