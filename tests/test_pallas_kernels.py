"""The Mosaic GPU kernels against the jnp oracle, in interpret mode on CPU, plus CUDA lowering.

On a machine with a GPU the same tests compile and run the kernels for real (``INTERPRET`` is
False there): ``python -m pytest tests/test_pallas_kernels.py`` is the GPU correctness check.

Interpret mode compiles one large XLA program per shape (~4 s here), so the matrix is chosen,
not crossed: each attention case packs the length edge cases (0, 1, page_size - 1,
page_size, page_size + 1, long) into one batch and runs that one compiled kernel on clean and
on NaN-poisoned pools.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _interpret
from paxkv.cache import paged as paged_cache
from pallas_kernels import quant
from paxkv.core.step_info import StepInfo
from pallas_kernels.kv_write import (copy_pages, copy_pages_reference, write_kv,
                                     write_kv_reference)
from pallas_kernels.paged_decode import paged_decode_attention
from pallas_kernels.paged_prefill import paged_prefill_attention
from pallas_kernels.reference import (paged_decode_attention_reference,
                                      paged_prefill_attention_reference)

INTERPRET = jax.default_backend() != "gpu"  # on a GPU: compiled, not interpreted
TOLERANCE = {jnp.dtype(jnp.float32): 1e-4, jnp.dtype(jnp.bfloat16): 2e-2,
             jnp.dtype(jnp.float16): 1e-2}


def ready(x):
    """``x`` once computed. NOTE: an interpret-mode kernel runs eager JAX ops in its host
    callbacks, and eager JAX work the test dispatches meanwhile (a reference) can deadlock
    with them (seen on 2 CPUs: both threads stuck in ``apply_primitive``): await each call."""
    return jax.block_until_ready(x)


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    yield
    _interpret.reset_interpret_state()  # a kernel that raised leaves global state behind


@dataclasses.dataclass(frozen=True)
class Case:
    group: int
    head_dim: int
    dtype: str
    page_size: int = 16
    num_kv_heads: int = 1
    kwargs: tuple = ()  # static kernel arguments
    clean_run: bool = False  # also run on the clean pool: poisoned output must be identical
    codes: str | None = None  # "int8" / "fp8": 8-bit pages with scales; dtype is then q's

    def __str__(self):
        codes = f"{self.codes}-" if self.codes else ""
        return f"{codes}g{self.group}-d{self.head_dim}-{self.dtype}-ps{self.page_size}-" + (
            "-".join(f"{k}{v}" for k, v in self.kwargs))


def edge_lengths(page_size: int, long: int) -> list[int]:
    return [0, 1, page_size - 1, page_size, page_size + 1, long]


def make_pool(seed, case: Case, lengths, *, shared_pages: int = 1, spare_pages: int = 3,
              first_seen=None):
    """Pages, a randomly permuted block table and per-sequence lengths.

    Sequences 4 and 5 share their first ``shared_pages`` pages (a forked prefix). Returns
    clean and poisoned pools: every slot no sequence can see (free pages, the tail of a
    partly filled page; with ``first_seen[b]``, the first key any query of sequence ``b``
    sees under a sliding window, also the slots before it) is NaN in the poisoned one, and
    table padding points at NaN pages or outside the pool.
    """
    rng = np.random.default_rng(seed)
    s = case.page_size
    lengths = np.asarray(lengths, np.int32)
    need = -(-lengths // s)
    max_pages = int(need.max()) + 1
    num_pages = int(need.sum()) + spare_pages
    perm = rng.permutation(num_pages)
    table = np.empty((len(lengths), max_pages), np.int32)
    live = np.zeros((num_pages, s), bool)
    first_seen = np.zeros(len(lengths), np.int64) if first_seen is None else first_seen
    used = 0
    for b, (n, length) in enumerate(zip(need, lengths)):
        row = perm[used:used + n]
        used += n
        if b == 5 and shared_pages and lengths[4] >= shared_pages * s:
            row[:shared_pages] = table[4, :shared_pages]
        pad = rng.choice([perm[-1], num_pages + 7, -1, 2**30], max_pages - n)
        table[b] = np.concatenate([row, pad])
        for p in range(n):
            live[row[p], max(0, first_seen[b] - p * s): min(s, length - p * s)] = True
    shape = (num_pages, case.num_kv_heads, s, case.head_dim)
    k = rng.standard_normal(shape, np.float32)
    v = rng.standard_normal(shape, np.float32)
    dead = ~live[:, None, :, None]
    clean = tuple(jnp.asarray(x, case.dtype) for x in (k, v))
    poisoned = tuple(jnp.asarray(np.where(dead, np.nan, x), case.dtype) for x in (k, v))
    return clean, poisoned, jnp.asarray(table), jnp.asarray(lengths)


def assert_rows_close(out, ref, dtype, row_axes):
    """Per-row relative error (a row: one query token of one head) under the dtype tolerance."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(out).all()
    axes = tuple(a for a in range(out.ndim) if a not in row_axes)
    err = np.sqrt(((out - ref) ** 2).sum(axes)) / np.maximum(np.sqrt((ref**2).sum(axes)), 1e-6)
    assert err.max() <= TOLERANCE[jnp.dtype(dtype)], f"worst per-row relative error {err.max()}"


DECODE_CASES = [
    Case(1, 128, "float32", page_size=64, kwargs=(("num_splits", 1), ("sm_scale", 0.3))),
    Case(3, 64, "bfloat16", num_kv_heads=2, kwargs=(("num_splits", 3),), clean_run=True),
    Case(8, 64, "float32", page_size=32, kwargs=(("num_splits", 2), ("logit_soft_cap", 4.0))),
    Case(8, 128, "bfloat16", kwargs=(("pages_per_block", 8),)),  # 128-token blocks, auto splits
]


def check_decode(kernel, case: Case) -> None:
    """``kernel`` (``paged_decode_attention``'s signature) on ``case``'s edge lengths over a
    NaN-poisoned pool: the oracle's output on the clean pool, exact zeros for the length-0
    row, and (``case.clean_run``) the clean pool's output bit for bit."""
    lengths = edge_lengths(case.page_size, 3 * 64 + 5)
    clean, poisoned, table, lengths = make_pool(0, case, lengths)
    q = jax.random.normal(jax.random.key(1), (len(lengths), case.num_kv_heads * case.group,
                                              case.head_dim), case.dtype)
    kw = dict(case.kwargs)
    ref_kw = {k: v for k, v in kw.items() if k in ("sm_scale", "logit_soft_cap")}
    def run(pages):
        return ready(kernel(q, *pages, table, lengths, interpret=INTERPRET, **kw))

    out = run(poisoned)
    assert out.shape == q.shape and out.dtype == q.dtype
    if case.clean_run:
        np.testing.assert_array_equal(np.asarray(out, np.float32),
                                      np.asarray(run(clean), np.float32))
    assert not np.asarray(out[0], np.float32).any(), "a length-0 row must be exactly zero"
    ref = paged_decode_attention_reference(q, *clean, table, lengths, **ref_kw)
    assert_rows_close(out, ref, case.dtype, row_axes=(0, 1))


