"""What a KV cache and a model must provide: the two protocols every part of paxkv is written
against.

``PagedCache`` and ``DenseCache`` implement :class:`KVCache`; ``paxkv.models.LanguageModel``
(the Llama loader) implements :class:`Model`. A researcher's own model plugs into the engine,
``generate``, ``beam_search`` and the jitted steps by implementing :class:`Model`, and calls
``cache.attend`` once per attention layer — nothing else of paxkv's::

    class MyModel:                           # any object with these attributes
        num_layers, num_kv_heads, head_dim, vocab_size = 4, 2, 32, 1000
        params = ...                         # a pytree

        def forward(self, params, tokens, step, cache):
            ...                              # per layer l: q [b, t, H, Dh], k, v [b, t, K, Dh]
            cache, out = cache.attend(l, q, k, v, step, sm_scale=0.125, logit_soft_cap=30.0)
            ...
            return logits, cache             # logits float32 [b, vocab] at each row's last token

Shapes: ``b`` rows in the step, ``t`` tokens per row (1 for decode), ``H`` query heads, ``K``
kv heads (``H % K == 0``: grouped-query attention), ``Dh`` head dim; ``max_seqs`` cache rows.
Every method of a cache returns a new cache (frozen pytrees; nothing mutates) and, where it can
fail, a per-row ``ok`` flag instead of raising inside jit.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from paxkv.core.step_info import StepInfo


@runtime_checkable
class KVCache(Protocol):
    """A pytree holding K/V for ``max_seqs`` rows (sequences) of at most ``max_len`` tokens.

    Static sizes (Python ints under jit, read from shapes, so valid after donation):
    ``max_seqs``, ``max_len``, ``page_size`` (a dense cache's page is a whole row:
    ``max_len``), ``num_pages`` (pages one row can draw on; dense: ``max_seqs``),
    ``total_pages`` (every page: a sharded cache counts all shards), ``kv_bytes_per_page``
    (K + V of one page over all layers, 8-bit scales included), ``kv_bytes_per_device`` (the
    K/V bytes one device holds); ``shares_pages``: whether rows can hold the same pages
    (paged: True; a dense fork copies).
    A cache that shares pages also gives ``sharing_stats() ->``
    :class:`paxkv.table.page_table.SharingStats` (per row ``[max_seqs]``), which ``Engine.stats``
    reads. (The engine's prefix cache, :mod:`paxkv.prefix.holds`, and its copy counters still
    read the page table itself: a ``PagedCache``'s ``.table`` or a ``ShardedPagedCache``'s
    per-shard ``.tables``; another cache that shares pages runs with ``prefix_cache=False``.)
    A cache whose rows draw on separate page pools also implements :class:`Shards`; any other
    cache is one shard.
    """

    max_seqs: int
    max_len: int
    page_size: int
    num_pages: int
    total_pages: int
    kv_bytes_per_page: int
    kv_bytes_per_device: int
    shares_pages: bool

    @property
    def lengths(self) -> jax.Array:
        """int32 ``[max_seqs]``: tokens each row holds."""
        ...

    @property
    def active(self) -> jax.Array:
        """bool ``[max_seqs]``: rows that hold a sequence."""
        ...

    def reserve(self, num_new: jax.Array, *, max_new: int) -> tuple["KVCache", jax.Array]:
        """Room for ``num_new`` int32 ``[max_seqs]`` more tokens per row, all or nothing per
        row (``max_new``: static bound on ``num_new``); ``ok`` bool ``[max_seqs]``. A failed
        row is left bit-identical."""
        ...

    def release(self, rows: jax.Array) -> tuple["KVCache", jax.Array]:
        """Ends rows (bool ``[max_seqs]``): what only they held is free at once."""
        ...

    def fork(self, parents: jax.Array, children: jax.Array) -> tuple["KVCache", jax.Array]:
        """Row ``children[i]`` continues ``parents[i]`` (int32 ``[k]``; -1 pairs are no-ops);
        ``ok`` bool ``[k]``."""
        ...

    def reorder(self, parents: jax.Array) -> tuple["KVCache", jax.Array]:
        """Row ``b`` continues row ``parents[b]`` (int32 ``[max_seqs]``, -1 = drop), all rows
        at once (beam search); ``ok`` bool ``[max_seqs]``."""
        ...

    def attend(self, layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
               step: StepInfo, *, sm_scale: float | None = None,
               logit_soft_cap: float | None = None) -> tuple["KVCache", jax.Array]:
        """Writes this step's K/V of ``layer`` (int32 scalar) into the rows, then attends.

        Args:
          q: ``[b, t, H, Dh]``; k, v: ``[b, t, K, Dh]`` (RoPE already applied).
          step: the step's positions, rows and :class:`~paxkv.core.plan.AttentionPlan`.
          sm_scale: the softmax scale (None: ``Dh ** -0.5``).
          logit_soft_cap: scores become ``cap * tanh(score / cap)`` (None: off).
        Returns:
          ``(cache, out)``, out ``[b, t, H, Dh]``; padding queries give zeros.
        """
        ...

    def free_pages(self) -> jax.Array:
        """int32 scalar: pages no row (or index) holds (dense: free rows)."""
        ...

    def pages_used(self) -> jax.Array:
        """int32 ``[max_seqs]``: pages each row references (dense: 1 per active row)."""
        ...

    def stats(self) -> Any:
        """Occupancy accounting (a pytree of scalars; see each cache)."""
        ...


@runtime_checkable
class Shards(Protocol):
    """How a cache's rows and pages split into shards (data-parallel pools): row ``r`` lives in
    shard ``r // rows_per_shard`` and draws pages only from that shard's pool, so a scheduler
    must place a request where its shard has room, and keep forks inside one shard.

    ``ShardedPagedCache`` has one per data index of its mesh. Optional: a :class:`KVCache`
    without these members (``PagedCache``, ``DenseCache``) is one shard of ``max_seqs`` rows
    (:func:`shard_layout`, :func:`shard_free_pages`).
    """

    num_shards: int
    rows_per_shard: int

    def shard_free_pages(self) -> jax.Array:
        """int32 ``[num_shards]``: pages nobody holds, per shard (dense: free rows)."""
        ...


def shard_layout(cache: KVCache) -> tuple[int, int]:
    """``(num_shards, rows_per_shard)`` of ``cache``: ``(1, max_seqs)`` unless it implements
    :class:`Shards`."""
    if isinstance(cache, Shards):
        return cache.num_shards, cache.rows_per_shard
    return 1, cache.max_seqs


def shard_free_pages(cache: KVCache) -> jax.Array:
    """int32 ``[num_shards]``: :meth:`Shards.shard_free_pages`, or ``[free_pages()]``."""
    if isinstance(cache, Shards):
        return cache.shard_free_pages()
    return jnp.reshape(cache.free_pages(), (1,))


@runtime_checkable
class Model(Protocol):
    """A decoder that keeps its K/V in a :class:`KVCache`.

    Attributes:
      num_layers, num_kv_heads, head_dim: what the cache must hold per token.
      vocab_size: logits' last axis.
      params: a pytree, passed to ``forward`` traced (so one compiled step serves any values).

    Optional (used when present): ``encode(text) -> list[int]``, ``decode(ids) -> str`` (text
    prompts and results), ``eos_token_ids: tuple[int, ...]`` (the default stop tokens), a
    keyword ``forward(..., all_logits=True)`` returning logits ``[b, t, vocab]`` at every
    position (:mod:`paxkv.scoring` then scores a whole continuation per step; without it, one
    token a step), and ``layer_windows: tuple[int | None, ...]``, one entry per layer: None
    for a global layer, ``w`` for a sliding-window layer whose queries see only their last
    ``w`` keys (their own included). The model declares its windows and the cache applies them
    (the caches paxkv builds for a model take ``layer_windows=model.layer_windows``); the
    model's ``attend`` calls stay the same. ``program_key() -> str``, defined by the model's
    class: a text naming everything ``forward``'s trace reads besides its arguments (paxkv's
    models: class, config, compute dtype); with it, the steps are stored beside the
    persistent compilation cache and a new process runs them without tracing ``forward``
    (:mod:`paxkv.core.stored`); a wrong key runs a stale program, so leave it out unless sure.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    params: Any

    def forward(self, params: Any, tokens: jax.Array, step: StepInfo,
                cache: KVCache) -> tuple[jax.Array, KVCache]:
        """One step over ``tokens`` int32 ``[b, t]`` (row ``i``'s real tokens are its first
        ``step.query_lengths[i]``): calls ``cache.attend`` once per layer, passing ``step``
        on unchanged. Returns float32 logits ``[b, vocab]`` at each row's last real token and
        the new cache. Must be a pure function of its arguments (it runs under ``jax.jit``;
        ``self`` is hashed as part of the compiled step's key)."""
        ...


def check_model(model: Any) -> None:
    """Raises a ``TypeError`` naming what ``model`` lacks of :class:`Model` (at the Python
    boundary: the engine, ``generate`` and ``beam_search`` call it)."""
    missing = [name for name in ("num_layers", "num_kv_heads", "head_dim", "vocab_size",
                                 "params", "forward") if not hasattr(model, name)]
    if missing:
        raise TypeError(f"{type(model).__name__} is not a paxkv Model: it lacks "
                        f"{', '.join(missing)} (see paxkv.core.protocol.Model)")
    for name in ("num_layers", "num_kv_heads", "head_dim", "vocab_size"):
        value = getattr(model, name)
        if not isinstance(value, int) or value < 1:
            raise TypeError(f"{type(model).__name__}.{name} must be an int >= 1, got {value!r}")
