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

from pallas_kernels import quant
from pallas_kernels.kv_storage import full, readable, storage_dtype, to_storage
from paxkv.attention import chunked, partials
from paxkv.attention.blocks import (attend_blocks, check_windows, default_sm_scale, in_window,
                                    layer_window)
from paxkv.attention.query_tiles import query_tiles
from paxkv.core.step_info import StepInfo


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
    (:class:`paxkv.core.protocol.KVCache`; a "page" is a whole row).

    Attributes:
      k, v: the caches; lengths: int32 ``[max_seqs]``; active: bool ``[max_seqs]``.
      scales: float32 ``[layers, max_seqs, kv_heads, 2, max_len]`` (K at 0, V at 1) when
        ``k`` / ``v`` hold 8-bit codes (:mod:`pallas_kernels.quant`), else None.
      layer_windows: each layer's sliding window (None: global), or None when no layer
        slides (static; :func:`paxkv.attention.blocks.layer_window`). A dense row keeps every
        token; a window layer only masks.
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array
    active: jax.Array
    scales: jax.Array | None = None
    layer_windows: tuple[int | None, ...] | None = dataclasses.field(
        default=None, metadata=dict(static=True))

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

    @property
    def total_pages(self) -> int:
        return self.max_seqs

    @property
    def kv_bytes_per_page(self) -> int:
        """K + V bytes of one row (its "page") over all layers, scales included."""
        return self.kv_bytes_per_device // self.max_seqs

    @property
    def kv_bytes_per_device(self) -> int:
        """Every K/V byte (one device holds it all)."""
        return sum(x.nbytes for x in self.arrays())

    def arrays(self) -> tuple[jax.Array, ...]:
        """Every per-row K/V array (row axis 1): ``(k, v)``, plus ``scales`` when scaled."""
        return (self.k, self.v) if self.scales is None else (self.k, self.v, self.scales)

    def _with_arrays(self, arrays: tuple[jax.Array, ...], **changes) -> "DenseCache":
        return dataclasses.replace(self, k=arrays[0], v=arrays[1],
                                   scales=arrays[2] if len(arrays) > 2 else None, **changes)

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
        return self._with_arrays(
            tuple(x.at[:, target].set(x[:, p], mode="drop") for x in self.arrays()),
            lengths=self.lengths.at[target].set(self.lengths[p], mode="drop"),
            active=self.active.at[target].set(True, mode="drop")), ok

    def reorder(self, parents: jax.Array) -> tuple["DenseCache", jax.Array]:
        """Row ``b`` continues row ``parents[b]`` (-1 = drop) by copying every layer's KV row:
        what a dense cache pays on each beam-search step (``cache[beam_idx]``)."""
        parents = jnp.asarray(parents, jnp.int32)
        p = jnp.clip(parents, 0, self.max_seqs - 1)
        ok = (parents >= 0) & (parents < self.max_seqs) & self.active[p]
        return self._with_arrays(tuple(x[:, p] for x in self.arrays()),
                                 lengths=jnp.where(ok, self.lengths[p], 0), active=ok), ok

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
        :meth:`paxkv.cache.paged.PagedCache.attend`; of the plan only the window applies, and
        it is checked the same way)."""
        rows = jnp.arange(self.max_seqs) if step.rows is None else step.rows
        new = _write(self.arrays(), layer, rows, step.positions, k, v)
        scores = dict(sm_scale=default_sm_scale(q.shape[-1], sm_scale),
                      logit_soft_cap=logit_soft_cap,
                      window=layer_window(self.layer_windows, layer))

        def read(window: int) -> jax.Array:
            return _attend_rows(new, layer, rows, q, step, window, scores)

        window = self.max_len if step.plan.window is None else min(self.max_len,
                                                                   step.plan.window)
        if window == self.max_len:
            out = read(window)
        else:
            live = step.query_lengths > 0
            fits = jnp.all(~live | (step.lengths <= window))
            out = lax.cond(fits, lambda: read(window), lambda: read(self.max_len))
        return self._with_arrays(new), out


def _write(arrays: tuple[jax.Array, ...], layer: jax.Array, rows: jax.Array,
           positions: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, ...]:
    """Stores ``k``, ``v`` ``[b, t, kv_heads, head_dim]`` of cache rows ``rows [b]`` at
    ``positions [b, t]`` (negative: padding, dropped) into ``arrays`` (:meth:`DenseCache.arrays`;
    a scaled cache quantises each vector and stores its scale beside it)."""
    k_all, v_all = arrays[:2]
    slot = jnp.where(positions >= 0, positions, k_all.shape[3])  # padding dropped
    at = (layer, rows[:, None], slice(None), slot)
    if len(arrays) == 2:
        return tuple(x.at[at].set(to_storage(y, x.dtype), mode="drop")
                     for x, y in ((k_all, k), (v_all, v)))
    fmt = quant.format_of_storage(k_all.dtype)
    (k_codes, k_scale), (v_codes, v_scale) = quant.quantise(k, fmt), quant.quantise(v, fmt)
    scales = arrays[2].at[layer, rows[:, None], :, :, slot].set(
        jnp.stack([k_scale, v_scale], axis=-1), mode="drop")  # [b, t, kv_heads, 2]
    return (k_all.at[at].set(k_codes, mode="drop"), v_all.at[at].set(v_codes, mode="drop"),
            scales)


def _read(arrays: tuple[jax.Array, ...], index: tuple, slots: slice | tuple = ()
          ) -> tuple[jax.Array, jax.Array]:
    """K and V at ``arrays[..][index]`` ``[..., kv_heads, n, head_dim]`` (``index`` ends at the
    kv-head axis; ``slots``: what to take of the slot axis), as attention reads them."""
    if len(arrays) == 2:
        return tuple(readable(x[index + (slice(None), slots)]) for x in arrays)
    both = arrays[2][index + (slice(None), slice(None), slots)]  # [..., kv_heads, 2, n]
    return (readable(arrays[0][index + (slice(None), slots)], both[..., 0, :]),
            readable(arrays[1][index + (slice(None), slots)], both[..., 1, :]))


def _attend_rows(arrays: tuple[jax.Array, ...], layer: jax.Array, rows: jax.Array,
                 q: jax.Array, step: StepInfo, window: int, scores: dict) -> jax.Array:
    """``q [b, t, H, Dh]`` over the first ``window`` slots of its rows -> ``[b, t, H, Dh]``:
    one wide pass on a GPU; on a CPU decode in row groups, prefill in query tiles."""
    if not chunked.tiles_pay():
        k_ctx, v_ctx = (x[:, None] for x in _read(arrays, (layer, rows), slice(None, window)))
        return attend_blocks(q, k_ctx, v_ctx, step.positions, step.lengths, **scores)
    if q.shape[1] == 1:
        return _decode_in_row_groups(arrays, layer, rows, q, step, window, scores)

    def read(row: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
        # [1, 1, kv_heads, n, head_dim] each; the slice is static, the row dynamic
        return tuple(x[None, None] for x in _read(arrays, (layer, row), slice(None, n)))

    return query_tiles(q, step.positions, step.lengths, rows, read, width=window, unit=1,
                       **scores)


# Keys per decode tile: the paged path's 32 chunks of 128 (paxkv.cache.paged.TILE_CHUNKS).
TILE_TOKENS = 4096


def _decode_in_row_groups(arrays: tuple[jax.Array, ...], layer: jax.Array,
                          rows: jax.Array, q: jax.Array, step: StepInfo, window: int,
                          scores: dict) -> jax.Array:
    """Decode attention ``q [b, 1, heads, d]`` a group of rows at a time under ``lax.map``
    (``TILE_TOKENS`` keys a group, the batch split evenly) -> ``[b, 1, heads, d]``, through
    the paged path's inner product (:func:`paxkv.attention.partials.keys_partial`)."""
    batch = q.shape[0]
    group = 1
    while 2 * group * window <= TILE_TOKENS and batch % (2 * group) == 0:
        group *= 2
    _, _, kv_heads, _, head_dim = arrays[0].shape
    key_pos = jnp.arange(window)
    scores = dict(scores)
    slide = scores.pop("window")  # the layer's sliding window (None: global)

    def one(args: tuple[jax.Array, ...]) -> jax.Array:
        q_g, rows_g, positions, lengths = args  # [group, 1, heads, d], [group], [group, 1], ..
        live = ((key_pos[None] < lengths[:, None]) & (key_pos[None] <= positions)
                & (positions >= 0))  # [group, window]
        if slide is not None:
            live &= in_window(key_pos[None], positions, slide)

        def read(kv: jax.Array, *slots: slice | int) -> jax.Array:
            return partials.read_in_range(kv, layer, rows_g, slice(None), *slots)

        window_slots = slice(None, window)
        k, v = read(arrays[0], window_slots), read(arrays[1], window_slots)
        if len(arrays) == 2:
            k, v = readable(k), readable(v)  # [group, kv_heads, window, d]
        else:
            both = read(arrays[2], slice(None), window_slots)  # [group, kv_heads, 2, window]
            k, v = readable(k, both[:, :, 0]), readable(v, both[:, :, 1])
        parts = partials.keys_partial(q_g.reshape(group, kv_heads, -1, head_dim),
                                     k.swapaxes(-1, -2), v, live, **scores)
        return partials.finish(parts, q.dtype)[:, None]

    split = lambda x: x.reshape((batch // group, group) + x.shape[1:])  # noqa: E731
    out = lax.map(one, (split(q), split(rows), split(step.positions), split(step.lengths)))
    return out.reshape(q.shape)


def create(*, num_layers: int, num_kv_heads: int, head_dim: int, max_seqs: int, max_len: int,
           dtype: jnp.dtype = jnp.float32, fill: float = 0.0,
           layer_windows: tuple[int | None, ...] | None = None) -> DenseCache:
    """An empty dense cache reserving ``max_len`` slots for each of ``max_seqs`` rows, K/V in
    ``dtype`` (stored as the paged pool stores it: :mod:`pallas_kernels.kv_storage`; int8 / fp8 as
    codes plus scales, :mod:`pallas_kernels.quant`). ``layer_windows``: the model's
    (:attr:`paxkv.Model.layer_windows`), one entry per layer."""
    if max_len < 1 or max_seqs < 1:
        raise ValueError(f"max_len and max_seqs must be >= 1, got {max_len}, {max_seqs}")
    windows = check_windows(layer_windows, num_layers)
    shape = (num_layers, max_seqs, num_kv_heads, max_len, head_dim)
    rows = dict(lengths=jnp.zeros((max_seqs,), jnp.int32), active=jnp.zeros((max_seqs,), bool))
    storage_dtype(dtype)  # a dtype the cache cannot serve raises here
    fmt = quant.format_of(dtype)
    if fmt is None:
        return DenseCache(k=full(shape, fill, dtype), v=full(shape, fill, dtype), **rows,
                          layer_windows=windows)
    codes, scale = quant.full_codes(shape, fill, fmt)
    return DenseCache(k=codes, v=jnp.array(codes), **rows,
                      scales=jnp.full(shape[:3] + (2, max_len), scale, jnp.float32),
                      layer_windows=windows)
