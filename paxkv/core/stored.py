"""Step programs stored on disk as exported StableHLO: a new process skips tracing and lowering.

JAX's persistent compilation cache (:mod:`paxkv.core.compiles`) keys a program by its lowered
module, so a new process must still trace and lower every step before the cache hands it
back: for the default model on these cores a step traces in 0.1-0.4 s and lowers in ~0.1 s,
against ~0.05 s to load its executable (issue 35; LOG 2026-12-05).

:func:`call` runs a jitted ``step(forward, *args, **static)`` through a program exported
(:func:`jax.export.export`) the first time any process met its key and written beside the
persistent cache (``<cache folder>/paxkv-steps``). A later process deserializes it and lowers
only the thin wrapper ``jax.jit(exported.call)`` (~0.015 s), whose executable the persistent
cache loads. The program takes the arguments' leaves flat and the outputs are rebuilt from the
stored tree; the ``donate``-th argument's buffers are donated as the step donates them.

**When.** Only with the persistent cache on and ``$PAXKV_STORE_STEPS`` not "off"
(:func:`folder`), on one device (a mesh keeps its
own placement: called directly), and for a ``forward`` that names itself
(:func:`forward_key`). A step that cannot be exported (a custom call without a stability
guarantee, an effect) is called directly, once tried.

**The key** (a SHA-256 file name) holds what a trace reads: the step, the forward's key, the
argument tree (the cache's static layout included), each leaf's shape and dtype, the static
arguments' ``repr``, JAX's tracing configuration (matmul precision, x64, promotion), the jax /
jaxlib / flax versions, the platform, and a digest of the source of ``paxkv``, its models,
``pallas_kernels`` and the forward's class: an edit stores new programs, never runs stale
ones. A key whose text holds an address (new in every process) is never stored. The folder is
trusted code, as JAX's own cache is: keep it private to you.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import inspect
import logging
import os
import pickle
import threading
from typing import Any, Callable

import jax
import numpy as np

SUBFOLDER = "paxkv-steps"
ENV = "PAXKV_STORE_STEPS"
FORMAT = 1  # the stored record's layout: bump to ignore every file written before
PACKAGES = ("paxkv", "paxkv.models", "pallas_kernels")

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Program:
    """A stored step: ``run(*leaves) -> out leaves`` (jitted, donating) and the output tree."""

    run: Callable[..., Any]
    out_tree: Any


_programs: dict[Any, Program | None] = {}  # in-process: None = call the step directly
_lock = threading.Lock()


def folder() -> str | None:
    """``<persistent cache folder>/paxkv-steps``, or None: JAX's persistent cache is off, or
    ``$PAXKV_STORE_STEPS`` is "off" (exporting costs a new program ~0.06-0.25 s more to
    compile: the test suite, which compiles thousands, turns it off)."""
    where = jax.config.jax_compilation_cache_dir
    if not where or os.environ.get(ENV, "on").strip().lower() in ("off", "0", "false", "no"):
        return None
    return os.path.join(where, SUBFOLDER)


def forward_key(forward: Any) -> str | None:
    """A text naming everything ``forward``'s trace reads besides its arguments, or None.

    A bound method of an object whose class defines ``program_key() -> str`` (paxkv's
    :class:`paxkv.models.LanguageModel`: its class, config and compute dtype), or a callable
    object whose class does (:class:`paxkv.scoring.steps.AllLogits`), gives
    ``"<class>.<method>|<key>|<digest of the class's source file>"``. Anything else (a
    researcher's model without one, a lambda) gives None: never stored."""
    owner = getattr(forward, "__self__", None)
    name = getattr(forward, "__name__", "?") if owner is not None else "__call__"
    owner = forward if owner is None else owner
    cls = type(owner)
    # Defined by the class itself: a wrapper that forwards attributes (``__getattr__``) to a
    # model must not borrow that model's key for a forward of its own.
    if not callable(inspect.getattr_static(cls, "program_key", None)):
        return None
    text = owner.program_key()
    if text is None:
        return None
    return f"{cls.__module__}.{cls.__qualname__}.{name}|{text}|{_class_digest(cls)}"


@functools.cache
def _source_digest() -> str:
    """SHA-256 over the source of paxkv, its models and pallas_kernels, and the versions."""
    import flax
    import jaxlib

    h = hashlib.sha256(f"{FORMAT}|{jax.__version__}|{jaxlib.__version__}|"
                       f"{flax.__version__}".encode())
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        for root in (spec.submodule_search_locations or []) if spec else []:
            for path in sorted(_py_files(root)):
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def _py_files(root: str) -> list[str]:
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files
            if f.endswith(".py")]


@functools.cache
def _file_digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


@functools.cache
def _class_digest(cls: type) -> str:
    """The digest of the file defining ``cls`` (a researcher's subclass included)."""
    try:
        path = inspect.getsourcefile(cls)
    except TypeError:
        path = None
    return _file_digest(path) if path else "?"


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


