"""Token sampling: what a user asks for (:class:`SamplingParams`, host side) and how each row
draws inside jit (:class:`RowSampling`, arrays: greedy, temperature, top-k and top-p).

Each row carries its own settings as arrays, so requests with different settings share one
compiled step. Each row's randomness comes from ``fold_in(key(seed), position)``: the same
request draws the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """What one request asks for; the same object (or the same keywords) for
    :func:`paxkv.generate`, :meth:`paxkv.Engine.submit` and :meth:`paxkv.Engine.fork`.

    Attributes:
      max_new_tokens: tokens to generate (fewer if a stop token comes).
      temperature: 0 is greedy; top_k, top_p: None is off.
      seed: request ``i`` of an engine samples from ``fold_in(PRNGKey(seed), i)``.
      n: samples of the prompt: one prefill, forked into ``n`` rows sharing its pages.
      stop_token_ids: tokens that end a sequence; None: the model's EOS ids; ``()``: none.
      logprobs: None (off: nothing computed) or ``k >= 0``: return each generated token's
        log-probability and the ``k`` most likely alternatives at each step, in the engine's
        ``logprobs_mode`` (:func:`mode_logits`: "raw", the model's own, by default).
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    n: int = 1
    stop_token_ids: tuple[int, ...] | None = None
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        validate(self.temperature, self.top_k, self.top_p)
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int)
                                          or self.logprobs < 0):
            raise ValueError(f"logprobs must be None or an int >= 0, got {self.logprobs!r}")
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids",
                               tuple(int(t) for t in self.stop_token_ids))

    @classmethod
    def of(cls, params: "SamplingParams | None", **overrides: Any) -> "SamplingParams":
        """``params`` (default: all defaults) with the keyword forms applied on top; keywords
        left None keep ``params``' value."""
        base = params if params is not None else cls()
        if not isinstance(base, SamplingParams):
            raise TypeError(f"params must be a paxkv.SamplingParams, got {type(base).__name__}")
        given = {k: v for k, v in overrides.items() if v is not None}
        return dataclasses.replace(base, **given) if given else base

    def stops(self, model: Any) -> frozenset[int]:
        """The stop ids for ``model``: its EOS ids unless ``stop_token_ids`` says otherwise."""
        if self.stop_token_ids is not None:
            return frozenset(self.stop_token_ids)
        return frozenset(int(t) for t in getattr(model, "eos_token_ids", ()))

    def key_data(self, request_id: int, key: jax.Array | None = None) -> np.ndarray:
        """uint32 key data request ``request_id`` samples from: ``key`` (a raw or typed PRNG
        key) if given, else ``fold_in(PRNGKey(seed), request_id)``."""
        if key is None:
            key = jax.random.fold_in(jax.random.PRNGKey(self.seed), request_id)
        elif jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.key_data(key)
        return np.asarray(key, np.uint32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSampling:
    """Per-row sampling settings inside jit (all ``[batch]``).

    Attributes:
      temperature: float32; 0 means greedy.
      top_k: int32; 0 means off.
      top_p: float32; 1 means off.
      seed: uint32 key data ``[batch, 2]`` (``jax.random.key_data`` of each row's key).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array


def validate(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Checks sampling values at the Python boundary, naming what to change."""
    if not (temperature >= 0.0):
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be None or in (0, 1], got {top_p!r}")


def make_params(batch: int, *, temperature: float = 0.0, top_k: int | None = None,
                top_p: float | None = None, seeds: list[int] | None = None) -> RowSampling:
    """The same settings for every row; ``seeds`` (one int per row) default to 0."""
    validate(temperature, top_k, top_p)
    seeds = [0] * batch if seeds is None else seeds
    keys = jnp.stack([jax.random.key_data(jax.random.PRNGKey(s)) for s in seeds])
    return RowSampling(
        temperature=jnp.full((batch,), temperature, jnp.float32),
        top_k=jnp.full((batch,), top_k or 0, jnp.int32),
        top_p=jnp.full((batch,), 1.0 if top_p is None else top_p, jnp.float32),
        seed=keys.astype(jnp.uint32))


def _filtered_logits(logits: jax.Array, params: RowSampling) -> jax.Array:
    """Temperature-scaled logits with everything outside top-k / top-p set to -inf."""
    scaled = logits / jnp.maximum(params.temperature, 1e-6)[:, None]
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    vocab = logits.shape[-1]
    k = jnp.where(params.top_k > 0, jnp.minimum(params.top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays). NOTE:
    # top_p 1 keeps every token: a float32 cumsum reaches 1.0 before a long tail ends.
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = (mass_before < params.top_p[:, None]) | (params.top_p[:, None] >= 1.0)
    cutoff = jnp.min(jnp.where(keep_sorted, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    threshold = jnp.maximum(kth, cutoff)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


NON_FINITE = -1  # the token a row whose logits are not all finite gets: no sample is drawn


def sample(logits: jax.Array, positions: jax.Array, params: RowSampling | None) -> jax.Array:
    """Next tokens: logits float32 ``[batch, vocab]``, positions int32 ``[batch]`` (the position
    the token will take, for the key) -> int32 ``[batch]``.

    ``params=None`` is greedy for every row and compiles to an argmax alone. Otherwise the sort
    that top-k / top-p need runs only when some row samples (a ``lax.cond``). A row whose
    logits hold a NaN or an infinity (diverged weights) gets :data:`NON_FINITE` in place of a
    token: one reduction over the logits the argmax reads anyway, so a caller ends that row
    instead of feeding it garbage.
    """
    finite = jnp.all(jnp.isfinite(logits), axis=-1)
    return jnp.where(finite, _draw(logits, positions, params), NON_FINITE)


def _draw(logits: jax.Array, positions: jax.Array, params: RowSampling | None) -> jax.Array:
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if params is None:
        return greedy

    def draw(_):
        keys = jax.vmap(lambda kd, p: jax.random.fold_in(jax.random.wrap_key_data(kd), p))(
            params.seed, positions)
        filtered = _filtered_logits(logits, params)
        drawn = jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)
        return jnp.where(params.temperature > 0, drawn, greedy)

    return jax.lax.cond(jnp.any(params.temperature > 0), draw, lambda _: greedy, None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sampled:
    """Sampled tokens with their log-probabilities (what a step returns when asked for them).

    Attributes:
      tokens: int32 ``[b]``.
      logprobs: float32 ``[b]``: each token's log-probability (in the step's mode:
        :func:`mode_logits`).
      top_ids: int32 ``[b, k]``; top_logprobs: float32 ``[b, k]``: the ``k`` most likely
        tokens at that step, most likely first.
    """

    tokens: jax.Array
    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


LOGPROBS_MODES = ("raw", "temperature", "processed")


def check_logprobs_mode(mode: str) -> str:
    """``mode`` if it is one of :data:`LOGPROBS_MODES`; a ``ValueError`` naming them otherwise."""
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {mode!r}")
    return mode


def mode_logits(logits: jax.Array, params: RowSampling | None, mode: str) -> jax.Array:
    """The logits whose log-softmax a ``mode`` reports: float32 ``[..., vocab]`` -> same shape.

    * ``"raw"``: the model's logits (its own distribution);
    * ``"temperature"``: divided by each row's temperature;
    * ``"processed"``: the distribution the token was drawn from: after the temperature,
      everything outside top-k / top-p set to ``-inf`` (renormalised by the log-softmax).

    ``params`` fields are ``[batch]`` and broadcast over any axes between batch and vocab (a
    trainer's ``[batch, t, vocab]``). A greedy row (temperature 0) draws no sample: every mode
    reports the raw distribution for it, as does every row when ``params`` is None. The
    sampler (:func:`with_logprobs`) and the trainer (:mod:`paxkv.rl.logprobs`) both call
    this, so they agree on the definition by construction.
    """
    logits = logits.astype(jnp.float32)
    check_logprobs_mode(mode)
    if mode == "raw" or params is None:
        return logits
    lead = (slice(None),) + (None,) * (logits.ndim - 1)
    sampled = (params.temperature > 0)[lead]
    if mode == "temperature":
        return jnp.where(sampled, logits / jnp.maximum(params.temperature, 1e-6)[lead], logits)
    flat = logits.reshape(logits.shape[0], -1, logits.shape[-1])  # [b, t, vocab]
    filtered = jax.vmap(_filtered_logits, in_axes=(1, None), out_axes=1)(flat, params)
    return jnp.where(sampled, filtered.reshape(logits.shape), logits)


def with_logprobs(logits: jax.Array, tokens: jax.Array, k: int,
                  params: RowSampling | None = None, mode: str = "raw") -> Sampled:
    """``tokens`` int32 ``[b]`` drawn from ``logits`` float32 ``[b, vocab]`` with their
    log-probabilities under ``mode`` (:func:`mode_logits`) and the top ``k`` (static)
    alternatives in the same mode; the full-vocabulary log-softmax stays inside jit, only
    ``[b]`` and ``[b, k]`` values leave it. A token of -1 (non-finite logits) reports NaN."""
    logp = jax.nn.log_softmax(mode_logits(logits, params, mode), axis=-1)
    chosen = jnp.take_along_axis(logp, jnp.maximum(tokens, 0)[:, None], axis=-1)[:, 0]
    top_logprobs, top_ids = jax.lax.top_k(logp, k)
    return Sampled(tokens, jnp.where(tokens >= 0, chosen, jnp.nan), top_ids.astype(jnp.int32),
                   top_logprobs)
