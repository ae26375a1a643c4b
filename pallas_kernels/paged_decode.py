"""Paged decode attention: a Mosaic GPU Pallas kernel (``plgpu``), one query token per sequence.

One program per (sequence ``b``, kv head ``h``, context split ``s``) serves every query head of
the GQA group together, so each K/V page is read once per kv head::

    split s of sequence b: blocks [s*bps, (s+1)*bps) of T = pages_per_block * page_size tokens

    block_tables[b]         -> page ids (read one by one from GMEM inside the kernel)
    k_pages[layer, page, h] -> TMA copy -> k_smem[slot, i*page_size : (i+1)*page_size]   (V too)
                               slot = block % 2: block j+1 is in flight while block j is computed

Pages are one layer ``[num_pages, kv_heads, page_size, head_dim]``, or with ``layer=`` (an int32
scalar the kernel reads from GMEM, like the block table) the whole pool ``[num_layers,
num_pages, ...]``: a model scanning over layers then hands the pool straight to the custom call,
where ``pool[layer]`` would make XLA copy a whole layer of K/V into a fresh buffer first. Inside
the kernel both are 5-D: one layer is a pool of one (a free reshape) read at layer 0.

Each block: scores ``[T]`` per query head on CUDA cores (see ``_interpret.py`` for why not
WGMMA), online softmax with float32 running max / sum / accumulator in SMEM. A split writes
unnormalised partials; the wrapper combines splits with one log-sum-exp rescale. Splits and
blocks past ``lengths[b]`` are skipped, and everything past ``lengths[b]`` is masked with
``where`` so NaN in free pages or behind table padding never reaches an output.

Layers: kernel body -> call builder -> public jitted wrapper -> reference (oracle).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _interpret
from pallas_kernels.reference import default_sm_scale, paged_decode_attention_reference

SMEM_BUDGET_BYTES = 200 * 1024  # H100/H200 allow 227 KiB per block; keep headroom
_ROW_ALIGN = 64  # rows of a WGMMA-layout register tile
_SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class KVTiles:
    """Static geometry of the paged K/V stream (shared with the prefill kernel)."""

    num_layers: int
    num_pages: int  # per layer
    max_pages: int  # block-table width
    page_size: int
    pages_per_block: int
    head_dim: int
    dtype: jnp.dtype

    @property
    def block_tokens(self) -> int:
        return self.pages_per_block * self.page_size

    @property
    def itemsize(self) -> int:
        return jnp.dtype(self.dtype).itemsize

    def smem_bytes(self) -> int:
        return 2 * 2 * self.block_tokens * self.head_dim * self.itemsize  # K, V x 2 slots

    def scratch(self) -> list:
        """K and V double buffers ``[2, block_tokens, head_dim]`` and one barrier per slot."""
        transforms = (plgpu.TilingTransform((8, 128 // self.itemsize)),  # rows are whole
                      plgpu.SwizzleTransform(128))  # multiples of 128 bytes (validate_kv)
        buf = plgpu.SMEM((2, self.block_tokens, self.head_dim), self.dtype, transforms=transforms)
        return [buf, buf, plgpu.Barrier(num_arrivals=2 * self.pages_per_block, num_barriers=2)]


def pool_operands(k_pages, v_pages, layer):
    """-> ``(k_pool, v_pool, layer_arr)``: 5-D pools and int32 ``[1]``, what every kernel takes.

    ``layer=None``: one layer's 4-D pages become a pool of one layer (a bitcast, no copy).
    """
    ndim = 4 if layer is None else 5
    if k_pages.ndim != ndim or k_pages.shape != v_pages.shape:
        want = "[num_pages, " if layer is None else "with layer=: [num_layers, num_pages, "
        raise ValueError(f"k_pages and v_pages must both be {want}num_kv_heads, page_size,"
                         f" head_dim]; got {k_pages.shape} and {v_pages.shape}")
    if layer is None:
        return k_pages[None], v_pages[None], jnp.zeros((1,), jnp.int32)
    if jnp.ndim(layer) != 0 or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
        raise ValueError(f"layer must be an integer scalar; got {jnp.result_type(layer)}"
                         f"{list(jnp.shape(layer))}")
    return k_pages, v_pages, jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))


def validate_kv(k_pages, v_pages, block_tables, pages_per_block: int) -> KVTiles:
    """Trace-time checks shared by the attention kernels on the 5-D pools of
    :func:`pool_operands`; errors say what to change."""
    if k_pages.dtype != v_pages.dtype or k_pages.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"k_pages/v_pages dtypes {k_pages.dtype}/{v_pages.dtype}: use one of"
                         " float32, bfloat16, float16 for both")
    if block_tables.ndim != 2 or block_tables.dtype != jnp.int32:
        raise ValueError("block_tables must be int32 [batch, max_pages_per_seq]; got"
                         f" {block_tables.dtype}{list(block_tables.shape)}")
    num_layers, num_pages, _, page_size, head_dim = k_pages.shape
    tiles = KVTiles(num_layers, num_pages, block_tables.shape[1], page_size, pages_per_block,
                    head_dim, jnp.dtype(k_pages.dtype))
    if page_size % 8:
        raise ValueError(f"page_size={page_size} must be a multiple of 8 (SMEM row tiling)")
    if tiles.block_tokens % _ROW_ALIGN:
        raise ValueError(f"pages_per_block * page_size = {tiles.block_tokens} must be a multiple"
                         f" of {_ROW_ALIGN}; try pages_per_block={default_pages_per_block(page_size)}")
    if (head_dim * tiles.itemsize) % 128:
        raise ValueError(f"head_dim={head_dim} x {tiles.itemsize} bytes must be a multiple of 128"
                         " bytes (whole TMA rows): use head_dim 64 or 128")
    return tiles


def default_pages_per_block(page_size: int) -> int:
    """Fewest pages whose tokens fill whole 64-row register tiles."""
    return math.lcm(_ROW_ALIGN, page_size) // page_size


# ---------------------------------------------------------------- kernel building blocks


def read_layer(tiles: KVTiles, layer_ref):
    """The layer to read, clipped so that no DMA ever leaves the pool."""
    return jnp.clip(layer_ref[0], 0, tiles.num_layers - 1)


def fetch_block(tiles: KVTiles, refs, layer, b, h, block, live_pages, slot) -> None:
    """Starts the TMA copies of block ``block`` of ``layer`` into ``slot``; pages past
    ``live_pages`` are not read (their share of the barrier is arrived without data)."""
    k_ref, v_ref, bt_ref, k_smem, v_smem, bars = refs
    s = tiles.page_size
    for i in range(tiles.pages_per_block):
        j = block * tiles.pages_per_block + i

        @pl.when(j < live_pages)
        def _copy():
            page = jnp.clip(bt_ref[b, j], 0, tiles.num_pages - 1)  # never DMA out of the pool
            dst = pl.ds(i * s, s)
            plgpu.copy_gmem_to_smem(k_ref.at[layer, page, h], k_smem.at[slot, dst],
                                    bars.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[layer, page, h], v_smem.at[slot, dst],
                                    bars.at[slot])

        @pl.when(j >= live_pages)
        def _skip():
            plgpu.barrier_arrive(bars.at[slot])
            plgpu.barrier_arrive(bars.at[slot])


def load_block(tiles: KVTiles, lay: _interpret.Layouts, k_smem, v_smem, slot, kpos0, length):
    """-> k, v ``[T, head_dim]`` (storage dtype, V zeroed at keys >= length) and key positions
    ``[T]``. NOTE: V is zeroed with ``where``: p == 0 times NaN would still be NaN."""
    t, d = tiles.block_tokens, tiles.head_dim
    k = k_smem[slot]
    v = v_smem[slot]
    live = lay.iota((t, d), 0, lay.tile) + kpos0 < length
    v = jnp.where(live, v, jnp.zeros((), v.dtype))
    return k, v, lay.iota((t,), 0, lay.row) + kpos0


def softmax_update(lay, q_smem, k, v, visible, m_prev, l_prev, acc_ref, r, *, sm_scale,
                   soft_cap):
    """Row ``r``'s online-softmax step over one block; returns the new (max, sum).

    q_smem: ``[rows, head_dim]``; k, v: ``[T, head_dim]``; visible: bool ``[T]``; m_prev,
    l_prev: f32 scalars; acc_ref: f32 ``[rows, head_dim]`` SMEM, row ``r`` updated in place.
    The caller guarantees ``visible`` has at least one True, so the new max is finite.
    """
    t, d = k.shape
    q = lay.load(q_smem, r, lay.col).astype(jnp.float32)
    s = jnp.sum(k.astype(jnp.float32) * lax.broadcast_in_dim(q, (t, d), [1]), axis=1) * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m_prev, jnp.max(s))
    alpha = jnp.exp(m_prev - m_new)  # exp(-inf) = 0 on the first visible block
    p = jnp.exp(s - m_new)
    pv = jnp.sum(lax.broadcast_in_dim(p, (t, d), [0]) * v.astype(jnp.float32), axis=0)
    acc_ref[r] = lay.load(acc_ref, r, lay.col) * alpha + pv
    return m_new, l_prev * alpha + jnp.sum(p)


def zero_rows(lay, acc_ref, lo, hi, head_dim: int) -> None:
    """acc rows ``[lo, hi)`` <- 0."""
    @pl.loop(lo, hi)
    def _zero(r):
        acc_ref[r] = lay.cast(jnp.zeros((head_dim,), jnp.float32), lay.col)


# ---------------------------------------------------------------- layer 1: kernel body


@dataclasses.dataclass(frozen=True)
class _DecodeSpec:
    tiles: KVTiles
    group: int
    group_pad: int  # stats rows padded to 16 floats: TMA rows must be whole 16-byte units
    num_splits: int
    blocks_per_split: int
    sm_scale: float
    soft_cap: float | None


def _decode_kernel(q_ref, k_ref, v_ref, layer_ref, bt_ref, len_ref, acc_out, stats_out,
                   q_smem, k_smem, v_smem, acc_smem, stats_smem, q_bar, kv_bars,
                   *, spec: _DecodeSpec, lay: _interpret.Layouts):
    # q_ref:      [batch, kv_heads, group, head_dim]              GMEM, storage dtype
    # k_ref/v_ref:[layers, num_pages, kv_heads, page_size, head_dim] GMEM (the whole pool)
    # layer_ref:  int32 [1]; bt_ref: int32 [batch, max_pages]; len_ref: int32 [batch]  GMEM
    # acc_out:    f32 [batch, kv_heads, splits, group, head_dim]  unnormalised partial sums
    # stats_out:  f32 [batch, kv_heads, splits, 2, group_pad]     (running max, running sum)
    # q_smem:     [group, head_dim]; k_smem/v_smem: [2, T, head_dim] (tiled, swizzled)
    # acc_smem:   f32 [group, head_dim]; stats_smem: f32 [2, group_pad]
    # q_bar:      1 barrier; kv_bars: 2 barriers (one per slot), 2 * pages_per_block arrivals
    tiles = spec.tiles
    b, h, split = lax.axis_index("b"), lax.axis_index("kvh"), lax.axis_index("split")
    length = jnp.clip(len_ref[b], 0, tiles.max_pages * tiles.page_size)
    live_pages = pl.cdiv(length, tiles.page_size)
    first = split * spec.blocks_per_split
    n_blocks = jnp.clip(pl.cdiv(length, tiles.block_tokens) - first, 0, spec.blocks_per_split)
    layer = read_layer(tiles, layer_ref)
    refs = (k_ref, v_ref, bt_ref, k_smem, v_smem, kv_bars)

    @pl.when(n_blocks > 0)
    def _start():
        plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem, q_bar.at[0])
        fetch_block(tiles, refs, layer, b, h, first, live_pages, 0)

    zero_rows(lay, acc_smem, 0, spec.group, tiles.head_dim)
    pl.when(n_blocks > 0)(lambda: plgpu.barrier_wait(q_bar.at[0]))

    def block(j, ml):  # ml: per query head (running max, running sum), f32 scalars
        slot = lax.rem(j, 2)

        @pl.when(j + 1 < n_blocks)
        def _prefetch():
            plgpu.commit_smem()  # every thread is done reading the slot about to be refilled
            fetch_block(tiles, refs, layer, b, h, first + j + 1, live_pages, 1 - slot)

        plgpu.barrier_wait(kv_bars.at[slot])
        k, v, kpos = load_block(tiles, lay, k_smem, v_smem, slot,
                                (first + j) * tiles.block_tokens, length)
        visible = kpos < length
        return tuple(softmax_update(lay, q_smem, k, v, visible, *ml[g], acc_smem, g,
                                    sm_scale=spec.sm_scale, soft_cap=spec.soft_cap)
                     for g in range(spec.group))

    ml = ((jnp.float32(-jnp.inf), jnp.float32(0.0)),) * spec.group
    ml = lax.fori_loop(0, n_blocks, block, ml)
    for g in range(spec.group):
        stats_smem[0, g] = ml[g][0]
        stats_smem[1, g] = ml[g][1]
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(acc_smem, acc_out.at[b, h, split])
    plgpu.copy_smem_to_gmem(stats_smem, stats_out.at[b, h, split])
    plgpu.wait_smem_to_gmem(0)


# ---------------------------------------------------------------- layer 2: call builder


def _decode_call(spec: _DecodeSpec, batch: int, num_kv_heads: int, interpret):
    tiles = spec.tiles
    interpret = _interpret.interpret_params(interpret)
    lay = _interpret.Layouts(interpret is not None)
    out_type = (
        jax.ShapeDtypeStruct((batch, num_kv_heads, spec.num_splits, spec.group, tiles.head_dim),
                             jnp.float32),
        jax.ShapeDtypeStruct((batch, num_kv_heads, spec.num_splits, 2, spec.group_pad),
                             jnp.float32),
    )
    scratch = [plgpu.SMEM((spec.group, tiles.head_dim), tiles.dtype),
               *tiles.scratch()[:2],
               plgpu.SMEM((spec.group, tiles.head_dim), jnp.float32),
               plgpu.SMEM((2, spec.group_pad), jnp.float32),
               plgpu.Barrier(num_barriers=1), tiles.scratch()[2]]
    name = (f"paged_decode_ppb{tiles.pages_per_block}_ps{tiles.page_size}"
            f"_splits{spec.num_splits}_g{spec.group}_d{tiles.head_dim}")
    return plgpu.kernel(
        functools.partial(_decode_kernel, spec=spec, lay=lay), out_type=out_type,
        scratch_types=scratch, grid=(batch, num_kv_heads, spec.num_splits),
        grid_names=("b", "kvh", "split"), interpret=interpret, kernel_name=name)


def combine_splits(acc, stats, group: int):
    """Merges split partials: acc f32 ``[b, kvh, splits, g, d]``, stats ``[b, kvh, splits, 2,
    g_pad]`` -> normalised ``[b, kvh, g, d]`` f32; rows that saw no token are zero."""
    m, l = stats[:, :, :, 0, :group], stats[:, :, :, 1, :group]
    m_all = jnp.max(m, axis=2, keepdims=True)
    m_all = jnp.where(jnp.isfinite(m_all), m_all, 0.0)
    w = jnp.exp(m - m_all)  # empty splits: exp(-inf) = 0
    denom = jnp.sum(w * l, axis=2)
    out = jnp.sum(w[..., None] * acc, axis=2)
    return out / jnp.where(denom > 0, denom, 1.0)[..., None]


# ---------------------------------------------------------------- layer 3: public wrapper


TARGET_PROGRAMS = 2048  # ~15 per SM of a 132-SM H100/H200
MAX_SPLITS = 32
MIN_BLOCKS_PER_SPLIT = 4


def auto_num_splits(batch: int, num_kv_heads: int, total_blocks: int) -> int:
    """Context splits so that ``batch x kv_heads x splits`` programs reach ~2,048, each split
    keeping at least 4 blocks (its own prologue and the combine are not free).

    Chosen from ``python -m experiments.kernels --tune`` on an H200 (bf16, 8 kv heads, page 16,
    2026-11-30): the old rule (~2 waves, <= 16 splits) took 9.41 / 0.644 / 0.423 ms at batch x
    context 64 x 32,768 / 16 x 4,096 / 1 x 32,768; the splits this rule picks measured 8.06 /
    0.450 / 0.305 ms there, and 1 split stays best at 256 x 512 (0.689 ms).
    """
    by_programs = TARGET_PROGRAMS // (batch * num_kv_heads)
    return max(1, min(MAX_SPLITS, total_blocks // MIN_BLOCKS_PER_SPLIT, by_programs))


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "logit_soft_cap", "pages_per_block", "num_splits", "interpret"))
def paged_decode_attention(q, k_pages, v_pages, block_tables, lengths, *, layer=None,
                           sm_scale=None, logit_soft_cap=None, pages_per_block=None,
                           num_splits=None, interpret=False):
    """One query token per sequence attending to its ``lengths[b]`` paged tokens.

    Args:
      q: ``[batch, num_q_heads, head_dim]``; query head ``i`` reads kv head ``i // group``.
      k_pages, v_pages: ``[num_pages, num_kv_heads, page_size, head_dim]``, or with ``layer``
        the whole pool ``[num_layers, num_pages, num_kv_heads, page_size, head_dim]``.
      block_tables: int32 ``[batch, max_pages_per_seq]``; lengths: int32 ``[batch]``.
      layer: int32 scalar (traced; clipped into the pool): the layer of a 5-D pool to read,
        so that no ``pool[layer]`` copy is made; None for 4-D pages.
      sm_scale: defaults to ``head_dim ** -0.5``; logit_soft_cap: ``cap * tanh(s / cap)``.
      pages_per_block: pages per compute block (default: fill 64 tokens).
      num_splits: context splits per sequence (default: enough programs for the GPU).
      interpret: ``True`` (or ``InterpretGPUParams``) runs the kernel on CPU.

    Returns:
      ``[batch, num_q_heads, head_dim]`` in ``q.dtype``; length-0 rows are zero.
    """
    if q.ndim != 3:
        raise ValueError(f"q must be [batch, num_q_heads, head_dim]; got {q.shape}")
    batch, num_q_heads, head_dim = q.shape
    k_pool, v_pool, layer_arr = pool_operands(k_pages, v_pages, layer)
    ppb = pages_per_block or default_pages_per_block(k_pool.shape[3])
    tiles = validate_kv(k_pool, v_pool, block_tables, ppb)
    num_kv_heads = k_pool.shape[2]
    if head_dim != tiles.head_dim or q.dtype != tiles.dtype:
        raise ValueError(f"q {q.dtype}{list(q.shape)} must match the pages' head_dim"
                         f" {tiles.head_dim} and dtype {tiles.dtype}")
    if num_q_heads % num_kv_heads or block_tables.shape[0] != batch or lengths.shape != (batch,):
        raise ValueError(f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads="
                         f"{num_kv_heads}; block_tables {block_tables.shape} and lengths"
                         f" {lengths.shape} must lead with batch={batch}")
    group = num_q_heads // num_kv_heads
    total_blocks = pl.cdiv(tiles.max_pages, ppb)
    splits = num_splits or auto_num_splits(batch, num_kv_heads, total_blocks)
    bps = pl.cdiv(total_blocks, splits)
    spec = _DecodeSpec(tiles, group, pl.cdiv(group, 16) * 16, pl.cdiv(total_blocks, bps), bps,
                       default_sm_scale(head_dim, sm_scale), logit_soft_cap)
    smem = tiles.smem_bytes() + group * head_dim * (tiles.itemsize + 4)
    if smem > SMEM_BUDGET_BYTES:
        raise ValueError(f"decode needs {smem} bytes of SMEM (> {SMEM_BUDGET_BYTES}); lower"
                         f" pages_per_block={ppb} or store pages in bfloat16")
    acc, stats = _decode_call(spec, batch, num_kv_heads, interpret)(
        q.reshape(batch, num_kv_heads, group, head_dim), k_pool, v_pool, layer_arr,
        block_tables, lengths.astype(jnp.int32))
    out = combine_splits(acc, stats, group)
    return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)


# ---------------------------------------------------------------- layer 4: reference

reference = paged_decode_attention_reference
