"""The paged KV cache: a page pool plus a page table, behind :class:`paxkv.core.protocol.KVCache`.

The model calls :meth:`PagedCache.attend` once per layer; decode loops call ``reserve``,
``release`` and ``fork``. Every method returns a new cache (and a status where it can fail);
inside ``jax.jit`` with the cache donated the pool is updated in place. How attention runs is
chosen once, when the cache is made (``impl``: the Pallas kernels or the XLA path); what one
step may skip is the step's :class:`~paxkv.core.plan.AttentionPlan`, checked here.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import quant
from pallas_kernels.kv_storage import is_bits
from paxkv.attention.blocks import check_windows, default_sm_scale, layer_window
from paxkv.cache import paged_xla
from paxkv.cache import pool as kv_pool
from paxkv.core import buckets
from paxkv.core.plan import NO_PLAN, AttentionPlan
from paxkv.core.step_info import StepInfo
from paxkv.table import page_table as pt

IMPLS = ("xla", "pallas", "pallas_mma")


def resolve_impl(impl: str, dtype: jnp.dtype, *, page_size: int, head_dim: int,
                 backend: str | None = None) -> str:
    """``"auto"`` -> the Pallas kernels on a GPU when they can stream pages of this geometry
    (``page_size`` tokens x ``head_dim`` of K/V ``dtype``: floats, or int8 / fp8 codes with
    scales), the XLA path otherwise: a small test model on a GPU (head_dim 16, page 4) runs
    rather than failing at its first step. Naming ``"pallas"`` keeps the kernels' own error.
    ``backend``: JAX's default backend unless given. Checks the name."""
    if impl not in IMPLS + ("auto",):
        raise ValueError(f"attention_impl must be 'auto', 'pallas', 'pallas_mma' or 'xla', "
                         f"got {impl!r}")
    if impl != "auto":
        return impl
    if (backend or jax.default_backend()) != "gpu":
        return "xla"
    from pallas_kernels._tiles import FLOAT_DTYPES, geometry_refusal  # Mosaic GPU: on a GPU only

    dtype = jnp.dtype(dtype)
    scaled = quant.format_of(dtype) is not None
    if not scaled and dtype not in FLOAT_DTYPES:
        return "xla"
    itemsize = 1 if scaled else dtype.itemsize
    return "xla" if geometry_refusal(page_size, head_dim, itemsize, scaled=scaled) else "pallas"


@functools.partial(jax.tree_util.register_dataclass, data_fields=["pool", "table"],
                   meta_fields=["scrub", "impl", "layer_windows"])
