"""How K/V values are stored in a pool, and read back for attention.

A pool holds K/V in the dtype the caller asks for (``float32`` by default), except one case:
**bfloat16 on a CPU is stored as its raw bits, in** ``uint16``. XLA:CPU runs bfloat16 arrays
through float32: a bfloat16 pool's gather converts what it reads, and the step's K/V write (a
scatter into the pool) converted the whole pool to float32 and back, four whole-pool
conversions a layer (a batch-8 x 512 decode step of the default model: 1.26 s, against 98 ms
stored as bits and 116 ms in float32; ``experiments/README.md``). Integer
gathers, scatters and page copies move the bits untouched, and a reader widens them to
float32 exactly (a bfloat16 is the top half of a float32), inside the copy that gathers them.

Who does what:

* :func:`storage_dtype` picks the pool's dtype for the K/V dtype asked for (:func:`full`
  makes a pool array in it);
* :func:`to_storage` turns new K/V into the pool's dtype (bfloat16 rounding: round to
  nearest even, as ``astype(jnp.bfloat16)``);
* :func:`readable` is applied to every gather from a pool: the bits become float32, any
  other dtype passes unchanged (the attention math casts it to float32 itself).

A bits pool stores and attends exactly as a float32 pool holding the same (bfloat16)
values (``tests/test_kv_storage.py``); a ``jnp.bfloat16``-typed pool agrees within bfloat16
rounding (its prefill also rounds the softmax weights for the value product). The Pallas
kernels take typed pools only: on a GPU bfloat16 is stored as itself.

**Scaled 8-bit K/V** (``jnp.int8``, ``jnp.float8_e4m3fn``: :mod:`pallas_kernels.quant`) is stored as
codes (int8; fp8 as its bits in uint8) plus a float32 scale per (token, kv head) held beside
them; :func:`to_storage` does not apply (use :func:`pallas_kernels.quant.quantise`) and
:func:`readable` needs the scales. A pool of codes attends exactly as a float32 pool holding
the dequantised values (``tests/test_int8.py``).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import quant

BFLOAT16_BITS = jnp.dtype(jnp.uint16)


def storage_dtype(dtype: jnp.dtype, backend: str | None = None) -> jnp.dtype:
    """The dtype a pool of ``dtype`` K/V is stored in on ``backend`` (default: JAX's default
    backend): :data:`BFLOAT16_BITS` for bfloat16 on a CPU, the codes' dtype of a scaled format
    (:mod:`pallas_kernels.quant`), else ``dtype`` itself; other dtypes raise, naming those served."""
    dtype = jnp.dtype(dtype)
    fmt = quant.format_of(dtype)
    if fmt is not None:
        return fmt.storage
    if not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize < 2:
        raise ValueError(f"K/V dtype {dtype} is not served: use a float dtype of 16 bits or more "
                         "(e.g. jnp.float32, jnp.bfloat16), or jnp.int8 / jnp.float8_e4m3fn "
                         "(8-bit codes with per-token scales)")
    backend = jax.default_backend() if backend is None else backend
    return BFLOAT16_BITS if dtype == jnp.bfloat16 and backend == "cpu" else dtype


def is_bits(x: jax.Array | jnp.dtype) -> bool:
    """Whether ``x`` (an array or a dtype) holds bfloat16 K/V as raw bits."""
    return jnp.dtype(getattr(x, "dtype", x)) == BFLOAT16_BITS


def to_storage(x: jax.Array, storage: jnp.dtype) -> jax.Array:
    """K/V values ``x`` (any float dtype) as stored in a pool of dtype ``storage`` (not a
    scaled one: :func:`pallas_kernels.quant.quantise` makes codes and scales)."""
    if quant.is_scaled(storage):
        raise ValueError(f"a {storage} pool stores codes with scales: use pallas_kernels.quant.quantise")
    if is_bits(storage):
        return lax.bitcast_convert_type(jnp.asarray(x).astype(jnp.bfloat16), BFLOAT16_BITS)
    return jnp.asarray(x).astype(storage)


def full(shape: tuple[int, ...], value: float, dtype: jnp.dtype) -> jax.Array:
    """A pool array of ``shape`` for K/V of unscaled ``dtype`` (stored in
    :func:`storage_dtype`), every value ``value`` (NaN in tests); scaled formats:
    :func:`pallas_kernels.quant.full_codes`."""
    storage = storage_dtype(dtype)
    if quant.is_scaled(storage):
        raise ValueError(f"a {dtype} pool stores codes with scales: use pallas_kernels.quant.full_codes")
    if is_bits(storage):
        return jnp.full(shape, np.array(value, jnp.bfloat16).view(np.uint16), storage)
    return jnp.full(shape, value, storage)


def readable(x: jax.Array, scales: jax.Array | None = None) -> jax.Array:
    """K/V gathered from a pool, for the attention math: bfloat16 bits -> float32 (exact);
    scaled codes ``[..., head_dim]`` with their gathered ``scales [...]`` -> float32
    (:func:`pallas_kernels.quant.dequantise`); any other dtype unchanged. Callers apply it right at
    the gather, so XLA fuses the shift (or the scaling) into the copy."""
    if scales is not None or quant.is_scaled(x):
        if scales is None:
            raise ValueError(f"{x.dtype} K/V codes are read with their scales")
        return quant.dequantise(x, scales)
    if is_bits(x):
        return lax.bitcast_convert_type(x.astype(jnp.uint32) << 16, jnp.float32)
    return x


def read_pages(k: jax.Array, v: jax.Array, scales: jax.Array | None, index: tuple,
               get: Callable[[jax.Array, tuple], jax.Array] | None = None
               ) -> tuple[jax.Array, jax.Array]:
    """K and V pages for attention: ``get(x, index)`` (default ``x[index]``) of pools ``k``,
    ``v`` ``[(layers,) pages, kv_heads, page_size, head_dim]``, where ``index`` picks leading
    (layer and) page axes -> ``[..., kv_heads, page_size, head_dim]`` each through
    :func:`readable`, 8-bit codes with their ``scales`` ``[(layers,) pages, kv_heads, 2,
    page_size]`` (:class:`paxkv.cache.pool.KVPool`) gathered by the same index."""
    get = get or (lambda x, i: x[i])
    k_scale = v_scale = None
    if scales is not None:
        both = get(scales, index)  # [..., kv_heads, 2, page_size]
        k_scale, v_scale = both[..., 0, :], both[..., 1, :]
    return readable(get(k, index), k_scale), readable(get(v, index), v_scale)
