"""Beam search over a paged (or dense) KV cache: one prefill per prompt, then one compiled loop.

    beams = paxkv.beam_search(lm, ["Write a haiku."], beam_width=4, max_new_tokens=32)
    beams[0][0].token_ids, beams[0][0].score          # prompt 0's best beam

Rows are prompts x beams: beam ``w`` of prompt ``p`` lives in cache row ``p * W + w``. Each
prompt is prefilled once into row ``p * W`` and forked into its other ``W - 1`` rows (all pages
shared; the partial last page is copied on first write only). Then one ``lax.while_loop``, with
the cache donated, repeats::

    decode P*W rows -> log-softmax -> top-K of the W x V candidates of each prompt (K = 2W, or
    (1 + number of stop ids) * W) -> finished hypotheses scored, W survivors kept
    -> cache.reorder(parents): surviving row b continues row parents[b]

The paged ``reorder`` moves block-table rows and ref counts (a dead beam's pages are free in
that same step; no KV moves); the dense one copies whole KV rows, every layer, every step.

Scoring is HF transformers 5.24 ``generate(num_beams=W, do_sample=False)``'s: a hypothesis that
ends after ``n`` generated tokens (its stop token counted; or the ``max_new_tokens``-th token)
scores ``sum(log p) / n ** length_penalty``; only the best W of the K candidates may finish; a
prompt stops when W hypotheses are finished and ``early_stopping`` is True, or (False) when the
best running beam's sum divided by ``n ** length_penalty`` (``max_new_tokens`` in place of ``n``
for "never" with a positive penalty) cannot beat the worst finished score.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from paxkv.attention.blocks import check_windows
from paxkv.cache import dense as dense_cache
from paxkv.cache import grouped
from paxkv.cache import paged as paged_cache
from paxkv.core.buckets import cdiv, prefix_bucket
from paxkv.core.compiles import use_persistent_cache
from paxkv.core.plan import NO_PLAN, AttentionPlan
from paxkv.core.protocol import KVCache, check_model, shard_free_pages
from paxkv.core.sampling import SamplingParams
from paxkv.core.step_info import StepInfo
from paxkv.decoding.beam_select import Beams, select
from paxkv.engine.setup import place_model, prompt_ids
from paxkv.scale import mesh as pmesh
from paxkv.scale import sharded_cache
from paxkv.scale.sharded_cache import ShardedPagedCache
from paxkv.table.page_table import PageTable

_EARLY = {False: 0, True: 1, "never": 2}


@dataclasses.dataclass(frozen=True)
class Beam:
    """A finished hypothesis: the generated ``token_ids`` (a stop token included) and its
    ``score`` (sum of log-probs / ``len(token_ids) ** length_penalty``)."""

    token_ids: list[int]
    score: float


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """Beams per prompt (best first) and what the cache did: ``peak_pages`` in use at once
    (dense: rows x page-equivalents of ``max_len``) vs ``unshared_pages`` (W private copies of
    prompt + output); pages the reorders freed; ``stale_pages``: the most pages held by no live
    row right after any reorder (0 = dead beams freed at once); ``all_free`` at the end."""

    beams: list[list[Beam]]
    steps: int
    peak_pages: int
    unshared_pages: int
    pages_freed_by_reorder: int
    stale_pages: int
    all_free: bool
    num_pages: int
    prefill_s: float
    loop_s: float


def _pages_used(cache: KVCache) -> jax.Array:
    """int32 ``[]``: pages held over every shard (dense: rows, each ``max_len`` slots)."""
    return cache.total_pages - jnp.sum(shard_free_pages(cache))


def _stale(cache: KVCache) -> jax.Array:
    """int32 ``[]``: pages with a reference but no live row pointing at them (0 if dense),
    summed over a sharded cache's shards."""
    if not cache.shares_pages:
        return jnp.zeros((), jnp.int32)
    if isinstance(cache, ShardedPagedCache):
        return jnp.sum(jax.vmap(_stale_pages)(cache.tables))
    return _stale_pages(cache.table)


def _stale_pages(table: PageTable) -> jax.Array:
    seen = jnp.zeros((table.num_pages + 1,), bool).at[table.block_tables].set(True)
    return jnp.sum(table.ref_counts > 0) - jnp.sum(seen[: table.num_pages])


