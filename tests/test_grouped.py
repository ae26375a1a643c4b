"""The layer-grouped paged cache: window groups release their pages inside the jitted step.

Against the plain paged cache with the same windows (which keeps every page and only masks)
and the numpy oracle of ``test_windows``: the same outputs for every layer through ragged
prefill, chunked prefill, decode, fork (shared pages in every group), reorder and release, on
NaN-filled unscrubbed pools; a window group's rows never hold more than the bound, pages it
drops are reused by the same jitted reservation, and every page comes back at the end.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxkv.cache import grouped, layer_groups
from paxkv.cache import paged as paged_cache
from paxkv.cache.layer_groups import LayerGroups
from paxkv.core.step_info import StepInfo
from paxkv.table import page_table as pt
from test_windows import DIM, HEADS, KV_HEADS, oracle

PAGE, MAX_LEN, ROWS = 4, 48, 4
WINDOWS = (6, None, 6, 3)  # group 0: layer 1 (global); window 3: layer 3; window 6: 0, 2
STEP = 12  # the widest step of the test (sizes the window groups)


def _pair(fill=float("nan")):
    kw = dict(num_layers=len(WINDOWS), num_kv_heads=KV_HEADS, head_dim=DIM, page_size=PAGE,
              max_seqs=ROWS, max_len=MAX_LEN, layer_windows=WINDOWS, fill=fill, scrub=False,
              num_pages=ROWS * MAX_LEN // PAGE)
    return {"grouped": grouped.create(step_tokens=STEP, **kw), "whole": paged_cache.create(**kw)}


reserve = jax.jit(lambda c, n: c.reserve(n, max_new=STEP))
attend = jax.jit(lambda c, layer, q, k, v, step: c.attend(layer, q, k, v, step))
fork = jax.jit(lambda c, p, ch: c.fork(p, ch))
reorder = jax.jit(lambda c, p: c.reorder(p))
release = jax.jit(lambda c, rows: c.release(rows))


class History:
    """Every row's K/V of every layer, as the oracle reads them."""

    def __init__(self):
        empty = np.zeros((0, KV_HEADS, DIM), np.float32)
        self.k = [[empty] * ROWS for _ in WINDOWS]
        self.v = [[empty] * ROWS for _ in WINDOWS]

    def fork(self, parents, children):
        for layer in range(len(WINDOWS)):
            for p, c in zip(parents, children):
                self.k[layer][c], self.v[layer][c] = self.k[layer][p], self.v[layer][p]

    def reorder(self, parents):
        for layer in range(len(WINDOWS)):
            self.k[layer] = [self.k[layer][p] for p in parents]
            self.v[layer] = [self.v[layer][p] for p in parents]


def _step(rng, caches, hist, num_new, width):
    num_new = np.asarray(num_new, np.int32)
    for name in caches:
        caches[name], ok = reserve(caches[name], num_new)
        assert bool(jnp.all(ok | (num_new == 0))), name
    step = StepInfo.make(np.asarray(caches["whole"].lengths), num_new, width)
    q = rng.standard_normal((len(WINDOWS), ROWS, width, HEADS, DIM)).astype(np.float32)
    k, v = (rng.standard_normal((len(WINDOWS), ROWS, width, KV_HEADS, DIM)).astype(np.float32)
            for _ in range(2))
    for layer, window in enumerate(WINDOWS):
        for b in range(ROWS):
            n = int(num_new[b])
            hist.k[layer][b] = np.concatenate([hist.k[layer][b], k[layer, b, :n]])
            hist.v[layer][b] = np.concatenate([hist.v[layer][b], v[layer, b, :n]])
        want = oracle(q[layer], hist.k[layer], hist.v[layer], np.asarray(step.positions),
                      window)
        for name in caches:
            caches[name], out = attend(caches[name], jnp.int32(layer), q[layer], k[layer],
                                       v[layer], step)
            np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=2e-5,
                                       err_msg=f"{name}, layer {layer}")


def _assert_window_groups_hold_at_most_their_bound(cache):
    for table, window in zip(cache.tables, cache.groups.windows):
        if window is None:
            continue
        held = np.asarray(pt.pages_referenced(table))
        bound = layer_groups.window_pages_per_row(window, PAGE, STEP, MAX_LEN)
        assert held.max() <= bound, (window, held, bound)
        refs = np.zeros(table.num_pages, np.int64)  # a recount of the cells: no leak
        for cell in np.asarray(table.block_tables).ravel():
            if cell < table.num_pages:
                refs[cell] += 1
        np.testing.assert_array_equal(np.asarray(table.ref_counts), refs)


