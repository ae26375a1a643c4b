"""The device side of the host tier (:mod:`paxkv.prefix.host_tier`): pages gathered out of
the pool for a copy to host, and host pages written back into fresh pages of the pool.

Both take page lists padded to a power of two (:func:`padded`), so each compiles once per
width; a sharded cache restores into one data shard (:func:`restore_shard_pages`) and gathers
its pages by their place in the pool's page axis (shard ``s``'s page ``p`` at
``s * (pages_per_shard + 1) + p``). A gather reads the pool in program order: the step that then releases and reuses those
pages runs after it, so the copy never sees a later write. A restore takes the first free
pages (one pass over the ref counts, :func:`paxkv.table.alloc.free_page_ids`), writes every
layer's K and V (and scales) there and gives each one reference: the prefix index's, which
then names them like pages it indexed after a prefill.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from paxkv.cache.pool import KVPool
from paxkv.core import buckets
from paxkv.scale import mesh as pmesh
from paxkv.table.alloc import free_page_ids


def padded(pages: Sequence[int], fill: int) -> np.ndarray:
    """int32 ``[pow2 >= 8]``: ``pages`` then ``fill`` (few compiled widths)."""
    out = np.full(buckets.pow2(len(pages), 8), fill, np.int32)
    out[:len(pages)] = pages
    return out


@jax.jit
def gather_pages(pool: KVPool, pages: jax.Array) -> tuple[jax.Array, ...]:
    """Every layer's K/V of ``pages`` (int32 ``[n]``): ``[layers, n, kv_heads, ...]`` per
    array of ``pool.arrays()`` (codes and scales as stored)."""
    return tuple(a[:, pages] for a in pool.arrays())


@functools.partial(jax.jit, donate_argnames=("cache",))
def restore_pages(cache: Any, data: tuple[jax.Array, ...],
                  count: jax.Array) -> tuple[Any, jax.Array]:
    """Writes ``data`` (``[layers, n, ...]`` per pool array, as :func:`gather_pages` gives)
    into the first ``count`` (<= n) free pages of a one-device paged cache, one reference
    each.

    Returns:
      ``(cache, ids)``: ids int32 ``[n]``, the pages written in order; the sentinel
      (``num_pages``) past ``count`` or where the pool ran out of free pages (nothing held).
    """
    table, n = cache.table, data[0].shape[1]
    ids = free_page_ids(table.ref_counts, n, table.num_pages)
    ids = jnp.where(jnp.arange(n) < count, ids, table.num_pages)
    pool = KVPool(*(a.at[:, ids].set(d.astype(a.dtype))
                    for a, d in zip(cache.pool.arrays(), data)))
    table = dataclasses.replace(table, ref_counts=table.ref_counts.at[ids].add(1, mode="drop"))
    return dataclasses.replace(cache, pool=pool, table=table), ids


@functools.partial(jax.jit, donate_argnames=("cache",))
def restore_shard_pages(cache: Any, data: tuple[jax.Array, ...], count: jax.Array,
                        shard: jax.Array) -> tuple[Any, jax.Array]:
    """:func:`restore_pages` into data shard ``shard`` of a
    :class:`~paxkv.scale.sharded_cache.ShardedPagedCache` (``data`` every kv head: each
    device of the shard writes its own heads); the other shards change nothing. Returns
    ``(cache, ids)``, ids that shard's local ids (its sentinel past ``count``)."""
    pages, n = cache.pages_per_shard, data[0].shape[1]

    def fn(c: Any, _: Any, shared: Any) -> Any:
        blocks, count, shard = shared
        mine = lax.axis_index(pmesh.DATA) == shard
        ids = free_page_ids(c.table.ref_counts, n, pages)
        ids = jnp.where((jnp.arange(n) < count) & mine, ids, pages)
        heads = lax.axis_index(pmesh.MODEL)
        arrays = []
        for a, d in zip(c.pool.arrays(), blocks):  # this device's kv heads of the data
            d = lax.dynamic_slice_in_dim(d, heads * a.shape[2], a.shape[2], axis=2)
            arrays.append(a.at[:, ids].set(d.astype(a.dtype)))
        refs = c.table.ref_counts.at[ids].add(1, mode="drop")
        return (KVPool(*arrays), dataclasses.replace(c.table, ref_counts=refs)), ids

    local, ids = cache.per_device(fn, shared=(data, count, shard))
    return cache.with_state(local), ids[shard]
