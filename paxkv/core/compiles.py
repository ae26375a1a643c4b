"""Compiles paid once: JAX's persistent compilation cache turned on where paxkv runs the
program for the user, and the compiles each engine or scorer paid, counted.

**The persistent cache.** Every new process compiles every step program again unless JAX's
persistent compilation cache is on (XLA:CPU compiles of the default model's steps take seconds
each; an lm-eval run meets a few dozen). :func:`use_persistent_cache` turns it on, once per
process, in the user's cache folder (the XDG convention, never inside a checkout)::

    $PAXKV_COMPILE_CACHE            a folder, or "off" / "0" / "false": the cache stays off
    $XDG_CACHE_HOME/paxkv/jax       else, when XDG_CACHE_HOME is set
    ~/.cache/paxkv/jax              else

An argument (``compile_cache=`` on :class:`paxkv.Engine`, :func:`paxkv.generate`,
:func:`paxkv.score`, :func:`paxkv.beam_search` and the lm-eval backend) moves it (a folder) or
turns it off (False). A user who configured JAX's cache (``JAX_COMPILATION_CACHE_DIR`` or
``jax.config.update("jax_compilation_cache_dir", ...)``) keeps theirs: paxkv changes nothing.
JAX keys each entry by the program, the flags and the versions, so a stale entry is never
loaded. The cache is trusted code: keep its folder private to you (JAX's own warning).

JAX finds a program in that cache only after tracing and lowering it again; the engine's and
the scorer's steps are also stored there as compiled executables (:mod:`paxkv.core.stored`),
so a later process skips both.

**Counting.** :func:`metered` attributes JAX's monitoring events (tracing, lowering, XLA's
backend compile, a persistent-cache load) to the :class:`CompileStats` of whatever engine or
scorer is running, so ``stats()`` says what a call paid for compiles.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
from typing import Any, Callable, Iterator, TypeVar

import jax

ENV = "PAXKV_COMPILE_CACHE"
OFF = ("off", "0", "false", "no", "")
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # a compile, or a cache load
TRACE_AND_LOWER = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration")
CACHE_HIT = "/jax/compilation_cache/cache_hits"
MIN_COMPILE_SECONDS = 0.0  # every program: JAX's default (1 s) skips most of a small model's steps


def default_folder() -> str:
    """``$XDG_CACHE_HOME/paxkv/jax``, or ``~/.cache/paxkv/jax``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "paxkv", "jax")


def use_persistent_cache(where: str | os.PathLike | bool | None = None) -> str | None:
    """Turns JAX's persistent compilation cache on for this process (see the module
    docstring) and returns its folder, or None when it stays off.

    Args:
      where: a folder; False: leave the cache off; None or True: ``$PAXKV_COMPILE_CACHE``,
        else :func:`default_folder`.
    """
    configured = jax.config.jax_compilation_cache_dir
    if configured:  # the user's own (or an earlier call's): keep it
        return configured
    if where is False:
        return None
    if where is None or where is True:
        env = os.environ.get(ENV)
        if env is not None and env.strip().lower() in OFF:
            return None
        where = env or default_folder()
    folder = os.path.abspath(os.fspath(where))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create the compile cache folder {folder!r} ({e}): pass "
                         f"compile_cache=<a writable folder> or False, or set {ENV}") from e
    jax.config.update("jax_compilation_cache_dir", folder)
    if jax.config.jax_persistent_cache_min_compile_time_secs >= 1.0:  # JAX's default
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return folder


@dataclasses.dataclass
class CompileStats:
    """What an engine or scorer paid for compiles since it was made (or last reset).

    Attributes:
      compiles: programs XLA compiled (persistent-cache loads excluded).
      cache_loads: programs loaded from the persistent cache instead.
      compile_seconds: wall seconds tracing, lowering, compiling and loading them.
    """

    compiles: int = 0
    cache_loads: int = 0
    compile_seconds: float = 0.0

    def reset(self) -> None:
        self.compiles = self.cache_loads = 0
        self.compile_seconds = 0.0

    def add(self, other: "CompileStats") -> None:
        self.compiles += other.compiles
        self.cache_loads += other.cache_loads
        self.compile_seconds += other.compile_seconds


_local = threading.local()  # .active: the CompileStats of the calls running on this thread
_registered = False
_register_lock = threading.Lock()


def _active() -> list[CompileStats]:
    if not hasattr(_local, "active"):
        _local.active = []
    return _local.active


def _on_duration(event: str, duration: float, **_: Any) -> None:
    if event == BACKEND_COMPILE:
        for stats in _active():
            stats.compiles += 1
            stats.compile_seconds += duration
    elif event in TRACE_AND_LOWER:
        for stats in _active():
            stats.compile_seconds += duration


def _on_event(event: str, **_: Any) -> None:
    if event == CACHE_HIT:  # its backend-compile event follows (the load): not a compile
        for stats in _active():
            stats.cache_loads += 1
            stats.compiles -= 1


def loaded(seconds: float) -> None:
    """Counts a program loaded outside JAX's cache (a stored step, :mod:`paxkv.core.stored`)
    as a cache load of ``seconds`` for the calls running on this thread."""
    for stats in _active():
        stats.cache_loads += 1
        stats.compile_seconds += seconds


@contextlib.contextmanager
def counting(stats: CompileStats) -> Iterator[CompileStats]:
    """Adds the compiles this thread runs inside the block to ``stats`` (once, however
    deeply nested)."""
    global _registered
    with _register_lock:
        if not _registered:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            jax.monitoring.register_event_listener(_on_event)
            _registered = True
    active = _active()
    if any(s is stats for s in active):
        yield stats
        return
    active.append(stats)
    try:
        yield stats
    finally:  # by identity: equal stats of an outer block must stay (list.remove uses ==)
        del active[next(i for i, s in enumerate(active) if s is stats)]


F = TypeVar("F", bound=Callable[..., Any])


def metered(method: F) -> F:
    """A method of an object with a ``compile_stats`` (:class:`CompileStats`) attribute whose
    compiles it counts there."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with counting(self.compile_stats):
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]
