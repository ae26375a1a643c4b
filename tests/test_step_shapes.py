"""A scorer's bounded set of step programs (:mod:`paxkv.scoring.shapes`): a new task of
ordinary lengths compiles a handful, the programs a scorer ran are remembered beside the
compilation cache for the next process, and ``warm_up`` compiles them before the first
request."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest

import paxkv
from paxkv.core.compiles import CompileStats, counting
from paxkv.core.plan import AttentionPlan
from paxkv.scoring import programs as programs_module
from paxkv.scoring.programs import Programs
from paxkv.scoring.shapes import StepShape, from_json, layout_key, recall, to_json
from tiny import tiny_lm

# What a task of "ordinary lengths" is here: lm-eval's multiple choice and cloze tasks.
MOST_COMPILES_A_TASK = 6  # issue 35's bound: backend compiles, small programs included


def task(seed: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """A multiple-choice task: 8-40 questions, contexts of one length class (a random span
    within 8-900 tokens), 2-6 choices of 1-24 tokens."""
    rng = np.random.default_rng(seed)
    lo = int(rng.integers(8, 600))
    hi = lo + int(rng.integers(1, 300))
    pairs = []
    for _ in range(int(rng.integers(8, 41))):
        ctx = tuple(int(x) for x in rng.integers(1, 256, int(rng.integers(lo, hi))))
        for _ in range(int(rng.integers(2, 7))):
            pairs.append((ctx, tuple(int(x) for x in rng.integers(1, 256,
                                                                   int(rng.integers(1, 25))))))
    return pairs


def scorer(**kw) -> paxkv.Scorer:
    """The lm-eval backend's scorer shape: 32 rows of 2,048 tokens."""
    return paxkv.Scorer(tiny_lm(), **dict(dict(max_seqs=32, max_len=2048, num_pages=640,
                                               remember_shapes=False), **kw))


def test_a_new_task_of_ordinary_lengths_compiles_a_handful():
    """A kept scorer (as the lm-eval backend keeps one) meets 8 tasks of lengths it has not
    seen: after the first, none compiles (or loads from the persistent cache) more than
    MOST_COMPILES_A_TASK programs. JAX's in-memory caches are cleared first, so no earlier
    test's compiles hide one."""
    jax.clear_caches()
    kept = scorer()
    paid = []
    for seed in range(8):
        kept.reset_stats()
        kept.score(task(seed))
        paid.append(kept.stats.compiles.compiles + kept.stats.compiles.cache_loads)
    assert max(paid[1:]) <= MOST_COMPILES_A_TASK, paid
    # Ski rental keeps the set small: 16 step programs for the 8 tasks (every step in its own
    # tight shape and window, the planner of before: 26; per task after the first 2-4, not 0-3).
    assert len(kept.programs.shapes.shapes()) <= 20
    # every step program ran is on the ladder: rows powers of two, windows powers of two
    for s in kept.programs.shapes.shapes():
        assert s.rows & (s.rows - 1) == 0 and s.extra & (s.extra - 1) == 0
        assert s.plan.window is None or s.plan.window & (s.plan.window - 1) == 0


def test_each_task_alone_would_compile_more():
    """What the kept shapes save: the same tasks, each on a scorer that knows no shapes (the
    planner picks every tight shape of its own) run more distinct step programs in all."""
    kept = scorer()
    fresh = set()
    for seed in range(1, 8):
        kept.score(task(seed))
        alone = scorer()
        alone.score(task(seed))
        fresh.update(alone.programs.shapes.shapes())
    assert len(kept.programs.shapes.shapes()) < len(fresh)


