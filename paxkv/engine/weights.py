"""The weights an engine steps, and replacing them between steps (RL: a new policy each step).

What :meth:`paxkv.Engine.update_params` does to the requests in flight (``in_flight``):

* "abort": running requests (and waiting ones that made tokens before a preemption) end
  "aborted" with the tokens they made, handed out by the next ``step()``;
* "keep": they go on under the new weights with the K/V they have (computed under the old);
* "recompute": their tokens so far are prefilled again under the new weights, then they go on.

With "abort" or "recompute", held rows (finished ``hold=True`` requests, shared prefixes from
``submit_prefix``) are prefilled again too and keep their finish reasons and rows, so no fork
or :meth:`~paxkv.Engine.extend` reads K/V of the old weights. None is allowed only when
nothing is in flight. Every token's weight version is in its result
(:attr:`~paxkv.engine.requests.GenerationResult.weight_versions`).

:class:`Weights` holds the params tree every jitted step takes as a traced argument, a
``version`` (one more per :meth:`paxkv.Engine.update_params`: the version that sampled each
token is in its result) and an ``epoch``, the part of the prefix cache's key that says which
weights computed a page's K/V (:func:`paxkv.engine.requests.epoch_salt`): it moves with the
version unless the caller keeps stale K/V on purpose.

:func:`check_like` refuses a tree the compiled steps cannot take as they are (a leaf missing
or extra, another shape or dtype), naming the leaf, before anything changes.
:func:`place_like` puts each leaf where the current one lies: a leaf already there is taken as
it is (no copy: the engine steps the caller's array), any other is placed once. Same tree,
shapes, dtypes and placement: the steps' compiled programs are reused, none is traced again.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paxkv.engine.requests import epoch_salt

IN_FLIGHT = ("abort", "keep", "recompute")


@dataclasses.dataclass
class Weights:
    """The params tree the steps read, its version and its prefix-cache epoch."""

    params: Any
    version: int = 0
    epoch: int = 0


@dataclasses.dataclass(frozen=True)
class ParamsUpdate:
    """What :meth:`paxkv.Engine.update_params` did.

    Attributes:
      version: the engine's weight version now (tokens sampled from here on carry it).
      placed: leaf paths that were copied to the engine's placement (another device or
        sharding, or a host array); every other leaf is the caller's array, uncopied.
      aborted: ids of requests ended "aborted" (``in_flight="abort"``).
      recomputed: ids of requests whose K/V is computed again under the new weights before
        they go on (``"recompute"``; with "abort" or "recompute", held rows and shared
        prefixes too).
      kept: ids of requests that go on with the K/V they have (``"keep"``).
      dropped_prefix_pages: pages the prefix cache forgot (their K/V came from the old weights).
    """

    version: int
    placed: tuple[str, ...] = ()
    aborted: tuple[int, ...] = ()
    recomputed: tuple[int, ...] = ()
    kept: tuple[int, ...] = ()
    dropped_prefix_pages: int = 0


def _leaves(tree: Any) -> dict[str, Any]:
    return {jax.tree_util.keystr(path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def check_like(new: Any, old: Any) -> None:
    """Raises a ``ValueError`` naming the first leaf path of ``new`` that the steps compiled
    for ``old`` cannot take: missing, extra, another shape or another dtype."""
    have, want = _leaves(new), _leaves(old)
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing or extra:
        raise ValueError(f"update_params: the new params tree differs from the engine's: "
                         f"missing {missing[:5]}, extra {extra[:5]} (pass the same tree the "
                         "engine was built with, e.g. the trainer's params after an optax step)")
    if jax.tree.structure(new) != jax.tree.structure(old):
        raise ValueError("update_params: the new params have the same leaf paths but another "
                         f"tree structure ({jax.tree.structure(new)} vs "
                         f"{jax.tree.structure(old)}): pass the same container types")
    for path, leaf in want.items():
        got = have[path]
        shape, dtype = np.shape(got), getattr(got, "dtype", None)
        if shape != leaf.shape:
            raise ValueError(f"update_params: leaf {path} has shape {shape}, expected "
                             f"{leaf.shape}")
        if dtype is None or jnp.dtype(dtype) != leaf.dtype:
            raise ValueError(f"update_params: leaf {path} has dtype {dtype}, expected "
                             f"{leaf.dtype} (cast it first: a new dtype would compile every "
                             "step again)")


def _same_place(new: Any, old: Any) -> bool:
    return (isinstance(new, jax.Array) and not new.is_deleted()
            and new.sharding.is_equivalent_to(old.sharding, new.ndim)
            and getattr(new, "weak_type", False) == getattr(old, "weak_type", False))


def place_like(new: Any, old: Any) -> tuple[Any, tuple[str, ...]]:
    """``new`` with every leaf where ``old``'s lies, and the paths of the leaves that had to be
    copied there (a leaf already in place is taken as it is). Call :func:`check_like`
    first."""
    placed: list[str] = []

    def put(path: Any, leaf: Any, ref: Any) -> Any:
        if _same_place(leaf, ref):
            return leaf
        placed.append(jax.tree_util.keystr(path))
        value = jax.device_put(leaf, ref.sharding)
        if getattr(ref, "weak_type", False) != getattr(value, "weak_type", False):
            value = jax.lax.convert_element_type(value, ref.dtype)  # a strong (non-weak) copy
        return value

    out = jax.tree_util.tree_map_with_path(put, new, old)
    return out, tuple(placed)


def check_in_flight(in_flight: str | None, busy: int) -> str:
    """``in_flight`` checked at the Python boundary: one of :data:`IN_FLIGHT`, or None when no
    request is in flight (``busy`` is how many are)."""
    if in_flight is None:
        if busy:
            raise ValueError(f"update_params: {busy} requests are in flight (running, held or "
                             "shared prefixes): say what happens to them with in_flight="
                             "'abort' (end them, keep their tokens), 'keep' (go on with their "
                             "K/V) or 'recompute' (prefill their tokens again under the new "
                             "weights)")
        return "keep"
    if in_flight not in IN_FLIGHT:
        raise ValueError(f"in_flight must be one of {IN_FLIGHT}, got {in_flight!r}")
    return in_flight


class WeightSwap:
    """An engine's weights, replaced between steps, and the prefix cache keyed by them: every
    cached page's key holds the weight epoch of its K/V (:func:`epoch_salt`), and the prompts
    :meth:`pin` pinned are pinned again under each new epoch.

    Composed of the engine's :class:`Weights`, its row hand-overs (:class:`Lifecycle`: what
    happens to the rows in flight) and its prefix cache (None without one)."""

    def __init__(self, weights: Weights, life: Any, prefixes: Any):
        self.weights, self.life, self.prefixes = weights, life, prefixes
        self.pins: dict[tuple[tuple[int, ...], str | bytes | None], None] = {}

    def salt(self, cache_salt: str | bytes | None) -> str | bytes | None:
        """The prefix cache's key for ``cache_salt``'s pages under the current weights."""
        return epoch_salt(cache_salt, self.weights.epoch)

    def _pins(self, what: str) -> None:
        if self.prefixes is None or not hasattr(self.prefixes, "pin"):
            raise ValueError(f"{what} needs the prefix cache of a paged cache: build the "
                             "engine with prefix_cache=True")

    def pin(self, ids: list[int], cache_salt: str | bytes | None) -> int:
        """:meth:`paxkv.Engine.pin_prefix`: pins ``ids``' pages under the current weights, and
        under every later weight epoch."""
        self._pins("pin_prefix")
        pinned = self.prefixes.pin(ids, self.salt(cache_salt))
        self.pins[(tuple(ids), cache_salt)] = None
        return len(pinned)

    def unpin(self, ids: list[int], cache_salt: str | bytes | None) -> int:
        """:meth:`paxkv.Engine.unpin_prefix`."""
        self._pins("unpin_prefix")
        self.pins.pop((tuple(ids), cache_salt), None)
        return len(self.prefixes.unpin(ids, self.salt(cache_salt)))

    def forget(self, keep_pins: bool) -> int:
        """Clears the prefix cache (device and host tiers); ``keep_pins``: pins again what
        :meth:`pin` pinned, under the current weights. Returns the pages the index held."""
        if self.prefixes is None:
            return 0
        dropped = self.prefixes.clear()
        if not keep_pins:
            self.pins.clear()
        for ids, salt in self.pins:
            self.prefixes.pin(list(ids), self.salt(salt))
        return dropped

    def update(self, params: Any, in_flight: str | None,
               keep_prefix_cache: bool) -> ParamsUpdate:
        """:meth:`paxkv.Engine.update_params`: checks ``params`` (nothing changes if it is
        refused), places it, settles the rows in flight, then swaps."""
        check_like(params, self.weights.params)
        mode = check_in_flight(in_flight, sum(map(len, self.life.in_flight())))
        new, placed = place_like(params, self.weights.params)
        aborted, recomputed, kept = self.life.update(mode)
        self.weights.params, self.weights.version = new, self.weights.version + 1
        dropped = 0
        if not keep_prefix_cache:
            self.weights.epoch += 1
            dropped = self.forget(keep_pins=True)
        return ParamsUpdate(self.weights.version, placed, tuple(aborted), tuple(recomputed),
                            tuple(kept), dropped)
