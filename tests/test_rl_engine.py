"""The engine inside an RL loop: weights replaced between steps (no compile, no copy, clear
errors), what happens to the requests in flight ("abort", "keep", "recompute"), a prefix cache
that never serves K/V of other weights, held rows continued with appended tokens (multi-turn),
rows whose logits are not finite, and the three logprob modes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paxkv
from paxkv.models import LanguageModel
from tiny import full_logits, tiny_lm

PROMPT = [5, 17, 99, 3, 250, 7, 7, 1, 42, 8, 8, 9, 30, 31, 32, 33, 34]
OPTS = dict(max_seqs=4, max_len=64, page_size=4, num_pages=40, prefill_chunk=16,
            compile_cache=False)


def _lm() -> LanguageModel:
    return tiny_lm(scale=1.0)


def _scaled(params, factor: float):
    return jax.tree.map(lambda x: x * jnp.asarray(factor, x.dtype), params)


def _with(lm: LanguageModel, params) -> LanguageModel:
    return LanguageModel(lm.config, params, lm.tokenizer, lm.name)


def _greedy(lm: LanguageModel, prompt: list[int], n: int) -> list[int]:
    engine = paxkv.Engine(lm, **OPTS)
    rid = engine.submit(prompt, max_new_tokens=n, stop_token_ids=[])
    return engine.run()[rid].token_ids


def _steps(engine: paxkv.Engine, k: int) -> None:
    for _ in range(k):
        engine.step()


def _all_free(engine: paxkv.Engine) -> bool:
    engine.clear_prefix_cache()
    return int(engine.cache.free_pages()) == engine.cache.num_pages


def test_updates_compile_nothing_and_copy_nothing():
    lm = _lm()
    engine = paxkv.Engine(lm, **OPTS)
    engine.submit(PROMPT, max_new_tokens=3, stop_token_ids=[])
    engine.run()
    compiled = engine.stats().compiles.compiles
    for i in range(20):
        new = _scaled(lm.params, 1.0 + 0.01 * i)
        update = engine.update_params(new)
        assert update.placed == () and update.version == i + 1
        assert all(a is b for a, b in zip(jax.tree.leaves(engine.params), jax.tree.leaves(new)))
        engine.submit(PROMPT, max_new_tokens=3, stop_token_ids=[])
        out = list(engine.run().values())[0]
        assert out.weight_versions == [i + 1] * 3
    assert engine.stats().compiles.compiles == compiled
    assert _all_free(engine)


def test_a_wrong_tree_is_refused_naming_the_leaf_and_the_old_weights_stay():
    lm = _lm()
    engine = paxkv.Engine(lm, **OPTS)
    want = _greedy(lm, PROMPT, 5)
    leaves, treedef = jax.tree.flatten_with_path(lm.params)
    path = jax.tree_util.keystr(leaves[0][0])
    first = leaves[0][1]
    bad_shape = jax.tree.unflatten(treedef, [jnp.zeros(first.shape + (1,))] +
                                   [x for _, x in leaves[1:]])
    bad_dtype = jax.tree.unflatten(treedef, [first.astype(jnp.bfloat16)] +
                                   [x for _, x in leaves[1:]])
    with pytest.raises(ValueError, match="shape"):
        engine.update_params(bad_shape)
    with pytest.raises(ValueError, match=f"{path}.*dtype"):
        engine.update_params(bad_dtype)
    with pytest.raises(ValueError, match="missing"):
        engine.update_params({"params": {}})
    extra = {"params": {**lm.params["params"], "extra": jnp.zeros(3)}}
    with pytest.raises(ValueError, match="extra"):
        engine.update_params(extra)
    assert engine.weight_version == 0
    rid = engine.submit(PROMPT, max_new_tokens=5, stop_token_ids=[])
    assert engine.run()[rid].token_ids == want


def test_a_host_array_is_placed_once():
    lm = _lm()
    engine = paxkv.Engine(lm, **OPTS)
    host = jax.tree.map(np.asarray, _scaled(lm.params, 1.1))
    update = engine.update_params(host)
    assert len(update.placed) == len(jax.tree.leaves(lm.params))
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(engine.params))


def test_in_flight_must_be_said_when_requests_run():
    lm = _lm()
    engine = paxkv.Engine(lm, **OPTS)
    engine.submit(PROMPT, max_new_tokens=8, stop_token_ids=[])
    _steps(engine, 2)
    with pytest.raises(ValueError, match="in_flight="):
        engine.update_params(lm.params)
    with pytest.raises(ValueError, match="in_flight must be"):
        engine.update_params(lm.params, in_flight="pause")
    assert engine.weight_version == 0


def test_abort_ends_running_requests_with_their_tokens():
    lm = _lm()
    engine = paxkv.Engine(lm, **OPTS)
    want = _greedy(lm, PROMPT, 12)
    rids = [engine.submit(PROMPT, max_new_tokens=12, stop_token_ids=[]) for _ in range(2)]
    _steps(engine, 3)  # a prefill and a decode, then 2 decodes: 4 tokens each
    update = engine.update_params(_scaled(lm.params, 1.2), in_flight="abort")
    assert sorted(update.aborted) == rids
    results = engine.step().finished
    for rid in rids:
        r = results[rid]
        assert r.finish_reason == "aborted" and r.token_ids == want[:4]
        assert r.weight_versions == [0] * 4
    assert not engine.has_work() and _all_free(engine)


def test_keep_goes_on_with_old_kv_under_new_weights():
    lm = _lm()
    new = _scaled(lm.params, 1.2)
    engine = paxkv.Engine(lm, **OPTS)
    rid = engine.submit(PROMPT, max_new_tokens=10, stop_token_ids=[])
    _steps(engine, 3)
    update = engine.update_params(new, in_flight="keep")
    assert update.kept == (rid,)
    r = engine.run()[rid]
    assert r.weight_versions == [0] * 4 + [1] * 6 and r.finish_reason == "length"
    # The first token after the update: new weights on the old K/V of the prompt and tokens.
    assert r.token_ids[:4] == _greedy(lm, PROMPT, 4)
    assert _all_free(engine)


def test_recompute_prefills_the_tokens_again_under_the_new_weights():
    lm = _lm()
    new_lm = _with(lm, _scaled(lm.params, 1.2))
    engine = paxkv.Engine(lm, **OPTS)
    rid = engine.submit(PROMPT, max_new_tokens=10, stop_token_ids=[])
    _steps(engine, 3)
    update = engine.update_params(new_lm.params, in_flight="recompute")
    assert update.recomputed == (rid,)
    r = engine.run()[rid]
    before = _greedy(lm, PROMPT, 4)
    assert r.token_ids[:4] == before and r.weight_versions == [0] * 4 + [1] * 6
    assert r.token_ids[4:] == _greedy(new_lm, PROMPT + before, 6)
    assert r.num_preemptions == 0
    assert _all_free(engine)


@pytest.mark.parametrize("host", [0, 1 << 20])
def test_the_prefix_cache_never_serves_kv_of_other_weights(host):
    lm = _lm()
    engine = paxkv.Engine(lm, host_cache_bytes=host, **OPTS)
    engine.submit(PROMPT, max_new_tokens=2, stop_token_ids=[])
    engine.run()
    engine.update_params(_scaled(lm.params, 1.2))
    rid = engine.submit(PROMPT, max_new_tokens=2, stop_token_ids=[])
    assert engine.run()[rid].num_cached_tokens == 0  # no stale hit
    rid = engine.submit(PROMPT, max_new_tokens=2, stop_token_ids=[])
    assert engine.run()[rid].num_cached_tokens == 16  # the new weights' pages serve
    engine.update_params(_scaled(lm.params, 1.3), keep_prefix_cache=True)
    rid = engine.submit(PROMPT, max_new_tokens=2, stop_token_ids=[])
    assert engine.run()[rid].num_cached_tokens == 16  # stale K/V, as asked
    assert _all_free(engine)


def test_a_request_kept_across_an_update_indexes_no_stale_pages():
    lm = _lm()
    engine = paxkv.Engine(lm, **OPTS)
    engine.submit(PROMPT, max_new_tokens=6, stop_token_ids=[])
    _steps(engine, 2)
    engine.update_params(_scaled(lm.params, 1.2), in_flight="keep")
    engine.run()  # finishes under the new weights with K/V of the old ones
    rid = engine.submit(PROMPT, max_new_tokens=2, stop_token_ids=[])
    assert engine.run()[rid].num_cached_tokens == 0


def test_pins_carry_over_to_the_new_weights():
    lm = _lm()
    engine = paxkv.Engine(lm, **{**OPTS, "num_pages": 12})
    engine.pin_prefix(PROMPT)
    engine.update_params(_scaled(lm.params, 1.2))
    rid = engine.submit(PROMPT, max_new_tokens=2, stop_token_ids=[])
    engine.run()
    for i in range(6):  # other prompts fill the pool: the pinned pages stay
        engine.submit([100 + i] * 20, max_new_tokens=2, stop_token_ids=[])
    engine.run()
    rid = engine.submit(PROMPT, max_new_tokens=2, stop_token_ids=[])
    assert engine.run()[rid].num_cached_tokens == 16


def test_extend_continues_a_held_row_with_appended_tokens():
    """Multi-turn: the continuation equals a fresh run of the whole history, and only the
    held row's last token and the appended ids are prefilled."""
    lm = _lm()
    engine = paxkv.Engine(lm, prefix_cache=False, **OPTS)
    rid = engine.submit(PROMPT, max_new_tokens=5, stop_token_ids=[], hold=True)
    first = engine.run()[rid]
    tool = [60, 61, 62, 63, 64, 65]
    before = engine.stats().prefill_tokens
    nid = engine.extend(rid, tool, max_new_tokens=6, hold=False)
    r = engine.run()[nid]
    assert r.prompt_ids == PROMPT + first.token_ids + tool
    assert r.token_ids == _greedy(lm, r.prompt_ids, 6)
    assert engine.stats().prefill_tokens - before == 1 + len(tool)
    assert r.num_cached_tokens == len(PROMPT) + len(first.token_ids) - 1
    assert _all_free(engine)
    with pytest.raises(ValueError, match="hold=True"):
        rid = engine.submit(PROMPT, max_new_tokens=2, stop_token_ids=[])
        engine.extend(rid, tool)


