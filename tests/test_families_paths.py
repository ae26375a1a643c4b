"""Every family through the paths ``tests/test_families.py`` does not take: the Pallas kernels
(interpret mode), the layer-grouped cache with int8 K/V, and the front ends (``Engine``,
``beam_search``, ``paxkv.score``) on prompts several sliding windows long, against HF
transformers on the same tiny random models (``family_oracle``).

The Pallas kernels stream whole 128-byte rows, so their models have ``head_dim`` 32 (float32)
and pages of 8 tokens; a window of 8 keeps a prompt of 3+ windows short, since interpret mode
costs ~0.25 s per prompt token of a 6-layer model here.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import family_oracle as fo
import paxkv
from paxkv import models
from paxkv.cache import grouped
from paxkv.cache import paged as paged_cache
from pallas_kernels import quant
from test_families import FAMILIES, TOL, WINDOW, Case, full_logits, prompts, worst_error

PAGE = 8


@pytest.fixture(autouse=True)
def _strict_ranks():
    with jax.numpy_rank_promotion("raise"):
        yield


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``tiny(family, **changes)``: the family's HF model (config ``changes`` applied) and
    paxkv's load of its ``save_pretrained`` folder, built once per module."""
    pytest.importorskip("transformers")

    @functools.cache
    def make(family: str, **changes) -> Case:
        hf = fo.tiny_hf(family, **changes)
        folder = tmp_path_factory.mktemp(family)
        hf.save_pretrained(folder)
        return Case(family, hf, models.load(folder))

    return make


def untied(family: str) -> dict:
    """Config changes giving a Gemma its own ``lm_head``: tied, a tiny random Gemma's scaled
    embedding makes it repeat the prompt's last token, so greedy tokens would test little."""
    return {"tie_word_embeddings": False} if family.startswith("gemma") else {}


def hf_logprobs(hf, ids: list[int]) -> np.ndarray:
    """float64 ``[len(ids), vocab]`` log-softmax of HF's logits."""
    logits = fo.hf_logits(hf, ids).astype(np.float64)
    return logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)


def continuation_logprobs(hf, ctx: list[int], cont: list[int]) -> np.ndarray:
    """HF's log-probability of each token of ``cont`` after ``ctx`` (teacher forced)."""
    logp = hf_logprobs(hf, ctx + cont)
    return logp[np.arange(len(ctx) - 1, len(ctx) + len(cont) - 1), cont]


def sizes(lm, max_len: int) -> dict:
    return dict(num_layers=lm.num_layers, num_kv_heads=lm.num_kv_heads, head_dim=lm.head_dim,
                max_seqs=1, max_len=max_len, layer_windows=lm.layer_windows)


