"""The paged K/V stream shared by the attention kernels: its geometry and trace-time checks.

Both attention kernels walk a sequence's pages in blocks of ``pages_per_block`` pages, double
buffered in SMEM, and run one online-softmax step per query row per block. This module owns
the walk's static shape; ``_stream.py`` its in-kernel steps; the kernels their grids, queries
and outputs.

Pages hold floats, or **8-bit codes** (int8; float8_e4m3fn as its bits, uint8) with float32
scales ``[layers, num_pages, kv_heads, 2, page_size]`` (:class:`paxkv.cache.pool.KVPool`, K scales at
index 0, V at 1). Codes are dequantised after the load: the scores of a block are scaled by the
K scales, the softmax weights by the V scales (zero at dead keys, so NaN in free slots or
poisoned scales never reaches an output).

**The SMEM layout 8-bit pages need.** Every Mosaic GPU copy must move a multiple of 128 bytes
(Lane semantics; TMA also wants 128-byte-aligned SMEM destinations, which every copy here
gets). The codes pass: a page's ``[page_size, head_dim]`` int8 tile is ``page_size * 64``
bytes at head_dim 64 (its 64-byte rows take a 64-byte swizzle), one copy per page as for
floats. The scales do not: a page's K scales are 64 bytes at page 16. The pool keeps its
layout (the XLA path, scrub and copy-on-write index it); the SMEM side adapts, keeping each
kind of scale at a fixed offset from its row, so one vector load per block reads it::

    page_size % 32 == 0, "split": K and V scales of a page, one copy each; no dead rows.
    page_size % 32 == 16, "paired": a page's [K | V] scales in one copy (8 * page_size bytes),
        so a page takes 2 * page_size SMEM rows, the second half dead:
          rows    [p0 t0..15 | dead x16 | p1 t0..15 | dead x16 ...]
          scales  [p0 K      | p0 V     | p1 K      | p1 V      ...]  K of row r: [r], V: [r + 16]
    page_size % 16 == 8: refused (a page's scales are 64 bytes even paired).

Dead rows are masked like free slots; they cost CUDA-core work (2x at page 16), not memory
traffic.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp

from pallas_kernels import quant

SMEM_BUDGET_BYTES = 200 * 1024  # H100/H200 allow 227 KiB per block; keep headroom
ROW_ALIGN = 64  # rows of a WGMMA-layout register tile
TMA_SMEM_ALIGN = 128  # bytes: where a TMA copy may start writing SMEM
FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class KVTiles:
    """Static geometry of the paged K/V stream."""

    num_layers: int
    num_pages: int  # per layer
    max_pages: int  # block-table width
    page_size: int
    pages_per_block: int
    head_dim: int
    dtype: jnp.dtype  # the pages' storage dtype: a float, or 8-bit codes
    scaled: bool = False  # codes with float32 scales

    @property
    def paired(self) -> bool:
        """Scaled pages whose K and V scales move in one copy (module docstring)."""
        return self.scaled and self.page_size % 32 != 0

    @property
    def slot_rows(self) -> int:
        """SMEM rows per page: ``page_size``, twice that for paired scales."""
        return 2 * self.page_size if self.paired else self.page_size

    @property
    def block_tokens(self) -> int:
        """Keys per block."""
        return self.pages_per_block * self.page_size

    @property
    def block_rows(self) -> int:
        """SMEM rows per block (``block_tokens`` plus any dead rows)."""
        return self.pages_per_block * self.slot_rows

    @property
    def v_scale_offset(self) -> int:
        """Where the V scale of SMEM row ``r`` sits in a slot's scales: ``r + offset``."""
        return self.page_size if self.paired else self.block_rows

    @property
    def itemsize(self) -> int:
        return jnp.dtype(self.dtype).itemsize

    def scale_copies(self, i: int) -> tuple[tuple[int, int, int], ...]:
        """``(src, dst, n)`` float32 offsets and length of each scale copy of block page ``i``:
        ``scales[layer, page, h, src:src+n] -> s_smem[slot, dst:dst+n]`` (module docstring)."""
        s, w = self.page_size, self.slot_rows
        if not self.scaled:
            return ()
        if self.paired:  # [K | V] -> the page's 2 * page_size rows
            return ((0, i * w, w),)
        return ((0, i * w, s), (s, self.v_scale_offset + i * w, s))

    @property
    def copies_per_page(self) -> int:
        return 2 + len(self.scale_copies(0))  # K and V codes, then scales

    @property
    def scale_slot_len(self) -> int:
        """float32 scales per slot: K and V windows, padded so slot 1 starts 128-byte aligned."""
        per = TMA_SMEM_ALIGN // 4
        return -(-(self.block_rows + self.v_scale_offset) // per) * per

    def smem_bytes(self) -> int:
        kv = 2 * 2 * self.block_rows * self.head_dim * self.itemsize  # K, V x 2 slots
        return kv + (2 * self.scale_slot_len * 4 if self.scaled else 0)

    def scratch(self) -> dict[str, Any]:
        """K and V double buffers ``[2, block_rows, head_dim]``, f32 scales ``[2,
        scale_slot_len]`` when scaled, and one barrier per slot."""
        row_bytes = self.head_dim * self.itemsize
        swizzle = TMA_SMEM_ALIGN if row_bytes % TMA_SMEM_ALIGN == 0 else row_bytes
        transforms = (plgpu.TilingTransform((8, swizzle // self.itemsize)),
                      plgpu.SwizzleTransform(swizzle))  # validate_kv: 128k (or 64) bytes
        buf = plgpu.SMEM((2, self.block_rows, self.head_dim), self.dtype, transforms=transforms)
        out = dict(k_smem=buf, v_smem=buf, kv_bars=plgpu.Barrier(
            num_arrivals=self.copies_per_page * self.pages_per_block, num_barriers=2))
        if self.scaled:
            out["s_smem"] = plgpu.SMEM((2, self.scale_slot_len), jnp.float32)
        return out


def pool_operands(k_pages, v_pages, scales, layer, window=None):
    """-> ``(kv, ints)``: ``kv`` the 5-D pools ``(k, v)``, or ``(k, v, scales)`` with scales
    ``[layers, num_pages, kv_heads, 2 * page_size]`` (K then V: a free reshape of the pool's
    ``[..., 2, page_size]``); ``ints`` int32 ``[1]`` = (layer,), or ``[2]`` = (layer, window)
    when a ``window`` is given: what every kernel takes.

    ``layer=None``: one layer's 4-D pages (and scales) become a pool of one layer (a bitcast).
    ``window=None`` keeps the operand at ``[1]``, so a kernel without a window is unchanged.
    """
    ndim = 4 if layer is None else 5
    if k_pages.ndim != ndim or k_pages.shape != v_pages.shape:
        want = "[num_pages, " if layer is None else "with layer=: [num_layers, num_pages, "
        raise ValueError(f"k_pages and v_pages must both be {want}num_kv_heads, page_size,"
                         f" head_dim]; got {k_pages.shape} and {v_pages.shape}")
    kv = (k_pages, v_pages)
    if scales is not None:
        want = k_pages.shape[:-2] + (2, k_pages.shape[-2])
        if scales.shape != want or scales.dtype != jnp.float32:
            raise ValueError(f"scales must be float32 {list(want)} ([..., kv_heads, K|V,"
                             f" page_size], as paxkv.cache.pool.KVPool.scales); got"
                             f" {scales.dtype}{list(scales.shape)}")
        kv = (k_pages, v_pages, scales.reshape(want[:-2] + (-1,)))
    if layer is None:
        kv, ints = tuple(x[None] for x in kv), [jnp.zeros((1,), jnp.int32)]
    else:
        ints = [_int_scalar("layer", layer)]
    if window is not None:
        ints.append(_int_scalar("window", window))
    return kv, ints[0] if len(ints) == 1 else jnp.concatenate(ints)


def _int_scalar(name: str, x) -> jax.Array:
    """An integer scalar (Python or traced) as int32 ``[1]``."""
    if jnp.ndim(x) != 0 or not jnp.issubdtype(jnp.result_type(x), jnp.integer):
        raise ValueError(f"{name} must be an integer scalar; got {jnp.result_type(x)}"
                         f"{list(jnp.shape(x))}")
    return jnp.reshape(jnp.asarray(x, jnp.int32), (1,))


def _check_dtypes(k_pool, v_pool, scaled: bool) -> None:
    dtype = k_pool.dtype
    if v_pool.dtype != dtype:
        raise ValueError(f"k_pages/v_pages dtypes {dtype}/{v_pool.dtype} must match")
    if scaled and not quant.is_scaled(dtype):
        raise ValueError(f"scales were given with {dtype} pages: they go with 8-bit codes (int8,"
                         " or float8_e4m3fn stored as uint8 bits); pass scales=None")
    if not scaled and quant.is_scaled(dtype):
        raise ValueError(f"k_pages/v_pages hold {dtype} 8-bit codes: pass them with their"
                         " scales= (float32 [..., kv_heads, 2, page_size])")
    if not scaled and dtype not in FLOAT_DTYPES:
        raise ValueError(f"k_pages/v_pages dtype {dtype}: use float32, bfloat16 or float16"
                         " pages, or int8 / uint8 (fp8 bits) codes with scales=")


def validate_kv(kv, block_tables, pages_per_block: int) -> KVTiles:
    """Trace-time checks shared by the attention kernels on the pools of
    :func:`pool_operands`; errors say what to change."""
    k_pool, v_pool = kv[:2]
    _check_dtypes(k_pool, v_pool, len(kv) == 3)
    if block_tables.ndim != 2 or block_tables.dtype != jnp.int32:
        raise ValueError("block_tables must be int32 [batch, max_pages_per_seq]; got"
                         f" {block_tables.dtype}{list(block_tables.shape)}")
    num_layers, num_pages, _, page_size, head_dim = k_pool.shape
    tiles = KVTiles(num_layers, num_pages, block_tables.shape[1], page_size, pages_per_block,
                    head_dim, jnp.dtype(k_pool.dtype), len(kv) == 3)
    refusal = geometry_refusal(page_size, head_dim, tiles.itemsize, scaled=tiles.scaled)
    if refusal:
        raise ValueError(refusal)
    if tiles.block_rows % ROW_ALIGN:
        raise ValueError(
            f"pages_per_block x {tiles.slot_rows} SMEM rows per page = {tiles.block_rows} must"
            f" be a multiple of {ROW_ALIGN}; try pages_per_block="
            f"{default_pages_per_block(page_size, scaled=tiles.scaled)}")
    return tiles


def geometry_refusal(page_size: int, head_dim: int, itemsize: int, *,
                     scaled: bool) -> str | None:
    """Why the kernels cannot stream pages of ``page_size`` tokens x ``head_dim`` elements of
    ``itemsize`` bytes (``scaled``: 8-bit codes with scales), or None when they can. One rule
    for :func:`validate_kv` and for ``attention_impl="auto"``
    (:func:`paxkv.cache.paged.resolve_impl`), which falls back to XLA instead of failing."""
    if page_size % 8:
        return f"page_size={page_size} must be a multiple of 8 (SMEM row tiling)"
    if scaled and page_size % 16:
        return (f"page_size={page_size} with 8-bit K/V: a page's scales ({8 * page_size} bytes)"
                " are under one 128-byte copy; use a multiple of 16 (32 wastes no SMEM rows),"
                " or attention_impl='xla'")
    row_bytes = head_dim * itemsize  # 8-bit rows of 64 bytes take a 64-byte swizzle
    if row_bytes % TMA_SMEM_ALIGN and not (itemsize == 1 and row_bytes == 64):
        return (f"head_dim={head_dim} x {itemsize} bytes must be a multiple of 128 bytes"
                " (whole swizzled TMA rows): use head_dim 64 or 128")
    return None


def check_query(q_dtype, head_dim: int, tiles: KVTiles) -> None:
    """q matches float pages' dtype (8-bit pages: any float dtype) and their head_dim."""
    want = FLOAT_DTYPES if tiles.scaled else (tiles.dtype,)
    if head_dim != tiles.head_dim or q_dtype not in want:
        dtypes = "a float dtype" if tiles.scaled else f"dtype {tiles.dtype}"
        raise ValueError(f"q {q_dtype}[..., {head_dim}] must match the pages' head_dim"
                         f" {tiles.head_dim} and {dtypes}")


def default_pages_per_block(page_size: int, *, scaled: bool = False) -> int:
    """Fewest pages whose SMEM rows fill whole 64-row register tiles."""
    rows = KVTiles(1, 1, 1, page_size, 1, 1, jnp.dtype(jnp.int8), scaled).slot_rows
    return math.lcm(ROW_ALIGN, rows) // rows
