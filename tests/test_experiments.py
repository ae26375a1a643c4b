"""Smoke tests of the experiments' core functions at tiny sizes, on a tiny random Llama.

The experiments themselves run the real model; here a 2-layer, 32-wide model with a byte
"tokenizer" stands in, so every test is about the experiment's logic (accounting, checks,
zero leaks, plots), not the model's speed.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from experiments import accounting, cancel, capacity, common, plots, reserve, short
from tiny import tiny_lm

# The experiments' own checks: `make test` runs them, `make test-fast` not.
pytestmark = pytest.mark.slow


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


def test_plots_write_pngs_titled_with_their_run(capacity_record, tmp_path):
    (tmp_path / "capacity_quick.json").write_text(json.dumps(capacity_record, default=str))
    fork = cancel.fork_run(tiny_lm(), children=3, decode_steps=3, max_len=32,
                           cancel_at={1: 1})
    cancel_record = common.record(dict(quick=True, **common.provenance()), {"fork": fork})
    (tmp_path / "cancel_quick.json").write_text(json.dumps(cancel_record, default=str))
    written = plots.plot_all(str(tmp_path), quick=True, out_dir=str(tmp_path / "figures"))
    assert [p.split("/")[-1] for p in written] == [
        "capacity_quick_concurrency.png", "capacity_quick_waste.png",
        "capacity_quick_page_map.png", "cancel_quick_page_map.png"]
    for path in written:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # Each title names its run: command, start time and commit, from the record itself.
    cfg = capacity_record["config"]
    title = plots.stamp(capacity_record, "capacity")
    assert title.startswith(f"python -m experiments.capacity --quick, run {cfg['started'][:16]}")
    assert f", git {cfg['git_sha_at_start']}" in title
    assert ("uncommitted" in title) == bool(cfg["uncommitted_at_start"])
    assert plots.stamp({"git_sha": "abc1234", "time": "2026-12-04 20:55:01", "config": {}},
                       "cancel") == ("python -m experiments.cancel, run ended 2026-12-04 20:55, "
                                     "git abc1234")
    assert "run 2026-12-04 20:42-21:07," in plots.stamp(
        {"time": "2026-12-04 21:07:22", "config": {"started": "2026-12-04 20:42:47"}}, "x")
    moved = dict(capacity_record, config=dict(cfg, git_sha_at_start="0000000",
                                              uncommitted_at_start=[]))
    assert plots.stamp(moved, "capacity").endswith(
        f"git 0000000 ({capacity_record['git_sha']} at the end)")


def test_harness_fills_defaults_names_results_and_refuses_wrong_answers(tmp_path, monkeypatch):
    ap = common.parser("One line.\n\n    python -m experiments.x\n", quick="tiny")
    ap.add_argument("--n", type=int)
    assert ap.description == "One line."
    full, quick = dict(n=64, extra="full"), dict(n=8, extra="quick")
    assert vars(common.fill_defaults(ap.parse_args([]), quick=quick, full=full)) == dict(
        quick=False, n=64, extra="full")
    assert vars(common.fill_defaults(ap.parse_args(["--quick", "--n", "3"]), quick=quick,
                                     full=full)) == dict(quick=True, n=3, extra="quick")
    assert common.result_name("decode_sweep", True, "", "bfloat16") == "decode_sweep_quick_bfloat16"
    assert common.result_name("offline", False, "") == "offline"
    monkeypatch.setattr(common, "RESULTS_DIR", str(tmp_path))
    rec = common.record(dict(common.provenance()), {"x": 1})
    assert {"git_sha", "jax", "jaxlib", "python", "device", "device_kind", "time"} <= set(rec)
    assert common.finish("ok", rec, True) == str(tmp_path / "ok.json")
    with pytest.raises(SystemExit, match="no figure"):
        common.finish("wrong", rec, False, "no figure stands")
    assert json.loads((tmp_path / "wrong.json").read_text())["results"] == {"x": 1}


def test_prose_windows_are_consecutive_slices_of_one_stream():
    lm = tiny_lm()
    stream = common.prose_tokens(lm, 300)
    assert len(stream) == 300
    windows = common.english_prompts(lm, 5, 10, 50, seed=3)
    joined = [t for w in windows for t in w]
    assert joined == stream[:len(joined)] and all(10 <= len(w) <= 50 for w in windows)


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


def test_timed_rounds_interleave_and_keep_every_time():
    calls = []

    def fn(name):
        return lambda: calls.append(name) or jnp.ones(3)

    t = common.timed_rounds({"a": fn("a"), "b": fn("b")}, repeats=3, warmup=2)
    assert calls == ["a", "b"] * 5  # one call of each per round, in order
    for timing in t.values():
        assert len(timing.warmup_s) == 2 and len(timing.times_s) == len(timing.cpu_times_s) == 3
        assert timing.median_s == sorted(timing.times_s)[1] and min(timing.times_s) > 0
    single = common.timed(fn("c"), repeats=1, warmup=0)
    assert single.times_s == [single.median_s] and single.warmup_s == [] and calls[-1] == "c"


def test_reserve_cost_allocates_on_every_call():
    r = reserve.reserve_cost(64, 512, 16, repeats=3, warmup=1)
    assert len(r["times_ms"]) == 4 and r["mean_pages_allocated"] > 0
    assert 0 < r["pages_in_use"] < 512


def test_window_capacity_releases_pages_leaks_none_and_agrees(tmp_path, monkeypatch):
    """``experiments.windows --quick``: the released system holds under a third of the
    whole-layer bytes per sequence, runs more sequences, every system gives the same tokens and
    leaks nothing (the run's own check exits non-zero otherwise); with a shared system prompt
    the window-aware prefix cache serves it to every request after the first."""
    import sys  # noqa: PLC0415

    from experiments import windows  # noqa: PLC0415

    monkeypatch.setattr(common, "RESULTS_DIR", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["windows", "--quick"])
    windows.main()
    data = json.loads((tmp_path / "windows_quick.json").read_text())["results"]
    systems = {r["system"]: r for r in data["systems"]}
    assert all(data["tokens_equal"].values())
    assert all(r["leaked"] == 0 for r in systems.values())
    assert systems["released"]["bytes_per_seq_vs_whole"] <= data["ideal_ratio"] + 0.02
    assert systems["released"]["peak_running"] > systems["whole"]["peak_running"]
    shared = {r["system"]: r for r in data["shared_prompt"]}
    assert data["shared_tokens_equal"] and all(r["leaked"] == 0 for r in shared.values())
    hit = shared["released + prefix cache"]["hit_tokens"]  # the system prompt, every request
    assert hit >= (12 - 1) * 2 * 16 - 4, hit  # but the first (2 windows of 16; pages of 4)
    assert shared["released, no prefix cache"]["hit_tokens"] == 0


def test_agents_fleet_serves_returning_histories_from_host(tmp_path, monkeypatch):
    """``experiments.agents --quick --only fleet``: the three engines give the same replies,
    the host tier recomputes a fraction of what the engine without it does, copies pages both
    ways and leaks nothing (the run asserts every page free after each engine)."""
    import sys  # noqa: PLC0415

    from experiments import agents  # noqa: PLC0415

    monkeypatch.setattr(common, "RESULTS_DIR", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["agents", "--quick", "--only", "fleet"])
    agents.main()
    data = json.loads((tmp_path / "agents_quick.json").read_text())["results"]["fleet"]
    assert all(v == 1.0 for v in data["agreement"].values()), data["agreement"]
    runs = data["runs"]
    assert runs["tier"]["recomputed_tokens"] < 0.25 * runs["no_tier"]["recomputed_tokens"]
    assert runs["tier"]["host"]["copy_in_pages"] > 0 and runs["tier"]["host"]["pages"] > 0
    assert runs["no_tier"]["host"] is None and runs["dense"]["max_seqs"] <= 4


def test_offline_counts_each_engine_step_variant():
    """The offline workload's compile count names each jitted engine step where it lives
    (attach_rows and retain_pages moved to paxkv.prefix.holds; the run failed at its end)."""
    from experiments import offline

    variants = offline._step_variants()
    assert set(variants) == {"prefill_step", "decode_step", "release_rows", "fork_rows",
                             "attach_rows", "retain_pages"}
    assert all(isinstance(n, int) and n >= 0 for n in variants.values())


def test_rl_rollouts_shares_prompt_pages_at_equal_kv_and_agrees():
    """``experiments.rl_rollouts``' group run at tiny sizes, greedy (sampling would compile as
    many step programs again): (a) == (b) token for token, the three ways hold the same K/V
    bytes, and the prompt K/V is exact: the pages below each prompt's boundary page stored
    once per group (1/G of unshared), and one boundary page per sample. (b)'s copies draw
    from the keys the engine gives (a)'s samples (the full run finds their sampled tokens
    identical)."""
    import jax  # noqa: PLC0415

    import paxkv  # noqa: PLC0415
    from experiments import rl_rollouts  # noqa: PLC0415

    lm, g = tiny_lm(scale=1.0), 4
    prompts = common.english_prompts(lm, 2, 27, 27, seed=0)  # boundary pages hold 3 tokens
    budget = rl_rollouts.Budget(rows=4, max_len=40, page_size=4)
    sp = paxkv.SamplingParams(max_new_tokens=12, stop_token_ids=list(range(0, 256, 23)))
    r = rl_rollouts.run_group(lm, prompts, g, budget, sp, repeats=1)
    assert r["correctness"]["shared_vs_unshared"]["identical"]
    assert r["sampled_rows_identical_a_b"] == [len(prompts) * g]
    assert r["pool_kv_bytes"] == r["dense_kv_bytes"] == 4 * 40 * r["kv_bytes_per_token"]
    assert all(p["peak_kv_bytes"] <= r["pool_kv_bytes"] for w in ("shared", "unshared")
               for p in r["passes"][w])
    assert r["prompt_kv_exact"] and r["prompt_kv"]["shared"]["samples_live"] == [g, g]
    assert r["prompt_kv_times_g"]["full_pages"] == 1.0
    assert r["prompt_kv_times_g"]["slots"] == pytest.approx((24 + g * 3) / 27)
    assert r["passes"]["shared"][0]["prefill_tokens"] < r["passes"]["unshared"][0]["prefill_tokens"]
    parent = jax.random.wrap_key_data(jnp.asarray(sp.key_data(7)))  # request 7's sample 3
    assert (jax.random.key_data(jax.random.fold_in(parent, 3))
            == rl_rollouts.sample_key(sp.seed, 7, 3)).all()
    assert rl_rollouts.report([r])["G4: prompt pages below the boundary page x G"]


def test_rl_sync_updates_compile_nothing_serve_no_stale_pages_and_logprobs_agree():
    """``experiments.rl_sync`` at tiny sizes: adamw updates through ``update_params`` compile
    nothing and copy no leaf, the prefix cache never serves a prompt's pages across an update
    (and serves them again after), and the trainer's log-probabilities of the rollout's
    tokens equal the engine's in float32."""
    from experiments import rl_sync  # noqa: PLC0415

    lm = tiny_lm()
    args = rl_sync.parse_args(["--quick", "--updates", "3"])
    prompt = common.english_prompts(lm, 1, 30, 30, seed=1)[0]
    s = rl_sync.sync(lm, prompt, args)
    assert s["updates"] == 3 and s["compiles"] == 0 and s["placed_leaves"] == 0
    assert s["update_ms_median"] < 50 and len(s["release_ms"]) == 3
    assert s["stale_hit_tokens"] == 0 and s["fresh_hits"] == 3 and s["versions_ok"]
    assert s["fresh_hit_tokens_median"] >= 28  # the prompt's full pages (of 4 tokens)
    r = rl_sync.agreement(lm, [prompt], args, "raw", None, None)
    assert r["compared"] == r["tokens"] == args.group * args.new
    assert r["max_abs"] < 1e-4, r


