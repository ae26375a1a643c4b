"""The physical page pool: every layer's K and V pages in two fixed arrays (three when scaled).

``k`` and ``v`` are ``[num_layers, num_pages + 1, num_kv_heads, page_size, head_dim]``; the
last page is the sentinel that table padding and dropped writes point at. Each
(layer, page, kv-head) tile is one contiguous ``[page_size, head_dim]`` slab, the layout every
attention kernel reads. Nothing here assumes one device: the kv-head and slot axes can carry a
``jax.sharding`` spec.

A scaled 8-bit pool (``jnp.int8`` / ``jnp.float8_e4m3fn`` K/V, :mod:`pallas_kernels.quant`) holds codes
in ``k`` / ``v`` and their float32 scales in ``scales``, indexed by the same page ids::

    scales[layer, page, kv_head, 0, slot]   the K scale of that token and kv head
    scales[layer, page, kv_head, 1, slot]   its V scale

so every page operation here (scrub, copy-on-write) moves or clears a page's scales with its
codes, and the table's operations (fork, reorder, release, the prefix index's retain) never
see the difference: they move page ids.

All functions return a new pool; under ``jax.jit`` with the pool donated they update in place.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import kv_storage, quant
from paxkv.table.alloc import PoolUpdate


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPool:
    """K and V pages for all layers, ``[layers, num_pages + 1, kv_heads, page_size, head_dim]``;
    ``scales``: float32 ``[layers, num_pages + 1, kv_heads, 2, page_size]`` for a scaled pool
    (K at index 0, V at 1), else None."""

    k: jax.Array
    v: jax.Array
    scales: jax.Array | None = None

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_pages(self) -> int:
        """Real pages (the sentinel excluded)."""
        return self.k.shape[1] - 1

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.arrays())

    def arrays(self) -> tuple[jax.Array, ...]:
        """Every array indexed by page id (axis 1): ``(k, v)``, plus ``scales`` when scaled."""
        return (self.k, self.v) if self.scales is None else (self.k, self.v, self.scales)

    def read(self, layer: jax.Array, pages: jax.Array) -> tuple[jax.Array, jax.Array]:
        """K and V of ``pages`` (int32, any shape ``[...]``) of one layer, for attention:
        ``[..., kv_heads, page_size, head_dim]`` each, bfloat16 bits widened to float32, codes
        dequantised with their scales (:func:`pallas_kernels.kv_storage.readable`)."""
        return kv_storage.read_pages(self.k, self.v, self.scales, (layer, pages))


def create(*, num_layers: int, num_pages: int, num_kv_heads: int, page_size: int,
           head_dim: int, dtype: jnp.dtype = jnp.float32, fill: float = 0.0) -> KVPool:
    """A pool of ``num_pages`` real pages plus the sentinel for K/V of ``dtype``, filled with
    ``fill`` (tests use NaN to prove no stray reads: a scaled pool then holds codes quantise
    never writes and NaN scales). Stored in :func:`pallas_kernels.kv_storage.storage_dtype` (bfloat16
    on a CPU: its bits; int8 / fp8: codes plus ``scales``)."""
    shape = (num_layers, num_pages + 1, num_kv_heads, page_size, head_dim)
    kv_storage.storage_dtype(dtype)  # a dtype the pool cannot serve raises here
    fmt = quant.format_of(dtype)
    if fmt is None:
        return KVPool(k=kv_storage.full(shape, fill, dtype), v=kv_storage.full(shape, fill, dtype))
    codes, scale = quant.full_codes(shape, fill, fmt)
    return KVPool(k=codes, v=jnp.array(codes), scales=jnp.full(shape[:3] + (2, page_size), scale))


def apply(pool: KVPool, update: PoolUpdate, *, scrub: bool = True) -> KVPool:
    """Scrubs freshly handed-out pages (so no sequence ever sees another's old data), then
    performs the copy-on-write copies. Touches only the pages named; ids past the pool are
    no-ops.

    Each half runs under ``lax.cond``: most decode steps hand out no page and copy none, and
    an unconditional gather of ``copy_src`` would read ``max_seqs`` pages of every layer of K
    and V (47 MB at batch 64 for the default model) on every step only to drop the result.
    """
    limit = pool.num_pages + 1  # ids >= limit are no-ops
    Arrays = tuple[jax.Array, ...]

    def scrub_pages(kv: Arrays) -> Arrays:
        # 0 is +0.0 in every storage dtype (bfloat16 and fp8 bits included), and a 0 scale
        return tuple(x.at[:, update.fresh_pages].set(0, mode="drop") for x in kv)

    def copy_pages(kv: Arrays) -> Arrays:
        src = jnp.clip(update.copy_src, 0, pool.num_pages)
        return tuple(x.at[:, update.copy_dst].set(x[:, src], mode="drop") for x in kv)

    kv = pool.arrays()
    if scrub:
        kv = jax.lax.cond(jnp.any(update.fresh_pages < limit), scrub_pages, lambda x: x, kv)
    kv = jax.lax.cond(jnp.any(update.copy_dst < limit), copy_pages, lambda x: x, kv)
    return KVPool(*kv)


def write(pool: KVPool, layer: jax.Array, k_new: jax.Array, v_new: jax.Array,
          pages: jax.Array, offsets: jax.Array) -> KVPool:
    """Stores new tokens of one layer.

    Args:
      layer: int32 scalar.
      k_new, v_new: ``[batch, t, kv_heads, head_dim]``.
      pages, offsets: int32 ``[batch, t]`` from :func:`paxkv.table.page_table.slot_mapping`.

    A scaled pool quantises each (token, kv head) vector and stores its scale beside it.
    """
    if pool.scales is None:
        k = pool.k.at[layer, pages, :, offsets].set(kv_storage.to_storage(k_new, pool.k.dtype))
        v = pool.v.at[layer, pages, :, offsets].set(kv_storage.to_storage(v_new, pool.v.dtype))
        return KVPool(k=k, v=v)
    fmt = quant.format_of_storage(pool.k.dtype)
    (k_codes, k_scale), (v_codes, v_scale) = quant.quantise(k_new, fmt), quant.quantise(v_new, fmt)
    return KVPool(k=pool.k.at[layer, pages, :, offsets].set(k_codes),
                  v=pool.v.at[layer, pages, :, offsets].set(v_codes),
                  scales=pool.scales.at[layer, pages, :, :, offsets].set(
                      jnp.stack([k_scale, v_scale], axis=-1)))  # [batch, t, kv_heads, 2]