@dataclasses.dataclass(frozen=True)
class PagedCache:
    """Paged KV for ``max_seqs`` sequences.

    Attributes:
      pool: the K/V pages of every layer.
      table: block tables, lengths, ref counts.
      scrub: zero pages when they are handed out (static).
      impl: "xla", "pallas" or "pallas_mma" (the kernels on tensor cores where they serve the
        pages): how :meth:`attend` reads the pages (static).
      layer_windows: each layer's sliding window (None: global), or None when no layer slides
        (static; :func:`paxkv.attention.blocks.layer_window`): a window layer's queries read
        only their last ``w`` keys.
    """

    pool: kv_pool.KVPool
    table: pt.PageTable
    scrub: bool = True
    impl: str = "xla"
    layer_windows: tuple[int | None, ...] | None = None

    shares_pages = True

    @property
    def lengths(self) -> jax.Array:
        return self.table.lengths

    @property
    def active(self) -> jax.Array:
        return self.table.active

    @property
    def max_seqs(self) -> int:
        return self.table.max_seqs

    @property
    def max_len(self) -> int:
        return self.table.max_len

    @property
    def page_size(self) -> int:
        return self.table.page_size

    @property
    def num_pages(self) -> int:
        return self.table.num_pages

    @property
    def total_pages(self) -> int:
        return self.table.num_pages

    @property
    def kv_bytes_per_page(self) -> int:
        """K + V bytes of one page over all layers, scales included (the pool has one
        sentinel page past ``num_pages``)."""
        return self.pool.nbytes // (self.num_pages + 1)

    @property
    def kv_bytes_per_device(self) -> int:
        """Every pool byte (one device holds it all)."""
        return self.pool.nbytes

    def reserve(self, num_new: jax.Array, *, max_new: int) -> tuple["PagedCache", jax.Array]:
        """Room for ``num_new`` int32 ``[max_seqs]`` more tokens; ``ok`` bool ``[max_seqs]``."""
        table, update, ok = pt.reserve(self.table, num_new, max_new=max_new)
        pool = kv_pool.apply(self.pool, update, scrub=self.scrub)
        return dataclasses.replace(self, pool=pool, table=table), ok

    def release(self, rows: jax.Array) -> tuple["PagedCache", jax.Array]:
        """Frees rows (bool ``[max_seqs]``); their unshared pages are free at once."""
        table, ok = pt.release(self.table, rows)
        return dataclasses.replace(self, table=table), ok

    def fork(self, parents: jax.Array, children: jax.Array) -> tuple["PagedCache", jax.Array]:
        """Children share their parents' pages (no KV copied); ``ok`` bool ``[k]``."""
        table, ok = pt.fork(self.table, parents, children)
        return dataclasses.replace(self, table=table), ok

    def reorder(self, parents: jax.Array) -> tuple["PagedCache", jax.Array]:
        """Row ``b`` continues row ``parents[b]`` (int32 ``[max_seqs]``, -1 = drop): block-table
        rows and ref counts move, KV stays put (beam search)."""
        table, ok = pt.reorder(self.table, parents)
        return dataclasses.replace(self, table=table), ok

    def free_pages(self) -> jax.Array:
        """int32 scalar: pages nobody holds."""
        return jnp.sum(self.table.ref_counts == 0).astype(jnp.int32)

    def pages_used(self) -> jax.Array:
        """int32 ``[max_seqs]``: pages each row references."""
        return self.table.pages_held()

    def stats(self) -> pt.TableStats:
        return pt.stats(self.table)

    def sharing_stats(self) -> pt.SharingStats:
        """Who shares what, per row (:func:`paxkv.table.page_table.sharing_stats`)."""
        return pt.sharing_stats(self.table)

    def attend(self, layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
               step: StepInfo, *, sm_scale: float | None = None,
               logit_soft_cap: float | None = None) -> tuple["PagedCache", jax.Array]:
        """Writes this step's K/V for ``layer`` into their slots, then attends
        (:meth:`paxkv.core.protocol.KVCache.attend`: q ``[b, t, H, Dh]``, k/v ``[b, t, K, Dh]`` ->
        ``(cache, [b, t, H, Dh])``).

        The step's plan window is checked: when a live row holds more tokens than the window,
        the step reads whole rows without the plan's other hints (never fewer keys).
        """
        pool, out = attend_pages(self.pool, self.table, self.impl, layer, q, k, v, step,
                                 sm_scale=sm_scale, logit_soft_cap=logit_soft_cap,
                                 window=layer_window(self.layer_windows, layer))
        return dataclasses.replace(self, pool=pool), out


