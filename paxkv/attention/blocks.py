"""The attention maths every path shares: masked softmax over gathered blocks, cascade over a
shared prefix, and the model's score settings (softmax scale, logit soft-cap).

One vocabulary and argument order for every attention function in paxkv:

    q, k_pages, v_pages, block_tables, lengths

with one layer's pages laid out ``[num_pages, num_kv_heads, page_size, head_dim]`` so each
(page, kv-head) tile is one contiguous ``[page_size, head_dim]`` slab.

Sequence ``b`` holds ``lengths[b]`` tokens; token ``p`` lives in page
``block_tables[b, p // page_size]`` at slot ``p % page_size``::

    logical blocks        block table row b        physical pages (one pool)
    [tok 0..15 ] -------> block_tables[b, 0] = 7 -> k_pages[7]
    [tok 16..31] -------> block_tables[b, 1] = 2 -> k_pages[2]
    [tok 32..40] -------> block_tables[b, 2] = 9 -> k_pages[9]   (partly filled)
                          block_tables[b, 3:] = padding (never read: masked by lengths)

Everything past ``lengths[b]`` is masked with ``where`` (never multiplied by zero), so NaN in free
pages or behind table padding cannot reach an output. Softmax and both contractions accumulate
in float32 whatever the storage dtype. Every score goes through :func:`scale_scores` (scale,
then soft-cap, then the mask), so a model's settings mean the same on every path. The Pallas
kernels' oracles (:mod:`pallas_kernels.reference`) are these functions over gathered pages.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG_INF = float("-inf")


def attend_blocks(
    q: jax.Array,
    k_blocks: jax.Array,
    v_blocks: jax.Array,
    q_positions: jax.Array,
    lengths: jax.Array,
    *,
    sm_scale: float,
    logit_soft_cap: float | None = None,
    window: jax.Array | None = None,
) -> jax.Array:
    """Masked causal GQA attention over KV already laid out in blocks.

    Args:
      q: ``[batch, q_len, num_q_heads, head_dim]``.
      k_blocks, v_blocks: ``[batch, num_blocks, num_kv_heads, block_size, head_dim]``: key
        position ``m * block_size + s`` is ``k_blocks[:, m, :, s]``. Paged KV arrives here as
        gathered pages; a dense cache ``[batch, kv_heads, max_len, head_dim]`` is one block.
      q_positions: int32 ``[batch, q_len]``: absolute position of each query (causal mask).
        A query with a negative position is padding and yields zeros.
      lengths: int32 ``[batch]``: keys at positions ``>= lengths`` are never read.
      sm_scale, logit_soft_cap: the model's score settings (:func:`scale_scores`).
      window: int32 scalar (traced) or None: a query sees only its last ``window`` keys, its
        own included (a sliding-window layer; :func:`layer_window`); None sees all.

    Returns:
      ``[batch, q_len, num_q_heads, head_dim]`` in ``q.dtype``; rows with nothing to attend
      to (length 0, padding queries) are zero.
    """
    batch, q_len, num_q_heads, head_dim = q.shape
    num_kv_heads = k_blocks.shape[2]
    q_grouped = q.reshape(batch, q_len, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    scores, v_live = _masked_scores(q_grouped, k_blocks, v_blocks, q_positions, lengths, 0,
                                    sm_scale=sm_scale, logit_soft_cap=logit_soft_cap,
                                    window=window)
    row_max = jnp.max(scores, axis=(-2, -1), keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    probs = jnp.exp(scores - row_max)  # exp(-inf) = 0 for masked keys
    denom = jnp.sum(probs, axis=(-2, -1), keepdims=True)
    probs = probs / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("btkgms,bmksd->btkgd", probs.astype(v_blocks.dtype), v_live,
                     preferred_element_type=jnp.float32)
    return out.reshape(batch, q_len, num_q_heads, head_dim).astype(q.dtype)


def _masked_scores(q_grouped: jax.Array, k_blocks: jax.Array, v_blocks: jax.Array,
                   q_positions: jax.Array, lengths: jax.Array, first_key: int, *,
                   sm_scale: float, logit_soft_cap: float | None,
                   window: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Each row's scores against its own blocks, masked, and its values, masked.

    Key position ``first_key + m * block_size + s`` is ``k_blocks[:, m, :, s]``. A query sees
    the live keys (before ``lengths``) at or before its own position (and, with a ``window``,
    after ``position - window``); a padding query (negative position) sees none.

    Returns:
      ``(scores, v_live)``: float32 ``[b, t, kv_heads, group, m, s]`` (-inf where not
      visible) and ``v_blocks`` with every key past ``lengths`` zeroed (0 * NaN would still
      be NaN), and with a ``window`` every key before the first query's window zeroed too
      (a page a sliding-window layer released may hold anything).
    """
    _, num_blocks, _, block_size, _ = k_blocks.shape
    in_blocks = jnp.arange(num_blocks)[:, None] * block_size + jnp.arange(block_size)[None]
    key_pos = first_key + in_blocks  # [m, s]
    key_live = key_pos[None] < lengths[:, None, None]  # [b, m, s]
    if window is not None:  # keys before every query's window: not read, V zeroed too
        first_q = jnp.min(jnp.where(q_positions >= 0, q_positions, NO_WINDOW), axis=1)
        key_live &= in_window(key_pos[None], first_q[:, None, None], window)
    visible = key_live[:, None] & (key_pos[None, None] <= q_positions[:, :, None, None])
    visible &= (q_positions >= 0)[:, :, None, None]  # [b, t, m, s]
    if window is not None:
        visible &= in_window(key_pos[None, None], q_positions[:, :, None, None], window)
    scores = scale_scores(jnp.einsum("btkgd,bmksd->btkgms", q_grouped, k_blocks,
                                     preferred_element_type=jnp.float32),
                          sm_scale, logit_soft_cap)
    v_live = jnp.where(key_live[:, :, None, :, None], v_blocks, jnp.zeros((), v_blocks.dtype))
    return jnp.where(visible[:, :, None, None], scores, _NEG_INF), v_live


