"""The paged cache over a data-axis mesh (:mod:`paxkv.scale.sharded_cache`) on forced CPU devices.

``JAX_NUM_CPU_DEVICES`` must be set before JAX starts, so every check runs in a subprocess of
its own (``python -c`` importing this file and calling one ``worker_*`` function, which prints
its findings as JSON; warnings are errors there, so a "donated buffers were not usable"
warning fails the test). The parent asserts on the JSON.

Checked: greedy tokens through :class:`paxkv.Engine` on meshes (8, 1), (4, 1) and (2, 1) with a
pool small enough to preempt equal a single-device paged run; after every engine step, per
shard: ref counts equal a recount of the block tables, page ids are local, every cache leaf
keeps its sharding; at the end every shard's pool is free. The engine's first admission puts a
request in every shard; a shard whose forked samples run it dry preempts only its own requests
(the short requests of the other shard, the cheapest recompute pool-wide, are never
preempted); ``generate(..., mesh=)`` gives one device's tokens, and sizes that do not split
over the data axis name the fix. With the prefix cache on a (2, 1) mesh, two waves sharing a
system prompt give one device's tokens, the second wave starts from cached pages, ref counts
equal the tables' plus each shard's index holds after every step, and clearing the indexes
frees every shard. The page-table ops (the prefix cache's attach and retain included) compile
to 0 collectives; each device holds 1 / data of the pool; cross-shard fork / reorder / attach
fail with ``ok`` False; a donated step donates every leaf.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import warnings

import numpy as np
import pytest

# Forced CPU devices in subprocesses: `make test` runs these, `make test-fast` not.
pytestmark = pytest.mark.devices

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE_SIZE, MAX_LEN, MAX_SEQS = 4, 24, 16
REF_PAGES = MAX_SEQS * MAX_LEN // PAGE_SIZE  # the single-device run never preempts
# data axis -> num_pages: 5 / 6 / 6 / 8 pages a shard (5: the longest request's), preempts even
# with requests spread over the shards
TIGHT = {8: 40, 6: 36, 4: 24, 2: 16}


def run_worker(name: str, *args: object, devices: int = 8, timeout: int = 300,
               module: str = "test_mesh") -> dict:
    """Runs ``<module>.worker_<name>(*args)`` in a fresh interpreter with ``devices`` CPU
    devices."""
    code = (f"import sys, json; sys.path.insert(0, 'tests'); import {module} as t; "
            f"print('RESULT ' + json.dumps(t.worker_{name}(*{args!r})))")
    # XLA's backend optimisations off: these runs are compiles of small steps on many devices
    # (the engine state machine compiles its ~50 variants in two thirds of the time so)
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
    env = dict(os.environ, JAX_NUM_CPU_DEVICES=str(devices), JAX_PLATFORMS="cpu",
               XLA_FLAGS=flags)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


# -- workers (run in the subprocess) -------------------------------------------------------
def _start() -> None:
    import jax  # noqa: PLC0415

    jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py
    warnings.simplefilter("error")


def _workload() -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(0)
    return [(rng.integers(8, 256, int(rng.integers(2, 12))).tolist(), int(rng.integers(2, 10)))
            for _ in range(12)]


def shard_problems(cache, held: list[list[int]] | None = None) -> list[str]:
    """Per-shard invariants of a :class:`ShardedPagedCache` (empty list: all hold); ``held``:
    the pages each shard's prefix index holds (one reference each, counted in)."""
    import jax  # noqa: PLC0415

    from paxkv.scale import mesh as pmesh  # noqa: PLC0415

    t = jax.device_get(cache.tables)
    pps, out = t.num_pages, []
    for s in range(t.block_tables.shape[0]):
        bt, lengths, refs = t.block_tables[s], t.lengths[s], t.ref_counts[s]
        cells = np.arange(bt.shape[1])[None, :] < (-(-lengths // t.page_size))[:, None]
        if ((bt < 0) | (bt > pps)).any() or (bt[cells] == pps).any():
            out.append(f"shard {s}: page ids not local or a held cell is the sentinel")
        if (bt[~cells] != pps).any() or (lengths[~t.active[s]] != 0).any():
            out.append(f"shard {s}: padding is not the sentinel or an idle row has a length")
        index = np.asarray(held[s] if held else [], np.int64)
        if ((index < 0) | (index >= pps)).any() or len(set(index.tolist())) < index.size:
            out.append(f"shard {s}: its index holds {index.tolist()}: not local real pages")
        recount = np.bincount(bt[cells], minlength=pps) + np.bincount(
            index[(index >= 0) & (index < pps)], minlength=pps)
        if not np.array_equal(recount, refs):
            out.append(f"shard {s}: ref counts {refs.tolist()} != recount of its tables and "
                       "index")
    for tree, want in ((cache.pools, pmesh.pool_sharding(cache.mesh)),
                       (cache.tables, pmesh.sharded(cache.mesh))):
        for leaf in jax.tree.leaves(tree):
            if not leaf.sharding.is_equivalent_to(want, leaf.ndim):
                out.append(f"a {leaf.shape} leaf moved to {leaf.sharding}")
    return out


def _record_admissions(engine) -> list[list[int]]:
    """Wraps ``engine``'s admission: the shards of each round's admitted rows, appended."""
    rounds, admit = [], engine.scheduler.admit
    rps = engine.ops.rows_per_shard

    def recording():
        admitted = admit()
        rounds.append(sorted({r.row // rps for r in admitted}))
        return admitted

    engine.scheduler.admit = recording
    return rounds


def _engine_run(lm, cache, check: bool) -> dict:
    import paxkv  # noqa: PLC0415

    engine = paxkv.Engine(lm, cache=cache, prefix_cache=False, prefill_chunk=16,
                          prefill_tokens=64)
    rounds = _record_admissions(engine)
    ids = [engine.submit(p, max_new_tokens=n, stop_token_ids=()) for p, n in _workload()]
    results, problems, steps = {}, [], 0
    while engine.has_work():
        results.update(engine.step().finished)
        steps += 1
        problems += shard_problems(engine.cache) if check else []
    out = dict(tokens=[results[i].token_ids for i in ids], steps=steps, problems=problems,
               preemptions=engine.counters.preemptions, first_shards=rounds[0])
    stats = engine.stats()  # reads the cache through its protocol (no .table on a sharded one)
    out.update(stats_free=stats.free_pages, stats_num_pages=stats.num_pages,
               stats_bytes_per_device=stats.kv_bytes_per_device)
    if check:
        c = engine.cache
        out.update(free=c.shard_free_pages().tolist(), pages_per_shard=c.pages_per_shard,
                   engine_free=int(c.free_pages()), bytes_per_device=c.kv_bytes_per_device,
                   total_pages=c.total_pages)
    return out


def worker_engine(datas: list[int]) -> dict:
    """Greedy tokens of the workload: single-device paged, then sharded on each data axis
    with the :data:`TIGHT` pool (NaN-filled: a stray read would poison the tokens)."""
    _start()
    from paxkv.scale import mesh as pmesh
    from paxkv.cache import paged as paged_cache
    from paxkv.scale import sharded_cache  # noqa: PLC0415
    from tiny import tiny_lm  # noqa: PLC0415

    lm = tiny_lm(scale=1.0)
    dims = dict(num_layers=lm.num_layers, num_kv_heads=lm.num_kv_heads, head_dim=lm.head_dim,
                page_size=PAGE_SIZE, max_len=MAX_LEN, max_seqs=MAX_SEQS)
    out = {"ref": _engine_run(lm, paged_cache.create(num_pages=REF_PAGES, **dims), False)}
    for data in datas:
        cache = sharded_cache.create(mesh=pmesh.make_mesh(data), num_pages=TIGHT[data],
                                     fill=float("nan"), **dims)
        out[str(data)] = _engine_run(lm, cache, True)
    out["dry"] = {"ref": _dry_shard(lm, None), "mesh": _dry_shard(lm, pmesh.make_mesh(2))}
    out["prefix"] = {"ref": _prefix_waves(lm, None), "mesh": _prefix_waves(lm, pmesh.make_mesh(2))}
    out["generate"] = _through_generate(lm, pmesh.make_mesh(4))
    return out


def _dry_shard(lm, mesh) -> dict:
    """One prompt with n=4 long greedy samples (forks: all in its shard, rows 0-3) beside two
    short requests (routed to shard 1) on a (2, 1) mesh of 12 pages a shard: shard 0 runs
    dry while the shorts decode. ``mesh`` None: one roomy device (the reference tokens)."""
    import paxkv  # noqa: PLC0415

    engine = paxkv.Engine(lm, mesh=mesh, max_seqs=8, max_len=24, page_size=PAGE_SIZE,
                          num_pages=24 if mesh else 64, prefix_cache=False, prefill_chunk=16,
                          prefill_tokens=64)
    victims, preempt = [], engine.lifecycle.preempt

    def recording(req):
        victims.append(dict(id=req.id, shard=req.row // engine.ops.rows_per_shard))
        preempt(req)

    engine.lifecycle.preempt = recording
    long = engine.submit(list(range(10, 16)), max_new_tokens=17, n=4, stop_token_ids=())
    short = [engine.submit(list(range(20 + 3 * i, 23 + 3 * i)), max_new_tokens=12,
                           stop_token_ids=()) for i in range(2)]
    results, first_shard = {}, {}  # request id -> the shard it first ran in
    while engine.has_work():
        results.update(engine.step().finished)
        for r in engine.table.running():
            first_shard.setdefault(r.id, r.row // engine.ops.rows_per_shard)
    samples = [shard for i, shard in sorted(first_shard.items()) if i not in (long, *short)]
    return dict(samples=[x.token_ids for x in results[long].samples],
                short=[results[i].token_ids for i in short],
                short_preemptions=[results[i].num_preemptions for i in short],
                sample_preemptions=sum(x.num_preemptions for x in results[long].samples),
                victims=victims, sample_shards=samples,
                short_shards=[first_shard[i] for i in short])


def _prefix_waves(lm, mesh) -> dict:
    """Two waves of requests, most sharing a 3-page system prompt, a few unrelated; the
    second wave arrives after two steps. ``mesh`` None: one roomy device without a prefix
    cache (the reference tokens); a (2, 1) mesh: the prefix cache on, 12 pages a shard (the
    sizes of :func:`_dry_shard`, so its compiled steps serve), checked after every step."""
    import paxkv  # noqa: PLC0415

    engine = paxkv.Engine(lm, mesh=mesh, max_seqs=8, max_len=24, page_size=PAGE_SIZE,
                          num_pages=24 if mesh else 64, prefix_cache=mesh is not None,
                          prefill_chunk=16, prefill_tokens=64)
    system = list(range(30, 42))
    rng = np.random.default_rng(1)

    def wave(n_shared: int, n_other: int) -> list[int]:
        prompts = [system + rng.integers(50, 250, int(rng.integers(1, 5))).tolist()
                   for _ in range(n_shared)]
        prompts += [rng.integers(50, 250, int(rng.integers(5, 14))).tolist()
                    for _ in range(n_other)]
        return [engine.submit(p, max_new_tokens=8, stop_token_ids=()) for p in prompts]

    first, second, results, problems, widths = wave(5, 2), [], {}, [], [0]

    def held() -> list[list[int]]:
        return [ix.pages() for ix in engine.prefixes.shards]

    if mesh is not None:
        inner = engine.prefixes.attach

        def attach(req, hit) -> None:
            widths.append(len(hit.pages))  # the most pages one hit attached
            inner(req, hit)

        engine.prefixes.attach = attach

    while engine.has_work():
        results.update(engine.step().finished)
        if mesh is not None:
            problems += shard_problems(engine.cache, held())
        if engine.scheduler.table.clock == 2:
            second = wave(6, 1)
    out = dict(tokens=[results[i].token_ids for i in first + second],
               cached=[results[i].num_cached_tokens for i in second[:6]],
               preemptions=engine.counters.preemptions, problems=problems,
               widest_hit=max(widths))
    if mesh is not None:
        stats = engine.stats()
        out.update(hit_tokens=stats.prefix_hit_tokens, cached_pages=stats.cached_pages,
                   per_shard=[len(ix) for ix in engine.prefixes.shards],
                   cleared=engine.clear_prefix_cache(),
                   free=engine.cache.shard_free_pages().tolist(),
                   pages_per_shard=engine.cache.pages_per_shard,
                   after_clear=shard_problems(engine.cache, held()))
    return out


def _through_generate(lm, mesh) -> dict:
    """The workload's prompts through ``paxkv.generate`` on one device and on ``mesh``."""
    import paxkv  # noqa: PLC0415

    prompts = [p for p, _ in _workload()]
    kw = dict(max_new_tokens=6, stop_token_ids=(), max_seqs=MAX_SEQS, max_len=MAX_LEN,
              page_size=PAGE_SIZE)
    return {name: [r.token_ids for r in paxkv.generate(lm, prompts, mesh=m, **kw)]
            for name, m in (("ref", None), ("mesh", mesh))}


def _tables_filled(mesh, dims: dict):
    """A sharded cache with rows 0, 1, 2, 5 holding 5, 9, 4, 13 tokens."""
    import jax.numpy as jnp  # noqa: PLC0415

    from paxkv.scale import sharded_cache  # noqa: PLC0415

    cache = sharded_cache.create(mesh=mesh, **dims)
    num_new = jnp.zeros((cache.max_seqs,), jnp.int32).at[jnp.array([0, 1, 2, 5])].set(
        jnp.array([5, 9, 4, 13]))
    cache, ok = cache.reserve(num_new, max_new=16)
    assert bool(ok.all())
    return cache


def worker_ops() -> dict:
    """Table ops on a data-8 mesh: compiled collectives, pool placement, fork / reorder
    across shards, donation."""
    _start()
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from paxkv.scale import mesh as pmesh  # noqa: PLC0415

    mesh = pmesh.make_mesh(8)
    dims = dict(num_layers=2, num_kv_heads=1, head_dim=16, num_pages=64, page_size=PAGE_SIZE,
                max_seqs=MAX_SEQS, max_len=MAX_LEN)
    cache = _tables_filled(mesh, dims)
    s = cache.max_seqs
    ops = {
        "reserve": (lambda c, n: c.reserve(n, max_new=1), jnp.ones((s,), jnp.int32)),
        "release": (lambda c, r: c.release(r), jnp.zeros((s,), bool).at[1].set(True)),
        "fork": (lambda c, p: c.fork(p, p + 1), jnp.full((s,), -1, jnp.int32)),
        "reorder": (lambda c, p: c.reorder(p), jnp.arange(s, dtype=jnp.int32)),
        "attach": (lambda c, n: c.attach(jnp.zeros((s, 6), jnp.int32), n),
                   jnp.zeros((s,), jnp.int32)),
        "retain": (lambda c, p: c.retain(p, 1), jnp.zeros((8, 16), jnp.int32)),
    }
    hlo = {name: pmesh.count_collectives(jax.jit(fn).lower(cache, x).compile().as_text())
           for name, (fn, x) in ops.items()}
    pool = cache.pools.k
    placement = dict(devices=len(pool.addressable_shards), total=pool.nbytes,
                     per_device=sorted({x.data.nbytes for x in pool.addressable_shards}),
                     shard_shape=list(pool.addressable_shards[0].data.shape),
                     distinct=len({x.device for x in pool.addressable_shards}))
    # rows 0,1 are shard 0; row 2 shard 1; row 5 shard 2 (2 rows a shard)
    forked, fork_ok = jax.jit(lambda c: c.fork(jnp.array([2, 0, 5]), jnp.array([3, 4, 3])))(
        cache)
    parents = jnp.arange(s, dtype=jnp.int32).at[3].set(2).at[4].set(0)
    reordered, reorder_ok = jax.jit(lambda c: c.reorder(parents))(cache)
    forks = dict(ok=fork_ok.tolist(), lengths=forked.lengths.tolist(),
                 problems=shard_problems(forked))
    reorders = dict(ok=reorder_ok.tolist(), lengths=reordered.lengths.tolist(),
                    problems=shard_problems(reordered))
    return dict(hlo=hlo, placement=placement, fork=forks, reorder=reorders, holds=_holds(cache),
                donation=_donation(mesh, dims), beams=_beams(pmesh.make_mesh(2)),
                scores=_scores(pmesh.make_mesh(2)))


def _holds(cache) -> dict:
    """The prefix cache's holds on a data-8 mesh (:mod:`paxkv.prefix.holds`): row 5's 4 pages
    (shard 2; more pages than a shard has rows, which a width read off the stacked table's
    rows axis could not hold) kept by an index hold past the row's release, attached to row 4
    of the same shard, then to row 6 of shard 3, where those ids name free pages (refused)."""
    import jax.numpy as jnp  # noqa: PLC0415

    from paxkv.prefix import holds as page_holds  # noqa: PLC0415

    pages = page_holds.block_tables(cache)[5, :4].tolist()
    held = [[], [], pages] + [[]] * 5
    cache = page_holds.retain(cache, held, 1)
    cache, _ = cache.release(jnp.zeros((cache.max_seqs,), bool).at[5].set(True))
    released = dict(refs=page_holds.ref_counts(cache)[2, pages].tolist(),
                    problems=shard_problems(cache, held))
    cache, ok = page_holds.attach(cache, 4, pages, 13)
    cache, other_ok = page_holds.attach(cache, 6, pages, 13)
    return dict(pages=pages, released=released, ok=[ok, other_ok],
                lengths=[int(cache.lengths[4]), int(cache.lengths[6])],
                refs=page_holds.ref_counts(cache)[2, pages].tolist(),
                problems=shard_problems(cache, held))


def _scores(mesh) -> dict:
    """Three contexts of 2, 3 and 1 continuations (forked) and a context longer than a page,
    scored on one device and on ``mesh`` with 4 rows a shard: 3 + 1 continuations fit one
    shard, not 2 + 3."""
    import paxkv  # noqa: PLC0415
    from tiny import tiny_lm  # noqa: PLC0415

    lm = tiny_lm(scale=1.0)
    a, b, c = [11, 12, 13, 14, 15, 16], [40, 41], [70, 71, 72, 73, 74, 75, 76, 77, 78]
    pairs = [(a, [20, 21]), (a, [22, 23, 24]), (b, [30, 31]), (b, [32]), (b, [33, 34, 35]),
             (c, [50, 51, 52]), (a, [25])]
    out = {}
    for name, m in (("ref", None), ("mesh", mesh)):
        found = paxkv.score(lm, pairs, page_size=PAGE_SIZE, max_seqs=8, mesh=m)
        out[name] = [(round(r.logprob, 4), r.is_greedy) for r in found]
    return out


def _beams(mesh) -> dict:
    """Three prompts' beam search on one device and on ``mesh`` (padded to four prompts, two
    a shard): beams, scores and the pool's accounting."""
    from paxkv.decoding.beam_search import search  # noqa: PLC0415
    from tiny import tiny_lm  # noqa: PLC0415

    lm, out = tiny_lm(scale=1.0), {}
    prompts = [[11, 12, 13, 14, 15], [40, 41], [70, 71, 72, 73, 74, 75, 76]]
    for name, m in (("ref", None), ("mesh", mesh)):
        found = search(lm, prompts, beam_width=3, max_new_tokens=6,
                       stop_token_ids=(), page_size=PAGE_SIZE, mesh=m)
        out[name] = dict(beams=[[(b.token_ids, round(b.score, 4)) for b in x]
                                for x in found.beams],
                         all_free=found.all_free, stale=found.stale_pages,
                         freed=found.pages_freed_by_reorder, num_pages=found.num_pages)
    return out


def _donation(mesh, dims: dict) -> dict:
    """A prefill step then a decode step of the tiny model, the cache donated each time."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from paxkv.scale import mesh as pmesh

    from paxkv.scale import sharded_cache

    from paxkv.core import steps  # noqa: PLC0415
    from tiny import tiny_lm  # noqa: PLC0415

    lm = tiny_lm(scale=1.0)
    cache = sharded_cache.create(mesh=mesh, **dict(dims, num_kv_heads=lm.num_kv_heads,
                                                   head_dim=lm.head_dim))
    s = cache.max_seqs
    before = jax.tree.leaves(cache)
    tokens = jnp.arange(s * 8, dtype=jnp.int32).reshape(s, 8) % 200 + 8
    rows, qlens = jnp.arange(s, dtype=jnp.int32), jnp.full((s,), 8, jnp.int32)
    cache, first, ok, _ = steps.prefill_step(lm.forward, lm.params, cache, tokens, rows, qlens,
                                             None)
    deleted = all(x.is_deleted() for x in before)
    cache, nxt, ok2, _ = steps.decode_step(lm.forward, lm.params, cache, first,
                                           jnp.ones((s,), bool), None)
    counts = {}
    for name, fn, args in (("prefill", steps.prefill_step, (tokens, rows, qlens, None)),
                           ("decode", steps.decode_step, (nxt, jnp.ones((s,), bool), None))):
        text = fn.lower(lm.forward, lm.params, cache, *args).compile().as_text()
        counts[name] = pmesh.count_collectives(text)
    return dict(deleted=deleted, ok=bool(ok.all() & ok2.all()),
                problems=shard_problems(cache), step_collectives=counts)


def worker_errors() -> dict:
    """The messages of meshes and sizes that do not fit."""
    _start()
    from paxkv.scale import mesh as pmesh
    from paxkv.scale import sharded_cache  # noqa: PLC0415

    dims = dict(num_layers=1, head_dim=8, page_size=4, max_len=16)
    cases = {"model": dict(mesh=pmesh.make_mesh(4, 2), num_pages=8, max_seqs=4,
                           num_kv_heads=3),
             "max_seqs": dict(mesh=pmesh.make_mesh(4), num_pages=8, max_seqs=6),
             "num_pages": dict(mesh=pmesh.make_mesh(4), num_pages=10, max_seqs=4),
             "axes": dict(mesh="not a mesh", num_pages=8, max_seqs=4)}
    from paxkv.core.protocol import KVCache  # noqa: PLC0415

    cache = sharded_cache.create(mesh=pmesh.make_mesh(2), num_pages=8, max_seqs=4,
                                 num_kv_heads=1, **dims)
    out = {"is_kv_cache": isinstance(cache, KVCache), "sizes": [
        cache.max_seqs, cache.num_pages, cache.total_pages, cache.max_len, cache.page_size]}
    for name, kw in cases.items():
        try:
            sharded_cache.create(**{"num_kv_heads": 1, **kw}, **dims)
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    return dict(out, engine=_engine_errors())


def _engine_errors() -> dict:
    """What ``paxkv.Engine(mesh=...)`` says to sizes and options that do not fit a mesh."""
    import paxkv  # noqa: PLC0415
    from paxkv.scale import mesh as pmesh  # noqa: PLC0415
    from tiny import tiny_lm  # noqa: PLC0415

    lm, mesh, out = tiny_lm(scale=1.0), pmesh.make_mesh(4), {}
    cases = {"max_seqs": dict(max_seqs=6), "num_pages": dict(max_seqs=8, num_pages=30),
             "dense": dict(cache="dense"), "prefix": dict(max_seqs=8, prefix_cache=True)}
    for name, kw in cases.items():
        try:
            paxkv.Engine(lm, mesh=mesh, max_len=16, page_size=4, **kw)
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    return out


# -- tests ---------------------------------------------------------------------------------
def _check_engine_runs(found: dict, datas: list[int]) -> None:
    ref = found["ref"]["tokens"]
    assert len({tuple(t) for t in ref}) > 6, "the workload's tokens should vary"
    for data in datas:
        run = found[str(data)]
        assert run["tokens"] == ref, f"data={data}"
        assert run["preemptions"] > 0, f"data={data}: the pool never ran dry"
        assert run["problems"] == [], run["problems"][:5]
        assert run["free"] == [run["pages_per_shard"]] * data
        assert run["engine_free"] == run["pages_per_shard"]
        # Engine.stats on a sharded cache (it raised AttributeError: no .table): all shards.
        assert run["stats_num_pages"] == run["stats_free"] == run["total_pages"]
        assert run["stats_bytes_per_device"] == run["bytes_per_device"]
        # the first admission spread the requests: every shard took one (the lowest free row
        # would have filled the first shards' rows only)
        assert run["first_shards"] == list(range(data)), (data, run["first_shards"])


def _check_dry_shard(dry: dict) -> None:
    """Shard 0 (the samples') ran dry and preempted only its own requests; the shorts in
    shard 1, the cheapest recompute pool-wide, ran through; tokens as on one device."""
    ref, run = dry["ref"], dry["mesh"]
    assert run["sample_shards"] == [0] * 4 and run["short_shards"] == [1, 1]
    assert run["victims"] and {v["shard"] for v in run["victims"]} == {0}, run["victims"]
    assert run["short_preemptions"] == [0, 0] and run["sample_preemptions"] > 0
    assert ref["victims"] == [] and run["samples"] == ref["samples"]
    assert run["short"] == ref["short"]


def _check_prefix_waves(found: dict) -> None:
    """The prefix cache on a (2, 1) mesh: one device's tokens; the second wave's users of the
    system prompt start from cached pages; ref counts are the tables' and the indexes' holds
    after every step; clearing the indexes frees every shard's pool."""
    ref, run = found["ref"], found["mesh"]
    assert run["tokens"] == ref["tokens"] and len({tuple(t) for t in ref["tokens"]}) > 6
    assert run["problems"] == [] and run["after_clear"] == [], run["problems"][:5]
    # preempted requests come back to hits of their own written pages: 5 pages, more than a
    # shard's 4 rows (an attach sized by the stacked table's rows axis failed there)
    assert run["preemptions"] > 0 and run["widest_hit"] == 5
    assert all(n >= 2 * PAGE_SIZE for n in run["cached"]), run["cached"]
    assert run["hit_tokens"] >= sum(run["cached"]) and run["cached_pages"] > 0
    assert run["cleared"] == sum(run["per_shard"]) == run["cached_pages"]
    assert run["free"] == [run["pages_per_shard"]] * 2


@pytest.mark.slow  # engine runs on 8 forced devices (~1 minute)
def test_engine_on_data_meshes_matches_one_device():
    """(8, 1) and (2, 1), the most and the fewest shards: the same greedy tokens as one
    device, through preemption."""
    found = run_worker("engine", [8, 2])
    for data in (8, 2):
        run = found[str(data)]
        print(f"data={data}: {run['steps']} steps, {run['preemptions']} preemptions")
    _check_engine_runs(found, [8, 2])
    _check_dry_shard(found["dry"])
    _check_prefix_waves(found["prefix"])
    print("prefix cache on (2, 1):", {k: found["prefix"]["mesh"][k] for k in (
        "cached", "per_shard", "preemptions", "hit_tokens", "widest_hit")})
    assert found["generate"]["mesh"] == found["generate"]["ref"]
    assert len({tuple(t) for t in found["generate"]["ref"]}) > 6


def test_table_ops_collectives_placement_and_donation():
    found = run_worker("ops")
    print("table-op collectives:", found["hlo"])
    print("step collectives:", found["donation"]["step_collectives"])
    for name in ("reserve", "release", "reorder", "attach", "retain"):
        assert sum(found["hlo"][name].values()) == 0, (name, found["hlo"][name])
    # a fork's pairs name global rows: one all-reduce gathers each pair's ok from its shard
    assert found["hlo"]["fork"] == dict(found["hlo"]["reserve"], **{"all-reduce": 1})
    place = found["placement"]
    assert place["devices"] == place["distinct"] == 8
    assert place["per_device"] == [place["total"] // 8]
    assert place["shard_shape"][1] == 64 // 8 + 1  # [layers, pages + sentinel, ...] a device
    # fork: (2 -> 3) same shard ok; (0 -> 4) and (5 -> 3) cross shards fail, change nothing
    assert found["fork"]["ok"] == [True, False, False]
    lengths = found["fork"]["lengths"]
    assert lengths[:6] == [5, 9, 4, 4, 0, 13] and found["fork"]["problems"] == []
    # reorder: row 3 continues row 2 (same shard); row 4 would continue row 0: dropped
    ok, lengths = found["reorder"]["ok"], found["reorder"]["lengths"]
    assert ok[:6] == [True, True, True, True, False, True]
    assert lengths[:6] == [5, 9, 4, 4, 0, 13] and found["reorder"]["problems"] == []
    # the prefix cache's holds: shard-local, a hit attaches only in its own shard
    holds = found["holds"]
    assert holds["released"] == dict(refs=[1] * 4, problems=[])
    assert holds["ok"] == [True, False] and holds["lengths"] == [13, 0]
    assert holds["refs"] == [2] * 4 and holds["problems"] == []
    donation = found["donation"]
    assert donation["deleted"] and donation["ok"] and donation["problems"] == []
    # beam search on a (2, 1) mesh: one device's beams; the padding prompt's pages count too
    ref, run = found["beams"]["ref"], found["beams"]["mesh"]
    # tokens exactly; scores (rounded to 4 places by the worker) to 2e-4: the mesh's program
    # sums in another order, and -0.61525 rounds either way (seen under QUICK_XLA on 12-04)
    tokens = lambda found: [[b[0] for b in beams] for beams in found["beams"]]  # noqa: E731
    scores = lambda found: [[b[1] for b in beams] for beams in found["beams"]]  # noqa: E731
    assert tokens(run) == tokens(ref) and len(run["beams"]) == 3
    np.testing.assert_allclose(scores(run), scores(ref), atol=2e-4)
    assert run["all_free"] and ref["all_free"] and run["stale"] == ref["stale"] == 0
    assert run["num_pages"] == ref["num_pages"] * 4 // 3
    # scoring on a (2, 1) mesh: each context forks its continuations inside one shard
    assert found["scores"]["mesh"] == found["scores"]["ref"]


def test_mesh_and_size_errors_name_the_fix():
    found = run_worker("errors")
    assert found["model"] == (
        "num_kv_heads=3 cannot be split over a model axis of 2: the model axis must divide 3 "
        "(1 or 3); on these 8 devices use a (data, model) mesh of (8, 1)")
    assert "max_seqs=6" in found["max_seqs"] and "max_seqs=4 or 8" in found["max_seqs"]
    assert "num_pages=8 or 12" in found["num_pages"]
    assert "('data', 'model')" in found["axes"]
    engine = found["engine"]
    assert "max_seqs=6" in engine["max_seqs"] and "max_seqs=4 or 8" in engine["max_seqs"]
    assert "num_pages=28 or 32" in engine["num_pages"]
    assert "cache='paged'" in engine["dense"]
    assert engine["prefix"] == "no error"  # one prefix index per shard
    # the engine-facing num_pages is one shard's (module docstring of paxkv.scale.sharded_cache)
    assert found["is_kv_cache"] and found["sizes"] == [4, 4, 8, 16, 4]
