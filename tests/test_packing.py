"""Packed prefill: the token-wise layers over a step's real tokens only
(:mod:`paxkv.core.packing`), the same logits and tokens as over every slot."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paxkv
from paxkv.cache.full import NoCache
from paxkv.core.packing import Packing
from paxkv.core.plan import AttentionPlan
from paxkv.core.step_info import StepInfo
from paxkv.engine import policy
from paxkv.scoring.batches import ChildRow, child_groups, continuation_step
from paxkv.scoring.programs import Programs
from paxkv.scoring.shapes import StepShape, StepShapes, runs
from paxkv.scoring.steps import scored
from tiny import tiny_lm


def test_pack_unpack_and_last_token():
    qlen = np.array([3, 0, 5, 1])
    step = StepInfo.make(qlen + 2, qlen, 5)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 5, 3)), jnp.float32)
    pack = Packing.make(step.valid, 10)
    packed = pack.pack(x)
    assert packed.shape == (1, 10, 3) and not bool(pack.overflow)
    want = np.concatenate([np.asarray(x[b, :q]) for b, q in enumerate(qlen)])
    np.testing.assert_array_equal(packed[0, :9], want)
    np.testing.assert_array_equal(pack.unpack(packed),
                                  np.asarray(x) * np.asarray(step.valid)[..., None])
    last = np.asarray(pack.last(packed, step.query_lengths))
    np.testing.assert_array_equal(last[[0, 2, 3]], np.asarray(x)[[0, 2, 3], [2, 4, 0]])
    np.testing.assert_array_equal(last[1], 0)  # a row with no token: the zero row
    assert bool(Packing.make(step.valid, 8).overflow)


@pytest.mark.parametrize("windows", [None, (None, 6)])
def test_a_packed_forward_gives_every_real_token_the_unpacked_logits(windows):
    lm = tiny_lm(scale=1.0, windows=windows)
    qlen = np.array([7, 2, 0, 5])
    tokens = jnp.asarray(np.random.default_rng(1).integers(1, 256, (4, 8)), jnp.int32)

    def run(plan, all_logits):
        step = StepInfo.make(qlen, qlen, 8, plan=plan)
        return lm.forward(lm.params, tokens, step, NoCache(layer_windows=lm.layer_windows),
                          all_logits=all_logits)[0]

    for all_logits in (True, False):
        plain, packed = run(AttentionPlan(), all_logits), run(AttentionPlan(packed_tokens=16),
                                                              all_logits)
        real = np.asarray(StepInfo.make(qlen, qlen, 8).valid) if all_logits else qlen > 0
        np.testing.assert_allclose(np.asarray(packed)[real], np.asarray(plain)[real],
                                   rtol=1e-5, atol=1e-5)
    # Fewer packed tokens than real ones: never a silent answer.
    assert np.isnan(np.asarray(run(AttentionPlan(packed_tokens=8), False))).all()


def test_the_engine_packs_a_ragged_prefill_and_its_tokens_do_not_change(monkeypatch):
    lm = tiny_lm(scale=1.0)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, 256, int(n)).tolist() for n in (61, 9, 33, 17, 50, 4)]

    def run():
        engine = paxkv.Engine(lm, max_seqs=8, max_len=96, page_size=8)
        plans, prefill = [], engine.scheduler.ops.prefill
        engine.scheduler.ops.prefill = lambda *a: plans.append(a[6]) or prefill(*a)
        ids = [engine.submit(p, max_new_tokens=6, stop_token_ids=[]) for p in prompts]
        out = engine.run()
        engine.clear_prefix_cache()
        assert int(engine.cache.free_pages()) == engine.cache.num_pages  # every page back
        return [out[i].token_ids for i in ids], plans

    tokens, plans = run()
    assert plans[0].packed_tokens is not None and plans[0].packed_tokens < 8 * 64
    monkeypatch.setattr(policy, "packed_tokens", lambda real, slots: None)
    plain, plans = run()
    assert tokens == plain and plans[0].packed_tokens is None


def test_a_packed_size_rents_a_larger_compiled_one_until_the_padding_costs_a_compile():
    shapes = policy.Shapes(buy=1024)
    big, small = AttentionPlan(packed_tokens=3840), AttentionPlan(packed_tokens=3072)
    assert shapes.plan((8, 512), big) is big
    assert shapes.plan((8, 512), small) is big  # 768 padded tokens
    assert shapes.plan((8, 512), small) is small  # 1,536 > 1,024: compiled
    assert shapes.plan((8, 512), AttentionPlan(packed_tokens=2944)) is small  # 128
    assert shapes.plan((8, 512), AttentionPlan()) == AttentionPlan()  # every slot: its own
    assert policy.packed_tokens(3651, 4096) == 3840 and policy.packed_tokens(4000, 4096) is None


# -- scoring steps pack too ---------------------------------------------------------------------
def _ragged_pairs(seed: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    rng = np.random.default_rng(seed)
    pairs = []
    for n in (57, 6, 33, 91, 18):
        ctx = tuple(int(x) for x in rng.integers(1, 256, n))
        pairs += [(ctx, tuple(int(x) for x in rng.integers(1, 256, int(k))))
                  for k in rng.integers(1, 21, 3)]
    return pairs


def test_packed_scoring_steps_give_the_unpacked_log_likelihoods(monkeypatch):
    """Context and continuation steps pack their real tokens (the continuation's vocab
    projection and log-softmax too): every log-probability and greedy flag is the one every
    slot gives, and the pool is all free after."""
    lm = tiny_lm(scale=1.0)
    pairs = _ragged_pairs(3)

    def run():
        scorer = paxkv.Scorer(lm, max_seqs=8, max_len=128, page_size=8, remember_shapes=False)
        out = scorer.score(pairs)
        assert scorer.ops.free == scorer.cache.total_pages
        return out, [s.plan.packed_tokens for s in scorer.programs.shapes.shapes()]

    packed, sizes = run()
    assert any(s is not None for s in sizes)
    monkeypatch.setattr(Programs, "packs", property(lambda self: False))
    plain, sizes = run()
    assert all(s is None for s in sizes)
    for a, b in zip(packed, plain):
        np.testing.assert_allclose(a.token_logprobs, b.token_logprobs, rtol=1e-5, atol=1e-5)
        assert a.is_greedy == b.is_greedy


def test_a_packed_scoring_step_below_its_real_tokens_gives_nan():
    lm = tiny_lm(scale=1.0)
    scorer = paxkv.Scorer(lm, max_seqs=4, max_len=64, page_size=8, remember_shapes=False)
    tokens = jnp.ones((2, 8), jnp.int32)
    out = scored(scorer.programs.forward_all, lm.params, scorer.cache, tokens,
                 jnp.array([0, 1]), jnp.array([8, 5]), tokens,
                 plan=AttentionPlan(packed_tokens=12))
    assert np.isnan(np.asarray(out[1])[0]).any()


def test_a_packed_program_runs_the_rows_whose_tokens_it_holds_and_is_rented_on_all_calls():
    plan = AttentionPlan(window=256)
    known = StepShape("context", 8, 256, 8, dataclasses.replace(plan, packed_tokens=1024))
    assert runs(known, [300, 300, 300, 300]) == 3 and runs(known, [1100]) == 0
    assert runs(known, None) == 8 and runs(known, [10] * 12) == 8
    shapes = StepShapes(buy=1024)
    shapes.adopt(known)
    # 1,025 tokens of 7 rows: two calls of the known program (2 x (1,024 + 2,048 / 6 + 128))
    # against one tight call (1,152 + 341 + 128): 1,365 more, past the price: compiled.
    tight = shapes.choose("context", 7, 256, 8, 32, plan, 2048, 512, [150] * 6 + [125])
    assert tight.rows == 8 and tight.plan.packed_tokens == 1152
    # 1,500 tokens: its tight program packs 1,536, and two calls cost 981 more: rented.
    assert shapes.choose("context", 8, 256, 8, 32, plan, 2048, 512, [200] * 7 + [100]) == known
    # 900 tokens: one call of the known program, 64 tokens of padding past its own: rented.
    assert shapes.choose("context", 8, 256, 8, 32, plan, 2048, 512, [150] * 6) == known
    # A step whose first row the program cannot hold never rents it.
    assert shapes.choose("context", 1, 256, 8, 32, plan, 2048, 512, [250]) != known


def test_packed_child_steps_count_their_tokens_against_the_budget():
    """A budget of 64 tokens: unpacked, at most 16 rows of width 4; packed, the rows feeding
    at most 64 tokens (20 rows of 3 in one step)."""
    assert child_groups([3] * 20, cap=512, max_rows=32, budget=64) == [(0, 16), (16, 20)]
    assert child_groups([3] * 20, cap=512, max_rows=32, budget=64, packs=True) == [(0, 20)]
    groups = child_groups([3] * 30, cap=512, max_rows=32, budget=64, packs=True)
    assert len(groups) == 2 and all(3 * (e - s) <= 64 for s, e in groups)


def test_a_wider_program_feeds_no_more_than_planned_and_an_overflow_raises():
    """A step planned at width t that runs in a wider program feeds at most t tokens a row
    (its packed size counted those); a step feeding more than its program packs raises
    before it runs (the tokens past the packed size would reach the cache as zeros)."""
    child = ChildRow(request=0, row=0, context=(1, 2), cont=tuple(range(1, 30)))
    assert continuation_step([child], 32, 1, feed=8)[3][0] == 8
    assert continuation_step([child], 32, 1)[3][0] == 28
    scorer = paxkv.Scorer(tiny_lm(scale=1.0), max_seqs=4, max_len=64, page_size=8,
                          remember_shapes=False)
    shape = StepShape("continuation", 2, 8, 8, AttentionPlan(window=64, packed_tokens=16))
    ones = np.ones((2, 8), np.int32)
    with pytest.raises(RuntimeError, match="packs fewer"):
        scorer.programs.run(shape, ones, np.array([0, 1]), np.array([8, 9]), ones)
    assert scorer.ops.free == scorer.cache.total_pages  # nothing ran