def _trace_config() -> str:
    """JAX's configuration that tracing reads (what ``jax.jit`` keys its own cache by), less
    whatever prints an address."""
    from jax._src import config as jax_config

    return repr([r for r in map(repr, jax_config.trace_context()) if " at 0x" not in r])


def _disk_key(step: Any, fkey: str, tree: Any, static: dict[str, Any],
              avals: tuple[Any, ...]) -> str | None:
    text = repr((f"{step.__module__}.{step.__qualname__}", fkey, str(tree),
                 sorted((k, repr(v)) for k, v in static.items()),
                 [(tuple(shape), np.dtype(dtype).name, bool(weak)) for shape, dtype, weak in avals],
                 _trace_config(), jax.default_backend(), _source_digest()))
    if " at 0x" in text:  # an address: a new key in every process, never found again
        return None
    return hashlib.sha256(text.encode()).hexdigest()


def _donated(tree: Any, leaves: list[Any], donate: int | None) -> tuple[int, ...]:
    if donate is None:
        return ()
    args = jax.tree_util.tree_unflatten(tree, list(range(len(leaves))))
    return tuple(jax.tree_util.tree_leaves(args[donate]))


def _exported(step: Any, forward: Any, tree: Any, leaves: list[Any], static: dict[str, Any]
              ) -> tuple[Any, Any]:
    out_tree = []

    def flat(*flat_args: Any) -> list[Any]:
        out = step(forward, *jax.tree_util.tree_unflatten(tree, list(flat_args)), **static)
        leaves_out, treedef = jax.tree_util.tree_flatten(out)
        out_tree.append(treedef)
        return leaves_out

    specs = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in leaves]
    exported = jax.export.export(jax.jit(flat))(*specs)
    return exported, out_tree[0]


def _load(path: str) -> tuple[Any, Any] | None:
    try:
        with open(path, "rb") as f:
            record = pickle.load(f)
        return jax.export.deserialize(bytearray(record["exported"])), record["out_tree"]
    except FileNotFoundError:
        return None
    except Exception as e:  # unreadable or from another layout: export afresh, overwrite it
        log.warning("paxkv: ignoring the stored step %s (%s: %s)", path, type(e).__name__, e)
        return None


def _save(path: str, exported: Any, out_tree: Any) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as f:
            pickle.dump(dict(exported=bytes(exported.serialize()), out_tree=out_tree), f)
        os.replace(tmp, path)  # atomic: processes may store the same program at once
    except OSError as e:  # a folder it cannot write: the program still runs, unstored
        log.warning("paxkv: cannot store a step program in %s (%s)", path, e)
    except (pickle.PicklingError, TypeError, AttributeError) as e:  # a tree it cannot write
        log.info("paxkv: a step's output tree cannot be stored (%s)", e)
        with contextlib.suppress(OSError):
            os.remove(tmp)


def _program(step: Any, forward: Any, fkey: str, tree: Any, leaves: list[Any],
             static: dict[str, Any], avals: tuple[Any, ...], where: str,
             donate: int | None, device: Any) -> Program | None:
    name = _disk_key(step, fkey, tree, static, avals)
    if name is None:
        return None
    path = os.path.join(where, f"{name}.bin")
    found = _load(path)
    if found is None:
        try:
            found = _exported(step, forward, tree, leaves, static)
        except Exception as e:  # noqa: BLE001 (not exportable: run it as jit would)
            log.info("paxkv: %s is not stored (%s: %s)", step.__qualname__, type(e).__name__, e)
            return None
        _save(path, *found)
    exported, out_tree = found
    # Placed explicitly: a fresh (uncommitted) cache and a step's (committed) output would
    # otherwise lower the wrapper twice, as two programs.
    on = jax.sharding.SingleDeviceSharding(device)
    run = jax.jit(exported.call, in_shardings=on, out_shardings=on,
                  donate_argnums=_donated(tree, leaves, donate))
    return Program(run, out_tree)


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
    try:
        return _programs[key], leaves
    except KeyError:
        pass
    with _lock:  # one export per key, however many threads warm up at once
        if key not in _programs:
            _programs[key] = _program(step, forward, fkey, tree, leaves, static, avals, where,
                                      donate, device)
    return _programs[key], leaves


def compiled(step: Callable[..., Any]) -> int:
    """The programs of jitted ``step`` this process holds compiled: its own jit cache's and
    those of its stored programs (``jax.clear_caches()`` empties both)."""
    with _lock:
        stored = [p for k, p in _programs.items() if k[0] is step and p is not None]
    return step._cache_size() + sum(p.run._cache_size() for p in stored)


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


def lower(step: Callable[..., Any], forward: Any, *args: Any, donate: int | None = 1,
          **static: Any) -> Any:
    """``step.lower(forward, *args, **static)`` as :func:`call` would run it: the stored
    program's wrapper when it has one. ``args`` may hold :class:`jax.ShapeDtypeStruct` leaves
    (a warm-up); compiling the result fills the persistent cache the first call loads from."""
    program, leaves = _lookup(step, forward, args, static, donate)
    if program is None:
        return step.lower(forward, *args, **static)
    return program.run.lower(*leaves)
