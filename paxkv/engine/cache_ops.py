"""The engine's device side: the cache and every jitted, donated operation on it.

:class:`CacheOps` owns the cache between steps. Its methods run one compiled function each
(the cache donated, so the pool is never copied) and keep two host-side counts current: free
pages per shard (:class:`paxkv.core.protocol.Shards`: a sharded cache's rows draw on their own
shard's pages; every other cache is one shard), and copy-on-write copies (probed around a
step only once rows may share pages). Every array argument has a fixed width (:func:`pad`), so
each operation compiles once per cache shape (the prefix cache's, attach and retain, per
shard: :mod:`paxkv.prefix.holds`). The cache an engine asks for by name is built by
:mod:`paxkv.engine.setup`.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from paxkv.core import buckets, steps, stored
from paxkv.core.plan import AttentionPlan
from paxkv.core.protocol import KVCache, shard_free_pages, shard_layout
from paxkv.core.sampling import RowSampling
from paxkv.engine.accounting import kv_bytes_used
from paxkv.prefix import holds as page_holds
from paxkv.scale import sharded_cache
from paxkv.scale.distributed import gather
from paxkv.table import page_table as pt


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
    """int32 ``[num_shards]``: :func:`paxkv.core.protocol.shard_free_pages` (one dispatch)."""
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


class CacheOps:
    """The cache, its free-page counts (per shard) and its copy-on-write count, changed only
    through the jitted operations below."""

    def __init__(self, cache: KVCache, max_len: int | None = None):
        self.cache = cache
        self.max_len = cache.max_len if max_len is None else min(max_len, cache.max_len)
        self.num_shards, self.rows_per_shard = shard_layout(cache)
        self.shard_free = np.full(self.num_shards, cache.num_pages, np.int64)  # [num_shards]
        self.peak_used = self.peak_kv_bytes = 0
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
        self.peak_kv_bytes = kv_bytes_used(self.cache, self.peak_used)
        self.cow_copies = 0

    def _note_free(self, free: int | None) -> None:
        """``free``: a one-shard cache's count from its step; None reads every shard's."""
        if free is not None and self.num_shards == 1:
            self.shard_free[0] = free
        else:
            self.shard_free = np.asarray(gather(free_per_shard(self.cache)), np.int64)
        used = self.cache.total_pages - self.free
        self.peak_used = max(self.peak_used, used)
        self.peak_kv_bytes = max(self.peak_kv_bytes, kv_bytes_used(self.cache, used))

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

    def attach_groups(self, row: int, pages: Sequence[Sequence[int]], first: Sequence[int],
                      num_tokens: int) -> None:
        """:meth:`attach` on a layer-grouped cache: ``pages[g]`` in group ``g`` from block
        ``first[g]`` (:meth:`paxkv.cache.grouped.GroupedPagedCache.attach`)."""
        self.cache, ok = page_holds.attach_groups(self.cache, row, pages, first, num_tokens)
        if not ok:
            raise RuntimeError(f"attaching cached pages {[list(p) for p in pages]} to row "
                               f"{row} failed")
        self.shares = True

    def retain_groups(self, pages: Sequence[Sequence[int]], delta: int) -> None:
        """``delta`` more references on each group's pages (``pages[g]``) of a layer-grouped
        cache: its prefix index's holds."""
        if any(pages):
            self.cache = page_holds.retain_groups(self.cache, pages, delta)

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

    def prefill(self, model: Any, params: Any, tokens: np.ndarray, rows: np.ndarray,
                query_lengths: np.ndarray, sampling: RowSampling | None, plan: AttentionPlan,
                logprobs: int | None = None, mode: str = "raw") -> tuple[Any, np.ndarray]:
        """:func:`paxkv.core.steps.prefill_step` of ``model.forward`` on ``params`` ->
        ``(next_tokens [b], ok [b])`` as numpy (with ``logprobs``, ``next_tokens`` is a
        :class:`paxkv.core.sampling.Sampled` of numpy arrays, in ``mode``)."""
        return self.run_step(lambda: stored.call(
            steps.prefill_step, model.forward, params, self.cache, host(tokens, np.int32),
            host(rows, np.int32), host(query_lengths, np.int32), sampling, plan=plan,
            logprobs=logprobs, logprobs_mode=mode))

    def decode(self, model: Any, params: Any, last_tokens: np.ndarray, live: np.ndarray,
               sampling: RowSampling | None, plan: AttentionPlan,
               logprobs: int | None = None, mode: str = "raw") -> tuple[Any, np.ndarray]:
        """:func:`paxkv.core.steps.decode_step` over every row -> ``(next_tokens, ok)``
        ``[max_seqs]`` as numpy (``logprobs``, ``mode``: as :meth:`prefill`)."""
        return self.run_step(lambda: stored.call(
            steps.decode_step, model.forward, params, self.cache, host(last_tokens, np.int32),
            host(live, bool), sampling, plan=plan, logprobs=logprobs, logprobs_mode=mode))