def assert_window_pages_released(cache: grouped.GroupedPagedCache) -> None:
    """Each window group holds at most ``ceil(w / page) + 1`` pages of the one row."""
    for table, window in zip(cache.tables, cache.groups.windows):
        if window is not None:
            held = int(jnp.sum(table.ref_counts > 0))
            assert held <= -(-window // cache.page_size) + 1, (window, held)


# -- the Pallas kernels (interpret mode) --------------------------------------------------

@pytest.mark.oracle
@pytest.mark.parametrize("family, kind", [("gemma3_text", "paged"), ("gemma3_text", "grouped"),
                                          ("mistral", "grouped")])
def test_pallas_kernels_match_hf_over_three_windows(tiny, family: str, kind: str) -> None:
    """A prompt of 3 windows + 3 in prefill chunks of 9 (each straddles a window edge), then
    two decode steps, through the Pallas prefill and decode kernels over a paged cache or the
    layer-grouped one the engine builds (its window groups drop pages mid-prompt): every
    position's logits = HF's within 1e-4."""
    window = 8
    case = tiny(family, head_dim=32, sliding_window=window)
    lm = case.lm
    assert set(lm.layer_windows) >= {window}
    ids = prompts((3 * window + 5,), seed=5)[0]
    ref = fo.hf_logits(case.hf, ids)
    blind = full_logits(lm, [ids])[0]  # no windows: far off, so the windows are under test
    assert np.abs(blind - ref).max() > 100 * TOL
    dims = sizes(lm, 5 * PAGE)
    if kind == "paged":
        cache = paged_cache.create(num_pages=5, page_size=PAGE, attention_impl="pallas", **dims)
    else:
        cache = grouped.create(num_pages=5, page_size=PAGE, attention_impl="pallas",
                               step_tokens=9, **dims)
    assert cache.impl == "pallas"
    logits, cache = fo.cached_run(lm, cache, ids, [9, 9, 9, 1, 1], exact=True)
    if kind == "grouped":
        assert_window_pages_released(cache)
    print(f"{family} {kind} pallas: max |logit error| vs HF {worst_error([logits], [ref]):.2e}")


# -- int8 K/V through the layer-grouped cache ------------------------------------------------

@functools.partial(jax.tree_util.register_dataclass, data_fields=["pool", "tables"],
                   meta_fields=["groups", "scrub", "impl", "index_pages"])
@dataclasses.dataclass(frozen=True)
class RoundTripCache(grouped.GroupedPagedCache):
    """A float32 grouped cache that stores K/V as int8 would give them back: the exact twin of
    an int8 cache (``tests/test_int8.py``'s oracle), here under the whole model."""

    def attend(self, layer, q, k, v, step, **kw):
        k, v = (quant.round_trip(x, quant.INT8) for x in (k, v))
        return super().attend(layer, q, k, v, step, **kw)


@pytest.mark.oracle
def test_int8_grouped_cache_on_a_window_family(tiny) -> None:
    """gemma3_text, a prompt of 3 windows + 8 through the grouped cache with int8 K/V: its
    logits equal a float32 twin fed the int8 round trip (as ``tests/test_int8.py``), and
    against float32 K/V (HF's logits) stay within the project's int8 quality bounds (top-1
    agreement >= 0.98, mean KL <= 1e-3: the default model's real-text test); ``generate``
    with int8 K/V (the grouped cache) gives HF's greedy tokens."""
    case = tiny("gemma3_text", **untied("gemma3_text"))
    lm = case.lm
    # 56 positions: 0.98 allows one flip (seeds 4 and 6 flip one, at float32 margins < 0.012)
    ids = prompts((3 * WINDOW + 8,), seed=7)[0]
    chunks = [13] * 4 + [1] * 4
    dims = dict(sizes(lm, 8 * PAGE), num_pages=8, page_size=PAGE, step_tokens=13)
    int8_cache = grouped.create(dtype=jnp.int8, **dims)
    assert int8_cache.pool.k.dtype == jnp.int8 and int8_cache.pool.scales is not None
    twin = grouped.create(**dims)
    twin = RoundTripCache(**{f.name: getattr(twin, f.name) for f in dataclasses.fields(twin)})
    got, int8_cache = fo.cached_run(lm, int8_cache, ids, chunks, exact=True)
    assert_window_pages_released(int8_cache)
    want = fo.cached_logits(lm, twin, ids, chunks, exact=True)
    exact = float(np.abs(got - want).max())
    assert exact < 1e-5, exact  # the same values: only summation order may differ
    f32 = fo.hf_logits(case.hf, ids)  # float32 K/V (our float32 caches: within 1e-4 of it)
    logp, logq = (x - np.logaddexp.reduce(x, axis=-1, keepdims=True)
                  for x in (f32.astype(np.float64), got.astype(np.float64)))
    kl = float(np.mean(np.sum(np.exp(logp) * (logp - logq), axis=-1)))
    top1 = float(np.mean(f32.argmax(-1) == got.argmax(-1)))
    print(f"int8 grouped: |int8 - twin| {exact:.2e}, vs float32 KL {kl:.2e} top-1 {top1:.3f}, "
          f"max |logit diff| {np.abs(got - f32).max():.2e}")
    assert top1 >= 0.98 and kl <= 1e-3
    out = paxkv.generate(lm, [ids], max_new_tokens=6, stop_token_ids=[], kv_dtype=jnp.int8,
                         page_size=PAGE)
    assert out[0].token_ids == fo.hf_greedy(case.hf, ids, 6)


# -- the front ends, every family -----------------------------------------------------------

def hf_beams(hf, prompt: list[int], width: int, new: int) -> list[tuple[list[int], float]]:
    """HF ``generate(num_beams=width)`` with no length penalty and no EOS: (ids, score)."""
    import torch

    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones((1, len(prompt)),
                                                                           dtype=torch.long),
                          num_beams=width, num_return_sequences=width, do_sample=False,
                          max_new_tokens=new, length_penalty=0.0, early_stopping=False,
                          eos_token_id=None, pad_token_id=0, output_scores=True,
                          return_dict_in_generate=True)
    return [(out.sequences[i, len(prompt):].tolist(), float(out.sequences_scores[i]))
            for i in range(width)]


