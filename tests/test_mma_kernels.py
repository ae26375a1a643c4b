"""The tensor-core kernels (:mod:`pallas_kernels.tensor_cores`) against the jnp oracle in
interpret mode, their CUDA lowering under both Mosaic GPU semantics, the shape of the GPU
branch, the SMEM / register arithmetic, and the paged cache's ``attention_impl="pallas_mma"``.

On a GPU the same tests compile and run them for real (``INTERPRET`` is False there). Each case
packs the length edge cases (0, 1, page - 1, page, page + 1, long; two rows sharing a page)
into one batch on a NaN-poisoned pool: every slot no row may read is NaN.
"""

from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_pallas_kernels import (INTERPRET, Case, assert_rows_close, check_decode,
                                 lowered_attend, make_pool, ready)

from pallas_kernels import _interpret
from pallas_kernels.reference import (paged_decode_attention_reference,
                                      paged_prefill_attention_reference)
from pallas_kernels.tensor_cores import geometry
from pallas_kernels.tensor_cores.decode import paged_decode_attention_mma
from pallas_kernels.tensor_cores.prefill import paged_prefill_attention_mma
from paxkv.cache import paged as paged_cache
from paxkv.core.step_info import StepInfo


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    yield
    _interpret.reset_interpret_state()  # a kernel that raised leaves global state behind


CASES = [
    # group 1, 64-key pages, one split: the normalised path of a single split
    Case(1, 128, "bfloat16", page_size=64, kwargs=(("num_splits", 1), ("sm_scale", 0.3))),
    # two kv heads, 3 splits sharing each row's blocks (the 4-block row: 2 + 2 + an empty
    # split; short rows: one), poisoned == clean bit for bit
    Case(2, 64, "bfloat16", num_kv_heads=2, kwargs=(("num_splits", 3),
                                                    ("min_blocks_per_split", 1)),
         clean_run=True),
    # float16, 32-key pages, soft-capped scores, a 2-stage ring
    Case(4, 64, "float16", page_size=32, kwargs=(("num_splits", 2), ("logit_soft_cap", 4.0),
                                                 ("stages", 2), ("min_blocks_per_split", 1))),
    # group 8, 128-key stages of 8 pages, a 4-deep ring... at head_dim 64 (SMEM allows it)
    Case(8, 64, "bfloat16", kwargs=(("pages_per_block", 8), ("stages", 4))),
    # one page a stage (page 128, head_dim 128: 2 stages by default), automatic splits
    Case(8, 128, "bfloat16", page_size=128),
    # warp specialised: a producer warpgroup issues every copy, 2 splits
    Case(4, 128, "bfloat16", kwargs=(("producer", True), ("num_splits", 2),
                                     ("min_blocks_per_split", 1))),
]


def _run(q, pages, table, lengths, **kw):
    return ready(paged_decode_attention_mma(q, *pages, table, lengths, interpret=INTERPRET,
                                            **kw))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_mma_decode_matches_reference_on_poisoned_pages(case):
    check_decode(paged_decode_attention_mma, case)


def test_mma_decode_reads_its_layer_of_the_pool():
    case = Case(4, 64, "bfloat16")
    clean, poisoned, table, lengths = make_pool(2, case, [70, 5, 130])
    q = jax.random.normal(jax.random.key(3), (3, 4, 64), jnp.bfloat16)
    pool = [jnp.stack([jnp.full_like(x, jnp.nan), x, jnp.full_like(x, jnp.nan)])
            for x in poisoned]
    out = _run(q, pool, table, lengths, layer=jnp.int32(1), num_splits=2,
               min_blocks_per_split=1)
    ref = paged_decode_attention_reference(q, *clean, table, lengths)
    assert_rows_close(out, ref, "bfloat16", row_axes=(0, 1))


