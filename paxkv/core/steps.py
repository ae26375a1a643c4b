"""Jitted prefill and decode steps over either cache, with the cache donated.

A step is ``reserve -> forward -> sample`` in one compiled function, so the page table, the
pool update and the model run without a host round trip. The cache argument is donated: the
pool arrays are updated in place and the caller must use the returned cache.

``forward`` is a :class:`paxkv.core.protocol.Model`'s ``forward(params, tokens, step, cache) ->
(logits, cache)``, passed as a static argument so one compiled step serves every call with the
same shapes. ``plan`` (static) is the step's :class:`~paxkv.core.plan.AttentionPlan`: hints
the cache checks, so any plan gives the same tokens.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from paxkv.core.plan import NO_PLAN, AttentionPlan
from paxkv.core.protocol import KVCache
from paxkv.core.sampling import RowSampling, Sampled, sample, with_logprobs
from paxkv.core.step_info import StepInfo

Forward = Callable[[Any, jax.Array, StepInfo, KVCache], tuple[jax.Array, KVCache]]
Cache = KVCache


def _sampled(logits: jax.Array, positions: jax.Array, sampling: RowSampling | None,
             logprobs: int | None, mode: str = "raw") -> jax.Array | Sampled:
    tokens = sample(logits, positions, sampling)
    if logprobs is None:
        return tokens
    return with_logprobs(logits, tokens, logprobs, sampling, mode)


@functools.partial(jax.jit, static_argnames=("forward", "plan", "logprobs", "logprobs_mode"),
                   donate_argnames=("cache",))
def prefill_step(forward: Forward, params: Any, cache: Cache, tokens: jax.Array,
                 rows: jax.Array, query_lengths: jax.Array, sampling: RowSampling | None, *,
                 plan: AttentionPlan = NO_PLAN, logprobs: int | None = None,
                 logprobs_mode: str = "raw"
                 ) -> tuple[Cache, jax.Array | Sampled, jax.Array, jax.Array]:
    """Appends a chunk of prompt tokens to some rows and samples each row's next token.

    Args:
      tokens: int32 ``[b, t]``, left-aligned; row ``i`` has ``query_lengths[i]`` real tokens.
      rows: int32 ``[b]``: cache rows (padding rows repeat a row with ``query_lengths`` 0).
      query_lengths: int32 ``[b]``.
      sampling: per batch row ``[b]``.
      logprobs: None, or ``k``: return :class:`paxkv.core.sampling.Sampled` (the tokens with their
        log-probabilities and top ``k``) in place of the tokens.
      logprobs_mode: "raw", "temperature" or "processed" (:func:`paxkv.core.sampling.mode_logits`).

    Returns:
      ``(cache, next_tokens [b], ok [b], free_pages)``; a row whose reserve failed is unchanged
      and its token is meaningless; a row whose logits were not finite gets the token
      :data:`paxkv.core.sampling.NON_FINITE` (-1).
    """
    num_new = jnp.zeros((cache.max_seqs,), jnp.int32).at[rows].add(query_lengths)
    cache, ok_rows = cache.reserve(num_new, max_new=tokens.shape[1])
    ok = ok_rows[rows]
    step = StepInfo.make(cache.lengths[rows], jnp.where(ok, query_lengths, 0), tokens.shape[1],
                         rows=rows, plan=plan)
    logits, cache = forward(params, tokens, step, cache)
    next_tokens = _sampled(logits, step.lengths, sampling, logprobs, logprobs_mode)
    return cache, next_tokens, ok, cache.free_pages()


def _decode(forward: Forward, params: Any, cache: Cache, tokens: jax.Array, live: jax.Array,
            sampling: RowSampling | None, plan: AttentionPlan, logprobs: int | None = None,
            mode: str = "raw"):
    cache, ok = cache.reserve(live.astype(jnp.int32), max_new=1)
    ok = ok & live
    step = StepInfo.make(cache.lengths, ok.astype(jnp.int32), 1, plan=plan)
    logits, cache = forward(params, tokens[:, None], step, cache)
    return cache, _sampled(logits, step.lengths, sampling, logprobs, mode), ok


@functools.partial(jax.jit, static_argnames=("forward", "plan", "logprobs", "logprobs_mode"),
                   donate_argnames=("cache",))
def decode_step(forward: Forward, params: Any, cache: Cache, tokens: jax.Array,
                live: jax.Array, sampling: RowSampling | None, *,
                plan: AttentionPlan = NO_PLAN, logprobs: int | None = None,
                logprobs_mode: str = "raw"
                ) -> tuple[Cache, jax.Array | Sampled, jax.Array, jax.Array]:
    """One token for every live row of the cache.

    Args:
      tokens: int32 ``[max_seqs]``: each row's last token (fed now).
      live: bool ``[max_seqs]``: rows that decode this step.
      sampling: per cache row ``[max_seqs]``.
      logprobs, logprobs_mode: as :func:`prefill_step`'s.

    Returns:
      ``(cache, next_tokens [max_seqs], ok [max_seqs], free_pages)``; ``ok`` is False for idle
      rows and for rows the pool had no page for (those are left unchanged); non-finite
      logits give the token -1 as in :func:`prefill_step`.
    """
    cache, next_tokens, ok = _decode(forward, params, cache, tokens, live, sampling, plan,
                                     logprobs, logprobs_mode)
    return cache, next_tokens, ok, cache.free_pages()


@functools.partial(jax.jit, static_argnames=("forward", "max_new_tokens", "plan"),
                   donate_argnames=("cache",))
def decode_loop(forward: Forward, params: Any, cache: Cache, first_tokens: jax.Array,
                limits: jax.Array, stop_ids: jax.Array, stop_mask: jax.Array,
                sampling: RowSampling | None, *, max_new_tokens: int,
                plan: AttentionPlan = NO_PLAN):
    """The fully jitted decode loop for a fixed batch (``lax.while_loop``, reserve inside).

    Args:
      first_tokens: int32 ``[max_seqs]``: the token each row sampled at prefill (output 0).
      limits: int32 ``[max_seqs]``: tokens each row may generate (0 = idle row).
      stop_ids: int32 ``[n]``; stop_mask: bool ``[max_seqs, n]``: which ids end which row.
      max_new_tokens: static width of the output buffer (``>= max(limits)``).

    Returns:
      ``(cache, tokens [max_seqs, max_new_tokens], num_tokens [max_seqs], out_of_pages
      [max_seqs])``: row ``b`` generated ``tokens[b, :num_tokens[b]]`` (a stop token included);
      ``out_of_pages`` marks rows stopped early because the pool ran dry. A row whose logits
      were not finite stops with the token -1 as its last (counted) token.
    """
    s = first_tokens.shape[0]
    rows = jnp.arange(s)

    def is_stop(tokens):
        return jnp.any((tokens[:, None] == stop_ids[None, :]) & stop_mask, axis=1)

    out = jnp.zeros((s, max_new_tokens), jnp.int32).at[:, 0].set(first_tokens)
    count = jnp.minimum(limits, 1)
    running = (count > 0) & ~is_stop(first_tokens) & (first_tokens >= 0) & (count < limits)

    def body(carry):
        cache, out, count, running, dry = carry
        last = out[rows, jnp.maximum(count - 1, 0)]
        cache, nxt, ok = _decode(forward, params, cache, last, running, sampling,
                                 plan)
        dry = dry | (running & ~ok)
        out = out.at[rows, jnp.where(ok, count, max_new_tokens)].set(nxt, mode="drop")
        count = count + ok.astype(jnp.int32)
        running = ok & ~is_stop(nxt) & (nxt >= 0) & (count < limits)
        return cache, out, count, running, dry

    cache, out, count, _, dry = jax.lax.while_loop(
        lambda c: jnp.any(c[3]), body, (cache, out, count, running, jnp.zeros((s,), bool)))
    return cache, out, count, dry
