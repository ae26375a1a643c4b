"""paxkv.score: shared (fork) == unshared == dense == the cache-less forward, the pool free after
every call, copy-on-write copies as the fork pattern predicts, bad input, rolling windows as
lm-eval makes them (the scoring guide's examples run in ``tests/test_docs.py``).

Most tests run a tiny random Llama (``tests/tiny.py``: exactness and bookkeeping, not model
quality); a few run the default model.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paxkv
from paxkv.core import buckets
from paxkv.cache.full import NoCache
from paxkv.scoring import Scorer, rolling_windows, scorer_for, token_pairs
from paxkv.scoring.batches import child_groups, step_width
from paxkv.scoring.shapes import StepShape
from paxkv.core.plan import AttentionPlan
from paxkv.scoring.steps import scored
from paxkv.core.step_info import StepInfo
from tiny import tiny_lm

TOL = 1e-5  # per-request relative error of summed log-probabilities, float32


def reference(lm, pairs) -> list[list[float]]:
    """Each continuation's token log-probs from a cache-less forward over context +
    continuation (float64 log-softmax of float32 logits); 8 rows of 128 tokens a call, so one
    compile serves every test."""
    out = []
    for i in range(0, len(pairs), 8):
        chunk = pairs[i:i + 8]
        ids = np.zeros((8, 128), np.int32)
        n = np.zeros(8, np.int32)
        for j, (ctx, cont) in enumerate(chunk):
            seq = list(ctx) + list(cont)
            ids[j, :len(seq)], n[j] = seq, len(seq)
        logits = _full_forward(lm, jnp.asarray(ids), jnp.asarray(n))
        lp = np.asarray(jax.nn.log_softmax(np.asarray(logits, np.float64), -1))
        out += [[lp[j, len(ctx) - 1 + k, t] for k, t in enumerate(cont)]
                for j, (ctx, cont) in enumerate(chunk)]
    return out


@functools.partial(jax.jit, static_argnums=0)
def _full_forward(lm, ids, n):
    step = StepInfo.make(n, n, ids.shape[1])
    return lm.forward(lm.params, ids, step, NoCache(), all_logits=True)[0]


def make(lm, **kw) -> Scorer:
    """The tests' scorer: one cache shape (8 rows of 128 tokens, pages of 16), so compiled
    steps are shared between tests; paxkv.score(lm, ..., max_seqs=8) makes the same."""
    return Scorer(lm, **dict(dict(max_seqs=8, max_len=128, page_size=16, num_pages=64), **kw))


def close(a: float, b: float, tol: float = TOL) -> bool:
    return abs(a - b) <= tol * max(1.0, abs(b))


def workload(seed: int = 0, contexts: tuple[int, ...] = (5, 16, 21, 32, 40),
             per_context: int = 4) -> list[tuple[list[int], list[int]]]:
    """Contexts of the given lengths (multiples of 16 and not), each with continuations of 1
    token, a few tokens and more than a page (20-30)."""
    rng = np.random.default_rng(seed)
    pairs = []
    for n in contexts:
        ctx = rng.integers(0, 256, n).tolist()
        for k in range(per_context):
            length = (1, 3, 7, 25)[k % 4]
            pairs.append((ctx, rng.integers(0, 256, length).tolist()))
    return pairs


@pytest.fixture(scope="module")
def tiny():
    return tiny_lm()


@pytest.fixture(scope="module")
def tiny_pairs(tiny):
    pairs = workload()
    return pairs, reference(tiny, pairs)


def assert_free(scorer: Scorer) -> None:
    cache = scorer.cache
    assert int(cache.free_pages()) == cache.num_pages
    assert not bool(jnp.any(cache.active))
    if cache.shares_pages:
        assert int(jnp.sum(cache.table.ref_counts)) == 0


@pytest.mark.parametrize("page_size", [1, 16, 128])
def test_shared_unshared_dense_equal_the_full_forward(tiny, tiny_pairs, page_size):
    """Contexts of lengths that are and are not multiples of the page, continuations of 1
    token and longer than a page, in one batch; unshared and dense at pages of 16."""
    pairs, ref = tiny_pairs
    runs = [("shared", dict(page_size=page_size, num_pages=1024 // page_size))]
    if page_size == 16:
        runs += [("unshared", dict(share=False)), ("dense", dict(cache="dense"))]
    got = {}
    for name, kw in runs:
        if kw.get("cache") == "dense":
            scorer = Scorer(tiny, cache="dense", max_seqs=8, max_len=128)
        else:
            scorer = make(tiny, **kw)
        got[name] = scorer.score(token_pairs(tiny, pairs))
        assert_free(scorer)
    for i, want in enumerate(ref):
        for name, res in got.items():
            r = res[i]
            assert len(r.token_logprobs) == len(want)
            assert close(r.logprob, sum(want)), (name, i, r.logprob, sum(want))
            assert all(close(a, b) for a, b in zip(r.token_logprobs, want)), (name, i)
        assert len({res[i].is_greedy for res in got.values()}) == 1


def test_is_greedy_means_every_token_is_the_argmax(tiny):
    ctx = [3, 1, 4, 1, 5, 9, 2, 6]
    greedy = []
    for _ in range(6):  # argmax continuation from the cache-less forward
        seq = ctx + greedy
        ids = jnp.asarray([seq + [0] * (128 - len(seq))] * 8, jnp.int32)
        logits = _full_forward(tiny, ids, jnp.full((8,), len(seq), jnp.int32))
        greedy.append(int(jnp.argmax(logits[0, len(seq) - 1])))
    other = greedy[:3] + [(greedy[3] + 1) % 256] + greedy[4:]
    a, b, c = make(tiny).score(token_pairs(tiny, [(ctx, greedy), (ctx, other),
                                                   (ctx, greedy[:1])]))
    assert a.is_greedy and c.is_greedy and not b.is_greedy
    assert close(a.token_logprobs[0], c.logprob)


def test_duplicate_choices_score_identically_and_permutation_permutes(tiny):
    ctx = list(range(10, 29))
    choices = [[5, 6, 7], [8], [5, 6, 7], list(range(40, 60)), [9, 9]]
    res = make(tiny).score(token_pairs(tiny, [(ctx, c) for c in choices]))
    assert res[0] == res[2]
    perm = [3, 0, 4, 2, 1]
    again = make(tiny).score(token_pairs(tiny, [(ctx, choices[p]) for p in perm]))
    assert all(close(again[i].logprob, res[p].logprob) for i, p in enumerate(perm))


def test_copy_on_write_copies_equal_the_fork_pattern(tiny):
    """Each context of length % page_size != 0 with k multi-token continuations costs k - 1
    copies (all k write into the shared partial page in one step; the last one keeps it)."""
    pairs = workload(seed=3, contexts=(5, 16, 21, 32, 40, 7), per_context=5)
    scorer = make(tiny)
    scorer.score(token_pairs(tiny, pairs))
    ps, want = 16, 0
    for n in (5, 16, 21, 32, 40, 7):
        kids = sum(1 for c, x in pairs if len(c) == n and len(x) > 1)
        want += (kids - 1) if n % ps else 0
    assert scorer.stats.cow_copies == want > 0
    assert scorer.stats.forks == sum(sum(1 for c, x in pairs if len(c) == n and len(x) > 1) - 1
                                     for n in (5, 16, 21, 32, 40, 7))
    assert_free(scorer)


def test_shared_prefixes_come_from_the_prefix_cache_and_the_pool_ends_free(tiny):
    """Few-shot contexts (one 48-token prefix + a question each): the prefix is prefilled
    once; scores equal the unshared run; fewer tokens through the model, fewer pages."""
    rng = np.random.default_rng(1)
    prefix = rng.integers(0, 256, 48).tolist()
    questions = [prefix + rng.integers(0, 256, 6 + q).tolist() for q in range(6)]
    pairs = [(q, rng.integers(0, 256, 2 + k).tolist()) for q in questions for k in range(3)]
    runs = {}
    for share in (True, False):
        scorer = make(tiny, share=share)
        for _ in range(2):  # the second call starts from an empty index again
            scorer.reset_stats()
            runs[share] = (scorer.score(token_pairs(tiny, pairs)), scorer.stats)
            assert_free(scorer)
    (shared, s), (alone, u) = runs[True], runs[False]
    assert all(close(a.logprob, b.logprob) for a, b in zip(shared, alone))
    assert s.cached_tokens == 5 * 48 and s.contexts == 6 and u.contexts == 18
    assert s.model_tokens < u.model_tokens / 2 and s.peak_pages < u.peak_pages


def test_long_contexts_and_continuations_run_in_chunks(tiny):
    rng = np.random.default_rng(2)
    pairs = [(rng.integers(0, 256, 70).tolist(), rng.integers(0, 256, n).tolist())
             for n in (1, 40, 33)]
    small = make(tiny, prefill_chunk=16, score_tokens=64)
    got = small.score(token_pairs(tiny, pairs))
    assert small.stats.steps >= 5 + 3  # 70 context tokens in chunks of 16, then 39 in 16s
    ref = reference(tiny, pairs)
    assert all(close(r.logprob, sum(w)) for r, w in zip(got, ref))
    assert_free(small)


def test_groups_larger_than_the_rows_are_split(tiny):
    ctx = list(range(30))
    pairs = [(ctx, [k, k + 1, k + 2]) for k in range(11)]  # 11 rows' worth, 8 rows
    got = paxkv.score(tiny, pairs, max_seqs=8)
    ref = reference(tiny, pairs)
    assert all(close(r.logprob, sum(w)) for r, w in zip(got, ref))


def test_child_steps_group_rows_of_like_lengths():
    # 4 continuations feeding 19 tokens and 28 feeding 2: one 32 x 32 step pads 1,024 tokens
    # for 132 real ones; a 4 x 32 step plus a 32 x 4 step pad 256.
    # Splitting pays once both shapes are compiled; before, two compiles cost more than the
    # padding they save, so a first pass runs one step (and its shape joins `compiled`).
    lefts = [19] * 4 + [2] * 28
    compiled: set[tuple[int, int]] = set()
    assert child_groups(lefts, cap=512, max_rows=32, budget=2048, compiled=compiled) == [(0, 32)]
    assert compiled == {(32, 32)}
    compiled = {(4, 32), (32, 4)}
    groups = child_groups(lefts, cap=512, max_rows=32, budget=2048, compiled=compiled)
    assert groups == [(0, 4), (4, 32)]
    work = sum(buckets.pow2(e - s) * step_width(lefts[s], 512) for s, e in groups)
    assert work == 4 * 32 + 32 * 4
    # Lengths alike: one step (another would only add its fixed cost); the budget caps rows.
    assert child_groups([7] * 32, cap=512, max_rows=32, budget=2048) == [(0, 32)]
    assert child_groups([30] * 8, cap=512, max_rows=32, budget=64) == [(0, 2), (2, 4), (4, 6),
                                                                      (6, 8)]
    assert child_groups([], cap=512, max_rows=32, budget=2048) == []


def test_mixed_continuation_lengths_score_exactly_in_fewer_padded_tokens(tiny):
    rng = np.random.default_rng(5)
    pairs = [(rng.integers(0, 256, 20).tolist(), rng.integers(0, 256, n).tolist())
             for n in (20, 3, 3, 3, 20, 3, 3, 3)]
    ref = reference(tiny, pairs)
    # A fresh scorer runs the children as one 8 x 32 step: two more compiled shapes would cost
    # more than the padding they save.
    fresh = make(tiny, remember_shapes=False)  # no shapes from another test's scorer
    got = fresh.score(token_pairs(tiny, pairs))
    assert all(close(r.logprob, sum(w)) for r, w in zip(got, ref))
    assert fresh.stats.padded_tokens == 8 * 24 + 8 * 32
    # With those shapes compiled: 2 x 32 (19 tokens each) and 8 x 4 (6 rows of 2).
    scorer = make(tiny, remember_shapes=False)
    for b, t in ((2, 32), (8, 4)):  # compiled for every window of these rows
        scorer.programs.shapes.adopt(StepShape("continuation", b, t, t, AttentionPlan(window=128)))
    got = scorer.score(token_pairs(tiny, pairs))
    assert all(close(r.logprob, sum(w)) for r, w in zip(got, ref))
    assert scorer.stats.padded_tokens == 8 * 24 + 2 * 32 + 8 * 4
    assert_free(fresh)
    assert_free(scorer)


class LastOnly:
    """A paxkv.Model whose forward gives only the last position's logits (no all_logits)."""

    def __init__(self, lm):
        self.lm = lm
        self.num_layers, self.num_kv_heads = lm.num_layers, lm.num_kv_heads
        self.head_dim, self.vocab_size, self.params = lm.head_dim, lm.vocab_size, lm.params

    def forward(self, params, tokens, step, cache):
        return self.lm.forward(params, tokens, step, cache)