@pytest.mark.skipif(not INTERPRET, reason="the race detector is the CPU interpreter's")
@pytest.mark.parametrize("producer", [False, True], ids=["one-warpgroup", "producer"])
@pytest.mark.parametrize("stream_only", [False, True], ids=["decode", "stream"])
def test_the_ring_has_no_races_and_every_stage_is_awaited(stream_only, producer):
    """A 3-stage ring over 5 blocks of one split: every TMA write is ordered before its reads
    (with a producer warpgroup: after the consumer released the stage), and every barrier
    phase is awaited (the interpreter raises otherwise). Stream-only waits for the same
    copies and returns zeros."""
    case = Case(2, 64, "bfloat16")
    clean, _, table, lengths = make_pool(4, case, [300, 70])
    q = jax.random.normal(jax.random.key(5), (2, 2, 64), jnp.bfloat16)
    params = _interpret.InterpretGPUParams(detect_races=True)
    out = ready(paged_decode_attention_mma(q, *clean, table, lengths, num_splits=1, stages=3,
                                           stream_only=stream_only, producer=producer,
                                           interpret=params))
    assert not _interpret.races_found()
    if stream_only:
        assert not np.asarray(out, np.float32).any()
    else:
        ref = paged_decode_attention_reference(q, *clean, table, lengths)
        assert_rows_close(out, ref, "bfloat16", row_axes=(0, 1))


PREFILL_CASES = [
    # group 3 (SmolLM2's): 21 query tokens a program, one zero row; 16-key pages
    Case(3, 64, "bfloat16", num_kv_heads=2),
    # group 8 at head_dim 128, one 64-key page a stage
    Case(8, 128, "bfloat16", page_size=64),
    # group 1: 64 query tokens a program; float16, soft cap, a 2-stage ring
    Case(1, 64, "float16", page_size=32, kwargs=(("logit_soft_cap", 4.0), ("stages", 2))),
]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=str)
def test_mma_prefill_matches_reference_on_poisoned_pages(case):
    """(context, new tokens): empty, a first token, a whole prompt, chunks after a cached
    prefix (one crossing a page), 70 queries after 127 cached keys (several query blocks)."""
    s = case.page_size
    clean, poisoned, table, lengths = make_pool(0, case, [0, 1, s - 1, s, s + 9, 3 * 64 + 5])
    query_lengths = jnp.array([0, 1, s - 1, 5, 9, 70], jnp.int32)
    q = jax.random.normal(jax.random.key(1), (6, 70, case.num_kv_heads * case.group,
                                              case.head_dim), case.dtype)
    kw = dict(case.kwargs)
    out = ready(paged_prefill_attention_mma(q, *poisoned, table, lengths, query_lengths,
                                            interpret=INTERPRET, **kw))
    assert out.shape == q.shape and out.dtype == q.dtype
    for b, n in enumerate(np.asarray(query_lengths)):
        assert not np.asarray(out[b, n:], np.float32).any(), "padding queries must be zero"
    ref_kw = {k: v for k, v in kw.items() if k == "logit_soft_cap"}
    ref = paged_prefill_attention_reference(q, *clean, table, lengths, query_lengths, **ref_kw)
    assert_rows_close(out, ref, case.dtype, row_axes=(0, 1, 2))


@pytest.mark.skipif(not INTERPRET, reason="the race detector is the CPU interpreter's")
def test_the_prefill_ring_has_no_races():
    case = Case(4, 64, "bfloat16")
    clean, _, table, lengths = make_pool(4, case, [300, 70])
    q = jax.random.normal(jax.random.key(5), (2, 40, 4, 64), jnp.bfloat16)
    query_lengths = jnp.array([40, 3], jnp.int32)
    params = _interpret.InterpretGPUParams(detect_races=True)
    out = ready(paged_prefill_attention_mma(q, *clean, table, lengths, query_lengths,
                                            stages=3, interpret=params))
    assert not _interpret.races_found()
    ref = paged_prefill_attention_reference(q, *clean, table, lengths, query_lengths)
    assert_rows_close(out, ref, "bfloat16", row_axes=(0, 1, 2))


# ---------------------------------------------------------------- lowering and structure


