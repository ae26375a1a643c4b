"""What a stored step program is named by (:mod:`paxkv.core.stored`): everything its trace
and its compile read besides the arguments' values.

:func:`forward_key` names a model's forward (its class, config and compute dtype, and the
digest of the file defining the class); :func:`disk_key` adds the step, the argument tree
and avals, the static arguments, JAX's tracing configuration, the versions, the machine an
executable's code is built for (:func:`machine`) and a digest of paxkv's own source, so an
edit, an upgrade or another host stores new programs and never runs stale ones.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import os
from typing import Any

import jax
import numpy as np

FORMAT = 2  # the stored record's layout: bump to ignore every file written before
PACKAGES = ("paxkv", "paxkv.models", "pallas_kernels")


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


@functools.cache
def machine() -> str:
    """What an executable's machine code was built for: the device kind, XLA's flags and, on
    a CPU, the host's model and instruction-set features (a folder shared by two hosts must
    never run one's code on the other)."""
    device = jax.devices()[0]
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        cpu = "|".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))
    except OSError:  # not Linux: the processor's name is the best we have
        import platform

        cpu = f"{platform.machine()}|{platform.processor()}"
    return repr((device.platform, device.device_kind, device.client.platform_version,
                 os.environ.get("XLA_FLAGS", ""), hashlib.sha256(cpu.encode()).hexdigest()))


def disk_key(step: Any, fkey: str, tree: Any, static: dict[str, Any],
              avals: tuple[Any, ...]) -> str | None:
    text = repr((f"{step.__module__}.{step.__qualname__}", fkey, str(tree),
                 sorted((k, repr(v)) for k, v in static.items()),
                 [(tuple(shape), np.dtype(dtype).name, bool(weak)) for shape, dtype, weak in avals],
                 _trace_config(), jax.default_backend(), machine(), _source_digest()))
    if " at 0x" in text:  # an address: a new key in every process, never found again
        return None
    return hashlib.sha256(text.encode()).hexdigest()


def _trace_config() -> str:
    """JAX's configuration that tracing reads (what ``jax.jit`` keys its own cache by), less
    whatever prints an address."""
    from jax._src import config as jax_config

    return repr([r for r in map(repr, jax_config.trace_context()) if " at 0x" not in r])
