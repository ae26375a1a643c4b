"""The pages of ``docs/`` run as written: each page's Python blocks run in order in one
namespace (a page reads as one session), on the default model; after a block, the checks of
what that block claims; at the end, every page of the page's engine must come back.

A check is keyed by a snippet of its block, so adding a block does not renumber the others.
The blocks that need several JAX devices or processes run as written in their own tests, in
subprocesses (:data:`ELSEWHERE`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import jax.numpy as jnp
import numpy as np
import pytest

import paxkv

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md")
               if "_build" not in p.relative_to(DOCS).parts and "```python" in p.read_text())

# JAX fixes its devices when it starts, so these blocks run in subprocesses of their own tests:
# page -> {a snippet of the block: the test file that runs it}.
ELSEWHERE = {
    "mesh.md": {"mesh.make_mesh(data=2, model=3)": "test_mesh_model.py",
                "# several processes": "test_multiprocess.py"},
}


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


def block(page: str, snippet: str) -> str:
    """The one Python block of ``docs/<page>`` that contains ``snippet`` (the tests that run a
    page's block in a subprocess find it here)."""
    found = [b for b in python_blocks(DOCS / page) if snippet in b]
    assert len(found) == 1, f"{len(found)} blocks of docs/{page} contain {snippet!r}"
    return found[0]


def _pages_come_back(engine) -> None:
    """Whatever a page ran, every page of its engine comes back: held rows and shared prefixes
    cancelled, the rest run out, the prefix cache cleared."""
    for rid in [r.id for r in engine.table.requests.values() if r.hold or r.is_prefix]:
        engine.cancel(rid)
    engine.run()
    engine.clear_prefix_cache()
    assert int(engine.cache.free_pages()) == engine.cache.num_pages


# -- index.md, getting_started.md ----------------------------------------------------------

def _five_lines(ns: dict) -> None:
    assert 1 <= len(ns["out"][0].token_ids) <= 8


def _first_generate(ns: dict) -> None:
    out = ns["out"]
    assert len(out) == 2 and all(len(r.token_ids) >= 1 for r in out)


def _first_engine_loop(ns: dict) -> None:
    results, stats = ns["results"], ns["stats"]
    for rid in (ns["first"], ns["second"]):
        assert 1 <= len(results[rid].token_ids) <= 12
        assert results[rid].finish_reason in ("stop", "length")
    assert stats.available_pages == stats.num_pages  # free, or held only by the prefix index


# -- decode_loops.md -------------------------------------------------------------------------

def _jitted_loop(ns: dict) -> None:
    """The ten-line loop gives ``generate``'s greedy tokens and frees every page."""
    cache, ok, lm = ns["cache"], ns["ok"], ns["lm"]
    assert bool(jnp.all(ok))
    assert int(jnp.sum(cache.table.ref_counts)) == 0
    assert not bool(jnp.any(cache.active))
    loop = np.stack([np.asarray(t) for t in ns["tokens"]], axis=1)  # [2, 9]
    want = paxkv.generate(lm, [ns["a"], ns["b"]], max_new_tokens=9, stop_token_ids=[])
    assert loop.tolist() == [r.token_ids for r in want]


def _own_model(ns: dict) -> None:
    """A user's NNX model in a jitted loop and through the engine gives the same greedy
    tokens, and every page is back in both pools."""
    model, cache, engine = ns["model"], ns["cache"], ns["engine"]
    assert ns["tokens"] == ns["mine"] and len(ns["mine"]) == 6
    assert int(cache.free_pages()) == cache.num_pages
    engine.clear_prefix_cache()
    assert int(engine.cache.free_pages()) == engine.cache.num_pages
    assert isinstance(model, paxkv.Model)


# -- engine.md -------------------------------------------------------------------------------

def _sampling_settings(ns: dict) -> None:
    out = ns["out"]
    assert len(out) == 2
    for r in out:
        assert 1 <= len(r.token_ids) <= 12
        assert len(r.logprobs) == len(r.token_ids) == len(r.top_logprobs)
        assert all(lp <= 0.0 for lp in r.logprobs)
        assert all(len(alternatives) == 2 for alternatives in r.top_logprobs)


def _streaming(ns: dict) -> None:
    ids, engine, done = ns["ids"], ns["engine"], ns["done"]
    assert sorted(done) == sorted(ids) and not engine.table.requests  # handed out, dropped
    assert all(ns["streamed"][i] == done[i].token_ids for i in ids)
    assert int(engine.cache.free_pages()) + engine.stats().cached_pages == engine.cache.num_pages


# -- sharing.md ------------------------------------------------------------------------------

def _samples_and_beams(ns: dict) -> None:
    outs, beams = ns["outs"], ns["beams"]
    assert [len(o.samples) for o in outs] == [2, 2]
    assert outs[1].num_cached_tokens > 0  # the second prompt found the system prompt cached
    scores = [b.score for b in beams[0]]
    assert len(scores) == 4 and scores == sorted(scores, reverse=True)


def _prefix_and_fork(ns: dict) -> None:
    """The questions start from the tutor's pages (none of its tokens prefilled again) and
    the root's three children continue it."""
    results, lm = ns["results"], ns["lm"]
    tutor = len(lm.encode(ns["system"]))
    for rid in ns["asks"]:
        assert results[rid].num_cached_tokens >= tutor - tutor % 16 > 0
        assert len(results[rid].token_ids) >= 1
    assert len(ns["children"]) == 3
    assert all(len(results[c].token_ids) >= 1 for c in ns["children"])


# -- scoring.md ------------------------------------------------------------------------------

def _score(ns: dict) -> None:
    results = ns["results"]
    assert len(results) == 3 and len(results[2].token_logprobs) > 1
    assert max(results, key=lambda r: r.logprob) is results[0]  # " honey"


def _score_step(ns: dict) -> None:
    """The hand-written step's scores equal ``paxkv.score``'s, and the pool is free."""
    tol = 1e-5  # per-request relative error of summed log-probabilities, float32
    want = paxkv.score(ns["lm"], [(ns["ctx"], c) for c in ns["choices"]])
    assert np.allclose(ns["scores"], [r.logprob for r in want], rtol=tol, atol=tol)
    cache = ns["cache"]
    assert int(cache.free_pages()) == cache.num_pages


# -- families.md, host_tier.md, int8.md, kernels.md ------------------------------------------

def _families(ns: dict) -> None:
    assert {"llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text"} <= set(
        ns["models"].SUPPORTED_MODEL_TYPES)


def _sliding_windows(ns: dict) -> None:
    """Every step's window layers hold at most ``ceil(16 / 8) + 1`` pages a row while the
    global layer holds the whole context, and every page is back at the end."""
    held, engine = ns["held"], ns["engine"]
    assert max(w for _, w in held) <= 3 < max(g for g, _ in held) == 21
    assert held[-2] == [21, 3] and held[-1] == [0, 0]
    assert engine.stats().kv_bytes_used == 0 < engine.stats().peak_kv_bytes_used


def _host_tier(ns: dict) -> None:
    """Histories pushed out of a one-history pool come back from host memory on their second
    turn, the pin holds, and clearing returns everything."""
    engine, host = ns["engine"], ns["host"]
    assert host.hit_tokens >= 256 and host.copy_in_pages > 0 and host.copy_out_pages > 0
    assert engine.stats().host.pinned_pages + engine.stats().cached_pages > 0
    engine.clear_prefix_cache()
    assert int(engine.cache.free_pages()) == engine.cache.num_pages
    assert engine.stats().host.pages == 0


def _int8(ns: dict) -> None:
    """The page's bytes per token (its table's first row) are the pools' own."""
    per_token = {dtype: size // 16 for dtype, size in ns["per_page"].items()}
    assert per_token == {"float32": 46_080, "bfloat16": 23_040, "int8": 12_240}
    assert len(ns["out"][0].token_ids) >= 1


def _kernel(ns: dict) -> None:
    assert float(jnp.max(jnp.abs(ns["out"] - ns["want"]))) < 1e-5


# -- rl.md -----------------------------------------------------------------------------------

def _rl(ns: dict) -> None:
    """The sampler / trainer gap, an update that compiled nothing (checked in the page), an
    abort, a second turn per held completion; then the page's first engine gives back every
    page (the GRPO step below makes its own)."""
    assert ns["gap"] < 1e-4
    assert ns["swap"].version == 2
    assert all(len(ns["second"][i].token_ids) >= 1 for i in ns["ids"])
    _pages_come_back(ns["engine"])


def _grpo_step(ns: dict) -> None:
    """One GRPO step on the default model: the trainer's log-probabilities of the sampled
    tokens equal the sampler's, the update placed nothing, and the next rollout under the new
    weights compiles no step and carries version 1."""
    from paxkv import rl  # noqa: PLC0415

    engine, out, swap = ns["engine"], ns["out"], ns["swap"]
    assert swap.version == 1 and swap.placed == ()
    assert sorted(set(out.group_ids.tolist())) == [0, 1] and len(out.group_ids) == 8
    got = rl.token_logprobs(ns["lm"], ns["params"], out.prompt_tokens, out.prompt_mask,
                            out.completion_tokens, out.completion_mask, ns["rows"],
                            mode="temperature")
    gap = np.abs(np.asarray(got) - out.logprobs)[out.completion_mask]
    assert gap.max() < 1e-4, gap.max()
    before = engine.stats().compiles.compiles
    again = rl.rollout(engine, ns["prompts"], group_size=4, params=ns["sampling"])
    assert engine.stats().compiles.compiles == before
    assert (again.weight_versions[again.completion_mask] == 1).all()


Check = Callable[[dict], None]
CHECKS: dict[str, list[tuple[str, Check]]] = {
    "index.md": [('["The capital of France is"], max_new_tokens=8)', _five_lines)],
    "getting_started.md": [('paxkv.generate(lm, ["Hello"', _first_generate),
                           ("results = engine.run()", _first_engine_loop)],
    "decode_loops.md": [("lm.forward(params, tokens, info, cache)", _jitted_loop),
                        ("# bring-your-own-model", _own_model)],
    "engine.md": [("logprobs=2)", _sampling_settings), ("out = engine.step()", _streaming)],
    "sharing.md": [("paxkv.beam_search(", _samples_and_beams),
                   ("engine.fork(root, 3", _prefix_and_fork)],
    "scoring.md": [('(ctx, " honey")', _score), ("scoring.score_step", _score_step)],
    "families.md": [("SUPPORTED_MODEL_TYPES", _families), ("# sliding windows", _sliding_windows)],
    "host_tier.md": [("host_cache_bytes=1 << 30", _host_tier)],
    "int8.md": [("kv_dtype=jnp.int8)", _int8)],
    "kernels.md": [("paged_decode_attention(q, k_pages", _kernel)],
    "rl.md": [("second = engine.run()", _rl),
              ("engine.update_params(optax.apply_updates", _grpo_step)],
}


@pytest.mark.model  # the pages load the default model
@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_python_block_of_a_page_runs(page):
    blocks = python_blocks(page)
    elsewhere = ELSEWHERE.get(page.name, {})
    checks = CHECKS.get(page.name, [])
    for snippet, _ in checks:
        assert sum(snippet in b for b in blocks) == 1, f"{page.name}: {snippet!r}"
    namespace: dict = {}
    for i, text in enumerate(blocks):
        if any(snippet in text for snippet in elsewhere):
            continue
        exec(compile(text, f"{page.name} block {i}", "exec"), namespace)  # noqa: S102
        for snippet, check in checks:
            if snippet in text:
                check(namespace)
    engine = namespace.get("engine")
    if engine is not None:
        _pages_come_back(engine)


@pytest.mark.parametrize("page, snippet", [(p, s) for p, runs in ELSEWHERE.items() for s in runs])
def test_a_block_run_elsewhere_is_run_there(page, snippet):
    """Each block :func:`test_every_python_block_of_a_page_runs` skips is one block of its
    page, and the test named for it reads that block from the page."""
    block(page, snippet)
    runner = (ROOT / "tests" / ELSEWHERE[page][snippet]).read_text()
    assert f'"{page}"' in runner and f'"{snippet}"' in runner, ELSEWHERE[page][snippet]