def test_held_rows_are_prefilled_again_after_an_update():
    lm = _lm()
    new_lm = _with(lm, _scaled(lm.params, 1.2))
    engine = paxkv.Engine(lm, **OPTS)
    rid = engine.submit(PROMPT, max_new_tokens=5, stop_token_ids=[], hold=True)
    first = engine.run()[rid]
    update = engine.update_params(new_lm.params, in_flight="recompute")
    assert update.recomputed == (rid,)
    assert engine.result(rid).finish_reason == "length"
    nid = engine.extend(rid, [60, 61], max_new_tokens=4, hold=False)
    r = engine.run()[nid]
    assert r.token_ids == _greedy(new_lm, PROMPT + first.token_ids + [60, 61], 4)
    assert r.weight_versions == [1] * 4
    engine.cancel(rid) if rid in engine.table.requests else None
    assert _all_free(engine)


def test_non_finite_logits_end_the_row_without_a_token():
    lm = _lm()
    engine = paxkv.Engine(lm, **OPTS)
    ok = engine.submit(PROMPT, max_new_tokens=4, stop_token_ids=[])
    _steps(engine, 1)  # a prefill and a decode
    nan = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), lm.params)
    engine.update_params(nan, in_flight="keep")
    bad = engine.submit(PROMPT[:5], max_new_tokens=4, stop_token_ids=[])
    results = engine.run()
    assert results[ok].finish_reason == "non_finite" and len(results[ok].token_ids) == 2
    assert results[bad].finish_reason == "non_finite" and results[bad].token_ids == []
    assert _all_free(engine)


