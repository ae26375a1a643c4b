"""What an engine builds from its arguments before its first step: the cache it asked for by
name (on a mesh when given one) and the model's weights placed on that mesh; and the checks of
what every entry point is given (sizes, prompts as token ids or text). Shared by
:class:`paxkv.Engine`, :func:`paxkv.generate`, :func:`paxkv.beam_search` and the scorer, so
every entry point checks sizes, meshes and prompts the same way and names the same fixes.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from paxkv.attention.blocks import check_windows
from paxkv.cache import dense as dense_cache
from paxkv.cache import grouped, layer_groups
from paxkv.cache import paged as paged_cache
from paxkv.core import buckets
from paxkv.core.compiles import CompileStats, counting, metered
from paxkv.core.sampling import SamplingParams
from paxkv.engine import accounting
from paxkv.core.protocol import KVCache
from paxkv.engine.cache_ops import CacheOps
from paxkv.engine.prefix_sharing import SharedPrefixes, WindowPrefixes
from paxkv.engine.tiered_prefixes import TieredPrefixes
from paxkv.prefix.host_tier import HostTier
from paxkv.scale import mesh as pmesh
from paxkv.scale import sharded_cache, tensor_parallel

# Cache rows when the caller names none (on a mesh: rounded up to a multiple of its data axis).
DEFAULT_MAX_SEQS = 32


def default_max_seqs(max_seqs: int | None, mesh: Mesh | None = None) -> int:
    """``max_seqs`` as given, or when None :data:`DEFAULT_MAX_SEQS` rounded up to a multiple of
    ``mesh``'s data axis (36 on a data axis of 6), so a default never fails to split over the
    mesh. A size the caller chose is left for :func:`build_cache` to check."""
    if max_seqs is not None:
        return max_seqs
    data = 1 if mesh is None else pmesh.axis_sizes(mesh)[0]
    return buckets.cdiv(DEFAULT_MAX_SEQS, data) * data


def build_cache(model: Any, cache: str | KVCache, *, max_seqs: int | None, max_len: int,
                page_size: int, num_pages: int | None, kv_dtype: Any, attention_impl: str,
                scrub: bool, mesh: Mesh | None = None, step_tokens: int | None = None,
                step_rows: int | None = None, prefix_cache: bool = False) -> KVCache:
    """The cache an engine asked for by name ("paged" or "dense", sized for ``model``), or
    ``cache`` itself when it is already a :class:`KVCache`. ``num_pages`` defaults to the
    dense reservation ``max_seqs * ceil(max_len / page_size)``; ``max_seqs`` None: the
    default for ``mesh`` (:func:`default_max_seqs`). With a ``("data", "model")``
    ``mesh`` a paged cache is :func:`paxkv.scale.sharded_cache.create`'s (``max_seqs`` and
    ``num_pages`` split over the data axis, a ``ValueError`` naming sizes that fit
    otherwise). A model with sliding-window layers (``model.layer_windows``) gets, given
    ``step_tokens`` (the most tokens one step adds over all rows, over at most ``step_rows``
    rows), the layer-grouped cache
    whose window groups release their pages in the step (:mod:`paxkv.cache.grouped`;
    ``num_pages`` are then its global layers', and with ``prefix_cache`` each window group
    holds :func:`paxkv.cache.layer_groups.prefix_index_pages` more for the index); on a
    mesh, or without ``step_tokens``, a paged cache that keeps every layer's pages and applies the windows as masks."""
    if isinstance(cache, KVCache):
        if mesh is not None:
            raise ValueError("mesh= builds the cache by name: pass cache='paged' with it (a "
                             "cache you built carries its own mesh: leave mesh out)")
        return cache
    max_seqs = default_max_seqs(max_seqs, mesh)
    max_seqs, max_len, page_size = (check_size(n, v) for n, v in (
        ("max_seqs", max_seqs), ("max_len", max_len), ("page_size", page_size)))
    num_pages = None if num_pages is None else check_size("num_pages", num_pages)
    dims = dict(num_layers=model.num_layers, num_kv_heads=model.num_kv_heads,
                head_dim=model.head_dim, max_seqs=max_seqs, max_len=max_len, dtype=kv_dtype,
                layer_windows=getattr(model, "layer_windows", None))
    if cache == "paged":
        paged = dict(num_pages=num_pages or max_seqs * buckets.cdiv(max_len, page_size),
                     page_size=page_size, scrub=scrub, attention_impl=attention_impl, **dims)
        if mesh is not None:
            return sharded_cache.create(mesh=mesh, **paged)
        if step_tokens is not None and check_windows(dims["layer_windows"], model.num_layers):
            index = (layer_groups.prefix_index_pages(dims["layer_windows"], page_size,
                                                     max_seqs, max_len) if prefix_cache else 0)
            return grouped.create(step_tokens=step_tokens, step_rows=step_rows,
                                  index_pages=index, **paged)
        return paged_cache.create(**paged)
    if cache == "dense":
        if mesh is not None:
            raise ValueError("mesh= needs cache='paged': the dense cache runs on one device")
        return dense_cache.create(**dims)
    raise ValueError(f"cache must be 'paged', 'dense' or a KVCache, got {cache!r}")


