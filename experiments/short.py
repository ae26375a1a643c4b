"""Short requests: the per-step price of paging when there is nothing to save.

    python -m experiments.short              # batch 1, 8, 64
    python -m experiments.short --quick      # batch 8 only, 3 repeats

Every row holds a 1-5 token prompt (random, seed 0) and decodes 5 more tokens, so contexts stay
at 1-10 tokens: the paged cache has no memory to win and only its bookkeeping to pay. Both
caches read a 64-token window (the engine's smallest context bucket: every step's attention
plan is ``AttentionPlan(window=64)``), through the XLA path. Per batch, one start
cache per kind is built (prompts fed by ``decode_step``); every repeat decodes from a fresh copy
of it, and the repeats alternate the order paged/dense (A/B, B/A, ...). Timed pieces, each
jitted on its own, blocked until ready, medians over every timed step:

* ``full``: ``steps.decode_step`` (reserve + 30 layers + sampling, cache donated);
* ``reserve``: the cache's ``reserve`` (paged: ``page_table.reserve`` + ``pool.apply``, i.e.
  scrubbing fresh pages and the copy-on-write copies, each skipped by a ``lax.cond`` when
  there is nothing to do); paged only: ``table`` = ``page_table.reserve`` alone and
  ``noscrub`` = reserve with ``pool.apply(scrub=False)``;
* ``attention``: ``cache.attend`` for every layer (K/V write + page gather + the reference
  ``attend_blocks``) in a ``fori_loop`` with the cache in the carry, as the model runs it;
* ``rest`` = full - reserve - attention (matmuls, norms, sampling, dispatch).

Correctness: the greedy tokens of the paged and dense ``full`` steps must be identical.
Target: paged full step <= 1.05 x dense. Writes ``results/short.json`` (``short_quick.json``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paxkv import models
from experiments.common import clock, finish, parser, print_table, provenance, record, result_name
from paxkv.cache import dense as dense_cache
from paxkv.table import page_table as pt
from paxkv.cache import paged as paged_cache
from paxkv.cache import pool as kv_pool
from paxkv.core import steps
from paxkv.core.plan import AttentionPlan
from paxkv.core.step_info import StepInfo

KINDS = ("paged", "dense")
TARGET_RATIO = 1.05
WINDOW = 64
PLAN = AttentionPlan(window=WINDOW)  # checked in every step (a longer row: whole rows read)


@functools.partial(jax.jit, donate_argnames=("cache",))
def _reserve_cache(cache: Any, live: jax.Array) -> tuple[Any, jax.Array]:
    return cache.reserve(live.astype(jnp.int32), max_new=1)


@jax.jit
def _reserve_table(table: pt.PageTable, live: jax.Array) -> tuple[Any, Any, jax.Array]:
    return pt.reserve(table, live.astype(jnp.int32), max_new=1)


@functools.partial(jax.jit, donate_argnames=("cache",))
def _reserve_noscrub(cache: Any, live: jax.Array) -> tuple[Any, jax.Array]:
    """The paged reserve with ``pool.apply(scrub=False)``: table + copy-on-write copies."""
    table, update, ok = pt.reserve(cache.table, live.astype(jnp.int32), max_new=1)
    pool = kv_pool.apply(cache.pool, update, scrub=False)
    return dataclasses.replace(cache, pool=pool, table=table), ok


@functools.partial(jax.jit, static_argnames=("num_layers",), donate_argnames=("cache",))
def _attend_all(cache: Any, q: jax.Array, k: jax.Array, v: jax.Array, *,
                num_layers: int) -> tuple[Any, jax.Array]:
    """Every layer's ``cache.attend`` for one decode token per row (the last held slot is
    rewritten, so the cache keeps its shape and lengths: every call does the same work)."""
    lengths = cache.lengths
    step = StepInfo.make(lengths, (lengths > 0).astype(jnp.int32), 1, plan=PLAN)

    def body(layer, carry):
        cache, acc = carry
        cache, out = cache.attend(layer, q, k, v, step)
        return cache, acc + out

    return jax.lax.fori_loop(0, num_layers, body, (cache, jnp.zeros_like(q)))


def make_cache(lm: Any, kind: str, batch: int, max_len: int, page_size: int) -> Any:
    cfg = lm.config
    dims = dict(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                max_seqs=batch, max_len=max_len)
    if kind == "paged":
        return paged_cache.create(num_pages=batch * -(-max_len // page_size),
                                  page_size=page_size, attention_impl="xla", **dims)
    return dense_cache.create(**dims)


def fill_prompts(lm: Any, cache: Any, prompts: list[list[int]]) -> tuple[Any, jax.Array]:
    """Feeds each row its prompt through ``decode_step`` (one token per step; a row is live
    while it has prompt left); returns the cache and each row's first sampled token."""
    width = max(map(len, prompts))
    grid = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        grid[i, : len(p)] = p
    lens = np.array([len(p) for p in prompts])
    nxt = np.zeros(len(prompts), np.int32)
    for t in range(width):
        live = jnp.asarray(t < lens)
        cache, out, _, _ = steps.decode_step(lm.forward, lm.params, cache,
                                             jnp.asarray(grid[:, t]), live, None, plan=PLAN)
        nxt = np.where(t == lens - 1, np.asarray(out), nxt)
    return cache, jnp.asarray(nxt)


