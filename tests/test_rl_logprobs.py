"""The trainer's log-probabilities (:mod:`paxkv.rl.logprobs`) against an independent computation.

The reference runs the tiny Llama's cache-less forward one row at a time over exactly
``prompt ++ completion`` (:func:`tiny.full_logits`) and applies each mode in numpy, float64,
with its own top-k / top-p filter: nothing of the row joining, the position arithmetic or
:func:`paxkv.core.sampling.mode_logits` is shared with the code under test.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxkv import Engine, SamplingParams
from paxkv.cache.full import NoCache
from paxkv.core.sampling import RowSampling
from paxkv.core.step_info import StepInfo
from paxkv.rl import join_rows, logprobs_fn, token_logprobs
from tiny import full_logits, tiny_lm

LM = tiny_lm(scale=1.0)
MODES = ("raw", "temperature", "processed")
PROMPT_LENGTHS = (3, 6, 1, 4)  # P = 6
COMPLETION_LENGTHS = (5, 2, 4, 0)  # C = 5; the last row scores nothing
P, C = 6, 5
# Row 1 is greedy: every mode must report raw for it.
TEMPERATURE = (0.7, 0.0, 1.3, 1.0)
TOP_K = (3, 5, 20, 0)
TOP_P = (1.0, 0.9, 0.5, 1.0)
SAMPLING = RowSampling(temperature=jnp.array(TEMPERATURE, jnp.float32),
                       top_k=jnp.array(TOP_K, jnp.int32), top_p=jnp.array(TOP_P, jnp.float32),
                       seed=jnp.zeros((4, 2), jnp.uint32))
TOL = dict(rtol=1e-5, atol=1e-5)


@functools.lru_cache(maxsize=None)
def _rows(lm=LM) -> tuple[tuple[list[int], list[int]], ...]:
    """Each row's (prompt, completion): random prompt ids, then completion tokens of raw rank
    0, 1, 2, 3, 0 under the model, so most lie inside a row's top-k / top-p set (rank 3 of
    row 0's top 3 does not, nor some of row 2's top-p 0.5: -inf to check too)."""
    rng = np.random.default_rng(1)
    rows = []
    for p_len, c_len in zip(PROMPT_LENGTHS, COMPLETION_LENGTHS):
        prompt = [int(t) for t in rng.integers(1, 256, p_len)]
        completion: list[int] = []
        for j in range(c_len):
            logits = full_logits(lm, prompt + completion)[-1]
            completion.append(int(np.argsort(-logits, kind="stable")[j % 4]))
        rows.append((prompt, completion))
    return tuple(rows)


def _batch(layout: str, lm=LM) -> tuple[np.ndarray, ...]:
    """``(prompt_tokens [4, P], prompt_mask, completion_tokens [4, C], completion_mask)`` with
    the prompts left-padded, right-padded or scattered among padding ("holes"); padding
    slots hold junk ids, which must not matter."""
    rng = np.random.default_rng(2)
    pt = rng.integers(0, 256, (4, P)).astype(np.int32)
    pm = np.zeros((4, P), bool)
    ct = rng.integers(0, 256, (4, C)).astype(np.int32)
    cm = np.zeros((4, C), bool)
    for b, (prompt, completion) in enumerate(_rows(lm)):
        n = len(prompt)
        slots = {"left": np.arange(P - n, P), "right": np.arange(n),
                 "holes": np.sort(rng.choice(P, n, replace=False))}[layout]
        pt[b, slots], pm[b, slots] = prompt, True
        ct[b, :len(completion)], cm[b, :len(completion)] = completion, True
    return pt, pm, ct, cm


def _np_mode(logits: np.ndarray, b: int, mode: str) -> np.ndarray:
    """Row ``b``'s mode logits ``[vocab]`` in float64: temperature, then top-k and top-p (the
    smallest prefix of the sorted distribution whose mass reaches top_p; 1 keeps all)."""
    t, k, p = TEMPERATURE[b], TOP_K[b], TOP_P[b]
    z = logits.astype(np.float64)
    if mode == "raw" or t == 0.0:
        return z
    z = z / t
    if mode == "temperature":
        return z
    s = np.sort(z)[::-1]
    kth = s[min(k, len(s)) - 1] if k > 0 else s[-1]
    probs = np.exp(s - s[0]) / np.exp(s - s[0]).sum()
    before = np.cumsum(probs) - probs
    cutoff = s[before < p].min() if p < 1.0 else s[-1]
    return np.where(z >= max(kth, cutoff), z, -np.inf)


def _reference(mode: str, lm=LM) -> np.ndarray:
    """float64 ``[4, C]``: numpy log-softmax of each row's full-forward logits."""
    out = np.zeros((4, C))
    for b, (prompt, completion) in enumerate(_rows(lm)):
        logits = full_logits(lm, prompt + completion)
        for j, token in enumerate(completion):
            z = _np_mode(logits[len(prompt) - 1 + j], b, mode)
            out[b, j] = z[token] - (z.max() + np.log(np.exp(z - z.max()).sum()))
    return out


