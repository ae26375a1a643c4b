"""Attention of a :class:`~paxkv.scale.sharded_cache.ShardedPagedCache`: one ``shard_map`` over
``(data, model)`` around the single-device :meth:`paxkv.cache.paged.PagedCache.attend`.

Device ``(d, m)`` holds data shard ``d``'s pages of kv heads ``m * K/model`` to ``(m + 1) *
K/model - 1`` and is handed the matching q heads. The blocks line up because q head ``h``
reads kv head ``h // (H / K)`` (grouped-query attention), so a contiguous block of ``H /
model`` q heads reads exactly a contiguous block of ``K / model`` kv heads::

    q heads  [ 0 1 2 | 3 4 5 | 6 7 8 ]     H = 9, K = 3, model = 3
    kv heads [   0   |   1   |   2   ]     device m: q heads 3m..3m+2 over kv head m

Nothing here sums over ``model``: the output keeps its head split, and the model's
row-parallel ``o_proj`` (:mod:`paxkv.scale.tensor_parallel`) contracts the heads, leaving XLA one
all-reduce per layer outside the ``shard_map``. No K/V crosses devices.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from paxkv.cache.paged import PagedCache
from paxkv.core.step_info import StepInfo
from paxkv.scale import mesh as pmesh

STATE = (pmesh.POOL, pmesh.SHARDED)  # specs of a shard's (pool, table)


def attend(cache: Any, layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
           step: StepInfo, scores: dict) -> tuple[Any, jax.Array]:
    """:meth:`paxkv.core.protocol.KVCache.attend` on a sharded cache: q ``[b, t, H, Dh]``, k/v
    ``[b, t, K, Dh]`` -> ``(cache, [b, t, H, Dh])``, the output's head axis on ``model``.

    A decode over every row in order (``step.rows`` None) splits the batch by data shard: no
    collective. A batch of chosen rows is seen whole by every data shard, which writes and
    reads only its own rows (the others are padding there) and one ``psum`` over ``"data"``
    assembles the output.
    """
    layer = jnp.asarray(layer, jnp.int32)
    if step.rows is None:
        def in_order(c: PagedCache, x: tuple, _: Any) -> tuple:
            q_, k_, v_, pos, lens, qlens = x
            c, out = c.attend(layer, q_, k_, v_, StepInfo(pos, lens, qlens, None, step.plan),
                              **scores)
            return (c.pool, c.table), out
        heads = (pmesh.HEADS,) * 3 + (pmesh.SHARDED,) * 3
        local, out = cache.per_device(in_order, q, k, v, step.positions, step.lengths,
                                step.query_lengths, row_specs=heads, shared=layer,
                                out_specs=(STATE, pmesh.HEADS))
        return cache.with_state(local), out.reshape(q.shape)
    heads = pmesh.ROW_HEADS
    local, out = cache.per_device(
        functools.partial(_attend_rows, rows_per_shard=cache.rows_per_shard, step=step,
                          scores=scores),
        shared=(layer, q, k, v, step),
        shared_specs=(pmesh.REPLICATED, heads, heads, heads, pmesh.REPLICATED),
        out_specs=(STATE, heads))
    return cache.with_state(local), out


def _attend_rows(c: PagedCache, _: tuple, shared: tuple, *, rows_per_shard: int,
                 step: StepInfo, scores: dict) -> tuple[tuple, jax.Array]:
    """One shard's part of a chosen-rows step: foreign rows become padding."""
    layer, q, k, v, full = shared
    mine = pmesh.shard_of(full.rows, rows_per_shard) == lax.axis_index(pmesh.DATA)
    shard_step = StepInfo(positions=jnp.where(mine[:, None], full.positions, -1),
                          lengths=jnp.where(mine, full.lengths, 0),
                          query_lengths=jnp.where(mine, full.query_lengths, 0),
                          rows=jnp.where(mine, full.rows % rows_per_shard, 0),
                          plan=step.plan)
    c, out = c.attend(layer, q, k, v, shard_step, **scores)
    out = jnp.where(mine[:, None, None, None], out, jnp.zeros_like(out))
    return (c.pool, c.table), lax.psum(out, pmesh.DATA)
