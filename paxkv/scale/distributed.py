"""The sharded cache across several processes: each process owns whole data shards of the
mesh (their rows, pages and page tables) and feeds only its own rows.

JAX runs one program per process (multi-controller): every process calls the same jitted
steps on *global* arrays, of which it holds only the blocks on its own devices. So a decode
loop over :mod:`paxkv.scale.sharded_cache` needs three things beyond one process's, all here:

* :func:`initialize` joins the processes (``jax.distributed.initialize``) from arguments or
  the environment :mod:`paxkv.scale.launch` sets; with neither it is one process and does nothing,
  so the same script runs alone.
* :func:`process_mesh` lays the devices out process by process, so each process's devices
  are whole rows of the ``data`` axis (all ``model`` devices of a data shard in one process)::

      process 0: devices 0-3    process 1: devices 4-7            (2 processes x 4, model 1)
      data shard  [ 0  1  2  3 | 4  5  6  7 ]
      cache rows  [0 1 2 3 4 5 6 7 | 8 9 ... 15]   (max_seqs 16: 2 rows a shard)
                   process 0's     process 1's

  A process then holds the pool pages, page tables and rows of its shards and nothing else.
* :func:`feed` turns this process's rows of a per-row input (``[rows_here, ...]``) into the
  global ``[max_seqs, ...]`` array the steps take (``jax.make_array_from_process_local_data``:
  no process needs another's prompts); :func:`gather` brings a step's output to every process
  as numpy, :func:`local_part` reads this process's rows without any communication.

Outputs of a step stay global arrays: feed them back to the next step as they are (the next
tokens of :func:`paxkv.core.steps.decode_step` never leave the devices). Every process must make
the same calls in the same order, so a decision that ends a loop must come from gathered
values, never from one process's rows alone.

:class:`paxkv.Engine` on a :func:`process_mesh` follows the same rule one level up: every
process builds the same engine and makes the same calls (submit, step, fork, cancel) in the
same order. Its decisions are plain Python over those calls and over what it reads back from
the devices, which it reads with :func:`gather` (one process: ``jax.device_get``), so every
process decides alike; its step inputs are the same host arrays everywhere.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from paxkv.scale import mesh as pmesh

COORDINATOR, NUM_PROCESSES, PROCESS_ID = (
    "PAXKV_COORDINATOR", "PAXKV_NUM_PROCESSES", "PAXKV_PROCESS_ID")
"""The environment :mod:`paxkv.scale.launch` sets in each process (set them yourself on a cluster:
the same address and count on every host, its own id on each)."""


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> int:
    """Joins this process to the others and returns how many there are.

    Each argument left None comes from :data:`COORDINATOR` / :data:`NUM_PROCESSES` /
    :data:`PROCESS_ID` in the environment; with neither, one process: nothing is joined (1),
    so a script that calls this runs alone unchanged. Already joined (a cluster's own
    ``jax.distributed.initialize()``): its process count. Must run before anything touches
    a device (``jax.devices()``, an array): JAX starts its backends once. On CPU the
    collectives are gloo's (JAX's default). Raises ``ValueError`` naming what is missing or
    out of range.
    """
    if jax.distributed.is_initialized():
        return jax.process_count()
    env = os.environ
    coordinator = coordinator or env.get(COORDINATOR) or None
    count = num_processes if num_processes is not None else int(env.get(NUM_PROCESSES, 1))
    pid = process_id if process_id is not None else env.get(PROCESS_ID)
    if count == 1:
        return 1
    if coordinator is None:
        raise ValueError(f"{count} processes need a coordinator host:port (argument or "
                         f"{COORDINATOR}); on SLURM, Open MPI or a TPU pod, "
                         "jax.distributed.initialize() with no arguments finds it")
    if pid is None or not 0 <= int(pid) < count:
        raise ValueError(f"process_id must be in 0..{count - 1} (argument or {PROCESS_ID}), "
                         f"got {pid!r}")
    jax.distributed.initialize(coordinator, count, int(pid))
    return jax.process_count()


def process_mesh(model: int = 1) -> Mesh:
    """A ``(data, model)`` mesh over every process's devices, ``data = devices / model``,
    each process's devices forming whole data rows (process 0's the first rows).

    Raises ``ValueError`` when ``model`` does not divide a process's device count (a data
    shard would straddle two processes, so its pages would be split between their hosts).
    """
    local = jax.local_device_count()
    if model < 1 or local % model:
        raise ValueError(f"a model axis of {model} must divide each process's "
                         f"{local} devices ({pmesh.either(pmesh.divisors(local))}): a data "
                         "shard's devices must all belong to one process")
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return pmesh.make_mesh(len(devices) // model, model, devices)


def local_shards(mesh: Mesh) -> np.ndarray:
    """int ``[shards_here]``: the data shards whose devices all belong to this process, in
    order. Raises ``ValueError`` if a shard is split between processes or this process's
    shards are not consecutive (build the mesh with :func:`process_mesh`)."""
    pmesh.axis_sizes(mesh)
    owner = np.vectorize(lambda d: d.process_index)(mesh.devices)  # [data, model]
    if (owner != owner[:, :1]).any():
        raise ValueError("a data shard's devices belong to several processes: build the mesh "
                         "with paxkv.scale.distributed.process_mesh")
    mine = np.flatnonzero(owner[:, 0] == jax.process_index())
    if mine.size and not np.array_equal(mine, np.arange(mine[0], mine[-1] + 1)):
        raise ValueError(f"this process's data shards {mine.tolist()} are not consecutive: "
                         "build the mesh with paxkv.scale.distributed.process_mesh")
    return mine


def local_rows(mesh: Mesh, max_seqs: int) -> np.ndarray:
    """int32 ``[rows_here]``: the global cache rows of this process's data shards (rows ``d
    * rows_per_shard ... (d + 1) * rows_per_shard - 1`` of each shard ``d``), in order: the
    rows whose inputs it feeds and whose outputs :func:`local_part` reads."""
    data, _ = pmesh.axis_sizes(mesh)
    if max_seqs % data:
        raise ValueError(f"max_seqs={max_seqs} must be a multiple of the data axis ({data})")
    per = max_seqs // data
    return (local_shards(mesh)[:, None] * per + np.arange(per)).reshape(-1).astype(np.int32)


def feed(mesh: Mesh, local: Any, max_seqs: int) -> jax.Array:
    """This process's rows ``[rows_here, ...]`` (in :func:`local_rows` order) -> the global
    per-row array ``[max_seqs, ...]``, rows split over ``data`` (``P("data")``) as the
    sharded cache's rows are; the other processes supply theirs in the same call."""
    local = np.asarray(local)
    want = len(local_rows(mesh, max_seqs))
    if local.shape[:1] != (want,):
        raise ValueError(f"this process owns {want} rows, got an array of shape {local.shape}")
    where = NamedSharding(mesh, pmesh.SHARDED)
    return jax.make_array_from_process_local_data(where, local, (max_seqs, *local.shape[1:]))


