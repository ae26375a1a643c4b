"""Mesh helpers for the sharded cache: the ``("data", "model")`` mesh, its checks, and the
per-shard runner every sharded operation goes through.

A sharded cache's arrays carry a leading *shard* axis of size ``data`` placed on the mesh's
``data`` axis (``P("data")``), so each device's block is one shard's single-device state::

    pool.k   [data, layers, pages_per_shard + 1, kv_heads, page_size, head_dim]
    table    block_tables [data, rows_per_shard, max_pages_per_seq], ref_counts [data, ...]
                  |
                  +-- device d holds index d of the shard axis (model axis of size 1)

:func:`per_shard` runs a single-device function on each block inside one ``shard_map`` (the
leading axis dropped inside, restored outside), so the pure page-table ops and the paged
attention run unchanged, with no collective unless the caller asks for one.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)
SHARDED = P(DATA)  # a leading shard axis on the data axis
REPLICATED = P()


def make_mesh(data: int, model: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """A ``(data, model)`` mesh with Auto axes over the first ``data * model`` devices (or
    ``devices``): Auto, not jax 0.10's default Explicit, so jitted steps take inputs of any
    placement and XLA moves them."""
    devices = jax.devices() if devices is None else list(devices)
    if data * model > len(devices):
        raise ValueError(f"a ({data}, {model}) mesh needs {data * model} devices but "
                         f"{len(devices)} are visible (on a CPU: set JAX_NUM_CPU_DEVICES "
                         "before JAX starts)")
    grid = np.asarray(devices[:data * model], dtype=object).reshape(data, model)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def data_size(mesh: Mesh) -> int:
    """The data axis of a ``("data", "model")`` mesh, checked: Raises ``ValueError`` naming
    the axes a mesh lacks, or a model axis other than 1 (not built yet)."""
    if not isinstance(mesh, Mesh) or tuple(mesh.axis_names) != AXES:
        names = getattr(mesh, "axis_names", None)
        raise ValueError(f"mesh must be a jax.sharding.Mesh with axes {AXES}, got {names!r}: "
                         "build one with paxkv.mesh.make_mesh(data, model)")
    if mesh.shape[MODEL] != 1:
        raise ValueError(f"the mesh's model axis is {mesh.shape[MODEL]}: model-axis (kv-head) "
                         "sharding is not built yet; use a (data, 1) mesh")
    return mesh.shape[DATA]


def auto(mesh: Mesh) -> Mesh:
    """``mesh`` with every axis Auto (an Explicit mesh makes shard_map and vmap strict about
    the placement of every input)."""
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * mesh.devices.ndim)


def sharded(mesh: Mesh) -> NamedSharding:
    """Where every cache leaf lives: its leading shard axis on ``data``."""
    return NamedSharding(mesh, SHARDED)


def per_shard(fn: Callable[..., Any], mesh: Mesh, blocks: Any, shared: Any = (),
              out_specs: Any = SHARDED) -> Any:
    """Runs ``fn(block, shared)`` once per data shard inside one ``shard_map``.

    Args:
      fn: a single-device function of one shard's ``block`` (the leading axis removed) and
        ``shared``; it may call ``jax.lax.axis_index("data")`` for its shard id. Outputs
        whose spec is ``SHARDED`` get the leading axis back; ``REPLICATED`` ones must be the
        same on every shard (a ``psum`` over ``"data"`` makes them so).
      blocks: a pytree whose array leaves are ``[data, ...]`` (placed by ``shard_map``).
      shared: a pytree of arrays every shard sees whole.
      out_specs: a pytree prefix of ``fn``'s outputs (default: all ``SHARDED``).
    """
    def body(block: Any, rest: Any) -> Any:
        out = fn(jax.tree.map(lambda x: x[0], block), rest)
        return jax.tree.map(lambda spec, o: _restack(spec, o), out_specs, out,
                            is_leaf=lambda x: isinstance(x, P))

    return jax.shard_map(body, mesh=mesh, in_specs=(SHARDED, REPLICATED),
                         out_specs=out_specs)(blocks, shared)


def _restack(spec: P, out: Any) -> Any:
    return jax.tree.map(lambda x: x[None], out) if spec == SHARDED else out


COLLECTIVES = ("all-reduce", "all-gather", "collective-permute", "all-to-all",
               "reduce-scatter")


def count_collectives(compiled_text: str) -> dict[str, int]:
    """Collective ops in a compiled module's text (``jit(f).lower(...).compile().as_text()``),
    by kind; async pairs (``all-reduce-start`` / ``-done``) count once."""
    counts = {}
    for kind in COLLECTIVES:
        n = 0
        for line in compiled_text.splitlines():
            if "=" not in line:
                continue
            op = line.split("=", 1)[1]
            if f" {kind}(" in op or f" {kind}-start(" in op:
                n += 1
        counts[kind] = n
    return counts
