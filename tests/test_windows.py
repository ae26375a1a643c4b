"""Sliding-window layers (Mistral, Gemma 2 / 3) in every cache and attention path.

A model declares ``layer_windows`` (None: a global layer; ``w``: a query sees its last ``w``
keys, its own included, as HF's ``sliding_window``); the caches apply them per layer. Checked
here against a plain numpy oracle that keeps every row's whole K/V history: the paged cache
(XLA path: prefill query tiles, decode chunk lists with and without plan hints), the dense
twin and the cache-less full forward, on NaN-filled pools, ragged rows several windows long,
chunked prefill continuing a row, and a traced layer index (the model's layer scan).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxkv.attention.blocks import check_windows, layer_window
from paxkv.cache import dense as dense_cache
from paxkv.cache import paged as paged_cache
from paxkv.cache.full import NoCache
from paxkv.core.plan import AttentionPlan
from paxkv.core.step_info import StepInfo

PAGE, MAX_LEN, HEADS, KV_HEADS, DIM = 4, 40, 4, 2, 8
WINDOWS = (5, None, 3)  # three layers: a window over a page, a global layer, one under a page
ROWS = 4


def oracle(q: np.ndarray, keys: list[np.ndarray], values: list[np.ndarray],
           positions: np.ndarray, window: int | None) -> np.ndarray:
    """q ``[b, t, H, d]``; keys / values: each row's whole history ``[n_b, K, d]``; positions
    ``[b, t]`` (-1: padding) -> ``[b, t, H, d]`` (zeros for padding)."""
    out = np.zeros(q.shape, np.float64)
    group = HEADS // KV_HEADS
    for b in range(q.shape[0]):
        for t in range(q.shape[1]):
            p = positions[b, t]
            if p < 0:
                continue
            lo = 0 if window is None else max(0, p - window + 1)
            for h in range(HEADS):
                k = keys[b][lo:p + 1, h // group].astype(np.float64)
                v = values[b][lo:p + 1, h // group].astype(np.float64)
                s = k @ q[b, t, h] * DIM ** -0.5
                w = np.exp(s - s.max())
                out[b, t, h] = (w / w.sum()) @ v
    return out


attend = jax.jit(lambda cache, layer, q, k, v, step: cache.attend(layer, q, k, v, step))
reserve = jax.jit(lambda cache, n: cache.reserve(n, max_new=12))


def _caches():
    paged = paged_cache.create(num_layers=len(WINDOWS), num_kv_heads=KV_HEADS, head_dim=DIM,
                               num_pages=ROWS * MAX_LEN // PAGE, page_size=PAGE,
                               max_seqs=ROWS, max_len=MAX_LEN, scrub=False,
                               fill=float("nan"), layer_windows=WINDOWS)
    dense = dense_cache.create(num_layers=len(WINDOWS), num_kv_heads=KV_HEADS, head_dim=DIM,
                               max_seqs=ROWS, max_len=MAX_LEN, fill=float("nan"),
                               layer_windows=WINDOWS)
    return {"paged": paged, "dense": dense}


def _run_steps(rng, caches, history, steps):
    """Feeds every step to every cache and layer; compares each with the oracle."""
    for num_new, width, plan in steps:
        num_new = np.asarray(num_new, np.int32)
        for name in caches:
            caches[name], ok = reserve(caches[name], num_new)
            assert bool(jnp.all(ok)), name
        lengths = np.asarray(caches["paged"].lengths)
        step = StepInfo.make(lengths, num_new, width, plan=plan)
        pos = np.asarray(step.positions)
        q = rng.standard_normal((len(WINDOWS), ROWS, width, HEADS, DIM)).astype(np.float32)
        k, v = (rng.standard_normal((len(WINDOWS), ROWS, width, KV_HEADS, DIM))
                .astype(np.float32) for _ in range(2))
        for layer, window in enumerate(WINDOWS):
            for b in range(ROWS):
                n = int(num_new[b])
                history[layer][0][b] = np.concatenate([history[layer][0][b], k[layer, b, :n]])
                history[layer][1][b] = np.concatenate([history[layer][1][b], v[layer, b, :n]])
            want = oracle(q[layer], *history[layer], pos, window)
            for name in caches:
                caches[name], out = attend(caches[name], jnp.int32(layer), q[layer], k[layer],
                                           v[layer], step)
                np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=2e-5,
                                           err_msg=f"{name}, layer {layer}, plan {plan}")


def test_window_layers_read_only_their_last_keys_in_paged_and_dense_caches():
    """Prompts of 0-3 windows plus chunked prefill and decode: every layer equals the oracle
    (NaN pools: a read outside what a row holds would poison the output)."""
    rng = np.random.default_rng(0)
    caches = _caches()
    history = [([np.zeros((0, KV_HEADS, DIM), np.float32)] * ROWS,
                [np.zeros((0, KV_HEADS, DIM), np.float32)] * ROWS) for _ in WINDOWS]
    history = [(list(a), list(b)) for a, b in history]
    chunks = AttentionPlan(decode_chunks=4)  # a chunk-count hint: fewer chunks than rows x width
    shared = AttentionPlan(prefix_pages=1)  # a (wrong) shared-prefix hint: must not be taken
    _run_steps(rng, caches, history, [
        ([12, 3, 1, 9], 12, AttentionPlan()),     # ragged prefill, up to 2.4 windows
        ([5, 12, 0, 7], 12, AttentionPlan()),     # chunked prefill continuing rows
        ([1, 1, 1, 1], 1, AttentionPlan()),       # decode
        ([1, 1, 1, 0], 1, chunks),
        ([1, 1, 1, 1], 1, shared),
    ])


def _poison_out_of_window(caches):
    """NaN into every page (paged) or slot (dense) that lies wholly before the window of the
    next step's first query in each window layer: what a released page may hold."""
    paged, dense = caches["paged"], caches["dense"]
    k, v = np.array(paged.pool.k), np.array(paged.pool.v)
    dk, dv = np.array(dense.k), np.array(dense.v)
    tables, lengths = np.asarray(paged.table.block_tables), np.asarray(paged.lengths)
    for layer, window in enumerate(WINDOWS):
        if window is None:
            continue
        for b in range(ROWS):
            first_needed = max(0, int(lengths[b]) - window + 1)  # next step's first query
            dead = first_needed // PAGE
            k[layer, tables[b, :dead]] = v[layer, tables[b, :dead]] = np.nan
            dk[layer, b, :, :first_needed] = dv[layer, b, :, :first_needed] = np.nan
    caches["paged"] = dataclasses.replace(
        paged, pool=dataclasses.replace(paged.pool, k=jnp.asarray(k), v=jnp.asarray(v)))
    caches["dense"] = dataclasses.replace(dense, k=jnp.asarray(dk), v=jnp.asarray(dv))