def attend_blocks_with_prefix(
    q: jax.Array,
    k_prefix: jax.Array,
    v_prefix: jax.Array,
    k_blocks: jax.Array,
    v_blocks: jax.Array,
    q_positions: jax.Array,
    lengths: jax.Array,
    *,
    sm_scale: float,
    logit_soft_cap: float | None = None,
) -> jax.Array:
    """:func:`attend_blocks` when every row's first keys are the same pages (cascade attention).

    Fifty users of one system prompt, or the beams of one prompt, point their first block-table
    columns at the same physical pages. Read per row, those pages cost ``rows`` small products
    per kv head (``[group, d] x [d, prefix]``); read once, they are one product
    ``[rows * q_len * group, d] x [d, prefix]`` per kv head, the shape a CPU (or GPU) runs at
    full speed. The per-row rest is the usual gather over ``k_blocks``; one softmax spans both
    parts, so the result equals :func:`attend_blocks` over the concatenated keys.

    Args:
      q: ``[batch, q_len, num_q_heads, head_dim]``.
      k_prefix, v_prefix: ``[prefix_pages, num_kv_heads, page_size, head_dim]``: keys at
        positions ``[0, prefix_pages * page_size)`` of every row. The caller guarantees every
        live query sits at or after the prefix's end (all of it visible) and every row holds
        it (``lengths >= prefix``).
      k_blocks, v_blocks: ``[batch, num_blocks, num_kv_heads, block_size, head_dim]``: key
        position ``prefix + m * block_size + s`` is ``k_blocks[:, m, :, s]``.
      q_positions: int32 ``[batch, q_len]`` (negative: padding, yields zeros).
      lengths: int32 ``[batch]``: keys at positions ``>= lengths`` are never read.
      sm_scale, logit_soft_cap: the model's score settings (:func:`scale_scores`), for both
        parts.

    Returns:
      ``[batch, q_len, num_q_heads, head_dim]`` in ``q.dtype``.
    """
    batch, q_len, num_q_heads, head_dim = q.shape
    prefix_pages, num_kv_heads, page_size, _ = k_prefix.shape
    group = num_q_heads // num_kv_heads
    q_grouped = q.reshape(batch, q_len, num_kv_heads, group, head_dim)
    # The shared part: every (row, query) at once, as partials [b, t, k, g(, d)].
    shared = attend_shared_pages(q_grouped.reshape(batch * q_len, num_kv_heads, group, head_dim),
                                 k_prefix, v_prefix, (q_positions >= 0).reshape(-1),
                                 sm_scale=sm_scale, logit_soft_cap=logit_soft_cap)
    shared = tuple(x.reshape((batch, q_len) + x.shape[1:]) for x in shared)
    s_own, v_live = _masked_scores(q_grouped, k_blocks, v_blocks, q_positions, lengths,
                                   prefix_pages * page_size, sm_scale=sm_scale,
                                   logit_soft_cap=logit_soft_cap)
    out = _softmax_with_shared(shared, s_own, v_live)
    return out.reshape(batch, q_len, num_q_heads, head_dim).astype(q.dtype)


def _softmax_with_shared(shared: tuple[jax.Array, jax.Array, jax.Array], s_own: jax.Array,
                         v_live: jax.Array) -> jax.Array:
    """One softmax over the shared partials ``(max, sum, out)`` ``[b, t, k, g(, d)]`` and the
    row's own masked scores and values (:func:`_masked_scores`) -> float32 ``[b, t, k, g, d]``:
    the shared partials are rescaled to the joint max."""
    m_shared, l_shared, o_shared = shared
    row_max = jnp.maximum(m_shared, jnp.max(s_own, axis=(-2, -1)))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)  # [b, t, k, g]
    w_shared = jnp.where(jnp.isfinite(m_shared), jnp.exp(m_shared - row_max), 0.0)
    p_own = jnp.exp(s_own - row_max[..., None, None])
    denom = w_shared * l_shared + jnp.sum(p_own, axis=(-2, -1))
    out = (w_shared[..., None] * o_shared
           + jnp.einsum("btkgms,bmksd->btkgd", p_own.astype(v_live.dtype), v_live,
                        preferred_element_type=jnp.float32))
    return out / jnp.where(denom > 0, denom, 1.0)[..., None]


