"""The paged KV cache over a ``("data", "model")`` JAX mesh: one single-device paged cache per
data shard, its kv heads split over the model axis.

Each data shard owns ``rows_per_shard = max_seqs / data`` rows, ``pages_per_shard =
num_pages / data`` pages and its own sentinel, with shard-local page ids. The page table's
leaves gain a leading shard axis on ``"data"``; the pool's page axis holds the shards' pages
one shard after another, also on ``"data"`` (:mod:`paxkv.scale.mesh`). Every operation runs today's
:class:`~paxkv.cache.paged.PagedCache` on each shard's block inside one ``shard_map``: table
ops and in-order decode attention compile to no collective. On a model axis each device of a
shard holds ``K / model`` of its kv heads and attends with the matching q heads
(:mod:`paxkv.scale.sharded_attention`), the table the same on each, the weights split to match
(:mod:`paxkv.scale.tensor_parallel`). Outside, rows are one flat ``[max_seqs]`` axis, so
:mod:`paxkv.core.steps` and :class:`paxkv.Engine` drive it unchanged::

    row r  ->  shard r // rows_per_shard, local row r % rows_per_shard
    rows:     [ 0  1 | 2  3 | 4  5 | 6  7 ]      (data = 4, rows_per_shard = 2)
    pages:    [0..P-1, S] [0..P-1, S] ...        (each shard: P pages + its sentinel S = P)

Sharing stays inside a shard: ``fork`` of a pair whose parent and child live in different
shards fails (``ok`` False, nothing changes) and ``reorder`` drops a row whose parent lives in
another shard (``ok`` False, as for an inactive parent): a page cannot be shared across
shards, since its id means a different page in each.

The engine sees the shards (:class:`paxkv.core.protocol.Shards`): it routes each new request
to a row of the shard holding its cached prefix, else of the least-loaded one
(:mod:`paxkv.engine.routing`), admits it against that shard's free pages, keeps forks in the
parent's shard, preempts only within a shard that runs dry, and keeps one prefix index per
shard (:meth:`attach`, :meth:`retain`). ``num_pages`` is what one row can draw on
(``pages_per_shard``); :meth:`free_pages` is the free pages of the fullest shard that still
has a free row (a lower bound for a caller blind to shards); exact figures:
:attr:`total_pages`, :meth:`shard_free_pages`, :meth:`stats`, :meth:`shard_stats`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh

from paxkv.cache import paged as paged_cache
from paxkv.cache import pool as kv_pool
from paxkv.cache.paged import PagedCache
from paxkv.core.step_info import StepInfo
from paxkv.scale import mesh as pmesh
from paxkv.scale import sharded_attention
from paxkv.scale.sharded_attention import STATE
from paxkv.table import page_table as pt
from paxkv.table import stats as page_stats


@functools.partial(jax.tree_util.register_dataclass, data_fields=["pools", "tables"],
                   meta_fields=["mesh", "scrub", "impl", "layer_windows"])
@dataclasses.dataclass(frozen=True)
class ShardedPagedCache:
    """Paged KV for ``max_seqs`` rows split over the mesh's data axis.

    Attributes:
      pools: every shard's pool along the page axis, leaves ``[layers, data *
        (pages_per_shard + 1), kv_heads, page_size, head_dim]`` (scales ``[layers, data *
        (pages_per_shard + 1), kv_heads, 2, page_size]``), on ``P(None, "data", "model")``
        (:data:`paxkv.scale.mesh.POOL`): shard ``s`` holds pages ``s * (pages_per_shard + 1)`` on,
        its sentinel last.
      tables: every shard's page table, leaves ``[data, ...]`` on ``P("data")``; its static
        ``num_pages`` is ``pages_per_shard`` and its ids are shard-local.
      mesh: a ``("data", "model")`` mesh whose model axis divides ``kv_heads`` (static).
      scrub, impl, layer_windows: as :class:`~paxkv.cache.paged.PagedCache`'s (static).
    """

    pools: kv_pool.KVPool
    tables: pt.PageTable
    mesh: Mesh
    scrub: bool = True
    impl: str = "xla"
    layer_windows: tuple[int | None, ...] | None = None

    shares_pages = True

    # -- sizes ----------------------------------------------------------------------------
    @property
    def num_shards(self) -> int:
        return self.tables.block_tables.shape[0]

    @property
    def rows_per_shard(self) -> int:
        return self.tables.block_tables.shape[1]

    @property
    def pages_per_shard(self) -> int:
        return self.tables.num_pages

    @property
    def max_seqs(self) -> int:
        return self.num_shards * self.rows_per_shard

    @property
    def max_len(self) -> int:
        return self.tables.block_tables.shape[2] * self.page_size

    @property
    def page_size(self) -> int:
        return self.tables.page_size

    @property
    def num_pages(self) -> int:
        """Pages one row can draw on: its shard's (see the module docstring)."""
        return self.pages_per_shard

    @property
    def total_pages(self) -> int:
        """Real pages over all shards (sentinels excluded)."""
        return self.num_shards * self.pages_per_shard

    @property
    def kv_bytes_per_page(self) -> int:
        """K + V bytes of one page over all layers, scales included (each shard's pool has
        its own sentinel page)."""
        return self.pools.nbytes // (self.num_shards * (self.pages_per_shard + 1))

    @property
    def kv_bytes_per_device(self) -> int:
        """Pool bytes (K, V and scales, sentinels included) each device holds: ``1 / (data x
        model)`` of the pool, from shapes alone (valid under jit, and after donation)."""
        return self.pools.nbytes // self.mesh.devices.size

    @property
    def lengths(self) -> jax.Array:
        """int32 ``[max_seqs]``."""
        return self.tables.lengths.reshape(-1)

    @property
    def active(self) -> jax.Array:
        """bool ``[max_seqs]``."""
        return self.tables.active.reshape(-1)

    def _by_shard(self, x: jax.Array) -> jax.Array:
        """``[max_seqs, ...]`` -> ``[data, rows_per_shard, ...]`` (row r -> shard r // rps)."""
        return x.reshape(self.num_shards, self.rows_per_shard, *x.shape[1:])

    def _local(self, block: tuple[kv_pool.KVPool, pt.PageTable]) -> PagedCache:
        return PagedCache(pool=block[0], table=block[1], scrub=self.scrub, impl=self.impl,
                          layer_windows=self.layer_windows)

    def per_device(self, fn: Callable[..., Any], *per_row: jax.Array,
                   row_specs: Any = pmesh.SHARDED, shared: Any = (),
                   shared_specs: Any = pmesh.REPLICATED,
                   out_specs: Any = (STATE, pmesh.SHARDED)) -> Any:
        """``fn(shard_cache, per_row_blocks, shared)`` on every device (per-row arrays
        ``[max_seqs, ...]`` split by data shard; specs as :func:`paxkv.scale.mesh.per_shard`'s).
        ``fn`` returns ``((pool, table), ...)`` by default."""
        blocks = (self.pools, self.tables, tuple(self._by_shard(x) for x in per_row))
        return pmesh.per_shard(lambda b, s: fn(self._local(b[:2]), b[2], s), self.mesh,
                               blocks, shared, out_specs, block_specs=STATE + (row_specs,),
                               shared_specs=shared_specs)

    def with_state(self, local: tuple[kv_pool.KVPool, pt.PageTable]) -> "ShardedPagedCache":
        """This cache holding ``(pools, tables)`` from :meth:`per_device`."""
        return dataclasses.replace(self, pools=local[0], tables=local[1])

    # -- the KVCache protocol -------------------------------------------------------------
    def reserve(self, num_new: jax.Array, *,
                max_new: int) -> tuple["ShardedPagedCache", jax.Array]:
        """Room for ``num_new`` int32 ``[max_seqs]`` more tokens per row, each row from its
        own shard's pages; ``ok`` bool ``[max_seqs]``."""
        def fn(c, rows, _):
            c, ok = c.reserve(rows[0], max_new=max_new)
            return (c.pool, c.table), ok
        local, ok = self.per_device(fn, jnp.asarray(num_new, jnp.int32))
        return self.with_state(local), ok.reshape(-1)

    def release(self, rows: jax.Array) -> tuple["ShardedPagedCache", jax.Array]:
        """Ends rows (bool ``[max_seqs]``); ``ok`` bool ``[max_seqs]``."""
        def fn(c, mask, _):
            c, ok = c.release(mask[0])
            return (c.pool, c.table), ok
        local, ok = self.per_device(fn, jnp.asarray(rows, bool))
        return self.with_state(local), ok.reshape(-1)

    def fork(self, parents: jax.Array,
             children: jax.Array) -> tuple["ShardedPagedCache", jax.Array]:
        """Row ``children[i]`` shares ``parents[i]``'s pages (int32 ``[k]`` global rows);
        ``ok`` bool ``[k]`` is False for a pair whose rows live in different shards."""
        def fn(c, _, pair):
            p, ch = pair
            me = lax.axis_index(pmesh.DATA)
            mine = ((pmesh.shard_of(p, self.rows_per_shard) == me)
                    & (pmesh.shard_of(ch, self.rows_per_shard) == me))
            c, ok = c.fork(self._to_local(p, mine), self._to_local(ch, mine))
            return (c.pool, c.table), ok & mine
        pair = (jnp.asarray(parents, jnp.int32), jnp.asarray(children, jnp.int32))
        local, ok = self.per_device(fn, shared=pair)
        return self.with_state(local), jnp.any(ok, axis=0)

    def reorder(self, parents: jax.Array) -> tuple["ShardedPagedCache", jax.Array]:
        """Row ``b`` continues row ``parents[b]`` (int32 ``[max_seqs]``, -1 = drop); a row
        whose parent lives in another shard is dropped too (``ok`` False)."""
        def fn(c, par, _):
            mine = pmesh.shard_of(par[0], self.rows_per_shard) == lax.axis_index(pmesh.DATA)
            c, ok = c.reorder(self._to_local(par[0], mine))
            return (c.pool, c.table), ok
        local, ok = self.per_device(fn, jnp.asarray(parents, jnp.int32))
        return self.with_state(local), ok.reshape(-1)

    def attach(self, pages: jax.Array,
               lengths: jax.Array) -> tuple["ShardedPagedCache", jax.Array]:
        """:func:`paxkv.table.share.attach` per shard (a prefix-cache hit): each row ``r``
        with ``lengths[r] > 0`` (int32 ``[max_seqs]``) holds ``pages[r]`` (int32 ``[max_seqs,
        w]``, its shard's ids); ``ok`` bool ``[max_seqs]``, True where ``lengths`` is 0."""
        def fn(c, blocks, _):
            cells, n = blocks
            want = n > 0
            rows = jnp.where(want, jnp.arange(self.rows_per_shard, dtype=jnp.int32), -1)
            table, ok = pt.attach(c.table, rows, cells, n)
            return (c.pool, table), ok | ~want
        local, ok = self.per_device(fn, jnp.asarray(pages, jnp.int32),
                                    jnp.asarray(lengths, jnp.int32))
        return self.with_state(local), ok.reshape(-1)

    def retain(self, pages: jax.Array, delta: int) -> "ShardedPagedCache":
        """``delta`` more references on each shard's ``pages`` (int32 ``[data, n]``, row
        ``s`` shard ``s``'s ids; ids past its pool are ignored): the prefix index's holds."""
        def fn(c, _, shared):
            mine, by = shared
            return c.pool, pt.retain(c.table, mine[0], by)
        return self.with_state(self.per_device(
            fn, shared=(jnp.asarray(pages, jnp.int32), jnp.asarray(delta, jnp.int32)),
            shared_specs=(pmesh.SHARDED, pmesh.REPLICATED), out_specs=STATE))

    def _to_local(self, rows: jax.Array, mine: jax.Array) -> jax.Array:
        """Global row ids -> this shard's local ids, -1 where not ``mine``."""
        return jnp.where(mine, rows % self.rows_per_shard, -1)

    def free_pages(self) -> jax.Array:
        """int32 scalar: free pages of the fullest shard that has a free row (of the fullest
        shard when none has): what the engine may count on for its next admission."""
        free = self.shard_free_pages()
        open_rows = jnp.any(~self.tables.active, axis=1)
        return jnp.min(jnp.where(open_rows | ~jnp.any(open_rows), free, self.pages_per_shard))

    def shard_free_pages(self) -> jax.Array:
        """int32 ``[data]``: pages nobody holds, per shard."""
        return jnp.sum(self.tables.ref_counts == 0, axis=1).astype(jnp.int32)

    def pages_used(self) -> jax.Array:
        """int32 ``[max_seqs]``: pages each row references."""
        return self.tables.pages_held().reshape(-1)

    def shard_stats(self) -> pt.TableStats:
        """:func:`paxkv.table.page_table.stats` per shard: each field ``[data]``."""
        return jax.vmap(pt.stats)(self.tables)

    def stats(self) -> pt.TableStats:
        """Pool-wide accounting over all shards (scalars)."""
        return page_stats.total(self.shard_stats(), self.page_size)

    def sharing_stats(self) -> pt.SharingStats:
        """Who shares what (:func:`paxkv.table.page_table.sharing_stats` per shard): per-row fields
        ``[max_seqs]`` in global row order, totals over all shards."""
        return page_stats.total_sharing(jax.vmap(pt.sharing_stats)(self.tables))

    def attend(self, layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
               step: StepInfo, *, sm_scale: float | None = None,
               logit_soft_cap: float | None = None) -> tuple["ShardedPagedCache", jax.Array]:
        """:meth:`paxkv.core.protocol.KVCache.attend` per device: q ``[b, t, H, Dh]``, k/v ``[b,
        t, K, Dh]`` -> ``(cache, [b, t, H, Dh])`` (:func:`paxkv.scale.sharded_attention.attend`)."""
        return sharded_attention.attend(self, layer, q, k, v, step,
                                        dict(sm_scale=sm_scale, logit_soft_cap=logit_soft_cap))