@pytest.mark.parametrize("case", DECODE_CASES, ids=str)
def test_decode_matches_reference(case):
    check_decode(paged_decode_attention, case)


PREFILL_CASES = [
    Case(3, 64, "bfloat16", num_kv_heads=2, kwargs=(("block_q", 4),)),
    Case(1, 128, "float32", kwargs=(("logit_soft_cap", 4.0),)),
    Case(8, 64, "float32", page_size=32, kwargs=(("block_q", 4),)),
]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=str)
def test_prefill_matches_reference(case):
    # (context, new tokens): empty, first token, a whole prompt, chunks after a cached
    # prefix (one crossing a page boundary), one token after a long context
    s = case.page_size
    lengths = [0, 1, s - 1, s, s + 9, 3 * 64 + 5]
    query_lengths = [0, 1, s - 1, 5, 12, 1]
    clean, poisoned, table, lengths = make_pool(2, case, lengths, shared_pages=0)
    query_lengths = jnp.asarray(query_lengths, jnp.int32)
    q = jax.random.normal(jax.random.key(3), (len(lengths), max(query_lengths) + 1,
                                              case.num_kv_heads * case.group, case.head_dim),
                          case.dtype)
    kw = dict(case.kwargs)
    ref_kw = {k: v for k, v in kw.items() if k in ("sm_scale", "logit_soft_cap")}
    args = (table, lengths, query_lengths)
    out = ready(paged_prefill_attention(q, *poisoned, *args, interpret=INTERPRET, **kw))
    ref = paged_prefill_attention_reference(q, *clean, *args, **ref_kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    if case.clean_run:
        out_clean = ready(paged_prefill_attention(q, *clean, *args, interpret=INTERPRET, **kw))
        np.testing.assert_array_equal(np.asarray(out, np.float32),
                                      np.asarray(out_clean, np.float32))
    t = np.arange(q.shape[1])[None, :]
    assert not np.asarray(out)[t >= np.asarray(query_lengths)[:, None]].any()
    assert_rows_close(out, ref, case.dtype, row_axes=(0, 1, 2))


def stack_layers(pages, layer: int, num_layers: int = 3):
    """A ``[num_layers, ...]`` pool holding ``pages`` at ``layer`` and NaN everywhere else, so
    reading any other layer poisons the output."""
    pool = jnp.full((num_layers, *pages.shape), jnp.nan, pages.dtype)
    return pool.at[layer].set(pages)


POOL_CASE = Case(3, 64, "bfloat16", num_kv_heads=2)


def test_decode_reads_its_layer_of_the_pool():
    case = POOL_CASE
    clean, poisoned, table, lengths = make_pool(10, case, edge_lengths(case.page_size, 100))
    q = jax.random.normal(jax.random.key(11), (len(lengths), 6, case.head_dim), case.dtype)
    k_pool, v_pool = (stack_layers(x, 1) for x in poisoned)
    out = ready(paged_decode_attention(q, k_pool, v_pool, table, lengths, layer=jnp.int32(1),
                                       num_splits=2, interpret=INTERPRET))
    ref = paged_decode_attention_reference(q, *clean, table, lengths)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not np.asarray(out[0]).any()
    assert_rows_close(out, ref, case.dtype, row_axes=(0, 1))


def test_prefill_reads_its_layer_of_the_pool():
    case = POOL_CASE
    s = case.page_size
    lengths, query_lengths = [0, s - 1, s + 9, 70], [0, s - 1, 12, 1]
    clean, poisoned, table, lengths = make_pool(12, case, lengths, shared_pages=0)
    query_lengths = jnp.asarray(query_lengths, jnp.int32)
    q = jax.random.normal(jax.random.key(13), (4, 16, 6, case.head_dim), case.dtype)
    k_pool, v_pool = (stack_layers(x, 2) for x in poisoned)
    args = (table, lengths, query_lengths)
    out = ready(paged_prefill_attention(q, k_pool, v_pool, *args, layer=jnp.int32(2), block_q=8,
                                        interpret=INTERPRET))
    ref = paged_prefill_attention_reference(q, *clean, *args)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_rows_close(out, ref, case.dtype, row_axes=(0, 1, 2))


@pytest.mark.skipif(not INTERPRET, reason="the race detector is the CPU interpreter's")
@pytest.mark.parametrize("codes", [None, "int8"])
def test_double_buffering_has_no_races(codes):
    """The interpreter's race detector sees every TMA write (scales included) ordered before
    the reads."""
    case = Case(2, 64, "bfloat16", codes=codes)
    pool = make_scaled_pool if codes else make_pool
    clean, _, table, lengths = pool(4, case, [128, 70])
    q = jax.random.normal(jax.random.key(5), (2, 2, 64), jnp.bfloat16)
    scales = dict(scales=clean[2]) if codes else {}
    params = _interpret.InterpretGPUParams(detect_races=True)
    out = paged_decode_attention(q, *clean[:2], table, lengths, num_splits=1, interpret=params,
                                 **scales)
    out.block_until_ready()
    assert not _interpret.races_found()


# ---------------------------------------------------------------- 8-bit pages with scales

FORMATS = {"int8": quant.INT8, "fp8": quant.FLOAT8}


def make_scaled_pool(seed, case: Case, lengths, *, shared_pages: int = 1, first_seen=None):
    """:func:`make_pool` quantised: ``(clean, poisoned, table, lengths)`` with clean and
    poisoned ``(k_codes, v_codes, scales)``, scales ``[num_pages, kv_heads, 2, page_size]``.
    Every slot no sequence can see holds codes ``quantise`` never writes and a NaN scale in
    the poisoned pool (fp8's garbage code is itself NaN)."""
    fmt = FORMATS[case.codes]
    floats = dataclasses.replace(case, dtype="float32", codes=None)
    (k, v), (k_nan, _), table, lengths = make_pool(seed, floats, lengths,
                                                   shared_pages=shared_pages,
                                                   first_seen=first_seen)
    (k_codes, k_scale), (v_codes, v_scale) = quant.quantise(k, fmt), quant.quantise(v, fmt)
    scales = jnp.stack([k_scale, v_scale], axis=2)  # [pages, kv_heads, 2, page_size]
    dead = jnp.isnan(k_nan[..., 0])  # [pages, kv_heads, page_size]
    poisoned = (jnp.where(dead[..., None], jnp.asarray(fmt.garbage, fmt.storage), k_codes),
                jnp.where(dead[..., None], jnp.asarray(fmt.garbage, fmt.storage), v_codes),
                jnp.where(dead[:, :, None], jnp.nan, scales))
    return (k_codes, v_codes, scales), poisoned, table, lengths


def dequantised(codes_pool):
    """``(k, v, scales)`` -> float32 ``(k, v)`` holding what the codes stand for."""
    k, v, scales = codes_pool
    return quant.dequantise(k, scales[:, :, 0]), quant.dequantise(v, scales[:, :, 1])


SCALED_DECODE_CASES = [  # paired scale copies at page 16, split ones at 32 and 64
    Case(4, 64, "float32", page_size=16, num_kv_heads=2, kwargs=(("num_splits", 1),),
         clean_run=True, codes="int8"),
    Case(1, 128, "bfloat16", page_size=64, kwargs=(("num_splits", 2),), codes="int8"),
    Case(2, 64, "float32", page_size=32, kwargs=(("logit_soft_cap", 4.0),), codes="fp8"),
]


@pytest.mark.parametrize("case", SCALED_DECODE_CASES, ids=str)
def test_scaled_decode_matches_reference(case):
    clean, poisoned, table, lengths = make_scaled_pool(
        20, case, edge_lengths(case.page_size, 2 * 64 + 5))
    q = jax.random.normal(jax.random.key(21), (len(lengths), case.num_kv_heads * case.group,
                                               case.head_dim), case.dtype)
    kw = dict(case.kwargs)
    ref_kw = {k: v for k, v in kw.items() if k in ("sm_scale", "logit_soft_cap")}
    out = ready(paged_decode_attention(q, *poisoned[:2], table, lengths, scales=poisoned[2],
                                       interpret=INTERPRET, **kw))
    ref = paged_decode_attention_reference(q, *clean[:2], table, lengths, scales=clean[2],
                                           **ref_kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    if case.clean_run:
        out_clean = ready(paged_decode_attention(q, *clean[:2], table, lengths, scales=clean[2],
                                                 interpret=INTERPRET, **kw))
        np.testing.assert_array_equal(np.asarray(out, np.float32),
                                      np.asarray(out_clean, np.float32))
    assert not np.asarray(out[0]).any(), "a length-0 row must be exactly zero"
    assert_rows_close(out, ref, case.dtype, row_axes=(0, 1))


SCALED_PREFILL_CASES = [
    Case(3, 64, "bfloat16", num_kv_heads=2, kwargs=(("block_q", 4),), codes="int8"),
    Case(1, 128, "float32", page_size=64, codes="int8"),
]


@pytest.mark.parametrize("case", SCALED_PREFILL_CASES, ids=str)
def test_scaled_prefill_matches_reference(case):
    s = case.page_size
    lengths = [0, 1, s - 1, s, s + 9, 2 * 64 + 5]
    query_lengths = jnp.asarray([0, 1, s - 1, 5, 12, 1], jnp.int32)
    clean, poisoned, table, lengths = make_scaled_pool(22, case, lengths, shared_pages=0)
    q = jax.random.normal(jax.random.key(23), (len(lengths), int(query_lengths.max()) + 1,
                                               case.num_kv_heads * case.group, case.head_dim),
                          case.dtype)
    args = (table, lengths, query_lengths)
    out = ready(paged_prefill_attention(q, *poisoned[:2], *args, scales=poisoned[2],
                                        interpret=INTERPRET, **dict(case.kwargs)))
    ref = paged_prefill_attention_reference(q, *clean[:2], *args, scales=clean[2])
    assert out.shape == q.shape and out.dtype == q.dtype
    t = np.arange(q.shape[1])[None, :]
    assert not np.asarray(out)[t >= np.asarray(query_lengths)[:, None]].any()
    assert_rows_close(out, ref, case.dtype, row_axes=(0, 1, 2))


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_int8_kernel_equals_the_float32_kernel_on_the_dequantised_pool(kernel):
    """Dequantising after the load (scores x K scale, weights x V scale) gives what the float
    kernel gives on a float32 pool of the dequantised values, NaN-poisoned slots included."""
    case = Case(2, 64, "float32", page_size=16, num_kv_heads=2, codes="int8")
    lengths = [0, 3, 16, 17, 40, 100]
    _, poisoned, table, lengths = make_scaled_pool(24, case, lengths)
    floats = dequantised(poisoned)  # NaN wherever a scale is
    if kernel == "decode":
        q = jax.random.normal(jax.random.key(25), (6, 4, 64), jnp.float32)
        run = functools.partial(paged_decode_attention, q, block_tables=table, lengths=lengths,
                                num_splits=2, interpret=INTERPRET)
        rows = (0, 1)
    else:
        q = jax.random.normal(jax.random.key(25), (6, 5, 4, 64), jnp.float32)
        run = functools.partial(paged_prefill_attention, q, block_tables=table,
                                lengths=lengths, interpret=INTERPRET,
                                query_lengths=jnp.minimum(lengths, 5))
        rows = (0, 1, 2)
    out = ready(run(k_pages=poisoned[0], v_pages=poisoned[1], scales=poisoned[2]))
    want = ready(run(k_pages=floats[0], v_pages=floats[1]))
    np.testing.assert_array_equal(np.asarray(out) == 0, np.asarray(want) == 0)
    assert_rows_close(out, want, jnp.float32, row_axes=rows)


def test_int8_paged_cache_on_the_kernels_equals_the_xla_path():
    """``attention_impl='pallas'`` with an int8 pool, through ``PagedCache.attend`` on layer 1
    of 2: ragged prefill (paired scale copies, page 16), a fork, decode over the shared pages.
    Same outputs as the XLA path, and the real pages (codes, scales, NaN garbage) bit-identical."""
    shape = dict(num_layers=2, num_kv_heads=2, head_dim=64, num_pages=12, page_size=16,
                 max_seqs=3, max_len=64, dtype=jnp.int8, fill=float("nan"), scrub=False)
    caches = [paged_cache.create(attention_impl=impl, **shape) for impl in ("pallas", "xla")]
    attend = jax.jit(lambda c, q, k, v, step: c.attend(1, q, k, v, step))
    rng = np.random.default_rng(26)
    for spec in (([20, 0, 5], 20), "fork", ([1, 1, 1], 1)):
        if spec == "fork":  # row 1 shares row 0's pages from here on
            forked = [c.fork(jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32)) for c in caches]
            assert all(bool(ok.all()) for _, ok in forked)
            caches = [c for c, _ in forked]
            continue
        num_new, width = jnp.asarray(spec[0], jnp.int32), spec[1]
        reserved = [c.reserve(num_new, max_new=width) for c in caches]
        assert all(bool(ok.all()) for _, ok in reserved)
        caches = [c for c, _ in reserved]
        step = StepInfo.make(caches[0].lengths, num_new, width)
        q, k, v = (jnp.asarray(3 * rng.standard_normal((3, width, h, 64)), jnp.float32)
                   for h in (6, 2, 2))
        outs = []
        for i, c in enumerate(caches):
            caches[i], out = attend(c, q, k, v, step)
            outs.append(np.asarray(out))
        assert np.isfinite(outs[0]).all()
        np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-5)
        # Real pages only: every padded token's write lands in the sentinel page (index
        # num_pages), and a GPU scatter does not fix which of those writes lands last (the
        # H200 run of 12-04 found the sentinels differing while every real page agreed).
        real = slice(0, shape["num_pages"])
        for a, b in zip(caches[0].pool.arrays(), caches[1].pool.arrays()):
            np.testing.assert_array_equal(np.asarray(a)[:, real], np.asarray(b)[:, real])


