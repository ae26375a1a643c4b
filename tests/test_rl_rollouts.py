"""Group rollouts (:func:`paxkv.rl.rollout`): one prefill per distinct prompt (repeats found),
samples sharing its pages, rows in the input's order with their group ids, arrays a loss reads
(the trainer's log-probabilities of the same slots equal the sampler's), held rows continued
for a second turn, an RL step's update between calls, GRPO's advantages and loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paxkv
from paxkv import rl
from paxkv.core.sampling import make_params
from tiny import tiny_lm

Q0 = list(range(40, 75))  # 35 tokens
Q1 = [9, 8, 7, 6, 5, 4, 3, 2, 1, 200, 201, 202, 203, 204, 205, 206, 207, 208]
OPTS = dict(max_seqs=8, max_len=96, page_size=4, num_pages=120, compile_cache=False)
SAMPLING = paxkv.SamplingParams(max_new_tokens=12, temperature=0.8, top_k=40, seed=1,
                                stop_token_ids=(7, 11, 13))


def test_repeated_prompts_share_one_prefill_and_rows_keep_the_input_order():
    lm = tiny_lm(scale=1.0)
    engine = paxkv.Engine(lm, **OPTS)
    prompts = [Q0, Q1, Q0, Q0]  # Tunix repeats each prompt G times: here 3 copies of Q0
    out = rl.rollout(engine, prompts, group_size=3, params=SAMPLING)
    assert out.group_ids.tolist() == [g for g in range(4) for _ in range(3)]
    assert engine.stats().prefill_tokens < 2 * (len(Q0) + len(Q1))  # not 12 prefills
    for i, g in enumerate(out.group_ids):
        real = out.prompt_tokens[i][out.prompt_mask[i]].tolist()
        assert real == prompts[g] and out.prompt_mask[i, -1]  # left-padded
        k = out.completion_lengths[i]
        assert out.completion_mask[i, :k].all() and not out.completion_mask[i, k:].any()
        assert (out.weight_versions[i, :k] == 0).all() and (out.weight_versions[i, k:] == -1).all()
        assert out.finish_reasons[i] in ("stop", "length")
    # Q0's nine samples are drawn from nine keys: they are not all one completion.
    q0 = {tuple(out.completion_tokens[i]) for i in range(12) if out.group_ids[i] != 1}
    assert len(q0) > 1
    assert out.completion_tokens.shape[1] % 16 == 0 and out.prompt_tokens.shape[1] == 48
    engine.clear_prefix_cache()
    assert int(engine.cache.free_pages()) == engine.cache.num_pages


def test_group_samples_share_the_prompt_pages():
    lm = tiny_lm(scale=1.0)
    engine = paxkv.Engine(lm, **OPTS)
    rl.rollout(engine, [Q0], group_size=8,
               params=paxkv.SamplingParams(max_new_tokens=4, temperature=1.0,
                                           stop_token_ids=()))
    stats = engine.stats()
    prompt_pages = len(Q0) // 4
    # Eight rows of 35 + 4 tokens hold 10 pages each alone; sharing keeps one prompt copy.
    assert stats.peak_pages_used <= prompt_pages + 8 * 3 < 8 * 10
    assert stats.prefill_tokens <= len(Q0)


@pytest.mark.parametrize("mode", ["raw", "temperature", "processed"])
def test_the_trainer_reproduces_the_rollout_logprobs(mode):
    lm = tiny_lm(scale=1.0)
    engine = paxkv.Engine(lm, logprobs_mode=mode, **OPTS)
    out = rl.rollout(engine, [Q0, Q1], group_size=4, params=SAMPLING)
    n = len(out.group_ids)
    sampling = make_params(n, temperature=SAMPLING.temperature, top_k=SAMPLING.top_k)
    got = rl.token_logprobs(lm, lm.params, out.prompt_tokens, out.prompt_mask,
                            out.completion_tokens, out.completion_mask, sampling, mode=mode)
    diff = np.abs(np.asarray(got) - out.logprobs)[out.completion_mask]
    assert diff.max() < 1e-4, diff.max()


def test_an_rl_step_between_rollouts_and_a_second_turn():
    """Rollout under version 0, an update, a rollout under version 1 whose held rows go on
    after a tool's result (token ids in, out), every page back at the end."""
    lm = tiny_lm(scale=1.0)
    engine = paxkv.Engine(lm, **OPTS)
    first = rl.rollout(engine, [Q0, Q1], group_size=2, params=SAMPLING)
    assert (first.weight_versions[first.completion_mask] == 0).all()
    engine.update_params(jax.tree.map(lambda x: x * 1.05, lm.params))
    second = rl.rollout(engine, [Q0, Q1], group_size=2, params=SAMPLING, hold=True)
    assert (second.weight_versions[second.completion_mask] == 1).all()
    assert len(set(second.request_ids)) == 4
    turns = [engine.extend(rid, [100, 101, 102], max_new_tokens=5, hold=False)
             for rid in second.request_ids]
    results = engine.run()
    for rid, turn in zip(second.request_ids, turns):
        assert results[turn].prompt_ids[-3:] == [100, 101, 102]
        assert results[turn].weight_versions == [1] * len(results[turn].token_ids)
    engine.clear_prefix_cache()
    assert int(engine.cache.free_pages()) == engine.cache.num_pages


def test_rollout_refuses_a_busy_engine_and_a_bad_group_size():
    lm = tiny_lm(scale=1.0)
    engine = paxkv.Engine(lm, **OPTS)
    with pytest.raises(ValueError, match="group_size"):
        rl.rollout(engine, [Q0], group_size=0)
    engine.submit(Q0, max_new_tokens=3)
    with pytest.raises(ValueError, match="nothing queued"):
        rl.rollout(engine, [Q0], group_size=2)


def test_group_advantages_and_the_policy_loss():
    rewards = jnp.array([1.0, 0.0, 1.0, 1.0, 0.5, 0.5])
    groups = jnp.array([0, 0, 1, 1, 2, 2])
    adv = rl.group_advantages(rewards, groups, 3)
    np.testing.assert_allclose(adv, [1, -1, 0, 0, 0, 0], atol=1e-3)
    unscaled = rl.group_advantages(rewards, groups, 3, scale=False)
    np.testing.assert_allclose(unscaled, [0.5, -0.5, 0, 0, 0, 0], atol=1e-6)
    logp = jnp.log(jnp.full((6, 4), 0.5))
    mask = jnp.ones((6, 4), bool).at[:, 3].set(False)
    loss, stats = rl.policy_loss(logp, logp, adv, mask)
    assert abs(float(loss)) < 1e-6 and float(stats["ratio_max"]) == pytest.approx(1.0)
    grad = jax.grad(lambda lp: rl.policy_loss(lp, logp, adv, mask)[0])(logp)
    assert float(grad[0, 0]) < 0 < float(grad[1, 0]) and float(grad[0, 3]) == 0