@pytest.mark.oracle
@pytest.mark.parametrize("family", FAMILIES)
def test_front_ends_match_hf_over_three_windows(tiny, family: str) -> None:
    """A prompt of 3 windows + 4 (52 tokens; pages of 8), each front end against HF:

    * ``Engine`` (the layer-grouped cache for a window family): a greedy request with
      logprobs, forked mid-decode into two greedy children, beside an ``n=2`` sampled request;
      the parent's tokens then each child's = HF's greedy tokens, the logprobs = HF's; the
      prompt and two of its tokens again, served from the prefix cache (every window group's
      pages at its end), go on with HF's tokens; every page of every group is free at the
      end;
    * ``paxkv.score``: two continuations of one context (shared, forked) = HF's
      log-likelihoods within 1e-4;
    * ``beam_search`` (2 beams, 4 tokens, no length penalty): HF's beams, and the best
      beam's score = the sum of HF's log-probabilities of its tokens within 1e-4."""
    case = tiny(family, **untied(family))
    lm, hf = case.lm, case.hf
    ctx = prompts((3 * WINDOW + 4,), seed=7)[0]
    new = 8
    greedy = fo.hf_greedy(hf, ctx, new)

    engine = paxkv.Engine(lm, max_seqs=4, max_len=96, page_size=PAGE, prefill_chunk=32)
    if lm.layer_windows is not None:
        assert isinstance(engine.cache, grouped.GroupedPagedCache)
    rid = engine.submit(ctx, max_new_tokens=new, stop_token_ids=[], logprobs=0)
    sampled = engine.submit(ctx[:20], max_new_tokens=5, stop_token_ids=[], n=2,
                            temperature=1.0, seed=3)
    while len(engine.table.get(rid).output) < 3:  # decode 3 tokens, then fork
        engine.step()
    kids = engine.fork(rid, 2, max_new_tokens=new - 3)
    out = engine.run()
    before = out[rid].token_ids
    assert out[rid].finish_reason == "forked" and len(before) == 3
    for kid in kids:
        assert before + out[kid].token_ids == greedy
    assert [len(s.token_ids) for s in out[sampled].samples] == [5, 5]
    again = engine.submit(ctx + greedy[:2], max_new_tokens=new - 2, stop_token_ids=[])
    assert greedy[:2] + engine.run()[again].token_ids == greedy  # from the prefix cache
    assert engine.stats().prefix_hit_tokens >= len(ctx) - PAGE  # window layers' pages too
    engine.clear_prefix_cache()
    tables = getattr(engine.cache, "tables", None) or (engine.cache.table,)
    assert all(int(jnp.sum(t.ref_counts)) == 0 for t in tables), "a page is still held"
    assert engine.stats().kv_bytes_used == 0
    want = continuation_logprobs(hf, ctx, greedy)
    errors = {"engine": max(float(np.abs(np.asarray(out[rid].logprobs + out[kid].logprobs)
                                         - want).max()) for kid in kids)}

    conts = [greedy[:3], [5, 9, 11, 13, 17]]
    scored = paxkv.score(lm, [(ctx, c) for c in conts], page_size=PAGE)
    wants = [continuation_logprobs(hf, ctx, cont) for cont in conts]
    errors["score"] = max(max(float(np.abs(np.asarray(r.token_logprobs) - w).max()),
                              abs(r.logprob - w.sum())) for r, w in zip(scored, wants))
    assert scored[0].is_greedy and not scored[1].is_greedy

    beams = paxkv.beam_search(lm, [ctx], beam_width=2, max_new_tokens=4, length_penalty=0.0,
                              stop_token_ids=[], page_size=PAGE)[0]
    expected = hf_beams(hf, ctx, 2, 4)
    assert [b.token_ids for b in beams] == [ids for ids, _ in expected]
    exact = continuation_logprobs(hf, ctx, beams[0].token_ids).sum()
    errors["beam"] = max([abs(beams[0].score - exact)]
                         + [abs(b.score - score) for b, (_, score) in zip(beams, expected)])
    print(f"{family}: max |logprob error| vs HF", {k: f"{v:.1e}" for k, v in errors.items()})
    assert max(errors.values()) < TOL, errors
