"""Scaled 8-bit K/V (int8, float8_e4m3fn) with per-(token, kv head) float32 scales.

The oracle is a float32 twin of the same cache holding the dequantised values (codes times
scales, NaN where the scale is NaN), fed K/V already round-tripped through the format: the
8-bit cache must store the same values and attend exactly as the twin, step after step,
through every XLA path (prefill tiles, decode chunks, cascade over a shared prefix, the dense
twin's row groups). Free pages, slot tails and the sentinel hold codes ``quantise`` never
writes and NaN (or inf, or huge) scales; changing that garbage must change no output.
The page-table state machine's read-back covers the scales (``tests/test_page_table.py``);
``tests/test_caches.py`` runs its paged == dense == reference spec on int8 too.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paxkv
from paxkv.cache import dense as dense_cache
from pallas_kernels import kv_storage
from paxkv.cache import paged as paged_cache
from pallas_kernels import quant
from paxkv.cache import pool as kv_pool
from paxkv.attention import chunked
from paxkv.core.plan import AttentionPlan
from paxkv.core.step_info import StepInfo
from tiny import tiny_lm

FORMATS = [quant.INT8, quant.FLOAT8]
FMT_IDS = ["int8", "fp8"]
attend_jit = jax.jit(lambda cache, q, k, v, step: cache.attend(0, q, k, v, step))


# -- the format ----------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS)
def test_round_trip_is_within_the_format_bound_and_the_largest_maps_to_qmax(fmt):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((500, 64)).astype(np.float32)
    x *= 10.0 ** rng.integers(-6, 4, (500, 1))  # every vector its own range
    x[0] = 0.0  # an all-zero vector: scale 0, codes 0
    x[1, :3] = [500.0, -500.0, 1e-3]  # a plain fp8 cast of 500 would be NaN
    codes, scales = quant.quantise(jnp.asarray(x), fmt)
    assert codes.dtype == fmt.storage and scales.dtype == jnp.float32
    assert scales.shape == (500,) and float(scales[0]) == 0.0
    back = np.asarray(quant.dequantise(codes, scales))
    assert np.isfinite(back).all()
    s = np.asarray(scales)[:, None]
    if fmt is quant.INT8:
        c = np.asarray(codes)
        assert c.min() >= -127, "-128 is never written"
        np.testing.assert_array_equal(np.abs(c[1:]).max(axis=1), 127)  # the largest -> 127
        bound = s / 2
    else:
        values = np.asarray(jax.lax.bitcast_convert_type(codes, quant.FP8).astype(jnp.float32))
        np.testing.assert_array_equal(np.abs(values[1:]).max(axis=1), 448.0)
        bound = np.maximum(np.abs(x) * 2.0 ** -4, s * 2.0 ** -10)
    assert np.all(np.abs(x - back) <= bound * (1 + 1e-6) + 1e-37)


def test_unservable_kv_dtypes_get_a_clear_error():
    dims = dict(num_layers=1, num_kv_heads=1, head_dim=8, max_seqs=1, max_len=8)
    for dtype in (jnp.int32, jnp.uint8, jnp.float8_e5m2, jnp.bool_):
        with pytest.raises(ValueError, match="not served.*jnp.int8"):
            paged_cache.create(num_pages=2, page_size=4, dtype=dtype, **dims)
        with pytest.raises(ValueError, match="not served"):
            dense_cache.create(dtype=dtype, **dims)
    # the Pallas kernels read int8 / fp8 pools (tests/test_pallas_kernels.py); "auto" is XLA on
    # a CPU, and on a GPU too for pages the kernels cannot stream (page 4, head_dim 8)
    assert paged_cache.create(num_pages=2, page_size=4, dtype=jnp.int8, attention_impl="pallas",
                              **dims).impl == "pallas"
    assert paged_cache.create(num_pages=2, page_size=4, dtype=jnp.int8, **dims).impl == "xla"


# -- exactness against a float32 cache of the dequantised values ----------------------------
def _float32_twin(cache):
    """The same cache with its codes dequantised into float32 arrays (the same values)."""
    if isinstance(cache, paged_cache.PagedCache):
        pool = cache.pool
        pages = jnp.arange(pool.num_pages + 1)
        k = jnp.stack([pool.read(layer, pages)[0] for layer in range(pool.num_layers)])
        v = jnp.stack([pool.read(layer, pages)[1] for layer in range(pool.num_layers)])
        return dataclasses.replace(cache, pool=kv_pool.KVPool(k=k, v=v))
    k = kv_storage.readable(cache.k, cache.scales[:, :, :, 0])
    v = kv_storage.readable(cache.v, cache.scales[:, :, :, 1])
    return dataclasses.replace(cache, k=k, v=v, scales=None)


def _real_pages(cache):
    """The paged cache with its pool cut to the real pages. Every padded token's write lands in
    the sentinel page (index ``num_pages``), and a GPU scatter does not fix which of those
    writes lands last: on the H200 of 12-04 only the sentinels differed."""
    n = cache.pool.num_pages
    return dataclasses.replace(cache, pool=kv_pool.KVPool(k=cache.pool.k[:, :n],
                                                          v=cache.pool.v[:, :n]))


def _make(kind: str, fmt: quant.Format, **kw):
    shape = dict(num_layers=1, num_kv_heads=2, head_dim=8, max_seqs=4, max_len=24,
                 dtype=fmt.dtype, fill=float("nan"), **kw)
    if kind == "paged":
        return paged_cache.create(num_pages=24, page_size=4, scrub=False, **shape)
    return dense_cache.create(**shape)


def _steps(kind: str):
    """(num_new, width, prefix_pages) of each step; ``"fork"`` between them."""
    yield [11, 0, 0, 7], 11, 0  # ragged prefill (query tiles)
    if kind == "paged":
        yield "fork"  # rows 1 and 2 share row 0's pages from here on
        yield [1, 1, 1, 1], 1, 0  # decode (chunks)
        yield [1, 1, 1, 0], 1, 2  # decode, cascade over the shared 2 pages
        yield [3, 3, 3, 0], 3, 2  # prefill, cascade
    else:
        yield [1, 0, 0, 1], 1, 0  # decode (row groups)


def _run(caches: list, kind: str, rng, check, attend=attend_jit) -> None:
    """Runs :func:`_steps` on every cache in ``caches`` with the same inputs (``check.inputs``
    may change each cache's K/V) through ``attend``; ``check(outs, caches)`` after each step.
    ``caches`` is updated in place."""
    for spec in _steps(kind):
        if spec == "fork":
            for i, c in enumerate(caches):
                caches[i], ok = c.fork(jnp.zeros(2, jnp.int32), jnp.array([1, 2], jnp.int32))
                assert bool(ok.all())
            continue
        num_new, width, prefix_pages = spec
        num_new = jnp.asarray(num_new, jnp.int32)
        info = None
        for i, c in enumerate(caches):
            caches[i], ok = c.reserve(num_new, max_new=width)
            assert bool(ok.all())
            info = StepInfo.make(caches[i].lengths, num_new, width,
                                 plan=AttentionPlan(prefix_pages=prefix_pages))
        q = jnp.asarray(3 * rng.standard_normal((4, width, 6, 8)), jnp.float32)
        k, v = (jnp.asarray(rng.standard_normal((4, width, 2, 8)) * 4, jnp.float32)
                for _ in range(2))
        outs = []
        for i, c in enumerate(caches):
            caches[i], out = attend(c, q, *check.inputs(i, k, v), info)
            assert np.isfinite(np.asarray(out)).all(), "a stray read of a garbage slot"
            outs.append(out)
        check(outs, caches)


@pytest.mark.parametrize("fmt", FORMATS, ids=FMT_IDS)
@pytest.mark.parametrize("kind", ["paged", "dense"])
def test_scaled_cache_attends_exactly_as_a_float32_cache_of_the_dequantised_values(kind, fmt):
    _assert_exact(kind, fmt)


@pytest.mark.parametrize("kind", ["paged", "dense"])
def test_int8_in_one_wide_pass_off_cpu_is_exact_too(monkeypatch, kind):
    """The path a GPU's XLA takes (no cache-sized tiles): gathered pages, one softmax."""
    monkeypatch.setattr(chunked, "tiles_pay", lambda: False)
    _assert_exact(kind, quant.INT8, jax.jit(lambda c, q, k, v, step: c.attend(0, q, k, v, step)))


def _assert_exact(kind: str, fmt: quant.Format, attend=attend_jit) -> None:
    scaled = _make(kind, fmt)
    arrays = scaled.pool.arrays() if kind == "paged" else scaled.arrays()
    assert [x.dtype for x in arrays] == [fmt.storage, fmt.storage, jnp.float32]
    twin = _float32_twin(scaled)

    class Check:
        @staticmethod
        def inputs(i, k, v):  # the twin stores what the format gives back
            return (k, v) if i == 0 else (quant.round_trip(k, fmt), quant.round_trip(v, fmt))

        def __call__(self, outs, caches):
            np.testing.assert_allclose(np.asarray(outs[0]), np.asarray(outs[1]),
                                       rtol=1e-6, atol=1e-6)
            got, want = _float32_twin(caches[0]), caches[1]
            if kind == "paged":
                got, want = _real_pages(got), _real_pages(want)
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):  # NaN: NaN
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    caches = [scaled, twin]
    _run(caches, kind, np.random.default_rng(0), Check(), attend)
    if kind == "paged":
        assert int(caches[0].stats().shared_pages) > 0