@pytest.mark.parametrize("page_size", [16, 32, 48, 64, 128])
def test_every_copy_of_an_8bit_block_is_whole_128_byte_units_at_128_byte_offsets(page_size):
    """What lowering on CPU cannot see: every TMA copy moves a multiple of 128 bytes (Mosaic
    GPU's rule) into SMEM at a 128-byte-aligned offset, for both SMEM slots, and each row's K
    and V scale windows stay inside its slot."""
    from pallas_kernels._tiles import KVTiles, default_pages_per_block
    for head_dim in (64, 128):
        ppb = default_pages_per_block(page_size, scaled=True)
        tiles = KVTiles(1, 8, 8, page_size, ppb, head_dim, jnp.dtype(jnp.int8), scaled=True)
        assert tiles.block_rows % 64 == 0 and tiles.block_tokens == ppb * page_size
        for slot in range(2):
            for i in range(ppb):
                code_offset = (slot * tiles.block_rows + i * tiles.slot_rows) * head_dim
                assert code_offset % 128 == 0 and (page_size * head_dim) % 128 == 0
                for _, dst, n in tiles.scale_copies(i):
                    assert (4 * (slot * tiles.scale_slot_len + dst)) % 128 == 0
                    assert (4 * n) % 128 == 0
        assert tiles.v_scale_offset + tiles.block_rows <= tiles.scale_slot_len
        assert tiles.copies_per_page == (3 if page_size % 32 else 4)


