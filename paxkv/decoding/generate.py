"""``paxkv.generate``: text in, text out, through a paged or dense cache.

Two loops behind one call:

* ``loop="python"`` (default): continuous batching (:class:`paxkv.engine.Engine`): requests are
  admitted while pages allow, queued otherwise, released the moment they finish; more prompts
  than ``max_seqs`` are fine.
* ``loop="jit"``: one prefill, then one compiled ``lax.while_loop`` that reserves pages inside
  jit (:func:`paxkv.core.steps.decode_loop`), for fixed batches in evaluation pipelines.

With the paged cache, prompts share pages: the prefix cache (on by default) lets a prompt reuse
the pages of an earlier prompt's identical prefix (a shared system prompt is prefilled once),
and ``n > 1`` prefills each prompt once and forks it into ``n`` samples.
"""

from __future__ import annotations

import numbers
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from paxkv.core.buckets import cdiv
from paxkv.core.sampling import SamplingParams
from paxkv.decoding.compiled_loop import run_fixed_batch
from paxkv.engine import Engine, GenerationResult
from paxkv.engine.setup import check_size, default_max_seqs, prompt_ids


def _token_ids(lm: Any, prompts: Any) -> list[list[int]]:
    """Every prompt as token ids (:func:`paxkv.engine.setup.prompt_ids`); a ``ValueError``
    (``TypeError`` for what is no list at all) naming what to pass instead."""
    if isinstance(prompts, (str, bytes)):
        raise TypeError(f"prompts is one string: pass a list of prompts, [{prompts!r}]")
    if isinstance(prompts, (np.ndarray, jax.Array)) and prompts.ndim:
        prompts = list(prompts)  # a 2-D array's rows are prompts (a 1-D one's: named below)
    if not isinstance(prompts, Sequence):
        raise TypeError("prompts must be a list of prompts, each a string or a list of int "
                        f"token ids: got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("prompts is empty: pass a list of at least one prompt, e.g. "
                         "['Hello'] or [[5, 17, 42]]")
    if any(isinstance(p, (numbers.Number, np.generic)) or getattr(p, "ndim", None) == 0
           for p in prompts):
        shown = ", ".join(map(str, prompts[:3])) + (", ..." if len(prompts) > 3 else "")
        raise ValueError(f"prompts is a flat list of numbers: pass a list of prompts, "
                         f"[[{shown}]] (one list of int token ids or one string per prompt)")
    ids = [prompt_ids(lm, p, f"prompt {i}") for i, p in enumerate(prompts)]
    for i, p in enumerate(ids):
        if not p:
            raise ValueError(f"prompt {i} is empty: give at least one token")
    return ids