def test_a_model_without_all_logits_scores_a_token_a_step(tiny, tiny_pairs):
    pairs, ref = tiny_pairs
    got = make(LastOnly(tiny)).score(token_pairs(tiny, pairs[:8]))
    assert all(close(r.logprob, sum(w)) for r, w in zip(got, ref[:8]))


def test_bad_input_names_what_to_change(tiny):
    with pytest.raises(ValueError, match="continuation is empty"):
        paxkv.score(tiny, [([1, 2], [])])
    with pytest.raises(ValueError, match="continuation is empty"):
        paxkv.score(tiny, [("abc", "")])
    with pytest.raises(ValueError, match="empty context"):
        paxkv.score(tiny, [([], [1])])
    with pytest.raises(ValueError, match="max_length=4"):
        paxkv.score(tiny, [([1, 2], [3, 4, 5, 6, 7])], max_length=4)
    with pytest.raises(ValueError, match="outside"):
        paxkv.score(tiny, [([1, 2], [300])])
    with pytest.raises(TypeError, match="mixes"):
        paxkv.score(tiny, [("abc", [1])])
    with pytest.raises(ValueError, match="raise max_len"):
        Scorer(tiny, max_len=16, max_seqs=2).score([((1,) * 10, (2,) * 10)])
    with pytest.raises(ValueError, match="page_size"):
        paxkv.score(tiny, [([1], [2])], page_size=0)


