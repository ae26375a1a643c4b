"""Smoke tests of the experiments' core functions at tiny sizes, on a tiny random Llama.

The experiments themselves run the real model; here a 2-layer, 32-wide model with a byte
"tokenizer" stands in, so every test is about the experiment's logic (accounting, checks,
zero leaks, plots), not the model's speed.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paxkv import models
from experiments import accounting, cancel, capacity, plots, read_floor, short
from paxkv.models.config import LlamaConfig
from paxkv.models.llama import Llama
from paxkv.full_attention import NoCache
from paxkv.step_info import StepInfo


class _Bytes:
    """Text <-> byte ids: enough tokenizer for the experiments' prompts and results."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(i % 256 for i in ids).decode("latin-1")


@functools.lru_cache(maxsize=None)
def tiny_lm() -> models.LanguageModel:
    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=16, tie_word_embeddings=True)
    step = StepInfo.make(jnp.array([4]), jnp.array([4]), 4)
    shapes = jax.eval_shape(lambda: Llama(cfg).init(jax.random.PRNGKey(0),
                                                    jnp.zeros((1, 4), jnp.int32), step, NoCache()))
    rng = np.random.default_rng(0)  # random weights without compiling flax's init
    params = jax.tree.map(lambda s: jnp.asarray(rng.normal(0, 0.3, s.shape), s.dtype), shapes)
    return models.LanguageModel(cfg, params, _Bytes(), "tiny")


def test_arena_first_fit_and_stranded_holes():
    arena = accounting.Arena(10)
    assert arena.alloc("a", 4) and arena.alloc("b", 3) and arena.alloc("c", 3)
    assert not arena.alloc("d", 1)
    arena.free("a")
    arena.free("c")
    assert arena.holes() == [(0, 4), (7, 3)] and arena.used == 3
    assert not arena.alloc("e", 5)  # 7 slots free, none 5 contiguous: external fragmentation
    assert arena.alloc("f", 3) and arena.blocks["f"] == (0, 3)


def test_lengths_are_lognormal_and_capped():
    lengths = capacity.sample_lengths(500, 64, prompt_median=8, prompt_sigma=1.0,
                                      output_median=8, output_sigma=1.0)
    assert lengths.min() >= 1 and (lengths.sum(1) <= 64).all()
    assert 5 <= np.median(lengths[:, 0]) <= 12  # median near 8
    assert lengths[:, 0].max() > 4 * np.median(lengths[:, 0])  # a long tail


@pytest.fixture(scope="module")
def capacity_record():
    # Sizes shared with the cancel tests' engine (rows 4, 24 pages of 4, max_len 32), so the
    # jitted steps compile once.
    args = capacity.parse_args(["--quick", "--max-len", "32", "--requests", "6",
                                "--paged-rows", "4", "--warmup", "0"])
    return capacity.run(args, tiny_lm())


def test_capacity_accounts_every_system(capacity_record):
    res = capacity_record["results"]
    assert res["outputs_identical"]
    budget, ps = 3 * 32, 4
    for name in capacity.SYSTEMS:
        r = res[name]
        assert r["check"]["all_identical"] and r["check"]["compared"] == 6
        assert r["pages_leaked"] == 0 and r["output_tokens"] == sum(
            n for _, n in capacity_record["config"]["lengths"])
        assert len(r["series"]["t"]) == r["steps"]
        assert all(0 <= w <= 100 for w in r["series"]["waste_pct"])
        assert len(r["page_map"]["owner"]) == budget // ps
        assert max(r["series"]["reserved"]) <= budget
    assert res["dense_max_len"]["peak_running"] <= 3
    assert res["dense_exact"]["preemptions"] == 0
    assert res["paged"]["peak_running"] >= res["dense_max_len"]["peak_running"]
    assert res["paged"]["future_pct_steady"] == 0 and res["dense_exact"]["internal_pct_steady"] == 0


