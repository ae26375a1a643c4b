"""Step programs stored beside the persistent compilation cache (:mod:`paxkv.core.stored`):
a new process loads the compiled step instead of tracing, lowering and compiling it, with the
same tokens and scores, and counts it as a load; the key changes with whatever the trace or
the compile reads; a model that cannot name itself, a broken file, an executable that cannot
be written or a step that cannot be compiled that way runs as plain ``jax.jit`` would."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import paxkv
from paxkv import models
from paxkv.core import steps, stored
from tiny import tiny_lm

TESTS = Path(__file__).resolve().parent
PROMPTS = [list(range(1, 21)), list(range(30, 63)), list(range(5, 14))]


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """JAX's persistent cache (and so the stored steps) in a fresh folder for this test, and
    no program of an earlier test in memory (the rest of the suite runs with
    ``PAXKV_STORE_STEPS=off``: tests/conftest.py)."""
    monkeypatch.setenv(stored.ENV, "on")
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax"))
    stored.forget()
    yield tmp_path / "jax" / stored.SUBFOLDER
    stored.forget()
    jax.config.update("jax_compilation_cache_dir", before)


def _tokens(lm, **kw):
    engine = paxkv.Engine(lm, max_seqs=4, max_len=64, page_size=8, **kw)
    ids = [engine.submit(p, max_new_tokens=6, stop_token_ids=[]) for p in PROMPTS]
    out = engine.run()
    engine.clear_prefix_cache()
    assert int(engine.cache.free_pages()) == engine.cache.num_pages
    return [out[i].token_ids for i in ids]


@pytest.fixture
def traced(monkeypatch):
    """Counts the model's forward traces (every step program traces it once)."""
    count = [0]
    forward = models.LanguageModel.forward

    @functools.wraps(forward)
    def counting(self, *args, **kwargs):
        count[0] += 1
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(models.LanguageModel, "forward", counting)
    return count


def test_a_stored_step_runs_as_the_step_and_is_loaded_without_tracing(folder, traced):
    lm = tiny_lm(scale=1.0)
    jax.config.update("jax_compilation_cache_dir", None)
    want = _tokens(lm, compile_cache=False)  # plain jit: nothing stored
    jax.config.update("jax_compilation_cache_dir", str(folder.parent))
    assert not folder.exists()
    assert _tokens(lm) == want
    files = sorted(folder.iterdir())
    assert files and traced[0] >= len(files)  # one export (one trace) per program
    stored.forget()
    jax.clear_caches()  # as a new process: nothing in memory, the files on disk
    traced[0] = 0
    assert _tokens(lm) == want
    assert traced[0] == 0 and sorted(folder.iterdir()) == files


def test_the_environment_turns_storing_off(folder, monkeypatch):
    assert stored.folder() == str(folder)
    for off in ("off", "0", "False"):
        monkeypatch.setenv(stored.ENV, off)
        assert stored.folder() is None
    _tokens(tiny_lm())
    assert not folder.exists()


def test_the_default_model_stored_gives_plain_jit_tokens_and_scores(folder, traced, lm):
    """The default model: greedy tokens and scores through stored steps equal plain jit's,
    and a process that finds them on disk traces the model in no step."""
    prompts = [lm.encode("The quick brown fox"), lm.encode("Paged attention keeps")]
    pairs = [(tuple(prompts[0]), tuple(prompts[1][:3])), (tuple(prompts[1]), (28, 29))]

    def both(**kw):
        tokens = [r.token_ids for r in paxkv.generate(lm, prompts, max_new_tokens=8,
                                                       stop_token_ids=[], **kw)]
        return tokens, [r.logprob for r in paxkv.score(lm, pairs, **kw)]

    jax.config.update("jax_compilation_cache_dir", None)
    want_tokens, want_scores = both(compile_cache=False)
    assert traced[0] > 0 and not folder.exists()
    jax.config.update("jax_compilation_cache_dir", str(folder.parent))
    for clear in (False, True):
        if clear:  # as a new process
            stored.forget()
            jax.clear_caches()
            traced[0] = 0
        tokens, scores = both()
        assert tokens == want_tokens
        np.testing.assert_allclose(scores, want_scores, rtol=0, atol=2e-5)
    assert traced[0] == 0 and any(folder.iterdir())


def test_the_stored_step_donates_the_cache(folder):
    lm = tiny_lm()
    engine = paxkv.Engine(lm, max_seqs=2, max_len=32, page_size=4)
    engine.submit(list(range(1, 9)), max_new_tokens=4, stop_token_ids=[])
    engine.step()
    old = engine.cache
    engine.step()
    assert any(folder.iterdir())
    assert old.pool.k.is_deleted() and old.pool.v.is_deleted()
    engine.run()