def prefix_cache(ops: CacheOps, prefix_cache: bool | None, *, host_cache_bytes: int = 0,
                 host_ttl_s: float | None = None) -> SharedPrefixes | None:
    """The engine's prefix cache over ``ops``' cache (``prefix_cache``: the engine's argument;
    None = on where pages can be shared and a window group keeps index pages), with a host tier
    of ``host_cache_bytes`` under it (:class:`~paxkv.engine.tiered_prefixes.TieredPrefixes`;
    on a mesh a tier per data shard, each ``1 / data`` of the bytes)."""
    kv = ops.cache
    host_cache_bytes = check_size("host_cache_bytes", host_cache_bytes, minimum=0)
    if prefix_cache and not kv.shares_pages:
        raise ValueError("prefix_cache needs a paged cache (a dense row cannot be shared): "
                         "pass prefix_cache=False or cache='paged'")
    blind = isinstance(kv, grouped.GroupedPagedCache) and len(kv.groups.windows) > 1 \
        and not kv.index_pages  # an index that may keep no window page never hits
    if prefix_cache and blind:
        raise ValueError("this grouped cache keeps no page for a prefix index in its window "
                         "groups: build it with paxkv.cache.grouped.create(..., index_pages="
                         "paxkv.cache.layer_groups.prefix_index_pages(...)) or pass prefix_cache=False")
    use_index = kv.shares_pages and not blind if prefix_cache is None else prefix_cache
    paged = isinstance(kv, (paged_cache.PagedCache, sharded_cache.ShardedPagedCache))
    if host_cache_bytes and not (use_index and paged):
        raise ValueError("host_cache_bytes needs the prefix cache on a paged cache with no "
                         f"window groups (this one: {type(kv).__name__}, prefix cache "
                         f"{'on' if use_index else 'off'}): pass host_cache_bytes=0, or "
                         "cache='paged' with the prefix cache on")
    if host_cache_bytes and jax.process_count() > 1:
        raise ValueError("host_cache_bytes holds every shard's host tier in one process: on a "
                         "mesh over several processes pass host_cache_bytes=0")
    if not use_index:
        return None
    if isinstance(kv, grouped.GroupedPagedCache):
        return WindowPrefixes(ops, kv.page_size)
    if host_cache_bytes:  # split evenly over the data shards, each its own tier
        page, shards = kv.kv_bytes_per_page, ops.num_shards
        return TieredPrefixes(ops, kv.page_size, [
            HostTier(host_cache_bytes // shards // page, page, ttl_s=host_ttl_s,
                     memory_kind=host_memory_kind(kv)) for _ in range(shards)])
    return SharedPrefixes(ops, kv.page_size)


def host_memory_kind(kv: KVCache) -> str:
    """Where a host tier keeps pages for ``kv``: the backend's pinned host memory when the pool
    lies on one accelerator that has it (:class:`~paxkv.prefix.host_pages.PinnedPages`: DMA
    both ways), else numpy slots. A CPU's "device" memory is host memory already: there a page
    per pinned buffer only adds dispatches (the agents fleet ran 2.2x slower so, 12-05)."""
    if not isinstance(kv, paged_cache.PagedCache):
        return "numpy"  # a mesh's pool spans devices
    devices = kv.pool.k.sharding.device_set
    device = next(iter(devices))
    kinds = {m.kind for m in device.addressable_memories()}
    pinned = len(devices) == 1 and device.platform != "cpu" and "pinned_host" in kinds
    return "pinned_host" if pinned else "numpy"


def place_model(model: Any, mesh: Mesh | None) -> Any:
    """``model`` with its params on ``mesh`` (None: ``model`` unchanged): replicated on a
    ``(data, 1)`` mesh, split by :data:`paxkv.scale.tensor_parallel.LLAMA_RULES` on a model axis,
    kept as they are when every leaf already lies on the mesh's devices (a model of your own
    placed with your own rules: :func:`paxkv.scale.tensor_parallel.shard_model`). Placed once here,
    no weight moves inside a step."""
    if mesh is None:
        return model
    _, width = pmesh.axis_sizes(mesh)
    leaves = jax.tree.leaves(model.params)
    if leaves and all(isinstance(getattr(x, "sharding", None), NamedSharding)
                      and x.sharding.device_set == set(mesh.devices.flat) for x in leaves):
        return model
    rules = tensor_parallel.LLAMA_RULES if width > 1 else ()  # () replicates every leaf
    try:
        return tensor_parallel.shard_model(model, mesh, rules)
    except ValueError as e:
        raise ValueError(f"mesh= with a model axis of {width} splits the weights by "
                         f"paxkv.scale.tensor_parallel.LLAMA_RULES, which do not fit this model ({e}):"
                         " place them first with paxkv.scale.tensor_parallel.shard_model(model, mesh, "
                         "rules), or use a (data, 1) mesh") from e


