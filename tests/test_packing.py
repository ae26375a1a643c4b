"""Packed prefill: the token-wise layers over a step's real tokens only
(:mod:`paxkv.core.packing`), the same logits and tokens as over every slot."""

from __future__ import annotations

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
        engine.scheduler.ops.prefill = lambda *a: plans.append(a[5]) or prefill(*a)
        ids = [engine.submit(p, max_new_tokens=6, stop_token_ids=[]) for p in prompts]
        out = engine.run()
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