@functools.partial(jax.jit, static_argnames=("forward", "beam_width"),
                   donate_argnames=("cache",))
def _prefill_fork(forward, params, cache, tokens, prompt_lens, *, beam_width):
    """Prefills prompt ``i`` (tokens int32 ``[P, T]``, ``prompt_lens [P]``) into row ``i * W``
    and forks it into rows ``i * W + 1 .. i * W + W - 1``. Returns ``(cache, log-probs [P, V],
    ok [])``."""
    p = tokens.shape[0]
    rows = jnp.arange(p, dtype=jnp.int32) * beam_width
    cache, ok = cache.reserve(jnp.zeros((cache.max_seqs,), jnp.int32).at[rows].set(prompt_lens),
                              max_new=tokens.shape[1])
    step = StepInfo.make(cache.lengths[rows], prompt_lens, tokens.shape[1], rows=rows)
    logits, cache = forward(params, tokens, step, cache)
    children = jnp.arange(cache.max_seqs, dtype=jnp.int32).reshape(p, beam_width)[:, 1:]
    parents = jnp.broadcast_to(rows[:, None], children.shape)
    cache, forked = cache.fork(parents.reshape(-1), children.reshape(-1))
    return cache, jax.nn.log_softmax(logits, axis=-1), jnp.all(ok[rows]) & jnp.all(forked)


@functools.partial(jax.jit, static_argnames=("forward", "max_new_tokens", "plan"),
                   donate_argnames=("cache",))
def _search(forward, params, cache, logp0, stop_ids, length_penalty, early, *,
            max_new_tokens, plan):
    """The compiled loop. ``logp0 [P, V]``: prefill log-probs; the cache holds P x W forked rows;
    ``plan``: every decode step's attention plan (the beams' shared prompt pages).

    Returns ``(cache with every row released, final Beams, stats int32 [5]: steps, peak
    pages, pages freed by reorders, max stale pages, 1 if the pool ran dry)``.
    """
    p, s = logp0.shape[0], cache.max_seqs
    w = s // p
    base = jnp.arange(p, dtype=jnp.int32)[:, None] * w

    def advance(cache, beams, logp, stats):
        beams, parents = select(beams, logp, stop_ids, length_penalty, early)
        before = _pages_used(cache)
        cache, _ = cache.reorder((base + parents).reshape(-1))
        stats = stats.at[2].add(jnp.maximum(before - _pages_used(cache), 0))
        return cache, beams, stats.at[3].max(_stale(cache))

    def body(carry):
        cache, beams, stats = carry
        cache, ok = cache.reserve(jnp.ones((s,), jnp.int32), max_new=1)
        step = StepInfo.make(cache.lengths, ok.astype(jnp.int32), 1, plan=plan)
        last = beams.run_tokens[:, :, beams.t - 1].reshape(s, 1)
        logits, cache = forward(params, last, step, cache)
        stats = stats.at[0].add(1).at[1].max(_pages_used(cache)).at[4].max(
            jnp.any(~ok).astype(jnp.int32))
        logp = jax.nn.log_softmax(logits, axis=-1).reshape(p, w, -1)
        cache, beams, stats = advance(cache, beams, logp, stats)
        return cache, dataclasses.replace(beams, done=beams.done | (stats[4] > 0)), stats

    stats = jnp.zeros((5,), jnp.int32).at[1].set(_pages_used(cache))
    beams = Beams.start(p, w, max_new_tokens)
    logp = jnp.broadcast_to(logp0[:, None, :], (p, w, logp0.shape[1]))
    cache, beams, stats = advance(cache, beams, logp, stats)
    cache, beams, stats = jax.lax.while_loop(lambda c: ~c[1].done, body, (cache, beams, stats))
    cache, _ = cache.release(jnp.ones((s,), bool))
    return cache, beams, stats


