"""Capacity at a fixed KV budget: paged vs dense-at-max_len vs dense-at-exact-length.

    python -m experiments.capacity            # max_len 2048, page 16, 96 requests (long)
    python -m experiments.capacity --quick    # a smoke run (< 2 min): max_len 256, page 4

**Budget**: ``--budget-seqs x max_len`` KV slots (default 3: a dense cache at ``max_len`` holds
exactly 3 sequences, the seed scenario scaled down). **Stream**: ``--requests`` requests, all
queued at step 0; prompt and output lengths are lognormal (seed 0)::

    prompt = clip(round(lognormal(ln(prompt_median), prompt_sigma)), 1, max_len - 1)
    output = clip(round(lognormal(ln(output_median), output_sigma)), 1, max_len - prompt)

prompts are consecutive slices of ``pydoc_data.topics`` (CPython's Language Reference prose);
decoding is greedy with EOS ignored, so each request makes exactly ``output`` tokens.

**Systems** (each in its own engine, same stream, same model, one run):

* ``paged``: ``Engine(cache="paged", num_pages=budget / page_size, max_seqs=--paged-rows,
  prefix_cache=False)`` (the prompts share nothing; cached pages would blur the accounting).
* ``dense_max_len``: ``Engine(cache="dense", max_seqs=budget_seqs)``: every row reserves
  ``max_len`` slots.
* ``dense_exact``: the vLLM paper's oracle: each request reserves exactly ``prompt + output``
  contiguous slots of one arena of ``budget`` slots (first fit, FIFO, no skipping). The arena
  decides admission and is what the memory figures count; the tokens are computed by a paged
  engine with one spare page per row, so its own page rounding never binds (checked: it must
  report 0 preemptions), and without the engine's growth projection
  (``growth=Growth(start=0, floor=0)``: the arena alone decides admission; ``dense_max_len``'s
  driver too). ``paged`` admits by the engine's own policy.

**Accounting** (after every ``engine.step()``, outside the timed region), in KV slots:

* reserved: locked to running sequences (paged: pages in use x page_size; dense: rows x
  max_len; exact: arena blocks). filled: slots holding a token's K/V.
* waste = (reserved - filled) / reserved = internal + future, where *internal* is reserved
  room the request will never fill (paged: the empty tail of each last page; dense:
  ``max_len - prompt - output``) and *future* is room held now for tokens not yet generated
  (dense rows and exact blocks). *external* = free slots the queue head cannot use because no
  contiguous hole is big enough (exact only: pages and dense rows are interchangeable), as a
  share of the budget.
* steady state = the steps while requests are queued (the budget is the bottleneck); the
  ``*_steady`` figures are medians over them.

Throughput = output tokens / (sum of ``step()`` wall times - compile time inside them, from
``jax.monitoring``), and per CPU-second of this process (``time.process_time``, which other
tenants of a shared machine inflate far less); a warm-up run of the first ``--warmup``
requests precedes each system. The series also records each step's wall and CPU seconds and
the attention window (tokens read per row: the window of the step's last attention plan).
The greedy tokens of every system are compared with the others' (no figure stands for a wrong
answer). Writes ``results/capacity.json`` (``capacity_quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
from typing import Any

import jax
import numpy as np

from paxkv import models
import paxkv
from experiments.accounting import (Arena, CompileClock, arena_page_map, dense_page_map,
                                    paged_page_map)
from experiments.common import (clock, finish, parser, print_table, prose_tokens, provenance,
                                record, result_name)
from paxkv.table import page_table as pt
from paxkv.engine import policy

SYSTEMS = ("paged", "dense_max_len", "dense_exact")
TARGETS = dict(concurrency_x=10.0, waste_pct=4.0)
_stats = jax.jit(pt.stats)


@dataclasses.dataclass(frozen=True)
class Config:
    max_len: int = 2048
    page_size: int = 16
    budget_seqs: int = 3
    paged_rows: int = 48
    warmup: int = 4
    prefill_chunk: int = 512

    @property
    def budget_slots(self) -> int:
        return self.budget_seqs * self.max_len


# -- the stream ----------------------------------------------------------------------------------
def sample_lengths(n: int, max_len: int, *, prompt_median: float, prompt_sigma: float,
                   output_median: float, output_sigma: float, seed: int = 0) -> np.ndarray:
    """int ``[n, 2]``: (prompt, output) lengths, lognormal, capped so the sum <= max_len."""
    rng = np.random.default_rng(seed)
    prompt = np.clip(np.rint(rng.lognormal(np.log(prompt_median), prompt_sigma, n)), 1,
                     max_len - 1).astype(int)
    output = np.clip(np.rint(rng.lognormal(np.log(output_median), output_sigma, n)), 1,
                     max_len - prompt).astype(int)
    return np.stack([prompt, output], axis=1)


def make_requests(lm: Any, lengths: np.ndarray) -> list[tuple[list[int], int]]:
    """``(prompt_ids, max_new_tokens)`` per row of ``lengths``: consecutive slices of the
    pydoc topics token stream (:func:`experiments.common.prose_tokens`; ids folded into the
    model's vocabulary)."""
    stream = prose_tokens(lm, int(lengths[:, 0].sum()))
    vocab = lm.config.vocab_size
    ends = np.cumsum(lengths[:, 0])
    return [([t % vocab for t in stream[e - p: e]], int(o))
            for e, (p, o) in zip(ends, lengths)]


# -- one system working through the stream -------------------------------------------------------
def make_engine(lm: Any, system: str, cfg: Config) -> paxkv.Engine:
    pages = cfg.budget_slots // cfg.page_size
    fits_now = policy.Growth(start=0.0, floor=0.0)  # the driver decides admission
    if system == "dense_max_len":
        return paxkv.Engine(lm, cache="dense", max_seqs=cfg.budget_seqs, max_len=cfg.max_len,
                            prefill_chunk=cfg.prefill_chunk, growth=fits_now)
    exact = system == "dense_exact"
    spare = cfg.paged_rows if exact else 0  # the oracle's rounding room
    return paxkv.Engine(lm, cache="paged", max_seqs=cfg.paged_rows, max_len=cfg.max_len,
                        page_size=cfg.page_size, num_pages=pages + spare,
                        prefill_chunk=cfg.prefill_chunk, prefix_cache=False,
                        growth=fits_now if exact else None)


class Driver:
    """Feeds one engine the stream under one system's admission rule and reads its memory.

    paged submits everything at once (the engine admits while pages allow); dense_max_len
    submits while a row is free (what the engine would admit); dense_exact submits while the
    arena has a contiguous ``prompt + output`` hole for the queue head.
    """

    def __init__(self, lm: Any, system: str, cfg: Config, requests: list[tuple[list[int], int]]):
        self.system, self.cfg, self.requests = system, cfg, requests
        self.engine = make_engine(lm, system, cfg)
        self.pending = collections.deque(range(len(requests)))
        self.inflight: dict[int, int] = {}  # request index -> engine request id
        self.outputs: dict[int, list[int]] = {}
        self.arena = Arena(cfg.budget_slots)

    def total(self, i: int) -> int:
        return len(self.requests[i][0]) + self.requests[i][1]

    def admit(self) -> None:
        rows = self.cfg.budget_seqs if self.system == "dense_max_len" else self.cfg.paged_rows
        while self.pending and (self.system == "paged" or len(self.inflight) < rows):
            i = self.pending[0]
            if self.system == "dense_exact" and not self.arena.alloc(i, self.total(i)):
                break
            self.pending.popleft()
            prompt, new = self.requests[i]
            self.inflight[i] = self.engine.submit(prompt, max_new_tokens=new, stop_token_ids=[])

    def poll(self, finished: dict[int, paxkv.GenerationResult]) -> None:
        """Takes the requests a step handed out (``StepOutput.finished``)."""
        for i, rid in list(self.inflight.items()):
            if rid in finished:
                self.outputs[i] = finished[rid].token_ids
                del self.inflight[i]
                if self.system == "dense_exact":
                    self.arena.free(i)

    def sample(self) -> dict[str, float]:
        """Memory accounting of the cache right now (slots; see the module docstring)."""
        cache, cfg = self.engine.cache, self.cfg
        if self.system == "paged":
            st = _stats(cache.table)
            running, filled = int(st.active_seqs), int(st.slots_filled)
            reserved = int(st.used_pages) * cfg.page_size
            internal, future, external = reserved - filled, 0, 0
        else:
            table = getattr(cache, "table", cache)
            running = int(np.asarray(table.active).sum())
            filled = int(np.asarray(table.lengths).sum())
            final = sum(self.total(i) for i in self.inflight)  # all in flight are running
            if self.system == "dense_max_len":
                reserved = running * cfg.max_len
                internal, future, external = reserved - final, final - filled, 0
            else:
                reserved = self.arena.used
                internal, future, external = 0, reserved - filled, self._stranded()
        pct = lambda x: 100.0 * x / max(reserved, 1)  # noqa: E731
        queued = len(self.pending) + len(self.inflight) - running
        plan = self.engine.scheduler.last_plan
        window = None if plan is None else (plan.window or cache.max_len)
        return dict(running=running, queued=queued, reserved=reserved, filled=filled,
                    window=window,
                    waste_pct=pct(reserved - filled), internal_pct=pct(internal),
                    future_pct=pct(future), external_pct=100.0 * external / cfg.budget_slots)

    def _stranded(self) -> int:
        """Free arena slots the queue head cannot use only because they are not contiguous."""
        if not self.pending or len(self.inflight) >= self.cfg.paged_rows:
            return 0
        need, holes = self.total(self.pending[0]), [n for _, n in self.arena.holes()]
        return sum(holes) if max(holes, default=0) < need <= sum(holes) else 0

    def page_map(self) -> dict[str, Any]:
        """The pool now, one cell per page: owner (-1 free), slots filled, shared."""
        cache, ps = self.engine.cache, self.cfg.page_size
        if self.system == "paged":
            return paged_page_map(cache.table)
        if self.system == "dense_max_len":
            return dense_page_map(np.asarray(cache.lengths), np.asarray(cache.active),
                                  self.cfg.max_len, ps)
        held = {i: len(self.requests[i][0]) + len(self.engine.result(rid).token_ids) - 1
                for i, rid in self.inflight.items()}
        return arena_page_map(self.arena, held, ps)


def run_system(lm: Any, system: str, cfg: Config,
               requests: list[tuple[list[int], int]]) -> dict[str, Any]:
    """Drives one system through ``requests``; returns its summary, time series, page map at
    peak, and ``outputs`` (token ids per request)."""
    drv = Driver(lm, system, cfg, requests)
    series: dict[str, list] = collections.defaultdict(list)
    busy = cpu = compiling = 0.0
    peak, page_map = -1, None
    with CompileClock() as compile_clock:
        while drv.pending or drv.inflight:
            drv.admit()
            c0 = compile_clock.total
            wall, spent, out = clock(drv.engine.step)
            compiled = compile_clock.total - c0
            busy, cpu, compiling = busy + wall, cpu + spent, compiling + compiled
            drv.poll(out.finished)
            s = drv.sample()
            s.update(t=busy - compiling, step_s=wall - compiled, cpu_s=max(spent - compiled, 0.0))
            for k, v in s.items():
                series[k].append(v)
            if s["running"] > peak:
                peak, page_map = s["running"], dict(drv.page_map(), step=len(series["t"]) - 1)
    return summarize(drv, dict(series), busy, cpu, compiling, page_map)


def summarize(drv: Driver, series: dict[str, list], busy: float, cpu: float, compiling: float,
              page_map: dict[str, Any] | None) -> dict[str, Any]:
    """The figures of one system's run (medians over the steady state)."""
    q = np.asarray(series["queued"])
    steady = np.flatnonzero(q > 0)
    if steady.size == 0:
        steady = np.flatnonzero(np.asarray(series["running"]) > 0)
    if steady.size == 0:
        steady = np.arange(len(q))
    med = lambda k: float(np.median(np.asarray(series[k])[steady]))  # noqa: E731
    out_tokens = sum(len(t) for t in drv.outputs.values())
    stats, table = drv.engine.stats(), getattr(drv.engine.cache, "table", None)
    leaked = 0 if table is None else int(table.num_pages - int(_stats(table).free_pages))
    return dict(
        peak_running=int(max(series["running"])), engine_peak_running=stats.peak_running,
        mean_running_steady=float(np.mean(np.asarray(series["running"])[steady])),
        mean_queued=float(q.mean()), steps=len(q), steady_steps=int(steady.size),
        output_tokens=out_tokens, timed_s=busy - compiling, compile_s_excluded=compiling,
        throughput_tok_s=out_tokens / max(busy - compiling, 1e-9),
        throughput_tok_per_cpu_s=out_tokens / max(cpu - compiling, 1e-9),
        median_step_s=float(np.median(series["step_s"])),
        prefill_tokens=stats.prefill_tokens,
        waste_pct_steady=med("waste_pct"), internal_pct_steady=med("internal_pct"),
        future_pct_steady=med("future_pct"), external_pct_steady=med("external_pct"),
        preemptions=stats.preemptions, pages_leaked=leaked,
        series=series, page_map=page_map, outputs=drv.outputs)


def compare(ours: dict[int, list[int]], ref: dict[int, list[int]], ref_name: str) -> dict:
    """Same greedy tokens for every request both completed?"""
    both = sorted(set(ours) & set(ref))
    bad = [i for i in both if ours[i] != ref[i]]
    first = None
    if bad:
        a, b = ours[bad[0]], ref[bad[0]]
        first = dict(request=bad[0], position=next((k for k, (x, y) in enumerate(zip(a, b))
                                                    if x != y), min(len(a), len(b))))
    return dict(reference=ref_name, compared=len(both), identical=len(both) - len(bad),
                all_identical=not bad, mismatched=bad, first_mismatch=first)


def measure(lm: Any, cfg: Config, requests: list[tuple[list[int], int]],
            systems: tuple[str, ...] = SYSTEMS) -> dict[str, dict[str, Any]]:
    """Every system through the same stream (after a warm-up on its first requests), each
    record carrying the token check against the others."""
    results = {}
    for system in systems:
        if cfg.warmup:
            run_system(lm, system, cfg, requests[: cfg.warmup])
        results[system] = run_system(lm, system, cfg, requests)
        r = results[system]
        print(f"  {system}: {r['steps']} steps, {r['timed_s']:.0f} s timed "
              f"(+{r['compile_s_excluded']:.0f} s compiling)", flush=True)
    for system in systems:
        ref = "dense_max_len" if system != "dense_max_len" else "paged"
        if ref in results:
            results[system]["check"] = compare(results[system]["outputs"],
                                               results[ref]["outputs"], ref)
    return results


# -- the command ---------------------------------------------------------------------------------
QUICK = dict(max_len=64, page_size=4, paged_rows=16, requests=24, prompt_median=6,
             output_median=6, warmup=1, prefill_chunk=16)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = parser(__doc__, quick="small smoke run: " + str(QUICK))
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--budget-seqs", type=int, default=3,
                    help="KV budget = this many sequences of max_len (the dense capacity)")
    ap.add_argument("--paged-rows", type=int, default=48, help="rows of the paged engines")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--prompt-median", type=float, default=96)
    ap.add_argument("--prompt-sigma", type=float, default=1.0)
    ap.add_argument("--output-median", type=float, default=48)
    ap.add_argument("--output-sigma", type=float, default=1.0)
    ap.add_argument("--warmup", type=int, default=4, help="requests in each warm-up run")
    ap.add_argument("--prefill-chunk", type=int, default=512,
                    help="the engine's longest prompt chunk (fewer compiled shapes when small)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    args = ap.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            if ap.get_default(k) == getattr(args, k):
                setattr(args, k, v)
    if (args.budget_seqs * args.max_len) % args.page_size:
        ap.error("the budget (budget_seqs x max_len) must be a whole number of pages")
    return args


def report(results: dict[str, dict[str, Any]], cfg: Config) -> dict[str, Any]:
    """Prints the table and the targets; returns the target verdicts."""
    base = results.get("dense_max_len", {}).get("peak_running", cfg.budget_seqs)
    rows = []
    for name, r in results.items():
        check = r.get("check", {})
        rows.append([name, r["peak_running"], f"{r['peak_running'] / base:.1f}x",
                     f"{r['mean_running_steady']:.1f}", f"{r['mean_queued']:.1f}", r["steps"],
                     f"{r['throughput_tok_s']:.1f}", f"{r['throughput_tok_per_cpu_s']:.1f}",
                     f"{r['waste_pct_steady']:.1f}",
                     f"{r['internal_pct_steady']:.1f}", f"{r['future_pct_steady']:.1f}",
                     f"{r['external_pct_steady']:.1f}", r["preemptions"], r["pages_leaked"],
                     f"{check.get('identical', '-')}/{check.get('compared', '-')} "
                     f"vs {check.get('reference', '-')}"])
    print_table(["system", "peak seqs", "vs dense", "seqs (steady)", "queued (mean)", "steps",
                 "out tok/s", "out tok/cpu-s", "waste % (steady)", "internal %", "future %",
                 "external %", "preempt", "leaked pages", "same tokens"], rows)
    verdict = {}
    if "paged" in results:
        paged = results["paged"]
        x = paged["peak_running"] / base
        verdict = dict(concurrency_x=x, concurrency_ok=x >= TARGETS["concurrency_x"],
                       waste_pct=paged["waste_pct_steady"],
                       waste_ok=paged["waste_pct_steady"] < TARGETS["waste_pct"])
        print(f"\ntarget: paged peak seqs >= {TARGETS['concurrency_x']:.0f}x dense_max_len: "
              f"{x:.1f}x -> {'met' if verdict['concurrency_ok'] else 'NOT met'}")
        print(f"target: paged waste at steady state < {TARGETS['waste_pct']:.0f}%: "
              f"{paged['waste_pct_steady']:.2f}% -> {'met' if verdict['waste_ok'] else 'NOT met'}")
    return verdict


def run(args: argparse.Namespace, lm: Any) -> dict[str, Any]:
    """Every system on the stream ``args`` describes; prints the table; returns the record."""
    started = provenance()
    cfg = Config(max_len=args.max_len, page_size=args.page_size, budget_seqs=args.budget_seqs,
                 paged_rows=args.paged_rows, warmup=args.warmup,
                 prefill_chunk=args.prefill_chunk)
    lengths = sample_lengths(args.requests, args.max_len, prompt_median=args.prompt_median,
                             prompt_sigma=args.prompt_sigma, output_median=args.output_median,
                             output_sigma=args.output_sigma, seed=args.seed)
    requests = make_requests(lm, lengths)
    print(f"{lm.name}: budget {cfg.budget_slots} slots ({cfg.budget_seqs} x max_len "
          f"{cfg.max_len}; {cfg.budget_slots // cfg.page_size} pages of {cfg.page_size}); "
          f"{len(requests)} requests, prompt {np.median(lengths[:, 0]):.0f} median / "
          f"{lengths[:, 0].max()} max, output {np.median(lengths[:, 1]):.0f} / "
          f"{lengths[:, 1].max()} tokens\n")
    results = measure(lm, cfg, requests, tuple(args.systems.split(",")))
    verdict = report(results, cfg)
    ok = all(r.get("check", {}).get("all_identical", True) for r in results.values())
    for r in results.values():
        r["outputs"] = {str(k): v for k, v in sorted(r["outputs"].items())}
    config = dict(vars(args), budget_slots=cfg.budget_slots, lengths=lengths.tolist(),
                  model=lm.name, **started)
    return record(config, dict(results, targets=dict(TARGETS, **verdict), outputs_identical=ok))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rec = run(args, models.load())
    finish(result_name("capacity", args.quick), rec, rec["results"]["outputs_identical"],
           "the systems' greedy tokens disagree: no figure stands")


if __name__ == "__main__":
    main()