def attend_pages(pool: kv_pool.KVPool, table: pt.PageTable, impl: str, layer: jax.Array,
                 q: jax.Array, k: jax.Array, v: jax.Array, step: StepInfo, *,
                 sm_scale: float | None, logit_soft_cap: float | None,
                 window: jax.Array | None) -> tuple[kv_pool.KVPool, jax.Array]:
    """:meth:`PagedCache.attend` over any (pool, table) pair: writes ``k``, ``v`` into the
    slots ``table`` maps this step's positions to (in pool layer ``layer``), then attends with
    ``q`` over ``table``'s pages -> ``(pool, [b, t, H, Dh])``. ``window``: the layer's sliding
    window (int32 scalar) or None. The layer-grouped cache calls it with a view of one group's
    table over its flat pool."""
    scores = dict(sm_scale=default_sm_scale(q.shape[-1], sm_scale),
                  logit_soft_cap=logit_soft_cap, window=window)
    page_size = table.page_size
    pages, offsets = pt.slot_mapping(table, step.positions, step.rows)
    block_tables = table.block_tables
    if step.rows is not None:
        block_tables = block_tables[step.rows]
    if impl != "xla":
        pool = _pallas_write(pool, layer, k, v, pages, offsets)
    else:
        pool = kv_pool.write(pool, layer, k, v, pages, offsets)

    def read(tables: jax.Array, plan: AttentionPlan) -> jax.Array:
        if impl != "xla":
            return _pallas_attend(pool, layer, q, tables, step, scores,
                                  mma=impl == "pallas_mma")
        return paged_xla.attend(pool, layer, q, tables, step, plan,
                                page_size=page_size, **scores)

    plan, width = step.plan, block_tables.shape[1]  # the plan's window: the rows' span
    span = width if plan.window is None else min(width, buckets.cdiv(plan.window, page_size))
    if span == width:
        return pool, read(block_tables, plan)
    live = step.query_lengths > 0
    fits = jnp.all(~live | (step.lengths <= span * page_size))
    return pool, lax.cond(fits, lambda: read(block_tables[:, :span], plan),
                          lambda: read(block_tables, NO_PLAN))


def _pallas_write(pool: kv_pool.KVPool, layer: jax.Array, k: jax.Array, v: jax.Array,
                  pages: jax.Array, offsets: jax.Array) -> kv_pool.KVPool:
    """Writes K/V ``[b, t, K, Dh]`` into their slots with the Pallas kernel (interpret mode off
    GPU); padding slots go to the sentinel page and are skipped.

    NOTE: a scaled 8-bit pool is written by XLA (:func:`paxkv.cache.pool.write`: quantise, then a
    scatter, in place with the pool donated): one token's codes per kv head are ``head_dim``
    bytes (64 at head_dim 64) and its scales 4 bytes, under the 128 bytes every Mosaic GPU copy
    must move, so a kernel could not write SmolLM2's 3 x 64-byte token rows. The attention
    kernels read the pool this write leaves, bit-identical to the XLA path's.
    """
    import pallas_kernels  # noqa: PLC0415 - the kernels load only when a cache uses them

    if pool.scales is not None:
        return kv_pool.write(pool, layer, k, v, pages, offsets)
    if is_bits(pool.k):
        raise ValueError(
            "the Pallas kernels read typed pools; this pool stores bfloat16 K/V as bits (a CPU "
            "pool, pallas_kernels.kv_storage): use attention_impl='xla' here, or kv_dtype=jnp.float32 "
            "to test the kernels")
    pages = jnp.where(pages < pool.num_pages, pages, -1)
    k_pool, v_pool = pallas_kernels.write_kv(pool.k, pool.v, k, v, pages, offsets, layer=layer,
                                             interpret=jax.default_backend() != "gpu")
    return kv_pool.KVPool(k=k_pool, v=v_pool)


