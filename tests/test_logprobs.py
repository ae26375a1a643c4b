"""Log-probabilities in generation: each generated token's logprob equals the cache-less
forward's log-softmax at that position, through both caches, every decode path (few rows, all
rows), preemption and n > 1 samples; asking for none costs nothing (no logprobs computed)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paxkv
from paxkv.core import steps, stored
from tiny import full_logits, tiny_lm

PROMPTS = [[5, 17, 99, 3, 250, 7, 7, 1, 42], [8, 8, 9], list(range(30, 70)), [200] * 5]


def full_logprobs(lm, seq: list[int]) -> np.ndarray:
    """``[len(seq), vocab]``: log-softmax of the cache-less forward at every position (float32
    throughout: the cached paths agree within ~5e-5 on this model's large logits)."""
    return np.asarray(jax.nn.log_softmax(full_logits(lm, seq)), np.float64)


def check(lm, result, k: int) -> None:
    seq = result.prompt_ids + result.token_ids
    want = full_logprobs(lm, seq)[len(result.prompt_ids) - 1: len(seq) - 1]
    got = np.asarray(result.logprobs)
    chosen = want[np.arange(len(result.token_ids)), result.token_ids]
    np.testing.assert_allclose(got, chosen, atol=2e-4)
    assert len(result.top_logprobs) == len(result.token_ids)
    for row, top in zip(want, result.top_logprobs):
        assert len(top) == k
        np.testing.assert_allclose([v for _, v in top], np.sort(row)[::-1][:k], atol=2e-4)
        assert [t for t, _ in top][:1] == [int(np.argmax(row))][:k]


@pytest.mark.parametrize("cache", ["paged", "dense"])
def test_generated_logprobs_equal_the_cacheless_forward(cache):
    lm = tiny_lm(scale=1.0)
    results = paxkv.generate(lm, PROMPTS, max_new_tokens=12, logprobs=3, cache=cache,
                             page_size=4, max_seqs=4, stop_token_ids=[])
    for r in results:
        check(lm, r, 3)


@pytest.mark.slow  # an engine run through preemption (`make test` runs it)
def test_logprobs_through_preemption_and_samples():
    """A pool too small for the batch preempts and recomputes; samples carry their own."""
    lm = tiny_lm(scale=1.0)
    engine = paxkv.Engine(lm, max_seqs=4, max_len=64, page_size=4, num_pages=14,
                          prefix_cache=False)
    ids = [engine.submit(p, max_new_tokens=16, logprobs=0, stop_token_ids=[]) for p in PROMPTS]
    sampled = engine.submit(PROMPTS[1], max_new_tokens=6, n=2, temperature=1.0, logprobs=2,
                            stop_token_ids=[])
    results = engine.run()
    assert engine.stats().preemptions > 0
    for i in ids:
        check(lm, results[i], 0)
        assert results[i].top_logprobs == [[]] * 16
    for sample in results[sampled].samples:
        check(lm, sample, 2)
    assert int(engine.cache.free_pages()) == engine.cache.num_pages


def test_no_logprobs_asked_computes_none():
    """Without ``logprobs`` the results carry None and the steps compile without the
    log-softmax (the static ``logprobs`` stays None)."""
    lm = tiny_lm(scale=1.0)
    before = stored.compiled(steps.decode_step) + stored.compiled(steps.prefill_step)
    plain = paxkv.generate(lm, PROMPTS[:2], max_new_tokens=5, page_size=4, stop_token_ids=[])
    assert all(r.logprobs is None and r.top_logprobs is None for r in plain)
    asked = paxkv.generate(lm, PROMPTS[:2], max_new_tokens=5, page_size=4, stop_token_ids=[],
                           logprobs=1)
    assert [r.token_ids for r in asked] == [r.token_ids for r in plain]
    assert stored.compiled(steps.decode_step) + stored.compiled(steps.prefill_step) > before


@pytest.mark.parametrize("kwargs, match", [
    (dict(logprobs=-1), "logprobs must be None or an int >= 0"),
    (dict(logprobs=2, loop="jit"), "logprobs need loop='python'"),
])
def test_bad_logprobs_requests_name_what_to_change(kwargs, match):
    with pytest.raises(ValueError, match=match):
        paxkv.generate(tiny_lm(), [[1, 2]], max_new_tokens=2, **kwargs)
