"""A second, deliberately different model keeps :mod:`paxkv.core.protocol` honest.

``TinyDecoder`` is not paxkv's Llama: Flax NNX instead of linen, learned absolute positions
instead of RoPE, LayerNorm, a GELU MLP, and its own attention module with a softmax scale that
is not ``head_dim ** -0.5`` and a logit soft-cap. Through the paged cache (NaN-filled, not
scrubbed), the dense cache, the engine and ``generate`` it must equal its own cache-less
forward (:class:`paxkv.cache.full.NoCache`): what a user's model may rely on.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import paxkv
from paxkv.cache import dense as dense_cache
from paxkv.cache import paged as paged_cache
from paxkv.cache.full import NoCache
from paxkv.core.protocol import KVCache, Model, check_model
from paxkv.core.step_info import StepInfo


# -- the model: what a user writes ------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 97
    dim: int = 32
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    max_positions: int = 64
    sm_scale: float | None = 0.2  # not head_dim ** -0.5 = 0.25
    logit_soft_cap: float | None = 8.0


class Attention(nnx.Module):
    """Grouped-query attention whose K/V live in the paxkv cache (no RoPE: positions are
    embedded)."""

    def __init__(self, c: TinyConfig, *, rngs: nnx.Rngs):
        self.config = c
        self.q = nnx.Linear(c.dim, c.num_heads * c.head_dim, rngs=rngs)
        self.kv = nnx.Linear(c.dim, 2 * c.num_kv_heads * c.head_dim, rngs=rngs)
        self.out = nnx.Linear(c.num_heads * c.head_dim, c.dim, rngs=rngs)

    def __call__(self, x: jax.Array, layer: int, step: StepInfo, cache: KVCache):
        """x ``[b, t, dim]`` -> (``[b, t, dim]``, cache)."""
        b, t, _ = x.shape
        c = self.config
        q = self.q(x).reshape(b, t, c.num_heads, c.head_dim)
        k, v = jnp.split(self.kv(x).reshape(b, t, 2 * c.num_kv_heads, c.head_dim), 2, axis=2)
        cache, out = cache.attend(layer, q, k, v, step, sm_scale=c.sm_scale,
                                  logit_soft_cap=c.logit_soft_cap)
        return self.out(out.reshape(b, t, -1)), cache


class Block(nnx.Module):
    def __init__(self, c: TinyConfig, *, rngs: nnx.Rngs):
        self.norm1, self.norm2 = nnx.LayerNorm(c.dim, rngs=rngs), nnx.LayerNorm(c.dim, rngs=rngs)
        self.attn = Attention(c, rngs=rngs)
        self.up = nnx.Linear(c.dim, 4 * c.dim, rngs=rngs)
        self.down = nnx.Linear(4 * c.dim, c.dim, rngs=rngs)

    def __call__(self, x: jax.Array, layer: int, step: StepInfo, cache: KVCache):
        h, cache = self.attn(self.norm1(x), layer, step, cache)
        x = x + h
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x)))), cache


class TinyDecoder(nnx.Module):
    def __init__(self, c: TinyConfig, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(c.vocab_size, c.dim, rngs=rngs)
        self.position = nnx.Embed(c.max_positions, c.dim, rngs=rngs)
        self.blocks = nnx.List([Block(c, rngs=rngs) for _ in range(c.num_layers)])
        self.norm = nnx.LayerNorm(c.dim, rngs=rngs)
        self.head = nnx.Linear(c.dim, c.vocab_size, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array, step: StepInfo, cache: KVCache):
        """tokens int32 ``[b, t]`` -> (float32 logits ``[b, vocab]`` at each row's last real
        token, cache)."""
        x = self.embed(tokens) + self.position(jnp.maximum(step.positions, 0))
        for layer, block in enumerate(self.blocks):
            x, cache = block(x, layer, step, cache)
        last = jnp.maximum(step.query_lengths - 1, 0)
        x = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]  # [b, dim]
        return self.head(self.norm(x)).astype(jnp.float32), cache


class TinyModel:
    """A :class:`paxkv.core.protocol.Model`: the NNX module split once into a graph and a params
    pytree; ``forward`` merges them inside the step (pure, jit-able)."""

    eos_token_ids: tuple[int, ...] = ()

    def __init__(self, config: TinyConfig = TinyConfig(), seed: int = 0):
        self.config = config
        self.graph, self.params = nnx.split(TinyDecoder(config, rngs=nnx.Rngs(seed)))
        self.num_layers, self.num_kv_heads = config.num_layers, config.num_kv_heads
        self.head_dim, self.vocab_size = config.head_dim, config.vocab_size

    def forward(self, params, tokens, step, cache):
        return nnx.merge(self.graph, params)(tokens, step, cache)


# -- helpers --------------------------------------------------------------------------------
MODEL = TinyModel()
PROMPTS = [list(range(3, 12)), [40, 41, 42, 43, 44], [7, 7], list(range(60, 73))]
WIDTH = 32  # every cache-less forward runs at this width (one compile)
TOLERANCE = 1e-5


def assert_rows_close(actual, desired, what: str = ""):
    """Per-row relative error of float32 logits ``[b, vocab]``."""
    a, d = np.asarray(actual, np.float32), np.asarray(desired, np.float32)
    assert a.shape == d.shape and np.all(np.isfinite(a)), what
    err = np.linalg.norm(a - d, axis=-1) / np.linalg.norm(d, axis=-1)
    assert err.max() < TOLERANCE, f"{what}: row {err.argmax()} relative error {err.max():.2e}"


@functools.partial(jax.jit, static_argnums=0)
def full_forward(model, tokens, lengths):
    """Cache-less logits ``[b, vocab]`` after each row's first ``lengths`` tokens."""
    step = StepInfo.make(lengths, lengths, tokens.shape[1])
    return model.forward(model.params, tokens, step, NoCache())[0]