def test_grouped_cache_equals_the_whole_cache_and_keeps_only_window_pages():
    rng = np.random.default_rng(0)
    caches, hist = _pair(), History()
    _step(rng, caches, hist, [12, 5, 0, 9], 12)
    _step(rng, caches, hist, [12, 12, 0, 3], 12)
    caches["grouped"], ok = fork(caches["grouped"], np.array([0]), np.array([2]))
    caches["whole"], _ = fork(caches["whole"], np.array([0]), np.array([2]))
    assert bool(ok[0])
    hist.fork([0], [2])
    for _ in range(6):
        _step(rng, caches, hist, [1, 1, 1, 1], 1)
        _assert_window_groups_hold_at_most_their_bound(caches["grouped"])
    parents = np.array([2, 1, 2, 3], np.int32)  # beam reorder: row 0 follows row 2
    for name in caches:
        caches[name], _ = reorder(caches[name], parents)
    hist.reorder(parents)
    _step(rng, caches, hist, [1, 1, 1, 1], 1)
    _step(rng, caches, hist, [5, 0, 2, 7], 8)
    _assert_window_groups_hold_at_most_their_bound(caches["grouped"])
    g, w = caches["grouped"], caches["whole"]
    assert int(g.layer_pages_used()) < 0.8 * int(jnp.sum(w.table.ref_counts > 0)) * len(WINDOWS)
    for name in caches:
        caches[name], _ = release(caches[name], np.ones(ROWS, bool))
    assert all(int(jnp.sum(t.ref_counts)) == 0 for t in caches["grouped"].tables)


