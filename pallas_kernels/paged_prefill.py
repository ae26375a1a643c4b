"""Paged prefill attention: ragged multi-token queries, causal over paged context (Mosaic GPU).

Sequence ``b`` brings its last ``query_lengths[b]`` tokens as queries; query ``t`` sits at
position ``lengths[b] - query_lengths[b] + t`` and sees every token at or before it (cached
prefix included). One program per (sequence, kv head, block of ``block_q`` query tokens) serves
``rows = block_q * group`` query rows against the same paged K/V stream as the decode kernel::

    rows of program (b, h, qb):  r = t * group + g   (query token t0 + t, query head h*group + g)
    kv block j (T tokens):       only rows whose position >= j*T see it, a suffix of the rows:
        rows [t_lo * group, n_q * group),  t_lo = clip(j*T - pos(t0), 0, n_q)

Per row, per block: the decode kernel's online-softmax step (CUDA cores, f32 state in SMEM).
Rows past ``query_lengths[b]`` are never computed and come out zero. Pages are one layer, or the
whole pool with ``layer=`` read inside the kernel, as in ``paged_decode.py``; 8-bit pages
(int8, fp8 bits) with ``scales=`` are dequantised after the load by the same block steps as
decode (``_tiles.py``), so prefill of an 8-bit cache needs no XLA fallback.

A sliding ``window=`` (int32 scalar, may be traced) narrows query ``p``'s keys to ``p - window <
k <= p``. A program then starts at the block holding its first query's first key, and each
block runs only the rows whose window reaches it (``_stream_blocks`` draws it); ``window=None``
builds the kernel without any of this.

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
from pallas_kernels.reference import default_sm_scale, paged_prefill_attention_reference

_MAX_ROWS = 256  # one TMA box of query rows

# ---------------------------------------------------------------- layer 1: kernel body


@dataclasses.dataclass(frozen=True)
class _PrefillSpec:
    tiles: KVTiles
    q_dtype: jnp.dtype
    group: int
    block_q: int
    max_q_len: int
    sm_scale: float
    soft_cap: float | None
    windowed: bool = False  # ints_ref holds (layer, window): a sliding window over the keys

    @property
    def rows(self) -> int:
        return self.block_q * self.group


def _prefill_kernel(q_ref, kv_refs, ints_ref, bt_ref, len_ref, qlen_ref, o_ref, *,
                    q_smem, k_smem, v_smem, acc_smem, stats_smem, q_bar, kv_bars, s_smem=None,
                    spec: _PrefillSpec, lay: _interpret.Layouts):
    # q_ref:      [batch, kv_heads, q_pad * group, head_dim]  GMEM; row t*group + g
    # kv_refs:    (k, v) or (k, v, scales) GMEM, the whole pool (as the decode kernel)
    # ints_ref:   int32 [1] (layer), or [2] (layer, window) when spec.windowed  GMEM
    # bt_ref:     int32 [batch, max_pages]  GMEM
    # len_ref, qlen_ref: int32 [batch]  GMEM
    # o_ref:      f32 [batch, kv_heads, q_pad * group, head_dim]  normalised output
    # q_smem:     [rows, head_dim]; k_smem/v_smem: [2, T, head_dim] (tiled, swizzled)
    # s_smem:     f32 [2, scale_slot_len] K | V scales per slot, scaled pools only
    # acc_smem:   f32 [rows, head_dim]; stats_smem: f32 [2, rows] (running max, running sum)
    # q_bar:      1 barrier; kv_bars: 2 barriers (one per slot), one arrival per page copy
    tiles, rows = spec.tiles, spec.rows
    b, h, qb = lax.axis_index("b"), lax.axis_index("kvh"), lax.axis_index("qblock")
    length = jnp.clip(len_ref[b], 0, tiles.max_pages * tiles.page_size)
    q_len = jnp.clip(qlen_ref[b], 0, jnp.minimum(length, spec.max_q_len))
    t0 = qb * spec.block_q
    pos0 = length - q_len + t0  # position of this program's first query token
    n_q = jnp.clip(q_len - t0, 0, spec.block_q)
    n_blocks = pl.cdiv(pos0 + n_q, tiles.block_tokens)  # keys up to the last query
    live_pages = pl.cdiv(length, tiles.page_size)
    window = start = None  # no window: blocks [0, n_blocks)
    if spec.windowed:  # blocks [start, ...): from the one holding the first query's first key
        window = read_window(ints_ref)
        start = jnp.maximum(pos0 - window + 1, 0) // tiles.block_tokens
        n_blocks = n_blocks - start
    st = KVStream(kv_refs[0], kv_refs[1], kv_refs[2] if tiles.scaled else None, bt_ref,
                  k_smem, v_smem, s_smem, kv_bars)

    @pl.when(n_q > 0)  # NOTE: programs without queries write nothing; the wrapper zeroes them
    def _queries():
        layer = read_layer(tiles, ints_ref)
        plgpu.copy_gmem_to_smem(q_ref.at[b, h, pl.ds(qb * rows, rows)], q_smem, q_bar.at[0])
        fetch_block(tiles, st, layer, b, h, 0 if start is None else start, live_pages, 0)
        _attend(spec, lay, st, q_smem, acc_smem, stats_smem, layer, b, h, length, pos0, n_q,
                start, n_blocks, live_pages, q_bar, window)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(acc_smem, o_ref.at[b, h, pl.ds(qb * rows, rows)])
        plgpu.wait_smem_to_gmem(0)


def _attend(spec, lay, st: KVStream, q_smem, acc_smem, stats_smem, layer, b, h, length, pos0,
            n_q, start, n_blocks, live_pages, q_bar, window):
    """Rows ``[0, n_q * group)``: stream the K/V blocks, update each row, normalise."""
    tiles, group = spec.tiles, spec.group
    zero_rows(lay, acc_smem, 0, n_q * group, tiles.head_dim)

    @pl.loop(0, n_q * group)
    def _init(r):
        stats_smem[0, r] = jnp.float32(-jnp.inf)
        stats_smem[1, r] = jnp.float32(0.0)

    plgpu.barrier_wait(q_bar.at[0])

    _stream_blocks(spec, lay, st, q_smem, acc_smem, stats_smem, layer, b, h, length, pos0, n_q,
                   start, n_blocks, live_pages, window)

    @pl.loop(0, n_q * group)
    def _normalise(r):
        denom = stats_smem[1, r]
        acc_smem[r] = lay.load(acc_smem, r, lay.col) / jnp.where(denom > 0, denom, 1.0)


def _stream_blocks(spec, lay, st: KVStream, q_smem, acc_smem, stats_smem, layer, b, h, length,
                   pos0, n_q, start, n_blocks, live_pages, window):
    """Blocks ``start + j`` for ``j < n_blocks`` (``start`` None: 0, no window), the first
    already in flight to slot 0, each fed to the query rows that see one of its keys::

        query t (position p = pos0 + t) sees keys  p - window < k <= p
        block [kpos0, kpos0 + T) is seen by        t in [t_lo, t_hi)
            t_lo = clip(kpos0 - pos0, 0, n_q)                  (causal: p >= kpos0)
            t_hi = clip(kpos0 + T - 1 + window - pos0, 0, n_q) (window: p - window < kpos0 + T - 1)

    NOTE: softmax_update needs a visible key in every row it runs; both bounds keep that."""
    tiles, group = spec.tiles, spec.group
    kpos_lo = None if window is None else jnp.maximum(pos0 - window + 1, 0)

    @pl.loop(0, n_blocks)
    def _block(j):
        slot = lax.rem(j, 2)
        at = j if start is None else start + j  # the block's index in the sequence

        @pl.when(j + 1 < n_blocks)
        def _prefetch():
            plgpu.commit_smem()  # every thread is done reading the slot about to be refilled
            fetch_block(tiles, st, layer, b, h, at + 1, live_pages, 1 - slot)

        plgpu.barrier_wait(st.bars.at[slot])
        kpos0 = at * tiles.block_tokens
        blk = load_block(tiles, lay, st, slot, kpos0, length, spec.sm_scale, kpos_lo)
        t_lo = jnp.clip(kpos0 - pos0, 0, n_q)
        t_hi = n_q
        if window is not None:
            t_hi = jnp.clip(kpos0 + tiles.block_tokens - 1 + window - pos0, 0, n_q)

        @pl.loop(t_lo * group, t_hi * group)
        def _row(r):
            visible = blk.kpos <= pos0 + r // group  # causal; implies kpos < length
            if window is not None:
                visible &= blk.kpos > pos0 + r // group - window
            m, l = softmax_update(lay, q_smem, blk, visible, stats_smem[0, r],
                                  stats_smem[1, r], acc_smem, r, sm_scale=spec.sm_scale,
                                  soft_cap=spec.soft_cap)
            stats_smem[0, r] = m
            stats_smem[1, r] = l


# ---------------------------------------------------------------- layer 2: call builder


def _prefill_call(spec: _PrefillSpec, batch: int, num_kv_heads: int, q_blocks: int, interpret):
    tiles, rows = spec.tiles, spec.rows
    interpret = _interpret.interpret_params(interpret)
    lay = _interpret.Layouts(interpret is not None)
    scratch = dict(q_smem=plgpu.SMEM((rows, tiles.head_dim), spec.q_dtype),
                   acc_smem=plgpu.SMEM((rows, tiles.head_dim), jnp.float32),
                   stats_smem=plgpu.SMEM((2, rows), jnp.float32),
                   q_bar=plgpu.Barrier(num_barriers=1), **tiles.scratch())
    out_type = jax.ShapeDtypeStruct((batch, num_kv_heads, q_blocks * rows, tiles.head_dim),
                                    jnp.float32)
    codes = f"_{tiles.dtype.name}" if tiles.scaled else ""
    window = "_window" if spec.windowed else ""
    name = (f"paged_prefill_bq{spec.block_q}_ppb{tiles.pages_per_block}_ps{tiles.page_size}"
            f"_g{spec.group}_d{tiles.head_dim}{codes}{window}")
    return plgpu.kernel(
        functools.partial(_prefill_kernel, spec=spec, lay=lay), out_type=out_type,
        scratch_types=scratch, grid=(batch, num_kv_heads, q_blocks),
        grid_names=("b", "kvh", "qblock"), interpret=interpret, kernel_name=name)


def _smem_bytes(tiles: KVTiles, rows: int, q_itemsize: int) -> int:
    return tiles.smem_bytes() + rows * tiles.head_dim * (q_itemsize + 4) + 8 * rows


def default_block_q(tiles: KVTiles, group: int, max_q_len: int, q_itemsize: int) -> int:
    """Largest query block (<= 16 tokens, <= 128 rows) that fits SMEM."""
    for bq in (16, 8, 4, 2, 1):
        bq = max(1, min(bq, max_q_len))
        if bq * group <= 128 and _smem_bytes(tiles, bq * group, q_itemsize) <= SMEM_BUDGET_BYTES:
            return bq
    return 1


# ---------------------------------------------------------------- layer 3: public wrapper


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "logit_soft_cap", "pages_per_block", "block_q", "interpret"))
def paged_prefill_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                            block_tables: jax.Array, lengths: jax.Array,
                            query_lengths: jax.Array, *, scales: jax.Array | None = None,
                            layer: jax.Array | None = None,
                            window: jax.Array | int | None = None,
                            sm_scale: float | None = None, logit_soft_cap: float | None = None,
                            pages_per_block: int | None = None, block_q: int | None = None,
                            interpret: _interpret.Interpret = False) -> jax.Array:
    """Ragged causal queries over paged context (chunked prefill, cached prefixes).

    Args:
      q: ``[batch, max_q_len, num_q_heads, head_dim]``; query ``t`` of row ``b`` sits at
        position ``lengths[b] - query_lengths[b] + t``.
      k_pages, v_pages: ``[num_pages, num_kv_heads, page_size, head_dim]``, or with ``layer``
        the whole pool ``[num_layers, num_pages, num_kv_heads, page_size, head_dim]``; floats
        in ``q.dtype``, or 8-bit codes with ``scales`` (as :func:`paged_decode_attention`).
      block_tables: int32 ``[batch, max_pages_per_seq]``.
      lengths: int32 ``[batch]``, the queries' own tokens included.
      query_lengths: int32 ``[batch]``, ``<= min(lengths, max_q_len)``.
      scales: float32 ``[(num_layers,) num_pages, num_kv_heads, 2, page_size]`` for 8-bit
        pages, else None.
      layer: int32 scalar: the layer of a 5-D pool to read (no ``pool[layer]`` copy); None for
        4-D pages.
      window: int32 scalar (may be traced), a sliding window: the query at position ``p``
        sees keys ``p - window < k <= p`` (HF's ``sliding_window``; values below 1 act as 1).
        None: causal over every key (the kernel is then built without the window).
      sm_scale, logit_soft_cap: as :func:`paged_decode_attention`.
      pages_per_block: pages per compute block (default: fill 64 SMEM rows).
      block_q: query tokens per program (default: up to 16, at most 128 rows).
      interpret: ``True`` (or ``InterpretGPUParams``) runs the kernel on CPU.

    Returns:
      ``[batch, max_q_len, num_q_heads, head_dim]`` in ``q.dtype``; queries
      ``t >= query_lengths[b]`` are zero.
    """
    if q.ndim != 4:
        raise ValueError(f"q must be [batch, max_q_len, num_q_heads, head_dim]; got {q.shape}")
    batch, max_q_len, num_q_heads, head_dim = q.shape
    kv, ints = pool_operands(k_pages, v_pages, scales, layer, window)
    ppb = pages_per_block or default_pages_per_block(kv[0].shape[3], scaled=scales is not None)
    tiles = validate_kv(kv, block_tables, ppb)
    num_kv_heads = kv[0].shape[2]
    _check_rows(q, tiles, num_kv_heads, block_tables, lengths, query_lengths)
    group = num_q_heads // num_kv_heads
    bq = block_q or default_block_q(tiles, group, max_q_len, q.dtype.itemsize)
    smem = _smem_bytes(tiles, bq * group, q.dtype.itemsize)
    if bq * group > _MAX_ROWS or smem > SMEM_BUDGET_BYTES:
        raise ValueError(f"block_q={bq} x group={group} rows need {smem} bytes of SMEM (budget"
                         f" {SMEM_BUDGET_BYTES}, <= {_MAX_ROWS} rows): lower block_q or"
                         " pages_per_block")
    q_blocks = pl.cdiv(max_q_len, bq)
    spec = _PrefillSpec(tiles, jnp.dtype(q.dtype), group, bq, max_q_len,
                        default_sm_scale(head_dim, sm_scale), logit_soft_cap,
                        windowed=window is not None)
    q_rows = jnp.pad(q, ((0, 0), (0, q_blocks * bq - max_q_len), (0, 0), (0, 0)))
    q_rows = q_rows.reshape(batch, q_blocks * bq, num_kv_heads, group, head_dim)
    q_rows = q_rows.transpose(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, -1, head_dim)
    out = _prefill_call(spec, batch, num_kv_heads, q_blocks, interpret)(
        q_rows, kv, ints, block_tables, lengths.astype(jnp.int32),
        query_lengths.astype(jnp.int32))
    out = out.reshape(batch, num_kv_heads, q_blocks * bq, group, head_dim).transpose(0, 2, 1, 3, 4)
    out = out[:, :max_q_len].reshape(q.shape)
    is_query = jnp.arange(max_q_len)[None, :] < jnp.minimum(query_lengths, lengths)[:, None]
    return jnp.where(is_query[:, :, None, None], out, 0.0).astype(q.dtype)


def _check_rows(q, tiles: KVTiles, num_kv_heads: int, block_tables, lengths,
                query_lengths) -> None:
    batch, _, num_q_heads, head_dim = q.shape
    check_query(q.dtype, head_dim, tiles)
    if num_q_heads % num_kv_heads or any(
            x.shape != (batch,) for x in (lengths, query_lengths)) or (
            block_tables.shape[0] != batch):
        raise ValueError(f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads="
                         f"{num_kv_heads}; block_tables, lengths, query_lengths must lead with"
                         f" batch={batch}")


# ---------------------------------------------------------------- layer 4: reference

reference = paged_prefill_attention_reference
