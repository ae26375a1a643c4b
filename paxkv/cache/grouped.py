"""The paged cache for a model with sliding-window layers: each layer group owns its pages, and
a window group returns the pages its window has moved past inside the jitted step.

A window layer never reads more than its last ``w`` keys, so keeping all of a long sequence's
pages for it holds K/V nothing will read (Gemma 3: five window layers for each global one, so
about 5/6 of a 32k-token sequence's K/V). Here the layers fall into groups by window (the
global layers, if any, are group 0; then one group per window size), and each group has its
own page table over its own pages::

    layer_windows (1024, 1024, 1024, 1024, 1024, None) x 5   ->   group 0: the 5 global layers
                                                               group 1: the 25 window layers
    flat pool axis: [ g0 layer 0: P0 + 1 pages | g0 layer 1 | ... | g1 layer 0: P1 + 1 | ... ]

Every group's table sees the same rows, lengths and operations (reserve, release, fork,
reorder); a window group's :meth:`reserve` first calls :func:`paxkv.table.page_table.slide`,
dropping each row's pages that lie wholly before its next query's window, so they are free (or
left to their other holders: a forked sibling) in the very reservation that follows, with no
host round trip and no sweep. A window group then holds at most ``ceil((w - 1 + t) / page) + 1``
pages of a row that adds ``t`` tokens in a step (``ceil(w / page) + 1`` decoding).

The pool is one flat array ``[1, sum_g layers_g x (P_g + 1), kv_heads, page, head_dim]``, so the
model's layer scan stays one scan with the cache in its carry (a ``lax.cond`` choosing between
per-group pools copies them whole each layer): :meth:`attend` picks the layer's group table
and page offset by the traced layer index (a few small integer selects) and runs the paged
cache's attention over that view (:func:`paxkv.cache.paged.attend_pages`).

:meth:`free_pages`, :meth:`pages_used`, :meth:`stats` and ``num_pages`` report group 0, the
group that binds admission (a global group holds every page of a row); window groups are sized
by :func:`create` so a row never waits for them. :meth:`group_stats` and
:meth:`layer_pages_used` cover every group.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from paxkv.attention.blocks import check_windows, layer_window
from paxkv.cache import pool as kv_pool
from paxkv.cache.layer_groups import LayerGroups, window_group_pages
from paxkv.cache.paged import attend_pages, resolve_impl
from paxkv.core.buckets import cdiv
from paxkv.core.step_info import StepInfo
from paxkv.table import page_table as pt


@functools.partial(jax.tree_util.register_dataclass, data_fields=["pool", "tables"],
                   meta_fields=["groups", "scrub", "impl", "index_pages"])
@dataclasses.dataclass(frozen=True)
class GroupedPagedCache:
    """Paged KV with one page table per layer group (:class:`paxkv.core.protocol.KVCache`).

    Attributes:
      pool: the flat pool, leaves ``[1, groups.flat_pages, kv_heads, page_size, head_dim]``.
      tables: one :class:`paxkv.table.page_table.PageTable` per group; the same rows and
        lengths in each, group ``g``'s ids ``0 .. groups.num_pages[g]`` (its sentinel last).
      groups: the layer groups (static).
      scrub, impl: as :class:`paxkv.cache.paged.PagedCache`'s (static).
      index_pages: pages of each window group (past group 0) kept for a prefix index's holds
        (:mod:`paxkv.prefix.window_index` never holds more), on top of what the rows need.
    """

    pool: kv_pool.KVPool
    tables: tuple[pt.PageTable, ...]
    groups: LayerGroups
    scrub: bool = True
    impl: str = "xla"
    index_pages: int = 0

    shares_pages = True

    # -- sizes (group 0 binds admission: see the module docstring) -------------------------
    @property
    def table(self) -> pt.PageTable:
        return self.tables[0]

    max_seqs = property(lambda self: self.table.max_seqs)
    max_len = property(lambda self: self.table.max_len)
    page_size = property(lambda self: self.table.page_size)
    num_pages = property(lambda self: self.table.num_pages)
    total_pages = property(lambda self: self.table.num_pages)
    lengths = property(lambda self: self.table.lengths)
    active = property(lambda self: self.table.active)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        return self.groups.layer_windows

    @property
    def layer_page_bytes(self) -> int:
        """K + V bytes of one page of one layer, scales included."""
        return self.pool.nbytes // self.groups.flat_pages

    @property
    def kv_bytes_per_page(self) -> int:
        """K + V bytes of one group-0 page over group 0's layers."""
        return self.layer_page_bytes * len(self.groups.members[0])

    @property
    def kv_bytes_per_device(self) -> int:
        return self.pool.nbytes

    # -- table operations, on every group -------------------------------------------------
    def reserve(self, num_new: jax.Array, *, max_new: int
                ) -> tuple["GroupedPagedCache", jax.Array]:
        """Room for ``num_new`` int32 ``[max_seqs]`` more tokens in every group, all-or-nothing
        per row across groups; ``ok`` bool ``[max_seqs]``. First each window group drops the
        pages no future query of a row can see (:func:`paxkv.table.page_table.slide`), so the
        pages it frees serve this very reservation."""
        num_new = jnp.asarray(num_new, jnp.int32)
        tables = [t if w is None else pt.slide(t, jnp.maximum(t.lengths - w + 1, 0))[0]
                  for t, w in zip(self.tables, self.groups.windows)]
        ok = functools.reduce(jnp.logical_and, [pt.reserve(t, num_new, max_new=max_new)[2]
                                                for t in tables])
        # Fewer requests never fail a row that fit before (grants go first-come by row).
        granted = [pt.reserve(t, jnp.where(ok, num_new, 0), max_new=max_new) for t in tables]
        pool = kv_pool.apply(self.pool, self._flat_update([u for _, u, _ in granted]),
                             scrub=self.scrub)
        return dataclasses.replace(self, pool=pool, tables=tuple(t for t, _, _ in granted)), ok

    def _flat_update(self, updates: list[pt.PoolUpdate]) -> pt.PoolUpdate:
        """Each group's update (group-local ids) applied to every layer of the group, as one
        update of the flat pool (ids past a group's range -> past the flat pool: no-ops)."""
        flat = self.groups.flat_pages
        parts: dict[str, list[jax.Array]] = {"fresh_pages": [], "copy_src": [], "copy_dst": []}
        for g, update in enumerate(updates):
            bases = jnp.asarray([self.groups.layer_base[i] for i in self.groups.members[g]],
                                jnp.int32)[:, None]
            for name in parts:
                ids = getattr(update, name)[None, :]
                parts[name].append(jnp.where(ids <= self.groups.num_pages[g], bases + ids,
                                             flat).reshape(-1))
        return pt.PoolUpdate(**{k: jnp.concatenate(v) for k, v in parts.items()})

    def _each(self, op, *args) -> tuple["GroupedPagedCache", jax.Array]:
        """``op(table, *args) -> (table, ok)`` on every group; ``ok`` is group 0's (the same
        rows and flags in every group, so the same answer)."""
        done = [op(t, *args) for t in self.tables]
        return dataclasses.replace(self, tables=tuple(t for t, _ in done)), done[0][1]

    def release(self, rows: jax.Array) -> tuple["GroupedPagedCache", jax.Array]:
        """Frees rows (bool ``[max_seqs]``) in every group; unshared pages are free at once."""
        return self._each(pt.release, rows)

    def fork(self, parents: jax.Array, children: jax.Array
             ) -> tuple["GroupedPagedCache", jax.Array]:
        """Children share their parents' live pages in every group (a window group's
        released pages are not shared: they are gone); ``ok`` bool ``[k]``."""
        return self._each(pt.fork, parents, children)

    def attach(self, rows: jax.Array, pages: jax.Array, lengths: jax.Array,
               first: jax.Array) -> tuple["GroupedPagedCache", jax.Array]:
        """A prefix-cache hit in every group, all-or-nothing per row: group ``g``'s
        :func:`paxkv.table.page_table.attach` of ``pages[g]`` (int32 ``[groups, k, w]``,
        group-local ids) from block ``first[g]`` (int32 ``[groups, k]``: a window group's row
        holds only its window's pages); ``ok`` bool ``[k]``."""
        rows = jnp.asarray(rows, jnp.int32)
        ok = functools.reduce(jnp.logical_and, [
            pt.attach(t, rows, pages[g], lengths, first[g])[1]
            for g, t in enumerate(self.tables)])
        kept = jnp.where(ok, rows, -1)  # a row out of range: a failed pair changes nothing
        tables = tuple(pt.attach(t, kept, pages[g], lengths, first[g])[0]
                       for g, t in enumerate(self.tables))
        return dataclasses.replace(self, tables=tables), ok

    def retain(self, pages: jax.Array, delta: int) -> "GroupedPagedCache":
        """``delta`` more references on ``pages[g]`` (int32 ``[groups, n]``, group-local ids;
        ids past a group's pool ignored) in each group: a prefix index's holds."""
        return dataclasses.replace(self, tables=tuple(
            pt.retain(t, pages[g], delta) for g, t in enumerate(self.tables)))

    def reorder(self, parents: jax.Array) -> tuple["GroupedPagedCache", jax.Array]:
        """Beam reorder in every group: block-table rows and ref counts move, K/V stays."""
        return self._each(pt.reorder, parents)

    # -- accounting -------------------------------------------------------------------------
    def free_pages(self) -> jax.Array:
        """int32 scalar: group 0's pages nobody holds."""
        return jnp.sum(self.table.ref_counts == 0).astype(jnp.int32)

    def pages_used(self) -> jax.Array:
        """int32 ``[max_seqs]``: group-0 pages each row references."""
        return pt.pages_referenced(self.table)

    def stats(self) -> pt.TableStats:
        return pt.stats(self.table)

    def sharing_stats(self) -> pt.SharingStats:
        return pt.sharing_stats(self.table)

    def group_stats(self) -> tuple[pt.TableStats, ...]:
        """Every group's :class:`~paxkv.table.page_table.TableStats`, group 0 first."""
        return tuple(pt.stats(t) for t in self.tables)

    def layer_pages_used(self) -> jax.Array:
        """int32 scalar: pages some holder keeps, summed over every group's layers (a page
        shared by rows counts once); times :attr:`layer_page_bytes` it is the K/V bytes held,
        scales included."""
        return functools.reduce(jnp.add, [jnp.sum(t.ref_counts > 0, dtype=jnp.int32) * len(m)
                                          for t, m in zip(self.tables, self.groups.members)])

    # -- attention --------------------------------------------------------------------------
    def attend(self, layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
               step: StepInfo, *, sm_scale: float | None = None,
               logit_soft_cap: float | None = None) -> tuple["GroupedPagedCache", jax.Array]:
        """:meth:`paxkv.core.protocol.KVCache.attend` for ``layer`` (traced): its group's
        table, shifted to the layer's range of the flat pool, over
        :func:`paxkv.cache.paged.attend_pages` with the layer's window."""
        g = self.groups
        layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, g.num_layers - 1)
        group = jnp.asarray(g.layer_group, jnp.int32)[layer]
        base = jnp.asarray(g.layer_base, jnp.int32)[layer]
        cells = jnp.stack([t.block_tables for t in self.tables])[group]  # [max_seqs, pages]
        sentinel = jnp.asarray(g.num_pages, jnp.int32)[group]
        view = dataclasses.replace(
            self.table, num_pages=g.flat_pages - 1,  # the flat pool's last page: a sentinel
            block_tables=jnp.where(cells == sentinel, g.flat_pages - 1, cells + base))
        pool, out = attend_pages(self.pool, view, self.impl, jnp.int32(0), q, k, v, step,
                                 sm_scale=sm_scale, logit_soft_cap=logit_soft_cap,
                                 window=layer_window(g.layer_windows, layer))
        return dataclasses.replace(self, pool=pool), out


