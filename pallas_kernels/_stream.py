"""The in-kernel steps of the paged K/V stream: fetch a block's pages (and scales) into SMEM,
load it into registers (dequantising 8-bit codes), run one row's online-softmax step (the
CUDA-core kernels); or feed a ring of stages from a producer warpgroup and run one stage's
online-softmax step for 64 query rows on WGMMA (the tensor-core kernels,
:mod:`pallas_kernels.tensor_cores.decode` and :mod:`pallas_kernels.tensor_cores.prefill`).

Geometry, SMEM layout and the trace-time checks are in ``_tiles.py``; the kernels call these
from their bodies, so everything here runs inside a Mosaic GPU kernel (or its interpreter).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _interpret, quant
from pallas_kernels._tiles import KVTiles

_DEAD_POSITION = 2**30  # key position of a dead SMEM row: never visible, never live
MAX_WINDOW = 2**30  # a sliding window at least this long is no window


@dataclasses.dataclass(frozen=True)
class KVStream:
    """One program's refs of the stream: GMEM pools and table, SMEM buffers, barriers."""

    k: Any  # [layers, num_pages, kv_heads, page_size, head_dim] GMEM
    v: Any
    scales: Any  # f32 [layers, num_pages, kv_heads, 2 * page_size] GMEM (K | V), or None
    block_tables: Any  # int32 [batch, max_pages] GMEM
    k_smem: Any  # [2, block_rows, head_dim] (tiled, swizzled)
    v_smem: Any
    s_smem: Any  # f32 [2, scale_slot_len], or None
    bars: Any  # 2 barriers, copies_per_page * pages_per_block arrivals each


@dataclasses.dataclass(frozen=True)
class Block:
    """One block in registers. k, v: ``[block_rows, head_dim]`` storage values (fp8 widened
    to float32), V zeroed at dead rows; kpos: int32 ``[block_rows]`` key positions (dead padding
    rows: never visible); k_mult: f32 ``[block_rows]`` K scale x sm_scale, v_mult: V scale
    (zero at dead rows), both None for float pages."""

    k: jax.Array
    v: jax.Array
    kpos: jax.Array
    k_mult: jax.Array | None = None
    v_mult: jax.Array | None = None


def read_layer(tiles: KVTiles, ints_ref):
    """The layer to read (``ints_ref[0]``), clipped so that no DMA ever leaves the pool."""
    return jnp.clip(ints_ref[0], 0, tiles.num_layers - 1)


def read_window(ints_ref):
    """The sliding window (keys a query sees, its own included) from ``ints_ref[1]``, clipped
    to ``[1, MAX_WINDOW]``: every query sees at least itself, and no position arithmetic on
    it overflows int32."""
    return jnp.clip(ints_ref[1], 1, MAX_WINDOW)


def fetch_block(tiles: KVTiles, st: KVStream, layer, b, h, block, live_pages, slot,
                table=None, first_page=0) -> None:
    """Starts the TMA copies of block ``block`` of ``layer`` into ``slot``; pages past
    ``live_pages`` are not read (their share of the barrier is arrived without data).
    ``table``: the row's block-table columns from ``first_page`` on, already in SMEM (else
    each page id is read from the GMEM table)."""
    s, w = tiles.page_size, tiles.slot_rows
    for i in range(tiles.pages_per_block):
        j = block * tiles.pages_per_block + i

        @pl.when(j < live_pages)
        def _copy():
            page = st.block_tables[b, j] if table is None else table[j - first_page]
            page = jnp.clip(page, 0, tiles.num_pages - 1)  # stay in the pool
            dst = pl.ds(i * w, s)
            bar = st.bars.at[slot]
            plgpu.copy_gmem_to_smem(st.k.at[layer, page, h], st.k_smem.at[slot, dst], bar)
            plgpu.copy_gmem_to_smem(st.v.at[layer, page, h], st.v_smem.at[slot, dst], bar)
            for src, dst_off, n in tiles.scale_copies(i):
                plgpu.copy_gmem_to_smem(st.scales.at[layer, page, h, pl.ds(src, n)],
                                        st.s_smem.at[slot, pl.ds(dst_off, n)], bar)

        @pl.when(j >= live_pages)
        def _skip():
            for _ in range(tiles.copies_per_page):
                plgpu.barrier_arrive(st.bars.at[slot])


