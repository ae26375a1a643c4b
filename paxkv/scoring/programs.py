"""The scorer's device side: its two jitted, donated steps, the programs they run in, and the
warm-up that compiles them ahead (:class:`Programs`; the planning rules are in
:mod:`paxkv.scoring.shapes`)."""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from paxkv.core import plan as attention_plan
from paxkv.core import stored
from paxkv.core.compiles import CompileStats, counting
from paxkv.core.plan import AttentionPlan
from paxkv.engine.cache_ops import CacheOps, host
from paxkv.scoring import steps
from paxkv.scoring.shapes import (StepShape, StepShapes, from_json, layout_key, recall,
                                  remember, runs)


def check_fits(shapes: Sequence[StepShape], max_seqs: int, max_len: int) -> None:
    """Raises ValueError for a program a scorer of ``max_seqs`` rows of ``max_len`` tokens
    cannot run (recorded by a larger one)."""
    for s in shapes:
        if s.rows > max_seqs or (s.plan.window or 0) > max_len:
            raise ValueError(f"{s} was run by a scorer with more rows or longer rows than this "
                             f"one (max_seqs={max_seqs}, max_len={max_len}): warm up a scorer "
                             "of the same layout")


def compile_all(shapes: Sequence[StepShape], prepare: Callable[[StepShape], Any],
                threads: int) -> CompileStats:
    """Runs ``prepare(shape)`` (compiles or loads that step's program) for every shape,
    ``threads`` at a time; each program is kept, so the first call of that shape runs it."""
    def one(s: StepShape) -> CompileStats:
        with counting(CompileStats()) as paid:  # counting is per thread
            prepare(s)
        return paid

    total = CompileStats()
    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        for paid in pool.map(one, shapes):
            total.add(paid)
    return total


class Programs:
    """The scorer's device side: its two jitted, donated steps over ``ops``' cache, the shapes
    and plans they run in (:class:`StepShapes`) and the warm-up.

    With a ``folder`` (the persistent compilation cache's), the programs earlier scorers of the
    same layout ran are known from the start (:func:`recall`): the planners rent them, and the
    first run of each loads it from that cache instead of compiling a shape of its own, so a new
    process on a new task mostly loads; :meth:`save` adds this scorer's."""

    def __init__(self, lm: Any, ops: CacheOps, folder: str | None = None) -> None:
        self.lm, self.ops, self.folder = lm, ops, folder
        self.forward_all = steps.all_logits(lm)
        self.shapes = StepShapes()
        self.key = layout_key(lm, ops.cache)
        for s in recall(folder, self.key) if folder else []:
            if s.rows <= ops.max_seqs and (s.plan.window or 0) <= ops.max_len:
                self.shapes.adopt(s)
        self._saved = len(self.shapes.shapes())  # programs known when the record was last read

    def save(self) -> None:
        """Adds the programs run so far to the folder's record (nothing without a folder, or
        when no program was added since the last save; a folder it cannot write is skipped:
        the record is a hint, never needed)."""
        shapes = self.shapes.shapes()
        if self.folder and len(shapes) != self._saved:
            try:
                remember(self.folder, self.key, shapes)
                self._saved = len(shapes)
            except OSError:
                pass

    @property
    def width_limit(self) -> int | None:
        """The widest continuation step the model scores (None: any)."""
        return self.forward_all.width_limit

    def program(self, kind: str) -> tuple[Any, Any]:
        """The jitted step of ``kind`` and the forward it runs."""
        if kind == "context":
            return steps.scored_last, self.lm.forward
        return steps.scored, self.forward_all

    def plan(self, prefixes: Sequence[Sequence[int]], longest: int) -> AttentionPlan:
        """The plan of a step whose rows hold ``prefixes`` before it and at most ``longest``
        tokens after it (:meth:`StepShapes.choose` rounds its window)."""
        cache = self.ops.cache
        shared = (attention_plan.shared_prefix_pages(prefixes, cache.page_size)
                  if cache.shares_pages and self.ops.shares else 0)
        return attention_plan.plan_step(longest=longest, max_len=cache.max_len,
                                        page_size=cache.page_size, prefix_pages=shared)

    @property
    def packs(self) -> bool:
        """Whether steps pack their real tokens: the model returns packed logits
        (:attr:`paxkv.scoring.steps.AllLogits.packs`) and the cache has one data shard
        (packing would mix the shards' rows)."""
        return self.forward_all.packs and self.ops.num_shards == 1

    def choose(self, kind: str, rows: int, width: int, extra: int, plan: AttentionPlan,
               max_width: int, real: Sequence[int]) -> tuple[StepShape, int]:
        """:meth:`StepShapes.choose` for this scorer's cache, and how many of the batch's
        rows the call runs (:func:`runs`); ``real``: each row's tokens, in batch order (read
        when the steps :attr:`packs`)."""
        real = list(real) if self.packs else None
        shape = self.shapes.choose(kind, rows, width, extra, self.ops.max_seqs, plan,
                                   self.ops.max_len, max_width, real)
        return shape, runs(shape, real)

    def run(self, shape: StepShape, tokens: np.ndarray, rows: np.ndarray, qlen: np.ndarray,
            extra: np.ndarray) -> tuple[np.ndarray, ...]:
        """One step of program ``shape`` (:meth:`paxkv.engine.cache_ops.CacheOps.run_step`)
        -> ``(logprobs, greedy, ok)`` as numpy; ``extra``: candidates or targets."""
        packed = shape.plan.packed_tokens
        if packed is not None and int(np.sum(qlen)) > packed:  # never a silently wrong cache
            raise RuntimeError(f"a scoring step feeds {int(np.sum(qlen))} tokens to {shape}, "
                               "which packs fewer: please report this")
        fn, forward = self.program(shape.kind)
        self.shapes.record(shape)
        return self.ops.run_step(lambda: stored.call(
            fn, forward, self.lm.params, self.ops.cache, host(tokens, np.int32),
            host(rows, np.int32), host(qlen, np.int32), host(extra, np.int32),
            plan=shape.plan))

    def warm_up(self, shapes: Iterable[StepShape] | str, threads: int) -> CompileStats:
        """:meth:`paxkv.scoring.Scorer.warm_up`."""
        todo = from_json(shapes) if isinstance(shapes, str) else list(shapes)
        check_fits(todo, self.ops.max_seqs, self.ops.max_len)

        def prepare(s: StepShape) -> None:
            fn, forward = self.program(s.kind)
            i32 = lambda *dims: jax.ShapeDtypeStruct(dims, jnp.int32)  # noqa: E731
            stored.prepare(fn, forward, self.lm.params, self.ops.cache, i32(s.rows, s.width),
                           i32(s.rows), i32(s.rows), i32(s.rows, s.extra), plan=s.plan)

        paid = compile_all(todo, prepare, threads)
        for s in todo:
            self.shapes.adopt(s)
        return paid