def test_grpo_steps_train_swap_weights_without_compiles_and_leak_nothing():
    """``experiments.grpo`` at tiny sizes: two supervised steps, then two GRPO steps (paged
    rollouts and their dense twin, the jitted loss and adamw step, ``update_params``): the
    loss is finite, ``update_params`` compiled nothing, no page or row is left held on either
    engine, the sampler's and the trainer's log-probabilities agree within 1e-4, and greedy
    tokens are identical paged vs dense."""
    pytest.importorskip("optax")
    from experiments import grpo  # noqa: PLC0415

    args = grpo.parse_args(["--quick", "--steps", "2", "--sft-steps", "2", "--sft-every", "2",
                            "--held-out", "16", "--check-pairs", "16", "--prompts", "4",
                            "--group", "2", "--paged-rows", "8", "--kv-tokens", "128",
                            "--eval-every", "2"])
    res = grpo.run(args)["results"]
    assert len(res["steps"]) == 2 and all(np.isfinite(s["loss"]) for s in res["steps"])
    checks, summary = res["checks"], res["summary"]
    assert checks["swap_programs"] == 0 and all(s["swap_programs"] == 0 for s in res["steps"])
    assert checks["programs_after_first_step"]["trainer"] == 0
    assert checks["paged_all_free"] and checks["leaked"] == {"paged": 0, "dense": 0}
    assert summary["logprob_gap_max"] < 1e-4 and summary["ratio_max"] < 1 + 1e-3
    assert summary["greedy_identical"] and summary["one_weight_version_per_rollout"]