def test_warm_up_compiles_what_another_scorer_ran(caplog):
    """Programs run by one scorer, as JSON, compile in a fresh scorer's warm_up (with JAX's
    in-memory caches cleared, as in a new process); its first request then compiles no step
    program, and scores the same."""
    pairs = task(3)
    first = scorer()
    want = first.score(pairs)
    shapes = first.programs.shapes.shapes()
    jax.clear_caches()
    second = scorer()
    paid = second.warm_up(to_json(shapes), threads=2)
    assert paid.compiles + paid.cache_loads >= len(shapes)
    assert second.stats.compiles.compiles == paid.compiles
    with jax.log_compiles(True), caplog.at_level(logging.WARNING, logger="jax"):
        got = second.score(pairs)
    compiled = [r.getMessage() for r in caplog.records if "compilation of" in r.getMessage()]
    assert not [m for m in compiled if "scored" in m], compiled
    assert [r.logprob for r in got] == pytest.approx([r.logprob for r in want], abs=1e-5)


def test_warm_up_refuses_a_larger_scorers_programs():
    big = StepShape("context", 64, 16, 4, AttentionPlan(window=64))
    with pytest.raises(ValueError, match="max_seqs=32"):
        scorer().warm_up([big])


def remembering(folder: str, **kw) -> paxkv.Scorer:
    """A scorer that keeps its shapes in ``folder`` (the suite's JAX cache folder is shared
    by every test, and JAX reads its setting once a process: set the record's folder alone)."""
    s = scorer(**kw)
    s.programs = Programs(s.lm, s.ops, folder)
    return s


def test_a_scorer_plans_with_the_shapes_an_earlier_one_remembered(tmp_path):
    """Beside the compilation cache, a scorer records the programs it ran; the next scorer of
    the same layout (in any process) starts knowing them, one of another layout does not, and
    an unreadable record is ignored."""
    folder = str(tmp_path)
    first = remembering(folder)
    first.score(task(1))
    ran = first.programs.shapes.shapes()
    assert ran and recall(folder, layout_key(first.lm, first.cache)) == ran
    assert remembering(folder).programs.shapes.shapes() == ran
    assert remembering(folder, max_seqs=16).programs.shapes.shapes() == []
    (tmp_path / "paxkv-scoring" / f"{layout_key(first.lm, first.cache)}.json").write_text("{")
    assert remembering(folder).programs.shapes.shapes() == []
    # the scorer's own switch: with remember_shapes (the default) it keeps them beside its cache
    assert paxkv.Scorer(tiny_lm(), max_seqs=4, max_len=64).programs.folder is not None
    assert scorer().programs.folder is None


def test_the_record_is_written_only_when_a_program_was_added(tmp_path, monkeypatch):
    """A call that ran only known programs leaves the record alone (each write reads and
    replaces the whole file), and so does a scorer that only recalled it."""
    writes = []
    real = programs_module.remember
    monkeypatch.setattr(programs_module, "remember", lambda *a: writes.append(a) or real(*a))
    s, grew = remembering(str(tmp_path)), 0
    for _ in range(4):  # a repeat may still buy a program its rent paid for: run to the end
        before = len(s.programs.shapes.shapes())
        s.score(task(1))
        grew += len(s.programs.shapes.shapes()) != before
    assert 1 <= grew < 4 and len(writes) == grew
    remembering(str(tmp_path)).programs.save()
    assert len(writes) == grew


def test_step_shapes_round_trip_and_check_their_fields():
    shape = StepShape("continuation", 8, 16, 16, AttentionPlan(window=256, prefix_pages=2))
    assert from_json(to_json([shape])) == [shape]
    with pytest.raises(ValueError, match="kind"):
        StepShape("decode", 8, 16, 16, AttentionPlan())
    with pytest.raises(ValueError, match="rows"):
        StepShape("context", 0, 16, 4, AttentionPlan())


def test_warm_up_adds_its_compiles_to_the_stats():
    s = scorer()
    with counting(CompileStats()):
        paid = s.warm_up([], threads=1)
    assert paid == CompileStats() and s.stats.compiles == CompileStats()


def test_a_record_it_cannot_write_never_fails_a_call(tmp_path):
    """The record is a hint: a folder that cannot hold it (here a file) is skipped."""
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    s = remembering(str(blocked))
    assert len(s.score(task(2))) > 0
