"""Cascade attention: pages every row shares are read once, and the result is unchanged.

``attend_blocks_with_prefix`` must equal ``attend_blocks`` over the concatenated keys; the
paged cache must take that path only when its ``prefix_pages`` hint holds in the step (every
live row's first columns are the same pages, every query after them), and attend per row
otherwise; the engine must produce the same tokens with the hint as without.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paxkv
from paxkv.attention import blocks, chunked, partials
from paxkv.cache import paged as paged_cache
from paxkv.core import buckets
from paxkv.cache import paged_xla
from paxkv.core import plan as attention_plan
from paxkv.core.plan import AttentionPlan
from paxkv.core.step_info import StepInfo

# Scores of std ~3.6 (queries at scale 3, head_dim 16, sm_scale 0.3): a soft-cap of 5 bends
# most of them, so ignoring it cannot pass.
SM_SCALE, SOFT_CAP, Q_SCALE = 0.3, 5.0, 3.0


def _rel_err(out: jax.Array, want: jax.Array) -> float:
    out, want = np.asarray(out, np.float32), np.asarray(want, np.float32)
    err = np.linalg.norm(out - want, axis=-1) / np.maximum(np.linalg.norm(want, axis=-1), 1e-6)
    return float(err.max())


CASES = [  # (batch, q_len, kv_heads, group, prefix_pages, page_size, rest_blocks, dtype)
    (5, 1, 2, 3, 3, 4, 4, jnp.float32),
    (3, 4, 1, 1, 1, 8, 2, jnp.float32),
    (4, 1, 3, 2, 2, 16, 3, jnp.bfloat16),
]


@pytest.mark.parametrize("cap", [None, SOFT_CAP], ids=["uncapped", "capped"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:7])))
def test_prefix_attention_equals_attention_over_all_keys(case, cap):
    """Both parts (shared pages, each row's own) take the scale and the soft-cap."""
    b, t, kvh, g, p, ps, m, dtype = case
    rng = np.random.default_rng(sum(case[:7]))
    d, prefix = 16, p * ps

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    q = (Q_SCALE * normal(b, t, kvh * g, d)).astype(dtype)
    k_prefix, v_prefix = normal(p, kvh, ps, d), normal(p, kvh, ps, d)
    k_rest, v_rest = normal(b, m, kvh, ps, d), normal(b, m, kvh, ps, d)
    lengths = rng.integers(prefix + t, prefix + m * ps + 1, b).astype(np.int32)
    lengths[0] = prefix + t  # nothing of its own before its queries
    q_len = np.full(b, t, np.int32)
    q_len[-1] = 1  # a shorter row: its other queries are padding
    pos = lengths[:, None] - q_len[:, None] + np.arange(t)[None]
    pos = np.where(np.arange(t)[None] < q_len[:, None], pos, -1).astype(np.int32)
    # Keys past each row's length are NaN: a stray read would poison the output.
    key = prefix + np.arange(m * ps).reshape(m, ps)
    dead = (key[None] >= lengths[:, None, None])[:, :, None, :, None]
    k_rest = jnp.where(dead, jnp.nan, k_rest).astype(dtype)
    v_rest = jnp.where(dead, jnp.nan, v_rest).astype(dtype)

    out = blocks.attend_blocks_with_prefix(q, k_prefix, v_prefix, k_rest, v_rest,
                                           jnp.asarray(pos), jnp.asarray(lengths),
                                           sm_scale=SM_SCALE, logit_soft_cap=cap)
    # The oracle: the prefix as every row's first blocks, then its own.
    tile = lambda x: jnp.broadcast_to(x[None], (b, *x.shape))  # noqa: E731
    k_all = jnp.concatenate([tile(k_prefix), k_rest], axis=1)
    v_all = jnp.concatenate([tile(v_prefix), v_rest], axis=1)
    oracle = functools.partial(blocks.attend_blocks, q, k_all, v_all, jnp.asarray(pos),
                               jnp.asarray(lengths), sm_scale=SM_SCALE)
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all()
    assert not out[-1, 1:].any(), "padding queries are zero"
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    assert _rel_err(out, oracle(logit_soft_cap=cap)) <= tol
    if cap is not None:
        assert _rel_err(out, oracle()) > 0.1, "the cap must change the output"


@pytest.mark.parametrize("cap", [None, SOFT_CAP], ids=["uncapped", "capped"])
def test_shared_pages_partials_are_attention_over_the_prefix(cap):
    """``attend_shared_pages`` (the cascade's shared part, prefill and decode) finished ==
    ``attend_blocks`` over the prefix pages alone, all visible, with the same settings;
    queries that are not live get empty partials."""
    rng = np.random.default_rng(7)
    n, kvh, g, p, ps, d = 5, 2, 3, 3, 4, 16
    q = jnp.asarray(Q_SCALE * rng.standard_normal((n, kvh, g, d)), jnp.float32)
    k_prefix, v_prefix = (jnp.asarray(rng.standard_normal((p, kvh, ps, d)), jnp.float32)
                          for _ in range(2))
    live = np.ones(n, bool)
    live[3] = False
    parts = partials.Partial(*blocks.attend_shared_pages(q, k_prefix, v_prefix, jnp.asarray(live),
                                                        sm_scale=SM_SCALE, logit_soft_cap=cap))
    out = np.asarray(partials.finish(parts, jnp.float32))  # [n, heads, d]
    # The oracle: each query as a one-row batch at the prefix's end, over the prefix's pages.
    oracle = functools.partial(
        blocks.attend_blocks, q.reshape(n, 1, kvh * g, d),
        jnp.broadcast_to(k_prefix[None], (n, p, kvh, ps, d)),
        jnp.broadcast_to(v_prefix[None], (n, p, kvh, ps, d)),
        jnp.full((n, 1), p * ps, jnp.int32), jnp.full(n, p * ps, jnp.int32), sm_scale=SM_SCALE)
    want = np.asarray(oracle(logit_soft_cap=cap))[:, 0]
    assert not out[3].any() and np.isneginf(np.asarray(parts.max)[3]).all()
    assert _rel_err(out[live], want[live]) <= 1e-5
    if cap is not None:
        assert _rel_err(out[live], np.asarray(oracle())[live, 0]) > 0.1


# -- the cache: the hint is checked inside the step ---------------------------------------

PS, PROMPT, ROWS = 4, 11, 4  # an 11-token prompt: 2 full pages + a partial one


def _forked_cache(share_all: bool) -> paged_cache.PagedCache:
    """Row 0 holds PROMPT tokens of random K/V; rows 1-2 are forks of it; row 3 is a fork too
    (``share_all``) or holds its own pages with the same length."""
    cache = paged_cache.create(num_layers=1, num_kv_heads=2, head_dim=8, num_pages=24,
                               page_size=PS, max_seqs=ROWS, max_len=24)
    cache, ok = cache.reserve(jnp.array([PROMPT, 0, 0, 0 if share_all else PROMPT]),
                              max_new=PROMPT)
    assert bool(ok.all())
    rng = np.random.default_rng(0)
    pool = cache.pool
    pool = type(pool)(k=jnp.asarray(rng.standard_normal(pool.k.shape), pool.k.dtype),
                      v=jnp.asarray(rng.standard_normal(pool.v.shape), pool.v.dtype))
    cache = cache.__class__(pool=pool, table=cache.table)
    children = [1, 2, 3] if share_all else [1, 2]
    cache, ok = cache.fork(jnp.zeros(len(children), jnp.int32), jnp.array(children, jnp.int32))
    assert bool(ok.all())
    cache, ok = cache.reserve(jnp.ones(ROWS, jnp.int32), max_new=1)  # copy-on-write page 2
    assert bool(ok.all())
    return cache


def _decode_outputs(cache: paged_cache.PagedCache, prefix_pages: int) -> np.ndarray:
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((ROWS, 1, 6, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((ROWS, 1, 2, 8)), jnp.float32)
    step = StepInfo.make(cache.lengths, jnp.ones(ROWS, jnp.int32), 1,
                         plan=AttentionPlan(prefix_pages=prefix_pages))
    attend = jax.jit(lambda c, q, k: c.attend(0, q, k, k, step)[1])  # a fresh trace per call
    return np.asarray(attend(cache, q, k))


@pytest.mark.parametrize("share_all", [True, False], ids=["shared", "one-row-differs"])
def test_cache_takes_the_cascade_only_when_the_hint_holds(monkeypatch, share_all):
    cache = _forked_cache(share_all)
    per_row = _decode_outputs(cache, 0)
    np.testing.assert_allclose(_decode_outputs(cache, 2), per_row, rtol=1e-5, atol=1e-6)
    # Poison the shared pages' partials to see which branch ran: NaN iff the cascade did.
    real = paged_xla._shared_partial
    monkeypatch.setattr(paged_xla, "_shared_partial",
                        lambda *a, **kw: jax.tree.map(lambda x: x * jnp.nan, real(*a, **kw)))
    marked = _decode_outputs(cache, 2)
    if share_all:
        assert np.isnan(marked).all(), "the hint holds: the cascade must run"
    else:
        np.testing.assert_allclose(marked, per_row, rtol=1e-5, atol=1e-6)
    # A hint past the queries (prefix pages the step's tokens fall inside) never cascades.
    np.testing.assert_allclose(_decode_outputs(cache, 3), per_row, rtol=1e-5, atol=1e-6)


def test_prefix_bucket_rounds_down_to_few_shapes():
    assert [buckets.prefix_bucket(n) for n in (0, 1, 2, 3, 5, 7, 11, 25, 47, 100)] == [
        0, 1, 2, 3, 4, 6, 8, 24, 32, 96]
    assert all(buckets.prefix_bucket(n) <= n for n in range(300))


def test_engine_tokens_equal_with_and_without_the_hint(lm, monkeypatch):
    """Six users of one system prompt through the prefix cache: the engine hints the shared
    pages (asserted) in the Python loop and the jitted one, and greedy tokens equal a run with
    the hint switched off."""
    system = ("You are a careful assistant for a team of engineers. Answer in one short "
              "sentence, use plain words, and say so when you do not know the answer.")
    prompts = [lm.chat_prompt([{"role": "system", "content": system},
                               {"role": "user", "content": q}])
               for q in ("What is a page table?", "Name a prime.", "Why is the sky blue?",
                         "Say hi.", "What is 2 + 2?", "Define entropy.")]
    kw = dict(max_new_tokens=8, max_seqs=8, page_size=8, prefix_cache=True)
    hints: list[int] = []
    real = attention_plan.shared_prefix_pages
    monkeypatch.setattr(attention_plan, "shared_prefix_pages",
                        lambda rows, ps: hints.append(real(rows, ps)) or hints[-1])
    hinted = paxkv.generate(lm, prompts, **kw)
    assert max(hints) >= 3, hints
    del hints[:]
    hinted_jit = paxkv.generate(lm, prompts, loop="jit", **kw)  # one hint for the whole loop
    assert max(hints) >= 3, hints
    monkeypatch.setattr(attention_plan, "shared_prefix_pages", lambda rows, ps: 0)
    plain = paxkv.generate(lm, prompts, **kw)
    assert [r.token_ids for r in hinted] == [r.token_ids for r in plain]
    assert [r.token_ids for r in hinted_jit] == [r.token_ids for r in plain]
