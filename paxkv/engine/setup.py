"""What an engine builds from its arguments before its first step: the cache it asked for by
name (on a mesh when given one) and the model's weights placed on that mesh. Shared by
:class:`paxkv.Engine`, :func:`paxkv.beam_search` and the scorer, so every entry point checks
sizes and meshes the same way and names the same fixes.
"""

from __future__ import annotations

import operator
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from paxkv.core import buckets

from paxkv.cache import dense as dense_cache

from paxkv.scale import mesh as pmesh

from paxkv.cache import paged as paged_cache

from paxkv.scale import sharded_cache
from paxkv.scale import tensor_parallel
from paxkv.core.protocol import KVCache


def build_cache(model: Any, cache: str | KVCache, *, max_seqs: int, max_len: int,
                page_size: int, num_pages: int | None, kv_dtype: Any, attention_impl: str,
                scrub: bool, mesh: Mesh | None = None) -> KVCache:
    """The cache an engine asked for by name ("paged" or "dense", sized for ``model``), or
    ``cache`` itself when it is already a :class:`KVCache`. ``num_pages`` defaults to the
    dense reservation ``max_seqs * ceil(max_len / page_size)``. With a ``("data", "model")``
    ``mesh`` a paged cache is :func:`paxkv.scale.sharded_cache.create`'s (``max_seqs`` and
    ``num_pages`` split over the data axis, a ``ValueError`` naming sizes that fit
    otherwise)."""
    if isinstance(cache, KVCache):
        if mesh is not None:
            raise ValueError("mesh= builds the cache by name: pass cache='paged' with it (a "
                             "cache you built carries its own mesh: leave mesh out)")
        return cache
    max_seqs, max_len, page_size = (check_size(n, v) for n, v in (
        ("max_seqs", max_seqs), ("max_len", max_len), ("page_size", page_size)))
    num_pages = None if num_pages is None else check_size("num_pages", num_pages)
    dims = dict(num_layers=model.num_layers, num_kv_heads=model.num_kv_heads,
                head_dim=model.head_dim, max_seqs=max_seqs, max_len=max_len, dtype=kv_dtype)
    if cache == "paged":
        paged = dict(num_pages=num_pages or max_seqs * buckets.cdiv(max_len, page_size),
                     page_size=page_size, scrub=scrub, attention_impl=attention_impl, **dims)
        if mesh is not None:
            return sharded_cache.create(mesh=mesh, **paged)
        return paged_cache.create(**paged)
    if cache == "dense":
        if mesh is not None:
            raise ValueError("mesh= needs cache='paged': the dense cache runs on one device")
        return dense_cache.create(**dims)
    raise ValueError(f"cache must be 'paged', 'dense' or a KVCache, got {cache!r}")


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


def check_size(name: str, value: Any) -> int:
    """``value`` as a Python int >= 1 (a numpy integer is fine); a ``ValueError`` naming
    ``name`` otherwise. The one size check of every entry point's arguments."""
    try:
        size = operator.index(value)
    except TypeError:
        size = 0
    if size < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return size