def test_scores_through_stored_steps_equal_plain_jit(folder, traced):
    lm = tiny_lm(scale=1.0)
    pairs = [(tuple(range(1, 30)), (40, 41, 42)), (tuple(range(1, 30)), (7,)),
             (tuple(range(50, 61)), (3, 4, 5, 6, 7))]
    jax.config.update("jax_compilation_cache_dir", None)
    want = [r.logprob for r in paxkv.score(lm, pairs, compile_cache=False)]
    jax.config.update("jax_compilation_cache_dir", str(folder.parent))
    got = [r.logprob for r in paxkv.score(lm, pairs)]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert any(folder.iterdir())
    stored.forget()
    jax.clear_caches()
    traced[0] = 0
    again = [r.logprob for r in paxkv.score(lm, pairs)]
    assert traced[0] == 0
    np.testing.assert_allclose(again, got, rtol=0, atol=1e-6)


def test_the_key_changes_with_what_the_trace_reads(folder):
    """Another config, another static plan or another matmul precision: another program."""
    lm, other = tiny_lm(), tiny_lm(windows=(None, 8))
    assert stored.forward_key(lm.forward) != stored.forward_key(other.forward)
    assert stored.forward_key(lm.forward) == stored.forward_key(tiny_lm(scale=1.0).forward)
    _tokens(lm)
    one = set(folder.iterdir())
    _tokens(lm)  # the same shapes again: nothing new
    assert set(folder.iterdir()) == one
    _tokens(other)
    two = set(folder.iterdir())
    assert two > one
    precision = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision",
                      "default" if precision == "highest" else "highest")
    try:
        _tokens(lm)
    finally:
        jax.config.update("jax_default_matmul_precision", precision)
    assert set(folder.iterdir()) > two


def test_a_model_without_a_key_is_never_stored(folder):
    """A researcher's model that does not name itself runs as plain jit, unstored."""

    class Mine:
        def __init__(self, lm):
            self.lm = lm

        def __getattr__(self, name):
            return getattr(self.lm, name)

        def forward(self, params, tokens, step, cache):
            return self.lm.forward(params, tokens, step, cache)

    lm = tiny_lm(scale=1.0)
    assert stored.forward_key(Mine(lm).forward) is None
    assert stored.forward_key(lambda *a: None) is None
    assert _tokens(Mine(lm)) == _tokens(lm)
    stored.forget()
    for f in folder.iterdir():
        f.unlink()
    _tokens(Mine(lm))
    assert not any(folder.iterdir())


def test_a_broken_file_is_stored_again(folder, caplog):
    lm = tiny_lm(scale=1.0)
    want = _tokens(lm)
    files = sorted(folder.iterdir())
    for f in files:
        f.write_bytes(b"not a program")
    stored.forget()
    jax.clear_caches()
    assert _tokens(lm) == want
    assert "ignoring the stored step" in caplog.text
    assert all(f.read_bytes() != b"not a program" for f in files)


def _refuse(*args, **kwargs):
    raise ValueError("not here")


def test_an_executable_that_cannot_be_written_runs_unstored(folder, monkeypatch):
    from jax.experimental import serialize_executable

    monkeypatch.setattr(serialize_executable, "serialize", _refuse)
    lm = tiny_lm(scale=1.0)
    want = _tokens(lm)
    assert not folder.exists() or not any(folder.iterdir())
    assert stored.compiled(steps.decode_step) > 0 and want == _tokens(lm)


def test_a_step_that_cannot_be_compiled_flat_runs_as_jit(folder, monkeypatch):
    monkeypatch.setattr(stored, "_compile", _refuse)
    lm = tiny_lm(scale=1.0)
    want = _tokens(lm)
    assert not folder.exists() or not any(folder.iterdir())
    assert steps.decode_step._cache_size() > 0 and want == _tokens(lm)


def test_a_loaded_step_counts_as_a_cache_load(folder):
    """A fresh engine (as in a new process) loads every stored step from its file, counted
    as a cache load, and compiles only the programs that are not steps (this folder's JAX
    cache keeps none of them: its minimum compile time is JAX's default)."""
    lm = tiny_lm(scale=1.0)

    def paid():
        engine = paxkv.Engine(lm, max_seqs=4, max_len=64, page_size=8)
        for p in PROMPTS:
            engine.submit(p, max_new_tokens=6, stop_token_ids=[])
        engine.run()
        return engine.stats().compiles

    jax.clear_caches()
    first = paid()
    stored.forget()
    jax.clear_caches()
    second = paid()
    files = len(list(folder.iterdir()))
    assert files >= 2 and first.compiles > files and first.cache_loads == 0
    assert (second.compiles, second.cache_loads) == (first.compiles - files, files)


def test_another_machine_stores_its_own_programs(folder, monkeypatch):
    """An executable holds machine code: another host (or other XLA flags) never loads it."""
    from paxkv.core import program_key

    lm = tiny_lm(scale=1.0)
    want = _tokens(lm)
    one = set(folder.iterdir())
    stored.forget()
    monkeypatch.setattr(program_key, "machine", lambda: "another host")
    assert _tokens(lm) == want
    assert set(folder.iterdir()) > one