def generate(lm: Any, prompts: Sequence[str | Sequence[int]] | Any,
             params: SamplingParams | None = None, *, max_new_tokens: int | None = None,
             temperature: float | None = None, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = None, n: int | None = None,
             stop_token_ids: Sequence[int] | None = None, logprobs: int | None = None,
             cache: str = "paged",
             page_size: int = 16, num_pages: int | None = None,
             max_seqs: int | None = None,
             max_len: int | None = None, loop: str = "python", attention_impl: str = "auto",
             kv_dtype: Any = jnp.float32, prefix_cache: bool | None = None,
             mesh: Mesh | None = None,
             compile_cache: str | bool | None = None) -> list[GenerationResult]:
    """Generates a continuation for every prompt.

    Args:
      lm: a :class:`paxkv.core.protocol.Model` (``paxkv.models.load()``; ``encode`` / ``decode``
        for text).
      prompts: a list of prompts, each a string (tokenised as it is: apply
        ``lm.chat_prompt`` first for chat) or int token ids (a list or a 1-D integer array;
        a 2-D integer array is a batch of equal-length prompts). Float or bool ids, a flat
        list of ids (not a list of prompts) or text to a model without ``encode`` raise a
        ``ValueError`` naming what to pass.
      params: the :class:`paxkv.SamplingParams` of every prompt; the keyword forms
        (``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``n``,
        ``stop_token_ids``) override its fields. Prompt ``i`` samples from
        ``fold_in(PRNGKey(seed), i)``; with ``n > 1`` sample ``j`` from
        ``fold_in(fold_in(PRNGKey(seed), i), j)`` (one prefill, ``n`` forks sharing its
        pages). ``stop_token_ids``: None = the model's EOS ids; ``[]`` = none.
        ``logprobs=k``: each result's ``logprobs`` / ``top_logprobs`` (k alternatives).
      cache: "paged" or "dense" (the comparison twin).
      page_size, num_pages: pool layout (``num_pages`` defaults to the dense reservation).
      max_seqs: sequences decoding at once (cache rows); default 32, on a ``mesh`` rounded
        up to a multiple of its data axis.
      max_len: tokens one sequence may hold; default the longest prompt + ``max_new_tokens``.
      loop: "python" (continuous batching) or "jit" (fixed batch, one compiled loop).
      attention_impl: "auto" (the Pallas kernels on a GPU for pages they accept, else XLA),
        "pallas", "pallas_mma" (the kernels on tensor cores where they serve the pages:
        bfloat16 / float16, no sliding window) or "xla".
      kv_dtype: the K/V values' dtype. ``jnp.bfloat16`` halves the cache (a CPU stores it as
        bits, :mod:`pallas_kernels.kv_storage`); tokens can then differ from float32's where two logits
        are within its rounding.
      prefix_cache: reuse cached pages of identical prompt prefixes (default: on for a paged
        cache; tokens are the same either way).
      mesh: a ``("data", "model")`` mesh (:func:`paxkv.scale.mesh.make_mesh`): the paged cache's rows
        and pages split over ``data`` (``max_seqs`` and ``num_pages`` must divide by it), kv
        heads and weights over ``model``; see :class:`paxkv.Engine`. None: one device.
      compile_cache: JAX's persistent compilation cache (default: on, in the user's cache
        folder; a folder; False: off): see :class:`paxkv.Engine`.

    Returns:
      One :class:`paxkv.GenerationResult` per prompt, in order; ``num_cached_tokens`` counts
      prompt tokens served from shared pages, and with ``n > 1`` ``samples`` holds the ``n``
      results.
    """
    p = SamplingParams.of(params, max_new_tokens=max_new_tokens, temperature=temperature,
                          top_k=top_k, top_p=top_p, seed=seed, n=n,
                          stop_token_ids=stop_token_ids, logprobs=logprobs)
    page_size = check_size("page_size", page_size)
    if loop not in ("python", "jit"):
        raise ValueError(f"loop must be 'python' or 'jit', got {loop!r}")
    if loop == "jit" and (p.n != 1 or p.logprobs is not None):
        raise ValueError("n > 1 samples and logprobs need loop='python'")
    ids = _token_ids(lm, prompts)
    max_seqs = default_max_seqs(max_seqs, mesh)
    if loop == "jit" and len(ids) > max_seqs:
        raise ValueError(f"loop='jit' runs one fixed batch: {len(ids)} prompts exceed "
                         f"max_seqs={max_seqs}; raise max_seqs or use loop='python'")
    longest = max(len(x) for x in ids) + p.max_new_tokens
    max_len = max_len or cdiv(longest, page_size) * page_size
    engine = Engine(lm, cache=cache, max_seqs=max_seqs, max_len=max_len, page_size=page_size,
                    num_pages=num_pages, kv_dtype=kv_dtype, attention_impl=attention_impl,
                    prefix_cache=prefix_cache, mesh=mesh, compile_cache=compile_cache)
    rids = [engine.submit(x, p) for x in ids]
    results = engine.run() if loop == "python" else run_fixed_batch(engine)
    return [results[r] for r in rids]


__all__ = ["generate", "GenerationResult", "Engine"]