def test_non_finite_logits_end_the_compiled_loop_too():
    lm = _with(_lm(), jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), _lm().params))
    out = paxkv.generate(lm, [PROMPT], max_new_tokens=4, stop_token_ids=[], loop="jit",
                         page_size=4, compile_cache=False)
    assert out[0].finish_reason == "non_finite" and out[0].token_ids == []


def _filtered(logits: np.ndarray, t: float, k: int | None, p: float | None) -> np.ndarray:
    """An independent top-k / top-p filter of temperature-scaled logits (float64)."""
    z = logits.astype(np.float64) / t
    order = np.argsort(-z)
    keep = np.zeros(z.shape, bool)
    keep[order[: (k or z.size)]] = True
    if p is not None:
        probs = np.exp(z[order] - z[order].max())
        probs /= probs.sum()
        before = np.cumsum(probs) - probs
        keep[order[before >= p]] = False
    return np.where(keep, z, -np.inf)


def _log_softmax(z: np.ndarray) -> np.ndarray:
    m = z[np.isfinite(z)].max()
    return z - m - np.log(np.exp(z - m).sum())


@pytest.mark.parametrize("mode", ["raw", "temperature", "processed"])
def test_logprob_modes_equal_an_independent_computation(mode):
    lm = _lm()
    t, k, p = 0.7, 20, 0.9
    engine = paxkv.Engine(lm, logprobs_mode=mode, **OPTS)
    rids = [engine.submit(PROMPT, max_new_tokens=8, temperature=t, top_k=k, top_p=p, seed=s,
                          logprobs=2, stop_token_ids=[]) for s in range(3)]
    results = engine.run()
    for rid in rids:
        r = results[rid]
        seq = r.prompt_ids + r.token_ids
        logits = full_logits(lm, seq)[len(r.prompt_ids) - 1: len(seq) - 1]
        for i, tok in enumerate(r.token_ids):
            z = {"raw": logits[i].astype(np.float64), "temperature": logits[i] / t,
                 "processed": _filtered(logits[i], t, k, p)}[mode]
            want = _log_softmax(z)
            assert abs(r.logprobs[i] - want[tok]) < 2e-4
            assert np.isfinite(want[tok])  # the drawn token is inside the filter
            assert abs(r.top_logprobs[i][0][1] - want.max()) < 2e-4
    with pytest.raises(ValueError, match="logprobs_mode"):
        paxkv.Engine(lm, logprobs_mode="sampled", **OPTS)


