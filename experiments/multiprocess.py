"""A research decode loop over the sharded cache that runs as one process or as several.

    python -m experiments.multiprocess                      # one process, its devices
    JAX_NUM_CPU_DEVICES=8 python -m experiments.multiprocess --quick
    python -m paxkv.scale.launch --processes 2 --devices 4 -- experiments.multiprocess --quick

The same code either way: :func:`paxkv.scale.distributed.initialize` joins the processes the
launcher started (alone: nothing), the cache lives on a ``(data, 1)`` mesh over every
process's devices (:func:`paxkv.scale.distributed.process_mesh`: each process owns whole data
shards, hence whole rows), and each process

1. reads only its own rows' prompts (here: cut from one seeded list; a real job would read
   its part of a dataset) and feeds them (:func:`paxkv.scale.distributed.feed`) to one
   :func:`paxkv.core.steps.prefill_step` over all ``max_seqs`` rows;
2. decodes ``--steps`` greedy tokens with :func:`paxkv.core.steps.decode_step` (``--loop step``,
   next tokens fed back on device) or :func:`paxkv.core.steps.decode_loop` (``--loop jit``);
3. gathers the tokens (:func:`paxkv.scale.distributed.gather`), reports which pool shards it held
   (``addressable_shards``), releases every row and checks each shard's pool is free.

Then the same processes run :class:`paxkv.Engine` on the same mesh (:func:`engine_run`): every
process builds the same engine and makes the same calls in the same order (requests arriving
between steps, one cancelled, prefix-cache hits, a pool tight enough to preempt). The engine's
decisions are plain Python over the same inputs and the values it reads back from the devices
are gathered (:func:`paxkv.scale.distributed.gather`), so every process decides alike, and each
device holds only its own shard's pages and rows.

Process 0 prints the tokens and writes ``results/multiprocess.json`` under the current
directory (``PAXKV_RESULTS`` for another folder, ``--out`` for a path) and prints where. The
launcher puts the checkout on the processes' path, so this runs from any directory.
Times are of one run on shared CPUs: first calls compile, so they are no speed result.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paxkv.scale import distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(name: str) -> Any:
    """``tiny``: ``tests/tiny.py``'s random Llama (weights N(0, 1): varied greedy tokens);
    ``default``: SmolLM2-135M (:func:`paxkv.models.load`)."""
    if name == "tiny":
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from tiny import tiny_lm  # noqa: PLC0415

        return tiny_lm(scale=1.0)
    from paxkv import models  # noqa: PLC0415

    return models.load()


def prompts(lm: Any, name: str, n: int, lo: int, hi: int) -> list[list[int]]:
    """``n`` prompts of ``lo..hi`` tokens, the same list on every process (seeded)."""
    if name == "tiny":
        rng = np.random.default_rng(0)
        return [rng.integers(8, 256, int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]
    from experiments.common import english_prompts  # noqa: PLC0415

    return english_prompts(lm, n, lo, hi)


def packed(own: list[list[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
    """This process's prompts left-aligned: tokens int32 ``[rows_here, width]``, lengths
    int32 ``[rows_here]``."""
    tokens = np.zeros((len(own), width), np.int32)
    for i, p in enumerate(own):
        tokens[i, :len(p)] = p
    return tokens, np.asarray([len(p) for p in own], np.int32)


def held(cache: Any) -> dict[str, list[int]]:
    """The data shards whose pool and table blocks sit on this process's devices (from
    ``addressable_shards``: only what this process can read)."""
    def shards(x: jax.Array, axis: int) -> list[int]:  # the data shards on ``axis``
        return sorted({(s.index[axis].start or 0) // (x.shape[axis] // cache.num_shards)
                       for s in x.addressable_shards})

    return dict(pool=shards(cache.pools.k, 1), table=shards(cache.tables.block_tables, 0))


def decode(lm: Any, cache: Any, first: jax.Array, live: jax.Array, steps_: int, loop: str,
           mesh: Any) -> tuple[Any, jax.Array, jax.Array]:
    """``steps_`` greedy tokens a row from ``first`` (int32 ``[max_seqs]``, global): ``(cache,
    tokens [max_seqs, steps_], ok [max_seqs])``, all global arrays."""
    from paxkv.core import steps  # noqa: PLC0415

    s = cache.max_seqs
    if loop == "jit":
        limits = jnp.where(live, steps_, 0).astype(jnp.int32)
        stop_ids = distributed.replicated(mesh, np.asarray([-1], np.int32))
        stop_mask = distributed.replicated(mesh, np.zeros((s, 1), bool))
        cache, out, count, dry = steps.decode_loop(
            lm.forward, lm.params, cache, first, limits, stop_ids, stop_mask, None,
            max_new_tokens=steps_)
        return cache, out, (count == limits) & ~dry
    out, ok, nxt = [first], live, first
    for _ in range(steps_ - 1):
        cache, nxt, step_ok, _ = steps.decode_step(lm.forward, lm.params, cache, nxt, ok, None)
        ok = ok & step_ok
        out.append(nxt)
    return cache, jnp.stack(out, axis=1), ok


def engine_run(lm: Any, mesh: Any, args: argparse.Namespace) -> dict[str, Any]:
    """``args.requests`` requests through one :class:`paxkv.Engine` on ``mesh`` (the same calls
    on every process): half share a system prompt (prefix hits), half arrive after two
    steps, one is cancelled mid-run; each shard's pool holds the longest request alone and
    admission does not project growth, so shards preempt. Its tokens, counters and free
    pages (the same on every process)."""
    import paxkv  # noqa: PLC0415
    from paxkv.engine.policy import Growth  # noqa: PLC0415

    data = mesh.shape["data"]
    rows = args.rows_per_shard * data
    rng = np.random.default_rng(1)
    system = rng.integers(8, 256, 2 * args.page_size + 1).tolist()
    work = [((system if i % 2 else []) + rng.integers(8, 256, int(rng.integers(2, 9))).tolist(),
             int(rng.integers(2, args.steps + 1))) for i in range(args.requests)]
    max_len = max(len(p) + n for p, n in work)
    per_row = -(-max_len // args.page_size)
    engine = paxkv.Engine(lm, mesh=mesh, max_seqs=rows, max_len=max_len,
                          page_size=args.page_size, num_pages=data * per_row, prefill_chunk=16,
                          prefill_tokens=64, growth=Growth(start=0, floor=0))
    half = len(work) // 2
    ids = [engine.submit(p, max_new_tokens=n, stop_token_ids=[]) for p, n in work[:half]]
    results: dict[int, Any] = {}
    for _ in range(2):
        results.update(engine.step().finished)
    ids += [engine.submit(p, max_new_tokens=n, stop_token_ids=[]) for p, n in work[half:]]
    results.update(engine.step().finished)
    cancelled = next(i for i in reversed(ids) if i not in results)
    engine.cancel(cancelled)
    while engine.has_work():
        results.update(engine.step().finished)
    engine.clear_prefix_cache()
    stats = engine.stats()
    return dict(tokens=[results[i].token_ids if i in results else None for i in ids],
                prompts=[p for p, _ in work], cancelled=ids.index(cancelled),
                preemptions=stats.preemptions, prefix_hit_tokens=stats.prefix_hit_tokens,
                free_pages=stats.free_pages, num_pages=stats.num_pages,
                held_pool=distributed.all_processes(held(engine.cache)["pool"]).tolist())


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The loop of the module docstring on this process; everything it reports (gathered)."""
    from paxkv.scale import sharded_cache
    from paxkv.core import steps
    from paxkv.scale import tensor_parallel  # noqa: PLC0415

    mesh = distributed.process_mesh()
    data = mesh.shape["data"]
    s = args.rows_per_shard * data
    lm = base = load(args.model)
    all_prompts = prompts(lm, args.model, s, 2, args.prompt_len)
    rows = distributed.local_rows(mesh, s)
    own = [all_prompts[r] for r in rows]  # NOTE: the only prompts this process reads
    width = int(distributed.all_processes(max(map(len, own))).max())  # one shape everywhere
    max_len = width + args.steps
    lm = tensor_parallel.shard_model(lm, mesh)
    cache = sharded_cache.create(
        mesh=mesh, num_layers=lm.num_layers, num_kv_heads=lm.num_kv_heads,
        head_dim=lm.head_dim, page_size=args.page_size, max_len=max_len, max_seqs=s,
        num_pages=s * -(-max_len // args.page_size), fill=float("nan"))
    tokens, lengths = packed(own, width)
    start = time.perf_counter()
    cache, first, ok, _ = steps.prefill_step(
        lm.forward, lm.params, cache, distributed.feed(mesh, tokens, s),
        distributed.feed(mesh, rows, s), distributed.feed(mesh, lengths, s), None)
    prefill_s = time.perf_counter() - start
    cache, out, ok = decode(lm, cache, first, ok, args.steps, args.loop, mesh)
    local = distributed.local_part(out)  # this process's rows, read with no collective
    out, ok = distributed.gather((out, ok))
    decode_s = time.perf_counter() - start - prefill_s
    holding = held(cache)
    release = jax.jit(lambda c, m: c.release(m), donate_argnums=0)
    cache, _ = release(cache, distributed.feed(mesh, np.ones(len(rows), bool), s))
    free = distributed.gather(cache.shard_free_pages())
    engine = engine_run(base, mesh, args) if args.requests else None  # it places the weights
    return dict(
        engine=engine,
        processes=jax.process_count(), devices=jax.device_count(), mesh=[data, 1],
        max_seqs=s, tokens=out.tolist(), ok=ok.tolist(), prompts=all_prompts,
        rows=distributed.all_processes(rows).tolist(),
        local_tokens=distributed.all_processes(local).tolist(),
        held_pool=distributed.all_processes(holding["pool"]).tolist(),
        held_table=distributed.all_processes(holding["table"]).tolist(),
        free_pages=free.tolist(), pages_per_shard=cache.pages_per_shard,
        prefill_s=prefill_s, decode_s=decode_s)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("tiny", "default"), default="default")
    parser.add_argument("--quick", action="store_true", help="the tiny model, 6 steps")
    parser.add_argument("--steps", type=int, default=16, help="tokens per row")
    parser.add_argument("--rows-per-shard", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=24, help="longest prompt")
    parser.add_argument("--page-size", type=int, default=4)
    parser.add_argument("--loop", choices=("step", "jit"), default="step")
    parser.add_argument("--requests", type=int, default=24,
                        help="requests through the Engine after the loop (0: none)")
    parser.add_argument("--out", help="JSON path (default: multiprocess[_quick].json in "
                        "$PAXKV_RESULTS, else in results/ under the current directory)")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.steps, args.prompt_len = "tiny", 6, 11
    distributed.initialize()  # before any device is touched
    jax.config.update("jax_default_matmul_precision", "highest")
    results = run(args)
    if jax.process_index() != 0:
        return
    from experiments.common import record  # noqa: PLC0415

    for row, toks in enumerate(results["tokens"]):
        print(f"row {row:2d}: {toks}")
    print(f"{results['processes']} process(es), {results['devices']} devices; pool shards "
          f"held per process: {results['held_pool']}; free pages per shard at the end: "
          f"{results['free_pages']}")
    engine = results["engine"]
    if engine:
        for i, toks in enumerate(engine["tokens"]):
            print(f"engine request {i:2d}: {toks}")
        print(f"engine: {engine['preemptions']} preemption(s), {engine['prefix_hit_tokens']} "
              f"prefix-hit tokens, request {engine['cancelled']} cancelled, "
              f"{engine['free_pages']} of {engine['num_pages']} pages free at the end")
    path = output_path(args)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record(vars(args), results), f, indent=2, default=str)
    print(f"\nwrote {path}")


def output_path(args: argparse.Namespace) -> str:
    """Where process 0 writes, as an absolute path (the message names it whatever the working
    directory): ``--out``, else ``multiprocess[_quick].json`` in ``$PAXKV_RESULTS``, default
    ``results/`` under the current directory (the checkout's only when run there)."""
    from experiments.common import RESULTS_DIR  # noqa: PLC0415

    name = "multiprocess_quick" if args.quick else "multiprocess"
    return os.path.abspath(args.out or os.path.join(RESULTS_DIR, f"{name}.json"))


if __name__ == "__main__":
    main()
