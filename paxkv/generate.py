"""``paxkv.generate``: text in, text out, through a paged or dense cache.

Two loops behind one call:

* ``loop="python"`` (default): continuous batching (:class:`paxkv.engine.Engine`): requests are
  admitted while pages allow, queued otherwise, released the moment they finish; more prompts
  than ``max_seqs`` are fine.
* ``loop="jit"``: one prefill, then one compiled ``lax.while_loop`` that reserves pages inside
  jit (:func:`paxkv.steps.decode_loop`), for fixed batches in evaluation pipelines.

With the paged cache, prompts share pages: the prefix cache (on by default) lets a prompt reuse
the pages of an earlier prompt's identical prefix (a shared system prompt is prefilled once),
and ``n > 1`` prefills each prompt once and forks it into ``n`` samples.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax.numpy as jnp

from paxkv.engine import Engine, GenerationResult


def _token_ids(lm: Any, prompts: Sequence[str | Sequence[int]]) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError("prompts must be a list of strings or of token-id lists")
    ids = [lm.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
    for i, p in enumerate(ids):
        if not p:
            raise ValueError(f"prompt {i} is empty: give at least one token")
    return ids


def generate(lm: Any, prompts: Sequence[str | Sequence[int]], *, max_new_tokens: int,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             seed: int = 0, stop_token_ids: Sequence[int] | None = None, cache: str = "paged",
             page_size: int = 16, num_pages: int | None = None, max_seqs: int = 32,
             max_len: int | None = None, loop: str = "python", attention_impl: str = "auto",
             kv_dtype: Any = jnp.float32, prefix_cache: bool = True,
             n: int = 1) -> list[GenerationResult]:
    """Generates a continuation for every prompt.

    Args:
      lm: a ``models.LanguageModel`` (``models.load()``).
      prompts: strings (tokenised as they are: apply ``lm.chat_prompt`` first for chat) or
        lists of token ids.
      max_new_tokens: tokens to generate per prompt (fewer if a stop token comes).
      temperature, top_k, top_p: sampling; ``temperature=0`` is greedy.
      seed: request ``i`` samples from ``fold_in(PRNGKey(seed), i)``.
      stop_token_ids: tokens that end a sequence; None = the model's EOS ids; ``[]`` = none.
      cache: "paged" or "dense" (the comparison twin).
      page_size, num_pages: pool layout (``num_pages`` defaults to the dense reservation).
      max_seqs: sequences decoding at once (cache rows).
      max_len: tokens one sequence may hold; default the longest prompt + ``max_new_tokens``.
      loop: "python" (continuous batching) or "jit" (fixed batch, one compiled loop).
      kv_dtype: the K/V values' dtype. ``jnp.bfloat16`` halves the cache (a CPU stores it as
        bits, :mod:`paxkv.kv_storage`, and decodes faster than float32); tokens can
        then differ from float32's (and HF's) where two logits are within its rounding.
      prefix_cache: reuse cached pages of identical prompt prefixes (paged cache only; the
        dense twin ignores it). Tokens are the same either way.
      n: samples per prompt (one prefill, then ``n`` forks sharing its pages; sample ``j`` of
        prompt ``i`` draws from ``fold_in(fold_in(PRNGKey(seed), i), j)``); needs
        ``loop="python"``.

    Returns:
      One :class:`paxkv.engine.GenerationResult` per prompt, in order; ``num_cached_tokens``
      counts prompt tokens served from shared pages, and with ``n > 1`` ``samples`` holds the
      ``n`` results.
    """
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    ids = _token_ids(lm, prompts)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    stops = tuple(lm.eos_token_ids) if stop_token_ids is None else tuple(stop_token_ids)
    longest = max(len(p) for p in ids) + max_new_tokens
    max_len = max_len or -(-longest // page_size) * page_size
    if loop == "jit" and n != 1:
        raise ValueError("n > 1 samples need loop='python'")
    engine = Engine(lm, cache=cache, max_seqs=max_seqs, max_len=max_len, page_size=page_size,
                    num_pages=num_pages, kv_dtype=kv_dtype, attention_impl=attention_impl,
                    prefix_cache=prefix_cache and cache == "paged")
    rids = [engine.submit(p, max_new_tokens=max_new_tokens, temperature=temperature,
                          top_k=top_k, top_p=top_p, seed=seed, stop_token_ids=stops, n=n)
            for p in ids]
    if loop == "python":
        results = engine.run()
        return [results[r] for r in rids]
    if loop != "jit":
        raise ValueError(f"loop must be 'python' or 'jit', got {loop!r}")
    if len(ids) > max_seqs:
        raise ValueError(f"loop='jit' runs one fixed batch: {len(ids)} prompts exceed "
                         f"max_seqs={max_seqs}; raise max_seqs or use loop='python'")
    results = engine.run_compiled()
    return [results[r] for r in rids]


__all__ = ["generate", "GenerationResult", "Engine"]
