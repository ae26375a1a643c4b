"""Paged decode attention: a Mosaic GPU Pallas kernel (``plgpu``), one query token per sequence.

One program per (sequence ``b``, kv head ``h``, context split ``s``) serves every query head of
the GQA group together, so each K/V page is read once per kv head::

    split s of sequence b: blocks [s*bps, (s+1)*bps) of T = pages_per_block * page_size tokens

    block_tables[b]         -> page ids (read one by one from GMEM inside the kernel)
    k_pages[layer, page, h] -> TMA copy -> k_smem[slot, i*R : i*R + page_size]   (V too)
                               slot = block % 2: block j+1 is in flight while block j is computed
                               R = page_size rows per page (2 * page_size for 8-bit page 16)

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

8-bit pages (int8 codes, or float8_e4m3fn as uint8 bits) come with ``scales=`` (float32
``[..., kv_heads, 2, page_size]``, the pool's own layout) and are dequantised after the load:
scores x K scale, softmax weights x V scale (``_tiles.py``, which also explains the SMEM layout
the scales need: at page 16 each page takes 32 SMEM rows, half of them dead).

A sliding ``window=`` (Mistral, Gemma 2/3 local layers; an int32 scalar that may be traced, read
from GMEM after the layer) limits the query to its last ``window`` keys, ``[length - window,
length)``: each split starts at the first of its blocks that reaches into the window and skips
the blocks before it (no copy, no compute)::

    blocks of split s:  [max(s * bps, lo), min((s + 1) * bps, cdiv(length, T)))
                        lo = max(length - window, 0) // T

``window=None`` builds the kernel without any of this (and with the ``[1]`` layer operand).

Layers: kernel body -> call builder -> public jitted wrapper -> reference (oracle).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _interpret
from pallas_kernels._stream import (KVStream, fetch_block, load_block, read_layer, read_window,
                                    softmax_update, zero_rows)
from pallas_kernels._tiles import (SMEM_BUDGET_BYTES, KVTiles, check_query, default_pages_per_block,
                                   pool_operands, validate_kv)
from pallas_kernels.reference import default_sm_scale, paged_decode_attention_reference

# ---------------------------------------------------------------- layer 1: kernel body


@dataclasses.dataclass(frozen=True)
class _DecodeSpec:
    tiles: KVTiles
    q_dtype: jnp.dtype
    group: int
    group_pad: int  # stats rows padded to 16 floats: TMA rows must be whole 16-byte units
    num_splits: int
    blocks_per_split: int
    sm_scale: float
    soft_cap: float | None
    windowed: bool = False  # ints_ref holds (layer, window): a sliding window over the keys


def _decode_kernel(q_ref, kv_refs, ints_ref, bt_ref, len_ref, acc_out, stats_out, *,
                   q_smem, k_smem, v_smem, acc_smem, stats_smem, q_bar, kv_bars, s_smem=None,
                   spec: _DecodeSpec, lay: _interpret.Layouts):
    # q_ref:      [batch, kv_heads, group, head_dim]              GMEM, q dtype
    # kv_refs:    (k, v) or (k, v, scales) GMEM, the whole pool:
    #             k/v [layers, num_pages, kv_heads, page_size, head_dim] (floats or 8-bit codes),
    #             scales f32 [layers, num_pages, kv_heads, 2 * page_size] (K | V)
    # ints_ref:   int32 [1] (layer), or [2] (layer, window) when spec.windowed     GMEM
    # bt_ref:     int32 [batch, max_pages]; len_ref: int32 [batch]                GMEM
    # acc_out:    f32 [batch, kv_heads, splits, group, head_dim]  unnormalised partial sums
    # stats_out:  f32 [batch, kv_heads, splits, 2, group_pad]     (running max, running sum)
    # q_smem:     [group, head_dim]; k_smem/v_smem: [2, rows, head_dim] (tiled, swizzled)
    # s_smem:     f32 [2, scale_slot_len] K | V scales per slot, scaled pools only
    # acc_smem:   f32 [group, head_dim]; stats_smem: f32 [2, group_pad]
    # q_bar:      1 barrier; kv_bars: 2 barriers (one per slot), one arrival per page copy
    tiles = spec.tiles
    b, h, split = lax.axis_index("b"), lax.axis_index("kvh"), lax.axis_index("split")
    length = jnp.clip(len_ref[b], 0, tiles.max_pages * tiles.page_size)
    live_pages = pl.cdiv(length, tiles.page_size)
    first = split * spec.blocks_per_split  # this split's blocks: [first, first + bps)
    kpos_lo = None
    if spec.windowed:  # keys [kpos_lo, length): skip the split's blocks wholly before them
        kpos_lo = jnp.maximum(length - read_window(ints_ref), 0)
        start = jnp.maximum(first, kpos_lo // tiles.block_tokens)
        end = jnp.minimum(pl.cdiv(length, tiles.block_tokens), first + spec.blocks_per_split)
        n_blocks = jnp.maximum(end - start, 0)
    else:
        start = first
        n_blocks = jnp.clip(pl.cdiv(length, tiles.block_tokens) - first, 0,
                            spec.blocks_per_split)
    layer = read_layer(tiles, ints_ref)
    st = KVStream(kv_refs[0], kv_refs[1], kv_refs[2] if tiles.scaled else None, bt_ref,
                  k_smem, v_smem, s_smem, kv_bars)

    @pl.when(n_blocks > 0)
    def _start():
        plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem, q_bar.at[0])
        fetch_block(tiles, st, layer, b, h, start, live_pages, 0)

    zero_rows(lay, acc_smem, 0, spec.group, tiles.head_dim)
    pl.when(n_blocks > 0)(lambda: plgpu.barrier_wait(q_bar.at[0]))

    def block(j, ml):  # block start + j; ml: per query head (running max, running sum)
        slot = lax.rem(j, 2)

        @pl.when(j + 1 < n_blocks)
        def _prefetch():
            plgpu.commit_smem()  # every thread is done reading the slot about to be refilled
            fetch_block(tiles, st, layer, b, h, start + j + 1, live_pages, 1 - slot)

        plgpu.barrier_wait(kv_bars.at[slot])
        blk = load_block(tiles, lay, st, slot, (start + j) * tiles.block_tokens, length,
                         spec.sm_scale, kpos_lo)
        visible = blk.kpos < length
        if spec.windowed:  # NOTE: every block in [start, end) holds a key in the window
            visible &= blk.kpos >= kpos_lo
        return tuple(softmax_update(lay, q_smem, blk, visible, *ml[g], acc_smem, g,
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
    scratch = dict(q_smem=plgpu.SMEM((spec.group, tiles.head_dim), spec.q_dtype),
                   acc_smem=plgpu.SMEM((spec.group, tiles.head_dim), jnp.float32),
                   stats_smem=plgpu.SMEM((2, spec.group_pad), jnp.float32),
                   q_bar=plgpu.Barrier(num_barriers=1), **tiles.scratch())
    codes = f"_{tiles.dtype.name}" if tiles.scaled else ""
    window = "_window" if spec.windowed else ""
    name = (f"paged_decode_ppb{tiles.pages_per_block}_ps{tiles.page_size}"
            f"_splits{spec.num_splits}_g{spec.group}_d{tiles.head_dim}{codes}{window}")
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
def paged_decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           block_tables: jax.Array, lengths: jax.Array, *,
                           scales: jax.Array | None = None, layer: jax.Array | None = None,
                           window: jax.Array | int | None = None,
                           sm_scale: float | None = None, logit_soft_cap: float | None = None,
                           pages_per_block: int | None = None, num_splits: int | None = None,
                           interpret: _interpret.Interpret = False) -> jax.Array:
    """One query token per sequence attending to its ``lengths[b]`` paged tokens.

    Args:
      q: ``[batch, num_q_heads, head_dim]``; query head ``i`` reads kv head ``i // group``.
      k_pages, v_pages: ``[num_pages, num_kv_heads, page_size, head_dim]``, or with ``layer``
        the whole pool ``[num_layers, num_pages, num_kv_heads, page_size, head_dim]``; floats
        (then in ``q.dtype``), or 8-bit codes (int8; float8_e4m3fn as uint8 bits) with scales.
      block_tables: int32 ``[batch, max_pages_per_seq]``; lengths: int32 ``[batch]``.
      scales: float32 ``[(num_layers,) num_pages, num_kv_heads, 2, page_size]`` for 8-bit
        pages (K scales at index 0, V at 1: :class:`paxkv.cache.pool.KVPool`), else None.
      layer: int32 scalar (traced; clipped into the pool): the layer of a 5-D pool to read,
        so that no ``pool[layer]`` copy is made; None for 4-D pages.
      window: int32 scalar (may be traced), a sliding window: the query at position
        ``lengths[b] - 1`` sees keys ``k > lengths[b] - 1 - window``, its last ``window``
        (HF's ``sliding_window``; values below 1 act as 1). None: every key (the kernel is then
        built without the window).
      sm_scale: defaults to ``head_dim ** -0.5``; logit_soft_cap: ``cap * tanh(s / cap)``.
      pages_per_block: pages per compute block (default: fill 64 SMEM rows).
      num_splits: context splits per sequence (default: enough programs for the GPU).
      interpret: ``True`` (or ``InterpretGPUParams``) runs the kernel on CPU.

    Returns:
      ``[batch, num_q_heads, head_dim]`` in ``q.dtype``; length-0 rows are zero.
    """
    if q.ndim != 3:
        raise ValueError(f"q must be [batch, num_q_heads, head_dim]; got {q.shape}")
    batch, num_q_heads, head_dim = q.shape
    kv, ints = pool_operands(k_pages, v_pages, scales, layer, window)
    ppb = pages_per_block or default_pages_per_block(kv[0].shape[3], scaled=scales is not None)
    tiles = validate_kv(kv, block_tables, ppb)
    check_query(q.dtype, head_dim, tiles)
    num_kv_heads = kv[0].shape[2]
    if num_q_heads % num_kv_heads or block_tables.shape[0] != batch or lengths.shape != (batch,):
        raise ValueError(f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads="
                         f"{num_kv_heads}; block_tables {block_tables.shape} and lengths"
                         f" {lengths.shape} must lead with batch={batch}")
    group = num_q_heads // num_kv_heads
    total_blocks = pl.cdiv(tiles.max_pages, ppb)
    splits = num_splits or auto_num_splits(batch, num_kv_heads, total_blocks)
    bps = pl.cdiv(total_blocks, splits)
    spec = _DecodeSpec(tiles, jnp.dtype(q.dtype), group, pl.cdiv(group, 16) * 16,
                       pl.cdiv(total_blocks, bps), bps, default_sm_scale(head_dim, sm_scale),
                       logit_soft_cap, windowed=window is not None)
    smem = tiles.smem_bytes() + group * head_dim * (q.dtype.itemsize + 4)
    if smem > SMEM_BUDGET_BYTES:
        raise ValueError(f"decode needs {smem} bytes of SMEM (> {SMEM_BUDGET_BYTES}); lower"
                         f" pages_per_block={ppb} or store pages in bfloat16")
    acc, stats = _decode_call(spec, batch, num_kv_heads, interpret)(
        q.reshape(batch, num_kv_heads, group, head_dim), kv, ints, block_tables,
        lengths.astype(jnp.int32))
    out = combine_splits(acc, stats, group)
    return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)


# ---------------------------------------------------------------- layer 4: reference

reference = paged_decode_attention_reference