def test_processed_logprobs_are_the_sampling_frequencies():
    """Many one-token samples of one prompt: each token's frequency matches exp(processed
    logprob) within a binomial tolerance, and no token outside the filter is drawn."""
    lm = _lm()
    n = 800
    engine = paxkv.Engine(lm, logprobs_mode="processed", **{**OPTS, "max_seqs": 16})
    rid = engine.submit(PROMPT, max_new_tokens=1, temperature=1.3, top_k=6, top_p=0.85,
                        n=n, logprobs=0, stop_token_ids=[], seed=3)
    samples = engine.run()[rid].samples
    tokens = np.array([s.token_ids[0] for s in samples])
    probs = {int(t): float(np.exp(s.logprobs[0])) for t, s in zip(tokens, samples)}
    logits = full_logits(lm, PROMPT)[-1]
    allowed = np.flatnonzero(np.isfinite(_filtered(logits, 1.3, 6, 0.85)))
    assert set(tokens.tolist()) <= set(allowed.tolist())
    assert abs(sum(probs.values()) - 1.0) < 1e-3 or len(probs) < len(allowed)
    for tok, prob in probs.items():
        freq = float(np.mean(tokens == tok))
        assert abs(freq - prob) < 4 * np.sqrt(prob * (1 - prob) / n) + 1e-3, (tok, freq, prob)


def test_a_held_row_refilled_from_the_prefix_cache_makes_no_token():
    """A held row whose every fed token is cached (stale K/V kept on purpose) is refilled
    without a step: it keeps its tokens (it once drew one more) and the host's free-page
    count stays the device's (it once kept what admission booked)."""
    lm = _lm()
    engine = paxkv.Engine(lm, **OPTS)
    rid = engine.submit(PROMPT[:16], max_new_tokens=1, stop_token_ids=[], hold=True)
    first = engine.run()[rid]
    engine.update_params(_scaled(lm.params, 1.0), in_flight="recompute",
                         keep_prefix_cache=True)
    engine.step()
    again = engine.result(rid)
    assert again.token_ids == first.token_ids and again.finish_reason == "length"
    assert engine.ops.free == int(engine.cache.free_pages())
    assert engine.table.requests[rid].cached == 16 and not engine.has_work()