def _copy(tree: Any) -> Any:
    return jax.block_until_ready(jax.tree.map(lambda x: x.copy(), tree))


def interleaved_repeat(lm: Any, starts: dict[str, tuple[Any, jax.Array]], live: jax.Array,
                       qkv: tuple[jax.Array, ...], out_len: int, sink: dict, rep: int
                       ) -> dict[str, np.ndarray]:
    """``out_len`` steps of each piece from fresh copies of the start caches, alternating
    paged/dense step by step (the order flips every step and every repeat). Appends
    ``(wall, cpu)`` to ``sink[kind][piece]``; returns each kind's full-step greedy tokens."""
    decode = functools.partial(steps.decode_step, lm.forward, lm.params, plan=PLAN)
    attend = functools.partial(_attend_all, num_layers=lm.config.num_layers)
    orders = [KINDS if (s + rep) % 2 else KINDS[::-1] for s in range(out_len)]
    state = {k: (_copy(starts[k][0]), starts[k][1]) for k in KINDS}
    tokens: dict[str, list] = {k: [] for k in KINDS}
    for order in orders:
        for kind in order:
            w, c, (cache, tok, _, _) = clock(decode, *state[kind], live, None)
            state[kind] = (cache, tok)
            sink[kind]["full"].append((w, c))
            tokens[kind].append(np.asarray(tok))
    for piece, fn, extra in (("reserve", _reserve_cache, (live,)), ("attention", attend, qkv)):
        caches = {k: _copy(starts[k][0]) for k in KINDS}
        for order in orders:
            for kind in order:
                w, c, (caches[kind], _) = clock(fn, caches[kind], *extra)
                sink[kind][piece].append((w, c))
        del caches
    for _ in orders:
        w, c, _ = clock(_reserve_table, starts["paged"][0].table, live)
        sink["paged"]["table"].append((w, c))
    cache = _copy(starts["paged"][0])
    for _ in orders:
        w, c, (cache, _) = clock(_reserve_noscrub, cache, live)
        sink["paged"]["noscrub"].append((w, c))
    del cache
    return {k: np.stack(v) for k, v in tokens.items()}


def xla_cost(lm: Any, start: tuple[Any, jax.Array], live: jax.Array) -> dict[str, float]:
    """XLA's static cost estimate of the compiled decode step (load-independent evidence)."""
    lowered = steps.decode_step.lower(lm.forward, lm.params, start[0], start[1], live, None,
                                      plan=PLAN)
    cost = lowered.compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return {"flops": float(cost.get("flops", 0)),
            "bytes_accessed": float(cost.get("bytes accessed", 0))}


def _medians(samples: dict[str, list], which: int) -> dict[str, float]:
    return {k: 1e3 * float(np.median([x[which] for x in v])) for k, v in samples.items() if v}