@pytest.mark.parametrize("layout", ["left", "right", "holes"])
@pytest.mark.parametrize("mode", MODES)
def test_each_mode_matches_an_independent_computation(mode, layout):
    pt, pm, ct, cm = _batch(layout)
    out = np.asarray(logprobs_fn(LM, mode=mode)(LM.params, pt, pm, ct, cm, SAMPLING))
    assert out.dtype == np.float32 and out.shape == (4, C)
    np.testing.assert_allclose(out, _reference(mode), **TOL)
    assert (out[~cm] == 0).all()


def test_the_modes_differ_and_processed_excludes_tokens():
    """The data exercise what they should: the modes give different values and a token
    outside a row's top-k / top-p set gets -inf in "processed" (on both sides)."""
    raw, temp, proc = (_reference(m) for m in MODES)
    assert np.abs(raw - temp).max() > 0.1 and np.abs(temp[np.isfinite(proc)]
                                                     - proc[np.isfinite(proc)]).max() > 0.01
    assert np.isinf(proc).any() and np.isfinite(proc).sum() > 5


def test_greedy_rows_report_raw_in_every_mode():
    pt, pm, ct, cm = _batch("left")
    raw = np.asarray(logprobs_fn(LM)(LM.params, pt, pm, ct, cm, SAMPLING))
    for mode in MODES:
        out = np.asarray(logprobs_fn(LM, mode=mode)(LM.params, pt, pm, ct, cm, SAMPLING))
        np.testing.assert_array_equal(out[1], raw[1])  # row 1: temperature 0
        no_sampling = np.asarray(logprobs_fn(LM, mode=mode)(LM.params, pt, pm, ct, cm))
        np.testing.assert_array_equal(no_sampling, raw)


def test_join_rows_left_aligns_each_prompt_then_its_completion():
    pt, pm, ct, _ = _batch("holes")
    tokens, lengths = join_rows(jnp.asarray(pt), jnp.asarray(pm), jnp.asarray(ct))
    for b, (prompt, _) in enumerate(_rows()):
        n = len(prompt)
        want = prompt + list(ct[b]) + [0] * (P - n)
        assert list(np.asarray(tokens[b])) == want and int(lengths[b]) == n


def test_jitted_equals_eager_and_chunks_equal_one_pass():
    pt, pm, ct, cm = _batch("left")
    jitted = np.asarray(logprobs_fn(LM, mode="temperature")(LM.params, pt, pm, ct, cm, SAMPLING))
    eager = np.asarray(token_logprobs(LM, LM.params, pt, pm, ct, cm, SAMPLING,
                                      mode="temperature"))
    np.testing.assert_allclose(eager, jitted, rtol=1e-6, atol=1e-6)
    chunked = logprobs_fn(LM, mode="temperature", row_chunk=2)
    np.testing.assert_allclose(np.asarray(chunked(LM.params, pt, pm, ct, cm, SAMPLING)),
                               jitted, rtol=1e-6, atol=1e-6)


def _reference_loss(params, rows, width: int = 16) -> jax.Array:
    """Sum of each row's completion log-probs in "temperature" mode, one row per forward
    (padded at the end to ``width``, which a causal model's earlier positions never see)."""
    total = jnp.zeros((), jnp.float32)
    for b, (prompt, completion) in enumerate(rows):
        seq = prompt + completion
        ids = jnp.asarray([seq + [0] * (width - len(seq))], jnp.int32)
        n = jnp.array([len(seq)])
        logits = LM.forward(params, ids, StepInfo.make(n, n, width), NoCache(),
                            all_logits=True)[0][0]
        if TEMPERATURE[b] > 0:
            logits = logits / TEMPERATURE[b]
        logp = jax.nn.log_softmax(logits, axis=-1)
        for j, token in enumerate(completion):
            total = total + logp[len(prompt) - 1 + j, token]
    return total


def test_grad_matches_an_independent_per_row_computation():
    pt, pm, ct, cm = _batch("right")

    def loss(params, row_chunk=None):
        fn = logprobs_fn(LM, mode="temperature", row_chunk=row_chunk)
        return fn(params, pt, pm, ct, cm, SAMPLING).sum()

    value, grad = jax.value_and_grad(loss)(LM.params)
    rows = _rows()
    ref_value, ref_grad = jax.jit(jax.value_and_grad(
        lambda params: _reference_loss(params, rows)))(LM.params)
    np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-5)
    chunked = jax.grad(functools.partial(loss, row_chunk=2))(LM.params)
    for got, want, other in zip(jax.tree.leaves(grad), jax.tree.leaves(ref_grad),
                                jax.tree.leaves(chunked)):
        assert np.isfinite(np.asarray(got)).all()
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.asarray(other), np.asarray(got), rtol=1e-5, atol=1e-5)
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grad)) > 1.0