def attend_shared_pages(
    q_grouped: jax.Array,
    k_prefix: jax.Array,
    v_prefix: jax.Array,
    live: jax.Array,
    *,
    sm_scale: float,
    logit_soft_cap: float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Softmax partials of many queries over the same pages, all of them visible: the shared
    part of cascade attention, for prefill (:func:`attend_blocks_with_prefix`) and decode
    (``paxkv.cache.paged``).

    One ``[n * group, d] x [d, prefix]`` product per kv head, in float32 (the pages are read
    once, and XLA:CPU has no bf16 x bf16 -> f32 kernel for this product).

    Args:
      q_grouped: ``[n, num_kv_heads, group, head_dim]``: the queries, by kv head.
      k_prefix, v_prefix: ``[prefix_pages, num_kv_heads, page_size, head_dim]``.
      live: bool ``[n]``: queries that attend (the rest get max -inf, zeros).
      sm_scale, logit_soft_cap: the model's score settings (:func:`scale_scores`).

    Returns:
      ``(max, sum, out)``: float32 ``[n, kv, group]`` (the largest score), ``[n, kv, group]``
      (sum of ``exp(score - max)``) and ``[n, kv, group, head_dim]`` (sum of
      ``exp(score - max) * value``) -- :class:`paxkv.attention.partials.Partial`'s fields.
    """
    _, num_kv_heads, _, head_dim = k_prefix.shape
    f32 = jnp.float32

    def keys(pages: jax.Array) -> jax.Array:  # [n, k, s, d] -> [k, n * s, d]
        return pages.transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim).astype(f32)

    scores = scale_scores(jnp.einsum("nkgd,ksd->nkgs", q_grouped.astype(f32), keys(k_prefix)),
                          sm_scale, logit_soft_cap)
    scores = jnp.where(live[:, None, None, None], scores, _NEG_INF)
    top = jnp.max(scores, axis=-1)
    probs = jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0.0)[..., None])
    return top, jnp.sum(probs, axis=-1), jnp.einsum("nkgs,ksd->nkgd", probs, keys(v_prefix))


def scale_scores(scores: jax.Array, sm_scale: float,
                 logit_soft_cap: float | None = None) -> jax.Array:
    """Raw float32 scores ``q . k`` (any shape) -> the scores the softmax sees, same shape:
    ``s = scores * sm_scale``, then, with a cap (Gemma-2), ``logit_soft_cap * tanh(s / cap)``,
    which bounds them to ``(-cap, cap)``. Callers mask afterwards (with ``where``)."""
    scores = scores * sm_scale
    if logit_soft_cap is None:
        return scores
    return logit_soft_cap * jnp.tanh(scores / logit_soft_cap)


def gather_pages(pages: jax.Array, block_tables: jax.Array) -> jax.Array:
    """``[num_pages, kv_heads, page_size, head_dim]`` x ``[batch, max_pages]`` ->
    ``[batch, max_pages, kv_heads, page_size, head_dim]``."""
    return jnp.take(pages, block_tables, axis=0, mode="clip")


def default_sm_scale(head_dim: int, sm_scale: float | None) -> float:
    return head_dim ** -0.5 if sm_scale is None else float(sm_scale)


# A window no sequence reaches: the value a global layer gets in a model whose other layers
# slide (so one traced comparison serves every layer of the scan).
NO_WINDOW = 2 ** 30


def layer_window(layer_windows: tuple[int | None, ...] | None,
                 layer: jax.Array) -> jax.Array | None:
    """The window of ``layer`` (int32 scalar, traced under the model's layer scan), or None
    when no layer of the model slides (then no attention path pays for a window).

    ``layer_windows``: one entry per layer, None for a global layer, ``w`` for a layer whose
    queries see only their last ``w`` keys (their own included: HF's ``sliding_window``)."""
    if not layer_windows or all(w is None for w in layer_windows):
        return None
    table = jnp.asarray([NO_WINDOW if w is None else int(w) for w in layer_windows], jnp.int32)
    return table[jnp.clip(layer, 0, len(layer_windows) - 1)]


def in_window(key_pos: jax.Array, q_pos: jax.Array, window: jax.Array) -> jax.Array:
    """Whether a key at ``key_pos`` is among the last ``window`` keys of a query at ``q_pos``
    (broadcast shapes): ``key_pos > q_pos - window``. Causality is the caller's mask."""
    return key_pos > q_pos - window


def check_windows(layer_windows: tuple[int | None, ...] | None, num_layers: int
                  ) -> tuple[int | None, ...] | None:
    """``layer_windows`` as a tuple (None when no layer slides), checked at the Python
    boundary: one entry per layer, each None or an int >= 1."""
    if layer_windows is None:
        return None
    windows = tuple(layer_windows)
    if len(windows) != num_layers:
        raise ValueError(f"layer_windows has {len(windows)} entries for {num_layers} layers: "
                         "pass one per layer (None for a global layer)")
    for w in windows:
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"layer_windows entries must be None or an int >= 1, got {w!r}")
    return windows if any(w is not None for w in windows) else None
