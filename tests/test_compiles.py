"""Compiles paid once (:mod:`paxkv.core.compiles`): the persistent compilation cache on by
default in the user's cache folder, an argument and an environment variable that move it or
turn it off, a user's own JAX setting kept; and the compiles each engine and scorer paid,
counted in ``stats()``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import paxkv
from paxkv.core import compiles
from tiny import tiny_lm

TESTS = Path(__file__).resolve().parent

_CHILD = """
import json, sys
sys.path.insert(0, {tests!r})
import paxkv
from tiny import tiny_lm
lm = tiny_lm()
engine = paxkv.Engine(lm, max_seqs=3, max_len=40, page_size=5{arg})
engine.submit(list(range(1, 12)), max_new_tokens=6, stop_token_ids=[])
out = engine.run()
c = engine.stats().compiles
print(json.dumps(dict(folder=engine.compile_cache, compiles=c.compiles, loads=c.cache_loads,
                      seconds=c.compile_seconds, tokens=list(out.values())[0].token_ids)))
"""


def _child(env: dict[str, str], arg: str = "") -> dict:
    env = {k: v for k, v in {**os.environ, **env}.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    done = subprocess.run([sys.executable, "-c", _CHILD.format(tests=str(TESTS), arg=arg)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_what_the_first_compiled(tmp_path):
    """Two fresh processes, no JAX cache configured: the first compiles into
    ``$XDG_CACHE_HOME/paxkv/jax`` (never the checkout), the second loads from it, compiling
    less, with the same tokens."""
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    first, second = _child(env), _child(env)
    folder = tmp_path / "xdg" / "paxkv" / "jax"
    assert first["folder"] == str(folder) and any(folder.iterdir())
    assert first["compiles"] > 0 and first["loads"] == 0
    assert second["loads"] > 0 and second["compiles"] < first["compiles"]
    assert second["tokens"] == first["tokens"]


@pytest.fixture
def unconfigured():
    """JAX's cache folder unset for the test (no compile runs inside), then the suite's."""
    mine = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        yield
    finally:
        jax.config.update("jax_compilation_cache_dir", mine)


def test_the_argument_and_the_environment_move_or_turn_off_the_cache(
        unconfigured, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv(compiles.ENV, "off")
    assert compiles.use_persistent_cache() is None
    assert jax.config.jax_compilation_cache_dir is None
    monkeypatch.setenv(compiles.ENV, str(tmp_path / "mine"))
    assert compiles.use_persistent_cache(False) is None
    assert compiles.use_persistent_cache() == str(tmp_path / "mine")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")
    assert (tmp_path / "mine").is_dir() and not (tmp_path / "xdg").exists()
    jax.config.update("jax_compilation_cache_dir", None)
    assert compiles.use_persistent_cache(tmp_path / "arg") == str(tmp_path / "arg")


def test_a_cache_the_user_configured_stays_theirs(tmp_path, monkeypatch):
    """With JAX's cache folder set (here by the test suite), no argument moves it or turns it
    off."""
    mine = jax.config.jax_compilation_cache_dir
    assert mine  # tests/conftest.py set one
    assert compiles.use_persistent_cache(str(tmp_path / "elsewhere")) == mine
    assert compiles.use_persistent_cache(False) == mine
    assert jax.config.jax_compilation_cache_dir == mine
    assert not (tmp_path / "elsewhere").exists()


def test_the_default_folder_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compiles.default_folder() == str(tmp_path / "paxkv" / "jax")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compiles.default_folder() == str(tmp_path / "home" / ".cache" / "paxkv" / "jax")


def test_engines_and_scorers_count_their_compiles():
    """A new shape compiles (or loads) programs and the engine's stats count them, with
    their seconds; a second engine of the same shapes in the process compiles none; a
    scorer counts its own; ``reset_stats`` zeroes the count."""
    lm = tiny_lm()
    counts = []
    for _ in range(2):
        engine = paxkv.Engine(lm, max_seqs=3, max_len=44, page_size=11)
        engine.submit(list(range(1, 15)), max_new_tokens=5, stop_token_ids=[])
        engine.run()
        counts.append(engine.stats().compiles)
    first, second = counts
    assert first.compiles + first.cache_loads > 0 and first.compile_seconds > 0
    assert (second.compiles, second.cache_loads) == (0, 0)
    engine.reset_stats()
    assert engine.stats().compiles == compiles.CompileStats()

    scorer = paxkv.scoring.Scorer(lm, max_seqs=3, max_len=44, page_size=11)
    scorer.score([((1, 2, 3, 4, 5), (6, 7))])
    c = scorer.stats.compiles
    assert c.compiles + c.cache_loads > 0 and c is scorer.compile_stats


def test_nested_calls_count_a_compile_once():
    stats = compiles.CompileStats()
    with compiles.counting(stats), compiles.counting(stats):
        jax.jit(lambda x: x * 3 + 1)(np.arange(7, dtype=np.float32)).block_until_ready()
    assert stats.compiles + stats.cache_loads == 1


def test_an_unwritable_folder_names_what_to_change(unconfigured):
    with pytest.raises(ValueError, match="compile_cache="):
        compiles.use_persistent_cache("/proc/no/such/folder")


def test_engine_warm_up_compiles_what_a_like_batch_then_needs():
    """warm_up on placeholder prompts of the batch's lengths: the real batch then compiles
    nothing, gives the tokens of an engine that never warmed up, and the warm-up leaves no
    request, page, cached prefix or running total behind."""
    lm = tiny_lm()
    prompts = [list(range(1, 21)), list(range(30, 63)), list(range(5, 14))]

    def run(engine):
        ids = [engine.submit(p, max_new_tokens=5, stop_token_ids=[]) for p in prompts]
        out = engine.run()
        return [out[i].token_ids for i in ids]

    make = lambda: paxkv.Engine(lm, max_seqs=4, max_len=64, page_size=8)  # noqa: E731
    want = run(make())
    jax.clear_caches()  # as a new process: nothing compiled in memory
    engine = make()
    paid = engine.warm_up([len(p) for p in prompts], max_new_tokens=5)
    assert paid.compiles + paid.cache_loads > 0
    stats = engine.stats()
    assert not engine.has_work() and not engine.table.requests
    assert stats.free_pages == engine.cache.num_pages and stats.prefill_tokens == 0
    assert stats.compiles.compiles + stats.compiles.cache_loads >= paid.compiles
    before = (stats.compiles.compiles, stats.compiles.cache_loads)
    assert run(engine) == want
    after = engine.stats().compiles
    assert (after.compiles, after.cache_loads) == before
    engine.submit(prompts[0], max_new_tokens=2)
    with pytest.raises(ValueError, match="before any request"):
        engine.warm_up([4])


def test_short_answers_on_a_shared_prompt_decode_in_one_compiled_window():
    """Eight rows share a 32-token prompt and run 60 tokens past their own 60-66: their own
    part grows from 67 to ~125 tokens, across the 96 -> 128 window buckets. Sized for the
    rows' end from the first decode step, every decode step runs one plan (two without
    :func:`paxkv.engine.policy.decode_window_tokens`), and the tokens are those of an engine
    with no shared pages."""
    lm = tiny_lm(scale=1.0)
    rng = np.random.default_rng(3)
    system = rng.integers(1, 256, 32).tolist()
    prompts = [system + rng.integers(1, 256, int(n)).tolist() for n in rng.integers(60, 67, 8)]

    def run(prefix_cache):
        engine = paxkv.Engine(lm, max_seqs=8, max_len=160, page_size=8,
                              prefix_cache=prefix_cache)
        plans, decode = [], engine.scheduler.ops.decode
        engine.scheduler.ops.decode = lambda *a: plans.append(a[5]) or decode(*a)
        ids = [engine.submit(p, max_new_tokens=60, stop_token_ids=[]) for p in prompts]
        out = engine.run()
        engine.clear_prefix_cache()
        assert int(engine.cache.free_pages()) == engine.cache.num_pages  # every page back
        return [out[i].token_ids for i in ids], plans

    tokens, plans = run(True)
    assert len(plans) >= 55 and all(p.prefix_pages == 4 for p in plans)
    assert len(set(plans)) == 1 and plans[0].window == 160, set(plans)
    assert tokens == run(False)[0]


def test_prefix_holds_retain_in_one_compiled_width():
    """Holding or dropping pages of any count compiles one program (an lm-eval task of new
    lengths compiled a retain program per power of two; +1 and -1 compiled one each, so a
    weight update's first clear of the prefix cache compiled)."""
    from paxkv.cache import paged
    from paxkv.prefix import holds

    cache = paged.create(num_layers=1, num_kv_heads=1, head_dim=4, num_pages=600,
                         page_size=4, max_seqs=2, max_len=64)
    before = holds.retain_pages._cache_size()
    for n in (3, 20, 100, 300):  # 300: two calls of CHUNK ids
        cache = holds.retain(cache, [list(range(n))], 1)
        cache = holds.retain(cache, [list(range(n))], -1)
    assert holds.retain_pages._cache_size() - before <= 1
    assert int(np.asarray(cache.table.ref_counts).sum()) == 0


def test_nested_counting_of_equal_stats_keeps_the_outer_block():
    """An inner block whose stats equal the outer's (both zero) once removed the outer one:
    the outer block's compiles went to the inner stats, and leaving it raised."""
    outer, inner = compiles.CompileStats(), compiles.CompileStats()
    with compiles.counting(outer):
        with compiles.counting(inner):
            pass
        jax.jit(lambda x: x * 3 + 1)(np.float32(1.5))
    assert outer.compiles >= 1 and inner.compiles == 0