def test_scaled_validation_names_the_fix():
    q = jnp.zeros((2, 4, 64), jnp.bfloat16)
    codes = jnp.zeros((8, 2, 16, 64), jnp.int8)
    scales = jnp.zeros((8, 2, 2, 16), jnp.float32)
    table, lengths = jnp.zeros((2, 4), jnp.int32), jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="pass them with their scales="):
        paged_decode_attention(q, codes, codes, table, lengths)
    with pytest.raises(ValueError, match="pass scales=None"):
        paged_decode_attention(q, codes.astype(q.dtype), codes.astype(q.dtype), table, lengths,
                               scales=scales)
    with pytest.raises(ValueError, match="scales must be float32"):
        paged_decode_attention(q, codes, codes, table, lengths, scales=scales[:, :, :1])
    with pytest.raises(ValueError, match="multiple of 16"):
        paged_decode_attention(q, codes[:, :, :8], codes[:, :, :8], table, lengths,
                               scales=scales[..., :8])
    with pytest.raises(ValueError, match="a float dtype"):
        paged_decode_attention(q.astype(jnp.int8), codes, codes, table, lengths, scales=scales)
    with pytest.raises(ValueError, match="paxkv.cache.pool.write"):
        write_kv(codes, codes, q[:, None, :2], q[:, None, :2], table[:, :1], table[:, :1])


# ---------------------------------------------------------------- sliding windows

# below a page, across pages, across blocks (and splits), past every sequence (= no window)
WINDOWS = (5, 40, 100, 10**6)
WINDOW_DECODE_CASES = [
    Case(3, 64, "bfloat16", kwargs=(("num_splits", 3),)),
    Case(2, 64, "float32", kwargs=(("num_splits", 2),), codes="int8"),  # 32-token blocks
]


def windowed_pool(seed, case: Case, lengths, first_seen):
    """:func:`make_pool` (or :func:`make_scaled_pool` for 8-bit cases) whose slots before
    ``first_seen[b]`` are poisoned too, as pages a cache freed behind the window would be."""
    make = make_scaled_pool if case.codes else make_pool
    return make(seed, case, lengths, first_seen=np.asarray(first_seen))


def pages_and_scales(pool):
    """``(k, v)`` or ``(k, v, scales)`` -> the kernels' positional pages and ``scales=``."""
    return pool[:2], (dict(scales=pool[2]) if len(pool) == 3 else {})


@pytest.mark.parametrize("case", WINDOW_DECODE_CASES, ids=str)
def test_windowed_decode_matches_reference(case):
    """The window is traced (one compiled kernel for every window): each sequence sees its
    last ``window`` keys, so a NaN anywhere before them (shared pages included) is never
    read; past every sequence it is the kernel without a window, to the bit."""
    lengths = edge_lengths(case.page_size, 3 * 64 + 5)
    q = jax.random.normal(jax.random.key(31), (len(lengths), case.num_kv_heads * case.group,
                                               case.head_dim), case.dtype)
    kw = dict(case.kwargs)

    @jax.jit
    def attend(pool, table, lengths, window):
        pages, scales = pages_and_scales(pool)
        return paged_decode_attention(q, *pages, table, lengths, window=window,
                                      interpret=INTERPRET, **scales, **kw)

    for window in WINDOWS:
        first_seen = np.maximum(np.asarray(lengths) - window, 0)
        clean, poisoned, table, lens = windowed_pool(30, case, lengths, first_seen)
        out = ready(attend(poisoned, table, lens, jnp.int32(window)))
        pages, scales = pages_and_scales(clean)
        ref = paged_decode_attention_reference(q, *pages, table, lens, window=window, **scales)
        assert out.shape == q.shape and out.dtype == q.dtype
        assert not np.asarray(out[0]).any(), "a length-0 row must be exactly zero"
        assert_rows_close(out, ref, case.dtype, row_axes=(0, 1))
    if not case.codes:  # the last window is past every sequence
        pages, scales = pages_and_scales(poisoned)
        plain = ready(paged_decode_attention(q, *pages, table, lens, interpret=INTERPRET, **kw))
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(plain, np.float32))


WINDOW_PREFILL_CASES = [
    Case(2, 64, "bfloat16", kwargs=(("block_q", 8),)),
    Case(2, 64, "float32", kwargs=(("block_q", 8),), codes="int8"),  # 32-token blocks
]


