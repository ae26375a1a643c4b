"""The trainer's per-token log-probabilities of sampled completions, in the sampler's definition.

A GRPO / PPO loss weighs each completion token by ``exp(logp_trainer - logp_sampler)``, so the
trainer's log-probabilities must equal the engine's for the same weights up to float noise
(~1e-5 nats in float32). They agree by construction, not by tuning:

* **the same forward**: :func:`token_logprobs` runs ``model.forward`` (the code the engine's
  prefill and decode steps run) over ``prompt ++ completion`` in one cache-less pass
  (:class:`paxkv.cache.full.NoCache`, the reference every cache is tested equal to), with the
  model's sliding windows;
* **the same mode**: the logits go through :func:`paxkv.core.sampling.mode_logits`, the
  function the engine's ``logprobs_mode`` calls (:func:`paxkv.core.sampling.with_logprobs`),
  with the rows' :class:`~paxkv.core.sampling.RowSampling`. The two agree in every mode:
  ``"raw"`` (the model's own distribution; what a policy-gradient loss differentiates),
  ``"temperature"`` (divided by each row's temperature: the sampler's distribution when it
  used no top-k / top-p) and ``"processed"`` (the distribution the token was drawn from).
  A greedy row (temperature 0) reports ``"raw"`` in every mode, on both sides.

NOTE: in ``"processed"`` a token outside the row's top-k / top-p set has log-probability
``-inf``. The two forwards differ by float noise, so a token at the edge of the set can be in
the sampler's set and out of the trainer's: use ``"raw"`` or ``"temperature"`` for a loss.

How a row is laid out (prompt left- or right-padded, completion right-padded)::

    prompt_tokens  [B, P]    row b:  _  _  p0 p1 p2          prompt_mask says which are real
    completion     [B, C]    row b:  c0 c1 c2 _              completion_mask: which are scored
    tokens         [B, P+C]  row b:  p0 p1 p2 c0 c1 c2 _  _  _    (join_rows: n_b = 3, C fed)
    logits at position n_b - 1 + j predict c_j                (c0 <- p2, c1 <- c0, ...)

Every completion slot is fed (its padding too: a causal model's earlier positions never see
it); only the masked ones are scored. Memory: the forward returns the logits of every position,
``B * (P + C) * vocab * 4`` bytes (8 rows of 1,024 tokens at SmolLM2's 49,152 vocab: 1.6 GB),
and ``jax.grad`` keeps as much again; ``row_chunk=k`` runs ``k`` rows at a time under
``jax.checkpoint`` (the backward pass recomputes each chunk), so the peak is ``k`` rows' worth.
``"raw"`` costs one log-sum-exp over the completion positions' logits; ``"processed"`` sorts
each of them (``B * C`` sorts of the vocabulary).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from paxkv.cache.full import NoCache
from paxkv.core.sampling import LOGPROBS_MODES, RowSampling, mode_logits
from paxkv.core.step_info import StepInfo
from paxkv.scoring.steps import AllLogits, all_logits


def join_rows(prompt_tokens: jax.Array, prompt_mask: jax.Array,
              completion_tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's real prompt tokens (in order) followed by its whole completion, left-aligned.

    Args:
      prompt_tokens: int ``[B, P]``; prompt_mask: bool ``[B, P]``, True at the real tokens
        (any layout: left- or right-padded, or holes; the real ones are kept in order).
      completion_tokens: int ``[B, C]``.

    Returns:
      ``(tokens int32 [B, P + C], prompt_lengths int32 [B])``: row ``b`` holds its
      ``prompt_lengths[b]`` prompt tokens, then its ``C`` completion tokens, then zeros.
      One stable argsort and two gathers: jittable, no loop over rows.
    """
    b, p = prompt_tokens.shape
    c = completion_tokens.shape[1]
    order = jnp.argsort(~prompt_mask, axis=1, stable=True)  # real slots first, in order
    prompt = jnp.take_along_axis(prompt_tokens.astype(jnp.int32), order, axis=1)
    prompt_lengths = jnp.sum(prompt_mask, axis=1, dtype=jnp.int32)
    both = jnp.concatenate([prompt, completion_tokens.astype(jnp.int32)], axis=1)  # [B, P+C]
    t = jnp.arange(p + c, dtype=jnp.int32)[None, :]
    n = prompt_lengths[:, None]
    source = jnp.where(t < n, t, p + t - n)  # prompt slot, else completion slot p + (t - n)
    tokens = jnp.take_along_axis(both, jnp.minimum(source, p + c - 1), axis=1)
    return jnp.where(t < n + c, tokens, 0), prompt_lengths


