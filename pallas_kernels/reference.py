"""Plain-jnp paged attention: the oracle for every Pallas kernel.

The kernels' argument order (``q, k_pages, v_pages, block_tables, lengths``) over one layer's
pages ``[num_pages, num_kv_heads, page_size, head_dim]``; each reference gathers the pages and
runs :func:`paxkv.attention.blocks.attend_blocks`, the maths every paxkv path shares. 8-bit
pages (int8 codes, fp8 as uint8 bits) are dequantised right at the gather with their
``scales`` ``[num_pages, num_kv_heads, 2, page_size]``, as the XLA path reads a scaled pool
(:func:`paxkv.kv_storage.read_pages`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paxkv.attention.blocks import attend_blocks, default_sm_scale, gather_pages
from paxkv.kv_storage import read_pages


def gather_kv(k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
              scales: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """K and V pages of every row, ``[batch, max_pages, num_kv_heads, page_size, head_dim]``
    each: as stored, or float32 codes x scales for 8-bit pages."""
    if scales is None:
        return gather_pages(k_pages, block_tables), gather_pages(v_pages, block_tables)
    return read_pages(k_pages, v_pages, scales, block_tables, gather_pages)


def paged_prefill_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    query_lengths: jax.Array,
    *,
    scales: jax.Array | None = None,
    sm_scale: float | None = None,
    logit_soft_cap: float | None = None,
) -> jax.Array:
    """Ragged multi-token queries over paged context (chunked prefill, cached prefixes).

    Args:
      q: ``[batch, max_q_len, num_q_heads, head_dim]``; sequence ``b``'s queries are its last
        ``query_lengths[b]`` tokens, so query ``t`` sits at position
        ``lengths[b] - query_lengths[b] + t`` and sees every cached token before it.
      k_pages, v_pages: ``[num_pages, num_kv_heads, page_size, head_dim]``.
      block_tables: int32 ``[batch, max_pages_per_seq]``.
      lengths: int32 ``[batch]``: tokens in context, the queries' own included.
      query_lengths: int32 ``[batch]``, ``<= min(lengths, max_q_len)``.
      scales: float32 ``[num_pages, num_kv_heads, 2, page_size]`` for 8-bit pages, else None.

    Returns:
      ``[batch, max_q_len, num_q_heads, head_dim]``; queries ``t >= query_lengths[b]`` are zero.
    """
    t = jnp.arange(q.shape[1])[None, :]
    q_positions = lengths[:, None] - query_lengths[:, None] + t
    q_positions = jnp.where(t < query_lengths[:, None], q_positions, -1)
    return attend_blocks(
        q, *gather_kv(k_pages, v_pages, block_tables, scales), q_positions, lengths,
        sm_scale=default_sm_scale(q.shape[-1], sm_scale), logit_soft_cap=logit_soft_cap)


def paged_decode_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    scales: jax.Array | None = None,
    sm_scale: float | None = None,
    logit_soft_cap: float | None = None,
) -> jax.Array:
    """One query token per sequence attending to its ``lengths[b]`` cached tokens.

    Args:
      q: ``[batch, num_q_heads, head_dim]``.
      k_pages, v_pages: ``[num_pages, num_kv_heads, page_size, head_dim]``.
      block_tables: int32 ``[batch, max_pages_per_seq]``.
      lengths: int32 ``[batch]``; a length-0 sequence yields zeros.
      scales: float32 ``[num_pages, num_kv_heads, 2, page_size]`` for 8-bit pages, else None.

    Returns:
      ``[batch, num_q_heads, head_dim]`` in ``q.dtype``.
    """
    out = paged_prefill_attention_reference(
        q[:, None], k_pages, v_pages, block_tables, lengths, jnp.minimum(lengths, 1),
        scales=scales, sm_scale=sm_scale, logit_soft_cap=logit_soft_cap)
    return out[:, 0]


def dense_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    query_lengths: jax.Array,
    *,
    sm_scale: float | None = None,
) -> jax.Array:
    """The dense twin: ``k``/``v`` ``[batch, num_kv_heads, max_len, head_dim]`` per sequence.

    Same query convention as :func:`paged_prefill_attention_reference`; no gather at all.
    """
    t = jnp.arange(q.shape[1])[None, :]
    q_positions = lengths[:, None] - query_lengths[:, None] + t
    q_positions = jnp.where(t < query_lengths[:, None], q_positions, -1)
    return attend_blocks(q, k[:, None], v[:, None], q_positions, lengths,
                         sm_scale=default_sm_scale(q.shape[-1], sm_scale))
