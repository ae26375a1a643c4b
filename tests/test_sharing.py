"""Shared pages on the real model: the prefix cache, forks and n samples change nothing but cost.

Every engine here is small (4 rows, prefill in chunks of 16, one row at a time) so the whole file
compiles a handful of shapes; every test ends with the index cleared and the pool all free.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paxkv
from paxkv.core.step_info import StepInfo

TEXT = ("The library opens at nine in the morning and closes at eight in the evening on weekdays. "
        "Members may borrow up to twelve items for three weeks and renew them twice online. "
        "Children under twelve need a parent or guardian to sign their card application. "
        "Quiet study rooms on the second floor can be booked for two hours at a time, and the "
        "reading garden is open from May to September whenever the weather allows it. Lost "
        "cards are replaced at the front desk for a small fee, and overdue fines are waived "
        "during the first week of every new year.")
QUESTIONS = ["When do you open?", "How many books can I borrow at once?", "Can I renew online?",
             "Where is the quiet room?", "What is a library card for?"]
SMALL = dict(max_seqs=4, max_len=128, prefill_chunk=16, prefill_tokens=16)


def engine(lm, page_size: int, prefix_cache: bool, **kw) -> paxkv.Engine:
    return paxkv.Engine(lm, page_size=page_size, prefix_cache=prefix_cache, **{**SMALL, **kw})


def assert_all_free(eng: paxkv.Engine) -> None:
    eng.clear_prefix_cache()
    assert int(eng.cache.free_pages()) == eng.cache.num_pages
    assert not bool(jnp.any(eng.cache.active))
    assert int(jnp.sum(eng.cache.lengths)) == 0


@functools.partial(jax.jit, static_argnames="forward")
def _peek(forward, params, cache, tokens, live):
    """Log-probs of every live row's next token, on a copy of the cache (not donated)."""
    cache, _ = cache.reserve(live.astype(jnp.int32), max_new=1)
    step = StepInfo.make(cache.lengths, live.astype(jnp.int32), 1)
    logits, _ = forward(params, tokens[:, None], step, cache)
    return jax.nn.log_softmax(logits, axis=-1)