@pytest.mark.parametrize("case", WINDOW_PREFILL_CASES, ids=str)
def test_windowed_prefill_matches_reference(case):
    """Ragged chunks under a traced window: a program starts at its first query's first key,
    and a block feeds only the rows whose window reaches it (window 3: the chunk at 63..69
    crosses a block boundary, so its last rows skip block 0)."""
    s = case.page_size
    lengths = np.asarray([0, 1, s - 1, s + 9, 70, 3 * 64 + 5])
    query_lengths = np.asarray([0, 1, s - 1, 12, 23, 1], np.int32)
    q = jax.random.normal(jax.random.key(33), (6, 24, case.num_kv_heads * case.group,
                                               case.head_dim), case.dtype)
    kw = dict(case.kwargs)

    @jax.jit
    def attend(pool, table, lengths, window):
        pages, scales = pages_and_scales(pool)
        return paged_prefill_attention(q, *pages, table, lengths, query_lengths, window=window,
                                       interpret=INTERPRET, **scales, **kw)

    for window in (3, 40, 10**6):
        first_seen = np.maximum(lengths - query_lengths - window + 1, 0)
        clean, poisoned, table, lens = windowed_pool(32, case, lengths, first_seen)
        out = ready(attend(poisoned, table, lens, jnp.int32(window)))
        pages, scales = pages_and_scales(clean)
        ref = paged_prefill_attention_reference(q, *pages, table, lens, query_lengths,
                                                window=window, **scales)
        assert out.shape == q.shape and out.dtype == q.dtype
        t = np.arange(q.shape[1])[None, :]
        assert not np.asarray(out)[t >= query_lengths[:, None]].any()
        assert_rows_close(out, ref, case.dtype, row_axes=(0, 1, 2))


def test_window_from_a_layer_table_indexed_by_a_traced_layer():
    """As a model's layer scan passes them: ``layer`` traced, ``window = windows[layer]``, both
    read by the kernel from one int32 operand; int32 max (a "full attention" entry) is no
    window."""
    case = POOL_CASE
    lengths = edge_lengths(case.page_size, 100)
    windows = jnp.asarray([2**31 - 1, 20, 7], jnp.int32)
    q = jax.random.normal(jax.random.key(35), (len(lengths), 6, case.head_dim), case.dtype)

    @jax.jit
    def attend(k_pool, v_pool, table, lengths, windows, layer):
        return paged_decode_attention(q, k_pool, v_pool, table, lengths, layer=layer,
                                      window=windows[layer], num_splits=2, interpret=INTERPRET)

    for layer in (1, 0):
        window = int(windows[layer])
        first_seen = np.maximum(np.asarray(lengths) - window, 0)
        clean, poisoned, table, lens = make_pool(34, case, lengths, first_seen=first_seen)
        k_pool, v_pool = (stack_layers(x, layer) for x in poisoned)
        out = ready(attend(k_pool, v_pool, table, lens, windows, jnp.int32(layer)))
        ref = paged_decode_attention_reference(q, *clean, table, lens, window=window)
        assert_rows_close(out, ref, case.dtype, row_axes=(0, 1))


# ---------------------------------------------------------------- KV writes and page copies


def _kv_pool(dtype=jnp.bfloat16, shape=(7, 2, 16, 64)):
    k = jax.random.normal(jax.random.key(6), shape, dtype)
    return k, jax.random.normal(jax.random.key(7), shape, dtype)


def test_write_kv_matches_reference_in_place():
    k, v = _kv_pool()
    k_new = jax.random.normal(jax.random.key(8), (3, 2, 2, 64), jnp.float32)
    v_new = jax.random.normal(jax.random.key(9), (3, 2, 2, 64), jnp.float32)
    # decode tokens, a page boundary, and padding slots (page -1, page past the pool, offset 99)
    pages = jnp.array([[2, 2], [5, -1], [6, 7]], jnp.int32)
    offsets = jnp.array([[14, 15], [0, 3], [99, 1]], jnp.int32)
    ref_k, ref_v = write_kv_reference(k, v, k_new, v_new, pages, offsets)
    k_in, v_in = jnp.copy(k), jnp.copy(v)
    out_k, out_v = write_kv(k_in, v_in, k_new, v_new, pages, offsets, interpret=INTERPRET)
    assert k_in.is_deleted() and v_in.is_deleted(), "the pages must be donated"
    np.testing.assert_array_equal(np.asarray(out_k, np.float32), np.asarray(ref_k, np.float32))
    np.testing.assert_array_equal(np.asarray(out_v, np.float32), np.asarray(ref_v, np.float32))
    np.testing.assert_array_equal(np.asarray(out_k[6], np.float32), np.asarray(k[6], np.float32))


def test_write_kv_into_a_layer_of_the_pool_in_place():
    k, v = _kv_pool(shape=(3, 7, 2, 16, 64))
    k_new = jax.random.normal(jax.random.key(8), (2, 2, 2, 64), jnp.float32)
    v_new = jax.random.normal(jax.random.key(9), (2, 2, 2, 64), jnp.float32)
    pages = jnp.array([[2, 2], [5, -1]], jnp.int32)
    offsets = jnp.array([[14, 15], [0, 3]], jnp.int32)
    # layer 3 is past the pool: nothing is written (and the same compiled kernel runs)
    for layer, written in ((2, True), (3, False)):
        ref_k, ref_v = write_kv_reference(k, v, k_new, v_new, pages, offsets, layer=layer)
        k_in, v_in = jnp.copy(k), jnp.copy(v)
        out_k, out_v = write_kv(k_in, v_in, k_new, v_new, pages, offsets, layer=jnp.int32(layer),
                                interpret=INTERPRET)
        assert k_in.is_deleted() and v_in.is_deleted(), "the pool must be donated"
        out_k, out_v = np.asarray(out_k, np.float32), np.asarray(out_v, np.float32)
        np.testing.assert_array_equal(out_k, np.asarray(ref_k, np.float32))
        np.testing.assert_array_equal(out_v, np.asarray(ref_v, np.float32))
        np.testing.assert_array_equal(out_k[:2], np.asarray(k[:2], np.float32))
        assert np.array_equal(out_k, np.asarray(k, np.float32)) != written


def test_copy_pages_matches_reference_in_place():
    k, v = _kv_pool()
    src = jnp.array([1, 4, -1, 2], jnp.int32)
    dst = jnp.array([3, 5, 0, 99], jnp.int32)  # the last two pairs are padding
    ref_k, ref_v = copy_pages_reference(k, v, src, dst)
    k_in, v_in = jnp.copy(k), jnp.copy(v)
    out_k, out_v = copy_pages(k_in, v_in, src, dst, interpret=INTERPRET)
    assert k_in.is_deleted() and v_in.is_deleted(), "the pages must be donated"
    np.testing.assert_array_equal(np.asarray(out_k, np.float32), np.asarray(ref_k, np.float32))
    np.testing.assert_array_equal(np.asarray(out_v, np.float32), np.asarray(ref_v, np.float32))
    np.testing.assert_array_equal(np.asarray(out_k[3]), np.asarray(k[1]))