def _pallas_attend(pool: kv_pool.KVPool, layer: jax.Array, q: jax.Array,
                   block_tables: jax.Array, step: StepInfo, scores: dict,
                   mma: bool = False) -> jax.Array:
    """The decode or prefill kernel over ``block_tables`` ``[b, width]`` -> ``[b, t, H, Dh]``.

    NOTE: every kernel gets the whole 5-D pool plus ``layer`` and indexes the layer itself:
    ``pool.k[layer]`` here would be a dynamic slice that XLA materialises to feed the custom
    call, a copy of one layer's K/V per layer per step. Rows that do not attend this step get
    length 0, so a kernel never walks a table past the window it was given. 8-bit pools hand
    their scales along; the kernels dequantise after the load. ``mma``: decode and prefill on
    tensor cores (:mod:`pallas_kernels.tensor_cores`) where they serve the pages (bf16 / f16,
    no sliding window), the CUDA-core kernels elsewhere.
    """
    import pallas_kernels  # noqa: PLC0415

    interpret = jax.default_backend() != "gpu"
    lengths = jnp.where(step.query_lengths > 0, step.lengths, 0)
    if q.shape[1] == 1 and mma and _mma_serves(pool, scores):
        from pallas_kernels.tensor_cores.decode import paged_decode_attention_mma  # noqa: PLC0415

        return paged_decode_attention_mma(  # 16-bit operands, as the pages
            q[:, 0].astype(pool.k.dtype), pool.k, pool.v, block_tables, lengths, layer=layer,
            sm_scale=scores["sm_scale"], logit_soft_cap=scores["logit_soft_cap"],
            interpret=interpret)[:, None].astype(q.dtype)
    if q.shape[1] == 1:
        return pallas_kernels.paged_decode_attention(
            q[:, 0], pool.k, pool.v, block_tables, lengths, scales=pool.scales, layer=layer,
            interpret=interpret, **scores)[:, None]
    if mma and _mma_serves(pool, scores):
        from pallas_kernels.tensor_cores.prefill import paged_prefill_attention_mma  # noqa: PLC0415

        return paged_prefill_attention_mma(
            q.astype(pool.k.dtype), pool.k, pool.v, block_tables, lengths, step.query_lengths,
            layer=layer, sm_scale=scores["sm_scale"], logit_soft_cap=scores["logit_soft_cap"],
            interpret=interpret).astype(q.dtype)
    return pallas_kernels.paged_prefill_attention(
        q, pool.k, pool.v, block_tables, lengths, step.query_lengths, scales=pool.scales,
        layer=layer, interpret=interpret, **scores)


def _mma_serves(pool: kv_pool.KVPool, scores: dict) -> bool:
    """Whether the tensor-core kernels take this pool and layer's window."""
    from pallas_kernels.tensor_cores import geometry  # noqa: PLC0415 - arithmetic only

    return geometry.serves(pool.k.dtype, *pool.k.shape[-2:], window=scores["window"],
                           scales=pool.scales)


def create(*, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int,
           page_size: int, max_seqs: int, max_len: int, dtype: jnp.dtype = jnp.float32,
           scrub: bool = True, fill: float = 0.0, attention_impl: str = "auto",
           layer_windows: tuple[int | None, ...] | None = None) -> PagedCache:
    """An empty paged cache of ``num_pages`` pages of ``page_size`` tokens for ``max_seqs``
    sequences of at most ``max_len`` tokens each, K/V in ``dtype`` (bfloat16 on a CPU is
    stored as bits: :mod:`pallas_kernels.kv_storage`; ``jnp.int8`` / ``jnp.float8_e4m3fn`` as 8-bit
    codes with per-token scales: :mod:`pallas_kernels.quant`). ``attention_impl``: "auto" (the Pallas
    kernels on a GPU where they serve this geometry, XLA elsewhere: :func:`resolve_impl`),
    "pallas" or "xla". ``layer_windows``: the model's (:attr:`paxkv.Model.layer_windows`), one
    entry per layer: each window layer's queries see only their last ``w`` keys."""
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len!r}")
    impl = resolve_impl(attention_impl, dtype, page_size=page_size, head_dim=head_dim)
    max_pages_per_seq = buckets.cdiv(max_len, page_size)
    table = pt.create(num_pages=num_pages, page_size=page_size, max_seqs=max_seqs,
                      max_pages_per_seq=max_pages_per_seq)
    pool = kv_pool.create(num_layers=num_layers, num_pages=num_pages, num_kv_heads=num_kv_heads,
                          page_size=page_size, head_dim=head_dim, dtype=dtype, fill=fill)
    return PagedCache(pool=pool, table=table, scrub=scrub, impl=impl,
                      layer_windows=check_windows(layer_windows, num_layers))
