"""Mesh helpers for the sharded cache: the ``("data", "model")`` mesh, its checks, and the
per-shard runner every sharded operation goes through.

A sharded cache's page-table arrays carry a leading *shard* axis of size ``data`` placed on the
mesh's ``data`` axis (``P("data")``), so each device's block is one shard's table. The pool
keeps a single-device pool's axes, its page axis holding every shard's pages one shard after
another (:data:`POOL`: pages on ``data``, kv heads on ``model``), so device ``(d, m)``'s block
is exactly a single-device pool of shard ``d``'s pages for kv heads ``m * K/model ... (m + 1)
* K/model - 1``::

    pool.k   [layers, data * (pages_per_shard + 1), kv_heads, page_size, head_dim]
                       |                              |
                       +-- "data"                     +-- "model"   (1 / (data x model) each)
    table    block_tables [data, rows_per_shard, max_pages_per_seq], ref_counts [data, ...]
                |
                +-- "data", the same on every device of one model row

:func:`per_shard` runs a single-device function on each block inside one ``shard_map`` (a
leading shard axis dropped inside and restored outside; the pool needs neither), so the pure
page-table ops and the paged attention run unchanged on a device's pages and heads, with no
collective unless the caller asks for one. The pool has no shard axis because dropping and
restoring one is a reshape around a size-1 axis, and with one kv head a device (two size-1
axes) XLA's CPU layout assignment turned those reshapes into copies of the whole pool, 4 a
layer (experiments/LOG.md, 2026-12-04).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)
SHARDED = P(DATA)  # a leading shard axis on the data axis
REPLICATED = P()
# [layers, data * (pages + 1), kv_heads, ...] pool leaves: pages on data, kv heads on model
POOL = P(None, DATA, MODEL)
# [data, rows, t, heads, head_dim] q / k / v blocks: the shard axis on data, heads on model
HEADS = P(DATA, None, None, MODEL)
ROW_HEADS = P(None, None, MODEL)  # [b, t, heads, head_dim] seen whole by every data shard


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


def axis_sizes(mesh: Mesh) -> tuple[int, int]:
    """``(data, model)`` of a ``("data", "model")`` mesh, checked: Raises ``ValueError``
    naming the axes a mesh lacks."""
    if not isinstance(mesh, Mesh) or tuple(mesh.axis_names) != AXES:
        names = getattr(mesh, "axis_names", None)
        raise ValueError(f"mesh must be a jax.sharding.Mesh with axes {AXES}, got {names!r}: "
                         "build one with paxkv.scale.mesh.make_mesh(data, model)")
    return mesh.shape[DATA], mesh.shape[MODEL]


def check_model_axis(name: str, size: int, mesh: Mesh) -> None:
    """Raises ``ValueError`` unless the model axis divides ``size`` (``name``: what is split,
    e.g. ``num_kv_heads``), naming the model axes and the mesh shapes on this mesh's devices
    that fit: a head split unevenly would give devices different heads to hold."""
    data, model = axis_sizes(mesh)
    if size % model == 0:
        return
    fits = divisors(size)
    n = data * model
    shapes = [(n // m, m) for m in fits if n % m == 0]
    raise ValueError(f"{name}={size} cannot be split over a model axis of {model}: the model "
                     f"axis must divide {size} ({either(fits)}); on these {n} devices use a "
                     f"(data, model) mesh of {either(shapes)}")


def split_data(name: str, total: int, data: int) -> int:
    """``total / data`` (a size split evenly over the data axis), or a ``ValueError`` naming
    ``name`` and the nearest sizes that fit."""
    if not isinstance(total, int) or total < data or total % data:
        lo, hi = max(data, total // data * data), (total // data + 1) * data
        raise ValueError(f"{name}={total!r} must be a positive multiple of the mesh's data "
                         f"axis ({data}): use {name}={lo} or {hi}, or another data axis")
    return total // data


def divisors(n: int, most: int = 64) -> list[int]:
    """The axis sizes up to ``most`` that split ``n`` evenly (for error messages)."""
    return [m for m in range(1, min(n, most) + 1) if n % m == 0]


def either(options: Sequence[Any]) -> str:
    """``"1, 2 or 4"``: choices as an error message lists them."""
    words = [str(x) for x in options]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def auto(mesh: Mesh) -> Mesh:
    """``mesh`` with every axis Auto (an Explicit mesh makes shard_map and vmap strict about
    the placement of every input)."""
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * mesh.devices.ndim)


def sharded(mesh: Mesh) -> NamedSharding:
    """Where every page-table leaf lives: its leading shard axis on ``data``."""
    return NamedSharding(mesh, SHARDED)


def pool_sharding(mesh: Mesh) -> NamedSharding:
    """Where every pool leaf lives: page axis on ``data``, kv-head axis on ``model``."""
    return NamedSharding(mesh, POOL)


def per_shard(fn: Callable[..., Any], mesh: Mesh, blocks: Any, shared: Any = (),
              out_specs: Any = SHARDED, *, block_specs: Any = SHARDED,
              shared_specs: Any = REPLICATED) -> Any:
    """Runs ``fn(block, shared)`` once per data shard inside one ``shard_map``.

    Args:
      fn: a single-device function of one shard's ``block`` (the leading shard axis removed
        from leaves whose spec starts with ``"data"``) and ``shared``; it may call
        ``jax.lax.axis_index("data")`` for its shard id. Outputs whose spec starts with
        ``"data"`` (``SHARDED``, ``HEADS``) get the leading axis back; ``POOL`` ones are
        returned as they are; ``REPLICATED`` ones must be the same on every shard (a ``psum``
        over ``"data"`` makes them so).
      blocks: a pytree of ``[data, ...]`` arrays and pool leaves (placed by ``shard_map``).
      shared: a pytree of arrays every data shard sees whole.
      out_specs: a pytree prefix of ``fn``'s outputs (default: all ``SHARDED``).
      block_specs, shared_specs: pytree prefixes of ``blocks`` / ``shared``: ``POOL`` /
        ``HEADS`` leaves (or ``ROW_HEADS`` shared ones) arrive with only this device's heads.
    """
    def body(block: Any, rest: Any) -> Any:
        out = fn(_on_shard_axis(block_specs, block, lambda x: x[0]), rest)
        return _on_shard_axis(out_specs, out, lambda x: x[None])

    return jax.shard_map(body, mesh=mesh, in_specs=(block_specs, shared_specs),
                         out_specs=out_specs)(blocks, shared)


def _on_shard_axis(specs: Any, tree: Any, f: Callable[[jax.Array], jax.Array]) -> Any:
    """``f`` on the leaves of ``tree`` whose spec (``specs`` is a pytree prefix) starts with
    ``"data"``: those with a leading shard axis."""
    def on(spec: P, sub: Any) -> Any:
        return jax.tree.map(f, sub) if len(spec) > 0 and spec[0] == DATA else sub
    return jax.tree.map(on, specs, tree, is_leaf=lambda x: isinstance(x, P))


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


def shard_of(rows: jax.Array, rows_per_shard: int) -> jax.Array:
    """The data shard of each global row id (``row // rows_per_shard``; -1 stays negative:
    no shard)."""
    return jax.numpy.where(rows >= 0, rows // rows_per_shard, -1)
