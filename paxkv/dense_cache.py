"""The dense twin: ``max_len`` slots reserved per sequence, same protocol as the paged cache.

It exists for comparison: every test and experiment can swap one for the other. Forking
copies KV rows (what a dense cache must do), and memory is ``max_seqs * max_len`` slots
whatever the sequences actually hold. Its attention gets the same CPU-cache tiling as the paged
path (decode: a few rows at a time; prefill: one row's query tile at a time, reading only the
keys it can see), so a paged vs dense comparison measures paging, not tiling; what it lacks by
nature is the paged chunk list's raggedness: every row reads the whole window.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax import lax

from paxkv.attention import chunked, partials
from paxkv.attention.query_tiles import query_tiles
from paxkv.kv_storage import full, readable, to_storage
from paxkv.attention.blocks import attend_blocks, default_sm_scale
from paxkv.step_info import StepInfo


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseStats:
    """Reserved vs filled slots of a dense cache."""

    reserved_slots: jax.Array
    tokens_held: jax.Array
    waste: jax.Array  # float32: reserved-but-empty slots / reserved slots
    active_seqs: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseCache:
    """Per-sequence KV ``[layers, max_seqs, kv_heads, max_len, head_dim]``
    (:class:`paxkv.protocol.KVCache`; a "page" is a whole row).

    Attributes:
      k, v: the caches; lengths: int32 ``[max_seqs]``; active: bool ``[max_seqs]``.
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array
    active: jax.Array

    shares_pages = False

    @property
    def max_seqs(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def page_size(self) -> int:
        return self.max_len

    @property
    def num_pages(self) -> int:
        return self.max_seqs

    def free_pages(self) -> jax.Array:
        """int32 scalar: free rows."""
        return jnp.sum(~self.active).astype(jnp.int32)

    def pages_used(self) -> jax.Array:
        """int32 ``[max_seqs]``: 1 per active row."""
        return self.active.astype(jnp.int32)

    def reserve(self, num_new: jax.Array, *, max_new: int) -> tuple["DenseCache", jax.Array]:
        """Grows lengths by ``num_new`` where it fits in ``max_len``; ``ok`` per row."""
        num_new = jnp.asarray(num_new, jnp.int32)
        new_len = self.lengths + num_new
        ok = (num_new >= 0) & (num_new <= max_new) & (new_len <= self.max_len)
        return dataclasses.replace(
            self, lengths=jnp.where(ok, new_len, self.lengths),
            active=self.active | (ok & (num_new > 0))), ok

    def release(self, rows: jax.Array) -> tuple["DenseCache", jax.Array]:
        ok = jnp.asarray(rows, bool) & self.active
        return dataclasses.replace(self, lengths=jnp.where(ok, 0, self.lengths),
                                   active=self.active & ~ok), ok

    def fork(self, parents: jax.Array, children: jax.Array) -> tuple["DenseCache", jax.Array]:
        """Copies each parent's KV row into its child (every layer, all ``max_len`` slots)."""
        parents = jnp.asarray(parents, jnp.int32)
        children = jnp.asarray(children, jnp.int32)
        s = self.max_seqs
        in_range = (parents >= 0) & (parents < s) & (children >= 0) & (children < s)
        p, c = jnp.clip(parents, 0, s - 1), jnp.clip(children, 0, s - 1)
        uses = jnp.zeros((s,), jnp.int32).at[jnp.where(in_range, c, s)].add(1, mode="drop")
        ok = in_range & self.active[p] & ~self.active[c] & (uses[c] == 1)
        target = jnp.where(ok, c, s)
        return dataclasses.replace(
            self, k=self.k.at[:, target].set(self.k[:, p], mode="drop"),
            v=self.v.at[:, target].set(self.v[:, p], mode="drop"),
            lengths=self.lengths.at[target].set(self.lengths[p], mode="drop"),
            active=self.active.at[target].set(True, mode="drop")), ok

    def reorder(self, parents: jax.Array) -> tuple["DenseCache", jax.Array]:
        """Row ``b`` continues row ``parents[b]`` (-1 = drop) by copying every layer's KV row:
        what a dense cache pays on each beam-search step (``cache[beam_idx]``)."""
        parents = jnp.asarray(parents, jnp.int32)
        p = jnp.clip(parents, 0, self.max_seqs - 1)
        ok = (parents >= 0) & (parents < self.max_seqs) & self.active[p]
        return dataclasses.replace(
            self, k=self.k[:, p], v=self.v[:, p], lengths=jnp.where(ok, self.lengths[p], 0),
            active=ok), ok

    def stats(self) -> DenseStats:
        reserved = jnp.sum(self.active) * self.max_len
        held = jnp.sum(self.lengths)
        return DenseStats(reserved_slots=reserved, tokens_held=held,
                          waste=jnp.where(reserved > 0, 1.0 - held / jnp.maximum(reserved, 1),
                                          0.0).astype(jnp.float32),
                          active_seqs=jnp.sum(self.active))

    def attend(self, layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
               step: StepInfo, *, sm_scale: float | None = None,
               logit_soft_cap: float | None = None) -> tuple["DenseCache", jax.Array]:
        """Writes this step's K/V at their positions, then attends (same contract as
        :meth:`paxkv.paged_cache.PagedCache.attend`; of the plan only the window applies, and
        it is checked the same way)."""
        rows = jnp.arange(self.max_seqs) if step.rows is None else step.rows
        slot = jnp.where(step.positions >= 0, step.positions, self.max_len)  # padding dropped
        new_k, new_v = (x.at[layer, rows[:, None], :, slot].set(to_storage(y, x.dtype), mode="drop")
                        for x, y in ((self.k, k), (self.v, v)))
        scores = dict(sm_scale=default_sm_scale(q.shape[-1], sm_scale),
                      logit_soft_cap=logit_soft_cap)

        def read(window: int) -> jax.Array:
            return _attend_rows(new_k, new_v, layer, rows, q, step, window, scores)

        window = self.max_len if step.plan.window is None else min(self.max_len,
                                                                   step.plan.window)
        if window == self.max_len:
            out = read(window)
        else:
            live = step.query_lengths > 0
            fits = jnp.all(~live | (step.lengths <= window))
            out = lax.cond(fits, lambda: read(window), lambda: read(self.max_len))
        return dataclasses.replace(self, k=new_k, v=new_v), out


def _attend_rows(k_all: jax.Array, v_all: jax.Array, layer: jax.Array, rows: jax.Array,
                 q: jax.Array, step: StepInfo, window: int, scores: dict) -> jax.Array:
    """``q [b, t, H, Dh]`` over the first ``window`` slots of its rows -> ``[b, t, H, Dh]``:
    one wide pass on a GPU; on a CPU decode in row groups, prefill in query tiles."""
    if not chunked.tiles_pay():
        k_ctx, v_ctx = (readable(x[layer, rows, :, :window])[:, None] for x in (k_all, v_all))
        return attend_blocks(q, k_ctx, v_ctx, step.positions, step.lengths, **scores)
    if q.shape[1] == 1:
        return _decode_in_row_groups(k_all, v_all, layer, rows, q, step, window, scores)
    _, _, kv_heads, _, head_dim = k_all.shape

    def read(row: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
        at, size = (layer, row, 0, 0, 0), (1, 1, kv_heads, n, head_dim)
        return (readable(lax.dynamic_slice(k_all, at, size)),
                readable(lax.dynamic_slice(v_all, at, size)))

    return query_tiles(q, step.positions, step.lengths, rows, read, width=window, unit=1,
                       **scores)


# Keys per decode tile: the paged path's 32 chunks of 128 (paxkv.paged_cache.TILE_CHUNKS).
TILE_TOKENS = 4096


def _decode_in_row_groups(k_all: jax.Array, v_all: jax.Array, layer: jax.Array,
                          rows: jax.Array, q: jax.Array, step: StepInfo, window: int,
                          scores: dict) -> jax.Array:
    """Decode attention ``q [b, 1, heads, d]`` a group of rows at a time under ``lax.map``
    (``TILE_TOKENS`` keys a group, the batch split evenly) -> ``[b, 1, heads, d]``, through
    the paged path's inner product (:func:`paxkv.attention.partials.keys_partial`)."""
    batch = q.shape[0]
    group = 1
    while 2 * group * window <= TILE_TOKENS and batch % (2 * group) == 0:
        group *= 2
    _, _, kv_heads, _, head_dim = k_all.shape
    key_pos = jnp.arange(window)

    def one(args: tuple[jax.Array, ...]) -> jax.Array:
        q_g, rows_g, positions, lengths = args  # [group, 1, heads, d], [group], [group, 1], ..
        live = ((key_pos[None] < lengths[:, None]) & (key_pos[None] <= positions)
                & (positions >= 0))  # [group, window]

        def read(kv: jax.Array) -> jax.Array:  # [group, kv_heads, window, d]
            return readable(partials.read_in_range(kv, layer, rows_g, slice(None),
                                                  slice(None, window)))

        parts = partials.keys_partial(q_g.reshape(group, kv_heads, -1, head_dim),
                                     read(k_all).swapaxes(-1, -2), read(v_all), live,
                                     **scores)
        return partials.finish(parts, q.dtype)[:, None]

    split = lambda x: x.reshape((batch // group, group) + x.shape[1:])  # noqa: E731
    out = lax.map(one, (split(q), split(rows), split(step.positions), split(step.lengths)))
    return out.reshape(q.shape)


def create(*, num_layers: int, num_kv_heads: int, head_dim: int, max_seqs: int, max_len: int,
           dtype: jnp.dtype = jnp.float32, fill: float = 0.0) -> DenseCache:
    """An empty dense cache reserving ``max_len`` slots for each of ``max_seqs`` rows, K/V in
    ``dtype`` (stored as the paged pool stores it: :mod:`paxkv.kv_storage`)."""
    if max_len < 1 or max_seqs < 1:
        raise ValueError(f"max_len and max_seqs must be >= 1, got {max_len}, {max_seqs}")
    shape = (num_layers, max_seqs, num_kv_heads, max_len, head_dim)
    return DenseCache(k=full(shape, fill, dtype), v=full(shape, fill, dtype),
                      lengths=jnp.zeros((max_seqs,), jnp.int32),
                      active=jnp.zeros((max_seqs,), bool))
