"""What the tensor-core kernels (:mod:`.decode`, :mod:`.prefill`) can tile: SMEM and register
budgets, defaults, why they refuse a geometry (then the CUDA-core kernels serve it: plain
arithmetic, so a cache made with ``attention_impl="pallas_mma"`` can ask without building a
kernel), and what both wrappers check and allocate.
"""

from __future__ import annotations

import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels._tiles import (SMEM_BUDGET_BYTES, TMA_SMEM_ALIGN, KVTiles, check_query,
                                   pool_operands, validate_kv)

ROWS = 64  # query rows of one WGMMA: the GQA group, zero-padded
MMA_DTYPES = (jnp.bfloat16, jnp.float16)
DEFAULT_STAGES = 3


def smem_bytes(block_tokens: int, head_dim: int, stages: int, itemsize: int = 2) -> int:
    """SMEM one program takes: the K/V ring, Q, P, the float32 output and stats (the
    interpreter's transposed K scratch is not counted: it exists only on a CPU)."""
    ring = 2 * stages * block_tokens * head_dim * itemsize
    return ring + ROWS * (head_dim + block_tokens) * itemsize + ROWS * (head_dim + 2) * 4


REGISTER_BUDGET = 160  # of a thread's 255 32-bit registers, for the two float32 tiles


def tile_registers(block_tokens: int, head_dim: int) -> int:
    """32-bit registers a thread of the warpgroup (128 threads) holds for the float32 scores
    ``[64, T]`` and output ``[64, head_dim]`` tiles; the rest of its 255 go to addresses,
    the row statistics and the compiler. Over :data:`REGISTER_BUDGET` the tiles would spill."""
    return ROWS * (block_tokens + head_dim) // 128


def mma_refusal(dtype, page_size: int, head_dim: int, pages_per_block: int, stages: int,
                window=None, scales=None) -> str | None:
    """Why this kernel cannot serve a geometry (the CUDA-core kernel then does), or None."""
    t = page_size * pages_per_block
    if jnp.dtype(dtype) not in MMA_DTYPES or scales is not None:
        return f"{jnp.dtype(dtype).name} pages: tensor-core decode takes bfloat16 or float16"
    if window is not None:
        return "a sliding window: the CUDA-core kernel reads windows"
    if t % ROWS or t > 256:
        return (f"pages_per_block x page_size = {t} keys a stage must be a multiple of {ROWS}"
                " and at most 256 (one WGMMA's width)")
    if head_dim not in (64, 128, 256):
        return f"head_dim={head_dim}: use 64, 128 or 256"
    if not 2 <= stages <= 4:
        return f"stages={stages}: use 2-4"
    if tile_registers(t, head_dim) > REGISTER_BUDGET:
        return (f"{tile_registers(t, head_dim)} registers a thread for a [64, {t}] score and a"
                f" [64, {head_dim}] output tile (> {REGISTER_BUDGET}): fewer keys a stage")
    need = smem_bytes(t, head_dim, stages, jnp.dtype(dtype).itemsize)
    if need > SMEM_BUDGET_BYTES:
        return f"{need} bytes of SMEM (> {SMEM_BUDGET_BYTES}): fewer stages or pages a block"
    return None


def serves(dtype, page_size: int, head_dim: int, *, window=None, scales=None) -> bool:
    """Whether the kernels take these pages at their default stage shape (a cache asks this
    before each step; the refusal, :func:`mma_refusal`, names why not)."""
    ppb = default_pages_per_block(page_size)
    stages = default_stages(ppb * page_size, head_dim, jnp.dtype(dtype).itemsize)
    return mma_refusal(dtype, page_size, head_dim, ppb, stages, window=window,
                       scales=scales) is None


def default_stages(block_tokens: int, head_dim: int, itemsize: int = 2) -> int:
    """The ring's depth: :data:`DEFAULT_STAGES`, or fewer (not under 2) where SMEM is short
    (page 128 at head_dim 128: 2 stages of 128 keys)."""
    fits = [n for n in range(2, DEFAULT_STAGES + 1)
            if smem_bytes(block_tokens, head_dim, n, itemsize) <= SMEM_BUDGET_BYTES]
    return max(fits, default=2)


def default_pages_per_block(page_size: int) -> int:
    """Pages of a stage: 64 keys, or one page when a page is longer."""
    return max(1, ROWS // page_size)


def swizzled(dtype, row_elems: int) -> tuple:
    """Tiling + swizzle of an SMEM operand whose rows hold ``row_elems`` elements."""
    swizzle = min(TMA_SMEM_ALIGN, row_elems * jnp.dtype(dtype).itemsize)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(swizzle))


SEMANTICS = {"lane": plgpu.LoweringSemantics.Lane,
             "warpgroup": plgpu.LoweringSemantics.Warpgroup}


def checked_geometry(q_dtype, num_q_heads: int, head_dim: int, k_pages, v_pages, layer,
                     block_tables, pages_per_block: int | None, stages: int | None,
                     semantics: str):
    """The wrappers' trace-time checks, each error naming what to change -> ``(kv, ints,
    tiles, stages, group)``: the 5-D pools and int operands (:func:`pool_operands`), the
    stream's geometry, the ring's depth and the GQA group."""
    kv, ints = pool_operands(k_pages, v_pages, None, layer)
    page_size = kv[0].shape[3]
    ppb = pages_per_block or default_pages_per_block(page_size)
    stages = stages or default_stages(ppb * page_size, head_dim, kv[0].dtype.itemsize)
    refusal = mma_refusal(kv[0].dtype, page_size, head_dim, ppb, stages)
    if refusal:
        raise ValueError(refusal)
    if semantics not in SEMANTICS:
        raise ValueError(f"semantics must be one of {sorted(SEMANTICS)}; got {semantics!r}")
    tiles = validate_kv(kv, block_tables, ppb)
    check_query(q_dtype, head_dim, tiles)
    num_kv_heads = kv[0].shape[2]
    group = num_q_heads // num_kv_heads
    if num_q_heads % num_kv_heads or group > ROWS:
        raise ValueError(f"num_q_heads={num_q_heads} must be 1-{ROWS} x num_kv_heads="
                         f"{num_kv_heads}")
    return kv, ints, tiles, stages, group


def operand_scratch(tiles: KVTiles, stages: int, interpret: bool) -> dict:
    """SMEM both kernels take: Q ``[64, D]``, the K and V rings ``[stages, T, D]``, the
    probabilities ``[64, T]`` (all swizzled WGMMA operands), the interpreter's transposed-K
    scratch ``[D, T]`` (None when compiling), and the barriers of Q and of each stage."""
    t, d, dtype = tiles.block_tokens, tiles.head_dim, tiles.dtype
    stage = plgpu.SMEM((stages, t, d), dtype, transforms=swizzled(dtype, d))
    return dict(
        q_smem=plgpu.SMEM((ROWS, d), dtype, transforms=swizzled(dtype, d)),
        k_smem=stage, v_smem=stage,
        kt_smem=plgpu.SMEM((d, t), dtype, transforms=swizzled(dtype, t)) if interpret
        else None,
        p_smem=plgpu.SMEM((ROWS, t), dtype, transforms=swizzled(dtype, t)),
        q_bar=plgpu.Barrier(num_barriers=1),
        kv_bars=plgpu.Barrier(num_arrivals=tiles.copies_per_page * tiles.pages_per_block,
                              num_barriers=stages))
