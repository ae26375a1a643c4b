"""Megatron-style tensor parallelism for a model's weights on the mesh's ``model`` axis.

A rule names parameters by a regular expression over their path (keys joined by ``/``, e.g.
``params/layers/attn/q_proj/kernel``) and gives their :class:`~jax.sharding.PartitionSpec`;
:func:`shard_params` places every leaf of any params pytree with the first rule that matches
(none: replicated), so a model of your own brings its own rules. Nothing in the model changes:
with the weights placed, XLA's partitioner runs each matmul on the slices a device holds and
inserts the sums itself. Per Llama layer::

    x [b,t,D] (whole) -> q/k/v_proj  [D, H|K, Dh] column-parallel: heads on "model"
                      -> attention   per device, its heads only (paxkv.scale.sharded_attention)
                      -> o_proj      [H, Dh, D]   row-parallel: partial sums -> all-reduce 1
    x [b,t,D] (whole) -> gate/up     [D, F]       column-parallel: F on "model"
                      -> down_proj   [F, D]       row-parallel: partial sums -> all-reduce 2

so a decode step costs two all-reduces of ``[b, t, D]`` activations per layer on the model
axis, and no K/V or weight moves. Norms, embeddings and the vocabulary head stay replicated
(a vocab-sharded head would need an all-gather of the logits before sampling).
"""

from __future__ import annotations

import copy
import re
from typing import Any, Sequence

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from paxkv.scale import mesh as pmesh

Rule = tuple[str, P]  # (regex searched in the "/"-joined path, spec of the leaf)

M = pmesh.MODEL
LLAMA_RULES: tuple[Rule, ...] = (
    # layers are stacked by nn.scan: every spec starts with the layer axis, unsplit
    (r"layers/attn/[qkv]_proj/kernel$", P(None, None, M, None)),  # [L, D, H|K, Dh] column
    (r"layers/attn/[qkv]_proj/bias$", P(None, M, None)),  # [L, H|K, Dh]
    (r"layers/attn/o_proj/kernel$", P(None, M, None, None)),  # [L, H, Dh, D] row
    (r"layers/mlp/(gate|up)_proj/kernel$", P(None, None, M)),  # [L, D, F] column
    (r"layers/mlp/down_proj/kernel$", P(None, M, None)),  # [L, F, D] row
)
"""The rules of :class:`paxkv.models.llama.Llama` (its param layout is in that module)."""

def path_name(path: Sequence[Any]) -> str:
    """A pytree key path as the ``/``-joined string rules match (``params/embed/embedding``)."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def param_specs(params: Any, mesh: Mesh, rules: Sequence[Rule] = LLAMA_RULES) -> Any:
    """The :class:`~jax.sharding.PartitionSpec` of every leaf of ``params`` (same tree).

    Raises ``ValueError`` when no rule matches any parameter (rules written for another
    layout would otherwise leave every weight silently replicated; a rule may match nothing,
    as the bias rules do for a model without biases) or when a split axis is not a multiple
    of its mesh axis, naming the parameter, its shape and the sizes that fit.
    """
    used = [False]

    def spec_of(path: Sequence[Any], leaf: Any) -> P:
        name = path_name(path)
        for pattern, spec in rules:
            if re.search(pattern, name):
                used[0] = True
                _check_divides(name, leaf.shape, spec, mesh)
                return spec
        return P()

    specs = jax.tree_util.tree_map_with_path(spec_of, params)
    if rules and not used[0]:
        names = [path_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)][:4]
        raise ValueError(f"no tensor-parallel rule matches a parameter; paths look like "
                         f"{names}: give rules for this model's params (paxkv.scale.tensor_parallel)")
    return specs


def _check_divides(name: str, shape: tuple[int, ...], spec: P, mesh: Mesh) -> None:
    if len(spec) > len(shape):
        raise ValueError(f"rule spec {spec} has {len(spec)} axes but {name} is {shape}")
    for dim, axis in zip(shape, spec):
        if axis is None:
            continue
        size = mesh.shape[axis]
        if dim % size:
            raise ValueError(f"{name} {tuple(shape)}: its axis of {dim} cannot be split over "
                             f"the mesh's {axis!r} axis of {size}; that axis must divide {dim} "
                             f"({pmesh.either(pmesh.divisors(dim))})")


def shard_params(params: Any, mesh: Mesh, rules: Sequence[Rule] = LLAMA_RULES) -> Any:
    """``params`` placed on ``mesh`` by ``rules`` (:func:`param_specs`), every other leaf
    replicated: the copy each step reads, so no weight moves inside a jitted step."""
    mesh = pmesh.auto(mesh)
    specs = param_specs(params, mesh, rules)
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs,
                        is_leaf=lambda x: isinstance(x, P))


def shard_model(model: Any, mesh: Mesh, rules: Sequence[Rule] = LLAMA_RULES) -> Any:
    """A shallow copy of a :class:`paxkv.core.protocol.Model` whose ``params`` are
    :func:`shard_params` of its own: hand it to :class:`paxkv.Engine` with a cache on the
    same mesh (``paxkv.scale.sharded_cache.create(mesh=...)``). The original keeps its params."""
    out = copy.copy(model)
    out.params = shard_params(model.params, mesh, rules)
    return out
