"""Writing new K/V tokens into pages, and the page copy behind copy-on-write (Mosaic GPU).

Both kernels update the page arrays in place. The pages enter the kernel as GMEM refs
(``jax.new_ref``), which Pallas turns into an ``input_output_aliases`` entry on the Mosaic
custom call; the public wrappers donate ``k_pages``/``v_pages``, so under ``jax.jit`` XLA
aliases the donated buffers straight through and no page array is ever copied. The
alternative, a jnp scatter (the references below), is also done in place by XLA when the
pages are donated (tests check both), but the kernel makes the aliasing explicit in the HLO
rather than leaving it to buffer assignment, touches exactly the named slots with TMA, and
keeps the copy on the same stream as the attention kernels.

Slots or page pairs whose page id (or offset) falls outside the pool are skipped: padding
tokens and padding copy pairs point past the pool and cost nothing. ``write_kv`` also takes the
whole ``[num_layers, num_pages, ...]`` pool with ``layer=`` (read inside the kernel), so a model
scanning over layers writes into the carried pool without slicing a layer out of it.

Scaled 8-bit pools (int8 / fp8 codes with float32 scales) are not written here: one token's
codes per kv head are ``head_dim`` bytes (64 at head_dim 64) and its scales 4 bytes, under the
128 bytes every Mosaic GPU copy must move, so ``paxkv.cache.paged`` writes them with XLA's
quantise-and-scatter (:func:`paxkv.cache.pool.write`, in place when donated) and the attention
kernels read what it leaves.

Layers: kernel bodies -> call builders -> public jitted wrappers -> references (oracles).
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _interpret, quant
from pallas_kernels.kv_storage import to_storage

# ---------------------------------------------------------------- layer 1: kernel bodies


def _write_kernel(k_new_ref, v_new_ref, pages_ref, offsets_ref, layer_ref, k_pages_ref,
                  v_pages_ref):
    # k_new_ref, v_new_ref:     [batch, t, kv_heads, head_dim]                   GMEM
    # pages_ref, offsets_ref:   int32 [batch, t]; layer_ref: int32 [1]            GMEM
    # k_pages_ref, v_pages_ref: [layers, num_pages, kv_heads, page_size, head_dim] GMEM, in place
    num_layers, num_pages, kv_heads, page_size, head_dim = k_pages_ref.shape
    b, t = lax.axis_index("b"), lax.axis_index("t")
    page, offset, layer = pages_ref[b, t], offsets_ref[b, t], layer_ref[0]

    def body(k_smem, v_smem, bar):
        # k_smem, v_smem: [kv_heads, head_dim]; bar: 1 barrier, 2 arrivals (K and V)
        plgpu.copy_gmem_to_smem(k_new_ref.at[b, t], k_smem, bar.at[0])
        plgpu.copy_gmem_to_smem(v_new_ref.at[b, t], v_smem, bar.at[0])
        plgpu.barrier_wait(bar.at[0])
        plgpu.copy_smem_to_gmem(k_smem, k_pages_ref.at[layer, page, :, offset])
        plgpu.copy_smem_to_gmem(v_smem, v_pages_ref.at[layer, page, :, offset])
        plgpu.wait_smem_to_gmem(0)

    # NOTE: skipped slots (prefill padding) allocate nothing: scoped SMEM offsets are static
    # and barriers are reserved for the whole kernel, so this costs nothing on the GPU and
    # spares the interpreter a dozen host callbacks per padding slot.
    @pl.when((layer >= 0) & (layer < num_layers) & (page >= 0) & (page < num_pages)
             & (offset >= 0) & (offset < page_size))
    def _write():
        smem = plgpu.SMEM((kv_heads, head_dim), k_pages_ref.dtype)
        pl.run_scoped(body, smem, smem, plgpu.Barrier(num_arrivals=2, num_barriers=1))


def _copy_kernel(src_ref, dst_ref, k_pages_ref, v_pages_ref):
    # src_ref, dst_ref:         int32 [num_copies]                        GMEM
    # k_pages_ref, v_pages_ref: [num_pages, kv_heads, page_size, head_dim] GMEM, in place
    num_pages, _, page_size, head_dim = k_pages_ref.shape

    def body(k_smem, v_smem, bar):
        # k_smem, v_smem: [page_size, head_dim] (one kv head of one page); bar: 2 arrivals
        i, h = lax.axis_index("pair"), lax.axis_index("kvh")
        src, dst = src_ref[i], dst_ref[i]

        @pl.when((src >= 0) & (src < num_pages) & (dst >= 0) & (dst < num_pages))
        def _copy():
            plgpu.copy_gmem_to_smem(k_pages_ref.at[src, h], k_smem, bar.at[0])
            plgpu.copy_gmem_to_smem(v_pages_ref.at[src, h], v_smem, bar.at[0])
            plgpu.barrier_wait(bar.at[0])
            plgpu.copy_smem_to_gmem(k_smem, k_pages_ref.at[dst, h])
            plgpu.copy_smem_to_gmem(v_smem, v_pages_ref.at[dst, h])
            plgpu.wait_smem_to_gmem(0)

    smem = plgpu.SMEM((page_size, head_dim), k_pages_ref.dtype)
    pl.run_scoped(body, smem, smem, plgpu.Barrier(num_arrivals=2, num_barriers=1))


# ---------------------------------------------------------------- layer 2: call builders


def _in_place(kernel, grid: dict[str, int], name: str, interpret, k_pages, v_pages, *operands):
    """Runs ``kernel(*operands, k_pages_ref, v_pages_ref)`` on GMEM refs; returns the pages."""
    k_ref = jax.new_ref(k_pages, memory_space=plgpu.GMEM)
    v_ref = jax.new_ref(v_pages, memory_space=plgpu.GMEM)
    mesh = plgpu.Mesh(grid=tuple(grid.values()), grid_names=tuple(grid))
    pl.kernel(kernel, out_type=(), mesh=mesh, name=name,
              interpret=_interpret.interpret_params(interpret))(*operands, k_ref, v_ref)
    return k_ref[...], v_ref[...]


def _validate_pages(k_pages, v_pages, *, pool: bool = False) -> None:
    ndim, layers = (5, "num_layers, ") if pool else (4, "")
    if k_pages.ndim != ndim or k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages and v_pages must both be [{layers}num_pages, num_kv_heads,"
                         f" page_size, head_dim] of one dtype; got {k_pages.dtype}"
                         f"{list(k_pages.shape)} and {v_pages.dtype}{list(v_pages.shape)}")
    if quant.is_scaled(k_pages.dtype):
        raise ValueError(f"{k_pages.dtype} pages hold 8-bit codes with scales: write them with"
                         " paxkv.cache.pool.write (quantise + XLA scatter; module docstring)")
    if (k_pages.shape[-1] * k_pages.dtype.itemsize) % 128:
        raise ValueError(f"head_dim={k_pages.shape[-1]} rows must be a multiple of 128 bytes"
                         " (whole TMA rows): use head_dim 64 or 128")


# ---------------------------------------------------------------- layer 3: public wrappers


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnames=("k_pages", "v_pages"))
def write_kv(k_pages, v_pages, k_new, v_new, slot_pages, slot_offsets, *, layer=None,
             interpret=False):
    """Stores ``k_new[b, i]``/``v_new[b, i]`` at page ``slot_pages[b, i]``, slot
    ``slot_offsets[b, i]``; out-of-pool slots are skipped. Updates the donated pages in place.

    Args:
      k_pages, v_pages: ``[num_pages, num_kv_heads, page_size, head_dim]`` (donated), or with
        ``layer`` the whole pool ``[num_layers, num_pages, num_kv_heads, page_size, head_dim]``.
      k_new, v_new: ``[batch, t, num_kv_heads, head_dim]`` (stored in the pages' dtype:
        :func:`pallas_kernels.kv_storage.to_storage`).
      slot_pages, slot_offsets: int32 ``[batch, t]``; every in-pool slot named at most once.
      layer: int32 scalar: the layer of a 5-D pool to write (outside the pool: nothing is
        written); None for 4-D pages.

    Returns:
      ``(k_pages, v_pages)``, shaped as given.
    """
    _validate_pages(k_pages, v_pages, pool=layer is not None)
    if layer is not None and (jnp.ndim(layer) != 0
                              or not jnp.issubdtype(jnp.result_type(layer), jnp.integer)):
        raise ValueError(f"layer must be an integer scalar; got {jnp.result_type(layer)}"
                         f"{list(jnp.shape(layer))}")
    batch, t = slot_pages.shape
    expected = (batch, t, k_pages.shape[-3], k_pages.shape[-1])
    if k_new.shape != expected or v_new.shape != expected or slot_offsets.shape != (batch, t):
        raise ValueError(f"k_new/v_new must be {list(expected)} and slot_offsets [batch, t] to"
                         f" match slot_pages {list(slot_pages.shape)}; got {list(k_new.shape)},"
                         f" {list(v_new.shape)}, {list(slot_offsets.shape)}")
    if batch * t == 0:
        return k_pages, v_pages
    k_pool, v_pool = (k_pages[None], v_pages[None]) if layer is None else (k_pages, v_pages)
    layer_arr = jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,))
    k_pool, v_pool = _in_place(
        _write_kernel, {"b": batch, "t": t}, f"write_kv_t{t}", interpret, k_pool, v_pool,
        to_storage(k_new, k_pages.dtype), to_storage(v_new, v_pages.dtype),
        slot_pages.astype(jnp.int32),
        slot_offsets.astype(jnp.int32), layer_arr)
    return (k_pool[0], v_pool[0]) if layer is None else (k_pool, v_pool)


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnames=("k_pages", "v_pages"))
def copy_pages(k_pages, v_pages, src, dst, *, interpret=False):
    """Copy-on-write: page ``dst[i]`` <- page ``src[i]`` (all kv heads, K and V), in place.

    Args:
      k_pages, v_pages: ``[num_pages, num_kv_heads, page_size, head_dim]`` (donated).
      src, dst: int32 ``[num_copies]``; pairs with either id outside the pool are skipped.
        NOTE: ``dst`` ids must be distinct and disjoint from ``src`` (fresh pages), since
        pairs run concurrently.

    Returns:
      ``(k_pages, v_pages)``.
    """
    _validate_pages(k_pages, v_pages)
    if src.ndim != 1 or src.shape != dst.shape:
        raise ValueError(f"src and dst must be int32 [num_copies]; got {src.shape}, {dst.shape}")
    if src.shape[0] == 0:
        return k_pages, v_pages
    grid = {"pair": src.shape[0], "kvh": k_pages.shape[1]}
    return _in_place(_copy_kernel, grid, f"copy_pages_ps{k_pages.shape[2]}", interpret,
                     k_pages, v_pages, src.astype(jnp.int32), dst.astype(jnp.int32))


# ---------------------------------------------------------------- layer 4: references


def write_kv_reference(k_pages, v_pages, k_new, v_new, slot_pages, slot_offsets, *,
                       layer=None):
    """jnp twin of :func:`write_kv` (a scatter; in place under ``jit`` with the pages donated)."""
    if layer is not None:
        layer = jnp.asarray(layer, jnp.int32)
        in_pool = (layer >= 0) & (layer < k_pages.shape[0])
        layer = jnp.clip(layer, 0, k_pages.shape[0] - 1)
        k, v = write_kv_reference(k_pages[layer], v_pages[layer], k_new, v_new,
                                  jnp.where(in_pool, slot_pages, -1), slot_offsets)
        return k_pages.at[layer].set(k), v_pages.at[layer].set(v)
    num_pages, _, page_size, _ = k_pages.shape
    keep = ((slot_pages >= 0) & (slot_pages < num_pages)
            & (slot_offsets >= 0) & (slot_offsets < page_size))
    pages = jnp.where(keep, slot_pages, num_pages)  # NOTE: negative ids would wrap; drop them
    k_pages = k_pages.at[pages, :, slot_offsets].set(to_storage(k_new, k_pages.dtype),
                                                     mode="drop")
    v_pages = v_pages.at[pages, :, slot_offsets].set(to_storage(v_new, v_pages.dtype),
                                                     mode="drop")
    return k_pages, v_pages


def copy_pages_reference(k_pages, v_pages, src, dst):
    """jnp twin of :func:`copy_pages` (gather then scatter)."""
    num_pages = k_pages.shape[0]
    keep = (src >= 0) & (src < num_pages) & (dst >= 0) & (dst < num_pages)
    dst = jnp.where(keep, dst, num_pages)
    src = jnp.clip(src, 0, num_pages - 1)
    return (k_pages.at[dst].set(k_pages[src], mode="drop"),
            v_pages.at[dst].set(v_pages[src], mode="drop"))