@pytest.mark.parametrize("fn", ["write", "copy"])
def test_reference_scatter_is_in_place_when_donated(fn):
    """The jnp twins alias the donated pages to the result: XLA scatters in place."""
    k, v = _kv_pool(jnp.float32)
    if fn == "write":
        extra = (jnp.ones((1, 1, 2, 64)), jnp.ones((1, 1, 2, 64)),
                 jnp.array([[3]], jnp.int32), jnp.array([[5]], jnp.int32))
        f = jax.jit(write_kv_reference, donate_argnums=(0, 1))
    else:
        extra = (jnp.array([1], jnp.int32), jnp.array([2], jnp.int32))
        f = jax.jit(copy_pages_reference, donate_argnums=(0, 1))
    hlo = f.lower(k, v, *extra).compile().as_text()
    assert "input_output_alias" in hlo
    f(k, v, *extra)
    assert k.is_deleted() and v.is_deleted()


# ---------------------------------------------------------------- validation and lowering


def test_trace_time_validation_names_the_fix():
    q = jnp.zeros((2, 4, 64), jnp.bfloat16)
    pages = jnp.zeros((8, 2, 16, 64), jnp.bfloat16)
    table, lengths = jnp.zeros((2, 4), jnp.int32), jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="pages_per_block"):
        paged_decode_attention(q, pages, pages, table, lengths, pages_per_block=3)
    with pytest.raises(ValueError, match="must match the pages"):
        paged_decode_attention(q.astype(jnp.float32), pages, pages, table, lengths)
    with pytest.raises(ValueError, match="int32"):
        paged_decode_attention(q, pages, pages, table.astype(jnp.int16), lengths)
    with pytest.raises(ValueError, match="multiple of 8"):
        paged_decode_attention(q, pages[:, :, :12], pages[:, :, :12], table, lengths)
    with pytest.raises(ValueError, match="block_q"):
        paged_prefill_attention(q[:, None].repeat(64, 1), pages, pages, table, lengths, lengths,
                                block_q=200)
    pool = pages[None].repeat(3, 0)
    with pytest.raises(ValueError, match="with layer="):
        paged_decode_attention(q, pages, pages, table, lengths, layer=1)
    with pytest.raises(ValueError, match=r"must both be \[num_pages"):
        paged_decode_attention(q, pool, pool, table, lengths)
    with pytest.raises(ValueError, match="integer scalar"):
        paged_prefill_attention(q[:, None], pool, pool, table, lengths, lengths,
                                layer=jnp.ones((1,), jnp.int32))
    with pytest.raises(ValueError, match="window must be an integer scalar"):
        paged_decode_attention(q, pages, pages, table, lengths, window=4.0)
    with pytest.raises(ValueError, match="window must be an integer scalar"):
        paged_prefill_attention(q[:, None], pool, pool, table, lengths, lengths, layer=1,
                                window=jnp.ones((2,), jnp.int32))
    with pytest.raises(ValueError, match="num_layers"):
        write_kv(pages, pages, q[:, None, :2], q[:, None, :2], table[:, :1], table[:, :1],
                 layer=0)


def _shapes(*xs):
    return [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in xs]


def _kernels_accept(kv: str, page_size: int, head_dim: int) -> bool:
    """Whether the decode kernel (and, for float pages, ``write_kv``) trace on this geometry."""
    dtype = jnp.dtype(jnp.bfloat16 if kv in FORMATS else kv)
    try:
        _lower_decode(dtype, 2, head_dim, page_size, kv if kv in FORMATS else None)
        if kv not in FORMATS:
            pages = jax.ShapeDtypeStruct((8, 2, page_size, head_dim), dtype)
            new = jax.ShapeDtypeStruct((4, 1, 2, head_dim), dtype)
            idx = jax.ShapeDtypeStruct((4, 1), jnp.int32)
            write_kv.trace(pages, pages, new, new, idx, idx)
    except ValueError:
        return False
    return True


def test_auto_takes_the_kernels_on_a_gpu_exactly_where_they_accept_the_pages():
    """``attention_impl="auto"`` on a GPU: the kernels where they trace, XLA where they raise
    (a small test model's head_dim 8 or page 4 ran into the kernels' errors on the H200 of
    12-04 before "auto" asked); XLA on any other backend; a named impl is kept."""
    geometries = [("float32", 16, 64), ("float32", 16, 32), ("float32", 4, 64),
                  ("float32", 16, 16), ("bfloat16", 16, 64), ("bfloat16", 8, 32),
                  ("bfloat16", 16, 8), ("float16", 12, 128), ("int8", 16, 64), ("int8", 8, 64),
                  ("int8", 32, 32), ("fp8", 16, 128), ("fp8", 24, 64)]
    for kv, page_size, head_dim in geometries:
        dtype = FORMATS[kv].dtype if kv in FORMATS else jnp.dtype(kv)
        geometry = dict(page_size=page_size, head_dim=head_dim)
        picked = paged_cache.resolve_impl("auto", dtype, backend="gpu", **geometry)
        assert (picked == "pallas") == _kernels_accept(kv, page_size, head_dim), (kv, geometry)
        assert paged_cache.resolve_impl("auto", dtype, backend="cpu", **geometry) == "xla"
        assert paged_cache.resolve_impl("pallas", dtype, backend="cpu", **geometry) == "pallas"
    accepted = [g for g in geometries if _kernels_accept(*g)]
    assert 4 <= len(accepted) < len(geometries)  # the grid has both answers
    with pytest.raises(ValueError, match="'auto', 'pallas', 'pallas_mma' or 'xla'"):
        paged_cache.resolve_impl("triton", jnp.float32, page_size=16, head_dim=64)


def _pages(dtype, head_dim, page_size, codes):
    """Page shapes (and scales) for a lowering: ``codes`` None, "int8" or "fp8"."""
    storage = dtype if codes is None else FORMATS[codes].storage
    pages = jax.ShapeDtypeStruct((64, 2, page_size, head_dim), storage)
    if codes is None:
        return pages, {}
    return pages, dict(scales=jax.ShapeDtypeStruct((64, 2, 2, page_size), jnp.float32))


def _lower_decode(dtype, group, head_dim, page_size, codes=None, **kw):
    q = jnp.zeros((4, 2 * group, head_dim), dtype)
    pages, scales = _pages(dtype, head_dim, page_size, codes)
    args = _shapes(q, jnp.zeros((4, 16), jnp.int32), jnp.zeros((4,), jnp.int32))
    return paged_decode_attention.trace(args[0], pages, pages, *args[1:], **scales, **kw)


def _lower_prefill(dtype, group, head_dim, page_size, codes=None, **kw):
    q = jnp.zeros((4, 32, 2 * group, head_dim), dtype)
    pages, scales = _pages(dtype, head_dim, page_size, codes)
    lengths = jnp.zeros((4,), jnp.int32)
    args = _shapes(q, jnp.zeros((4, 16), jnp.int32), lengths, lengths)
    return paged_prefill_attention.trace(args[0], pages, pages, *args[1:], **scales, **kw)


