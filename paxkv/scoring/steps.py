"""The scoring steps: pure functions over the cache that append tokens and score them.

Two steps, both ``reserve -> forward -> log-softmax -> gather`` in one function, so the full
``[b, t, vocab]`` distribution never leaves the compiled step (only the gathered log-probs and
the argmax flags do):

* :func:`score_step`: teacher forcing. Row ``i`` appends ``tokens[i, :n_i]`` and gets the
  log-probability of ``targets[i, j]`` at every fed position ``j`` (the token that follows
  ``tokens[i, j]``). Needs a forward that returns logits at every position
  (:func:`all_logits`).
* :func:`score_last_step`: a context's last chunk. Each row gets the log-probabilities of a few
  ``candidates`` after its last fed token (the first token of each continuation), from the
  model's ordinary last-position logits.

Both are pure: call them inside your own ``jax.jit`` with the cache donated (the README's
"Scoring" section), or through the donated wrappers at the bottom (what :func:`paxkv.score`
uses)::

    tokens  [b, t]   row i: ctx[-1] c0 c1 .. (padding)     fed now, n_i real
    targets [b, t]   row i: c0      c1 c2 .. (ignored)     the token after each fed one
    logprobs[b, t] = log p(targets[i, j] | row i's cache, tokens[i, :j+1]); 0 at padding
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable

import jax
import jax.numpy as jnp

from paxkv.core.packing import Packing
from paxkv.core.plan import NO_PLAN, AttentionPlan
from paxkv.core.protocol import KVCache
from paxkv.core.step_info import StepInfo
from paxkv.core.program_key import forward_key

Forward = Callable[[Any, jax.Array, StepInfo, KVCache], tuple[jax.Array, KVCache]]


@dataclasses.dataclass(frozen=True)
class AllLogits:
    """``model.forward`` with logits at every position, ``[b, t, vocab]``: a hashable static
    argument (equal for the same model, so one compiled step serves every call).

    A model whose ``forward`` takes ``all_logits=True`` (paxkv's Llama) runs once per step; any
    other :class:`paxkv.core.protocol.Model` gives only its last position, so it scores one token per
    row per step (``width == 1``; a wider step raises at trace time)."""

    model: Any

    @property
    def packs(self) -> bool:
        """Whether the model can return a packing step's logits packed
        (``forward(..., packed_logits=True)``, :meth:`packed`): then a continuation step's
        vocab projection and log-softmax run over its real tokens only."""
        return _takes(self.model, "packed_logits")

    def packed(self, params: Any, tokens: jax.Array, step: StepInfo,
               cache: KVCache) -> tuple[jax.Array, KVCache]:
        """The logits ``[1, T, vocab]`` of a step that packs ``T`` tokens
        (:meth:`paxkv.core.packing.Packing.of`), in packed order."""
        return self.model.forward(params, tokens, step, cache, all_logits=True,
                                  packed_logits=True)

    def program_key(self) -> str | None:
        """The model's forward key (:func:`paxkv.core.program_key.forward_key`), or None."""
        return forward_key(self.model.forward)

    @property
    def width_limit(self) -> int | None:
        """The widest step this forward can score (None: any)."""
        return None if _takes(self.model, "all_logits") else 1

    def __call__(self, params: Any, tokens: jax.Array, step: StepInfo,
                 cache: KVCache) -> tuple[jax.Array, KVCache]:
        if _takes(self.model, "all_logits"):
            return self.model.forward(params, tokens, step, cache, all_logits=True)
        if tokens.shape[1] != 1:
            raise ValueError(f"{type(self.model).__name__}.forward has no all_logits=True: it "
                             "scores one token per row per step (tokens must be [b, 1])")
        logits, cache = self.model.forward(params, tokens, step, cache)
        return logits[:, None], cache


def _takes(model: Any, keyword: str) -> bool:
    """Whether ``model.forward`` has the keyword ``keyword``."""
    try:
        return keyword in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def all_logits(model: Any) -> AllLogits:
    """The forward :func:`score_step` needs: ``model``'s, with logits at every position."""
    return AllLogits(model)


def gather_logprobs(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """float32 logits ``[..., vocab]`` and int32 ``targets [..., k]`` -> the targets'
    log-probabilities ``[..., k]`` (float32) and whether each is the argmax (bool ``[..., k]``)."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    picked = jnp.take_along_axis(logits, targets, axis=-1)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)[..., None] == targets
    return picked - lse, greedy


def _reserve_rows(cache: KVCache, rows: jax.Array, query_lengths: jax.Array, t: int,
                  plan: AttentionPlan) -> tuple[KVCache, StepInfo, jax.Array]:
    """Room for ``query_lengths`` more tokens in cache rows ``rows`` (padding rows repeat a row
    with length 0) -> the cache, the step's positions and ``ok [b]``."""
    num_new = jnp.zeros((cache.max_seqs,), jnp.int32).at[rows].add(query_lengths)
    cache, ok_rows = cache.reserve(num_new, max_new=t)
    ok = ok_rows[rows]
    step = StepInfo.make(cache.lengths[rows], jnp.where(ok, query_lengths, 0), t, rows=rows,
                         plan=plan)
    return cache, step, ok


def score_step(forward: Forward, params: Any, cache: KVCache, tokens: jax.Array,
               rows: jax.Array, query_lengths: jax.Array, targets: jax.Array, *,
               plan: AttentionPlan = NO_PLAN
               ) -> tuple[KVCache, jax.Array, jax.Array, jax.Array]:
    """Appends ``tokens`` to cache rows and scores ``targets`` teacher-forced (pure).

    Args:
      forward: logits at every position (:func:`all_logits`).
      tokens: int32 ``[b, t]``, left-aligned: row ``i`` feeds ``query_lengths[i]`` real tokens.
      rows: int32 ``[b]``: the cache row of each batch row (padding rows repeat a row, with
        ``query_lengths`` 0).
      query_lengths: int32 ``[b]``.
      targets: int32 ``[b, t]``: the token expected after each fed token.
      plan: the step's static attention hints (checked by the cache); with
        ``packed_tokens`` and a forward that :attr:`~AllLogits.packs`, the logits come packed
        and only the real tokens are projected and scored.

    Returns:
      ``(cache, logprobs [b, t] float32, greedy [b, t] bool, ok [b] bool)``: padding positions
      give log-prob 0 and greedy True, so ``logprobs.sum(-1)`` and ``greedy.all(-1)`` are the
      rows' totals; a row whose reserve failed (``ok`` False) is left unchanged.
    """
    cache, step, ok = _reserve_rows(cache, rows, query_lengths, tokens.shape[1], plan)
    pack = Packing.of(step.valid, plan.packed_tokens) if getattr(forward, "packs", False) else None
    if pack is None:
        logits, cache = forward(params, tokens, step, cache)  # [b, t, vocab]
        logprobs, greedy = gather_logprobs(logits, targets[..., None])
        logprobs, greedy = logprobs[..., 0], greedy[..., 0]
    else:  # [1, T, vocab]: the vocab matmul and log-softmax skip the padding
        logits, cache = forward.packed(params, tokens, step, cache)
        logprobs, greedy = gather_logprobs(logits[0], pack.pack(targets)[0, :, None])
        logprobs, greedy = pack.unpack(logprobs[None, :, 0]), pack.unpack(greedy[None, :, 0])
    valid = step.valid
    return cache, jnp.where(valid, logprobs, 0.0), greedy | ~valid, ok


def score_last_step(forward: Forward, params: Any, cache: KVCache, tokens: jax.Array,
                    rows: jax.Array, query_lengths: jax.Array, candidates: jax.Array, *,
                    plan: AttentionPlan = NO_PLAN
                    ) -> tuple[KVCache, jax.Array, jax.Array, jax.Array]:
    """Appends ``tokens`` (a context chunk) to cache rows and scores ``candidates`` after each
    row's last fed token (pure).

    Args:
      forward: the model's ordinary forward (logits ``[b, vocab]`` at the last real token).
      tokens, rows, query_lengths: as in :func:`score_step`.
      candidates: int32 ``[b, k]``: tokens to score after the last fed one (padding: any id).

    Returns:
      ``(cache, logprobs [b, k] float32, greedy [b, k] bool, ok [b] bool)``.
    """
    cache, step, ok = _reserve_rows(cache, rows, query_lengths, tokens.shape[1], plan)
    logits, cache = forward(params, tokens, step, cache)  # [b, vocab]
    logprobs, greedy = gather_logprobs(logits, candidates)
    return cache, logprobs, greedy, ok


# -- the donated, jitted forms the scorer calls (the pool is updated in place) ----------------
@functools.partial(jax.jit, static_argnames=("forward", "plan"), donate_argnames=("cache",))
def scored(forward: Forward, params: Any, cache: KVCache, tokens: jax.Array, rows: jax.Array,
           query_lengths: jax.Array, targets: jax.Array, *, plan: AttentionPlan = NO_PLAN):
    """:func:`score_step`, jitted with the cache donated; adds the free pages after it."""
    cache, logprobs, greedy, ok = score_step(forward, params, cache, tokens, rows,
                                             query_lengths, targets, plan=plan)
    return cache, logprobs, greedy, ok, cache.free_pages()


@functools.partial(jax.jit, static_argnames=("forward", "plan"), donate_argnames=("cache",))
def scored_last(forward: Forward, params: Any, cache: KVCache, tokens: jax.Array,
                rows: jax.Array, query_lengths: jax.Array, candidates: jax.Array, *,
                plan: AttentionPlan = NO_PLAN):
    """:func:`score_last_step`, jitted with the cache donated; adds the free pages after it."""
    cache, logprobs, greedy, ok = score_last_step(forward, params, cache, tokens, rows,
                                                  query_lengths, candidates, plan=plan)
    return cache, logprobs, greedy, ok, cache.free_pages()
