"""Scaled 8-bit K/V: symmetric per (token, kv head) quantisation with float32 scales.

A K or V vector ``x [head_dim]`` of one token and one kv head is stored as 8-bit codes plus one
float32 scale::

    scale = max|x| / qmax                      (0 for an all-zero vector)
    code  = to_format(x / scale)               int8: round, clip to +-127 (never -128)
    x'    = from_format(code) * scale          what attention reads (dequantised)

so the largest element maps to ``qmax`` exactly and every element is within half a step of
the format (int8: ``|x - x'| <= scale / 2``). Two formats:

* **int8** (``qmax = 127``): codes are ``int8``; ``-128`` is never produced.
* **float8_e4m3fn** (``qmax = 448``): values are clipped to the format's range before the cast
  (a plain cast of 500 gives NaN) and stored as their bits in ``uint8`` on every backend: an
  fp8-typed pool on XLA:CPU converts the whole pool on every write, the trap bfloat16 had.
  Relative error per element <= 2^-4 (3 mantissa bits), absolute <= 2^-10 * scale near 0.

The scales of a pool sit beside its codes, indexed by the same page ids
(:class:`paxkv.cache.pool.KVPool`), and a reader dequantises what it gathers
(:func:`pallas_kernels.kv_storage.readable` with the scales): no dequantised copy of a pool is made.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

FP8 = jnp.dtype(jnp.float8_e4m3fn)
FP8_BITS = jnp.dtype(jnp.uint8)


@dataclasses.dataclass(frozen=True)
class Format:
    """A scaled 8-bit K/V format.

    Attributes:
      dtype: the K/V dtype a caller asks for (``jnp.int8``, ``jnp.float8_e4m3fn``).
      storage: the pool's dtype (int8 codes; fp8 as its bits, uint8).
      qmax: the code of the largest element (the format's largest finite value for fp8).
    """

    dtype: jnp.dtype
    storage: jnp.dtype
    qmax: float

    @property
    def garbage(self) -> int:
        """A code :func:`quantise` never writes (tests fill free slots with it): int8 -128,
        fp8 0x7F (NaN)."""
        return -128 if self.storage == jnp.int8 else 0x7F


INT8 = Format(jnp.dtype(jnp.int8), jnp.dtype(jnp.int8), 127.0)
FLOAT8 = Format(FP8, FP8_BITS, 448.0)
FORMATS = {f.dtype: f for f in (INT8, FLOAT8)}
_BY_STORAGE = {f.storage: f for f in (INT8, FLOAT8)}


def format_of(dtype: jnp.dtype) -> Format | None:
    """The scaled format for K/V dtype ``dtype`` (None: stored as values, unscaled)."""
    return FORMATS.get(jnp.dtype(dtype))


def format_of_storage(storage: jnp.dtype) -> Format:
    """The scaled format whose codes are stored in ``storage`` (int8 or uint8)."""
    try:
        return _BY_STORAGE[jnp.dtype(storage)]
    except KeyError:
        raise ValueError(f"no scaled K/V format stores {storage}") from None


def is_scaled(x: jax.Array | jnp.dtype) -> bool:
    """Whether ``x`` (an array or a storage dtype) holds scaled codes (int8, fp8 bits)."""
    return jnp.dtype(getattr(x, "dtype", x)) in _BY_STORAGE


def quantise(x: jax.Array, fmt: Format) -> tuple[jax.Array, jax.Array]:
    """K/V ``x [..., head_dim]`` (any float dtype) -> ``(codes [..., head_dim]`` in
    ``fmt.storage``, ``scales [...]`` float32): one scale per vector over the last axis."""
    x = jnp.asarray(x).astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = amax / fmt.qmax
    y = x / jnp.where(scale > 0, scale, 1.0)[..., None]
    y = jnp.clip(y, -fmt.qmax, fmt.qmax)  # float error never reaches 128 (nor 448 -> NaN)
    if fmt is INT8:
        return jnp.round(y).astype(jnp.int8), scale
    return lax.bitcast_convert_type(y.astype(FP8), FP8_BITS), scale


def dequantise(codes: jax.Array, scales: jax.Array) -> jax.Array:
    """``codes [..., head_dim]`` (int8 or fp8 bits) x ``scales [...]`` -> float32 values.
    Callers apply it right at the gather, so XLA fuses it into the copy."""
    return code_values(codes) * scales.astype(jnp.float32)[..., None]


def code_values(codes: jax.Array) -> jax.Array:
    """``codes`` (int8 or fp8 bits, any shape) -> their float32 values, unscaled."""
    if jnp.dtype(codes.dtype) == FP8_BITS:
        return lax.bitcast_convert_type(codes, FP8).astype(jnp.float32)
    if jnp.dtype(codes.dtype) == jnp.int8:
        return codes.astype(jnp.float32)
    raise ValueError(f"no scaled K/V format stores {codes.dtype}")


def round_trip(x: jax.Array, fmt: Format) -> jax.Array:
    """``x`` as a ``fmt`` pool gives it back: float32, same shape (the oracle's values)."""
    return dequantise(*quantise(x, fmt))


def full_codes(shape: tuple[int, ...], value: float, fmt: Format) -> tuple[jax.Array, float]:
    """Codes of ``shape`` and the one scale that read back as ``value`` everywhere (NaN:
    :attr:`Format.garbage` codes and a NaN scale, for tests that prove no stray reads)."""
    if np.isnan(value):
        return jnp.full(shape, fmt.garbage, fmt.storage), float("nan")
    codes, scale = quantise(jnp.full((1,), value, jnp.float32), fmt)
    return jnp.full(shape, codes[0], fmt.storage), float(scale)