@pytest.mark.parametrize("kind", ["paged", "dense"])
def test_garbage_codes_and_nan_scales_in_unheld_slots_change_no_output(kind):
    """Two int8 caches whose every slot differs before anything is written (garbage codes;
    NaN / inf / huge / random scales), run through the same steps: free pages, page tails,
    the sentinel behind table padding are never read, so outputs are identical and finite."""
    rng = np.random.default_rng(1)
    plain = _make(kind, quant.INT8)
    arrays = plain.pool.arrays() if kind == "paged" else plain.arrays()
    codes = [jnp.asarray(rng.integers(-128, 128, arrays[0].shape), jnp.int8) for _ in range(2)]
    scales = rng.choice(np.array([np.nan, np.inf, -np.inf, 1e30, -3.0, 0.5], np.float32),
                        arrays[2].shape)
    if kind == "paged":
        other = dataclasses.replace(plain, pool=kv_pool.KVPool(*codes, jnp.asarray(scales)))
    else:
        other = dataclasses.replace(plain, k=codes[0], v=codes[1], scales=jnp.asarray(scales))

    class Check:
        @staticmethod
        def inputs(i, k, v):
            return k, v

        def __call__(self, outs, caches):
            np.testing.assert_array_equal(np.asarray(outs[0]), np.asarray(outs[1]))

    _run([plain, other], kind, rng, Check())