def test_max_length_cuts_contexts_from_the_left_as_the_hf_backend(tiny):
    ctx, cont = list(range(1, 40)), [7, 8, 9]
    got = paxkv.score(tiny, [(ctx, cont)], max_length=10, max_seqs=8)[0]
    want = paxkv.score(tiny, [((ctx + cont)[-11:][:-3], cont)], max_seqs=8)[0]  # hf's cut
    assert got == want


@pytest.mark.parametrize("n, max_length", [(1, 4), (10, 4), (17, 8), (16, 16), (40, 7)])
def test_rolling_windows_are_lm_eval_s(n, max_length):
    utils = pytest.importorskip("lm_eval.utils")
    tokens = list(range(100, 100 + n))
    want = [tuple(map(tuple, utils.make_disjoint_window(w))) for w in
            utils.get_rolling_token_windows(tokens, prefix_token=1, max_seq_len=max_length,
                                            context_len=1)]
    got = rolling_windows(tokens, prefix_token=1, max_length=max_length)
    assert got == want
    assert [t for _, c in got for t in c] == tokens  # every token predicted once


def test_rolling_loglikelihood_sums_every_token_once(tiny):
    text = list(range(50, 90))
    whole = reference(tiny, [([1], text)])[0]
    for max_length in (40, 12):  # one window; four windows (less context for later tokens)
        got = paxkv.score_rolling(tiny, [text], max_length=max_length, prefix_token=1,
                                  max_seqs=8)[0]
        windows = rolling_windows(text, prefix_token=1, max_length=max_length)
        want = sum(sum(w) for w in reference(tiny, windows))
        assert close(got, want)
    assert close(paxkv.score_rolling(tiny, [text], max_length=40, prefix_token=1,
                                     max_seqs=8)[0], sum(whole))


