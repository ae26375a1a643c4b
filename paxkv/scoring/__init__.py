"""Scoring: log-likelihoods of continuations, each distinct context prefilled once and forked::

    results = paxkv.score(lm, [("The capital of France is", " Paris"),
                               ("The capital of France is", " London")])
    results[0].logprob, results[0].is_greedy, results[0].token_logprobs

A multiple-choice question is one context and K continuations: the context is prefilled once,
its row forked into one row per continuation (they share its pages; the partial last page is
copied on first write) and the continuations are scored teacher-forced, many rows per jitted
step. With the paged cache the prefix cache also shares full pages across contexts (few-shot
examples repeated in every question). ``share=False`` scores every pair on its own.

* :mod:`paxkv.scoring.steps` — the pure scoring steps (call them in your own ``jit``).
* :mod:`paxkv.scoring.requests` — tokenising, truncation, grouping, rolling windows.
* :mod:`paxkv.scoring.scorer` — :class:`Scorer`: the cache and the batches
  (:mod:`~paxkv.scoring.batches`: what each step feeds; :mod:`~paxkv.scoring.shared`: the
  prefix index; :mod:`~paxkv.scoring.results`: what comes back).

May import every layer below it (core, table, cache, scale, prefix, engine). Must not
import :mod:`paxkv.decoding`, :mod:`paxkv.harness` or any model.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax.numpy as jnp
from jax.sharding import Mesh

from pallas_kernels import quant
from paxkv.core import buckets
from paxkv.engine.setup import check_size, default_max_seqs, prompt_ids
from paxkv.scale import mesh as pmesh
from paxkv.scoring.requests import Pair, rolling_windows, token_pairs, truncate
from paxkv.scoring.results import ScoreResult, ScoreStats
from paxkv.scoring.scorer import Scorer
from paxkv.scoring.steps import all_logits, score_last_step, score_step

__all__ = ["Scorer", "ScoreResult", "ScoreStats", "all_logits", "rolling_windows", "score",
           "score_last_step", "score_rolling", "score_step", "scorer_for"]


# Default K/V memory of a scorer's pool when num_pages is not given (rows of long windows would
# otherwise reserve max_seqs full rows: 12 GiB at 32 x 8,192 tokens of the default model).
KV_BUDGET_BYTES = 2 << 30


def scorer_for(lm: Any, pairs: Sequence[Pair], *, cache: str = "paged", share: bool = True,
               page_size: int = 16, max_seqs: int | None = None, num_pages: int | None = None,
               kv_dtype: Any = jnp.float32, attention_impl: str = "auto",
               mesh: Mesh | None = None, compile_cache: str | bool | None = None,
               min_len: int = 128) -> Scorer:
    """A :class:`Scorer` whose rows hold the longest of ``pairs`` (rounded up to a power of
    two >= ``min_len``, so workloads of similar lengths share compiled steps). Without ``num_pages``
    the pool is ``max_seqs`` full rows or :data:`KV_BUDGET_BYTES`, whichever is smaller (a
    dense cache gets fewer rows instead), and at least one full row (on a ``mesh``: per data
    shard, the pool a multiple of the data axis). ``max_seqs``: default 32, on a ``mesh``
    rounded up to a multiple of its data axis."""
    page_size = check_size("page_size", page_size)
    max_seqs = default_max_seqs(max_seqs, mesh)
    longest = max((len(c) + len(x) - 1 for c, x in pairs), default=1)
    max_len = buckets.cdiv(buckets.pow2(max(longest, min_len), 128), page_size) * page_size
    scale_bytes = 4 if quant.format_of(kv_dtype) else 0  # int8 / fp8: a float32 scale each
    token_bytes = (2 * lm.num_layers * lm.num_kv_heads
                   * (lm.head_dim * jnp.dtype(kv_dtype).itemsize + scale_bytes))
    row_pages = max_len // page_size
    budget_pages = KV_BUDGET_BYTES // (token_bytes * page_size)
    if cache == "dense":
        max_seqs = max(1, min(max_seqs, budget_pages // row_pages))
    elif num_pages is None:
        data = 1 if mesh is None else pmesh.axis_sizes(mesh)[0]
        pages = min(max_seqs * row_pages, budget_pages)
        num_pages = data * max(row_pages, pages // data)
    return Scorer(lm, cache=cache, share=share, max_seqs=max_seqs, max_len=max_len,
                  page_size=page_size, num_pages=num_pages, kv_dtype=kv_dtype,
                  attention_impl=attention_impl, mesh=mesh, compile_cache=compile_cache)


def score(lm: Any, requests: Sequence[tuple[Any, Any]], *, cache: str = "paged",
          share: bool = True, page_size: int = 16, max_seqs: int | None = None,
          num_pages: int | None = None, kv_dtype: Any = jnp.float32,
          max_length: int | None = None, attention_impl: str = "auto",
          mesh: Mesh | None = None,
          compile_cache: str | bool | None = None) -> list[ScoreResult]:
    """Log-likelihood of each continuation given its context.

    Args:
      lm: a :class:`paxkv.core.protocol.Model` (``encode`` needed for text).
      requests: ``(context, continuation)`` pairs, both strings or both lists of int token
        ids (float or bool ids are refused). Text is
        split as lm-eval does: ``encode(context + continuation)`` at ``len(encode(context))``.
      cache: "paged" or "dense" (the comparison twin).
      share: prefill each distinct context once and fork it (paged: and share full pages of
        common prefixes through the prefix cache); False scores each pair on its own.
      page_size, num_pages: the pool's layout (``num_pages``: default ``max_seqs`` full rows).
      max_seqs: cache rows (contexts and continuations in flight at once); default 32, on a
        ``mesh`` rounded up to a multiple of its data axis.
      kv_dtype: the K/V dtype (``jnp.bfloat16`` halves the cache).
      max_length: the most tokens the model sees per request: longer contexts are cut from the
        left as lm-eval's hf backend does; a continuation longer than this is an error.
      mesh: a ``("data", "model")`` mesh (:func:`paxkv.scale.mesh.make_mesh`) for the paged cache:
        rows and pages split over ``data`` (``max_seqs`` and ``num_pages`` must divide by it),
        each context with its continuations in one shard; kv heads and weights over
        ``model``. Contexts fork but share no pages across contexts there. None: one device.
      compile_cache: JAX's persistent compilation cache (default: on, in the user's cache
        folder; a folder; False: off): see :class:`paxkv.Engine`.

    Returns:
      One :class:`ScoreResult` per request, in order. Every page is free again afterwards.
    """
    pairs = truncate(token_pairs(lm, requests), max_length)
    if not pairs:
        return []
    scorer = scorer_for(lm, pairs, cache=cache, share=share, page_size=page_size,
                        max_seqs=max_seqs, num_pages=num_pages, kv_dtype=kv_dtype,
                        attention_impl=attention_impl, mesh=mesh, compile_cache=compile_cache)
    return scorer.score(pairs)


def score_rolling(lm: Any, texts: Sequence[str | Sequence[int]], *, max_length: int,
                  prefix_token: int | None = None, **kwargs: Any) -> list[float]:
    """The log-likelihood of each whole text (perplexity's numerator), over lm-eval's rolling
    windows of ``max_length`` tokens (:func:`rolling_windows`): every token scored once.

    Args:
      texts: strings or token-id lists.
      prefix_token: what the first token is predicted after (default: the model's BOS,
        ``lm.config.bos_token_id``, as lm-eval's hf backend does).
      kwargs: as for :func:`score` (``cache``, ``share``, ``page_size``, ...).
    """
    if prefix_token is None:
        prefix_token = getattr(getattr(lm, "config", None), "bos_token_id", None)
        if prefix_token is None:
            raise ValueError("this model has no BOS token: pass prefix_token=")
    windows, owner = [], []
    for i, text in enumerate(texts):
        ids = prompt_ids(lm, text, f"text {i}")
        for w in rolling_windows(ids, prefix_token=prefix_token, max_length=max_length):
            windows.append(w)
            owner.append(i)
    totals = [0.0] * len(texts)
    for i, r in zip(owner, score(lm, windows, **kwargs)):
        totals[i] += r.logprob
    return totals
