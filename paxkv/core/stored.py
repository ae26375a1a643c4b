"""Step programs stored on disk as compiled executables: a new process skips tracing,
lowering and compiling them.

JAX's persistent compilation cache (:mod:`paxkv.core.compiles`) keys a program by its lowered
module, so a new process must still trace and lower every step before the cache hands it
back: for the default model on these cores a step traces in 0.1-0.4 s and lowers in ~0.1 s,
against ~0.05 s to load its executable (issue 35; LOG 2026-12-05).

:func:`call` runs a jitted ``step(forward, *args, **static)`` through its executable, compiled
the first time any process met its key and written beside the persistent cache (``<cache
folder>/paxkv-steps``; :mod:`jax.experimental.serialize_executable`). A later process reads
the file and calls the loaded executable: nothing traced, lowered or looked up in JAX's cache.
The program takes the arguments' leaves flat and the outputs are rebuilt from the stored
tree; the ``donate``-th argument's buffers are donated as the step donates them.

**When.** Only with the persistent cache on and ``$PAXKV_STORE_STEPS`` not "off"
(:func:`folder`), on one device (a mesh keeps its own placement: called directly), and for a
``forward`` that names itself (:func:`forward_key`). A step that cannot be compiled as a
flat program is called directly, once tried; one whose executable cannot be written runs
from memory, unstored.

**The key** (a SHA-256 file name) holds what a trace or a compile reads: the step, the
forward's key, the argument tree (the cache's static layout included), each leaf's shape and
dtype, the static arguments' ``repr``, JAX's tracing configuration (matmul precision, x64,
promotion), the jax / jaxlib / flax versions, the platform, the device kind, ``$XLA_FLAGS``,
the host CPU's model and features (an executable holds machine code for them), and a digest
of the source of ``paxkv``, its models, ``pallas_kernels`` and the forward's class: an edit
stores new programs, never runs stale ones. A key whose text holds an address (new in every
process) is never stored. The folder is trusted code, as JAX's own cache is: keep it private.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import threading
import time
from typing import Any, Callable

import jax

from paxkv.core import compiles
from paxkv.core.program_key import disk_key, forward_key

__all__ = ["call", "compiled", "folder", "forget", "forward_key", "prepare"]

SUBFOLDER = "paxkv-steps"
ENV = "PAXKV_STORE_STEPS"

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Program:
    """A stored step: ``run(*leaves) -> out leaves`` (a compiled executable, donating) and the
    output tree."""

    run: Callable[..., Any]
    out_tree: Any
    stores: bool = True  # compiled by XLA here (False: reloaded, which cannot be written)


_programs: dict[Any, Program | None] = {}  # in-process: None = call the step directly
_building: dict[Any, threading.Event] = {}  # keys a thread is compiling or loading now
_lock = threading.Lock()


def folder() -> str | None:
    """``<persistent cache folder>/paxkv-steps``, or None: JAX's persistent cache is off, or
    ``$PAXKV_STORE_STEPS`` is "off" (exporting costs a new program ~0.06-0.25 s more to
    compile: the test suite, which compiles thousands, turns it off)."""
    where = jax.config.jax_compilation_cache_dir
    if not where or os.environ.get(ENV, "on").strip().lower() in ("off", "0", "false", "no"):
        return None
    return os.path.join(where, SUBFOLDER)


def _aval(leaf: Any) -> tuple[tuple[int, ...], Any, bool]:
    """Shape, dtype, weak type: what a program is specialised to (cheap: read every step)."""
    return (leaf.shape, leaf.dtype, getattr(leaf, "weak_type", False))


def _device(leaves: list[Any]) -> Any | None:
    """The one device every placed leaf is on, or None (several devices or processes, or a
    leaf placed on a mesh: a sharded step keeps its own placement)."""
    shardings = [s for s in (getattr(x, "sharding", None) for x in leaves) if s is not None]
    if not all(isinstance(s, jax.sharding.SingleDeviceSharding) for s in shardings):
        return None
    devices = {d for s in shardings for d in s.device_set}
    if len(devices) > 1 or jax.process_count() != 1:
        return None
    return devices.pop() if devices else jax.devices()[0]


def _donated(tree: Any, leaves: list[Any], donate: int | None) -> tuple[int, ...]:
    if donate is None:
        return ()
    args = jax.tree_util.tree_unflatten(tree, list(range(len(leaves))))
    return tuple(jax.tree_util.tree_leaves(args[donate]))


def _compile(step: Any, forward: Any, tree: Any, avals: tuple[Any, ...],
             static: dict[str, Any], donate: int | None, device: Any, name: str) -> Program:
    """Traces, lowers and compiles ``step`` as a program of the arguments' leaves, placed on
    ``device`` (a fresh, uncommitted cache and a step's committed output would otherwise be
    two programs), named after its key ``name``.

    The executable must come from XLA, not from JAX's persistent cache: one loaded from there
    serializes without its kernels (a later process failed with "Function ... not found").
    The name keeps JAX's entries of one key apart from every other key's; where JAX's cache
    still has this one (its file deleted, or broken and written again), it compiles once more
    under a name no entry has."""
    out_tree = []

    def program(label: str) -> Any:
        def flat(*flat_args: Any) -> list[Any]:
            out = step(forward, *jax.tree_util.tree_unflatten(tree, list(flat_args)), **static)
            leaves_out, treedef = jax.tree_util.tree_flatten(out)
            out_tree.append(treedef)
            return leaves_out

        flat.__name__ = flat.__qualname__ = label  # JAX's cache keys the module by it
        on = jax.sharding.SingleDeviceSharding(device)
        specs = [jax.ShapeDtypeStruct(shape, dtype, weak_type=weak)
                 for shape, dtype, weak in avals]
        lowered = jax.jit(flat, in_shardings=on, out_shardings=on,
                          donate_argnums=_donated(tree, specs, donate)).lower(*specs)
        with compiles.counting(compiles.CompileStats()) as paid:
            run = lowered.compile()
        return run, paid.cache_loads == 0

    run, fresh = program(f"paxkv_step_{name[:16]}")
    if not fresh:
        run, fresh = program(f"paxkv_step_{name[:16]}_{os.getpid()}_{time.time_ns()}")
    return Program(run, out_tree[-1], stores=fresh)


def _load(path: str, device: Any) -> Program | None:
    from jax.experimental import serialize_executable

    try:
        start = time.perf_counter()
        with open(path, "rb") as f:
            record = pickle.load(f)
        run = serialize_executable.deserialize_and_load(
            record["executable"], record["in_tree"], record["out_leaves"],
            execution_devices=[device])
        compiles.loaded(time.perf_counter() - start)
        return Program(run, record["out_tree"])
    except FileNotFoundError:
        return None
    except Exception as e:  # unreadable or from another layout: compile afresh, overwrite it
        log.warning("paxkv: ignoring the stored step %s (%s: %s)", path, type(e).__name__, e)
        return None


def _save(path: str, program: Program) -> None:
    from jax.experimental import serialize_executable

    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        executable, in_tree, out_leaves = serialize_executable.serialize(program.run)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "wb") as f:
            pickle.dump(dict(executable=executable, in_tree=in_tree, out_leaves=out_leaves,
                             out_tree=program.out_tree), f)
        os.replace(tmp, path)  # atomic: processes may store the same program at once
    except OSError as e:  # a folder it cannot write: the program still runs, unstored
        log.warning("paxkv: cannot store a step program in %s (%s)", path, e)
    except Exception as e:  # noqa: BLE001 (an executable or a tree it cannot write)
        log.info("paxkv: a step program cannot be stored (%s: %s)", type(e).__name__, e)
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)  # left only by a failure: a stored file was renamed away


def _program(step: Any, forward: Any, fkey: str, tree: Any, static: dict[str, Any],
             avals: tuple[Any, ...], where: str, donate: int | None,
             device: Any) -> Program | None:
    name = disk_key(step, fkey, tree, static, avals)
    if name is None:
        return None
    path = os.path.join(where, f"{name}.bin")
    program = _load(path, device)
    if program is None:
        try:
            program = _compile(step, forward, tree, avals, static, donate, device, name)
        except Exception as e:  # noqa: BLE001 (not compilable this way: run it as jit would)
            log.info("paxkv: %s is not stored (%s: %s)", step.__qualname__, type(e).__name__, e)
            return None
        if program.stores:
            _save(path, program)
    return program


def _lookup(step: Any, forward: Any, args: tuple[Any, ...], static: dict[str, Any],
            donate: int | None) -> tuple[Program | None, list[Any]]:
    leaves, tree = jax.tree_util.tree_flatten(args)
    where = folder()
    fkey = forward_key(forward) if where else None
    device = _device(leaves) if fkey is not None else None
    if device is None:
        return None, leaves
    try:
        avals = tuple(_aval(x) for x in leaves)
    except AttributeError:  # a Python scalar among the arguments: run it as jit would
        return None, leaves
    from jax._src import config as jax_config

    key = (step, fkey, tree, tuple(sorted(static.items())), avals, where, device,
           jax_config.trace_context())
    while True:
        with _lock:
            if key in _programs:
                return _programs[key], leaves
            building = _building.get(key)
            if building is None:  # this thread builds it; others wait for this key only
                building = _building[key] = threading.Event()
                break
        building.wait()
    try:
        program = _program(step, forward, fkey, tree, static, avals, where, donate, device)
        with _lock:
            _programs[key] = program
    finally:
        with _lock:
            del _building[key]
        building.set()
    return program, leaves


def compiled(step: Callable[..., Any]) -> int:
    """The programs of jitted ``step`` this process holds compiled: its own jit cache's and
    its stored programs (:func:`forget` drops those; ``jax.clear_caches()`` the others)."""
    with _lock:
        stored = [p for k, p in _programs.items() if k[0] is step and p is not None]
    return step._cache_size() + len(stored)


def forget() -> None:
    """Drops every stored program this process holds (as a new process would start; the
    files stay)."""
    with _lock:
        _programs.clear()


def call(step: Callable[..., Any], forward: Any, *args: Any, donate: int | None = 1,
         **static: Any) -> Any:
    """``step(forward, *args, **static)``, through its stored program when it has one.

    Args:
      step: a jitted step whose first argument is a static ``forward`` and whose keyword
        arguments are static (:func:`paxkv.core.steps.prefill_step`,
        :func:`paxkv.scoring.steps.scored`, ...).
      args: its traced arguments (arrays, pytrees, None), as the step takes them.
      donate: the index in ``args`` of the argument the step donates (its cache), or None.

    Returns:
      What ``step`` returns (the same tree).
    """
    program, leaves = _lookup(step, forward, args, static, donate)
    if program is None:
        return step(forward, *args, **static)
    return jax.tree_util.tree_unflatten(program.out_tree, program.run(*leaves))


def prepare(step: Callable[..., Any], forward: Any, *args: Any, donate: int | None = 1,
            **static: Any) -> None:
    """Compiles (or loads) the program :func:`call` would run for these arguments, so that
    its first call runs at once (a warm-up). ``args`` may hold :class:`jax.ShapeDtypeStruct`
    leaves; a step that is not stored is compiled into JAX's caches instead."""
    program, _ = _lookup(step, forward, args, static, donate)
    if program is None:
        step.lower(forward, *args, **static).compile()
