"""Paged decode attention on tensor cores: both contractions on WGMMA (Hopper), bf16/f16 pages.

The CUDA-core kernel (:mod:`pallas_kernels.paged_decode`) computes ``q . k`` and ``p . v`` as
broadcast-multiply + reductions, one query head at a time. Here one program per (sequence
``b``, kv head ``h``, context split ``s``) stacks its GQA group's query heads into the 64 rows
one WGMMA needs (zero rows pad a group of 1-8; decode reads ~64 FLOP a byte, far below an
H200's ridge of ~200, so the padding costs tensor-core time nobody waits for) and runs::

    ring of S stages, T = pages_per_block * page_size keys a stage (T % 64 == 0, T <= 256)
    prologue: copy Q [64, D]; start blocks 0 .. S-2
    block j:  start block j + S - 1 into the stage block j - 1 left (its WGMMAs are done)
              wait stage j % S
              s = Q @ K^T              WGMMA  [64, D] x [D, T] (K read transposed in SMEM)
              online softmax along rows, base 2 with the scale folded in
              P -> SMEM (bf16/f16), dead rows of V -> 0
              o = o * alpha + P @ V    WGMMA  [64, T] x [T, D]
    end:      one split: o / sum, the output; more: unnormalised partials (o, max, sum),
              merged by the wrapper (:func:`pallas_kernels.paged_decode.combine_splits`)

**Splits** share out each row's own blocks, ``cdiv(row_blocks, splits)`` (at least
``min_blocks_per_split``) a split: the grid is static, the work follows the row's length, so
in a ragged batch a long row fills every split and a short one runs on few (the rest exit at
once), where a split of the table's width would leave a short row's work on one program.

**Masking.** Keys at ``lengths[b]`` and past it are dead: their scores are ``-inf`` (chosen with
``where``, so NaN in a free slot's K never reaches the softmax) and their V rows are set to 0
in SMEM before ``P @ V`` (``0 * NaN`` is NaN inside a tensor core too). Stages hold stale data
where a block has fewer live pages; the same masks cover it.

**Interpret mode.** jax 0.10.2's interpreter runs ``plgpu.wgmma`` only on plain SMEM operands,
not on ``plgpu.transpose_ref`` (``_interpret.py``). On the GPU ``Q @ K^T`` reads the stage
through ``transpose_ref``; interpreted, :func:`pallas_kernels._stream.keys_for_scores` first
writes the stage's transpose into a ``[D, T]`` scratch and runs the same ``wgmma`` on it.
Both branches lower for CUDA (``tests/test_mma_kernels.py``); only the GPU runs the first.
The per-stage step (:func:`pallas_kernels._stream.mma_block`) is the prefill kernel's too
(:mod:`pallas_kernels.tensor_cores.prefill`).

**Stream only** (``stream_only=True``): the same copies, stages and barriers, a consumer that
waits for each stage and computes nothing. Its bandwidth on a GPU is the ceiling of one copy
per page at a page size, what ``experiments.kernels`` measures the kernels against.

float32 pages (a float32 ``P @ V`` does not lower: "Only f16 WGMMA supports transposes"),
8-bit pages and sliding windows stay on the CUDA-core kernel.
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
                                    mma_state, produce_blocks, read_layer)
from pallas_kernels._tiles import SMEM_BUDGET_BYTES
from pallas_kernels.paged_decode import MIN_BLOCKS_PER_SPLIT, auto_num_splits, combine_splits
from pallas_kernels.reference import default_sm_scale, paged_decode_attention_reference
from pallas_kernels.tensor_cores.geometry import (ROWS, SEMANTICS, checked_geometry,
                                                  operand_scratch, smem_bytes)
from pallas_kernels.tensor_cores.program import ComputeSmem, DecodeSpec, RowShare


# ---------------------------------------------------------------- layer 1: kernel body


def _kernel(q_ref, kv_refs, ints_ref, bt_ref, len_ref, *outs, q_smem, k_smem, v_smem, kt_smem,
            p_smem, o_smem, stats_smem, q_bar, kv_bars, consumed, table_smem, table_bar,
            spec: DecodeSpec, lay: _interpret.Layouts):
    # q_ref:     [batch, kv_heads, 64, head_dim] GMEM (the group, zero rows below it)
    # kv_refs:   (k, v) [layers, num_pages, kv_heads, page_size, head_dim] GMEM
    # ints_ref:  int32 [1] (layer); bt_ref int32 [batch, max_pages]; len_ref int32 [batch]
    # outs, one split:  out [batch, kv_heads, group_pad, head_dim] in q's dtype, normalised
    #       splits > 1: acc f32 [batch, kv_heads, splits, group_pad, head_dim] unnormalised,
    #                   stats f32 [batch, kv_heads, splits, 2, 64] (max, sum) per row, base e
    # k_smem, v_smem: [stages, T, head_dim]; kt_smem [head_dim, T] (interpret only) or None
    # p_smem: [64, T] (probabilities, the pages' dtype); o_smem [64, head_dim], f32 or (one
    # split) the output's dtype; stats_smem f32 [2, 64] (splits > 1)
    # kv_bars: a stage's copies landed; consumed: a stage released; table_smem int32
    # [table_span]: the split's block-table columns (these three with spec.producer only)
    tiles = spec.tiles
    t = tiles.block_tokens
    b, h, split = lax.axis_index("b"), lax.axis_index("kvh"), lax.axis_index("split")
    length = jnp.clip(len_ref[b], 0, tiles.max_pages * tiles.page_size)
    live_pages = pl.cdiv(length, tiles.page_size)
    # The row's own blocks, shared evenly by the splits (at least spec.min_blocks each): a
    # short row of a ragged batch runs on fewer splits, a long one on all of them.
    row_blocks = pl.cdiv(length, t)
    per_split = jnp.maximum(pl.cdiv(row_blocks, spec.num_splits), spec.min_blocks)
    start = split * per_split
    n_blocks = jnp.clip(row_blocks - start, 0, per_split)
    layer = read_layer(tiles, ints_ref)
    st = KVStream(kv_refs[0], kv_refs[1], None, bt_ref, k_smem, v_smem, None, kv_bars)

    share = RowShare(b, h, split, length, start, n_blocks, live_pages, layer)
    smem = ComputeSmem(q_smem, kt_smem, p_smem, o_smem, stats_smem, q_bar,
                 consumed if spec.producer else None)
    if spec.producer:  # warpgroup 1 copies, warpgroup 0 (below) computes
        producing = lax.axis_index("wg") == 1
        pl.when(producing)(functools.partial(produce_blocks, tiles, st, layer, b, h, start,
                                             n_blocks, live_pages, consumed, spec.stages,
                                             table_smem, table_bar))
        pl.when(~producing)(functools.partial(_consume, q_ref, outs, share, st, smem, spec,
                                              lay))
    else:
        _consume(q_ref, outs, share, st, smem, spec, lay)


def _consume(q_ref, outs, share: RowShare, st: KVStream, smem: ComputeSmem, spec: DecodeSpec,
             lay: _interpret.Layouts) -> None:
    """The compute side: waits for each stage, runs :func:`mma_block`, writes the output.
    Without a producer (``smem.consumed`` None) it also keeps the ring ``stages - 1`` blocks
    ahead itself."""
    tiles = spec.tiles
    t, d = tiles.block_tokens, tiles.head_dim
    b, h, start, n_blocks, layer = share.b, share.h, share.start, share.n_blocks, share.layer
    q_smem, o_smem, consumed = smem.q, smem.o, smem.consumed

    @pl.when(n_blocks > 0)
    def _prologue():
        plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem, smem.q_bar.at[0])
        for i in range(0 if consumed is not None else spec.stages - 1):
            pl.when(i < n_blocks)(functools.partial(
                fetch_block, tiles, st, layer, b, h, start + i, share.live_pages, i))
        plgpu.barrier_wait(smem.q_bar.at[0])

    scale = spec.sm_scale * (1.0 if spec.soft_cap else LOG2E)

    def block(j, carry):
        slot = lax.rem(j, spec.stages)
        ahead = j + spec.stages - 1

        if consumed is None:
            @pl.when(ahead < n_blocks)
            def _refill():
                plgpu.commit_smem()  # every read of the stage block j - 1 used is done
                fetch_block(tiles, st, layer, b, h, start + ahead, share.live_pages,
                            lax.rem(ahead, spec.stages))

        plgpu.barrier_wait(st.bars.at[slot])
        if not spec.stream_only:
            kpos0 = (start + j) * t
            visible = lay.iota((ROWS, t), 1, lay.tile) + kpos0 < share.length
            carry = mma_block(lay, carry, q_smem, st.k_smem.at[slot], st.v_smem.at[slot],
                              smem.kt, smem.p, visible, kpos0, share.length, scale=scale,
                              soft_cap=spec.soft_cap)
        if consumed is not None:
            plgpu.commit_smem()
            plgpu.barrier_arrive(consumed.at[slot])  # the producer may refill the stage
        return carry

    carry = lax.fori_loop(0, n_blocks, block, () if spec.stream_only else mma_state(lay, ROWS, d))
    if spec.stream_only:  # nothing was computed: the partials of no key
        carry = mma_state(lay, ROWS, d)
    o, m, l = carry
    if spec.num_splits == 1:  # the whole row: normalise here, no combine
        o_smem[...] = mma_normalised(carry, o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, spec.group_pad)], outs[0].at[b, h])
    else:
        o_smem[...] = o
        smem.stats[0] = m * (1.0 / LOG2E)  # back to base e for combine_splits
        smem.stats[1] = l
        plgpu.commit_smem()
        split = share.split
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, spec.group_pad)], outs[0].at[b, h, split])
        plgpu.copy_smem_to_gmem(smem.stats, outs[1].at[b, h, split])
    plgpu.wait_smem_to_gmem(0)


# ---------------------------------------------------------------- layer 2: call builder


def _call(spec: DecodeSpec, batch: int, num_kv_heads: int, interpret, semantics: str):
    tiles = spec.tiles
    d, dtype = tiles.head_dim, tiles.dtype
    interpret = _interpret.interpret_params(interpret)
    lay = _interpret.Layouts(interpret is not None)
    if spec.num_splits == 1:
        out_type = (jax.ShapeDtypeStruct((batch, num_kv_heads, spec.group_pad, d), dtype),)
    else:
        out_type = (
            jax.ShapeDtypeStruct((batch, num_kv_heads, spec.num_splits, spec.group_pad, d),
                                 jnp.float32),
            jax.ShapeDtypeStruct((batch, num_kv_heads, spec.num_splits, 2, ROWS),
                                 jnp.float32))
    scratch = dict(
        operand_scratch(tiles, spec.stages, lay.interpret),
        o_smem=plgpu.SMEM((ROWS, d), dtype if spec.num_splits == 1 else jnp.float32),
        stats_smem=plgpu.SMEM((2, ROWS), jnp.float32) if spec.num_splits > 1 else None,
        consumed=plgpu.Barrier(num_barriers=spec.stages) if spec.producer else None,
        table_smem=plgpu.SMEM((spec.table_span,), jnp.int32) if spec.producer else None,
        table_bar=plgpu.Barrier(num_barriers=1) if spec.producer else None)
    kind = ("stream" if spec.stream_only else "decode_mma") + ("_ws" if spec.producer else "")
    threads = dict(num_threads=2, thread_name="wg") if spec.producer else {}
    name = (f"paged_{kind}_ppb{tiles.pages_per_block}_ps{tiles.page_size}_st{spec.stages}"
            f"_splits{spec.num_splits}_g{spec.group}_d{d}")
    params = plgpu.CompilerParams(approx_math=True, lowering_semantics=SEMANTICS[semantics])
    return plgpu.kernel(
        functools.partial(_kernel, spec=spec, lay=lay), out_type=out_type,
        scratch_types=scratch, grid=(batch, num_kv_heads, spec.num_splits),
        grid_names=("b", "kvh", "split"), compiler_params=params, interpret=interpret,
        kernel_name=name, **threads)


# ---------------------------------------------------------------- layer 3: public wrapper


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "logit_soft_cap", "pages_per_block", "stages", "num_splits",
    "min_blocks_per_split", "stream_only", "producer", "semantics", "interpret"))
def paged_decode_attention_mma(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                               block_tables: jax.Array, lengths: jax.Array, *,
                               layer: jax.Array | None = None, sm_scale: float | None = None,
                               logit_soft_cap: float | None = None,
                               pages_per_block: int | None = None,
                               stages: int | None = None, num_splits: int | None = None,
                               min_blocks_per_split: int = MIN_BLOCKS_PER_SPLIT,
                               stream_only: bool = False, producer: bool = False,
                               semantics: str = "lane",
                               interpret: _interpret.Interpret = False) -> jax.Array:
    """:func:`pallas_kernels.paged_decode_attention` on tensor cores (module docstring).

    Args:
      q: ``[batch, num_q_heads, head_dim]`` bf16/f16; query head ``i`` reads kv head
        ``i // group``, ``group = num_q_heads / num_kv_heads <= 64``.
      k_pages, v_pages: ``[num_pages, num_kv_heads, page_size, head_dim]``, or with ``layer``
        the pool ``[num_layers, num_pages, ...]``, in ``q.dtype``.
      block_tables: int32 ``[batch, max_pages_per_seq]``; lengths: int32 ``[batch]``.
      layer: int32 scalar (traced; clipped into the pool), or None for 4-D pages.
      sm_scale: defaults to ``head_dim ** -0.5``; logit_soft_cap: ``cap * tanh(s / cap)``.
      pages_per_block: pages a stage (default: 64 keys); stages: the ring's depth, 2-4
        (default: :func:`default_stages`).
      num_splits: context splits per sequence (default: :func:`~pallas_kernels.paged_decode.
        auto_num_splits`). Each row's own blocks are shared evenly among them, at least
        ``min_blocks_per_split`` a split, so a short row of a ragged batch runs on fewer.
        One split writes the normalised output itself (no combine).
      stream_only: copy and wait only (returns zeros).
      producer: a second warpgroup issues every copy (full / consumed barriers a stage)
        while the first computes; without it the computing warpgroup keeps the ring ahead
        itself (TMA copies are asynchronous either way). Which is faster waits for a GPU.
      semantics: Mosaic GPU's lowering, ``"lane"`` (jax 0.10's default) or ``"warpgroup"``.
      interpret: ``True`` (or ``InterpretGPUParams``) runs the kernel on CPU.

    Returns:
      ``[batch, num_q_heads, head_dim]`` in ``q.dtype``; length-0 rows are zero.
    """
    if q.ndim != 3:
        raise ValueError(f"q must be [batch, num_q_heads, head_dim]; got {q.shape}")
    batch, num_q_heads, head_dim = q.shape
    kv, ints, tiles, stages, group = checked_geometry(
        q.dtype, num_q_heads, head_dim, k_pages, v_pages, layer, block_tables, pages_per_block,
        stages, semantics)
    num_kv_heads, ppb = kv[0].shape[2], tiles.pages_per_block
    if block_tables.shape[0] != batch or lengths.shape != (batch,):
        raise ValueError(f"block_tables {block_tables.shape} and lengths {lengths.shape} must"
                         f" lead with batch={batch}")
    total_blocks = pl.cdiv(tiles.max_pages, ppb)
    splits = num_splits or auto_num_splits(batch, num_kv_heads, total_blocks)
    if min_blocks_per_split < 1:
        raise ValueError(f"min_blocks_per_split={min_blocks_per_split}: use 1 or more")
    spec = DecodeSpec(tiles, group, pl.cdiv(group, 8) * 8, stages, splits,
                      min_blocks_per_split, default_sm_scale(head_dim, sm_scale),
                      logit_soft_cap, stream_only, producer)
    q_rows = jnp.zeros((batch, num_kv_heads, ROWS, head_dim), q.dtype)
    q_rows = q_rows.at[:, :, :group].set(q.reshape(batch, num_kv_heads, group, head_dim))
    if producer:  # a split's table columns move in one copy: pad so none leaves the table
        span = -(-spec.max_split_blocks * ppb // 32) * 32  # whole 128-byte copies
        width = -(-((splits - 1) * spec.max_split_blocks * ppb + span) // 32) * 32
        spec = dataclasses.replace(spec, table_span=span)
        need = smem_bytes(tiles.block_tokens, head_dim, stages, tiles.itemsize) + 4 * span
        if need > SMEM_BUDGET_BYTES:
            raise ValueError(f"producer=True needs {need} bytes of SMEM with a {span}-column"
                             f" block-table slice (> {SMEM_BUDGET_BYTES}): more num_splits,"
                             " fewer stages, or producer=False")
        block_tables = jnp.pad(block_tables, ((0, 0), (0, max(0, width - tiles.max_pages))))
    outs = _call(spec, batch, num_kv_heads, interpret, semantics)(
        q_rows, kv, ints, block_tables, lengths.astype(jnp.int32))
    if splits == 1:
        out = outs[0][:, :, :group]
    else:
        out = combine_splits(outs[0][:, :, :, :group], outs[1], group)
    return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)


# ---------------------------------------------------------------- layer 4: reference

reference = paged_decode_attention_reference
