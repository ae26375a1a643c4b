"""The engine as a state machine: random submits (``n`` samples, shared prefixes, sampling,
held rows), forks, extensions of held rows, cancels, weight updates in each in-flight mode and
steps on a tiny random Llama, through a pool small enough to run dry.

After every operation the page table equals a plain-Python recount of its holders (block-table
cells of live rows plus the prefix index), the engine's host counts equal the device's, and
each row holds exactly its request's cached tokens and an idle row no page. A request that was
cancelled or handed out holds no row, queue place or page, nor do its samples (an ``n > 1``
request's children end with it; fork children are requests of their own); a cancel frees them
in that very call (checked as it returns: the rows, the device table, ``stats()`` before and
after), and one rule cancels ``n > 1`` requests while their samples run. At the end of each
run every page is free once the prefix cache is cleared, and every request's tokens equal a
reference run of the same request (its prompt, settings and key) in an engine of the same
shapes without the prefix cache, two requests at a time (never preempted): a cancelled or
forked request's tokens are a prefix of it. The machine runs again with a host tier under the
prefix cache (:class:`HostTierMachine`). The last test is a soak: 10,000 requests through
one engine, with host memory and compiled step variants bounded.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import resource
import subprocess
import sys

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule, run_state_machine_as_test)

import paxkv
from paxkv.core import steps, stored
from paxkv.engine.requests import Request
from tiny import tiny_lm

MAX_SEQS, MAX_LEN, PAGE_SIZE, NUM_PAGES = 6, 48, 4, 26
SYSTEM = list(range(40, 56))  # a shared "system prompt": prefix-cache hits, mid-page too
# operations; cancels of n > 1 requests with samples in rows; weight updates; extensions
OPS = {"count": 0, "parent_cancels": 0, "update_abort": 0, "update_keep": 0,
       "update_recompute": 0, "extends": 0}
ROOT = pathlib.Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Spec:
    """What a request asked for, enough to run it again alone."""

    prompt: tuple[int, ...]
    max_new_tokens: int
    stops: tuple[int, ...]
    temperature: float
    key: tuple[int, ...]
    n: int


def _lm():
    return tiny_lm(eos=(7,), scale=1.0)


class EngineMachine(RuleBasedStateMachine):
    HOST_BYTES = 0  # the prefix cache's host tier (HostTierMachine)

    @initialize()
    def start(self):
        self.engine = paxkv.Engine(_lm(), max_seqs=MAX_SEQS, max_len=MAX_LEN,
                                   page_size=PAGE_SIZE, num_pages=NUM_PAGES, prefill_chunk=16,
                                   prefill_tokens=32, host_cache_bytes=self.HOST_BYTES)
        self.specs: dict[int, Spec] = {}
        self.ticks = 0  # operations of this machine (a precondition reads it: no global)
        self.children: dict[int, list[int]] = {}
        self.results: dict[int, paxkv.GenerationResult] = {}
        self.cancelled: set[int] = set()
        # Every request the engine ever added (samples and fork children too, even those made
        # and handed out within one step), kept after the engine drops them.
        self.seen: dict[int, Request] = {}
        add = self.engine.table.add

        def record(req):
            self.seen[req.id] = req
            add(req)
        self.engine.table.add = record

    def _note(self) -> None:
        """Remembers every live request's settings (samples and fork children included)."""
        OPS["count"] += 1
        self.ticks += 1
        for rid, r in self.engine.table.requests.items():
            self.specs.setdefault(rid, Spec(tuple(r.prompt_ids), r.max_new_tokens,
                                            tuple(sorted(r.stop_ids)), r.temperature,
                                            tuple(int(x) for x in r.key_data), r.n))
            if r.children:
                self.children[rid] = list(r.children)

    @rule(data=st.data(), prefix=st.sampled_from([0, 9, 16]),
          own=st.lists(st.integers(8, 255), min_size=1, max_size=10),
          max_new=st.integers(1, 8), n=st.sampled_from([1, 1, 1, 2, 3]),
          stops=st.sampled_from([(), (7,)]), temperature=st.sampled_from([0.0, 0.0, 0.9]),
          seed=st.integers(0, 2**16), hold=st.sampled_from([False, False, True]))
    def submit(self, data, prefix, own, max_new, n, stops, temperature, seed, hold):
        key = jax.random.key_data(jax.random.PRNGKey(seed))
        # One held request at most: two whole held rows (2 x 12 pages) would leave too little
        # of the pool for a request alone, which the engine reports as an error.
        holding = any(r.hold for r in self.engine.table.requests.values())
        self.engine.submit(SYSTEM[:prefix] + own, max_new_tokens=max_new, n=n,
                           stop_token_ids=stops, temperature=temperature, key=key,
                           hold=hold and n == 1 and not holding)
        self._note()

    def _held(self) -> list[int]:
        """Finished ``hold=True`` requests holding their rows (not yet refilled)."""
        return sorted(rid for rid, r in self.engine.table.requests.items()
                      if r.hold and r.row is not None and r.finish_reason in ("stop", "length"))

    @precondition(lambda self: self._held())
    @rule(data=st.data(), more=st.lists(st.integers(8, 255), min_size=1, max_size=6),
          max_new=st.integers(1, 5), hold=st.booleans())
    def extend(self, data, more, max_new, hold):
        """A held completion goes on after appended ids (a tool's result) in its row."""
        rid = data.draw(st.sampled_from(self._held()))
        room = MAX_LEN - len(self.engine.table.requests[rid].tokens) - max_new
        if room >= 1:
            self.engine.extend(rid, more[:room], max_new_tokens=max_new, hold=hold)
            OPS["extends"] += 1
        self._note()

    @precondition(lambda self: self.ticks % 5 == 0)  # rarer: the cache refills between updates
    @rule(mode=st.sampled_from(["abort", "keep", "recompute"]), keep=st.booleans())
    def update_weights(self, mode, keep):
        """New weights of the same values (a fresh copy of every leaf), so tokens still equal
        the reference's: what is checked is who holds which pages across the update."""
        eng = self.engine
        before = eng.weight_version
        new = jax.tree.map(lambda x: x.copy(), eng.params)
        update = eng.update_params(new, in_flight=mode, keep_prefix_cache=keep)
        assert update.version == before + 1 and update.placed == ()
        for rid in update.aborted:
            assert self.seen[rid].finish_reason == "aborted" and self.seen[rid].row is None
        if not keep:  # nothing cached under the old weights is left to serve
            assert len(eng.prefixes) == 0
        OPS[f"update_{mode}"] += 1
        self._note()

    @rule()
    def step(self):
        out = self.engine.step()
        assert not set(out.finished) & set(self.results), "a result handed out twice"
        self.results.update(out.finished)
        self._note()
        for rid in self.cancelled:  # a cancelled request is done: handed out by this step
            req = self.seen[rid]
            parent = req.sample_of
            if parent is None or parent not in self.engine.table.requests:
                assert rid not in self.engine.table.requests, f"cancelled {rid} not handed out"
                assert (parent if parent is not None else rid) in self.results, rid

    @precondition(lambda self: any(r.decoding for r in self.engine.table.requests.values()))
    @rule(data=st.data(), k=st.integers(1, 3), max_new=st.integers(1, 6))
    def fork(self, data, k, max_new):
        live = sorted(rid for rid, r in self.engine.table.requests.items() if r.decoding)
        self.engine.fork(data.draw(st.sampled_from(live)), k, max_new_tokens=max_new)
        self._note()

    @precondition(lambda self: self.engine.table.requests)
    @rule(data=st.data())
    def cancel(self, data):
        """Cancels a live request; half the time an ``n > 1`` one whose samples run, if any."""
        parents = self._sampled_parents()
        live = parents if parents and data.draw(st.booleans()) else self.engine.table.requests
        self._cancel(data.draw(st.sampled_from(sorted(live))))

    def _sampled_parents(self) -> list[int]:
        """Live ``n > 1`` requests with a sample not yet finished."""
        reqs = self.engine.table.requests
        return sorted(rid for rid, r in reqs.items() if r.n > 1 and any(
            c in reqs and reqs[c].finish_reason is None for c in r.children))

    @precondition(lambda self: self._sampled_parents())
    @rule(data=st.data())
    def cancel_sampled_parent(self, data):
        """Cancelling an ``n > 1`` request must end every sample of it (a uniform draw over
        the live requests rarely lands on a parent while its samples run)."""
        self._cancel(data.draw(st.sampled_from(self._sampled_parents())))

    def _family(self, rid: int) -> list[Request]:
        """Request ``rid`` and its samples (recursively): what ends when it ends. Fork
        children are not in it: a forked request has ended ("forked") and its children, child
        0 in its old row, run on as requests of their own (cancel ends each one itself)."""
        req = self.seen[rid]
        out = [req]
        for kid in (req.children if req.n > 1 else []):
            out += self._family(kid)
        return out

    def _cancel(self, rid: int) -> None:
        """Cancels ``rid``; checks that the call itself freed the rows of it and its samples
        (and no other row), and that ``stats()`` shows them gone."""
        eng = self.engine
        family = self._family(rid)
        ids = {m.id for m in family}
        rows_before = list(eng.table.rows)
        freed = {m.row for m in family if m.row is not None}
        before = eng.stats()
        if any(m.row is not None and m.finish_reason is None for m in family[1:]):
            OPS["parent_cancels"] += 1
        eng.cancel(rid)
        self.cancelled.add(rid)
        after = eng.stats()
        table = jax.device_get(eng.cache.table)
        waiting = {r.id for r in eng.table.waiting}
        running = {r.id for r in eng.table.running()}
        for m in family:
            assert m.row is None and m.finish_reason is not None, (
                f"cancel {rid}: request {m.id} still in row {m.row}, finish {m.finish_reason}")
            assert m.id not in waiting and m.id not in running, f"cancel {rid}: {m.id} runs on"
        for row, req in enumerate(eng.table.rows):
            want = None if row in freed else rows_before[row]
            assert req is want, f"cancel {rid}: row {row} holds {req and req.id}, not {want}"
        for row in freed:
            assert not table.active[row] and table.lengths[row] == 0, f"cancel {rid}: row {row}"
            assert (table.block_tables[row] == NUM_PAGES).all(), f"cancel {rid}: row {row} pages"
        assert set(after.sequences) == set(before.sequences) - ids, (
            f"cancel {rid}: stats() sequences {sorted(before.sequences)} -> "
            f"{sorted(after.sequences)}, ended {sorted(ids)}")
        gone = sum(before.sequences[i].pages for i in ids & set(before.sequences))
        assert after.row_references == before.row_references - gone, (
            f"cancel {rid}: row pages {before.row_references} -> {after.row_references}, "
            f"freed {gone}")
        assert after.free_pages >= before.free_pages, f"cancel {rid}: fewer free pages"
        self._note()

    @invariant()
    def table_matches_a_recount_of_its_holders(self):
        eng = self.engine
        cache = eng.cache
        table = jax.device_get(cache.table)
        held = -(-table.lengths // PAGE_SIZE)
        expected = np.zeros(NUM_PAGES + 1, np.int64)
        for row in range(MAX_SEQS):
            cells = table.block_tables[row]
            assert (cells[held[row]:] == NUM_PAGES).all(), f"row {row}: cells past its pages"
            assert (cells[:held[row]] < NUM_PAGES).all(), f"row {row}: a sentinel it reads"
            np.add.at(expected, cells[:held[row]], 1)
        index = eng.prefixes.index
        np.add.at(expected, np.asarray(index.pages(), np.int64), 1)
        np.testing.assert_array_equal(table.ref_counts, expected[:NUM_PAGES])
        assert eng.ops.free == int(np.sum(table.ref_counts == 0)), "host free count is stale"
        for row, req in enumerate(eng.table.rows):
            assert bool(table.active[row]) == (req is not None), f"row {row}"
            if req is not None:
                assert int(table.lengths[row]) == req.cached, f"row {row} length"

    @invariant()
    def ended_requests_hold_nothing(self):
        """A cancelled or handed-out request and its samples are finished and hold no row,
        queue place or page (a handed-out one is gone from the table, samples too); the
        recount above then shows their pages released."""
        eng = self.engine
        in_rows = {r.id for r in eng.table.rows if r is not None}
        waiting = {r.id for r in eng.table.waiting}
        for rid in self.cancelled | set(self.results):
            what = f"{'cancelled' if rid in self.cancelled else 'handed-out'} {rid}"
            for m in self._family(rid):
                assert m.finish_reason is not None and m.row is None, (
                    f"{what}: request {m.id} in row {m.row}, finish {m.finish_reason}")
                assert m.id not in in_rows and m.id not in waiting, f"{what}: {m.id} runs on"
                assert rid not in self.results or m.id not in eng.table.requests, (
                    f"{what}: {m.id} still in the table")
        table = jax.device_get(eng.cache.table)
        for row, req in enumerate(eng.table.rows):
            if req is None:  # an idle row holds no page
                assert int(table.lengths[row]) == 0, f"idle row {row} has a length"
                assert (table.block_tables[row] == NUM_PAGES).all(), f"idle row {row}: pages"

    def teardown(self):
        if not hasattr(self, "engine"):
            return
        self.results.update(self.engine.run())
        for rid in self._held():  # held rows end here; their results were handed out above
            self.engine.cancel(rid)
        self.engine.run()
        self._note()
        self.engine.clear_prefix_cache()
        assert int(self.engine.cache.free_pages()) == NUM_PAGES, "a leaked page"
        host = self.engine.stats().host
        assert host is None or (host.pages, host.bytes, host.in_flight) == (0, 0, 0), host
        assert not self.engine.table.requests, "a request was never handed out"
        self._check_against_reference()

    def _flatten(self) -> dict[int, paxkv.GenerationResult]:
        """Every result by request id, samples under their own ids."""
        out = {}
        for rid, res in self.results.items():
            out[rid] = res
            for kid, sample in zip(self.children.get(rid, []), res.samples or []):
                out[kid] = sample
        return out

    def _check_against_reference(self) -> None:
        # An n > 1 request's own result repeats its sample 0 (checked under the sample's id).
        got = {rid: r for rid, r in self._flatten().items() if self.specs[rid].n == 1}
        if not got:
            return
        # The reference engine has the machine's shapes (its compiled steps serve both) but
        # no prefix cache, and runs two requests at a time: two whole rows (2 x 12 pages) fit
        # the 26-page pool, so nothing is shared, queued behind a full pool or preempted.
        ref = paxkv.Engine(_lm(), max_seqs=MAX_SEQS, max_len=MAX_LEN, page_size=PAGE_SIZE,
                           num_pages=NUM_PAGES, prefill_chunk=16, prefill_tokens=32,
                           prefix_cache=False)
        assert 2 * (MAX_LEN // PAGE_SIZE) <= NUM_PAGES
        ids, want = {}, {}
        rids = list(got)
        for start in range(0, len(rids), 2):
            for rid in rids[start:start + 2]:
                s = self.specs[rid]
                ids[rid] = ref.submit(list(s.prompt), max_new_tokens=s.max_new_tokens,
                                      stop_token_ids=s.stops, temperature=s.temperature,
                                      key=np.asarray(s.key, np.uint32))
            want.update(ref.run())
        assert ref.stats().preemptions == 0
        for rid, res in got.items():
            expected = want[ids[rid]].token_ids
            if res.finish_reason in ("cancelled", "forked", "aborted"):
                assert res.token_ids == expected[:len(res.token_ids)], rid
            else:
                assert res.token_ids == expected, (rid, res.finish_reason)


class HostTierMachine(EngineMachine):
    """The machine with a host tier of 12 pages under its 26-page pool: evictions copy pages
    out, lookups copy them back (a cancel may follow at once), the host budget runs out and
    drops its least recent pages; tokens still equal the reference's."""

    HOST_BYTES = 12 * 2 * 2 * PAGE_SIZE * 16 * 4  # 12 pages: K+V x 2 layers x 4 x 16 float32

    @precondition(lambda self: self.specs)
    @rule(data=st.data(), more=st.lists(st.integers(8, 255), min_size=1, max_size=12),
          max_new=st.integers(1, 6), seed=st.integers(0, 2**16))
    def come_back(self, data, more, max_new, seed):
        """An earlier request's prompt and tokens again, extended: a returning agent, whose
        pages may have gone to the host tier since."""
        rid = data.draw(st.sampled_from(sorted(self.specs)))
        done = self.results.get(rid)
        prompt = list(self.specs[rid].prompt) + (done.token_ids if done else [])
        key = jax.random.key_data(jax.random.PRNGKey(seed))
        self.engine.submit((prompt + more)[:MAX_LEN - max_new], max_new_tokens=max_new,
                           key=key)
        self._note()

    @invariant()
    def host_tier_within_its_budget(self):
        host = self.engine.stats().host
        assert host.capacity_pages == 12 and host.pages <= 12, host
        assert host.bytes == host.pages * self.engine.cache.kv_bytes_per_page


def run_machine(machine: type = EngineMachine, examples: int = 45) -> int:
    """Runs a state machine (derandomized: the same examples every run); returns how many
    operations it did."""
    jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py
    OPS.update(dict.fromkeys(OPS, 0))
    run_state_machine_as_test(machine, settings=settings(
        max_examples=examples, stateful_step_count=60, deadline=None, derandomize=True,
        database=None, suppress_health_check=list(HealthCheck)))
    return OPS["count"]


def _in_own_process(call: str) -> str:
    """Runs ``call`` (Python that prints) with this module as ``t`` in a fresh interpreter and
    returns its stdout. A process of its own: a pytest worker that had run other files twice
    died in XLA's compile of a decode step here (a segmentation fault; never seen in a fresh
    process), and a dead worker hangs the suite.
    Three quarters of a machine's run is XLA compiling ~50 step variants of a model too small
    for its optimisations to matter: the unoptimised backend compiles them in two thirds of
    the time (97 s -> 74 s alone, same operations)."""
    code = f"import sys; sys.path.insert(0, 'tests'); import test_engine_machine as t; {call}"
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=1200, env=dict(os.environ, XLA_FLAGS=flags))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.slow  # ~2-4 minutes of engine steps: `make test` runs it, `make test-fast` not
def test_engine_state_machine():
    """>= 2,000 operations with 0 invariant breaks, in a process of its own; weight updates in
    every in-flight mode and extensions of held rows among them."""
    out = _in_own_process("import json; t.run_machine(examples=50); print('OPS ' + json.dumps(t.OPS))")
    ops = json.loads(out.split("OPS ", 1)[1].splitlines()[0])
    print(f"engine state machine: {ops}")
    assert ops["count"] >= 2000, ops
    # What catches a cancel that leaves samples running (the derandomized examples are seeded
    # by EngineMachine's source, so an edit there moves it).
    assert ops["parent_cancels"] >= 10, ops
    assert min(ops["update_abort"], ops["update_keep"], ops["update_recompute"]) >= 5, ops
    assert ops["extends"] >= 5, ops


@pytest.mark.slow  # ~1 minute
def test_engine_state_machine_with_a_host_tier():
    """The machine again with the prefix cache's host tier (:class:`HostTierMachine`, returning
    requests among its rules): >= 800 operations, 0 invariant breaks, every page free and the
    host tier empty once cleared, tokens equal to the reference's; its own process, as above."""
    out = _in_own_process("print('operations:', t.run_machine(t.HostTierMachine, 15))")
    ops = int(re.search(r"operations: (\d+)", out).group(1))
    assert ops >= 800, ops


def _resident_kib() -> int:
    """This process's resident memory now, KiB (Linux; elsewhere its peak). Not the peak
    (``ru_maxrss``): every compile of a new step shape adds ~20 MiB to the peak, and the
    draining tail of the soak compiles two or three prefill shapes of few rows, which made
    the check fail now and then on a flat run (+77 MiB after 4,000 requests, 12-03)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() // 1024
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


@pytest.mark.slow
def test_soak_ten_thousand_requests():
    """10,000 short requests through one engine (continuous batching, prefix hits, samples,
    preemption): the engine keeps only live requests, host memory stays flat, the compiled
    step variants stay few, and every page comes back."""
    lm = _lm()
    jax.clear_caches()  # count this engine's compiled steps only
    engine = paxkv.Engine(lm, max_seqs=16, max_len=MAX_LEN, page_size=PAGE_SIZE,
                          num_pages=48, prefill_chunk=16, prefill_tokens=64)
    rng = np.random.default_rng(0)
    done, submitted, peak_live, rss = 0, 0, 0, {}
    while done < 10_000:
        while submitted < 10_000 and len(engine.table.waiting) < 32:
            prompt = SYSTEM[: int(rng.choice([0, 9, 16]))] + list(rng.integers(8, 256, 4))
            engine.submit(prompt, max_new_tokens=int(rng.integers(1, 5)),
                          n=int(rng.choice([1, 1, 1, 2])), stop_token_ids=())
            submitted += 1
        done += len(engine.step().finished)
        peak_live = max(peak_live, len(engine.table.requests))
        if submitted < 10_000:  # the steady state; the draining tail compiles its own shapes
            rss.setdefault(done // 2000, _resident_kib())
    compiled = stored.compiled(steps.prefill_step) + stored.compiled(steps.decode_step)
    print(f"soak: peak live requests {peak_live}, compiled steps {compiled}, "
          f"resident {rss[0] // 1024} -> {rss[max(rss)] // 1024} MiB")
    assert not engine.table.requests and peak_live <= 16 * 3 + 32 * 3
    assert compiled <= 40, compiled
    assert rss[max(rss)] - rss[2] < 64 * 1024, rss  # KiB: flat after the first 4,000
    engine.clear_prefix_cache()
    assert int(engine.cache.free_pages()) == 48