def test_plots_write_pngs(capacity_record, tmp_path):
    (tmp_path / "capacity_quick.json").write_text(json.dumps(capacity_record, default=str))
    fork = cancel.fork_run(tiny_lm(), children=3, decode_steps=3, max_len=32,
                           cancel_at={1: 1})
    (tmp_path / "cancel_quick.json").write_text(json.dumps({"results": {"fork": fork}}))
    written = plots.plot_all(str(tmp_path), quick=True)
    assert len(written) == 4
    for path in written:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_short_times_both_caches_and_agrees():
    # batch 4 x 8 pages: the paged cache of the fork runs (3 children), one compile for both.
    r = short.measure(tiny_lm(), 4, max_len=32, page_size=4, reps=1, out_len=2, cost=False)
    assert r["tokens_identical"] and r["samples"] == 2
    for clock in ("wall", "cpu"):
        for kind in short.KINDS:
            assert {"full", "reserve", "attention", "rest"} <= set(r[f"{clock}_ms"][kind])
        assert {"table", "noscrub"} <= set(r[f"{clock}_ms"]["paged"])


def test_cancel_random_ops_leak_nothing():
    r = cancel.random_ops(300, seed=1)
    assert r["pages_leaked"] == 0 and not r["invariant_errors"]
    assert r["all_freed_in_same_call"]
    assert {"mid_prompt", "mid_decode", "forked", "sharing_prefix"} <= set(r["cancels"])


def test_cancel_in_engine_and_forks_spare_the_others():
    eng = cancel.engine_run(tiny_lm(), requests=6, max_len=32, max_seqs=4, num_pages=24,
                            cancel_frac=0.5, prefill_chunk=16)
    assert eng["all_freed_in_same_call"] and eng["freed_matches_tokens"]
    assert eng["survivors_identical"] == eng["survivors"] and eng["pages_leaked"] == 0
    assert "queued" in {c["kind"] for c in eng["cancels"]}
    assert any(c["freed"] > 0 for c in eng["cancels"])
    shared = cancel.engine_sharing_run(tiny_lm(), requests=2, prefix_len=10, new=12, max_len=32,
                                       max_seqs=4, num_pages=24)
    assert shared["all_freed_in_same_call"] and shared["pages_leaked"] == 0
    assert shared["survivors_identical"] == shared["survivors"] > 0
    assert [c["kind"] for c in shared["cancels"]] == ["child", "sharer", "prefix"]
    fork = cancel.fork_run(tiny_lm(), children=3, decode_steps=4, max_len=32,
                           cancel_at={1: 2, 2: 0})
    assert fork["all_freed_in_same_call"] and fork["survivors_identical"]
    assert fork["pages_leaked"] == 0 and any(fork["page_map"]["shared"])


def test_read_floor_variants_read_every_page_once():
    """The floor's variants read what attention reads: summed, the gathered and the sliced
    K/V both equal the pool's live pages; attention, and the unpaged ceiling over the same
    K/V laid out contiguously (keys transposed or not), equal the per-row reference."""
    from pallas_kernels.reference import paged_decode_attention_reference

    cfg = LlamaConfig(vocab_size=8, hidden_size=16, intermediate_size=8, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8)
    batch, context = 4, 64  # 4 pages a row, 16 in all, scattered; a list with no padding
    rng = np.random.default_rng(0)
    shape = (2, 17, 2, read_floor.PAGE_SIZE, 8)
    k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((batch, 4, 8)), jnp.float32)
    block_tables = jnp.asarray(rng.permutation(16).reshape(batch, 4).astype(np.int32))
    lengths = jnp.full((batch,), context, jnp.int32)
    fns = read_floor.variants(cfg, batch, context)
    got = {name: float(f(q, k, v, block_tables, lengths)) for name, f in fns.items()}
    live = float(jnp.sum(k[:, :16]) + jnp.sum(v[:, :16]))
    assert got["gather"] == pytest.approx(live, rel=1e-5)
    assert got["slice"] == pytest.approx(live, rel=1e-5)
    want = sum(float(jnp.sum(paged_decode_attention_reference(q, k[i], v[i], block_tables,
                                                               lengths))) for i in range(2))
    assert got["attention"] == pytest.approx(want, rel=1e-4)
    for transposed in (False, True):  # the unpaged ceiling computes the same attention
        ks, vs = read_floor.unpaged_layers(k, v, block_tables, keys_transposed=transposed)
        assert ks[1].shape == ((batch, 2, 8, context) if transposed else (batch, 2, context, 8))
        got_unpaged = float(read_floor.unpaged_variant(transposed)(q, ks, vs))
        assert got_unpaged == pytest.approx(want, rel=1e-4)
    result = read_floor.run(cfg, batch, context, repeats=1, with_step=False)
    assert result["attention_outputs_agree"] and result["rest_of_step_ms"] is None
    assert set(result["variants"]) == {"attention", "gather", "slice", "unpaged",
                                       "unpaged, K transposed"}