def _shapes(dtype, group, head_dim, page_size, batch=4, kv_heads=2, max_pages=32):
    pages = jax.ShapeDtypeStruct((64, kv_heads, page_size, head_dim), dtype)
    return (jax.ShapeDtypeStruct((batch, kv_heads * group, head_dim), dtype), pages, pages,
            jax.ShapeDtypeStruct((batch, max_pages), jnp.int32),
            jax.ShapeDtypeStruct((batch,), jnp.int32))


LOWERINGS = {
    "bf16-g8-d128-ps16": (jnp.bfloat16, 8, 128, 16, {}),
    "bf16-g4-d64-ps16-st4-ppb8": (jnp.bfloat16, 4, 64, 16, dict(stages=4, pages_per_block=8)),
    "f16-g1-d128-ps64-softcap": (jnp.float16, 1, 128, 64, dict(logit_soft_cap=30.0)),
    "bf16-g2-d128-ps128": (jnp.bfloat16, 2, 128, 128, {}),
    "bf16-g8-d64-ps32-stream": (jnp.bfloat16, 8, 64, 32, dict(stream_only=True)),
    "bf16-g4-d128-ps16-producer": (jnp.bfloat16, 4, 128, 16, dict(producer=True)),
    "bf16-g8-d64-ps64-stream-producer": (jnp.bfloat16, 8, 64, 64,
                                         dict(stream_only=True, producer=True)),
}


@pytest.mark.parametrize("semantics", ["lane", "warpgroup"])
@pytest.mark.parametrize("group,head_dim,page_size", [(3, 64, 16), (8, 128, 16), (1, 128, 128)])
def test_prefill_lowers_for_cuda_under_both_semantics(group, head_dim, page_size, semantics):
    q, k, v, table, lengths = _shapes(jnp.bfloat16, group, head_dim, page_size)
    q = jax.ShapeDtypeStruct((q.shape[0], 100) + q.shape[1:], q.dtype)
    fn = jax.jit(lambda *a: paged_prefill_attention_mma(*a, semantics=semantics))
    lowered = fn.trace(q, k, v, table, lengths, lengths).lower(lowering_platforms=("cuda",))
    assert f"paged_prefill_mma_bq{64 // group}" in lowered.as_text(debug_info=True)


@pytest.mark.parametrize("semantics", ["lane", "warpgroup"])
@pytest.mark.parametrize("name", LOWERINGS)
def test_lowers_for_cuda_under_both_semantics(name, semantics):
    """Lowering runs Mosaic GPU's layout, WGMMA and TMA checks (PTX needs a GPU); jax 0.10
    lowers with Lane semantics by default and 0.11 with Warpgroup, so both are held."""
    dtype, group, head_dim, page_size, kw = LOWERINGS[name]
    fn = jax.jit(lambda *a: paged_decode_attention_mma(*a, semantics=semantics, **kw))
    lowered = fn.trace(*_shapes(dtype, group, head_dim, page_size)).lower(
        lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
    kind = ("paged_stream" if kw.get("stream_only") else "paged_decode_mma") + (
        "_ws" if kw.get("producer") else "_ppb")
    assert kind in lowered.as_text(debug_info=True), "name= carries the kernel and its tiles"


def _kernel_eqns(interpret: bool, **kw) -> list:
    """Every equation of the kernel body (nested jaxprs included)."""
    jaxpr = jax.make_jaxpr(lambda *a: paged_decode_attention_mma(*a, interpret=interpret,
                                                                 **kw))(
        *_shapes(jnp.bfloat16, 4, 64, 16))

    def walk(j, out):
        for e in j.eqns:
            out.append(e)
            for p in e.params.values():
                for sub in p if isinstance(p, (list, tuple)) else [p]:
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner, out)
        return out

    return walk(jaxpr.jaxpr, [])