def top5(lm, eng: paxkv.Engine) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Request id -> (top-5 next-token ids, their log-probs) for every decoding request."""
    live = np.array([r is not None and r.decoding for r in eng.table.rows])
    logp = np.asarray(_peek(lm.forward, lm.params, eng.cache,
                            jnp.asarray(eng.lifecycle.rows.last_tokens), jnp.asarray(live)))
    out = {}
    for row in np.flatnonzero(live):
        ids = np.argsort(-logp[row])[:5]
        out[eng.table.rows[row].id] = (ids, logp[row, ids])
    return out


def workload(lm, page_size: int, seed: int) -> list[list[int]]:
    """Four prompts over one text: p0 runs two pages on; p1 shares a prefix of it that ends
    mid-page (a partial-page hit), then asks its own question; p2 repeats p0 (fully cached);
    p3 is a shorter prefix."""
    rng = np.random.default_rng(seed)
    text, base = lm.encode(TEXT), max(page_size, 16)
    assert len(text) > 2 * base + 5, "TEXT is too short for this page size"
    prefix = text[: base + int(rng.integers(1, base))]
    p0 = text[: 2 * base + int(rng.integers(1, 6))]
    own = lm.encode(" " + QUESTIONS[int(rng.integers(len(QUESTIONS)))])
    return [p0, prefix + own[: int(rng.integers(3, 10))], list(p0),
            prefix[: len(prefix) - int(rng.integers(1, 6))]]


# 1: every token its own page; 16: partial-page hits and copy-on-write (32 ran too until
# 12-03: the same geometry at twice the prompt length)
@pytest.mark.parametrize("page_size", [1, 16])
def test_prefix_cache_changes_nothing_but_cost(lm, page_size):
    """Greedy tokens and every step's top-5 log-probs, sharing on vs off, two random
    workloads through the same pair of engines."""
    runs = {on: engine(lm, page_size, on) for on in (True, False)}
    for seed in (page_size, page_size + 100):
        _compare(lm, runs, workload(lm, page_size, seed), page_size)
    for e in runs.values():
        assert_all_free(e)


def _compare(lm, runs: dict[bool, paxkv.Engine], prompts: list[list[int]], page_size: int):
    before = {on: e.stats() for on, e in runs.items()}
    ids = {on: [e.submit(p, max_new_tokens=6) for p in prompts] for on, e in runs.items()}
    for _ in range(3):
        peeks = {}
        for on, e in runs.items():
            e.step()
            got = top5(lm, e)
            peeks[on] = {i: got[rid] for i, rid in enumerate(ids[on]) if rid in got}
        assert peeks[True].keys() == peeks[False].keys() and peeks[True]
        for i, (top_on, lp_on) in peeks[True].items():
            top_off, lp_off = peeks[False][i]
            np.testing.assert_array_equal(top_on, top_off)
            np.testing.assert_allclose(lp_on, lp_off, atol=1e-4)
    results = {on: e.run() for on, e in runs.items()}
    got = [[results[on][r].token_ids for r in ids[on]] for on in (True, False)]
    assert got[0] == got[1]
    cached = [results[True][r].num_cached_tokens for r in ids[True]]
    whole = len(prompts[2]) // page_size * page_size  # the repeat finds p0's full pages
    assert cached[0] == 0 and cached[2] == min(len(prompts[2]) - 1, whole)
    assert min(cached[1:]) > 0
    assert all(results[False][r].num_cached_tokens == 0 for r in ids[False])
    on, off = (runs[k].stats() for k in (True, False))
    assert on.prefix_hit_tokens - before[True].prefix_hit_tokens == sum(cached)
    assert on.cow_copies - before[True].cow_copies >= (page_size > 1)
    assert (on.prefill_tokens - before[True].prefill_tokens
            == off.prefill_tokens - before[False].prefill_tokens - sum(cached))
    runs[True].clear_prefix_cache()  # the next workload starts cold


def test_seeded_sampling_same_with_sharing(lm):
    prompts = workload(lm, 16, seed=3)
    kw = dict(max_new_tokens=8, temperature=0.8, top_k=40, top_p=0.95, seed=11)
    out = {}
    for on in (True, False):
        e = engine(lm, 16, on)
        rids = [e.submit(p, **kw) for p in prompts]
        res = e.run()
        out[on] = [res[r].token_ids for r in rids]
        assert_all_free(e)
    assert out[True] == out[False]


def test_n_samples_fork_one_prefill(lm):
    """n = 3: one prefill, three children; sample j equals a lone request with its key."""
    prompt = workload(lm, 16, seed=5)[0]
    kw = dict(max_new_tokens=8, temperature=0.9, seed=4)
    e = engine(lm, 16, False)
    rid = e.submit(prompt, n=3, **kw)
    res = e.run()[rid]
    assert len(res.samples) == 3 and res.token_ids == res.samples[0].token_ids
    assert len({tuple(s.token_ids) for s in res.samples}) > 1
    assert e.stats().prefill_tokens == len(prompt) - 1  # each child feeds the last token itself
    # Three writers of one partial page: two copy, the third keeps it.
    assert e.stats().cow_copies == (2 if (len(prompt) - 1) % 16 else 0)
    assert_all_free(e)
    alone = engine(lm, 16, False)
    parent_key = jax.random.fold_in(jax.random.PRNGKey(kw["seed"]), rid)
    kids = [alone.submit(prompt, key=jax.random.fold_in(parent_key, j), max_new_tokens=8,
                         temperature=0.9) for j in range(3)]
    lone = alone.run()
    assert [lone[k].token_ids for k in kids] == [s.token_ids for s in res.samples]
    assert_all_free(alone)


def test_cancel_returns_only_its_own_pages(lm):
    prompt = workload(lm, 16, seed=6)[1]
    kw = dict(max_new_tokens=12, temperature=0.9, seed=2)
    base = engine(lm, 16, False)
    rid = base.submit(prompt, n=3, **kw)
    baseline = base.run()[rid].samples
    assert_all_free(base)

    e = engine(lm, 16, False)
    rid = e.submit(prompt, n=3, **kw)
    for _ in range(3):
        e.step()
    kids = e.table.get(rid).children
    stats = e.stats()
    table = e.cache.table
    row = e.table.get(kids[1]).row
    held = -(-int(table.lengths[row]) // 16)
    pages = np.asarray(table.block_tables)[row, :held]
    alone = int(np.sum(np.asarray(table.ref_counts)[pages] == 1))
    assert stats.sequences[kids[1]].shared_pages == held - alone > 0
    assert stats.shared_pages > 0 and stats.row_references > stats.row_pages
    free = int(e.cache.free_pages())
    shared = pages[np.asarray(table.ref_counts)[pages] > 1]
    e.cancel(kids[1])
    assert int(e.cache.free_pages()) - free == alone
    assert np.all(np.asarray(e.cache.table.ref_counts)[shared] >= 1)  # still with the others
    samples = e.run()[rid].samples  # samples are handed out with their request
    assert samples[1].finish_reason == "cancelled"
    assert samples[0].token_ids == baseline[0].token_ids
    assert samples[2].token_ids == baseline[2].token_ids
    assert_all_free(e)


def test_explicit_prefix_is_prefilled_once_and_forked(lm):
    """submit_prefix + submit(prefix=...): no hashing; the partial last page is shared too."""
    p0, p1, _, prefix = workload(lm, 16, seed=9)
    own = [p0[len(prefix):], p1[len(prefix):] or [42], [42, 43, 44]]
    e = engine(lm, 16, False)
    pid = e.submit_prefix(prefix)
    rids = [e.submit(q, prefix=pid, max_new_tokens=5) for q in own]
    res = e.run()
    assert res[pid].finish_reason == "prefilled"
    assert all(res[r].num_cached_tokens == len(prefix) for r in rids)
    stats = e.stats()
    assert stats.prefill_tokens == len(prefix) + sum(map(len, own))
    assert stats.cow_copies == (len(own) if len(prefix) % 16 else 0)
    assert int(e.cache.free_pages()) == e.cache.num_pages - -(-len(prefix) // 16)  # held
    e.cancel(pid)
    assert_all_free(e)
    alone = engine(lm, 16, False)
    ids = [alone.submit(prefix + q, max_new_tokens=5) for q in own]
    lone = alone.run()
    assert [lone[i].token_ids for i in ids] == [res[r].token_ids for r in rids]
    assert_all_free(alone)


def test_salts_isolate_tenants_and_clear_frees_all(lm):
    prompt = workload(lm, 16, seed=7)[0]
    e = engine(lm, 16, True)
    first = e.submit(prompt, max_new_tokens=4, cache_salt="tenant-a")
    first_tokens = e.run()[first].token_ids
    assert e.stats().cached_pages > 0 and int(e.cache.free_pages()) < e.cache.num_pages
    other = e.submit(prompt, max_new_tokens=4, cache_salt="tenant-b")
    same = e.submit(prompt, max_new_tokens=4, cache_salt="tenant-a")
    res = e.run()
    assert res[other].num_cached_tokens == 0
    assert res[same].num_cached_tokens == min(len(prompt) - 1, len(prompt) // 16 * 16)
    assert first_tokens == res[other].token_ids == res[same].token_ids
    assert e.clear_prefix_cache() > 0
    assert_all_free(e)


def test_tree_of_thought_forks_without_prefill(lm):
    """Branch 2 x 2 with held nodes; leaves equal lone requests recomputed from scratch."""
    prompt = workload(lm, 16, seed=8)[1]
    e = engine(lm, 16, False)
    root = e.submit(prompt, max_new_tokens=3, temperature=0.9, seed=1, hold=True,
                    stop_token_ids=[])
    res = e.run()  # a held request is reported, and stays until forked or cancelled
    prefilled = e.stats().prefill_tokens
    mids = e.fork(root, 2, max_new_tokens=3, hold=True)
    res.update(e.run())
    leaves = [leaf for m in mids for leaf in e.fork(m, 2, max_new_tokens=3)]
    assert e.stats().sequences.keys() == set(leaves)
    keys = {leaf: e.table.get(leaf).key_data for leaf in leaves}
    prompts = {leaf: e.table.get(leaf).prompt_ids for leaf in leaves}
    e.cancel(leaves[3])  # prune one
    res.update(e.run())
    assert e.stats().prefill_tokens == prefilled  # nothing was prefilled again
    assert res[root].finish_reason == "length" and res[leaves[3]].finish_reason == "cancelled"
    assert_all_free(e)
    lone = engine(lm, 16, False)
    for leaf in leaves[:3]:
        rid = lone.submit(prompts[leaf], max_new_tokens=3, temperature=0.9,
                          key=jnp.asarray(keys[leaf]), stop_token_ids=[])
        assert lone.run()[rid].token_ids == res[leaf].token_ids
    assert_all_free(lone)


@pytest.mark.slow
def test_fifty_users_share_one_system_prompt(lm):
    """50 users x (1,000 shared + 20-40 own tokens): memory and prefill work of one prompt."""
    rng = np.random.default_rng(0)
    text = lm.encode(" ".join([TEXT] * 40))
    system = text[:1000]
    own = [[int(t) for t in rng.integers(100, 20000, int(rng.integers(20, 41)))]
           for _ in range(50)]
    new, ps = 2, 16
    e = paxkv.Engine(lm, max_seqs=50, max_len=1056, page_size=ps, num_pages=320,
                     prefix_cache=True)
    rids = [e.submit(system + q, max_new_tokens=new, stop_token_ids=[]) for q in own]
    res = e.run()
    stats = e.stats()
    shared = -(-len(system) // ps)
    unique = sum(-(-(len(system) + len(q) + new) // ps) - len(system) // ps for q in own)
    assert e.stats().peak_pages_used <= 1.1 * (shared + unique), (e.stats().peak_pages_used, shared, unique)
    assert stats.prefill_tokens <= len(system) + sum(len(q) for q in own) + 50
    assert all(res[r].num_cached_tokens >= len(system) for r in rids[1:])
    assert_all_free(e)