def check_size(name: str, value: Any, minimum: int = 1) -> int:
    """``value`` as a Python int >= ``minimum`` (a numpy integer is fine); a ``ValueError``
    naming ``name`` otherwise. The one size check of every entry point's arguments."""
    try:
        size = operator.index(value)
    except TypeError:
        size = minimum - 1
    if size < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return size


def token_ids(ids: Any, what: str = "the prompt", *, text: bool = False) -> list[int]:
    """``ids`` (a list or tuple of ints, or a 1-D integer numpy / JAX array) as a list of
    Python ints; empty stays empty (the caller names that fix). Anything else raises a
    ``ValueError`` naming ``what`` and what to pass instead: float ids (never truncated
    silently), bools, a string, a single int, a nested or ragged list. ``text``: the caller
    also takes a string (the message offers it). The one check of every entry point's token
    ids (:func:`paxkv.generate`, :meth:`paxkv.Engine.submit`, :func:`paxkv.score`)."""
    instead = "a list of int token ids" + (" or a string" if text else "")
    if isinstance(ids, (str, bytes)):
        raise ValueError(f"{what} is a string: pass {instead} (the model's encode(text))")
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError) as e:  # ragged nesting, an object numpy cannot hold
        raise ValueError(f"{what} is not a flat list of token ids ({e}): pass {instead}, "
                         "e.g. [5, 17, 42]") from None
    if arr.ndim != 1:
        kind = (f"a single {type(ids).__name__}" if arr.ndim == 0 else
                f"nested (shape {tuple(arr.shape)})")
        raise ValueError(f"{what} is {kind}: pass {instead}, e.g. [5, 17, 42]")
    if not arr.size:
        return []
    if arr.dtype.kind == "b" or (isinstance(ids, (list, tuple))
                                 and any(isinstance(t, (bool, np.bool_)) for t in ids)):
        raise ValueError(f"{what} holds bools, not token ids: pass {instead}")
    if arr.dtype.kind not in "iu":
        shown = ", ".join(map(str, arr[:3])) + (", ..." if arr.size > 3 else "")
        raise ValueError(f"{what} holds {arr.dtype} values ({shown}), not int token ids: pass "
                         f"{instead} (a float id is never rounded for you)")
    return arr.tolist()


def encode(model: Any, text: str, what: str = "the prompt") -> list[int]:
    """``text`` through ``model.encode``; a ``ValueError`` naming ``what`` when the model has
    no tokenizer."""
    tokenize = getattr(model, "encode", None)
    if tokenize is None:
        raise ValueError(f"{what} is text, but this model ({type(model).__name__}) has no "
                         "tokenizer (encode): pass token ids")
    return token_ids(tokenize(text), f"{what}'s encoding")


def prompt_ids(model: Any, prompt: Any, what: str = "the prompt") -> list[int]:
    """A prompt given as text (encoded by ``model``) or as token ids (:func:`token_ids`)."""
    if isinstance(prompt, str):
        return encode(model, prompt, what)
    return token_ids(prompt, what, text=True)


@metered
def warm_up(self: Any, prompt_lengths: Sequence[int], max_new_tokens: int = 4,
            params: SamplingParams | None = None) -> CompileStats:
    """:meth:`paxkv.Engine.warm_up` (``self``): compiles the steps a batch of prompts of
    ``prompt_lengths`` tokens takes (its prefill calls, its decode steps at each width it
    passes) before the first request, by running that batch on placeholder tokens: for
    steady timings from the first real batch, warm up with one like it. The results are dropped, every page returns, the
    prefix cache forgets them (cached under a salt of their own: what it held before
    stays, pins too, unless they needed its room), admission's growth projection and the
    running totals restart (``compile_stats`` keeps what this paid). Returns what this paid.

    Args:
      prompt_lengths: one placeholder prompt of each length (distinct random tokens, so
        no prompt is served from another's pages).
      max_new_tokens: decode steps to run.
      params: the sampling the real requests will use (the default: greedy).
    """
    if self.has_work():
        raise ValueError("warm_up runs before any request: the engine has work queued or "
                         "running (finish or cancel it first)")
    paid = CompileStats()
    with counting(paid):
        rng = np.random.default_rng(0)
        salt = b"paxkv-warm-up\x00" + np.random.default_rng().bytes(16)  # no user's
        p = SamplingParams.of(params, max_new_tokens=max_new_tokens, stop_token_ids=[])
        for n in prompt_lengths:
            self.submit(rng.integers(0, self.model.vocab_size, int(n)).tolist(), p,
                        cache_salt=salt)
        self.run()  # hands every result out: the table keeps none of them
        if self.prefixes is not None:
            self.prefixes.drop_salt(self.swap.salt(salt))
    accounting.reset_totals(self.counters, self.ops, self.prefixes)  # compiles kept
    self.scheduler.growth.reset()
    return paid