@pytest.mark.parametrize("kind", ["paged", "dense"])
def test_jitted_reserve_and_attend_donate_codes_and_scales(kind):
    cache = _make(kind, quant.INT8)
    reserve = jax.jit(lambda c, n: c.reserve(n, max_new=2), donate_argnums=0)
    attend = jax.jit(lambda c, q, k, v, step: c.attend(0, q, k, v, step), donate_argnums=0)
    arrays = lambda c: c.pool.arrays() if kind == "paged" else c.arrays()  # noqa: E731
    num_new = jnp.array([2, 1, 0, 2], jnp.int32)
    new, ok = reserve(cache, num_new)
    assert bool(ok.all()) and all(x.is_deleted() for x in arrays(cache))
    step = StepInfo.make(np.asarray(new.lengths), num_new, 2)
    kv = jnp.ones((4, 2, 2, 8), jnp.float32)
    newer, out = attend(new, jnp.ones((4, 2, 6, 8), jnp.float32), kv, kv, step)
    assert all(x.is_deleted() for x in arrays(new)) and np.isfinite(np.asarray(out)).all()
    assert len(arrays(newer)) == 3


@pytest.mark.parametrize("dtype, value_bytes, scale_bytes", [
    (jnp.bfloat16, 2, 0),
    (jnp.int8, 1, 4),
])
def test_an_engine_with_a_narrow_cache_counts_its_bytes_and_frees_every_page(
        dtype, value_bytes, scale_bytes):
    """bfloat16 (stored as bits on a CPU: two bytes a value) and int8 (one byte a value plus a
    float32 scale per token and kv head, K and V each): 3 requests on 2 rows finish, every
    page comes back, and ``kv_bytes_per_page`` counts what the pool holds."""
    lm = tiny_lm()
    c = lm.config
    engine = paxkv.Engine(lm, max_seqs=2, max_len=48, page_size=4, kv_dtype=dtype)
    # the backend's storage (bfloat16 as uint16 bits on a CPU, as itself on a GPU: the
    # H200 run of 12-04 caught this test asserting the CPU's)
    assert engine.cache.pool.k.dtype == kv_storage.storage_dtype(dtype)
    if jax.default_backend() == "cpu":
        assert kv_storage.storage_dtype(jnp.bfloat16) == kv_storage.BFLOAT16_BITS
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [11] * 20]  # 3 requests on 2 rows: one queues
    ids = [engine.submit(p, max_new_tokens=6, stop_token_ids=[]) for p in prompts]
    results = engine.run()
    assert [len(results[i].token_ids) for i in ids] == [6, 6, 6]
    engine.clear_prefix_cache()
    assert int(engine.cache.free_pages()) == engine.cache.num_pages, "a leaked page"
    per_token = 2 * c.num_layers * c.num_kv_heads * (c.head_dim * value_bytes + scale_bytes)
    assert engine.stats().kv_bytes_per_page == 4 * per_token


