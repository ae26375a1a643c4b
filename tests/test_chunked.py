"""The XLA decode path's chunk list (pallas_kernels/chunked.py) against the per-row reference,
and the cache's in-step check of its ``decode_chunks`` hint."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxkv.attention import chunked, partials, query_tiles
from pallas_kernels.reference import (paged_decode_attention_reference,
                                      paged_prefill_attention_reference)
from paxkv.cache import paged as paged_cache
from paxkv.core.plan import AttentionPlan
from paxkv.core.step_info import StepInfo


def _rel_err(out: np.ndarray, want: np.ndarray) -> float:
    out, want = np.asarray(out, np.float32), np.asarray(want, np.float32)
    err = np.linalg.norm(out - want, axis=-1) / np.maximum(np.linalg.norm(want, axis=-1), 1e-6)
    return float(err.max())


def _poisoned_pool(rng, block_tables: np.ndarray, lengths: np.ndarray, num_pages: int,
                   kv_heads: int, page_size: int, head_dim: int, dtype):
    """Random K/V where some row holds a token, NaN in every other slot (free pages, slots past
    a row's length, pages nobody references): a stray read shows as NaN."""
    held = np.zeros((num_pages, page_size), bool)
    for row, length in enumerate(lengths):
        for p in range(length):
            held[block_tables[row, p // page_size], p % page_size] = True
    mask = held[:, None, :, None]
    shape = (num_pages, kv_heads, page_size, head_dim)
    k = np.where(mask, rng.standard_normal(shape), np.nan)
    v = np.where(mask, rng.standard_normal(shape), np.nan)
    return jnp.asarray(k, dtype), jnp.asarray(v, dtype)


# A model's score settings off the defaults: a softmax scale and a Gemma-2 logit soft-cap. With
# queries drawn at scale CAPPED_Q (scores of std ~3.6 at head_dim 16) the cap bends most scores.
CAPPED = dict(sm_scale=0.3, logit_soft_cap=5.0)
CAPPED_Q = 3.0


def _assert_cap_matters(out: jax.Array, uncapped: jax.Array) -> None:
    """The capped output is far from the uncapped one (same scale): a path that ignored the cap
    could not match the capped reference."""
    assert _rel_err(out, uncapped) > 0.1, _rel_err(out, uncapped)


CASES = [  # (page_size, chunk_pages, max_tile, rows, pages per row, kv heads, group, dtype)
    (1, 8, 4, 5, 24, 1, 4, jnp.float32),
    (4, 1, 1, 3, 9, 2, 3, jnp.float32),
    (4, 3, 2, 6, 10, 2, 1, jnp.float32),
    (16, 2, 4, 7, 6, 3, 3, jnp.float32),
    (16, 8, 16, 4, 20, 3, 3, jnp.float32),
    (32, 1, 8, 5, 5, 1, 2, jnp.bfloat16),
]


@pytest.mark.parametrize("capped", [False, True], ids=["default", "capped"])
@pytest.mark.parametrize("case", CASES, ids=[f"ps{c[0]}-cp{c[1]}-tile{c[2]}" for c in CASES])
def test_chunk_list_equals_the_per_row_reference(case, capped):
    """Ragged lengths (idle rows, page edges, full rows), pages shared between rows, NaN in
    every slot no row holds, a list longer than needed: the same output as one softmax per
    row over its gathered pages, with the default score settings or a model's own
    (``CAPPED``)."""
    page_size, chunk_pages, max_tile, rows, width, kv_heads, group, dtype = case
    rng = np.random.default_rng(page_size * 100 + chunk_pages)
    head_dim, num_pages = 16, rows * width + 2
    block_tables = rng.permutation(num_pages)[: rows * width].reshape(rows, width)
    block_tables[1, :2] = block_tables[0, :2]  # row 1 shares row 0's first two pages
    block_tables = block_tables.astype(np.int32)
    lengths = rng.integers(1, width * page_size + 1, rows).astype(np.int32)
    lengths[0] = width * page_size  # a full row
    lengths[1] = max(lengths[1], 2 * page_size)
    lengths[2] = 0  # idle
    if rows > 3:
        lengths[3] = chunk_pages * page_size  # exactly one chunk
    k, v = _poisoned_pool(rng, block_tables, lengths, num_pages, kv_heads, page_size, head_dim,
                          dtype)
    q_scale, settings = (CAPPED_Q, CAPPED) if capped else (1.0, {})
    q = jnp.asarray(q_scale * rng.standard_normal((rows, kv_heads * group, head_dim)), dtype)
    needed = int(chunked.chunks_needed(lengths, start_page=0, page_size=page_size,
                                       chunk_pages=chunk_pages).sum())
    num_chunks, tile = chunked.list_shape(needed + 3, max_tile)  # some padding chunks too
    out = jax.jit(chunked.paged_decode_attention_chunked,
                  static_argnames=("num_chunks", "chunk_pages", "tile_chunks", "sm_scale",
                                   "logit_soft_cap"))(
        q, k, v, block_tables, lengths, num_chunks=num_chunks, chunk_pages=chunk_pages,
        tile_chunks=tile, **settings)
    reference = functools.partial(paged_decode_attention_reference, q, jnp.nan_to_num(k),
                                  jnp.nan_to_num(v), block_tables, lengths)
    want = reference(**settings)
    assert out.dtype == dtype and np.isfinite(np.asarray(out, np.float32)).all()
    assert not np.asarray(out, np.float32)[2].any(), "an idle row is zero"
    assert _rel_err(out, want) <= (1e-5 if dtype == jnp.float32 else 2e-2)
    if capped:
        _assert_cap_matters(out, reference(sm_scale=CAPPED["sm_scale"]))


def test_work_list_enumerates_each_rows_chunks_in_order():
    lengths = jnp.array([300, 0, 128, 129, 5], jnp.int32)
    live = jnp.array([True, True, True, True, False])
    work = chunked.chunk_work(lengths, live, start_page=2, page_size=16, chunk_pages=4,
                              num_chunks=8)
    # Past the first 32 tokens, chunks of 64: row 0 has 268 -> 5 chunks, row 2 96 -> 2,
    # row 3 97 -> 2 (total 9 > 8: the list is one short, which ``total`` shows), row 4 idle.
    assert int(work.total) == 9
    assert np.asarray(work.row).tolist() == [0, 0, 0, 0, 0, 2, 2, 3]
    assert np.asarray(work.first_page).tolist() == [2, 6, 10, 14, 18, 2, 6, 2]
    assert np.asarray(work.valid).all()
    short = chunked.chunk_work(jnp.array([10], jnp.int32), jnp.array([True]), start_page=0,
                               page_size=16, chunk_pages=4, num_chunks=4)
    assert np.asarray(short.valid).tolist() == [True, False, False, False]


def test_list_shape_covers_the_need_in_few_shapes():
    shapes = set()
    for needed in range(1, 2000):
        n, tile = chunked.list_shape(needed, 16)
        assert n >= needed and n % tile == 0 and tile <= 16
        if needed > 16:
            assert tile == 16 and n - needed < max(16, needed / 8), (needed, n)
        shapes.add(n)
    assert len(shapes) < 60, len(shapes)  # 1,999 counts, a few dozen compiled lengths
    assert chunked.list_shape(1, 16) == (1, 1) and chunked.list_shape(5, 16) == (8, 8)


def test_merge_of_disjoint_key_sets_is_one_softmax():
    rng = np.random.default_rng(3)
    scores = rng.standard_normal((2, 1, 3, 10)) * 4  # [b, kv heads, group, keys]
    values = rng.standard_normal((10, 5))

    def partial(s: np.ndarray, vals: np.ndarray) -> partials.Partial:
        top = s.max(-1)
        p = np.exp(s - top[..., None])
        return partials.Partial(*(jnp.asarray(x, jnp.float32) for x in (top, p.sum(-1), p @ vals)))

    merged = partials.merge(partial(scores[..., :6], values[:6]),
                           partial(scores[..., 6:], values[6:]))
    p = np.exp(scores - scores.max(-1, keepdims=True))
    want = ((p / p.sum(-1, keepdims=True)) @ values).reshape(2, 3, 5)
    np.testing.assert_allclose(np.asarray(partials.finish(merged, jnp.float32)), want, rtol=1e-5)
    empty = partials.Partial(jnp.full((2, 1, 3), -jnp.inf), jnp.zeros((2, 1, 3)),
                            jnp.zeros((2, 1, 3, 5)))
    whole = partial(scores, values)
    np.testing.assert_allclose(np.asarray(partials.finish(partials.merge(empty, whole),
                                                         jnp.float32)), want, rtol=1e-5)
    assert not np.asarray(partials.finish(partials.merge(empty, empty), jnp.float32)).any()


def test_keys_partial_is_a_masked_softmax_of_transposed_keys():
    """The tiles' inner product (keys laid out [head_dim, keys]) == a float64 softmax over the
    live keys; NaN behind dead keys stays out, and an item with no live key is empty."""
    rng = np.random.default_rng(4)
    n, kv, group, d, keys = 3, 2, 3, 16, 40
    q = rng.standard_normal((n, kv, group, d))
    k = rng.standard_normal((n, kv, keys, d))
    v = rng.standard_normal((n, kv, keys, d))
    live = np.ones((n, keys), bool)
    live[0, 25:] = False
    live[2] = False  # nothing to attend to
    k[~live[:, None, :].repeat(kv, 1)] = np.nan
    v[~live[:, None, :].repeat(kv, 1)] = np.nan
    parts = partials.keys_partial(*(jnp.asarray(x, jnp.float32) for x in
                                   (q, k.swapaxes(-1, -2), v)), jnp.asarray(live), sm_scale=0.3)
    out = np.asarray(partials.finish(parts, jnp.float32)).reshape(n, kv, group, d)
    for i in range(2):
        s = 0.3 * np.einsum("kgd,ksd->kgs", q[i], k[i][:, live[i]])
        p = np.exp(s - s.max(-1, keepdims=True))
        want = np.einsum("kgs,ksd->kgd", p / p.sum(-1, keepdims=True), v[i][:, live[i]])
        np.testing.assert_allclose(out[i], want, rtol=2e-5, atol=2e-6)
    assert not out[2].any() and np.isfinite(out).all()
    assert np.isneginf(np.asarray(parts.max)[2]).all()


@pytest.mark.parametrize("capped", [False, True], ids=["scaled", "capped"])
def test_query_tiles_equal_one_pass(capped):
    """Prefill through (row, query tile) pieces: ragged queries, cached context before them,
    padding queries, NaN in every slot no row holds; a softmax scale alone or with a model's
    soft-cap (``CAPPED``)."""
    rng = np.random.default_rng(5)
    page_size, rows, width, t = 8, 3, 40, 192  # tiles of 96 queries
    assert query_tiles.query_tile(t) == 96 and query_tiles.query_tile(100) == 100
    block_tables = rng.permutation(rows * width).reshape(rows, width).astype(np.int32)
    # Row 0: cached context before its queries (every tile reads the whole window); row 1:
    # a fresh prompt (its first tile reads half of it); row 2: padding queries.
    lengths = np.array([300, 192, 50], np.int32)
    query_lengths = np.array([192, 192, 50], np.int32)
    k, v = _poisoned_pool(rng, block_tables, lengths, rows * width, 2, page_size, 16,
                          jnp.float32)
    q_scale, settings = (CAPPED_Q, CAPPED) if capped else (1.0, dict(sm_scale=0.25))
    q = jnp.asarray(q_scale * rng.standard_normal((rows, t, 6, 16)), jnp.float32)
    step = StepInfo.make(lengths, query_lengths, t)
    out = jax.jit(query_tiles.attend_in_query_tiles,
                  static_argnames=("sm_scale", "logit_soft_cap"))(
        q, k, v, block_tables, step.positions, step.lengths, **settings)
    reference = functools.partial(paged_prefill_attention_reference, q, jnp.nan_to_num(k),
                                  jnp.nan_to_num(v), block_tables, lengths, query_lengths)
    assert np.isfinite(np.asarray(out)).all()
    assert _rel_err(out, reference(**settings)) <= 1e-5
    if capped:
        _assert_cap_matters(out, reference(sm_scale=CAPPED["sm_scale"]))


# -- the cache: the decode_chunks hint is checked inside the step ----------------------------

LENGTHS = (30, 3, 0, 17)  # pages of one token: chunks of 128 pages, one per live row


def _ragged_cache() -> paged_cache.PagedCache:
    """Rows of LENGTHS tokens (row 2 idle) about to decode one more; NaN in every free slot.
    A 512-token row width: the whole-row list is 4 rows x 4 chunks."""
    cache = paged_cache.create(num_layers=1, num_kv_heads=2, head_dim=8, num_pages=64,
                               page_size=1, max_seqs=len(LENGTHS), max_len=512, fill=jnp.nan,
                               scrub=False)
    live = jnp.array([n > 0 for n in LENGTHS])
    cache, ok = cache.reserve(jnp.array(LENGTHS, jnp.int32) + live, max_new=64)
    assert bool(ok.all())
    rng = np.random.default_rng(0)
    k, v = np.asarray(cache.pool.k).copy(), np.asarray(cache.pool.v).copy()
    for row, page in enumerate(np.asarray(cache.table.block_tables)):
        held = page[: LENGTHS[row]]
        k[0, held], v[0, held] = (rng.standard_normal((len(held), 2, 1, 8)) for _ in range(2))
    return cache.__class__(pool=type(cache.pool)(k=jnp.asarray(k), v=jnp.asarray(v)),
                           table=cache.table)


def _decode(cache: paged_cache.PagedCache, hint: int | None) -> np.ndarray:
    rng = np.random.default_rng(1)
    rows = len(LENGTHS)
    q = jnp.asarray(rng.standard_normal((rows, 1, 6, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((rows, 1, 2, 8)), jnp.float32)
    step = StepInfo.make(cache.lengths, jnp.array([n > 0 for n in LENGTHS], jnp.int32), 1,
                         plan=AttentionPlan(decode_chunks=hint))
    attend = jax.jit(lambda c, q, k: c.attend(0, q, k, k, step)[1])  # a fresh trace per call
    return np.asarray(attend(cache, q, k))


def test_cache_uses_the_hinted_list_only_when_it_covers_the_rows(monkeypatch):
    """A hint that covers every live row's chunks sizes the list; one too small falls back to
    whole rows inside the step (never a row attending to part of its keys)."""
    cache = _ragged_cache()
    want = _decode(cache, None)
    assert np.isfinite(want).all() and not want[2].any()
    np.testing.assert_allclose(_decode(cache, 3), want, rtol=1e-6)  # 3 rows: a list of 4
    np.testing.assert_allclose(_decode(cache, 2), want, rtol=1e-6)  # too short: whole rows

    real = chunked.chunk_partials
    lengths_seen: list[int] = []

    def poison(length: int):  # NaN out of every list of ``length`` chunks
        def marked(*args, **kw):
            parts = real(*args, **kw)
            lengths_seen.append(args[5].row.shape[0])
            return jax.tree.map(lambda x: x * jnp.nan, parts) if lengths_seen[-1] == length \
                else parts
        monkeypatch.setattr(chunked, "chunk_partials", marked)

    poison(4)
    assert np.isnan(_decode(cache, 3)).all(), "the hint holds: its list must run"
    poison(2)
    np.testing.assert_allclose(_decode(cache, 2), want, rtol=1e-6)
    assert {2, 16} <= set(lengths_seen), lengths_seen  # both branches traced, whole rows ran


@pytest.mark.parametrize("kind", ["paged", "dense"])
def test_one_wide_pass_off_cpu_equals_the_tiles(monkeypatch, kind):
    """Off a CPU (``tiles_pay()`` False) both caches attend in one pass; same outputs."""
    from paxkv.cache import dense as dense_cache  # noqa: PLC0415

    def run() -> list[np.ndarray]:
        dims = dict(num_layers=1, num_kv_heads=2, head_dim=8, max_seqs=3, max_len=64)
        cache = (paged_cache.create(num_pages=40, page_size=4, **dims) if kind == "paged"
                 else dense_cache.create(**dims))
        rng = np.random.default_rng(2)
        outs = []
        for new in ([20, 5, 0], [1, 1, 0]):  # a ragged prefill, then a decode step
            cache, ok = cache.reserve(jnp.array(new, jnp.int32), max_new=20)
            assert bool(ok.all())
            t = max(new)
            q = jnp.asarray(rng.standard_normal((3, t, 6, 8)), jnp.float32)
            kv = jnp.asarray(rng.standard_normal((3, t, 2, 8)), jnp.float32)
            step = StepInfo.make(cache.lengths, jnp.array(new, jnp.int32), t)
            cache, out = jax.jit(lambda c, q, kv, s: c.attend(0, q, kv, kv, s))(cache, q, kv,
                                                                                 step)
            outs.append(np.asarray(out))
        return outs

    tiled = run()
    monkeypatch.setattr(chunked, "tiles_pay", lambda: False)
    for got, want in zip(run(), tiled):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