def _lower_kv(fn):
    k, v = _kv_pool()
    if fn == "write":
        new = jnp.zeros((4, 1, 2, 64), jnp.bfloat16)
        idx = jnp.zeros((4, 1), jnp.int32)
        return write_kv.trace(*_shapes(k, v, new, new, idx, idx))
    idx = jnp.zeros((5,), jnp.int32)
    return copy_pages.trace(*_shapes(k, v, idx, idx))


LOWERINGS = {
    "decode-bf16-g8-d128-ps16": lambda: _lower_decode(jnp.bfloat16, 8, 128, 16),
    "decode-f32-g3-d64-ps64-softcap": lambda: _lower_decode(jnp.float32, 3, 64, 64,
                                                            logit_soft_cap=30.0),
    "decode-f16-g1-d128-ps128": lambda: _lower_decode(jnp.float16, 1, 128, 128),
    "prefill-bf16-g4-d128-ps16": lambda: _lower_prefill(jnp.bfloat16, 4, 128, 16),
    "prefill-f32-g1-d64-ps32": lambda: _lower_prefill(jnp.float32, 1, 64, 32),
    # 8-bit pages: paired scale copies (page 16, 48), split ones (page 32, 64); q bf16 / f32
    "decode-int8-g8-d128-ps16": lambda: _lower_decode(jnp.bfloat16, 8, 128, 16, "int8"),
    "decode-int8-g3-d64-ps64-softcap": lambda: _lower_decode(jnp.float32, 3, 64, 64, "int8",
                                                             logit_soft_cap=30.0),
    "decode-fp8-g4-d64-ps32": lambda: _lower_decode(jnp.bfloat16, 4, 64, 32, "fp8"),
    "prefill-int8-g4-d64-ps16": lambda: _lower_prefill(jnp.bfloat16, 4, 64, 16, "int8"),
    "prefill-int8-g1-d128-ps48": lambda: _lower_prefill(jnp.float32, 1, 128, 48, "int8"),
    "prefill-fp8-g2-d128-ps64": lambda: _lower_prefill(jnp.bfloat16, 2, 128, 64, "fp8"),
    "write_kv": lambda: _lower_kv("write"),
    "copy_pages": lambda: _lower_kv("copy"),
}


@pytest.mark.parametrize("name", LOWERINGS)
def test_lowers_for_cuda(name):
    """Lowering runs Mosaic GPU's layout and TMA checks; PTX compilation needs a GPU."""
    lowered = LOWERINGS[name]().lower(lowering_platforms=("cuda",))
    hlo = lowered.as_text()
    assert "mosaic_gpu" in hlo
    kernel_name = {"decode": "paged_decode_ppb", "prefill": "paged_prefill_bq"}.get(
        name.split("-")[0], name)
    assert kernel_name in lowered.as_text(debug_info=True), "name= carries the tile sizes"
    if kernel_name != name:  # window=None: no window in the kernel, (layer,) its one int
        assert "_window" not in lowered.as_text(debug_info=True)
        operands = custom_call_operands(hlo)
        assert len(operands) == 1 and "tensor<1xi32>, tensor<4x16xi32>" in operands[0]
    if name in ("write_kv", "copy_pages"):  # the pages alias through the kernel and the jit
        assert "output_operand_aliases" in hlo and hlo.count("tf.aliasing_output") == 2


WINDOWED_LOWERINGS = {  # (kernel, q dtype, group, head_dim, page_size, 8-bit codes)
    "decode-bf16-g8-d128-ps16": ("decode", jnp.bfloat16, 8, 128, 16, None),
    "decode-int8-g4-d64-ps16": ("decode", jnp.bfloat16, 4, 64, 16, "int8"),  # paired scales
    "prefill-f32-g4-d128-ps16": ("prefill", jnp.float32, 4, 128, 16, None),
    "prefill-int8-g1-d128-ps48": ("prefill", jnp.float32, 1, 128, 48, "int8"),
}


def _lower_windowed(name: str, semantics: str):
    """-> ``(lowered, pool)``: the kernel of ``WINDOWED_LOWERINGS[name]`` on a 4-layer pool
    with a traced layer and window, traced afresh (not from jit's cache) with every
    ``plgpu.kernel`` under ``semantics`` lowering."""
    kind, dtype, group, head_dim, page_size, codes = WINDOWED_LOWERINGS[name]
    storage = FORMATS[codes].storage if codes else dtype
    pool = jax.ShapeDtypeStruct((4, 64, 2, page_size, head_dim), storage)
    kw = dict(layer=LAYER, window=LAYER)
    if codes:
        kw["scales"] = jax.ShapeDtypeStruct((4, 64, 2, 2, page_size), jnp.float32)
    q = (4, 2 * group, head_dim) if kind == "decode" else (4, 32, 2 * group, head_dim)
    lengths = jax.ShapeDtypeStruct((4,), jnp.int32)
    args = (jax.ShapeDtypeStruct(q, dtype), pool, pool, jax.ShapeDtypeStruct((4, 16), jnp.int32),
            lengths) + ((lengths,) if kind == "prefill" else ())
    kernel = {"decode": paged_decode_attention, "prefill": paged_prefill_attention}[kind]
    params = plgpu.CompilerParams(lowering_semantics=getattr(plgpu.LoweringSemantics, semantics))
    build = plgpu.kernel
    try:
        plgpu.kernel = functools.partial(build, compiler_params=params)
        fresh = jax.jit(functools.partial(kernel.__wrapped__))
        return fresh.trace(*args, **kw).lower(lowering_platforms=("cuda",)), pool
    finally:
        plgpu.kernel = build


@pytest.mark.parametrize("name", WINDOWED_LOWERINGS)
def test_windowed_kernels_lower_for_cuda_under_both_semantics(name):
    """With a traced window and layer the kernels lower for CUDA under Lane (jax 0.10.2's
    default) and Warpgroup (0.11's) semantics; the window rides in the int32 (layer, window)
    operand, and the pool reaches the custom call unsliced."""
    texts = []
    for semantics in ("Lane", "Warpgroup"):
        lowered, pool = _lower_windowed(name, semantics)
        hlo = lowered.as_text()
        operands = custom_call_operands(hlo)
        assert len(operands) == 1 and operands[0].count(mlir_type(pool)) == 2, operands
        assert "tensor<2xi32>" in operands[0] and "tensor<1xi32>" not in operands[0], operands
        assert "_window" in lowered.as_text(debug_info=True), "name= says it is windowed"
        assert not pool_slices(hlo, pool)
        texts.append(hlo)
    assert texts[0] != texts[1], "both semantics lowered the same: the setting did not apply"


# ---------------------------------------------------------------- the whole pool, no slice