def create(*, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int,
           page_size: int, max_seqs: int, max_len: int,
           layer_windows: tuple[int | None, ...], step_tokens: int = 4096,
           step_rows: int | None = None, window_pages: int | None = None,
           index_pages: int = 0, dtype: jnp.dtype = jnp.float32, scrub: bool = True,
           fill: float = 0.0, attention_impl: str = "auto") -> GroupedPagedCache:
    """An empty layer-grouped paged cache.

    Args:
      num_pages: pages of group 0 (the global layers, or the only window group of a model
        whose every layer slides): what admission counts.
      layer_windows: the model's, one entry per layer (None: global); at least one window.
      step_tokens: the most tokens one step adds over all rows (the engine's
        ``prefill_tokens``): sizes each window group so no row waits for its pages
        (:func:`window_group_pages`); ``step_rows``: the most rows that step spans (the
        engine's prefill call: :func:`paxkv.engine.policy.most_prefill_rows`; default all).
      window_pages: override of that size, for every window group.
      index_pages: pages added to every window group past group 0 for a prefix index to
        hold (:func:`paxkv.cache.layer_groups.prefix_index_pages`; 0: the index keeps no window page, so a model with
        a window group never hits).
      dtype, scrub, fill, attention_impl: as :func:`paxkv.cache.paged.create`.
    """
    windows = check_windows(layer_windows, num_layers)
    if windows is None:
        raise ValueError("layer_windows names no window: use paxkv.cache.paged.create")
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    first = None if None in windows else min(windows)
    if not isinstance(index_pages, int) or index_pages < 0:
        raise ValueError(f"index_pages must be an int >= 0, got {index_pages!r}")
    pages = {w: index_pages + (window_pages or window_group_pages(
        w, page_size, max_seqs, max_len, step_tokens, step_rows))
             for w in set(windows) if w is not None and w != first}
    pages[first] = num_pages
    groups = LayerGroups.of(windows, pages)
    impl = resolve_impl(attention_impl, dtype, page_size=page_size, head_dim=head_dim)
    tables = tuple(pt.create(num_pages=p, page_size=page_size, max_seqs=max_seqs,
                             max_pages_per_seq=cdiv(max_len, page_size))
                   for p in groups.num_pages)
    flat = kv_pool.create(num_layers=1, num_pages=groups.flat_pages - 1,
                          num_kv_heads=num_kv_heads, page_size=page_size, head_dim=head_dim,
                          dtype=dtype, fill=fill)
    return GroupedPagedCache(pool=flat, tables=tables, groups=groups, scrub=scrub, impl=impl,
                             index_pages=index_pages)