@pytest.mark.parametrize("producer", [False, True])
def test_the_gpu_branch_runs_both_contractions_on_wgmma_with_k_read_transposed(producer):
    """Per block: two WGMMAs, ``Q @ K^T`` reading the stage through a transposed view and
    ``P @ V`` the stage as it is; no transpose is computed. Interpreted, the only change is
    K's transpose written to a scratch first (:func:`pallas_kernels._stream.keys_for_scores`)."""
    gpu = _kernel_eqns(False, producer=producer)
    mma = [e for e in gpu if e.primitive.name == "wgmma_ref"]
    assert len(mma) == 2
    transposed = [bool(re.search("Transpose", str(e.params["b_transforms_tree"]))) for e in mma]
    assert transposed == [True, False]
    names = collections.Counter(e.primitive.name for e in gpu)
    assert names["transpose"] == 0
    cpu = collections.Counter(e.primitive.name for e in _kernel_eqns(True))
    assert cpu["wgmma_ref"] == 2 and cpu["transpose"] == 1


@pytest.mark.parametrize("splits", [1, 4])
def test_one_split_writes_the_normalised_output_itself(splits):
    """One split: the kernel's one output is ``[b, kv_heads, group_pad, d]`` in q's dtype
    (no partials, no combine); more: float32 partials and their statistics."""
    eqns = _kernel_eqns(False, num_splits=splits)
    call = next(e for e in eqns if e.primitive.name in ("pallas_call", "mpmd_map"))
    outs = [(v.aval.shape, v.aval.dtype) for v in call.outvars]
    stores = sum(e.primitive.name == "copy_smem_to_gmem" for e in eqns)
    assert stores == (1 if splits == 1 else 2)
    if splits == 1:
        assert outs == [((4, 2, 8, 64), jnp.dtype(jnp.bfloat16))]
    else:
        assert outs == [((4, 2, 4, 8, 64), jnp.dtype(jnp.float32)),
                        ((4, 2, 4, 2, 64), jnp.dtype(jnp.float32))]


# ---------------------------------------------------------------- budgets and refusals


def test_smem_and_register_budgets():
    """One program's SMEM: the K/V ring, Q and P in bf16, the float32 output and stats; the
    float32 score and output tiles' registers per thread of the warpgroup."""
    assert geometry.smem_bytes(64, 128, 3) == (2 * 3 * 64 * 128 * 2 + 64 * (128 + 64) * 2
                                                 + 64 * 130 * 4)
    assert geometry.tile_registers(64, 128) == 96  # 64 x (64 + 128) floats / 128 threads
    assert geometry.default_stages(64, 128) == 3
    assert geometry.default_stages(128, 128) == 2  # 3 stages of 128 keys do not fit
    refuse = geometry.mma_refusal
    assert refuse(jnp.bfloat16, 16, 128, 4, 3) is None
    assert "SMEM" in refuse(jnp.bfloat16, 128, 128, 1, 3)
    assert "registers" in refuse(jnp.bfloat16, 16, 128, 16, 2)  # [64, 256] scores
    assert "bfloat16 or float16" in refuse(jnp.float32, 16, 64, 4, 3)
    assert "bfloat16 or float16" in refuse(jnp.int8, 16, 64, 4, 3, scales=object())
    assert "window" in refuse(jnp.bfloat16, 16, 64, 4, 3, window=128)
    assert "multiple of 64" in refuse(jnp.bfloat16, 16, 64, 3, 3)
    assert "stages=5" in refuse(jnp.bfloat16, 16, 64, 4, 5)


