"""The paged and dense caches behind one protocol: paged == dense == reference, no stray reads.

Both caches start filled with NaN (and the paged one does not scrub), so any read of a free
page, of a slot past a sequence's length or of table padding poisons the output. The paged
block tables are random permutations of the pool, lengths are ragged around page edges, and
forks make rows share pages (and then copy them on write).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import reference as ref
from pallas_kernels.kv_storage import readable
from paxkv.cache import dense as dense_cache
from paxkv.cache import paged as paged_cache
from pallas_kernels import quant
from paxkv.cache.full import NoCache
from paxkv.core.plan import AttentionPlan
from paxkv.core.step_info import StepInfo

PAGE_SIZE = 4
MAX_LEN = 24  # 6 pages per row
NUM_PAGES = 40
NUM_LAYERS, NUM_KV_HEADS, NUM_Q_HEADS, HEAD_DIM = 2, 2, 4, 8
# Ragged prompts around page edges; rows 0, 6 and 8 start idle (0 and 6 become fork children).
PROMPT = np.array([0, 1, PAGE_SIZE - 1, PAGE_SIZE, PAGE_SIZE + 1, 2 * PAGE_SIZE + 3, 0, 9, 0],
                  np.int32)
MAX_SEQS = len(PROMPT)
PROMPT_WIDTH = int(PROMPT.max())  # the q_len of every multi-token step (one compile)
MAX_NEW = PROMPT_WIDTH  # the static bound of every reserve (one compile)
# Per-row relative error allowed, by storage dtype. int8 caches are compared with oracles of
# the same (dequantised) values, so they are held to float32's tolerance.
TOLERANCE = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-2,
             jnp.dtype(jnp.int8): 1e-5}

attend_jit = jax.jit(lambda cache, layer, q, k, v, step: cache.attend(layer, q, k, v, step))
reserve_jit = jax.jit(lambda cache, num_new: cache.reserve(num_new, max_new=MAX_NEW))
stats_jit = jax.jit(lambda cache: cache.stats())
release_jit = jax.jit(lambda cache, rows: cache.release(rows))
fork_jit = jax.jit(lambda cache, parents, children: cache.fork(parents, children))
paged_prefill_ref = jax.jit(ref.paged_prefill_attention_reference)
paged_decode_ref = jax.jit(ref.paged_decode_attention_reference)
dense_ref = jax.jit(ref.dense_attention_reference)


@pytest.fixture(autouse=True)
def _strict_ranks():
    with jax.numpy_rank_promotion("raise"):
        yield


def assert_rows_close(actual: jax.Array, desired: jax.Array, dtype, what: str = ""):
    """Per-row relative error (a row = one query token, all heads) within the dtype's
    tolerance; rows that must be zero (padding, idle rows) must be exactly zero."""
    a = np.asarray(actual, np.float32)
    d = np.asarray(desired, np.float32)
    assert a.shape == d.shape, (a.shape, d.shape)
    assert np.all(np.isfinite(a)), f"{what}: non-finite output (a stray read)"
    a, d = a.reshape(-1, a.shape[-2] * a.shape[-1]), d.reshape(-1, d.shape[-2] * d.shape[-1])
    err = np.linalg.norm(a - d, axis=1) / np.maximum(np.linalg.norm(d, axis=1),
                                                       np.finfo(np.float32).tiny)
    tol = TOLERANCE[jnp.dtype(dtype)]
    assert err.max() <= tol, f"{what}: row {err.argmax()} relative error {err.max():.2e} > {tol}"


def _qkv(rng, t: int, dtype, batch: int = MAX_SEQS):
    if quant.format_of(dtype) is not None:
        dtype = jnp.float32  # a scaled cache quantises float K/V itself

    def normal(heads):
        return jnp.asarray(rng.standard_normal((NUM_LAYERS, batch, t, heads, HEAD_DIM)), dtype)
    return normal(NUM_Q_HEADS), normal(NUM_KV_HEADS), normal(NUM_KV_HEADS)


def _permuted_paged(rng, dtype) -> paged_cache.PagedCache:
    """A NaN-filled paged cache holding PROMPT's lengths in randomly permuted pages."""
    cache = paged_cache.create(num_layers=NUM_LAYERS, num_kv_heads=NUM_KV_HEADS,
                               head_dim=HEAD_DIM, num_pages=NUM_PAGES, page_size=PAGE_SIZE,
                               max_seqs=MAX_SEQS, max_len=MAX_LEN, dtype=dtype, scrub=False,
                               fill=float("nan"))
    held = -(-PROMPT // PAGE_SIZE)
    perm = rng.permutation(NUM_PAGES).astype(np.int32)
    block_tables = np.full((MAX_SEQS, MAX_LEN // PAGE_SIZE), NUM_PAGES, np.int32)
    starts = np.cumsum(held) - held
    for b in range(MAX_SEQS):
        block_tables[b, :held[b]] = perm[starts[b]: starts[b] + held[b]]
    ref_counts = np.zeros(NUM_PAGES, np.int32)
    ref_counts[perm[:held.sum()]] = 1
    table = dataclasses.replace(cache.table, block_tables=jnp.asarray(block_tables),
                                lengths=jnp.asarray(PROMPT), ref_counts=jnp.asarray(ref_counts),
                                active=jnp.asarray(PROMPT > 0))
    return dataclasses.replace(cache, table=table)


def _dense(dtype) -> dense_cache.DenseCache:
    cache = dense_cache.create(num_layers=NUM_LAYERS, num_kv_heads=NUM_KV_HEADS,
                               head_dim=HEAD_DIM, max_seqs=MAX_SEQS, max_len=MAX_LEN,
                               dtype=dtype, fill=float("nan"))
    cache, ok = reserve_jit(cache, PROMPT)
    assert np.all(np.asarray(ok))
    return cache


def _step(paged, dense, step: StepInfo, q, k, v, dtype, what: str):
    """Runs one step through every layer of both caches and checks each output against the
    other cache and the reference functions."""
    rows = np.arange(MAX_SEQS) if step.rows is None else np.asarray(step.rows)
    np.testing.assert_array_equal(np.asarray(paged.lengths)[rows], np.asarray(step.lengths))
    np.testing.assert_array_equal(np.asarray(dense.lengths)[rows], np.asarray(step.lengths))
    outs = []
    for layer in range(NUM_LAYERS):
        paged, out_p = attend_jit(paged, layer, q[layer], k[layer], v[layer], step)
        dense, out_d = attend_jit(dense, layer, q[layer], k[layer], v[layer], step)
        tag = f"{what} layer {layer}"
        k_pages, v_pages = paged.pool.read(layer, jnp.arange(paged.pool.num_pages + 1))
        bt = paged.table.block_tables[rows]
        assert_rows_close(out_p, out_d, dtype, f"{tag}: paged vs dense")
        assert_rows_close(out_p, paged_prefill_ref(q[layer], k_pages, v_pages, bt, step.lengths,
                                                   step.query_lengths), dtype,
                          f"{tag}: paged vs reference")
        assert_rows_close(out_d, dense_ref(q[layer], *_dense_rows(dense, layer, rows),
                                           step.lengths, step.query_lengths), dtype,
                          f"{tag}: dense vs reference")
        if q.shape[2] == 1 and np.array_equal(np.asarray(step.query_lengths),
                                              np.minimum(np.asarray(step.lengths), 1)):
            assert_rows_close(out_p[:, 0], paged_decode_ref(q[layer, :, 0], k_pages, v_pages, bt,
                                                            step.lengths), dtype,
                              f"{tag}: paged vs decode reference")
        outs.append(out_p)
    return paged, dense, jnp.stack(outs)


def _dense_rows(dense, layer: int, rows) -> tuple[jax.Array, jax.Array]:
    """K and V ``[rows, kv_heads, max_len, head_dim]`` of a dense cache, as attention reads
    them (codes dequantised)."""
    if dense.scales is None:
        return readable(dense.k[layer, rows]), readable(dense.v[layer, rows])
    scales = dense.scales[layer, rows]  # [rows, kv_heads, 2, max_len]
    return (readable(dense.k[layer, rows], scales[:, :, 0]),
            readable(dense.v[layer, rows], scales[:, :, 1]))


def _same_protocol_results(paged_result, dense_result):
    (paged, ok_p), (dense, ok_d) = paged_result, dense_result
    np.testing.assert_array_equal(np.asarray(ok_p), np.asarray(ok_d))
    np.testing.assert_array_equal(np.asarray(paged.lengths), np.asarray(dense.lengths))
    np.testing.assert_array_equal(np.asarray(paged.active), np.asarray(dense.active))
    return paged, dense


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8],
                         ids=["f32", "bf16", "int8"])
def test_paged_equals_dense_and_reference_with_no_stray_reads(dtype):
    rng = np.random.default_rng(0)
    paged, dense = _permuted_paged(rng, dtype), _dense(dtype)

    # Prefill the ragged prompts (lengths 0, 1, ps-1, ps, ps+1, ...): also == a full forward.
    step = StepInfo.make(PROMPT, PROMPT, PROMPT_WIDTH)
    q, k, v = _qkv(rng, PROMPT_WIDTH, dtype)
    paged, dense, out = _step(paged, dense, step, q, k, v, dtype, "prefill")
    fmt = quant.format_of(dtype)
    stored = (lambda x: x) if fmt is None else (lambda x: quant.round_trip(x, fmt))
    for layer in range(NUM_LAYERS):
        _, full = NoCache().attend(layer, q[layer], stored(k[layer]), stored(v[layer]), step)
        assert_rows_close(out[layer], full, dtype, "prefill: paged vs full forward")

    # Fork: row 3 (a full page) -> 0, row 7 (a partial page) -> 6; pairs into active rows fail.
    parents, children = np.array([3, 7, 1, 5], np.int32), np.array([0, 6, 2, 3], np.int32)
    paged, dense = _same_protocol_results(fork_jit(paged, parents, children),
                                          fork_jit(dense, parents, children))
    np.testing.assert_array_equal(np.asarray(fork_jit(paged, parents, children)[1]),
                                  [False] * 4)  # children are active now
    assert int(stats_jit(paged).shared_pages) == 4  # row 3's page, row 7's three

    # Decode one token in every row but the idle row 8: rows 6 and 7 write into their shared
    # partial page with equal lengths (one keeps it, the other copies it).
    live = np.asarray(paged.active).astype(np.int32)
    paged, dense = _same_protocol_results(reserve_jit(paged, live), reserve_jit(dense, live))
    assert int(stats_jit(paged).shared_pages) == 3  # only full pages are still shared
    step = StepInfo.make(paged.lengths, live, 1)
    paged, dense, _ = _step(paged, dense, step, *_qkv(rng, 1, dtype), dtype, "decode")

    # Cancel two shared rows (the parents), then a ragged chunked prefill (t > 1) that crosses
    # page edges, batched over some cache rows out of order (a released row among them).
    paged, dense = _same_protocol_results(
        release_jit(paged, np.isin(np.arange(MAX_SEQS), [3, 7])),
        release_jit(dense, np.isin(np.arange(MAX_SEQS), [3, 7])))
    assert int(stats_jit(paged).shared_pages) == 0
    num_new = np.array([5, 4, 1, 0, 3, 2, 5, 0, 0], np.int32)
    paged, dense = _same_protocol_results(reserve_jit(paged, num_new), reserve_jit(dense, num_new))
    rows = np.array([6, 0, 1, 2, 4, 5, 3], np.int32)
    step = StepInfo.make(np.asarray(paged.lengths)[rows], num_new[rows], PROMPT_WIDTH, rows)
    paged, dense, _ = _step(paged, dense, step, *_qkv(rng, PROMPT_WIDTH, dtype, len(rows)),
                            dtype, "chunked prefill of some rows")

    # A context bucket no shorter than any row (and not a page multiple) changes nothing.
    live = np.asarray(paged.active).astype(np.int32)
    paged, dense = _same_protocol_results(reserve_jit(paged, live), reserve_jit(dense, live))
    window = int(np.asarray(paged.lengths).max()) + 1
    assert window % PAGE_SIZE != 0
    step = StepInfo.make(paged.lengths, live, 1)
    q, k, v = _qkv(rng, 1, dtype)
    _, _, full = _step(paged, dense, step, q, k, v, dtype, "decode")
    assert -(-window // PAGE_SIZE) < MAX_LEN // PAGE_SIZE
    windowed = StepInfo.make(paged.lengths, live, 1, plan=AttentionPlan(window=window))
    _, _, out = _step(paged, dense, windowed, q, k, v, dtype, "windowed decode")
    assert_rows_close(out, full, dtype, "windowed vs whole row")
    # A window shorter than a row is a wrong hint: the step must still read every key.
    short = StepInfo.make(paged.lengths, live, 1, plan=AttentionPlan(window=PAGE_SIZE))
    assert int(np.asarray(paged.lengths).max()) + 1 > PAGE_SIZE
    _, _, out = _step(paged, dense, short, q, k, v, dtype, "decode, window too short")
    assert_rows_close(out, full, dtype, "too-short window vs whole row")


# -- donation and eager == jitted -----------------------------------------------------------
def _prefilled(kind: str):
    """The f32 caches of the test above after the prompt (shapes already compiled)."""
    rng = np.random.default_rng(1)
    cache = _permuted_paged(rng, jnp.float32) if kind == "paged" else _dense(jnp.float32)
    q, k, v = _qkv(rng, PROMPT_WIDTH, jnp.float32)
    prompt = StepInfo.make(PROMPT, PROMPT, PROMPT_WIDTH)
    for layer in range(NUM_LAYERS):
        cache, _ = attend_jit(cache, layer, q[layer], k[layer], v[layer], prompt)
    return cache


def _kv_buffers(cache):
    if isinstance(cache, paged_cache.PagedCache):
        return cache.pool.k, cache.pool.v
    return cache.k, cache.v


@pytest.mark.parametrize("kind", ["paged", "dense"])
def test_jitted_reserve_and_attend_donate_the_cache(kind):
    cache = _prefilled(kind)
    reserve = jax.jit(lambda c, n: c.reserve(n, max_new=1), donate_argnums=0)
    attend = jax.jit(lambda c, q, k, v, step: c.attend(1, q, k, v, step), donate_argnums=0)
    live = np.asarray(cache.active).astype(np.int32)
    new, ok = reserve(cache, live)
    assert np.all(np.asarray(ok))
    assert all(buf.is_deleted() for buf in _kv_buffers(cache))
    q, k, v = _qkv(np.random.default_rng(1), 1, jnp.float32)
    step = StepInfo.make(np.asarray(new.lengths), live, 1)  # not a view of the donated cache
    newer, out = attend(new, q[0], k[0], v[0], step)
    assert all(buf.is_deleted() for buf in _kv_buffers(new))
    assert np.all(np.isfinite(np.asarray(out)))
    assert not any(buf.is_deleted() for buf in _kv_buffers(newer))


def _assert_trees_close(eager, jitted):
    leaves_e, tree_e = jax.tree.flatten(eager)
    leaves_j, tree_j = jax.tree.flatten(jitted)
    assert tree_e == tree_j
    for a, b in zip(leaves_e, leaves_j):
        assert a.dtype == b.dtype and a.shape == b.shape
        if a.ndim == 4:  # an attention output [batch, t, heads, head_dim]
            assert_rows_close(a, b, a.dtype, "eager vs jitted")
        elif a.ndim == 0 and jnp.issubdtype(a.dtype, jnp.floating):  # a stats fraction
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
        else:  # tables, flags and pools (data movement only: bit-exact, NaN included)
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("kind", ["paged", "dense"])
def test_eager_and_jitted_cache_ops_agree(kind):
    cache = _prefilled(kind)
    parents, children = np.array([7, 2, 5, 4], np.int32), np.array([6, 8, 8, 1], np.int32)
    forked, _ = fork_jit(cache, parents, children)
    live = np.asarray(forked.active).astype(np.int32)
    grown, _ = reserve_jit(forked, live)
    q, k, v = _qkv(np.random.default_rng(2), 1, jnp.float32)
    decode = StepInfo.make(grown.lengths, live, 1)
    rows = np.isin(np.arange(MAX_SEQS), [1, 7, 8])
    # (eager op, its jitted form): the jitted forms are the ones compiled above.
    cases = [
        (lambda: forked.reserve(live, max_new=MAX_NEW), lambda: reserve_jit(forked, live)),
        (lambda: forked.release(rows), lambda: release_jit(forked, rows)),
        (lambda: cache.fork(parents, children), lambda: fork_jit(cache, parents, children)),
        (lambda: grown.attend(0, q[0], k[0], v[0], decode),
         lambda: attend_jit(grown, 0, q[0], k[0], v[0], decode)),
        (lambda: forked.stats(), lambda: stats_jit(forked)),
    ]
    for eager, jitted in cases:
        _assert_trees_close(eager(), jitted())


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int8])
def test_caches_report_their_sizes_through_the_protocol(dtype):
    """``total_pages`` and the byte counts are part of :class:`paxkv.core.protocol.KVCache` (the
    engine's accounting reads nothing else): a paged page and a dense row hold the same bytes
    per token, 8-bit scales included, and the whole cache is on one device."""
    sizes = dict(num_layers=NUM_LAYERS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM)
    paged = paged_cache.create(**sizes, num_pages=NUM_PAGES, page_size=PAGE_SIZE,
                               max_seqs=MAX_SEQS, max_len=MAX_LEN, dtype=dtype)
    dense = dense_cache.create(**sizes, max_seqs=MAX_SEQS, max_len=MAX_LEN, dtype=dtype)
    per_token = 2 * NUM_LAYERS * NUM_KV_HEADS * (HEAD_DIM * jnp.dtype(dtype).itemsize
                                                  + (4 if dtype == jnp.int8 else 0))
    assert paged.total_pages == NUM_PAGES and dense.total_pages == MAX_SEQS
    assert paged.kv_bytes_per_page == PAGE_SIZE * per_token
    assert dense.kv_bytes_per_page == MAX_LEN * per_token
    assert paged.kv_bytes_per_device == (NUM_PAGES + 1) * PAGE_SIZE * per_token  # + sentinel
    assert dense.kv_bytes_per_device == MAX_SEQS * MAX_LEN * per_token