def test_window_pages_are_released_in_the_step_and_reused_by_the_next_reservation():
    """One row decoding far past its window through a window group of exactly the bound: it
    runs only if each jitted step's reservation gets the pages the window left behind."""
    bound = layer_groups.window_pages_per_row(3, PAGE, 1, MAX_LEN)
    cache = grouped.create(num_layers=2, num_kv_heads=1, head_dim=8, page_size=PAGE,
                           max_seqs=1, max_len=MAX_LEN, layer_windows=(None, 3),
                           num_pages=MAX_LEN // PAGE, step_tokens=1, window_pages=bound)
    one = jax.jit(lambda c: c.reserve(jnp.ones((1,), jnp.int32), max_new=1))
    for t in range(MAX_LEN):
        cache, ok = one(cache)
        assert bool(ok[0]), f"token {t}: the window group ran dry"
    window = cache.tables[1]
    assert int(jnp.sum(window.ref_counts > 0)) <= bound < MAX_LEN // PAGE
    assert int(cache.tables[0].ref_counts.sum()) == MAX_LEN // PAGE


def test_reservation_is_all_or_nothing_across_groups():
    """A row the global group cannot serve leaves every group's table as it was (but for the
    pages its window group may drop: they are out of every window either way)."""
    cache = grouped.create(num_layers=2, num_kv_heads=1, head_dim=8, page_size=PAGE,
                           max_seqs=2, max_len=MAX_LEN, layer_windows=(None, 3),
                           num_pages=3, step_tokens=8)
    cache, ok = reserve(cache, np.array([8, 8], np.int32))  # 2 + 2 global pages: row 1 fails
    assert ok.tolist() == [True, False]
    assert [int(t.lengths[1]) for t in cache.tables] == [0, 0]
    assert [int(jnp.sum(t.block_tables[1] < t.num_pages)) for t in cache.tables] == [0, 0]


def test_layer_groups_map_layers_to_flat_ranges():
    groups = LayerGroups.of((6, None, 6, 3), {None: 10, 3: 4, 6: 5})
    assert groups.windows == (None, 3, 6)
    assert groups.members == ((1,), (3,), (0, 2))
    assert groups.layer_base == (16, 0, 22, 11)
    assert groups.flat_pages == 11 + 5 + 6 + 6
    assert groups.layer_windows == (6, None, 6, 3)


def test_create_names_what_to_change():
    kw = dict(num_layers=2, num_kv_heads=1, head_dim=8, page_size=PAGE, max_seqs=1,
              max_len=8, num_pages=2)
    with pytest.raises(ValueError, match="no window"):
        grouped.create(layer_windows=(None, None), **kw)
    with pytest.raises(ValueError, match="layer_windows"):
        grouped.create(layer_windows=(3,), **kw)


def test_engine_serves_a_window_model_from_the_grouped_cache():
    """``Engine(cache="paged")`` on a model with window layers builds the grouped cache
    (prefix cache off); ragged prompts several windows long, chunked prefill, ``n=2``
    samples, a fork and a cancel give the tokens of an engine whose cache keeps every page,
    greedy tokens equal the cache-less forward's argmax, and every page of every group is
    free at the end."""
    import paxkv  # noqa: PLC0415
    from tiny import full_logits, tiny_lm  # noqa: PLC0415

    lm = tiny_lm(scale=1.0, windows=(6, None, 5))
    sizes = dict(prefill_chunk=8, prefill_tokens=16)
    engine = paxkv.Engine(lm, max_seqs=4, max_len=64, page_size=4, prefix_cache=False,
                          **sizes)
    assert isinstance(engine.cache, grouped.GroupedPagedCache)
    whole = paged_cache.create(num_layers=3, num_kv_heads=1, head_dim=16, num_pages=64,
                               page_size=4, max_seqs=4, max_len=64,
                               layer_windows=lm.layer_windows)
    twin = paxkv.Engine(lm, cache=whole, prefix_cache=False, **sizes)
    results, stats = [], []
    for e in (engine, twin):
        ids = [e.submit(list(range(10, 10 + n)), max_new_tokens=10, stop_token_ids=[])
               for n in (3, 17, 30)]
        ids.append(e.submit([7, 8, 9] * 6, max_new_tokens=6, stop_token_ids=[], n=2,
                            temperature=1.0, seed=3))
        for _ in range(3):
            e.step()
        mid = e.stats()
        kids = e.fork(ids[1], 2)
        e.cancel(ids[2])
        out = e.run()
        results.append([out[i].token_ids for i in ids[:2] + kids if i in out]
                       + [[s.token_ids for s in out[ids[3]].samples]])
        tables = e.cache.tables if e is engine else (e.cache.table,)
        assert all(int(jnp.sum(t.ref_counts)) == 0 for t in tables)
        end = e.stats()
        assert end.kv_bytes_used == 0 and end.peak_kv_bytes_used >= mid.kv_bytes_used > 0
        stats.append(mid)
    assert results[0] == results[1]
    grouped_mid, whole_mid = stats
    assert [(g.window, g.layers) for g in grouped_mid.groups] == [(None, 1), (5, 1), (6, 1)]
    assert [(g.window, g.layers) for g in whole_mid.groups] == [(None, 3)]
    # the window groups hold a few pages a row; every layer of the whole cache holds them all
    assert grouped_mid.kv_bytes_used < whole_mid.kv_bytes_used
    assert sum(g.used_pages * g.layers for g in grouped_mid.groups) * \
        engine.cache.layer_page_bytes == grouped_mid.kv_bytes_used
    prompt = list(range(10, 27))
    greedy = paxkv.generate(lm, [prompt], max_new_tokens=8, stop_token_ids=[])[0].token_ids
    seq = prompt + greedy
    want = full_logits(lm, seq)[len(prompt) - 1:-1].argmax(-1).tolist()
    assert greedy == want


def test_beam_search_on_a_window_model_runs_the_grouped_cache(monkeypatch) -> None:
    """``beam_search`` on a model with window layers searches over the layer-grouped cache
    (window pages released as the beams move on: fork, reorder and release per group) and
    finds the beams and scores of the same search over a cache that keeps every layer's
    pages and masks the windows."""
    import paxkv  # noqa: PLC0415
    from paxkv.decoding import beam_search as bs  # noqa: PLC0415
    from tiny import tiny_lm  # noqa: PLC0415

    lm = tiny_lm(scale=1.0, windows=(6, None, 5))
    prompts = [list(range(10, 40)), list(range(60, 81))]
    made = []
    original = bs._make_cache

    def spy(*args, **kw):
        made.append(original(*args, **kw))
        return made[-1]

    monkeypatch.setattr(bs, "_make_cache", spy)
    kw = dict(beam_width=3, max_new_tokens=12, stop_token_ids=[], page_size=4)
    windowed = paxkv.beam_search(lm, prompts, **kw)
    assert isinstance(made[-1], grouped.GroupedPagedCache)
    monkeypatch.setattr(bs, "_make_cache", lambda cache, mesh, num_pages, page_size, impl,
                        tokens, rows, **dims: paged_cache.create(
                            num_pages=num_pages, page_size=page_size, **dims))
    whole = paxkv.beam_search(lm, prompts, **kw)
    for a, b in zip(windowed, whole):
        assert [x.token_ids for x in a] == [x.token_ids for x in b]
        np.testing.assert_allclose([x.score for x in a], [x.score for x in b], atol=1e-5)
