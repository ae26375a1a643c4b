"""The scorer's step programs: a bounded set, chosen by ski rental, remembered, compiled ahead.

Every scoring step is one compiled program per ``(kind, rows, width, extra, plan)``::

    kind "context"       scored_last: tokens [rows, width], candidates [rows, extra]
    kind "continuation"  scored:      tokens [rows, width], targets    [rows, width]

**The ladder.** Each dimension is rounded to a short ladder: rows to powers of two; context
widths to :func:`paxkv.core.buckets.fine` up to ``prefill_chunk``; continuation widths to powers
of two from 4; candidates to powers of two from 8; the attention window to a power of two up to
``max_len``; a one-shard scorer of a model that packs (:class:`paxkv.core.packing.Packing`)
packs each step's real tokens into :func:`paxkv.core.buckets.eighths` of their count. So the
programs a scorer can ever compile are a fixed, finite set for its layout.

**Ski rental over whole programs.** A step first looks for a known program at least as wide,
with as many candidates and a plan that covers its own (:meth:`~paxkv.core.plan.AttentionPlan.
covers`: a window at least as long; packed, the rows whose tokens it holds, in as many calls
as that takes), and runs there, padded, until the work paid in place of its own tight program,
judged on every call the batch needs (:func:`paxkv.core.packing.step_work`, and
:data:`~paxkv.scoring.batches.STEP_TOKENS` a call), passes
:data:`paxkv.core.buckets.COMPILE_TOKENS` (what one compile costs on 2 CPU cores, in tokens of
step work); then its tight program compiles. So a workload never
pays more than twice the better of "compile every tight program" and "pad into what is known",
and a scorer kept across tasks (the lm-eval backend keeps one) runs a new task of ordinary
lengths mostly in programs it has (``tests/test_step_shapes.py``: at most 6 compiles a task).

**Remembered and compiled ahead** (:class:`paxkv.scoring.programs.Programs`).
:meth:`StepShapes.shapes` lists the programs a scorer knows.
With the persistent compilation cache on, that list is kept beside it (:func:`remember`, keyed
by the model's sizes and the cache's layout), so a scorer in a later process plans with the
programs earlier ones compiled, and loads them instead of compiling shapes of its own;
:meth:`paxkv.scoring.Scorer.warm_up` compiles a list (or its JSON, :func:`to_json`) before the
first request, several at a time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from typing import Any, Iterable, Sequence

import numpy as np

from paxkv.core import buckets
from paxkv.core.packing import step_work
from paxkv.core.plan import AttentionPlan
from paxkv.engine import policy
from paxkv.scoring.batches import STEP_TOKENS

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


def runs(shape: StepShape, real: Sequence[int] | None) -> int:
    """How many rows of a batch (``real``: each row's tokens, in order; None: not packing)
    one call of program ``shape`` runs: at most its rows and, when it packs, the first rows
    whose tokens fit its packed size (0: not even the first)."""
    if real is None:
        return shape.rows
    n = min(shape.rows, len(real))
    if shape.plan.packed_tokens is not None:
        n = int(np.searchsorted(np.cumsum(real[:n]), shape.plan.packed_tokens, side="right"))
    return n


class StepShapes:
    """The programs a scorer knows (compiled, or remembered), the rent paid in place of each
    tight one, and the record of every program it ran."""

    def __init__(self, buy: int = buckets.COMPILE_TOKENS) -> None:
        self.buy = buy
        self.known: dict[str, dict[StepShape, None]] = {kind: {} for kind in KINDS}
        self.rent: dict[StepShape, int] = {}
        self._seen: dict[StepShape, None] = {}  # insertion-ordered set

    def choose(self, kind: str, rows: int, width: int, extra: int, max_rows: int,
               plan: AttentionPlan, max_len: int, max_width: int,
               real: Sequence[int] | None = None) -> StepShape:
        """The program for a step of ``rows`` rows of at most ``width`` tokens, ``extra``
        candidates (a continuation step: its width) and attention ``plan``: its tight one
        (``pow2(rows)`` rows, the plan's window rounded up to a power of two), or a known one
        at least as wide, with as many candidates and a plan that covers it, padded, while
        the work paid in place of the tight one stays within ``buy`` tokens (ski rental).
        A program of ``b < rows`` rows runs only ``b`` rows now; none wider than
        ``max_width`` is rented.

        ``real``: each row's real tokens, in batch order, when the step packs them
        (:class:`paxkv.core.packing.Packing`): the tight program packs their sum
        (:func:`paxkv.engine.policy.packed_tokens`); a known one runs the first rows whose
        tokens it packs (:func:`runs`), and work is :func:`paxkv.core.packing.step_work`."""
        if plan.window is not None:
            plan = dataclasses.replace(plan, window=min(max_len, buckets.pow2(plan.window)))
        b = buckets.pow2(rows, 1, max_rows)
        total = None if real is None else int(sum(real))
        tight_plan = plan if real is None else dataclasses.replace(
            plan, packed_tokens=policy.packed_tokens(total, b * width))
        tight = StepShape(kind, b, width, width if kind == "continuation" else extra, tight_plan)
        tight_work = step_work(b * width, tight_plan.packed_tokens) + STEP_TOKENS
        # A program of fewer rows, or fewer packed tokens, runs the batch in several calls:
        # its rent is judged on all of them and charged call by call (rented per call, a
        # two-choice task ran ten 2-row context steps of 0.96 s where four 8-row ones would).
        options = []
        for i, s in enumerate(self.known[kind]):
            packed = s.plan.packed_tokens
            if not (width <= s.width <= max_width and s.extra >= tight.extra
                    and runs(s, real) and s.plan.covers(dataclasses.replace(
                        plan, packed_tokens=None if real is None else packed))):
                continue
            calls = buckets.cdiv(rows, s.rows)
            if packed is not None:  # a call runs the rows whose tokens it packs
                calls = max(calls, buckets.cdiv(total, packed))
            work = step_work(s.rows * s.width, packed) + STEP_TOKENS
            options.append((max(0, calls * work - tight_work), calls, i, s))
        # One ledger for the tight programs of every packed size (each step of a batch packs
        # its own count), emptied when one of them compiles.
        ledger = dataclasses.replace(tight, plan=plan)
        if options:
            whole, calls, _, shape = min(options)
            paid = self.rent.get(ledger, 0)
            if paid + whole <= self.buy:
                self.rent[ledger] = paid + buckets.cdiv(whole, calls)
                return shape
        self.rent.pop(ledger, None)
        self.known[kind][tight] = None
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
