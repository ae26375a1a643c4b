"""Beam search: HF transformers' ``generate(num_beams=4)`` as the oracle, paged == dense, pages.

All model runs share one compiled shape (6 prompts x 4 beams, prompt bucket 64, 16 new tokens);
``length_penalty`` and ``early_stopping`` are traced, so the HF cases with other settings reuse
it. HF results are cached under pytest's cache dir, so a rerun does not load HF at all.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxkv import models
import paxkv
from paxkv.cache import paged as paged_cache
from paxkv.core.buckets import prefix_bucket
from paxkv.decoding.beam_search import Beam, SearchResult, _stale, search

WIDTH, NEW = 4, 16
CHAT = ["What is the capital of France? Answer in one word.",  # ends after a few tokens
        "Say hello.",
        "Name a primary colour."]
PLAIN = ["The quick brown fox", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def prompts(lm) -> list[list[int]]:
    return ([lm.encode(lm.chat_prompt([{"role": "user", "content": q}])) for q in CHAT]
            + [lm.encode(p) for p in PLAIN])


@pytest.fixture(scope="module")
def runs(lm, prompts) -> dict[str, SearchResult]:
    """The default settings through both caches, one batch of 6 prompts each."""
    return {c: search(lm, prompts, beam_width=WIDTH, max_new_tokens=NEW, cache=c)
            for c in ("paged", "dense")}


def hf_beams(request, prompt: list[int], length_penalty: float, early_stopping) -> list:
    """``[(generated ids, score)] * 4`` from HF ``generate``, cached on disk by inputs."""
    import torch
    import transformers

    path = models.default_model_path()
    key = hashlib.sha256(json.dumps([
        os.path.basename(path), os.path.getsize(path), prompt, WIDTH, NEW, length_penalty,
        str(early_stopping), torch.__version__, transformers.__version__]).encode())
    key, disk = f"paxkv/beam/{key.hexdigest()[:24]}", getattr(request.config, "cache", None)
    cached = None if disk is None else disk.get(key, None)
    if cached is not None:
        return cached
    hf = request.getfixturevalue("hf")
    with torch.no_grad():
        out = hf.model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones((1, len(prompt)), dtype=torch.long),
            num_beams=WIDTH, num_return_sequences=WIDTH, do_sample=False, max_new_tokens=NEW,
            length_penalty=length_penalty, early_stopping=early_stopping, output_scores=True,
            return_dict_in_generate=True)
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
    result = [(out.sequences[i, len(prompt): len(prompt) + n].tolist(),
               float(out.sequences_scores[i])) for i, n in enumerate(lengths)]
    if disk is not None:
        disk.set(key, result)
    return result


def assert_matches_hf(request, got: list[list[Beam]], prompts, length_penalty, early):
    """Every beam's tokens equal HF's and its score is within 1e-3 (the top one first)."""
    worst = 0.0
    for i, (beams, prompt) in enumerate(zip(got, prompts)):
        expected = hf_beams(request, prompt, length_penalty, early)
        assert len(beams) == WIDTH
        assert beams[0].token_ids == expected[0][0], f"prompt {i}: top sequence differs"
        for j, (beam, (ids, score)) in enumerate(zip(beams, expected)):
            assert abs(beam.score - score) < 1e-3, f"prompt {i} beam {j}: {beam.score} vs {score}"
            assert beam.token_ids == ids, f"prompt {i} beam {j}"
            worst = max(worst, abs(beam.score - score))
        print(f"prompt {i}: top score {beams[0].score:.5f} (HF {expected[0][1]:.5f}), "
              f"{len(beams[0].token_ids)} tokens")
    print(f"length_penalty={length_penalty} early_stopping={early}: max |score - HF| = "
          f"{worst:.2e}")


@pytest.mark.oracle
def test_matches_hf_generate(request, runs, prompts, lm):
    """Six prompts, default settings: all four beams' tokens and scores equal HF's."""
    assert_matches_hf(request, runs["paged"].beams, prompts, 1.0, False)
    ended = [b[0].token_ids[-1] in lm.eos_token_ids for b in runs["paged"].beams]
    assert any(ended) and not all(ended), "want prompts that stop on EOS and ones that run out"


@pytest.mark.oracle
@pytest.mark.parametrize("length_penalty, early", [(2.0, "never"), (0.5, True)])
def test_matches_hf_length_penalty_and_early_stopping(request, lm, prompts, length_penalty,
                                                      early):
    got = paxkv.beam_search(lm, prompts, beam_width=WIDTH, max_new_tokens=NEW,
                            length_penalty=length_penalty, early_stopping=early)
    assert_matches_hf(request, got, prompts, length_penalty, early)


def test_paged_equals_dense(runs):
    paged, dense = runs["paged"], runs["dense"]
    assert paged.steps == dense.steps
    for p_beams, d_beams in zip(paged.beams, dense.beams):
        assert [b.token_ids for b in p_beams] == [b.token_ids for b in d_beams]
        np.testing.assert_allclose([b.score for b in p_beams], [b.score for b in d_beams],
                                   atol=1e-4)


def test_pool_all_free_and_dead_beams_freed_at_once(runs):
    for name, run in runs.items():
        assert run.all_free, name
    paged = runs["paged"]
    assert paged.stale_pages == 0  # after every reorder, every held page has a live row
    assert paged.pages_freed_by_reorder > 0
    assert paged.peak_pages < paged.unshared_pages


def test_reorder_frees_dead_beams_pages_in_the_same_step():
    """Four beams with private tails; reorder keeps rows 0 and 2: rows 1 and 3's private pages
    are free in the returned cache, shared pages stay (one jitted function, donated cache)."""

    @functools.partial(jax.jit, donate_argnums=0)
    def scenario(cache):
        cache, ok1 = cache.reserve(jnp.array([10, 0, 0, 0]), max_new=10)  # last page partial
        cache, ok2 = cache.fork(jnp.array([0, 0, 0]), jnp.array([1, 2, 3]))
        cache, ok3 = cache.reserve(jnp.full((4,), 6), max_new=6)  # partial copied, +1 page each
        before = cache.stats().used_pages
        cache, ok4 = cache.reorder(jnp.array([0, 0, 2, 2]))
        after, stale = cache.stats().used_pages, _stale(cache)
        cache, _ = cache.release(jnp.ones((4,), bool))
        oks = jnp.concatenate([ok1[:1], ok2, ok3, ok4])
        return cache, jnp.all(oks), before, after, stale

    cache = paged_cache.create(num_layers=1, num_kv_heads=1, head_dim=4, num_pages=32,
                               page_size=4, max_seqs=4, max_len=32)
    cache, ok, before, after, stale = scenario(cache)
    assert bool(ok)
    assert int(before) == 2 + 4 * 2  # 2 shared full pages + 2 private pages per row
    assert int(after) == 2 + 2 * 2  # rows 1 and 3's private pages: free in the same step
    assert int(stale) == 0
    assert int(cache.stats().free_pages) == 32


@pytest.mark.slow
def test_memory_512_prompt_shares_pages(lm):
    """Width 4, a 512-token prompt, 64 new tokens: peak pages <= 30% of four private copies."""
    from pydoc_data.topics import topics

    text = " ".join(topics[k] for k in sorted(topics))
    prompt = lm.encode(text)[:512]
    run = search(lm, [prompt], beam_width=4, max_new_tokens=64, stop_token_ids=[],
                    early_stopping="never")
    print(f"peak {run.peak_pages} pages of {run.unshared_pages} unshared "
          f"({run.peak_pages / run.unshared_pages:.1%}); reorders freed "
          f"{run.pages_freed_by_reorder} pages")
    assert run.unshared_pages == 4 * (512 + 64) // 16
    assert run.peak_pages <= 0.3 * run.unshared_pages, (run.peak_pages, run.unshared_pages)
    assert run.steps == 63 and all(len(b.token_ids) == 64 for b in run.beams[0])
    assert run.all_free and run.stale_pages == 0


def test_one_prompt_reads_its_pages_once_and_beams_are_unchanged(lm, prompts, monkeypatch):
    """With one prompt every beam starts with its pages, so the paged search hints them
    (cascade attention); beams and scores equal the dense cache's."""
    bs = importlib.import_module("paxkv.decoding.beam_search")  # paxkv.beam_search: the function

    seen = []
    real = bs._search
    monkeypatch.setattr(bs, "_search", lambda forward, params, cache, *a, **kw: (
        seen.append(kw["plan"].prefix_pages), real(forward, params, cache, *a, **kw))[1])
    prompt = prompts[0] + prompts[3] + prompts[5]  # > 2 pages of 16
    got = {c: search(lm, [prompt], beam_width=3, max_new_tokens=6, cache=c)
           for c in ("paged", "dense")}
    assert seen[0] == prefix_bucket(len(prompt) // 16) >= 2, seen
    paged, dense = got["paged"].beams[0], got["dense"].beams[0]
    assert [b.token_ids for b in paged] == [b.token_ids for b in dense]
    np.testing.assert_allclose([b.score for b in paged], [b.score for b in dense], rtol=1e-4)
    assert got["paged"].all_free
