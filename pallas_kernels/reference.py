"""Plain-jnp paged attention: the oracle for every Pallas kernel, written to stand alone.

The kernels' argument order (``q, k_pages, v_pages, block_tables, lengths``) over one layer's
pages ``[num_pages, num_kv_heads, page_size, head_dim]``. Each reference does the textbook
thing and nothing clever: gather a row's pages into one contiguous ``[max_len]`` key axis,
decode the stored format (:func:`pallas_kernels.kv_storage.readable`: bfloat16 bits, 8-bit
codes x their ``scales`` ``[num_pages, num_kv_heads, 2, page_size]``), then one masked float32
softmax per query (causal; with ``window=`` over the query's last ``window`` keys only). It
shares no code with paxkv's XLA attention path, so a test of either against it checks the
maths, not a shared helper.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kv_storage import readable


def default_sm_scale(head_dim: int, sm_scale: float | None) -> float:
    """The softmax scale a kernel uses: ``sm_scale``, or ``head_dim ** -0.5`` when None."""
    return head_dim ** -0.5 if sm_scale is None else float(sm_scale)


def gather_kv(k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
              scales: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Every row's keys and values as float32 ``[batch, num_kv_heads, max_len, head_dim]``,
    ``max_len = max_pages_per_seq * page_size`` (padding entries read whatever they point at;
    the softmax masks them)."""
    def one(pages: jax.Array, which: int) -> jax.Array:
        got = jnp.take(pages, block_tables, axis=0, mode="clip")  # [b, m, k, s, d]
        scale = None
        if scales is not None:
            scale = jnp.take(scales, block_tables, axis=0, mode="clip")[:, :, :, which]
        x = readable(got, scale).astype(jnp.float32)
        b, m, k, s, d = x.shape
        return x.transpose(0, 2, 1, 3, 4).reshape(b, k, m * s, d)
    return one(k_pages, 0), one(v_pages, 1)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array,
            lengths: jax.Array, sm_scale: float, logit_soft_cap: float | None,
            window: jax.Array | int | None) -> jax.Array:
    """q ``[b, t, H, d]``, k / v ``[b, K, L, d]``, q_positions int32 ``[b, t]`` (-1: padding
    query), lengths ``[b]``, window: None or an int scalar -> ``[b, t, H, d]`` in ``q.dtype``;
    zero where nothing is seen."""
    b, t, heads, d = q.shape
    group = heads // k.shape[1]
    k = jnp.repeat(k, group, axis=1)  # [b, H, L, d]: query head h reads kv head h // group
    v = jnp.repeat(v, group, axis=1)
    s = jnp.einsum("bthd,bhld->bhtl", q.astype(jnp.float32), k) * sm_scale
    if logit_soft_cap is not None:
        s = logit_soft_cap * jnp.tanh(s / logit_soft_cap)
    key = jnp.arange(k.shape[2])
    live = key[None, :] < lengths[:, None]  # [b, L]
    seen = (live[:, None, :] & (key[None, None, :] <= q_positions[:, :, None])
            & (q_positions[:, :, None] >= 0))  # [b, t, L]
    if window is not None:  # sliding window: the last `window` keys, the query's own included
        seen &= key[None, None, :] > q_positions[:, :, None] - jnp.maximum(window, 1)
    s = jnp.where(seen[:, None], s, -jnp.inf)
    top = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(top), top, 0.0))
    total = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(total > 0, total, 1.0)
    # NaN in a slot no query sees (dead, or before every window): 0 * NaN is still NaN
    v = jnp.where(jnp.any(seen, axis=1)[:, None, :, None], v, 0.0)
    return jnp.einsum("bhtl,bhld->bthd", p, v).astype(q.dtype)


def _query_positions(q_len: int, lengths: jax.Array, query_lengths: jax.Array) -> jax.Array:
    """Row ``b``'s queries are its last ``query_lengths[b]`` tokens; the rest are padding."""
    t = jnp.arange(q_len)[None, :]
    pos = lengths[:, None] - query_lengths[:, None] + t
    return jnp.where(t < query_lengths[:, None], pos, -1)


def paged_prefill_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    query_lengths: jax.Array,
    *,
    scales: jax.Array | None = None,
    window: jax.Array | int | None = None,
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
      window: int scalar (may be traced) or None: a sliding window, the query at position
        ``p`` sees only keys ``p - window < k <= p`` (values below 1 act as 1).

    Returns:
      ``[batch, max_q_len, num_q_heads, head_dim]``; queries ``t >= query_lengths[b]`` are zero.
    """
    k, v = gather_kv(k_pages, v_pages, block_tables, scales)
    return _attend(q, k, v, _query_positions(q.shape[1], lengths, query_lengths), lengths,
                   default_sm_scale(q.shape[-1], sm_scale), logit_soft_cap, window)


def paged_decode_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    *,
    scales: jax.Array | None = None,
    window: jax.Array | int | None = None,
    sm_scale: float | None = None,
    logit_soft_cap: float | None = None,
) -> jax.Array:
    """One query token per sequence attending to its ``lengths[b]`` cached tokens (its last
    ``window`` with a sliding window).

    Args:
      q: ``[batch, num_q_heads, head_dim]``.
      k_pages, v_pages: ``[num_pages, num_kv_heads, page_size, head_dim]``.
      block_tables: int32 ``[batch, max_pages_per_seq]``.
      lengths: int32 ``[batch]``; a length-0 sequence yields zeros.
      scales: float32 ``[num_pages, num_kv_heads, 2, page_size]`` for 8-bit pages, else None.
      window: int scalar or None, as :func:`paged_prefill_attention_reference`.

    Returns:
      ``[batch, num_q_heads, head_dim]`` in ``q.dtype``.
    """
    out = paged_prefill_attention_reference(
        q[:, None], k_pages, v_pages, block_tables, lengths, jnp.minimum(lengths, 1),
        scales=scales, window=window, sm_scale=sm_scale, logit_soft_cap=logit_soft_cap)
    return out[:, 0]


def dense_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    query_lengths: jax.Array,
    *,
    window: jax.Array | int | None = None,
    sm_scale: float | None = None,
    logit_soft_cap: float | None = None,
) -> jax.Array:
    """The dense twin: ``k``/``v`` ``[batch, num_kv_heads, max_len, head_dim]`` per sequence.

    Same query convention (and ``window``) as :func:`paged_prefill_attention_reference`; no
    gather at all.
    """
    return _attend(q, k.astype(jnp.float32), v.astype(jnp.float32),
                   _query_positions(q.shape[1], lengths, query_lengths), lengths,
                   default_sm_scale(q.shape[-1], sm_scale), logit_soft_cap, window)