def key_positions(tiles: KVTiles, rows, kpos0):
    """int32 key position of each SMEM row index in ``rows`` (any shape) of a block starting at
    ``kpos0``; dead rows between pages get a position no query sees and no length reaches."""
    if tiles.slot_rows == tiles.page_size:
        return rows + kpos0
    in_page = lax.rem(rows, tiles.slot_rows)
    pos = kpos0 + lax.div(rows, tiles.slot_rows) * tiles.page_size + in_page
    return jnp.where(in_page < tiles.page_size, pos, _DEAD_POSITION)


def load_block(tiles: KVTiles, lay: _interpret.Layouts, st: KVStream, slot, kpos0, length,
               sm_scale: float, kpos_lo=None) -> Block:
    """Block ``slot`` (first key at position ``kpos0``) into registers; see :class:`Block`.
    Keys at ``length`` and beyond (and, with a sliding window, before ``kpos_lo``: the first
    key any query of the program sees) are dead: their V and V scales are zeroed.
    NOTE: V and its scales are zeroed with ``where``: p == 0 times NaN would still be NaN.
    int8 codes are always finite, so there only the V scales need it."""
    t, d = tiles.block_rows, tiles.head_dim
    k, v = st.k_smem[slot], st.v_smem[slot]
    if tiles.dtype == quant.FP8_BITS:  # Mosaic GPU computes on no 8-bit float: widen first
        k, v = (lax.bitcast_convert_type(x, quant.FP8).astype(jnp.float32) for x in (k, v))

    def live(pos):
        return pos < length if kpos_lo is None else (pos < length) & (pos >= kpos_lo)

    kpos = key_positions(tiles, lay.iota((t,), 0, lay.row), kpos0)
    if tiles.dtype != jnp.int8:
        live_tile = live(key_positions(tiles, lay.iota((t, d), 0, lay.tile), kpos0))
        v = jnp.where(live_tile, v, jnp.zeros((), v.dtype))
    if not tiles.scaled:
        return Block(k, v, kpos)
    k_scale = lay.load(st.s_smem, (slot, pl.ds(0, t)), lay.row)
    v_scale = lay.load(st.s_smem, (slot, pl.ds(tiles.v_scale_offset, t)), lay.row)
    k_mult = k_scale * sm_scale
    v_mult = jnp.where(live(kpos), v_scale, 0.0)
    return Block(k, v, kpos, k_mult, v_mult)


def softmax_update(lay, q_smem, blk: Block, visible, m_prev, l_prev, acc_ref, r, *, sm_scale,
                   soft_cap):
    """Row ``r``'s online-softmax step over one block; returns the new (max, sum).

    q_smem: ``[rows, head_dim]``; blk: :class:`Block`; visible: bool ``[block_rows]``; m_prev,
    l_prev: f32 scalars; acc_ref: f32 ``[rows, head_dim]`` SMEM, row ``r`` updated in place.
    The caller guarantees ``visible`` has at least one True, so the new max is finite.
    """
    t, d = blk.k.shape
    q = lay.load(q_smem, r, lay.col).astype(jnp.float32)
    s = jnp.sum(blk.k.astype(jnp.float32) * lax.broadcast_in_dim(q, (t, d), [1]), axis=1)
    s = s * (sm_scale if blk.k_mult is None else blk.k_mult)
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m_prev, jnp.max(s))
    alpha = jnp.exp(m_prev - m_new)  # exp(-inf) = 0 on the first visible block
    p = jnp.exp(s - m_new)
    pw = p if blk.v_mult is None else p * blk.v_mult
    pv = jnp.sum(lax.broadcast_in_dim(pw, (t, d), [0]) * blk.v.astype(jnp.float32), axis=0)
    acc_ref[r] = lay.load(acc_ref, r, lay.col) * alpha + pv
    return m_new, l_prev * alpha + jnp.sum(p)


def zero_rows(lay, acc_ref, lo, hi, head_dim: int) -> None:
    """acc rows ``[lo, hi)`` <- 0."""
    @pl.loop(lo, hi)
    def _zero(r):
        acc_ref[r] = lay.cast(jnp.zeros((head_dim,), jnp.float32), lay.col)


