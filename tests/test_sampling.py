"""Sampling on synthetic logits: the filters and the per-row keys, without the model.

The model-level test (`tests/test_generate.py`) checks that a seeded request draws the same
tokens through either cache and with or without batch company; these check the rules those
draws follow, on logits where the right answer is known.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxkv.core import sampling

# One compiled sampler for every call here (eager, each call would trace the cond again).
sample = jax.jit(sampling.sample)


def _logits(batch: int, vocab: int = 50, seed: int = 0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(size=(batch, vocab)) * 3, jnp.float32)


def test_top_k_of_one_is_greedy_at_any_temperature():
    logits = _logits(6)
    params = sampling.make_params(6, temperature=1.7, top_k=1, seeds=list(range(6)))
    for pos in range(5):
        got = sample(logits, jnp.full((6,), pos, jnp.int32), params)
        np.testing.assert_array_equal(got, jnp.argmax(logits, -1))


def test_none_and_zero_temperature_are_greedy():
    logits = _logits(4)
    positions = jnp.arange(4, dtype=jnp.int32)
    want = np.asarray(jnp.argmax(logits, -1))
    np.testing.assert_array_equal(sample(logits, positions, None), want)
    params = sampling.make_params(4, temperature=0.0, top_k=5, seeds=[1, 2, 3, 4])
    np.testing.assert_array_equal(sample(logits, positions, params), want)


def test_draws_stay_inside_top_k_and_top_p():
    """Over 200 positions: every draw is among the row's top-k tokens and inside the smallest
    set holding top_p of the mass; more than one token is drawn (it samples)."""
    batch, vocab, k, p = 3, 50, 7, 0.6
    logits = _logits(batch, vocab, seed=3)
    top_k = sampling.make_params(batch, temperature=1.0, top_k=k, seeds=[5, 6, 7])
    top_p = sampling.make_params(batch, temperature=1.0, top_p=p, seeds=[5, 6, 7])
    draws_k = np.stack([sample(logits, jnp.full((batch,), i, jnp.int32), top_k)
                        for i in range(200)])
    draws_p = np.stack([sample(logits, jnp.full((batch,), i, jnp.int32), top_p)
                        for i in range(200)])
    probs = np.asarray(jax.nn.softmax(logits, -1))
    for r in range(batch):
        order = np.argsort(-probs[r])
        assert set(draws_k[:, r]) <= set(order[:k]) and len(set(draws_k[:, r])) > 1
        mass_before = np.cumsum(probs[r][order]) - probs[r][order]
        nucleus = set(order[mass_before < p])
        assert set(draws_p[:, r]) <= nucleus


def test_a_row_draws_the_same_whatever_its_neighbours():
    """Row i's draw depends on its seed, position and logits only."""
    logits = _logits(4, seed=1)
    params = sampling.make_params(4, temperature=0.9, top_p=0.95, seeds=[11, 12, 13, 14])
    positions = jnp.array([3, 9, 27, 81], jnp.int32)
    together = np.asarray(sample(logits, positions, params))
    for i in range(4):
        alone = sampling.make_params(1, temperature=0.9, top_p=0.95, seeds=[11 + i])
        got = sample(logits[i:i + 1], positions[i:i + 1], alone)
        assert int(got[0]) == together[i]


def test_the_seed_and_the_position_change_the_draws():
    logits = jnp.zeros((1, 1000), jnp.float32)  # uniform: any two keys disagree almost surely
    draws = {}
    for seed in (7, 8):
        params = sampling.make_params(1, temperature=1.0, seeds=[seed])
        draws[seed] = [int(sample(logits, jnp.array([pos], jnp.int32), params)[0])
                       for pos in range(8)]
    assert draws[7] != draws[8]
    assert len(set(draws[7])) > 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.5), "temperature"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
])
def test_bad_settings_name_what_to_change(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sampling.make_params(2, **kwargs)