def test_an_empty_prompt_gives_nan_where_nothing_predicts_the_token():
    pt, pm, ct, cm = _batch("left")
    pm[0] = False
    out = np.asarray(logprobs_fn(LM)(LM.params, pt, pm, ct, cm))
    assert np.isnan(out[0, 0]) and np.isfinite(out[0, 1:]).all() and np.isfinite(out[1:]).all()


def test_a_model_with_sliding_windows_applies_them():
    lm = tiny_lm(scale=1.0, windows=(2, None))
    pt, pm, ct, cm = _batch("left", lm)
    out = np.asarray(logprobs_fn(lm)(lm.params, pt, pm, ct, cm))
    np.testing.assert_allclose(out, _reference("raw", lm), **TOL)
    plain = np.asarray(logprobs_fn(LM)(lm.params, pt, pm, ct, cm))
    assert np.abs(plain - out).max() > 1e-3  # the windows changed something


def test_the_engine_reports_the_same_logprobs():
    """The sampler's side: the engine's logprobs of the tokens it drew ("processed": sampled
    with top-k, top-p, plain temperature and greedy rows, through the paged cache) equal the
    trainer's over the same prompts and completions, left-padded as Tunix pads them."""
    prompts = [_rows()[b][0] for b in range(4)]
    settings = [dict(temperature=0.8, top_k=10), dict(temperature=1.2, top_p=0.7),
                dict(temperature=0.0), dict(temperature=1.0)]
    engine = Engine(LM, max_seqs=4, max_len=64, page_size=8, logprobs_mode="processed",
                    compile_cache=False)
    ids = [engine.submit(p, SamplingParams(max_new_tokens=C, seed=b, logprobs=0,
                                           stop_token_ids=(), **s))
           for b, (p, s) in enumerate(zip(prompts, settings))]
    results = engine.run()
    pt, pm = np.zeros((4, P), np.int32), np.zeros((4, P), bool)
    ct, engine_logprobs = np.zeros((4, C), np.int32), np.zeros((4, C), np.float32)
    for b, (prompt, i) in enumerate(zip(prompts, ids)):
        pt[b, P - len(prompt):], pm[b, P - len(prompt):] = prompt, True
        ct[b], engine_logprobs[b] = results[i].token_ids, results[i].logprobs
    sampling = RowSampling(
        temperature=jnp.array([s["temperature"] for s in settings], jnp.float32),
        top_k=jnp.array([s.get("top_k", 0) for s in settings], jnp.int32),
        top_p=jnp.array([s.get("top_p", 1.0) for s in settings], jnp.float32),
        seed=jnp.zeros((4, 2), jnp.uint32))
    trainer = logprobs_fn(LM, mode="processed")(LM.params, pt, pm, ct, np.ones((4, C), bool),
                                                sampling)
    np.testing.assert_allclose(np.asarray(trainer), engine_logprobs, **TOL)


def _bad(**change):
    pt, pm, ct, cm = _batch("left")
    args = dict(prompt_tokens=pt, prompt_mask=pm, completion_tokens=ct, completion_mask=cm,
                sampling=SAMPLING)
    return {**args, **change}


BAD = [
    (_bad(prompt_mask=np.ones((4, P), np.int32)), {}, "prompt_mask must be bool"),
    (_bad(completion_mask=np.ones((4, C - 1), bool)), {}, "completion_mask must have"),
    (_bad(completion_tokens=np.ones((3, C), np.int32), completion_mask=np.ones((3, C), bool)),
     {}, "completion_tokens has 3 rows"),
    (_bad(prompt_tokens=np.ones((4, P), np.float32)), {}, "prompt_tokens must be an int"),
    (_bad(prompt_tokens=np.ones((4 * P,), np.int32), prompt_mask=np.ones((4 * P,), bool)), {},
     "prompt_tokens must be an int array"),
    (_bad(sampling=jax.tree.map(lambda x: x[:2], SAMPLING)), {}, r"sampling.temperature"),
    (_bad(), {"mode": "logits"}, "mode must be one of"),
    (_bad(), {"row_chunk": 3}, "row_chunk must be"),
]


@pytest.mark.parametrize("args, static, message", BAD)
@pytest.mark.parametrize("jitted", [False, True])
def test_bad_input_raises_a_value_error_naming_the_fix(args, static, message, jitted):
    if jitted:
        with pytest.raises(ValueError, match=message):
            logprobs_fn(LM, **static)(LM.params, **args)
    else:
        with pytest.raises(ValueError, match=message):
            token_logprobs(LM, LM.params, **args, **static)


def test_a_model_without_all_logits_is_refused():
    class LastOnly:
        num_layers, num_kv_heads, head_dim, vocab_size = 2, 1, 16, 256
        params = LM.params

        def forward(self, params, tokens, step, cache):
            return LM.forward(params, tokens, step, cache)

    pt, pm, ct, cm = _batch("left")
    with pytest.raises(TypeError, match="all_logits"):
        token_logprobs(LastOnly(), LM.params, pt, pm, ct, cm)