def replicated(mesh: Mesh, value: Any) -> jax.Array:
    """``value`` (numpy, the same on every process) whole on every device of ``mesh``
    (``P()``): a step's input that is not per row, e.g. stop ids."""
    return jax.device_put(np.asarray(value), NamedSharding(mesh, pmesh.REPLICATED))


def gather(tree: Any) -> Any:
    """Every array leaf of ``tree`` whole, as numpy, on every process (a collective: every
    process must call it, in the same order). One process: ``jax.device_get``."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    return multihost_utils.process_allgather(tree, tiled=True)


def local_part(x: jax.Array) -> np.ndarray:
    """This process's blocks of a global array split on its leading axis (``[max_seqs, ...]``
    rows, or a ``[data, ...]`` per-shard array) -> numpy ``[mine, ...]`` in order: no
    communication. A block repeated over ``model`` devices is read once."""
    blocks = {}
    for shard in x.addressable_shards:
        start = shard.index[0].start if shard.index and shard.index[0].start else 0
        blocks.setdefault(start, shard.data)
    return np.concatenate([np.asarray(blocks[k]) for k in sorted(blocks)])


def all_processes(values: Any) -> np.ndarray:
    """``values`` (the same shape on every process) from every process, stacked ``[processes,
    ...]``: a report of what each one holds (a collective, as :func:`gather`)."""
    values = np.asarray(values)
    if jax.process_count() == 1:
        return values[None]
    return np.asarray(multihost_utils.process_allgather(values))