@pytest.mark.slow
def test_int8_on_the_default_model_is_near_lossless_over_real_text(lm):
    """SmolLM2-135M teacher-forced over 1,024 tokens of CPython's Language Reference prose
    (``pydoc_data.topics``), 512 a step, every score and value read from the pool: int8 vs
    float32 K/V. Measured here: top-1 99.1%, mean KL 8.2e-4, perplexity -0.02% (over 2,048
    tokens, the test's length until 12-03: 98.7%, 8.9e-4, +0.02%; almost all of the KL comes
    from K, whose outlier channels coarsen the rest of a per-token scale)."""
    from experiments.kv_dtype import real_text, teacher_forced

    got = teacher_forced(lm, real_text(lm, 1024), ["float32", "int8"], 512)
    assert got["predictions"] >= 1000
    int8 = got["per_dtype"]["int8"]
    print("int8 over real text:", int8)
    assert int8["top1_agreement"] >= 0.98, int8
    assert int8["mean_kl"] <= 1e-3, int8
    assert abs(int8["perplexity_pct"]) <= 0.5, int8


@pytest.mark.slow  # an experiment's own check (`make test` runs it)
def test_the_kv_dtype_experiment_measures_every_dtype_on_a_tiny_model():
    """``experiments.kv_dtype``'s parts at tiny sizes: the capacity arithmetic, teacher
    forcing in lockstep, and a decode cell of every dtype."""
    import argparse

    from experiments import kv_dtype

    lm, dtypes = tiny_lm(), ["float32", "bfloat16", "int8"]
    fit = kv_dtype.capacity_fit(lm, dtypes)["per_dtype"]
    c = lm.config
    per_value = 2 * c.num_layers * c.num_kv_heads  # K and V of one token over all layers
    assert [fit[d]["bytes_per_token"] for d in dtypes] == [per_value * c.head_dim * 4,
                                                           per_value * c.head_dim * 2,
                                                           per_value * (c.head_dim + 4)]
    assert fit["int8"]["tokens"] > fit["bfloat16"]["tokens"] > fit["float32"]["tokens"]
    text = lm.encode("The quick brown fox jumps over the lazy dog. " * 2)[:64]
    quality = kv_dtype.teacher_forced(lm, text, dtypes, 32)["per_dtype"]
    assert quality["float32"]["mean_kl"] == 0.0 and quality["float32"]["top1_agreement"] == 1.0
    assert 0.0 < quality["int8"]["mean_kl"] < 0.1, quality["int8"]
    args = argparse.Namespace(warmup=1, repeats=1, interleave_gib=1.0)
    cell = kv_dtype.decode_cell(lm, 2, 32, dtypes, args)
    assert all(cell["per_dtype"][d]["tok_s"] > 0 for d in dtypes)


@pytest.mark.slow  # beam search on an int8 pool end to end (`make test` runs it)
def test_beam_search_takes_int8_kv():
    """Beam search over int8 pages: paged equals the dense twin (both int8), every page free
    at the end (``search`` checks it), and the beams hold as many tokens as asked."""
    from paxkv.decoding.beam_search import search

    lm = tiny_lm(scale=1.0)
    runs = {cache: search(lm, [[5, 9, 17, 3, 250, 8], [1, 2]], beam_width=3, max_new_tokens=6,
                          stop_token_ids=[], cache=cache, page_size=4, kv_dtype=jnp.int8)
            for cache in ("paged", "dense")}
    assert runs["paged"].all_free and runs["dense"].all_free
    # the same hypotheses; their scores to float32 rounding (two programs, two summation orders)
    paged, dense = runs["paged"].beams, runs["dense"].beams
    assert [[b.token_ids for b in beams] for beams in paged] == \
        [[b.token_ids for b in beams] for beams in dense]
    np.testing.assert_allclose([b.score for beams in paged for b in beams],
                               [b.score for beams in dense for b in beams], rtol=1e-5)
    assert all(len(b.token_ids) == 6 for beams in runs["paged"].beams for b in beams)