def test_the_scoring_step_donates_the_cache(tiny):
    scorer = make(tiny)
    cache = scorer.cache
    out = scored(scorer.programs.forward_all, tiny.params, cache, jnp.zeros((2, 4), jnp.int32),
                 jnp.array([0, 1]), jnp.array([4, 2]), jnp.ones((2, 4), jnp.int32))
    assert cache.pool.k.is_deleted() and cache.pool.v.is_deleted()
    new, lp, greedy, ok, free = out
    assert bool(jnp.all(ok)) and lp.shape == (2, 4) and float(lp[1, 2:].sum()) == 0.0
    assert bool(greedy[1, 2:].all()) and int(free) == new.num_pages - 2
    assert int(jax.device_get(new.lengths)[:2].sum()) == 6


# -- the default model -------------------------------------------------------------------------
def test_reference_values_of_the_default_model(lm):
    """The hf backend's values on this GGUF (NOTES.md: float32, lm-eval 0.4.13)."""
    ctx = "The capital of France is"
    paris, london = paxkv.score(lm, [(ctx, " Paris"), (ctx, " London")])
    assert abs(paris.logprob - -0.2581) < 1e-3 and paris.is_greedy
    assert abs(london.logprob - -4.3844) < 1e-3 and not london.is_greedy


def test_default_model_shared_unshared_dense_agree(lm):
    ctx = ("Question: Which of these is a fruit that grows on trees and is often red or green?"
           "\nAnswer:")
    choices = [" an apple", " a carrot", " a potato that grows under the ground in the dark",
               " B"]
    pairs = [(ctx, c) for c in choices]
    runs = [paxkv.score(lm, pairs, **kw) for kw in ({}, dict(share=False),
                                                     dict(cache="dense", max_seqs=4))]
    for res in runs[1:]:
        assert all(close(a.logprob, b.logprob) for a, b in zip(res, runs[0]))
        assert [a.is_greedy for a in res] == [b.is_greedy for b in runs[0]]


