"""The engine's device side: the cache and every jitted, donated operation on it.

:class:`CacheOps` owns the cache between steps. Its methods run one compiled function each
(the cache donated, so the pool is never copied) and keep two host-side counts current: free
pages per shard (:class:`paxkv.protocol.Shards`: a sharded cache's rows draw on their own
shard's pages; every other cache is one shard), and copy-on-write copies (probed around a
step only once rows may share pages). Every array argument has a fixed width (:func:`pad`), so
each operation compiles once per cache shape (the prefix cache's, attach and retain, per
shard: :mod:`paxkv.page_holds`). :func:`build_cache` makes the cache an engine asked for by
name, on a mesh when given one.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import Mesh, NamedSharding

from paxkv import buckets, dense_cache, mesh as pmesh, page_holds, paged_cache
from paxkv.distributed import gather
from paxkv import sharded_cache, steps
from paxkv import page_table as pt
from paxkv import tensor_parallel
from paxkv.attention.plan import AttentionPlan
from paxkv.page_holds import attach_rows, retain_pages  # noqa: F401 (the engine's jitted ops)
from paxkv.protocol import KVCache, shard_free_pages, shard_layout
from paxkv.sampling import RowSampling


def host(x: Any, dtype: Any) -> np.ndarray:
    """A fresh numpy copy of ``x`` to hand a jitted step. ``jnp.asarray`` of a host array
    compiles a tiny copy program per shape and dtype (jax 0.10.2: ``jit(stage)``,
    ``jit(convert_element_type)``; 16 of the engine state machine's 87 compiles), and a
    jitted function takes numpy as it is (dispatch: 27 us against 132 us through
    ``jnp.asarray``, three small inputs here). A copy, because the caller may change its
    array while the step still reads it."""
    return np.array(x, dtype)


def pad(values: Sequence[int], width: int, fill: int) -> np.ndarray:
    """int32 ``[width]``: ``values`` then ``fill``."""
    out = np.full(width, fill, np.int32)
    out[:len(values)] = values
    return out


@functools.partial(jax.jit, donate_argnames=("cache",))
def fork_rows(cache: KVCache, parents: jax.Array, children: jax.Array) -> tuple[KVCache, jax.Array]:
    """``cache.fork`` (paged: share pages; dense: copy rows); pairs out of range are no-ops."""
    return cache.fork(parents, children)


@functools.partial(jax.jit, donate_argnames=("cache",))
def release_rows(cache: KVCache, rows: jax.Array) -> tuple[KVCache, jax.Array]:
    """``cache.release(rows)``; rows bool ``[max_seqs]``."""
    return cache.release(rows)


@jax.jit
def shared_partial_pages(table: pt.PageTable) -> tuple[jax.Array, jax.Array]:
    """Before a step: each row's last cell and, where that page is partly filled and shared,
    its page id (``num_pages + 1`` elsewhere). int32 ``[max_seqs]`` each."""
    held = table.pages_held()
    cell = jnp.clip(held - 1, 0)
    page = jnp.take_along_axis(table.block_tables, cell[:, None], axis=1)[:, 0]
    refs = jnp.take(table.ref_counts, page, mode="fill", fill_value=0)
    shared = (held > 0) & (table.lengths % table.page_size != 0) & (refs > 1)
    return cell, jnp.where(shared, page, table.num_pages + 1)


@jax.jit
def free_per_shard(cache: KVCache) -> jax.Array:
    """int32 ``[num_shards]``: :func:`paxkv.protocol.shard_free_pages` (one dispatch)."""
    return shard_free_pages(cache)


@jax.jit
def count_copies(table: pt.PageTable, cell: jax.Array, page: jax.Array) -> jax.Array:
    """After a step: rows whose shared partial page was replaced by a private copy."""
    now = jnp.take_along_axis(table.block_tables, cell[:, None], axis=1)[:, 0]
    return jnp.sum((page <= table.num_pages) & (now != page))


# The same on a sharded cache's stacked tables (leaves ``[data, ...]``): per shard, summed.
shard_partial_pages = jax.jit(jax.vmap(shared_partial_pages))
shard_copies = jax.jit(lambda tables, cell, page: jnp.sum(jax.vmap(count_copies)(
    tables, cell, page)))


def build_cache(model: Any, cache: str | KVCache, *, max_seqs: int, max_len: int,
                page_size: int, num_pages: int | None, kv_dtype: Any, attention_impl: str,
                scrub: bool, mesh: Mesh | None = None) -> KVCache:
    """The cache an engine asked for by name ("paged" or "dense", sized for ``model``), or
    ``cache`` itself when it is already a :class:`KVCache`. ``num_pages`` defaults to the
    dense reservation ``max_seqs * ceil(max_len / page_size)``. With a ``("data", "model")``
    ``mesh`` a paged cache is :func:`paxkv.sharded_cache.create`'s (``max_seqs`` and
    ``num_pages`` split over the data axis, a ``ValueError`` naming sizes that fit
    otherwise)."""
    if isinstance(cache, KVCache):
        if mesh is not None:
            raise ValueError("mesh= builds the cache by name: pass cache='paged' with it (a "
                             "cache you built carries its own mesh: leave mesh out)")
        return cache
    max_seqs, max_len, page_size = (_size(n, v) for n, v in (
        ("max_seqs", max_seqs), ("max_len", max_len), ("page_size", page_size)))
    num_pages = None if num_pages is None else _size("num_pages", num_pages)
    dims = dict(num_layers=model.num_layers, num_kv_heads=model.num_kv_heads,
                head_dim=model.head_dim, max_seqs=max_seqs, max_len=max_len, dtype=kv_dtype)
    if cache == "paged":
        paged = dict(num_pages=num_pages or max_seqs * buckets.cdiv(max_len, page_size),
                     page_size=page_size, scrub=scrub, attention_impl=attention_impl, **dims)
        if mesh is not None:
            return sharded_cache.create(mesh=mesh, **paged)
        return paged_cache.create(**paged)
    if cache == "dense":
        if mesh is not None:
            raise ValueError("mesh= needs cache='paged': the dense cache runs on one device")
        return dense_cache.create(**dims)
    raise ValueError(f"cache must be 'paged', 'dense' or a KVCache, got {cache!r}")


def place_model(model: Any, mesh: Mesh | None) -> Any:
    """``model`` with its params on ``mesh`` (None: ``model`` unchanged): replicated on a
    ``(data, 1)`` mesh, split by :data:`paxkv.tensor_parallel.LLAMA_RULES` on a model axis,
    kept as they are when every leaf already lies on the mesh's devices (a model of your own
    placed with your own rules: :func:`paxkv.tensor_parallel.shard_model`). Placed once here,
    no weight moves inside a step."""
    if mesh is None:
        return model
    _, width = pmesh.axis_sizes(mesh)
    leaves = jax.tree.leaves(model.params)
    if leaves and all(isinstance(getattr(x, "sharding", None), NamedSharding)
                      and x.sharding.device_set == set(mesh.devices.flat) for x in leaves):
        return model
    rules = tensor_parallel.LLAMA_RULES if width > 1 else ()  # () replicates every leaf
    try:
        return tensor_parallel.shard_model(model, mesh, rules)
    except ValueError as e:
        raise ValueError(f"mesh= with a model axis of {width} splits the weights by "
                         f"paxkv.tensor_parallel.LLAMA_RULES, which do not fit this model ({e}):"
                         " place them first with paxkv.tensor_parallel.shard_model(model, mesh, "
                         "rules), or use a (data, 1) mesh") from e


def _size(name: str, value: Any) -> int:
    """``value`` as a Python int >= 1 (a numpy integer is fine); a ``ValueError`` naming
    ``name`` otherwise."""
    try:
        size = operator.index(value)
    except TypeError:
        size = 0
    if size < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return size


class CacheOps:
    """The cache, its free-page counts (per shard) and its copy-on-write count, changed only
    through the jitted operations below."""

    def __init__(self, cache: KVCache, max_len: int | None = None):
        self.cache = cache
        self.max_len = cache.max_len if max_len is None else min(max_len, cache.max_len)
        self.num_shards, self.rows_per_shard = shard_layout(cache)
        self.shard_free = np.full(self.num_shards, cache.num_pages, np.int64)  # [num_shards]
        self.peak_used = 0
        self.cow_copies = 0
        self.shares = False  # rows may share a partly filled page: probe steps for copies

    @property
    def max_seqs(self) -> int:
        return self.cache.max_seqs

    @property
    def free(self) -> int:
        """Free pages over every shard (a one-shard cache's count)."""
        return int(self.shard_free.sum())

    @free.setter
    def free(self, value: int) -> None:
        # NOTE: only callers blind to shards set the total (the scorer's prefix index): they
        # run on one-shard caches.
        if self.num_shards != 1:
            raise RuntimeError("a sharded cache's free pages are counted per shard: use take()")
        self.shard_free[0] = value

    def shard_of(self, row: int) -> int:
        """The shard whose pages row ``row`` draws on."""
        return row // self.rows_per_shard

    def take(self, row: int, pages: int) -> None:
        """Books ``pages`` for a request just placed in ``row`` (its step reads the real
        count)."""
        self.shard_free[self.shard_of(row)] -= pages

    def reset_counts(self) -> None:
        """Restarts the peak and the copy count from now (a timed run after a warm-up)."""
        self.peak_used = self.cache.total_pages - self.free
        self.cow_copies = 0

    def _note_free(self, free: int | None) -> None:
        """``free``: a one-shard cache's count from its step; None reads every shard's."""
        if free is not None and self.num_shards == 1:
            self.shard_free[0] = free
        else:
            self.shard_free = np.asarray(gather(free_per_shard(self.cache)), np.int64)
        self.peak_used = max(self.peak_used, self.cache.total_pages - self.free)

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """Raises a ``ValueError`` naming what to change when a request of ``prompt_len`` +
        ``max_new_tokens`` tokens could never fit the cache, even alone."""
        total, cache = prompt_len + max_new_tokens, self.cache
        if total > self.max_len:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens})"
                             f" = {total} exceeds max_len={self.max_len}: raise max_len or "
                             "shorten the request")
        pages = buckets.cdiv(total, cache.page_size)
        if cache.shares_pages and pages > cache.num_pages:
            raise ValueError(f"a request of {total} tokens needs {pages} pages but the pool "
                             f"has num_pages={cache.num_pages}: raise it")

    def refresh_free(self) -> None:
        self._note_free(int(self.cache.free_pages()) if self.num_shards == 1 else None)

    def attach(self, row: int, pages: Sequence[int], num_tokens: int) -> None:
        """Row ``row`` holds ``pages`` (a prefix-cache hit in its shard: that shard's ids) for
        ``num_tokens`` tokens."""
        self.cache, ok = page_holds.attach(self.cache, row, pages, num_tokens)
        if not ok:
            raise RuntimeError(f"attaching cached pages {list(pages)} to row {row} failed")
        self.shares = True

    def retain(self, pages: Sequence[int], delta: int, shard: int = 0) -> None:
        """``delta`` more references on each of ``pages`` of ``shard`` (the prefix index's
        holds)."""
        by_shard: list[Sequence[int]] = [[] for _ in range(self.num_shards)]
        by_shard[shard] = pages
        self.retain_shards(by_shard, delta)

    def retain_shards(self, pages_by_shard: Sequence[Sequence[int]], delta: int) -> None:
        """:meth:`retain` of every shard's pages at once (``pages_by_shard[s]``: shard
        ``s``'s ids)."""
        self.cache = page_holds.retain(self.cache, pages_by_shard, delta)

    def fork(self, parent: int, children: Sequence[int]) -> None:
        """Rows ``children`` continue row ``parent`` (paged: sharing its pages)."""
        if not children:
            return
        self.cache, ok = fork_rows(
            self.cache, pad([parent] * len(children), self.max_seqs, -1),
            pad(list(children), self.max_seqs, -1))
        if not gather(ok)[:len(children)].all():
            raise RuntimeError(f"forking row {parent} into rows {list(children)} failed")
        self.shares = self.cache.shares_pages

    def release(self, rows: Sequence[int]) -> None:
        """Ends ``rows``: pages only they held are free at once."""
        mask = np.zeros(self.max_seqs, bool)
        mask[list(rows)] = True
        self.cache, _ = release_rows(self.cache, mask)
        self.refresh_free()

    def run_step(self, run: Any) -> tuple[Any, ...]:
        """``run()``, a jitted step returning ``(cache, *out, free_pages)``: keeps the cache,
        the free counts and the copy-on-write count (probed around the step once rows may
        share a partly filled page); returns ``out`` as numpy."""
        sharded = isinstance(self.cache, sharded_cache.ShardedPagedCache)
        probe = None
        if self.shares and self.cache.shares_pages:
            probe = (shard_partial_pages(self.cache.tables) if sharded
                     else shared_partial_pages(self.cache.table))
        self.cache, *out, free = run()
        self._note_free(int(free) if self.num_shards == 1 else None)
        if probe is not None:
            self.cow_copies += int(gather(shard_copies(self.cache.tables, *probe) if sharded
                                          else count_copies(self.cache.table, *probe)))
        return tuple(gather(tuple(out)))

    def prefill(self, model: Any, tokens: np.ndarray, rows: np.ndarray, query_lengths: np.ndarray,
                sampling: RowSampling | None, plan: AttentionPlan,
                logprobs: int | None = None) -> tuple[Any, np.ndarray]:
        """:func:`paxkv.steps.prefill_step` -> ``(next_tokens [b], ok [b])`` as numpy (with
        ``logprobs``, ``next_tokens`` is a :class:`paxkv.sampling.Sampled` of numpy arrays)."""
        return self.run_step(lambda: steps.prefill_step(
            model.forward, model.params, self.cache, host(tokens, np.int32), host(rows, np.int32),
            host(query_lengths, np.int32), sampling, plan=plan, logprobs=logprobs))

    def decode(self, model: Any, last_tokens: np.ndarray, live: np.ndarray,
               sampling: RowSampling | None, plan: AttentionPlan,
               logprobs: int | None = None) -> tuple[Any, np.ndarray]:
        """:func:`paxkv.steps.decode_step` over every row -> ``(next_tokens, ok)``
        ``[max_seqs]`` as numpy (``logprobs``: as :meth:`prefill`)."""
        return self.run_step(lambda: steps.decode_step(
            model.forward, model.params, self.cache, host(last_tokens, np.int32),
            host(live, bool), sampling, plan=plan, logprobs=logprobs))