def test_bad_input_names_the_fix():
    case = Case(2, 64, "float32")
    clean, _, table, lengths = make_pool(0, case, [20])
    q = jnp.zeros((1, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        paged_decode_attention_mma(q, *clean, table, lengths, interpret=True)
    bf = [x.astype(jnp.bfloat16) for x in clean]
    with pytest.raises(ValueError, match="semantics"):
        paged_decode_attention_mma(q.astype(jnp.bfloat16), *bf, table, lengths,
                                   semantics="lanes", interpret=True)
    with pytest.raises(ValueError, match="pages_per_block x page_size"):
        paged_decode_attention_mma(q.astype(jnp.bfloat16), *bf, table, lengths,
                                   pages_per_block=3, interpret=True)
    # a producer's block-table slice counts against SMEM: one split of a 64k-token table
    # (4,096 columns, 16 KiB) on top of four 64-key stages at head_dim 128 (189 KiB) is over
    long_table = jax.ShapeDtypeStruct((1, 4096), jnp.int32)
    pages = jax.ShapeDtypeStruct((8, 1, 16, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="producer=True needs .* more num_splits"):
        jax.eval_shape(lambda *a: paged_decode_attention_mma(
            *a, stages=4, num_splits=1, producer=True), jax.ShapeDtypeStruct(
                (1, 2, 128), jnp.bfloat16), pages, pages, long_table,
            jax.ShapeDtypeStruct((1,), jnp.int32))


# ---------------------------------------------------------------- through the paged cache


def _cache_decode(impl: str, dtype) -> tuple[np.ndarray, np.ndarray]:
    """Rows of 0, 17 and 70 cached tokens (written by one prefill step) decode one more
    through ``PagedCache.attend`` with ``attention_impl=impl`` -> (decode out, prefill out)."""
    cache = paged_cache.create(num_layers=2, num_kv_heads=2, head_dim=64, num_pages=16,
                               page_size=16, max_seqs=3, max_len=96, dtype=dtype,
                               attention_impl=impl, fill=jnp.nan, scrub=False)
    lengths = jnp.array([0, 17, 70], jnp.int32)
    cache, ok = cache.reserve(lengths + 1, max_new=96)
    assert bool(ok.all())
    keys = jax.random.split(jax.random.key(7), 6)
    normal = lambda key, shape: jax.random.normal(key, shape, dtype)  # noqa: E731
    prefill = StepInfo.make(lengths, lengths, 80)  # lengths after the step
    cache, pre = jax.jit(lambda c, q, k, v: c.attend(jnp.int32(1), q, k, v, prefill))(
        cache, normal(keys[0], (3, 80, 4, 64)), normal(keys[1], (3, 80, 2, 64)),
        normal(keys[2], (3, 80, 2, 64)))
    live = jnp.array([0, 1, 1], jnp.int32)
    decode = StepInfo.make(lengths + live, live, 1)
    _, out = jax.jit(lambda c, q, k, v: c.attend(jnp.int32(1), q, k, v, decode))(
        cache, normal(keys[3], (3, 1, 4, 64)), normal(keys[4], (3, 1, 2, 64)),
        normal(keys[5], (3, 1, 2, 64)))
    return np.asarray(ready(out), np.float32), np.asarray(pre, np.float32)


@pytest.mark.skipif(not INTERPRET, reason="interpret mode: the XLA twin runs on this backend")
def test_pallas_mma_cache_decodes_what_the_xla_path_does():
    """``attention_impl="pallas_mma"``: the cache's prefill and decode run the tensor-core
    kernels over its own pool (a traced layer, NaN in every free slot) and give the XLA path's
    outputs."""
    mma, mma_pre = _cache_decode("pallas_mma", jnp.float16)
    xla, xla_pre = _cache_decode("xla", jnp.float16)
    assert np.isfinite(mma).all() and np.isfinite(mma_pre).all()
    for b, n in ((1, 17), (2, 70)):  # each row's queries (the prefill kernel's rows)
        assert_rows_close(mma_pre[b, :n], xla_pre[b, :n], "float16", row_axes=(0, 1))
    assert_rows_close(mma[1:], xla[1:], "float16", row_axes=(0, 1, 2))


def test_pallas_mma_cache_lowers_decode_and_prefill_to_the_tensor_core_kernels(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # compile, bf16 as itself
    cache = paged_cache.create(num_layers=4, num_kv_heads=2, head_dim=64, num_pages=8,
                               page_size=16, max_seqs=2, max_len=64, dtype=jnp.bfloat16,
                               attention_impl="pallas_mma")
    assert "paged_decode_mma" in lowered_attend(cache, 1, debug_info=True)
    assert "paged_prefill_mma" in lowered_attend(cache, 16, debug_info=True)