def create(*, mesh: Mesh, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int,
           page_size: int, max_seqs: int, max_len: int, dtype: jnp.dtype = jnp.float32,
           fill: float = 0.0, scrub: bool = True, attention_impl: str = "xla",
           layer_windows: tuple[int | None, ...] | None = None) -> ShardedPagedCache:
    """An empty sharded cache: ``num_pages`` and ``max_seqs`` split evenly over the mesh's
    data axis, each shard with its own sentinel page, ``num_kv_heads`` evenly over its model
    axis, the pool created in place on its devices (``fill``, ``dtype``: as
    :func:`paxkv.cache.paged.create`). Raises ``ValueError`` naming what to change for a mesh
    or a size that does not fit."""
    data, model = pmesh.axis_sizes(mesh)
    pmesh.check_model_axis("num_kv_heads", num_kv_heads, mesh)
    mesh = pmesh.auto(mesh)
    rows = pmesh.split_data("max_seqs", max_seqs, data)
    pages = pmesh.split_data("num_pages", num_pages, data)
    one_shard = functools.partial(  # also checks the sizes and resolves attention_impl
        paged_cache.create, num_layers=num_layers, num_kv_heads=num_kv_heads,
        head_dim=head_dim, num_pages=pages, page_size=page_size, max_seqs=rows,
        max_len=max_len, dtype=dtype, scrub=scrub, fill=fill, attention_impl=attention_impl,
        layer_windows=layer_windows)
    shape = jax.eval_shape(one_shard)  # the impl and windows one shard resolves to
    if shape.impl != "xla" and model > 1:
        raise ValueError("the Pallas kernels do not run on a model axis yet: use "
                         "attention_impl='xla' on a (data, model) mesh with model > 1, or a "
                         "(data, 1) mesh")

    def stacked() -> tuple[kv_pool.KVPool, pt.PageTable]:
        one = one_shard()
        return (jax.tree.map(lambda x: jnp.tile(x, (1, data) + (1,) * (x.ndim - 2)), one.pool),
                jax.tree.map(lambda x: jnp.broadcast_to(x, (data, *x.shape)), one.table))

    # each device builds only its blocks
    pools, tables = jax.jit(stacked, out_shardings=(pmesh.pool_sharding(mesh),
                                                    pmesh.sharded(mesh)))()
    return ShardedPagedCache(pools=pools, tables=tables, mesh=mesh, scrub=scrub,
                             impl=shape.impl, layer_windows=shape.layer_windows)
