"""The scorer's step programs: a bounded set, chosen by ski rental, remembered, compiled ahead.

Every scoring step is one compiled program per ``(kind, rows, width, extra, plan)``::

    kind "context"       scored_last: tokens [rows, width], candidates [rows, extra]
    kind "continuation"  scored:      tokens [rows, width], targets    [rows, width]

**The ladder.** Each dimension is rounded to a short ladder: rows to powers of two; context
widths to :func:`paxkv.core.buckets.fine` up to ``prefill_chunk``; continuation widths to powers
of two from 4; candidates to powers of two from 8; the attention window to a power of two up to
``max_len``. So the programs a scorer can ever compile are a fixed, finite set for its layout.

**Ski rental over whole programs.** A step first looks for a known program at least as wide,
with as many candidates and a plan that covers its own (:meth:`~paxkv.core.plan.AttentionPlan.
covers`: a window at least as long), and runs there, padded, until the padding paid in place of
its own tight program passes :data:`paxkv.core.buckets.COMPILE_TOKENS` (what one compile costs
on 2 CPU cores, in tokens of step work); then its tight program compiles. So a workload never
pays more than twice the better of "compile every tight program" and "pad into what is known",
and a scorer kept across tasks (the lm-eval backend keeps one) runs a new task of ordinary
lengths mostly in programs it has (``tests/test_step_shapes.py``: at most 6 compiles a task).

**Remembered and compiled ahead.** :meth:`StepShapes.shapes` lists the programs a scorer knows.
With the persistent compilation cache on, that list is kept beside it (:func:`remember`, keyed
by the model's sizes and the cache's layout), so a scorer in a later process plans with the
programs earlier ones compiled, and loads them instead of compiling shapes of its own;
:meth:`paxkv.scoring.Scorer.warm_up` compiles a list (or its JSON, :func:`to_json`) before the
first request, several at a time.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import tempfile
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from paxkv.core import buckets
from paxkv.core import plan as attention_plan
from paxkv.core.compiles import CompileStats, counting
from paxkv.core.plan import AttentionPlan
from paxkv.engine.cache_ops import CacheOps, host
from paxkv.scoring import steps

KINDS = ("context", "continuation")


@dataclasses.dataclass(frozen=True)
class StepShape:
    """One compiled scoring step: its kind, ``[rows, width]`` tokens, ``extra`` (candidates
    per row of a context step; a continuation step's targets are ``[rows, width]``, extra =
    width) and the attention plan it was compiled for."""

    kind: str
    rows: int
    width: int
    extra: int
    plan: AttentionPlan

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"StepShape.kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("rows", "width", "extra"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"StepShape.{name} must be an int >= 1, got {value!r}")


class StepShapes:
    """The programs a scorer knows (compiled, or remembered), the rent paid in place of each
    tight one, and the record of every program it ran."""

    def __init__(self, buy: int = buckets.COMPILE_TOKENS) -> None:
        self.buy = buy
        self.known: dict[str, dict[StepShape, None]] = {kind: {} for kind in KINDS}
        self.rent: dict[StepShape, int] = {}
        self._seen: dict[StepShape, None] = {}  # insertion-ordered set

    def choose(self, kind: str, rows: int, width: int, extra: int, max_rows: int,
               plan: AttentionPlan, max_len: int, max_width: int) -> StepShape:
        """The program for a step of ``rows`` rows of at most ``width`` tokens, ``extra``
        candidates (a continuation step: its width) and attention ``plan``: its tight one
        (``pow2(rows)`` rows, the plan's window rounded up to a power of two), or a known one
        at least as wide, with as many candidates and a plan that covers it, padded, while
        the padding paid in place of the tight one stays within ``buy`` tokens (ski rental).
        A program of ``b < rows`` rows runs only ``b`` rows now; none wider than
        ``max_width`` is rented."""
        if plan.window is not None:
            plan = dataclasses.replace(plan, window=min(max_len, buckets.pow2(plan.window)))
        b = buckets.pow2(rows, 1, max_rows)
        tight = StepShape(kind, b, width, width if kind == "continuation" else extra, plan)
        known = self.known[kind]
        same = [s for s in known if (s.rows, s.width, s.extra) == (b, width, tight.extra)
                and s.plan.covers(plan)]
        if same:
            return same[0]
        options = [(s.rows * s.width - buckets.pow2(min(rows, s.rows)) * width, i, s)
                   for i, s in enumerate(known) if width <= s.width <= max_width
                   and s.extra >= tight.extra and s.plan.covers(plan)]
        if options:
            cost, _, shape = min(options)
            paid = self.rent.get(tight, 0) + cost
            if paid <= self.buy:
                self.rent[tight] = paid
                return shape
        known[tight] = None
        return tight

    def owned(self, kind: str) -> set[tuple[int, int]]:
        """The ``(rows, width)`` of the programs known for ``kind`` (what the continuation
        planner prices as compiled: :func:`paxkv.scoring.batches.child_groups`)."""
        return {(s.rows, s.width) for s in self.known[kind]}

    def record(self, shape: StepShape) -> None:
        self._seen.setdefault(shape, None)

    def shapes(self) -> list[StepShape]:
        """Every step program known (run, warmed up or remembered), first known first."""
        return list(self._seen)

    def adopt(self, shape: StepShape) -> None:
        """Counts ``shape`` as compiled (:meth:`paxkv.scoring.Scorer.warm_up`, or remembered):
        the planner rents it from now on."""
        self.known[shape.kind][shape] = None
        self.record(shape)


def to_json(shapes: Iterable[StepShape]) -> str:
    """A list of step programs as JSON (what :func:`from_json` reads)."""
    return json.dumps([dict(dataclasses.asdict(s), plan=dataclasses.asdict(s.plan))
                       for s in shapes])


def from_json(text: str) -> list[StepShape]:
    """The list :func:`to_json` wrote."""
    return [StepShape(**dict(d, plan=AttentionPlan(**d["plan"]))) for d in json.loads(text)]


def check_fits(shapes: Sequence[StepShape], max_seqs: int, max_len: int) -> None:
    """Raises ValueError for a program a scorer of ``max_seqs`` rows of ``max_len`` tokens
    cannot run (recorded by a larger one)."""
    for s in shapes:
        if s.rows > max_seqs or (s.plan.window or 0) > max_len:
            raise ValueError(f"{s} was run by a scorer with more rows or longer rows than this "
                             f"one (max_seqs={max_seqs}, max_len={max_len}): warm up a scorer "
                             "of the same layout")


def compile_all(shapes: Sequence[StepShape], lower: Callable[[StepShape], Any],
                threads: int) -> CompileStats:
    """Compiles ``lower(shape)`` (a ``jax.stages.Lowered``) for every shape, ``threads`` at a
    time; JAX keeps each executable, so the first call of that shape runs it."""
    def one(s: StepShape) -> CompileStats:
        with counting(CompileStats()) as paid:  # counting is per thread
            lower(s).compile()
        return paid

    total = CompileStats()
    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        for paid in pool.map(one, shapes):
            total.add(paid)
    return total


def layout_key(lm: Any, cache: Any) -> str:
    """What a step program depends on besides its shape: the model's sizes and the cache's
    type and layout (a digest; the persistent cache keys the programs themselves)."""
    pool = getattr(cache, "pool", None)
    dtype = getattr(getattr(pool, "k", None), "dtype", None)
    parts = (type(lm).__name__, lm.num_layers, lm.num_kv_heads, lm.head_dim, lm.vocab_size,
             type(cache).__name__, cache.max_seqs, cache.max_len, cache.page_size,
             getattr(cache, "num_pages", 0), str(dtype))
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def recall(folder: str, key: str) -> list[StepShape]:
    """The programs scorers of layout ``key`` ran before (:func:`remember`), or [] ."""
    try:
        with open(os.path.join(folder, "paxkv-scoring", f"{key}.json")) as f:
            return from_json(f.read())
    except (OSError, ValueError, TypeError, KeyError):  # none yet, or unreadable: start afresh
        return []


def remember(folder: str, key: str, shapes: Sequence[StepShape]) -> None:
    """Adds ``shapes`` to the record of layout ``key`` in ``folder`` (replaced atomically:
    processes may write it at once; the last writer's union wins)."""
    where = os.path.join(folder, "paxkv-scoring")
    os.makedirs(where, exist_ok=True)
    known = dict.fromkeys(recall(folder, key))
    known.update(dict.fromkeys(shapes))
    fd, tmp = tempfile.mkstemp(dir=where, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(to_json(known))
    os.replace(tmp, os.path.join(where, f"{key}.json"))


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

    def choose(self, kind: str, rows: int, width: int, extra: int, plan: AttentionPlan,
               max_width: int) -> StepShape:
        """:meth:`StepShapes.choose` for this scorer's cache."""
        return self.shapes.choose(kind, rows, width, extra, self.ops.max_seqs, plan,
                                  self.ops.max_len, max_width)

    def run(self, shape: StepShape, tokens: np.ndarray, rows: np.ndarray, qlen: np.ndarray,
            extra: np.ndarray) -> tuple[np.ndarray, ...]:
        """One step of program ``shape`` (:meth:`paxkv.engine.cache_ops.CacheOps.run_step`)
        -> ``(logprobs, greedy, ok)`` as numpy; ``extra``: candidates or targets."""
        fn, forward = self.program(shape.kind)
        self.shapes.record(shape)
        return self.ops.run_step(lambda: fn(
            forward, self.lm.params, self.ops.cache, host(tokens, np.int32),
            host(rows, np.int32), host(qlen, np.int32), host(extra, np.int32),
            plan=shape.plan))

    def warm_up(self, shapes: Iterable[StepShape] | str, threads: int) -> CompileStats:
        """:meth:`paxkv.scoring.Scorer.warm_up`."""
        todo = from_json(shapes) if isinstance(shapes, str) else list(shapes)
        check_fits(todo, self.ops.max_seqs, self.ops.max_len)

        def lower(s: StepShape) -> Any:
            fn, forward = self.program(s.kind)
            i32 = lambda *dims: jax.ShapeDtypeStruct(dims, jnp.int32)  # noqa: E731
            return fn.lower(forward, self.lm.params, self.ops.cache, i32(s.rows, s.width),
                            i32(s.rows), i32(s.rows), i32(s.rows, s.extra), plan=s.plan)

        paid = compile_all(todo, lower, threads)
        for s in todo:
            self.shapes.adopt(s)
        return paid