def test_a_pool_without_num_pages_stays_in_the_kv_budget(tiny, monkeypatch):
    monkeypatch.setattr(paxkv.scoring, "KV_BUDGET_BYTES", 40 << 10)  # 10 pages of 16 here
    pairs = [((1,) * 190, (2, 3))]
    paged = scorer_for(tiny, pairs, max_seqs=32)
    assert paged.cache.num_pages == buckets.cdiv(256, 16)  # one whole row of 256, no more
    dense = scorer_for(tiny, pairs, max_seqs=32, cache="dense")
    assert dense.cache.max_seqs == 1


def test_an_int8_pool_counts_its_scales_in_the_kv_budget(tiny, monkeypatch):
    """An int8 page holds codes and a float32 scale per (token, kv head): the default pool
    fills the budget with whole pages, scales included (it overshot by the scales before)."""
    budget = 256 << 10
    monkeypatch.setattr(paxkv.scoring, "KV_BUDGET_BYTES", budget)
    scorer = scorer_for(tiny, [((1,) * 190, (2, 3))], max_seqs=32, kv_dtype=jnp.int8)
    pages = scorer.cache.num_pages
    per_page = scorer.cache.pool.nbytes // (pages + 1)  # the pool holds a sentinel page too
    assert pages * per_page <= budget < (pages + 1) * per_page