def measure(lm: Any, batch: int, *, max_len: int = 256, page_size: int = 16, reps: int = 5,
            out_len: int = 5, seed: int = 0, cost: bool = True) -> dict[str, Any]:
    """Interleaved A/B timing of paged vs dense at one batch; medians in ms per step."""
    rng = np.random.default_rng(seed)
    cfg = lm.config
    prompts = [rng.integers(0, cfg.vocab_size, rng.integers(1, 6)).tolist()
               for _ in range(batch)]
    live = jnp.ones((batch,), bool)
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    qkv = tuple(jax.random.normal(key, (batch, 1, heads, cfg.head_dim))
                for key, heads in zip(keys, (cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads)))
    starts = {kind: fill_prompts(lm, make_cache(lm, kind, batch, max_len, page_size), prompts)
              for kind in KINDS}
    times = {kind: {k: [] for k in ("full", "reserve", "table", "noscrub", "attention")}
             for kind in KINDS}
    for rep in range(reps + 1):  # repeat 0 is the warm-up
        sink = {kind: {k: [] for k in times[kind]} for kind in KINDS} if rep == 0 else times
        tokens = interleaved_repeat(lm, starts, live, qkv, out_len, sink, rep)
    out: dict[str, Any] = dict(batch=batch, samples=len(times["paged"]["full"]),
                               prompt_lengths=[len(p) for p in prompts])
    for timer, which in (("wall", 0), ("cpu", 1)):
        ms = {kind: _medians(times[kind], which) for kind in KINDS}
        for kind in KINDS:
            ms[kind]["rest"] = ms[kind]["full"] - ms[kind]["reserve"] - ms[kind]["attention"]
        out[f"{timer}_ms"] = ms
        out[f"{timer}_ratio"] = ms["paged"]["full"] / ms["dense"]["full"]
    out["wall_min_ratio"] = (min(w for w, _ in times["paged"]["full"])
                             / min(w for w, _ in times["dense"]["full"]))
    out["tokens_identical"] = bool(np.array_equal(tokens["paged"], tokens["dense"]))
    if cost:
        out["xla_cost"] = {kind: xla_cost(lm, starts[kind], live) for kind in KINDS}
    out["raw_ms"] = {kind: {k: [[1e3 * w, 1e3 * c] for w, c in v] for k, v in t.items()}
                     for kind, t in times.items()}
    return out


def report(results: list[dict[str, Any]]) -> None:
    for timer in ("wall", "cpu"):
        rows = []
        for r in results:
            p, d = r[f"{timer}_ms"]["paged"], r[f"{timer}_ms"]["dense"]
            ratio = r[f"{timer}_ratio"]
            rows.append([r["batch"], f"{p['full']:.1f}", f"{d['full']:.1f}", f"{ratio:.3f}",
                         f"{p['table']:.2f}", f"{p['reserve']:.2f}", f"{d['reserve']:.2f}",
                         f"{p['attention']:.1f}", f"{d['attention']:.1f}", f"{p['rest']:.1f}",
                         f"{d['rest']:.1f}",
                         "yes" if r["tokens_identical"] else "NO",
                         "met" if ratio <= TARGET_RATIO else "NOT met"])
        print(f"\n{timer} time, median ms per step")
        print_table(["batch", "paged step", "dense step", "paged/dense", "paged table",
                     "paged reserve", "dense reserve", "paged attn", "dense attn",
                     "paged rest", "dense rest", "same tokens",
                     f"target <= {TARGET_RATIO:.2f}"], rows)
    rows = []
    for r in results:
        for timer in ("cpu", "wall"):
            p = r[f"{timer}_ms"]["paged"]
            rows.append([r["batch"], timer, f"{p['table']:.2f}", f"{p['noscrub']:.2f}",
                         f"{p['reserve']:.2f}",
                         f"{100 * (p['reserve'] - p['table']) / p['full']:.1f}%"])
    print("\npaged reserve, median ms: page table only / + copy-on-write copies (scrub=False) / "
          "+ scrub (as run)")
    print_table(["batch", "clock", "table", "table + copies", "table + copies + scrub",
                 "pool update / paged step"], rows)


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, quick="batch 8 only, 3 repeats")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--reps", type=int, default=5, help="timed repeats (each both kinds)")
    ap.add_argument("--out-len", type=int, default=5, help="decode steps per repeat")
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--no-cost", action="store_true", help="skip XLA's cost analysis")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.quick:
        args.batches, args.reps = "8", 3
    started = provenance()
    lm = models.load()
    print(f"{lm.name}: prompts 1-5 tokens, {args.out_len} decode steps per repeat, "
          f"{args.reps} repeats, paged/dense alternating step by step, window {WINDOW}")
    results = [measure(lm, int(b), max_len=args.max_len, page_size=args.page_size,
                       reps=args.reps, out_len=args.out_len, seed=args.seed,
                       cost=not args.no_cost)
               for b in args.batches.split(",")]
    report(results)
    ok = all(r["tokens_identical"] for r in results)
    finish(result_name("short", args.quick),
           record(dict(vars(args), model=lm.name, **started),
                  dict(batches=results, target_ratio=TARGET_RATIO, outputs_identical=ok)),
           ok, "paged and dense tokens disagree: no figure stands")


if __name__ == "__main__":
    main()