def test_compiled_counts_stored_and_plain_programs(folder):
    lm = tiny_lm()
    jax.clear_caches()
    _tokens(lm)
    n = stored.compiled(steps.prefill_step) + stored.compiled(steps.decode_step)
    assert n >= 2 and steps.decode_step._cache_size() == 0  # all ran stored
    stored.forget()
    assert stored.compiled(steps.decode_step) == 0


_CHILD = """
import functools, json, sys
sys.path.insert(0, {tests!r})
import paxkv
from paxkv import models
from tiny import tiny_lm
count = [0]
forward = models.LanguageModel.forward
@functools.wraps(forward)
def counting(self, *a, **k):
    count[0] += 1
    return forward(self, *a, **k)
models.LanguageModel.forward = counting
lm = tiny_lm(scale=1.0)
engine = paxkv.Engine(lm, max_seqs=3, max_len=40, page_size=5)
engine.submit(list(range(1, 12)), max_new_tokens=6, stop_token_ids=[])
out = engine.run()
scores = [r.logprob for r in paxkv.score(lm, [((1, 2, 3, 4, 5), (6, 7)), ((9, 8), (1,))])]
print(json.dumps(dict(traces=count[0], tokens=list(out.values())[0].token_ids,
                      scores=scores)))
"""


def test_a_second_process_traces_no_step(tmp_path):
    """Two fresh processes sharing a cache folder: the second traces the model in no step (it
    loads each program stored by the first) and gives the same tokens and scores."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["PAXKV_COMPILE_CACHE"] = str(tmp_path / "cache")
    env[stored.ENV] = "on"

    def child():
        done = subprocess.run([sys.executable, "-c", _CHILD.format(tests=str(TESTS))],
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first, second = child(), child()
    assert first["traces"] >= 3 and second["traces"] == 0
    assert second["tokens"] == first["tokens"]
    np.testing.assert_allclose(second["scores"], first["scores"], rtol=0, atol=1e-6)
    assert any((tmp_path / "cache" / stored.SUBFOLDER).iterdir())


def test_a_step_on_a_mesh_keeps_its_placement_and_is_not_stored(folder):
    """A model placed on a (one-device) mesh: its steps run as plain jit, nothing stored (the
    wrapper would place them on one device, and a mesh in the tree cannot be written)."""
    from paxkv.scale import mesh as pmesh

    lm = tiny_lm()
    engine = paxkv.Engine(lm, mesh=pmesh.make_mesh(data=1), max_seqs=2, max_len=32,
                          page_size=4)
    rid = engine.submit([5, 6, 7], max_new_tokens=3)
    assert len(engine.run()[rid].token_ids) == 3
    assert not folder.exists() or not any(folder.iterdir())


def test_warm_up_stores_its_programs_and_a_new_scorer_loads_them(folder):
    """``Scorer.warm_up`` through stored steps, their files deleted while JAX's cache keeps
    the programs: each is compiled once, however many threads ask for it at once (every shape
    is listed twice here), and written; a scorer in
    a "new process" loads every one (counted as loads, none compiled) and its first request
    compiles no step and scores the same."""
    lm = tiny_lm(scale=1.0)
    pairs = [(tuple(range(1, 30)), (40, 41, 42)), (tuple(range(1, 30)), (7,)),
             (tuple(range(50, 61)), (3, 4, 5, 6, 7))]

    def scorer():
        return paxkv.Scorer(lm, max_seqs=4, max_len=64, num_pages=40, remember_shapes=False)

    first = scorer()
    want = [r.logprob for r in first.score(pairs)]
    shapes = first.programs.shapes.shapes()
    stored.forget()
    jax.clear_caches()
    for f in folder.iterdir():
        f.unlink()
    warmed = scorer()
    paid = warmed.warm_up(shapes + shapes, threads=2)
    # XLA compiles each once; JAX's own cache, which the first scorer filled, is read (a
    # reloaded executable is not written: its kernels would be missing in the next process)
    assert paid.compiles == len(shapes) and len(list(folder.iterdir())) == len(shapes)
    stored.forget()
    jax.clear_caches()
    fresh = scorer()
    paid = fresh.warm_up(shapes, threads=2)
    assert (paid.compiles, paid.cache_loads) == (0, len(shapes))
    got = [r.logprob for r in fresh.score(pairs)]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    from paxkv.scoring import steps as scoring_steps

    # every step ran a loaded program: neither jitted step traced or compiled one of its own
    assert scoring_steps.scored._cache_size() == scoring_steps.scored_last._cache_size() == 0
    assert len(list(folder.iterdir())) == len(shapes)


def test_a_file_that_cannot_be_renamed_leaves_no_partial_file(folder, monkeypatch):
    """A failed write (here the rename into place) runs the step unstored and leaves no
    temporary file behind in the folder."""
    def refuse(src, dst):
        raise OSError("read-only")

    lm = tiny_lm(scale=1.0)
    with monkeypatch.context() as patched:
        patched.setattr(stored.os, "replace", refuse)
        want = _tokens(lm)
    assert not folder.exists() or not any(folder.iterdir())
    stored.forget()
    assert _tokens(lm) == want and any(folder.iterdir())  # written once it can be