def reference_logits(model, seqs: list[list[int]]) -> jax.Array:
    tokens = np.zeros((len(seqs), WIDTH), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, :len(s)] = s
    return full_forward(model, tokens, np.array([len(s) for s in seqs], np.int32))


def reference_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens from recomputing the whole sequence each token, no cache."""
    seq = list(prompt)
    for _ in range(max_new_tokens):
        seq.append(int(jnp.argmax(reference_logits(model, [seq])[0])))
    return seq[len(prompt):]


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def prefill(model, params, cache, tokens, rows, n):
    """Prompts ``tokens [b, t]`` (``n [b]`` real) into cache rows ``rows [b]``."""
    num_new = jnp.zeros((cache.max_seqs,), jnp.int32).at[rows].add(n)
    cache, ok = cache.reserve(num_new, max_new=tokens.shape[1])
    step = StepInfo.make(cache.lengths[rows], n, tokens.shape[1], rows=rows)
    logits, cache = model.forward(params, tokens, step, cache)
    return cache, logits, ok[rows]


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def decode(model, params, cache, tokens, live):
    """One token ``tokens [max_seqs]`` for every live row."""
    cache, ok = cache.reserve(live.astype(jnp.int32), max_new=1)
    step = StepInfo.make(cache.lengths, (ok & live).astype(jnp.int32), 1)
    logits, cache = model.forward(params, tokens[:, None], step, cache)
    return cache, logits, ok


def make_cache(kind: str, model, max_seqs: int = 4, max_len: int = WIDTH):
    dims = dict(num_layers=model.num_layers, num_kv_heads=model.num_kv_heads,
                head_dim=model.head_dim, max_seqs=max_seqs, max_len=max_len)
    if kind == "paged":  # free slots hold NaN: a stray read poisons the logits
        return paged_cache.create(num_pages=max_seqs * max_len // 4, page_size=4, scrub=False,
                                  fill=jnp.nan, **dims)
    return dense_cache.create(fill=jnp.nan, **dims)


def kv_buffers(cache) -> tuple[jax.Array, jax.Array]:
    if isinstance(cache, paged_cache.PagedCache):
        return cache.pool.k, cache.pool.v
    return cache.k, cache.v


# -- tests ----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["paged", "dense"])
def test_cache_steps_equal_the_cacheless_forward(kind):
    """A ragged prefill into permuted rows (one row idle), then decode steps: every step's
    logits equal the full forward over the whole sequence so far."""
    cache = make_cache(kind, MODEL)
    prompts, rows = PROMPTS[:3], np.array([3, 0, 1], np.int32)
    n = np.array([len(p) for p in prompts], np.int32)
    tokens = np.zeros((len(prompts), n.max()), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    old = kv_buffers(cache)
    cache, logits, ok = prefill(MODEL, MODEL.params, cache, tokens, rows, n)
    assert bool(jnp.all(ok)) and all(buf.is_deleted() for buf in old)  # donated
    seqs = [list(p) for p in prompts]
    assert_rows_close(logits, reference_logits(MODEL, seqs), f"{kind} prefill")
    live = np.zeros(4, bool)
    live[rows] = True
    for i in range(6):
        nxt = np.zeros(4, np.int32)
        nxt[rows] = np.asarray(jnp.argmax(logits, -1))
        for s, t in zip(seqs, nxt[rows]):
            s.append(int(t))
        cache, all_rows, ok = decode(MODEL, MODEL.params, cache, nxt, live)
        assert bool(jnp.all(ok[rows]))
        logits = all_rows[rows]
        assert_rows_close(logits, reference_logits(MODEL, seqs), f"{kind} decode {i}")
    np.testing.assert_array_equal(np.asarray(cache.lengths)[rows], [len(s) for s in seqs])


def test_sm_scale_and_soft_cap_change_the_logits():
    """Same weights with the default scale, or without the cap, give other logits: a cache
    that dropped either setting could not pass the test above."""
    seqs = [list(p) for p in PROMPTS]
    mine = reference_logits(MODEL, seqs)
    for change in (dict(sm_scale=None), dict(logit_soft_cap=None)):
        other = TinyModel(dataclasses.replace(MODEL.config, **change))
        theirs = reference_logits(other, seqs)
        err = np.linalg.norm(np.asarray(mine - theirs), axis=-1) / np.linalg.norm(mine, axis=-1)
        assert err.min() > 100 * TOLERANCE, (change, err)
        cache = make_cache("paged", other)
        rows = np.arange(2, dtype=np.int32)
        tokens = np.array([PROMPTS[0], PROMPTS[0]], np.int32)
        n = np.array([len(PROMPTS[0])] * 2, np.int32)
        _, paged, _ = prefill(other, other.params, cache, tokens, rows, n)
        assert_rows_close(paged[:1], theirs[:1], f"paged with {change}")


@pytest.mark.parametrize("kind", ["paged", "dense"])
def test_engine_greedy_equals_cacheless_greedy(kind):
    """More prompts than rows (queued), two sharing a full page prefix (the prefix cache)."""
    prompts = PROMPTS + [PROMPTS[0][:8] + [90, 91]]
    engine = paxkv.Engine(MODEL, cache=kind, max_seqs=2, max_len=WIDTH, page_size=4)
    rids = [engine.submit(p, max_new_tokens=5, stop_token_ids=[]) for p in prompts]
    results = engine.run()
    for rid, p in zip(rids, prompts):
        assert results[rid].token_ids == reference_greedy(MODEL, p, 5), p
    if kind == "paged":  # the last prompt's first two pages came from the prefix cache
        assert results[rids[-1]].num_cached_tokens == 8
    engine.clear_prefix_cache()
    assert int(engine.cache.free_pages()) == engine.cache.num_pages


@pytest.mark.slow  # eager, every distinct op compiles on its own (~30 s)
def test_engine_gives_the_same_tokens_with_jit_disabled():
    """A researcher debugging a model runs it under ``jax.disable_jit()``: the engine's
    steps (reserve, prefix hits, prefill, decode, sampling) then run op by op and must give the
    jitted run's tokens. The second prompt starts with the first's two full pages and comes
    after it, so the eager run attaches cached pages too."""
    prompts = [PROMPTS[0], PROMPTS[0][:8] + [90, 91]]

    def run() -> list[list[int]]:
        engine = paxkv.Engine(MODEL, max_seqs=2, max_len=WIDTH, page_size=4)
        results = []
        for p in prompts:
            rid = engine.submit(p, max_new_tokens=3, stop_token_ids=[])
            results.append(engine.run()[rid])
        assert results[1].num_cached_tokens == 8
        engine.clear_prefix_cache()
        assert int(engine.cache.free_pages()) == engine.cache.num_pages
        return [r.token_ids for r in results]

    jitted = run()
    with jax.disable_jit():
        eager = run()
    assert eager == jitted == [reference_greedy(MODEL, p, 3) for p in prompts]


def test_generate_equals_cacheless_greedy():
    out = paxkv.generate(MODEL, PROMPTS[:2], max_new_tokens=4, stop_token_ids=[], page_size=4)
    assert [r.token_ids for r in out] == [reference_greedy(MODEL, p, 4) for p in PROMPTS[:2]]


def test_the_protocol_is_checked():
    assert isinstance(MODEL, Model)
    check_model(MODEL)

    class NoForward:
        num_layers, num_kv_heads, head_dim, vocab_size, params = 2, 2, 16, 97, {}

    assert not isinstance(NoForward(), Model)
    with pytest.raises(TypeError, match="forward"):
        check_model(NoForward())
    with pytest.raises(TypeError, match="forward"):
        paxkv.Engine(NoForward(), max_seqs=1, max_len=8)


def test_engine_sizes_accept_numpy_ints_and_name_a_bad_one():
    """A size computed with numpy (``max(lengths) + n``) is an int; a bad size's error names the
    argument the caller passed (it used to name ``max_pages_per_seq``, which nobody passes)."""
    engine = paxkv.Engine(MODEL, max_seqs=np.int64(2), max_len=np.int64(40),
                          page_size=np.int32(8), num_pages=np.int64(10))
    assert (engine.cache.max_seqs, engine.cache.num_pages) == (2, 10)
    for name, value in (("max_len", 0), ("max_seqs", 2.5), ("page_size", None)):
        with pytest.raises(ValueError, match=f"{name} must be an int >= 1"):
            paxkv.Engine(MODEL, **{"max_seqs": 2, "max_len": 40, name: value})