def _make_cache(cache: str, mesh: Mesh | None, num_pages: int, page_size: int,
                attention_impl: str, prefill_tokens: int, prompts: int, **dims: Any) -> KVCache:
    """The search's cache: paged (sharded over ``mesh``'s data axis when given) or dense; on
    one device, for a model with sliding-window layers, layer-grouped (its window groups
    release their pages in the step, sized for one prefill of ``prefill_tokens`` over
    ``prompts`` rows, then one token a row)."""
    if cache == "dense":
        return dense_cache.create(**dims)
    paged = dict(num_pages=num_pages, page_size=page_size, attention_impl=attention_impl,
                 **dims)
    if mesh is not None:
        return sharded_cache.create(mesh=mesh, **paged)
    if check_windows(dims["layer_windows"], dims["num_layers"]):
        return grouped.create(step_tokens=prefill_tokens, step_rows=prompts, **paged)
    return paged_cache.create(**paged)


def _check(beam_width, max_new_tokens, early_stopping, cache, page_size, mesh=None) -> None:
    for name, v in (("beam_width", beam_width), ("max_new_tokens", max_new_tokens),
                    ("page_size", page_size)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if not (early_stopping is True or early_stopping is False or early_stopping == "never"):
        raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
    if cache not in ("paged", "dense"):
        raise ValueError(f"cache must be 'paged' or 'dense', got {cache!r}")
    if mesh is not None and cache != "paged":
        raise ValueError("mesh= needs cache='paged': the dense cache runs on one device")


def search(lm: Any, prompt_ids: Sequence[Sequence[int]], *, beam_width: int,
           max_new_tokens: int, length_penalty: float = 1.0, early_stopping: bool | str = False,
           stop_token_ids: Sequence[int] | None = None, cache: str = "paged",
           page_size: int = 16, attention_impl: str = "auto",
           kv_dtype: Any = jnp.float32, mesh: Mesh | None = None) -> SearchResult:
    """Beam search for one batch of prompts (rows = prompts x beams); see :func:`beam_search`.

    The paged pool holds ``ceil(T / page_size) + W * (ceil(N / page_size) + 1)`` pages per
    prompt (``T``: the prompt bucket): the worst case, whatever the beams share. On a
    ``mesh`` the batch is padded with copies of its first prompt to a multiple of the data
    axis, so every shard holds whole prompts (a prompt's beams fork and reorder within their
    shard); the copies' beams are dropped.
    """
    _check(beam_width, max_new_tokens, early_stopping, cache, page_size, mesh)
    check_model(lm)
    asked = len(prompt_ids)
    if mesh is not None:
        data, _ = pmesh.axis_sizes(mesh)
        prompt_ids = list(prompt_ids) + [prompt_ids[0]] * (-asked % data)
        lm = place_model(lm, mesh)
    p, w, n, ps = len(prompt_ids), beam_width, max_new_tokens, page_size
    stops = tuple(SamplingParams(stop_token_ids=stop_token_ids).stops(lm))
    lens = [len(x) for x in prompt_ids]
    width = max(16, 1 << (max(lens) - 1).bit_length())  # prompt bucket: few compiled shapes
    tokens = np.zeros((p, width), np.int32)
    for i, x in enumerate(prompt_ids):
        tokens[i, : len(x)] = x
    max_len = cdiv(width + n, ps) * ps
    dims = dict(num_layers=lm.num_layers, num_kv_heads=lm.num_kv_heads, head_dim=lm.head_dim,
                max_seqs=p * w, max_len=max_len, dtype=kv_dtype,
                layer_windows=getattr(lm, "layer_windows", None))
    num_pages = p * (cdiv(width, ps) + w * (cdiv(n, ps) + 1))
    kv = _make_cache(cache, mesh, num_pages, ps, attention_impl, p * width, p, **dims)
    plan = NO_PLAN
    if cache == "paged" and p == 1:  # every beam starts with the prompt's pages: read them once
        plan = AttentionPlan(prefix_pages=prefix_bucket(lens[0] // ps))
    start = time.perf_counter()
    kv, logp0, ok = _prefill_fork(lm.forward, lm.params, kv, tokens,
                                  np.asarray(lens, np.int32), beam_width=w)
    if not bool(ok):
        raise RuntimeError("prefill or fork failed: the pool is too small (a bug in sizing)")
    mid = time.perf_counter()
    kv, beams, stats = _search(
        lm.forward, lm.params, kv, logp0, np.asarray(stops, np.int32).reshape(-1),
        jnp.float32(length_penalty), jnp.int32(_EARLY[early_stopping]), max_new_tokens=n,
        plan=plan)
    stats, loop_s = np.asarray(stats), time.perf_counter() - mid
    if stats[4]:
        raise RuntimeError("beam search ran out of KV pages (a bug in pool sizing)")
    all_free = not bool(jnp.any(kv.active)) and int(_pages_used(kv)) == 0
    per_page = kv.page_size // ps  # a dense "page" is a row of max_len slots
    toks, scores, flens, fin = (np.asarray(a) for a in (
        beams.fin_tokens, beams.fin_scores, beams.fin_lens, beams.is_fin))
    out = [[Beam([int(t) for t in toks[i, j, : flens[i, j]]], float(scores[i, j]))
            for j in range(w) if fin[i, j]] for i in range(asked)]
    unshared = sum(w * cdiv(x + n, ps) for x in lens[:asked])
    return SearchResult(
        out, int(stats[0]), int(stats[1]) * per_page, unshared, int(stats[2]) * per_page,
        int(stats[3]), all_free, kv.total_pages * per_page, mid - start, loop_s)


def beam_search(lm: Any, prompts: Sequence[str | Sequence[int]], *, beam_width: int,
                max_new_tokens: int, length_penalty: float = 1.0,
                early_stopping: bool | str = False, stop_token_ids: Sequence[int] | None = None,
                cache: str = "paged", page_size: int = 16, prompts_per_batch: int | None = None,
                attention_impl: str = "auto", kv_dtype: Any = jnp.float32,
                mesh: Mesh | None = None,
                compile_cache: str | bool | None = None) -> list[list[Beam]]:
    """Beam search, HF-``generate(num_beams=beam_width)``-compatible, in one compiled loop.

    Args:
      lm: a :class:`paxkv.core.protocol.Model` (with ``encode`` for text prompts).
      prompts: strings (tokenised as they are) or token-id lists.
      beam_width: beams per prompt (W).
      max_new_tokens: the most tokens a hypothesis may have (N).
      length_penalty: finished scores are ``sum log p / len ** length_penalty``.
      early_stopping: True, False or "never" (HF's meanings; see the module docstring).
      stop_token_ids: ids that end a hypothesis; None = the model's EOS ids; ``[]`` = none.
      cache: "paged" (reorder moves block-table rows) or "dense" (reorder copies KV rows).
      page_size: tokens per page (paged).
      prompts_per_batch: prompts searched together (rows = prompts x W); None = all at once.
      kv_dtype: K/V dtype (``jnp.bfloat16``, ``jnp.int8``: see :func:`paxkv.generate`).
      mesh: a ``("data", "model")`` mesh (:func:`paxkv.scale.mesh.make_mesh`) for the paged cache:
        each batch's prompts split over ``data`` (padded to a multiple of it with copies whose
        beams are dropped), kv heads and weights over ``model``. None: one device.
      compile_cache: JAX's persistent compilation cache (:class:`paxkv.Engine`'s argument).

    Returns:
      Per prompt, its W best finished beams, best first.
    """
    _check(beam_width, max_new_tokens, early_stopping, cache, page_size, mesh)
    use_persistent_cache(compile_cache)
    if isinstance(prompts, (str, bytes)):
        raise TypeError("prompts must be a list of strings or of token-id lists")
    ids = [prompt_ids(lm, x, f"prompt {i}") for i, x in enumerate(prompts)]  # no float ids
    if any(not x for x in ids):
        raise ValueError("every prompt needs at least one token")
    step = prompts_per_batch or max(1, len(ids))
    out: list[list[Beam]] = []
    for i in range(0, len(ids), step):
        out += search(lm, ids[i: i + step], beam_width=beam_width,
                      max_new_tokens=max_new_tokens, length_penalty=length_penalty,
                      early_stopping=early_stopping, stop_token_ids=stop_token_ids,
                      cache=cache, page_size=page_size, attention_impl=attention_impl,
                      kv_dtype=kv_dtype, mesh=mesh).beams
    return out
