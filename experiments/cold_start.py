"""A user's first call in a new process: with JAX's persistent compilation cache empty, with it
populated by an earlier process, and the same call again in a warm process.

    python -m experiments.cold_start            # the default model: generate and score
    python -m experiments.cold_start --quick    # fewer, shorter requests

Each process runs in a fresh interpreter with its own cache folder (``PAXKV_COMPILE_CACHE``,
:mod:`paxkv.core.compiles`; ``JAX_COMPILATION_CACHE_DIR`` unset), loads the default model
(untimed), then times one call twice: the first pays the compiles, the second is warm. The
first process meets an empty folder; ``--repeats`` more processes (3) meet what it wrote. A
call's time moves 10-20% from one call to the next on these cores, so the populated first
call is compared with the warm second call of the same process, and the median of those
paired ratios is reported (with the median seconds of each). Calls:

* ``generate``: prompts of real English prose (``pydoc_data.topics``), greedy, EOS ignored;
* ``score``: (context, continuation) pairs of the same prose, two continuations a context.

Reported per call and process: wall seconds, XLA compiles, persistent-cache loads, seconds
compiling or loading (``stats().compiles``); the first call against the warm one; tokens and
log-likelihoods equal in every variant (tokens exactly; log-likelihoods within
:data:`LL_TOLERANCE`: a warm call may run its steps in other compiled shapes, padded
differently, :mod:`paxkv.scoring.shapes`). Writes ``results/cold_start.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from experiments import common

LL_TOLERANCE = 1e-4  # summed continuation log-likelihoods, float32 steps


def child(args: Any) -> dict[str, Any]:
    """One process: the model, then each call twice (run with ``--child``)."""
    import paxkv
    from paxkv import models

    lm = models.load()
    prompts = common.english_prompts(lm, args.prompts, args.lo, args.hi, seed=5)
    pairs = [(tuple(p[:-k]), tuple(p[-k:])) for p in prompts for k in (3, 7)]
    out: dict[str, Any] = {}
    for name in ("generate", "score"):
        runs = []
        for _ in range(2):
            start = time.perf_counter()
            if name == "generate":
                engine = paxkv.Engine(lm, max_seqs=args.prompts, max_len=args.hi + args.new)
                ids = [engine.submit(p, max_new_tokens=args.new, stop_token_ids=[])
                       for p in prompts]
                done = engine.run()
                answer = [done[i].token_ids for i in ids]
                stats = engine.stats().compiles
            else:
                scorer = paxkv.scoring.scorer_for(lm, pairs)
                answer = [r.logprob for r in scorer.score(pairs)]
                stats = scorer.stats.compiles
            runs.append(dict(seconds=time.perf_counter() - start, compiles=stats.compiles,
                             loads=stats.cache_loads, compile_s=stats.compile_seconds,
                             answer=answer))
        out[name] = runs
    return out


def spawn(folder: str, argv: list[str]) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["PAXKV_COMPILE_CACHE"] = folder
    done = subprocess.run([sys.executable, "-m", "experiments.cold_start", "--child", *argv],
                          env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--child", action="store_true", help=argparse_hidden())
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--lo", type=int, default=None)
    ap.add_argument("--hi", type=int, default=None)
    ap.add_argument("--new", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None,
                    help="processes that meet the populated cache (3; --quick 1)")
    args = common.fill_defaults(ap.parse_args(),
                                quick=dict(prompts=4, lo=40, hi=80, new=8, repeats=1),
                                full=dict(prompts=16, lo=100, hi=300, new=32, repeats=3))
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: at least 1 process must meet the populated cache")
    if args.child:
        print(json.dumps(child(args)))
        return
    argv = [f"--{k}={getattr(args, k)}" for k in ("prompts", "lo", "hi", "new")]
    with tempfile.TemporaryDirectory() as folder:
        empty = spawn(folder, argv)
        populated = [spawn(folder, argv) for _ in range(args.repeats)]
    rows, table, equal, worst = [], [], True, 0.0
    for call in ("generate", "score"):
        firsts = [p[call][0] for p in populated]
        seconds = [p[call][1] for p in populated]
        median = lambda runs, key: float(np.median([r[key] for r in runs]))  # noqa: E731
        paired = float(np.median([b["seconds"] / a["seconds"] for a, b in zip(firsts, seconds)]))
        warm_s = median(seconds, "seconds")
        for label, runs in (("new process, empty cache", [empty[call][0]]),
                            ("new process, cache populated", firsts),
                            ("warm (second call)", seconds)):
            for run in runs:
                if call == "generate":
                    equal &= run["answer"] == empty[call][0]["answer"]
                else:
                    diff = max(abs(a - b) for a, b in zip(run["answer"], empty[call][0]["answer"]))
                    worst = max(worst, diff)
                    equal &= diff <= LL_TOLERANCE
            wall = median(runs, "seconds")
            speed = paired if label == "new process, cache populated" else warm_s / wall
            rows.append(dict(call=call, variant=label, processes=len(runs), seconds=wall,
                             each_s=[r["seconds"] for r in runs], warm_vs_this=speed,
                             compiles=median(runs, "compiles"), loads=median(runs, "loads"),
                             compile_s=median(runs, "compile_s")))
            table.append([call, label, str(len(runs)), f"{wall:.2f}",
                          f"{median(runs, 'compiles'):.0f}", f"{median(runs, 'loads'):.0f}",
                          f"{median(runs, 'compile_s'):.2f}", f"{speed:.2f}"])
    common.print_table(["call", "process", "processes", "median wall s", "compiles",
                        "cache loads", "compile / load s", "warm / this (speed)"], table)
    print("populated: the median over its processes of (second call / first call), each pair "
          "from one process; empty: the median warm call / its first call")
    print(f"answers equal in every variant: {equal} (log-likelihoods within {worst:.1e})")
    common.finish(common.result_name("cold_start", args.quick),
                  common.record(vars(args), dict(rows=rows, answers_equal=equal, max_ll_diff=worst)), equal)


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
