"""bfloat16 K/V stored as bits on a CPU (pallas_kernels.kv_storage).

The oracle is a float32 twin of the same cache holding the same values (the bits widened),
fed K/V already rounded to bfloat16: the bits cache must store the same values and give the
same attention, step after step, through every XLA path a cache takes (prefill tiles,
decode chunks, cascade over a shared prefix, the dense twin's row groups), with NaN in
every slot no sequence holds. (A ``jnp.bfloat16``-typed pool is no exact oracle: its
prefill rounds the softmax weights to bfloat16 for the value product.)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import kv_storage
from paxkv.cache import dense as dense_cache
from paxkv.cache import paged as paged_cache
from paxkv.cache import pool as kv_pool
from paxkv.core.plan import AttentionPlan
from paxkv.core.step_info import StepInfo
from tests.test_caches import _kv_buffers

BF16, BITS = jnp.dtype(jnp.bfloat16), kv_storage.BFLOAT16_BITS
attend_jit = jax.jit(lambda cache, q, k, v, step: cache.attend(0, q, k, v, step))


def test_storage_dtype_is_bits_for_bfloat16_on_a_cpu_only():
    assert kv_storage.storage_dtype(jnp.bfloat16, "cpu") == BITS
    assert kv_storage.storage_dtype(jnp.bfloat16, "gpu") == BF16
    assert kv_storage.storage_dtype(jnp.float32, "cpu") == jnp.float32
    assert kv_storage.storage_dtype(jnp.float16, "cpu") == jnp.float16
    assert kv_storage.storage_dtype(jnp.int8, "cpu") == jnp.int8  # codes + scales
    assert kv_storage.storage_dtype(jnp.float8_e4m3fn, "gpu") == jnp.uint8  # bits everywhere
    for dtype in (jnp.int32, jnp.float8_e5m2):
        with pytest.raises(ValueError, match="not served"):
            kv_storage.storage_dtype(dtype)


def test_bits_round_to_nearest_even_and_widen_exactly():
    """to_storage then readable == astype(bfloat16) then astype(float32), bit for bit,
    specials and ties included; other dtypes pass through readable untouched."""
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(1000).astype(np.float32) * 10.0 ** rng.integers(
        -30, 30, 1000), np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, 3.4e38,
                                  1.00390625, 1.01171875], np.float32)])  # last two: ties
    got = kv_storage.readable(kv_storage.to_storage(jnp.asarray(x), BITS))
    want = jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32),
                                  np.asarray(want).view(np.uint32))
    typed = jnp.asarray(x, jnp.bfloat16)
    assert kv_storage.readable(typed) is typed
    nan_bits = kv_storage.full((), float("nan"), jnp.bfloat16)
    assert nan_bits.dtype == BITS and np.isnan(float(kv_storage.readable(nan_bits)))


def _float32_twin(cache):
    """The same cache with its K/V widened to float32 arrays (the same values)."""
    widen = kv_storage.readable
    if isinstance(cache, paged_cache.PagedCache):
        return dataclasses.replace(cache, pool=kv_pool.KVPool(k=widen(cache.pool.k),
                                                              v=widen(cache.pool.v)))
    return dataclasses.replace(cache, k=widen(cache.k), v=widen(cache.v))


@pytest.mark.parametrize("kind", ["paged", "dense"])
def test_bits_cache_stores_and_attends_like_a_float32_cache_of_the_same_values(kind):
    shape = dict(num_layers=1, num_kv_heads=2, head_dim=8, max_seqs=4, max_len=24,
                 dtype=jnp.bfloat16, fill=float("nan"))
    if kind == "paged":
        bits = paged_cache.create(num_pages=24, page_size=4, scrub=False, **shape)
    else:
        bits = dense_cache.create(**shape)
    assert _kv_buffers(bits)[0].dtype == BITS
    typed = _float32_twin(bits)
    assert _kv_buffers(typed)[0].dtype == jnp.float32
    rng = np.random.default_rng(0)

    def step(num_new, width, prefix_pages=0):
        nonlocal bits, typed
        num_new = jnp.asarray(num_new, jnp.int32)
        (bits, ok_b), (typed, ok_t) = (c.reserve(num_new, max_new=width) for c in (bits, typed))
        assert bool(ok_b.all()) and bool(ok_t.all())
        info = StepInfo.make(bits.lengths, num_new, width,
                             plan=AttentionPlan(prefix_pages=prefix_pages))
        q = jnp.asarray(rng.standard_normal((4, width, 6, 8)), jnp.float32)
        k, v = (jnp.asarray(rng.standard_normal((4, width, 2, 8)), jnp.bfloat16)
                .astype(jnp.float32) for _ in range(2))  # values a bfloat16 holds
        bits, out_b = attend_jit(bits, q, k, v, info)
        typed, out_t = attend_jit(typed, q, k, v, info)
        assert np.isfinite(np.asarray(out_b)).all(), "a stray read of a NaN slot"
        np.testing.assert_allclose(np.asarray(out_b), np.asarray(out_t), rtol=1e-6, atol=1e-7)
        for x_b, x_t in zip(_kv_buffers(bits), _kv_buffers(typed)):  # same values (NaN: NaN)
            np.testing.assert_array_equal(np.asarray(kv_storage.readable(x_b)), np.asarray(x_t))

    step([11, 0, 0, 7], 11)  # ragged prefill (query tiles)
    if kind == "paged":  # rows 1 and 2 share row 0's pages from here on
        forked = [c.fork(jnp.zeros(2, jnp.int32), jnp.array([1, 2], jnp.int32)) for c in
                  (bits, typed)]
        (bits, ok), (typed, _) = forked
        assert bool(ok.all())
    step([1, 1, 1, 1] if kind == "paged" else [1, 0, 0, 1], 1)  # decode (chunks / row groups)
    if kind == "paged":
        step([1, 1, 1, 0], 1, prefix_pages=2)  # decode, cascade over the shared 2 pages
        step([3, 3, 3, 0], 3, prefix_pages=2)  # prefill, cascade
        assert bool(paged_cache.PagedCache.stats(bits).shared_pages > 0)


def test_pallas_kernels_refuse_a_bits_pool_by_name():
    cache = paged_cache.create(num_layers=1, num_kv_heads=2, head_dim=8, max_seqs=2,
                               max_len=8, num_pages=4, page_size=4, dtype=jnp.bfloat16,
                               attention_impl="pallas")
    cache, _ = cache.reserve(jnp.array([1, 0], jnp.int32), max_new=1)
    q, k = jnp.zeros((2, 1, 2, 8)), jnp.zeros((2, 1, 2, 8))
    with pytest.raises(ValueError, match="attention_impl='xla'"):
        cache.attend(0, q, k, k, StepInfo.make(cache.lengths, jnp.array([1, 0]), 1))
