"""Softmax partials: attention over disjoint key sets, computed apart and merged exactly.

A set of keys yields, per (row, kv head, query), the largest score, the sum of
``exp(score - max)`` and the unnormalised output; two sets' partials merge by log-sum-exp
rescaling (:func:`merge`) and :func:`finish` divides once at the end, so any split of a row's
keys (decode chunks, dense row groups, cascade attention's shared pages) gives one softmax.
Masked keys are excluded with ``where`` and everything accumulates in float32.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from paxkv.attention.blocks import scale_scores

_NEG_INF = float("-inf")


class Partial(NamedTuple):
    """Softmax partials of a set of keys, per (row, kv head, query in the GQA group).

    Attributes:
      max: float32 ``[b, kv_heads, group]``: the largest score (-inf: no key seen).
      sum: float32 ``[b, kv_heads, group]``: sum of ``exp(score - max)``.
      out: float32 ``[b, kv_heads, group, head_dim]``: sum of ``exp(score - max) * value``.
    """

    max: jax.Array
    sum: jax.Array
    out: jax.Array


def read_in_range(x: jax.Array, *index: jax.Array | slice) -> jax.Array:
    """``x[index]`` for indices in range by construction (block-table entries, the layer, a
    dense row): without the clamp and the negative-index wrap, a gather's index per element
    is one load. Both decode paths (paged chunks, dense row groups) read their keys this way."""
    return x.at[index].get(mode="promise_in_bounds", wrap_negative_indices=False)


def keys_partial(q: jax.Array, k_t: jax.Array, v: jax.Array, live: jax.Array, *,
                 sm_scale: float, logit_soft_cap: float | None = None) -> Partial:
    """Softmax partials of ``n`` independent (queries, keys) pairs: the inner product of both
    decode paths' tiles (paged chunks, dense row groups).

    The two products are shaped for XLA:CPU, where they are small (a GQA group's 3 queries
    against a few hundred keys) and a batched ``dot`` runs far below the machine's speed: the
    scores are a multiply-and-sum over ``head_dim`` of keys laid out ``[head_dim, keys]``
    (callers transpose them in the copy that gathers them anyway), and only the value product
    is a ``dot``.

    Args:
      q: ``[n, kv_heads, group, head_dim]``.
      k_t: ``[n, kv_heads, head_dim, keys]``: the keys, transposed.
      v: ``[n, kv_heads, keys, head_dim]`` (any float dtype; products in float32).
      live: bool ``[n, keys]``: keys to attend to; the rest are excluded with ``where``, so
        NaN there never reaches an output.
      sm_scale, logit_soft_cap: the model's score settings
        (:func:`paxkv.attention.blocks.scale_scores`).

    Returns:
      :class:`Partial` of shape ``[n, kv_heads, group(, head_dim)]``.
    """
    f32 = jnp.float32
    dots = jnp.sum(q.astype(f32)[..., None] * k_t.astype(f32)[:, :, None], axis=3)
    scores = scale_scores(dots, sm_scale, logit_soft_cap)
    scores = jnp.where(live[:, None, None], scores, _NEG_INF)  # [n, k, g, keys]
    top = jnp.max(scores, axis=-1)
    probs = jnp.exp(scores - finite(top)[..., None])
    v = jnp.where(live[:, None, :, None], v.astype(f32), 0.0)
    out = lax.dot_general(probs, v, (((3,), (2,)), ((0, 1), (0, 1))))
    return Partial(top, jnp.sum(probs, axis=-1), out)


def merge(a: Partial, b: Partial) -> Partial:
    """The partials of two disjoint key sets of the same rows -> those of their union."""
    top = jnp.maximum(a.max, b.max)
    wa = jnp.where(jnp.isfinite(a.max), jnp.exp(a.max - finite(top)), 0.0)
    wb = jnp.where(jnp.isfinite(b.max), jnp.exp(b.max - finite(top)), 0.0)
    return Partial(top, wa * a.sum + wb * b.sum, wa[..., None] * a.out + wb[..., None] * b.out)


def finish(p: Partial, dtype: jnp.dtype) -> jax.Array:
    """Partials -> attention output ``[b, num_q_heads, head_dim]`` (rows with no key: zeros)."""
    out = p.out / jnp.where(p.sum > 0, p.sum, 1.0)[..., None]
    batch, kv_heads, group, head_dim = out.shape
    return out.reshape(batch, kv_heads * group, head_dim).astype(dtype)


def finite(x: jax.Array) -> jax.Array:
    """``x`` with -inf (a partial that saw no key) replaced by 0, so it can be subtracted."""
    return jnp.where(jnp.isfinite(x), x, 0.0)
