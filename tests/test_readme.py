"""The README's examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import paxkv

pytestmark = pytest.mark.model  # the examples load the default model

README = Path(__file__).resolve().parent.parent / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _block(snippet: str) -> str:
    """The one Python block of the README that contains ``snippet`` (so adding a section
    does not renumber the others)."""
    found = [b for b in _python_blocks() if snippet in b]
    assert len(found) == 1, f"{len(found)} README blocks contain {snippet!r}"
    return found[0]


def _run(block: str) -> dict:
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102
    return namespace


def test_readme_jitted_loop_gives_generate_s_tokens_and_frees_every_page():
    namespace = _run(_block("lm.forward(params, tokens, info, cache)"))
    cache, ok, lm = namespace["cache"], namespace["ok"], namespace["lm"]
    assert bool(jnp.all(ok))
    assert int(jnp.sum(cache.table.ref_counts)) == 0
    assert not bool(jnp.any(cache.active))
    loop = np.stack([np.asarray(t) for t in namespace["tokens"]], axis=1)  # [2, 9]
    want = paxkv.generate(lm, [namespace["a"], namespace["b"]], max_new_tokens=9,
                          stop_token_ids=[])
    assert loop.tolist() == [r.token_ids for r in want]


def test_readme_streaming_loop_streams_every_token():
    namespace = _run(_block("out = engine.step()"))
    ids, engine, done = namespace["ids"], namespace["engine"], namespace["done"]
    assert sorted(done) == sorted(ids) and not engine.table.requests  # handed out, dropped
    assert all(namespace["streamed"][i] == done[i].token_ids for i in ids)
    assert int(engine.cache.free_pages()) + engine.stats().cached_pages == engine.cache.num_pages


def test_readme_generate_example_runs():
    namespace = _run(_block('paxkv.generate(lm, ["Hello"'))
    out = namespace["out"]
    assert len(out) == 2 and all(len(r.token_ids) >= 1 for r in out)


def test_readme_sharing_example_runs():
    namespace = _run(_block("paxkv.beam_search("))
    outs, beams = namespace["outs"], namespace["beams"]
    assert [len(o.samples) for o in outs] == [2, 2]
    assert outs[1].num_cached_tokens > 0  # the second prompt found the system prompt cached
    scores = [b.score for b in beams[0]]
    assert len(scores) == 4 and scores == sorted(scores, reverse=True)


def test_readme_own_model_loop_equals_the_engine():
    """The "Bring your own model" block: a user's NNX model in a jitted loop and through the
    engine gives the same greedy tokens, and every page is back in both pools."""
    namespace = _run(_block("# bring-your-own-model"))
    model, cache, engine = namespace["model"], namespace["cache"], namespace["engine"]
    assert namespace["tokens"] == namespace["mine"] and len(namespace["mine"]) == 6
    assert int(cache.free_pages()) == cache.num_pages
    engine.clear_prefix_cache()
    assert int(engine.cache.free_pages()) == engine.cache.num_pages
    assert isinstance(model, paxkv.Model)


def test_readme_host_tier_example_serves_returning_histories_from_host():
    """The "Paging out" block: agents' histories pushed out of a one-history pool come back
    from host memory on their second turn, the pin holds, and clearing returns everything."""
    namespace = _run(_block("host_cache_bytes=1 << 30"))
    engine, host = namespace["engine"], namespace["host"]
    assert host.hit_tokens >= 256 and host.copy_in_pages > 0 and host.copy_out_pages > 0
    assert engine.stats().host.pinned_pages + engine.stats().cached_pages > 0
    engine.clear_prefix_cache()
    assert int(engine.cache.free_pages()) == engine.cache.num_pages
    assert engine.stats().host.pages == 0


def test_readme_rl_step_agrees_with_the_sampler_and_swaps_without_a_compile():
    """The "RL rollouts" block: one GRPO step on the default model. The trainer's
    log-probabilities of the sampled tokens equal the sampler's, the update placed nothing,
    and the next rollout under the new weights compiles no step and carries version 1."""
    from paxkv import rl  # noqa: PLC0415

    ns = _run(_block("engine.update_params(optax.apply_updates"))
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