def _chosen_logprobs(logits: jax.Array, tokens: jax.Array, sampling: RowSampling | None,
                     mode: str) -> jax.Array:
    """float32 logits ``[b, C, vocab]``, int32 tokens ``[b, C]`` -> ``[b, C]``: each token's
    log-probability under ``mode`` (a log-sum-exp and a gather: no ``[b, C, vocab]``
    log-softmax is kept beyond what the gradient needs)."""
    z = mode_logits(logits, sampling, mode)
    picked = jnp.take_along_axis(z, tokens[..., None], axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(z, axis=-1)


def _rows_logprobs(forward: AllLogits, windows: tuple[int | None, ...] | None, mode: str,
                   params: Any, tokens: jax.Array, prompt_lengths: jax.Array,
                   completion_tokens: jax.Array, sampling: RowSampling | None) -> jax.Array:
    """One forward over joined rows (:func:`join_rows`) -> float32 ``[b, C]`` (unmasked;
    NaN where a row with an empty prompt has nothing to predict its first token from)."""
    t, c = tokens.shape[1], completion_tokens.shape[1]
    n = prompt_lengths + c  # every completion slot is fed
    logits, _ = forward(params, tokens, StepInfo.make(n, n, t), NoCache(layer_windows=windows))
    where = prompt_lengths[:, None] - 1 + jnp.arange(c, dtype=jnp.int32)[None, :]  # [b, C]
    picked = jnp.take_along_axis(logits, jnp.maximum(where, 0)[..., None], axis=1)  # [b, C, V]
    logprobs = _chosen_logprobs(picked, completion_tokens.astype(jnp.int32), sampling, mode)
    return jnp.where(where >= 0, logprobs, jnp.nan)


def token_logprobs(model: Any, params: Any, prompt_tokens: jax.Array, prompt_mask: jax.Array,
                   completion_tokens: jax.Array, completion_mask: jax.Array,
                   sampling: RowSampling | None = None, *, mode: str = "raw",
                   row_chunk: int | None = None) -> jax.Array:
    """Each completion token's log-probability under ``params``: float32 ``[B, C]``.

    Pure, jittable with ``model``, ``mode`` and ``row_chunk`` static (or :func:`logprobs_fn`),
    and differentiable w.r.t. ``params``. The checks read shapes and dtypes only, so they run
    at trace time and raise ``ValueError`` at the Python boundary, jitted or not.

    Args:
      model: a :class:`paxkv.core.protocol.Model` whose ``forward`` takes ``all_logits=True``
        (hashable: a static argument); its ``layer_windows`` are applied.
      params: the pytree ``model.forward`` takes (``model.params`` or the trainer's copy).
      prompt_tokens: int ``[B, P]``; prompt_mask: bool ``[B, P]``, True at real tokens (left-
        padded as Tunix lays them out, right-padded, either). A row needs one real token:
        with none, its first completion token gets NaN.
      completion_tokens: int ``[B, C]``; completion_mask: bool ``[B, C]``, True at the tokens
        to score (right-padded: real tokens first).
      sampling: each row's settings ``[B]`` (the ones it was sampled with), or None: every
        row greedy, so every mode is ``"raw"``.
      mode: ``"raw"``, ``"temperature"`` or ``"processed"``
        (:func:`paxkv.core.sampling.mode_logits`; the engine's ``logprobs_mode``).
      row_chunk: None (one forward over all rows) or ``k`` dividing ``B``: ``k`` rows per
        forward under ``jax.checkpoint``, bounding the logits' memory (module docstring).

    Returns:
      float32 ``[B, C]``: ``log p(c_j | prompt, c_<j)``; 0 where ``completion_mask`` is False.
    """
    prompt_tokens, prompt_mask, completion_tokens, completion_mask = map(
        jnp.asarray, (prompt_tokens, prompt_mask, completion_tokens, completion_mask))
    forward = _check(model, prompt_tokens, prompt_mask, completion_tokens, completion_mask,
                     sampling, mode, row_chunk)
    tokens, prompt_lengths = join_rows(prompt_tokens, prompt_mask, completion_tokens)
    rows = functools.partial(_rows_logprobs, forward, getattr(model, "layer_windows", None),
                             mode, params)
    args = (tokens, prompt_lengths, completion_tokens, sampling)
    b = tokens.shape[0]
    if row_chunk is None or row_chunk == b:
        logprobs = rows(*args)
    else:  # [B/k, k, ...] chunks, each recomputed in the backward pass
        chunked = jax.tree.map(lambda x: x.reshape(b // row_chunk, row_chunk, *x.shape[1:]), args)
        logprobs = jax.lax.map(lambda a: jax.checkpoint(rows)(*a), chunked)
        logprobs = logprobs.reshape(b, -1)
    return jnp.where(completion_mask, logprobs, 0.0)


_jitted = jax.jit(token_logprobs, static_argnames=("model", "mode", "row_chunk"))


def logprobs_fn(model: Any, *, mode: str = "raw", row_chunk: int | None = None
                ) -> Callable[..., jax.Array]:
    """:func:`token_logprobs` jitted for ``model``: ``fn(params, prompt_tokens, prompt_mask,
    completion_tokens, completion_mask, sampling=None) -> float32 [B, C]``. Compiles once per
    input shapes; ``jax.grad`` / ``jax.value_and_grad`` of a loss over it work as over any
    jitted function."""
    _check_mode(mode)
    return functools.partial(_jitted, model, mode=mode, row_chunk=row_chunk)


def _check_mode(mode: str) -> None:
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"mode must be one of {LOGPROBS_MODES} (the engine's logprobs_mode), "
                         f"got {mode!r}")


def _check(model: Any, prompt_tokens: jax.Array, prompt_mask: jax.Array,
           completion_tokens: jax.Array, completion_mask: jax.Array,
           sampling: RowSampling | None, mode: str, row_chunk: int | None) -> AllLogits:
    """Static checks of :func:`token_logprobs`' arguments (shapes, dtypes, settings), each
    ``ValueError`` naming what to change; returns the model's all-positions forward."""
    _check_mode(mode)
    forward = all_logits(model)
    if forward.width_limit is not None:
        raise TypeError(f"{type(model).__name__}.forward has no all_logits=True keyword: the "
                        "trainer needs logits at every position in one pass")
    for name, tokens, mask in (("prompt", prompt_tokens, prompt_mask),
                               ("completion", completion_tokens, completion_mask)):
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"{name}_tokens must be an int array [B, {name[0].upper()}], got "
                             f"{tokens.dtype} {tokens.shape}")
        if mask.shape != tokens.shape:
            raise ValueError(f"{name}_mask must have {name}_tokens' shape {tokens.shape}, got "
                             f"{mask.shape}")
        if mask.dtype != jnp.bool_:
            raise ValueError(f"{name}_mask must be bool (pass mask.astype(bool)), got "
                             f"{mask.dtype}")
    b = prompt_tokens.shape[0]
    if completion_tokens.shape[0] != b:
        raise ValueError(f"completion_tokens has {completion_tokens.shape[0]} rows, "
                         f"prompt_tokens {b}: pass one completion per prompt row (repeat each "
                         "prompt for its group)")
    if sampling is not None:
        if not isinstance(sampling, RowSampling):
            raise ValueError(f"sampling must be a RowSampling or None, got "
                             f"{type(sampling).__name__}")
        for field in ("temperature", "top_k", "top_p"):
            if jnp.shape(getattr(sampling, field)) != (b,):
                raise ValueError(f"sampling.{field} must have shape ({b},) (one per row), got "
                                 f"{jnp.shape(getattr(sampling, field))}")
    if row_chunk is not None and (not isinstance(row_chunk, int) or row_chunk < 1
                                  or b % row_chunk):
        raise ValueError(f"row_chunk must be None or an int >= 1 dividing the batch {b}, got "
                         f"{row_chunk!r}")
    return forward