POOL = jax.ShapeDtypeStruct((4, 64, 2, 16, 64), jnp.bfloat16)  # [layers, pages, kvh, ps, d]
LAYER = jax.ShapeDtypeStruct((), jnp.int32)
_MLIR_DTYPES = {"bfloat16": "bf16", "float32": "f32", "float16": "f16", "int8": "i8"}


def lowered_attend(cache, q_len: int, debug_info: bool = False) -> str:
    """The HLO of one ``cache.attend`` of ``q_len`` new tokens a row (1: a decode step) for a
    cache of 2 rows, 2 kv heads, head_dim 64 and 6 query heads, lowered for CUDA (the caller
    patches ``jax.default_backend`` to "gpu"); ``debug_info``: with locations (kernel names)."""
    def layer_step(cache, q, k, v, layer):
        step = StepInfo.make(cache.lengths + q_len, jnp.full((2,), q_len, jnp.int32), q_len)
        return cache.attend(layer, q, k, v, step)

    q = jax.ShapeDtypeStruct((2, q_len, 6, 64), cache.pool.k.dtype)
    kv = jax.ShapeDtypeStruct((2, q_len, 2, 64), cache.pool.k.dtype)
    return jax.jit(layer_step, donate_argnums=0).trace(
        cache, q, kv, kv, jax.ShapeDtypeStruct((), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text(debug_info=debug_info)


def mlir_type(x) -> str:
    return f"tensor<{'x'.join(map(str, x.shape))}x{_MLIR_DTYPES[jnp.dtype(x.dtype).name]}>"


def pool_slices(hlo: str, pool) -> list[str]:
    """StableHLO ops that cut a piece out of a pool-typed value (``pool[layer]`` is one)."""
    return [line for line in hlo.splitlines()
            if ("dynamic_slice" in line or "stablehlo.slice" in line or "gather" in line)
            and f"({mlir_type(pool)}" in line]


def custom_call_operands(hlo: str) -> list[str]:
    """The operand types of every Mosaic GPU custom call."""
    return [line.rsplit(" : (", 1)[1].split(") -> ")[0] for line in hlo.splitlines()
            if "stablehlo.custom_call @mosaic_gpu" in line]


def _lower_from_pool(name: str, *, slice_layer: bool = False):
    """Traces a kernel fed from the 5-D pool as the model does: ``layer=i``, or (the pattern
    the kernels avoid) ``pool[i]`` sliced out first."""
    table = jax.ShapeDtypeStruct((4, 16), jnp.int32)
    lengths = jax.ShapeDtypeStruct((4,), jnp.int32)
    if name == "write_kv":
        new = jax.ShapeDtypeStruct((4, 1, 2, 64), jnp.bfloat16)
        slots = jax.ShapeDtypeStruct((4, 1), jnp.int32)
        return write_kv.trace(POOL, POOL, new, new, slots, slots, layer=LAYER)
    kernel, q_shape, extra = {
        "decode": (paged_decode_attention, (4, 6, 64), ()),
        "prefill": (paged_prefill_attention, (4, 32, 6, 64), (lengths,)),
    }[name]

    def attend(q, k, v, block_tables, lengths, *rest, layer):
        if slice_layer:
            return kernel(q, k[layer], v[layer], block_tables, lengths, *rest)
        return kernel(q, k, v, block_tables, lengths, *rest, layer=layer)

    q = jax.ShapeDtypeStruct(q_shape, jnp.bfloat16)
    return jax.jit(attend).trace(q, POOL, POOL, table, lengths, *extra, layer=LAYER)


@pytest.mark.parametrize("name", ["decode", "prefill", "write_kv"])
def test_whole_pool_feeds_the_custom_call_unsliced(name):
    """With ``layer=`` the 5-D pool goes to the CUDA custom call as it is: no dynamic slice
    (which XLA would materialise, a layer of K/V copied per call) sits in between."""
    hlo = _lower_from_pool(name).lower(lowering_platforms=("cuda",)).as_text()
    operands = custom_call_operands(hlo)
    assert len(operands) == 1 and operands[0].count(mlir_type(POOL)) == 2, operands
    assert not pool_slices(hlo, POOL), pool_slices(hlo, POOL)
    if name == "write_kv":  # the pool aliases through the kernel and the jit
        assert "output_operand_aliases" in hlo and hlo.count("tf.aliasing_output") == 2
    else:  # the check above does see the slice it rules out
        sliced = _lower_from_pool(name, slice_layer=True).lower(
            lowering_platforms=("cuda",)).as_text()
        assert len(pool_slices(sliced, POOL)) == 2



@pytest.mark.parametrize("kernel", [paged_decode_attention, paged_prefill_attention],
                         ids=["decode", "prefill"])
def test_int8_pool_and_scales_feed_the_custom_call_unsliced(kernel):
    """An int8 pool and its scales reach the custom call whole: the scales only reshaped
    (``[..., 2, page_size]`` -> ``[..., 2 * page_size]``, a bitcast), nothing sliced."""
    pool = jax.ShapeDtypeStruct(POOL.shape, jnp.int8)
    scales = jax.ShapeDtypeStruct((4, 64, 2, 2, 16), jnp.float32)
    flat_scales = jax.ShapeDtypeStruct((4, 64, 2, 32), jnp.float32)
    table = jax.ShapeDtypeStruct((4, 16), jnp.int32)
    lengths = jax.ShapeDtypeStruct((4,), jnp.int32)
    q, extra = ((4, 6, 64), ()) if kernel is paged_decode_attention else ((4, 32, 6, 64),
                                                                          (lengths,))
    q = jax.ShapeDtypeStruct(q, jnp.bfloat16)
    hlo = kernel.trace(q, pool, pool, table, lengths, *extra, scales=scales,
                       layer=LAYER).lower(lowering_platforms=("cuda",)).as_text()
    operands = custom_call_operands(hlo)
    assert len(operands) == 1 and operands[0].count(mlir_type(pool)) == 2, operands
    assert mlir_type(flat_scales) in operands[0], operands
    assert not pool_slices(hlo, pool) and not pool_slices(hlo, scales)


def test_auto_num_splits_fills_the_gpu_without_tiny_splits():
    """The rule tuned on an H200 (experiments/README.md, kernels): ~2,048 programs, at most 32
    splits, at least 4 blocks per split, and never below one split."""
    from pallas_kernels.paged_decode import auto_num_splits
    assert [auto_num_splits(b, 8, blocks) for b, blocks in
            ((64, 512), (16, 64), (1, 512), (256, 8))] == [4, 16, 32, 1]
    for batch in (1, 3, 64, 1000):
        for blocks in (1, 3, 4, 17, 4096):
            n = auto_num_splits(batch, 2, blocks)
            assert 1 <= n <= 32 and (n == 1 or blocks // n >= 4)