def produce_blocks(tiles: KVTiles, st: KVStream, layer, b, h, start, n_blocks, live_pages,
                   consumed, stages: int, table_smem, table_bar) -> None:
    """A producer warpgroup's whole work: blocks ``start .. start + n_blocks - 1`` into a ring
    of ``stages`` slots, each copy started once the consumer has released its slot
    (``consumed``: one barrier a slot, one arrival a release). The split's block-table
    columns come into ``table_smem`` first, in one copy, so no page copy waits on a GMEM read
    of its page id. At the end it awaits the last releases, so every barrier phase is
    observed (the interpreter insists) and no copy is left in flight when the program ends."""
    first_page = start * tiles.pages_per_block

    @pl.when(n_blocks > 0)
    def _table():
        span = table_smem.shape[0]  # the caller pads the table so this slice stays inside
        plgpu.copy_gmem_to_smem(st.block_tables.at[b, pl.ds(first_page, span)], table_smem,
                                table_bar.at[0])
        plgpu.barrier_wait(table_bar.at[0])

    def issue(j, _):
        slot = lax.rem(j, stages)
        pl.when(j >= stages)(lambda: plgpu.barrier_wait(consumed.at[slot]))
        fetch_block(tiles, st, layer, b, h, start + j, live_pages, slot, table_smem,
                    first_page)
        return ()

    def drain(j, _):
        plgpu.barrier_wait(consumed.at[lax.rem(j, stages)])
        return ()

    lax.fori_loop(0, n_blocks, issue, ())
    lax.fori_loop(jnp.maximum(n_blocks - stages, 0), n_blocks, drain, ())


# ---------------------------------------------------------------- tensor cores (WGMMA)


def keys_for_scores(k_stage, kt_smem, interpret: bool):
    """The ``[D, T]`` right operand of ``Q @ K^T`` for stage ``k_stage`` ``[T, D]``: a
    transposed view on the GPU; interpreted (jax 0.10.2 runs no WGMMA on a transposed view),
    a transposed copy written to ``kt_smem`` first."""
    if not interpret:
        return plgpu.transpose_ref(k_stage, (1, 0))
    kt_smem[...] = k_stage[...].T
    plgpu.commit_smem()
    return kt_smem


def mma(a, b, shape):
    """``a @ b`` on WGMMA into a fresh float32 accumulator of ``shape`` (registers)."""
    def run(acc):
        plgpu.wgmma(acc, a, b)
        return acc[...]
    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


LOG2E = 1.4426950408889634  # log2(e): scores move to base 2, exp2 is the hardware's


def mma_state(lay: _interpret.Layouts, rows: int, head_dim: int):
    """The online softmax's start for ``rows`` query rows: output 0, max -inf, sum 0."""
    return (lay.cast(jnp.zeros((rows, head_dim), jnp.float32), lay.tile),
            lay.cast(jnp.full((rows,), -jnp.inf, jnp.float32), lay.row),
            lay.cast(jnp.zeros((rows,), jnp.float32), lay.row))


def mma_block(lay: _interpret.Layouts, state, q_smem, k_stage, v_stage, kt_smem, p_smem,
              visible, kpos0, length, *, scale: float, soft_cap: float | None):
    """One stage's online-softmax step on tensor cores -> the new ``(o, max, sum)``.

    q_smem ``[R, D]``; k_stage, v_stage ``[T, D]`` (the stage's keys at ``kpos0 ...``);
    ``visible`` bool ``[R, T]``: which key each row sees; ``length``: keys at it and past it
    are dead, and their V rows are set to 0 in SMEM first (``0 * NaN`` is NaN in a tensor
    core too). ``scale``: ``sm_scale * log2(e)`` (or ``sm_scale`` with a ``soft_cap``, applied
    here); the max is kept in base 2. A row that has seen no key keeps max -inf, sum 0."""
    o, m, l = state
    rows, t = visible.shape
    d = v_stage.shape[-1]
    s = mma(q_smem, keys_for_scores(k_stage, kt_smem, lay.interpret), (rows, t)) * scale
    if soft_cap:
        s = (soft_cap * LOG2E) * jnp.tanh(s / soft_cap)
    s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no key yet: exp2(-inf) = 0, not NaN
    alpha = jnp.exp2(m - m_use)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_use, (rows, t), [0]))
    l = l * alpha + jnp.sum(p, axis=1)
    p_smem[...] = p.astype(p_smem.dtype)

    @pl.when(kpos0 + t > length)  # the last live block: dead V rows -> 0
    def _zero_dead():
        keys = lay.iota((t, d), 0, lay.tile) + kpos0
        v_stage[...] = jnp.where(keys < length, v_stage[...], jnp.zeros((), v_stage.dtype))

    plgpu.commit_smem()
    pv = mma(p_smem, v_stage, (rows, d))
    return o * lax.broadcast_in_dim(alpha, (rows, d), [0]) + pv, m_new, l


def mma_normalised(state, dtype):
    """``o / sum`` per row in ``dtype``; a row that saw no key is 0."""
    o, _, l = state
    inv = jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)
    return (o * lax.broadcast_in_dim(inv, o.shape, [0])).astype(dtype)
