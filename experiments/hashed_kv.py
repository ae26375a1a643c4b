"""Caches that already hold a context of hashed K/V, and decode steps over them: what the
decode sweep (``experiments.decode_sweep``) and the GPU model check (``experiments.gpu_model``)
time and compare.

A paged and a dense cache filled by :func:`filled_cache` hold identical K/V (the values depend
only on layer, row, head, position and dim), so one step's logits must agree between them;
:class:`NoAttention` is the same step with attention taken out (attention = full - it). Every
step reads a window of the context (:func:`window_plan`, the step's attention plan).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import kv_storage, quant
from paxkv import dense_cache, page_table as pt, paged_cache, pool as kv_pool, steps
from paxkv.core.plan import AttentionPlan
from paxkv.core.step_info import StepInfo

PAGE_SIZE = 16


@functools.partial(jax.tree_util.register_dataclass, data_fields=["inner"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class NoAttention:
    """A cache whose ``attend`` writes nothing and reads nothing: the step minus attention.

    It returns ``q + mean_kv_heads(k + v)`` rather than zeros: constant zeros would let XLA drop
    the q/k/v projections and RoPE, which would then be billed to attention.
    """

    inner: Any

    lengths = property(lambda self: self.inner.lengths)
    active = property(lambda self: self.inner.active)
    max_seqs = property(lambda self: self.inner.max_seqs)
    table = property(lambda self: getattr(self.inner, "table", None))

    def reserve(self, num_new: jax.Array, *, max_new: int) -> tuple["NoAttention", jax.Array]:
        inner, ok = self.inner.reserve(num_new, max_new=max_new)
        return NoAttention(inner), ok

    def free_pages(self) -> jax.Array:
        return self.inner.free_pages()

    def attend(self, layer, q, k, v, step, *, sm_scale=None, logit_soft_cap=None):
        del layer, step, sm_scale, logit_soft_cap
        return self, q + jnp.mean(k + v, axis=2, keepdims=True).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("shape", "salt"))
def _hashed(shape: tuple[int, ...], salt: int, filled: jax.Array,
            page_row: jax.Array | None = None, page_block: jax.Array | None = None) -> jax.Array:
    """float32 values in [-1, 1) at positions ``< filled`` (zero beyond) that depend only on
    (layer, row, kv head, position, dim) and ``salt``, so a paged pool ``[L, pages, H,
    page_size, D]`` whose page ``p`` is block ``page_block[p]`` of row ``page_row[p]`` holds the
    same K/V as a dense cache ``[L, rows, H, max_len, D]`` (no page maps: dense). Zeros past
    the fill match what a scrubbed fresh page holds, so slots a no-attention step reserves but
    never writes are equal in both layouts too."""
    # NOTE: per-axis vectors broadcast together fuse into one loop; full-shape index arrays
    # (a gather by an iota) would materialise a temporary as large as the pool.
    axis = lambda i: jnp.arange(shape[i], dtype=jnp.uint32).reshape(  # noqa: E731
        [-1 if j == i else 1 for j in range(5)])
    layer, a, head, s, d = (axis(i) for i in range(5))
    if page_row is None:
        row, pos, held = a, s, True
    else:  # a page of row -1 is free (or the sentinel)
        per_page = lambda x: x.reshape(-1, 1, 1, 1)  # noqa: E731  [pages, 1, 1, 1]
        row, held = per_page(page_row).astype(jnp.uint32), per_page(page_row) >= 0
        pos = per_page(page_block).astype(jnp.uint32) * shape[3] + s
    x = (((layer * 4099 + row) * 131 + head) * 65537 + pos) * 257 + d + jnp.uint32(salt) * 7919
    for shift, mult in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):  # murmur3 finaliser
        x = (x ^ (x >> shift)) * jnp.uint32(mult)
    x = x ^ (x >> 16)
    value = (x >> 8).astype(jnp.float32) * (2.0 / (1 << 24)) - 1.0
    return jnp.where(held & (pos < filled.astype(jnp.uint32)), value, 0.0)


@functools.partial(jax.jit, static_argnames=("max_new",), donate_argnums=(0,))
def _reserve(cache, num_new, *, max_new):
    return cache.reserve(num_new, max_new=max_new)


_table_reserve = jax.jit(pt.reserve, static_argnames=("max_new",), donate_argnums=(0,))


def window_plan(context: int) -> AttentionPlan:
    """The attention plan of a step over rows of at most ``context`` tokens: read that window
    (checked in the step: a longer row makes it read whole rows)."""
    return AttentionPlan(window=context)


def filled_cache(lm, kind: str, batch: int, context: int, filled: int, salt: int = 0,
                 kv_dtype: Any = jnp.float32, attention_impl: str = "xla"):
    """A ``kind`` cache of ``batch`` rows of ``context`` tokens, each row holding ``filled``
    tokens (one jitted reserve) of hashed K/V (``salt`` changes the values), stored as a
    ``kv_dtype`` cache stores them (bfloat16 on a CPU: its bits; int8: codes and scales). A
    paged cache attends through ``attention_impl`` ("xla" or "pallas"; a dense cache has one
    path)."""
    c = lm.config
    stored = functools.partial(_stored, kv_dtype=kv_dtype)
    num_new = jnp.full((batch,), filled, jnp.int32)
    if kind == "paged":
        row_pages = -(-context // PAGE_SIZE)
        table = pt.create(num_pages=batch * row_pages, page_size=PAGE_SIZE, max_seqs=batch,
                          max_pages_per_seq=row_pages)
        table, _, ok = _table_reserve(table, num_new, max_new=filled)
        # Which (row, block) each page holds; free pages and the sentinel get row -1.
        bt = np.asarray(table.block_tables)
        page_row = np.full(table.num_pages + 1, -1, np.int32)
        page_block = np.zeros(table.num_pages + 1, np.int32)
        page_row[bt], page_block[bt] = np.arange(batch)[:, None], np.arange(row_pages)[None, :]
        page_row[-1] = -1  # the sentinel: table padding points here
        shape = (c.num_layers, table.num_pages + 1, c.num_kv_heads, PAGE_SIZE, c.head_dim)
        pool = stored(*(_hashed(shape, 2 * salt + i, num_new[0], page_row, page_block)
                        for i in (0, 1)))
        cache = paged_cache.PagedCache(pool=kv_pool.KVPool(**pool), table=table, scrub=True,
                                       impl=paged_cache.resolve_impl(
                                           attention_impl, kv_dtype, page_size=PAGE_SIZE,
                                           head_dim=c.head_dim))
    else:
        shape = (c.num_layers, batch, c.num_kv_heads, context, c.head_dim)
        kv = stored(*(_hashed(shape, 2 * salt + i, num_new[0]) for i in (0, 1)))
        cache = dense_cache.DenseCache(**kv,
                                       lengths=jnp.zeros((batch,), jnp.int32),
                                       active=jnp.zeros((batch,), bool))
        cache, ok = _reserve(cache, num_new, max_new=filled)
    assert bool(ok.all()), "the fill reserve failed"
    return cache


def _stored(k: jax.Array, v: jax.Array, kv_dtype: Any) -> dict[str, jax.Array]:
    """float32 K/V ``[L, pages or rows, H, slots, D]`` as a ``kv_dtype`` cache stores them:
    ``k``, ``v`` (and ``scales`` ``[L, pages or rows, H, 2, slots]`` for int8 / fp8)."""
    fmt = quant.format_of(kv_dtype)
    if fmt is None:
        storage = kv_storage.storage_dtype(kv_dtype)
        return dict(k=kv_storage.to_storage(k, storage), v=kv_storage.to_storage(v, storage))
    (k, k_scale), (v, v_scale) = quant.quantise(k, fmt), quant.quantise(v, fmt)
    return dict(k=k, v=v, scales=jnp.stack([k_scale, v_scale], axis=3))


def kv_bytes(lm, batch: int, context: int, kv_dtype: Any = jnp.float32) -> int:
    """K/V bytes of ``batch`` rows of ``context`` tokens (an int8 / fp8 cache's scales too)."""
    c = lm.config
    per_value = jnp.dtype(kv_dtype).itemsize
    scale = 4 if quant.format_of(kv_dtype) is not None else 0
    return 2 * c.num_layers * batch * c.num_kv_heads * context * (c.head_dim * per_value + scale)


def decode(lm, cache, tokens, *, plan: AttentionPlan, no_attention: bool = False):
    """One donated ``steps.decode_step`` of every row (the cache's attention path, ``plan``'s
    window): ``(cache, next tokens [batch], ok [batch])``; with ``no_attention`` the same step
    through :class:`NoAttention` wrapped around ``cache``."""
    live = jnp.ones(tokens.shape, bool)
    step_cache = NoAttention(cache) if no_attention else cache
    out, nxt, ok, _ = steps.decode_step(lm.forward, lm.params, step_cache, tokens, live, None,
                                        plan=plan)
    # NOTE: keep no wrapper alive: it would pin the donated buffers
    return (out.inner if no_attention else out), nxt, ok


@functools.partial(jax.jit, static_argnames=("forward", "plan"))
def step_logits(forward, params, cache, tokens, plan: AttentionPlan):
    """float32 ``[batch, vocab]`` logits of one decode step of every row (cache not donated;
    the cache's attention path, ``plan``'s window)."""
    cache, _ = cache.reserve(jnp.ones(tokens.shape, jnp.int32), max_new=1)
    step = StepInfo.make(cache.lengths, jnp.ones(tokens.shape, jnp.int32), 1, plan=plan)
    return forward(params, tokens[:, None], step, cache)[0]