def test_pages_wholly_before_the_window_are_never_read():
    """A window layer may release the pages its queries can no longer see: NaN there (and in
    a dense row's slots before the window) must not reach any output."""
    rng = np.random.default_rng(2)
    caches = _caches()
    history = [([np.zeros((0, KV_HEADS, DIM), np.float32)] * ROWS,
                [np.zeros((0, KV_HEADS, DIM), np.float32)] * ROWS) for _ in WINDOWS]
    history = [(list(a), list(b)) for a, b in history]
    _run_steps(rng, caches, history, [([12, 10, 2, 12], 12, AttentionPlan()),
                                      ([9, 12, 0, 7], 12, AttentionPlan())])
    _poison_out_of_window(caches)
    _run_steps(rng, caches, history, [([1, 1, 1, 1], 1, AttentionPlan()),
                                      ([1, 1, 0, 1], 1, AttentionPlan(decode_chunks=4))])
    _poison_out_of_window(caches)
    _run_steps(rng, caches, history, [([3, 5, 2, 1], 5, AttentionPlan())])


def test_full_forward_applies_the_windows():
    rng = np.random.default_rng(1)
    t = 14
    q = rng.standard_normal((1, t, HEADS, DIM)).astype(np.float32)
    k, v = (rng.standard_normal((1, t, KV_HEADS, DIM)).astype(np.float32) for _ in range(2))
    step = StepInfo.make(np.array([t]), np.array([t]), t)
    for layer, window in enumerate(WINDOWS):
        _, out = NoCache(layer_windows=WINDOWS).attend(jnp.int32(layer), q, k, v, step)
        want = oracle(q, [k[0]], [v[0]], np.asarray(step.positions), window)
        np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=2e-5)


def test_the_window_follows_a_traced_layer_and_costs_nothing_without_windows():
    layers = jnp.arange(3)
    got = jax.jit(jax.vmap(lambda i: layer_window(WINDOWS, i)))(layers)
    assert got.tolist() == [5, 2 ** 30, 3]
    assert layer_window(None, jnp.int32(0)) is None
    assert layer_window((None, None), jnp.int32(0)) is None
    cache = paged_cache.create(num_layers=2, num_kv_heads=1, head_dim=8, num_pages=4,
                               page_size=4, max_seqs=1, max_len=8, layer_windows=(None, None))
    assert cache.layer_windows is None  # all-global: the plain path, no window term


@pytest.mark.parametrize("bad, why", [((4,), "2 layers"), ((0, None), ">= 1"),
                                      ((2.5, None), ">= 1"), ((True, None), ">= 1")])
def test_bad_windows_name_the_fix(bad, why):
    with pytest.raises(ValueError, match="layer_windows"):
        check_windows(bad, 2)
