"""Paged prefill attention on tensor cores: ragged multi-token queries, causal over paged
context, both contractions on WGMMA (Hopper), bf16/f16 pages.

The CUDA-core prefill kernel (:mod:`pallas_kernels.paged_prefill`) runs one row's
online-softmax step at a time. Here one program per (sequence ``b``, kv head ``h``, block of
``block_q = 64 // group`` query tokens) stacks those tokens' query heads into WGMMA's 64 rows::

    row r = t * group + g:  query token t0 + t (position pos0 + t), query head h * group + g
    rows past the block's live queries (and past block_q * group) are zero, see no key, and
    come out zero

and walks the K/V stream from the first key to the block's last query's position through the
same ring of stages as the decode kernel, with the same per-stage step
(:func:`pallas_kernels._stream.mma_block`): a key is visible to row ``r`` when it is live and at
or before the row's position. A program normalises its rows itself (no splits).

Query ``t`` of sequence ``b`` sits at position ``lengths[b] - query_lengths[b] + t``, as in
:func:`pallas_kernels.paged_prefill_attention`; float32 and 8-bit pages and sliding windows
stay on that kernel.
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
from pallas_kernels._stream import (LOG2E, KVStream, fetch_block, mma_block, mma_normalised,
                                    mma_state, read_layer)
from pallas_kernels._tiles import KVTiles
from pallas_kernels.reference import default_sm_scale, paged_prefill_attention_reference
from pallas_kernels.tensor_cores.geometry import (ROWS, SEMANTICS, checked_geometry,
                                                  operand_scratch)


@dataclasses.dataclass(frozen=True)
class _Spec:
    tiles: KVTiles
    group: int
    block_q: int  # query tokens a program: 64 // group
    stages: int
    sm_scale: float
    soft_cap: float | None


def _kernel(q_ref, kv_refs, ints_ref, bt_ref, len_ref, qlen_ref, out_ref, *, q_smem, k_smem,
            v_smem, kt_smem, p_smem, o_smem, q_bar, kv_bars, spec: _Spec,
            lay: _interpret.Layouts):
    # q_ref:   [batch, kv_heads, q_blocks, 64, head_dim] GMEM (module docstring's rows)
    # kv_refs: (k, v) [layers, num_pages, kv_heads, page_size, head_dim] GMEM
    # ints_ref int32 [1] (layer); bt_ref int32 [batch, max_pages]; len_ref, qlen_ref [batch]
    # out_ref: [batch, kv_heads, q_blocks, 64, head_dim], normalised, q's dtype
    tiles = spec.tiles
    t, d = tiles.block_tokens, tiles.head_dim
    b, h, qb = lax.axis_index("b"), lax.axis_index("kvh"), lax.axis_index("qb")
    length = jnp.clip(len_ref[b], 0, tiles.max_pages * tiles.page_size)
    q_len = jnp.clip(qlen_ref[b], 0, length)
    t0 = qb * spec.block_q
    n_q = jnp.clip(q_len - t0, 0, spec.block_q)  # this program's live query tokens
    pos0 = length - q_len + t0  # position of its first query token
    n_blocks = jnp.where(n_q > 0, pl.cdiv(pos0 + n_q, t), 0)  # keys up to its last query
    live_pages = pl.cdiv(length, tiles.page_size)
    layer = read_layer(tiles, ints_ref)
    st = KVStream(kv_refs[0], kv_refs[1], None, bt_ref, k_smem, v_smem, None, kv_bars)

    @pl.when(n_blocks > 0)
    def _prologue():
        plgpu.copy_gmem_to_smem(q_ref.at[b, h, qb], q_smem, q_bar.at[0])
        for i in range(spec.stages - 1):
            pl.when(i < n_blocks)(functools.partial(
                fetch_block, tiles, st, layer, b, h, i, live_pages, i))
        plgpu.barrier_wait(q_bar.at[0])

    # Each row's last visible key: its query's position; -1 for padding rows (sees none).
    row = lay.iota((ROWS, t), 0, lay.tile)
    token = lax.div(row, spec.group)
    row_pos = jnp.where(token < n_q, pos0 + token, -1)
    scale = spec.sm_scale * (1.0 if spec.soft_cap else LOG2E)

    def block(j, state):
        slot = lax.rem(j, spec.stages)
        ahead = j + spec.stages - 1

        @pl.when(ahead < n_blocks)
        def _refill():
            plgpu.commit_smem()  # every read of the stage block j - 1 used is done
            fetch_block(tiles, st, layer, b, h, ahead, live_pages, lax.rem(ahead, spec.stages))

        plgpu.barrier_wait(kv_bars.at[slot])
        kpos0 = j * t
        kpos = lay.iota((ROWS, t), 1, lay.tile) + kpos0
        visible = (kpos <= row_pos) & (kpos < length)
        return mma_block(lay, state, q_smem, k_smem.at[slot], v_smem.at[slot], kt_smem, p_smem,
                         visible, kpos0, length, scale=scale, soft_cap=spec.soft_cap)

    state = lax.fori_loop(0, n_blocks, block, mma_state(lay, ROWS, d))
    o_smem[...] = mma_normalised(state, o_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, out_ref.at[b, h, qb])
    plgpu.wait_smem_to_gmem(0)


def _call(spec: _Spec, batch: int, num_kv_heads: int, q_blocks: int, interpret,
          semantics: str):
    tiles = spec.tiles
    d, dtype = tiles.head_dim, tiles.dtype
    interpret = _interpret.interpret_params(interpret)
    lay = _interpret.Layouts(interpret is not None)
    scratch = dict(operand_scratch(tiles, spec.stages, lay.interpret),
                   o_smem=plgpu.SMEM((ROWS, d), dtype))
    name = (f"paged_prefill_mma_bq{spec.block_q}_ppb{tiles.pages_per_block}"
            f"_ps{tiles.page_size}_st{spec.stages}_g{spec.group}_d{d}")
    params = plgpu.CompilerParams(approx_math=True, lowering_semantics=SEMANTICS[semantics])
    return plgpu.kernel(
        functools.partial(_kernel, spec=spec, lay=lay),
        out_type=jax.ShapeDtypeStruct((batch, num_kv_heads, q_blocks, ROWS, d), dtype),
        scratch_types=scratch, grid=(batch, num_kv_heads, q_blocks),
        grid_names=("b", "kvh", "qb"), compiler_params=params, interpret=interpret,
        kernel_name=name)


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "logit_soft_cap", "pages_per_block", "stages", "semantics", "interpret"))
def paged_prefill_attention_mma(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                                block_tables: jax.Array, lengths: jax.Array,
                                query_lengths: jax.Array, *, layer: jax.Array | None = None,
                                sm_scale: float | None = None,
                                logit_soft_cap: float | None = None,
                                pages_per_block: int | None = None, stages: int | None = None,
                                semantics: str = "lane",
                                interpret: _interpret.Interpret = False) -> jax.Array:
    """:func:`pallas_kernels.paged_prefill_attention` on tensor cores (module docstring).

    Args:
      q: ``[batch, max_q_len, num_q_heads, head_dim]`` bf16/f16; sequence ``b``'s queries are
        its first ``query_lengths[b]`` tokens, the last ones of its ``lengths[b]``.
      k_pages, v_pages: ``[num_pages, num_kv_heads, page_size, head_dim]``, or with ``layer``
        the pool ``[num_layers, num_pages, ...]``, in ``q.dtype``.
      block_tables: int32 ``[batch, max_pages_per_seq]``; lengths, query_lengths: int32
        ``[batch]`` (tokens after the step, and of them this step's queries).
      layer, sm_scale, logit_soft_cap, pages_per_block, stages, semantics, interpret: as
        :func:`pallas_kernels.tensor_cores.decode.paged_decode_attention_mma`.

    Returns:
      ``[batch, max_q_len, num_q_heads, head_dim]`` in ``q.dtype``; query slots past
      ``query_lengths[b]`` are zero.
    """
    if q.ndim != 4:
        raise ValueError(f"q must be [batch, max_q_len, num_q_heads, head_dim]; got {q.shape}")
    batch, max_q, num_q_heads, head_dim = q.shape
    kv, ints, tiles, stages, group = checked_geometry(
        q.dtype, num_q_heads, head_dim, k_pages, v_pages, layer, block_tables, pages_per_block,
        stages, semantics)
    num_kv_heads = kv[0].shape[2]
    if (block_tables.shape[0] != batch or lengths.shape != (batch,)
            or query_lengths.shape != (batch,)):
        raise ValueError(f"block_tables {block_tables.shape}, lengths {lengths.shape} and"
                         f" query_lengths {query_lengths.shape} must lead with batch={batch}")
    block_q = ROWS // group
    q_blocks = pl.cdiv(max_q, block_q)
    spec = _Spec(tiles, group, block_q, stages, default_sm_scale(head_dim, sm_scale),
                 logit_soft_cap)
    # [b, t, H, d] -> [b, kv_heads, q_blocks, block_q * group (+ zero rows to 64), d]
    rows = jnp.pad(q, ((0, 0), (0, q_blocks * block_q - max_q), (0, 0), (0, 0)))
    rows = rows.reshape(batch, q_blocks, block_q, num_kv_heads, group, head_dim)
    rows = rows.transpose(0, 3, 1, 2, 4, 5).reshape(batch, num_kv_heads, q_blocks,
                                                    block_q * group, head_dim)
    rows = jnp.pad(rows, ((0, 0),) * 3 + ((0, ROWS - block_q * group), (0, 0)))
    out = _call(spec, batch, num_kv_heads, q_blocks, interpret, semantics)(
        rows, kv, ints, block_tables, lengths.astype(jnp.int32),
        query_lengths.astype(jnp.int32))
    out = out[:, :, :, :block_q * group].reshape(batch, num_kv_heads, q_blocks, block_q, group,
                                                 head_dim)
    out = out.transpose(0, 2, 3, 1, 4, 5).reshape(batch, q_blocks * block_q, num_q_heads,
                                                  head_dim)
    return out[:, :max_q]


reference = paged_prefill_attention_reference
