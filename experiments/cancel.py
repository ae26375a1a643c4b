"""Cancellation: pages come back in the same call, nothing leaks, nobody else notices.

    python -m experiments.cancel             # 10,000 random page-table ops + model runs
    python -m experiments.cancel --quick     # 1,000 ops, 12 engine requests

1. **ops** (page-table level, jitted ``reserve`` / ``release`` / ``fork`` / ``retain``):
   ``--ops`` random operations on a small table: admit a prompt, feed a prompt chunk (chunked
   prefill), decode one token for every decoding row, fork a decoding row, let a "prefix index"
   hold a row's full pages (``retain``) or drop such a hold, finish a row, and cancel a random
   row (mid-prompt, mid-decode, forked, sharing prefix pages). Each cancel counts the free
   pages before and after the one ``release`` call: the difference must equal the row's pages
   nobody else holds. Invariants (ref count = table entries + index holds; free iff 0) are
   checked every 100 ops; at the end every row and hold is dropped and all pages must be free.
2. **engine** (real model, ``paxkv.Engine``, prefix cache off, EOS ignored): the same requests
   run once undisturbed and once with a third of them cancelled at random steps (queued, just
   admitted, mid-decode; a request already finished by then is recorded as "finished", and its
   cancel is not made). Each cancel's freed pages must match the pages its row held
   (``ceil(tokens held / page_size)``); the survivors' greedy tokens must equal the undisturbed
   run's; no page leaks.
2b. **engine, shared** (real model): requests fork one ``submit_prefix`` holder (a shared
   system prompt) and one request is ``Engine.fork``-ed into two children; then a child, a
   request sharing the prefix and the prefix holder are cancelled. Same checks.
3. **fork** (real model, ``PagedCache`` + jitted steps): a prompt is prefilled, forked into
   children that share its pages, each child gets its own suffix token (copy-on-write of the
   shared last page), a prefix index holds the prompt's full pages, and all rows decode; the
   parent and some children are cancelled mid-decode. Freed pages per cancel = pages only that
   row held; the survivors' tokens equal an uncancelled run's; no leak at the end.

Writes ``results/cancel.json`` (``cancel_quick.json``), including a page map of part 3's pool
with shared pages (for ``experiments.plots``).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from paxkv import models
import paxkv
from experiments.accounting import paged_page_map
from experiments.common import finish, parser, print_table, provenance, record, result_name
from experiments.table_ops import host_table, random_ops, summarize_cancels
from paxkv.engine import cache_ops
from paxkv.table import page_table as pt
from paxkv.cache import paged as paged_cache
from paxkv.core import steps


# -- part 2: the engine with the real model ------------------------------------------------------
def _free(cache: Any) -> int:
    return int(np.sum(np.asarray(cache.table.ref_counts) == 0))


def _engine(lm: Any, **engine_kw: Any) -> paxkv.Engine:
    """A paged engine without the prefix cache (its held pages are not the subject here)."""
    return paxkv.Engine(lm, cache="paged", prefix_cache=False, **engine_kw)


def cancel_in_engine(engine: paxkv.Engine, rid: int) -> dict[str, Any]:
    """``engine.cancel(rid)`` with the free pages counted around it; the row it released (the
    one that went inactive) must have held exactly the pages that came back. A request that
    already finished (handed out, no longer live) is not cancelled: kind "finished"."""
    if rid not in engine.table.requests:
        return dict(kind="finished", freed=0, expected=0, tokens_held=0, pages_for_tokens=0)
    bt, lengths, refs, active = host_table(engine.cache.table)
    result = engine.result(rid)
    before = _free(engine.cache)
    engine.cancel(rid)
    after = _free(engine.cache)
    gone = np.flatnonzero(active & ~np.asarray(engine.cache.table.active))
    ps = engine.cache.page_size
    expected = sum(int(np.sum(refs[bt[r, : -(-int(lengths[r]) // ps)]] == 1)) for r in gone)
    held = len(result.prompt_ids) + len(result.token_ids) - 1 if gone.size else 0
    # A request's first step prefills it and decodes once: 2 tokens.
    kind = ("queued" if not gone.size else
            "just_prefilled" if len(result.token_ids) <= 2 else "mid_decode")
    return dict(kind=kind, freed=after - before, expected=expected,
                tokens_held=held, pages_for_tokens=-(-held // ps))


def drive_engine(lm: Any, requests: list[tuple[list[int], int]], cancel_at: dict[int, int],
                 **engine_kw: Any) -> tuple[dict[int, list[int]], list[dict], int, int]:
    """Runs ``requests``, cancelling request ``i`` just before step ``cancel_at[i]``.
    Returns (tokens per request, cancel records, steps, pages leaked)."""
    engine = _engine(lm, **engine_kw)
    ids = [engine.submit(p, max_new_tokens=n, stop_token_ids=[]) for p, n in requests]
    cancels, step, results = [], 0, {}
    while engine.has_work():
        for i in sorted(i for i, s in cancel_at.items() if s == step):
            cancels.append(dict(cancel_in_engine(engine, ids[i]), request=i, step=step))
        results.update(engine.step().finished)
        step += 1
    results.update(engine.run())  # anything cancelled after the last step
    tokens = {i: results[rid].token_ids for i, rid in enumerate(ids)}
    return tokens, cancels, step, engine.cache.num_pages - _free(engine.cache)


def engine_run(lm: Any, *, requests: int = 16, max_len: int = 64, page_size: int = 4,
               max_seqs: int = 8, num_pages: int = 64, cancel_frac: float = 0.33,
               prefill_chunk: int = 512, seed: int = 0) -> dict[str, Any]:
    """Part 2: an undisturbed run and a run with random cancels; see the module doc."""
    rng = np.random.default_rng(seed)
    reqs = []
    for _ in range(requests):
        p = int(rng.integers(2, max_len // 2))
        reqs.append((rng.integers(0, lm.config.vocab_size, p).tolist(),
                     int(rng.integers(2, max_len - p))))
    kw = dict(max_seqs=max_seqs, max_len=max_len, page_size=page_size, num_pages=num_pages,
              prefill_chunk=prefill_chunk)
    base, _, steps_base, leak_base = drive_engine(lm, reqs, {}, **kw)
    # A third of the victims go before step 0 (queued), a third of the first max_seqs
    # requests before step 1 (just prefilled, if pages allowed), the rest mid-decode.
    n = max(3, int(cancel_frac * requests))
    first = rng.permutation(min(max_seqs, requests))[: n // 3]
    rest = rng.permutation([i for i in range(requests) if i not in first])[: n - len(first)]
    late = max(3, steps_base * 3 // 4)
    cancel_at = {int(i): 1 for i in first}
    cancel_at.update({int(i): (0 if k % 2 == 0 else int(rng.integers(2, late)))
                      for k, i in enumerate(rest)})
    got, cancels, steps_run, leak = drive_engine(lm, reqs, cancel_at, **kw)
    survivors = [i for i in range(requests) if i not in cancel_at]
    same = [i for i in survivors if got[i] == base[i]]
    prefix_ok = all(got[i] == base[i][: len(got[i])] for i in cancel_at)
    return dict(requests=requests, cancels=cancels, by_kind=summarize_cancels(cancels),
                all_freed_in_same_call=all(c["freed"] == c["expected"] for c in cancels),
                freed_matches_tokens=all(c["expected"] == c["pages_for_tokens"] for c in cancels),
                survivors=len(survivors), survivors_identical=len(same),
                cancelled_prefixes_identical=prefix_ok,
                pages_leaked=leak, pages_leaked_baseline=leak_base,
                steps=steps_run, steps_baseline=steps_base, config=dict(kw, seed=seed))


def _drive_shared(lm: Any, prefix: list[int], suffixes: list[list[int]], new: int,
                  plan: dict[int, str], **engine_kw: Any) -> dict[str, Any]:
    """Requests fork one ``submit_prefix`` holder; after step 2 request 0 is ``Engine.fork``-ed
    into two children. ``plan``: step -> what to cancel before it ("child" = the second fork
    child, "sharer" = request 1, "prefix" = the prefix holder)."""
    engine = _engine(lm, **engine_kw)
    holder = engine.submit_prefix(prefix)
    ids = [engine.submit(sfx, max_new_tokens=new, prefix=holder, stop_token_ids=[])
           for sfx in suffixes]
    kids, cancels, step, results = [], [], 0, {}
    while engine.has_work():
        if step == 2:
            kids = engine.fork(ids[0], 2, max_new_tokens=new // 2)
        who = plan.get(step)
        target = dict(child=kids[1] if kids else None, sharer=ids[1], prefix=holder).get(who)
        if target is not None:
            cancels.append(dict(cancel_in_engine(engine, target), kind=who, step=step))
        results.update(engine.step().finished)
        step += 1
    if holder in engine.table.requests:
        engine.cancel(holder)  # a prefix holder keeps its row until cancelled
    results.update(engine.run())
    tokens = {rid: results[rid].token_ids for rid in ids[1:] + kids}
    return dict(tokens=tokens, cancels=cancels,
                leaked=engine.cache.num_pages - _free(engine.cache),
                cancelled={c for c, w in ((kids[1] if kids else -1, "child"), (ids[1], "sharer"))
                           if w in plan.values()})


def engine_sharing_run(lm: Any, *, requests: int = 4, prefix_len: int = 18, new: int = 12,
                       max_len: int = 64, page_size: int = 4, max_seqs: int = 8,
                       num_pages: int = 64, seed: int = 0) -> dict[str, Any]:
    """Part 2b: cancels while pages are shared inside the engine (a fork child, a request
    sharing the prefix, the prefix holder); survivors vs an uncancelled run."""
    rng = np.random.default_rng(seed)
    vocab = lm.config.vocab_size
    prefix = rng.integers(0, vocab, prefix_len).tolist()
    suffixes = [rng.integers(0, vocab, int(rng.integers(1, 6))).tolist() for _ in range(requests)]
    kw = dict(max_seqs=max_seqs, max_len=max_len, page_size=page_size, num_pages=num_pages,
              prefill_chunk=16)
    base = _drive_shared(lm, prefix, suffixes, new, {}, **kw)
    run = _drive_shared(lm, prefix, suffixes, new, {4: "child", 5: "sharer", 6: "prefix"}, **kw)
    survivors = [r for r in base["tokens"] if r not in run["cancelled"]]
    return dict(cancels=run["cancels"],
                all_freed_in_same_call=all(c["freed"] == c["expected"] for c in run["cancels"]),
                survivors=len(survivors),
                survivors_identical=sum(run["tokens"][r] == base["tokens"][r] for r in survivors),
                pages_leaked=run["leaked"], pages_leaked_baseline=base["leaked"],
                config=dict(kw, requests=requests, prefix_len=prefix_len, new=new, seed=seed))


# -- part 3: fork and a shared prefix with the real model ----------------------------------------
def _release_row(cache: Any, row: int) -> tuple[Any, dict[str, int]]:
    """Releases one row with the jitted step; returns the freed and expected page counts."""
    bt, lengths, refs, _ = host_table(cache.table)
    pages = bt[row, : -(-int(lengths[row]) // cache.table.page_size)]
    before = _free(cache)
    mask = np.zeros(cache.max_seqs, bool)
    mask[row] = True
    cache, _ = cache_ops.release_rows(cache, jnp.asarray(mask))
    return cache, dict(row=row, freed=_free(cache) - before,
                       expected=int(np.sum(refs[pages] == 1)), shared=int(np.sum(refs[pages] > 1)))


def _forked_start(lm: Any, prompt: list[int], children: int, *, max_len: int, page_size: int,
                  num_pages: int) -> tuple[Any, np.ndarray, np.ndarray]:
    """Row 0 holds the prompt; rows 1..children share it and each adds its own token (so the
    shared partial page is copied on write). Returns (cache, last tokens, index-held pages)."""
    cfg, rows = lm.config, children + 1
    cache = paged_cache.create(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                               head_dim=cfg.head_dim, num_pages=num_pages, page_size=page_size,
                               max_seqs=rows, max_len=max_len, attention_impl="xla")
    width = -(-len(prompt) // 16) * 16
    tokens = np.zeros((1, width), np.int32)
    tokens[0, : len(prompt)] = prompt
    cache, first, _, _ = steps.prefill_step(lm.forward, lm.params, cache, jnp.asarray(tokens),
                                            jnp.array([0]), jnp.array([len(prompt)]), None)
    kids = np.arange(1, rows)
    cache, ok = cache.fork(jnp.zeros(children, jnp.int32), jnp.asarray(kids, jnp.int32))
    assert bool(np.all(ok)), "fork failed"
    suffix = (np.asarray(first)[0] + kids) % cfg.vocab_size  # each child's own next token
    cache, nxt, _, _ = steps.prefill_step(
        lm.forward, lm.params, cache, jnp.asarray(suffix[:, None], jnp.int32),
        jnp.asarray(kids, jnp.int32), jnp.ones(children, jnp.int32), None)
    held = np.asarray(cache.table.block_tables)[0, : len(prompt) // page_size]
    cache = dataclasses.replace(cache, table=pt.retain(cache.table, jnp.asarray(held), 1))
    last = np.concatenate([np.asarray(first), np.asarray(nxt)]).astype(np.int32)
    return cache, last, held


def fork_run(lm: Any, *, children: int = 4, prompt_len: int = 21, decode_steps: int = 8,
             max_len: int = 64, page_size: int = 4, seed: int = 0,
             cancel_at: dict[int, int] | None = None) -> dict[str, Any]:
    """Part 3 (see the module doc). ``cancel_at``: decode step -> row to cancel before it
    (default: a child, the parent, another child)."""
    cancel_at = cancel_at or {2: 2, 3: 0, 5: children}
    prompt = np.random.default_rng(seed).integers(0, lm.config.vocab_size, prompt_len).tolist()
    num_pages = (children + 1) * -(-max_len // page_size)
    runs, page_map = {}, None
    for name, plan in (("uncancelled", {}), ("cancelled", cancel_at)):
        cache, last, held = _forked_start(lm, prompt, children, max_len=max_len,
                                          page_size=page_size, num_pages=num_pages)
        page_map = page_map or dict(paged_page_map(cache.table), index_held=held.tolist())
        live, tokens, cancels = np.ones(children + 1, bool), [], []
        for step in range(decode_steps):
            if step in plan:
                cache, c = _release_row(cache, plan[step])
                cancels.append(dict(c, step=step, kind="parent" if plan[step] == 0 else "child"))
                live[plan[step]] = False
            cache, nxt, ok, _ = steps.decode_step(lm.forward, lm.params, cache, jnp.asarray(last),
                                                  jnp.asarray(live), None)
            last = np.where(live, np.asarray(nxt), last).astype(np.int32)
            tokens.append(np.where(live, np.asarray(nxt), -1))
        for row in np.flatnonzero(live):
            cache, _ = _release_row(cache, int(row))
        cache = dataclasses.replace(cache, table=pt.retain(cache.table, jnp.asarray(held), -1))
        runs[name] = dict(tokens=np.stack(tokens).T, cancels=cancels,
                          leaked=num_pages - _free(cache))
    a, b = runs["cancelled"]["tokens"], runs["uncancelled"]["tokens"]
    alive = b >= 0
    agree = (a == b) | (a == -1)  # a cancelled row made nothing after its cancel
    return dict(children=children, prompt_len=prompt_len, page_size=page_size,
                cancels=runs["cancelled"]["cancels"],
                all_freed_in_same_call=all(c["freed"] == c["expected"]
                                           for c in runs["cancelled"]["cancels"]),
                survivors_identical=bool(np.all(agree[alive])),
                tokens_cancelled=a.tolist(), tokens_uncancelled=b.tolist(),
                pages_leaked=runs["cancelled"]["leaked"],
                pages_leaked_uncancelled=runs["uncancelled"]["leaked"], page_map=page_map)


# -- the command ---------------------------------------------------------------------------------
def _kind_rows(part: str, by_kind: dict[str, dict[str, int]]) -> list[list[Any]]:
    return [[part, k, s["n"], s["pages_freed"], s["wrong"]] for k, s in sorted(by_kind.items())]


def report(ops: dict, eng: dict, shared: dict, fork: dict) -> bool:
    """Prints the tables; returns whether every check passed."""
    rows = _kind_rows("ops", ops["cancels"]) + _kind_rows("engine", eng["by_kind"])
    rows += [["engine, shared", f"{c['kind']} (step {c['step']})", 1, c["freed"],
              int(c["freed"] != c["expected"])] for c in shared["cancels"]]
    rows += [["fork", f"{c['kind']} (row {c['row']}, step {c['step']}, {c['shared']} shared)",
              1, c["freed"], int(c["freed"] != c["expected"])] for c in fork["cancels"]]
    print_table(["part", "released while", "count", "pages freed", "freed != expected"], rows)
    checks = [
        ("ops", f"{ops['ops']:,} random ops", "leaked pages", ops["pages_leaked"], 0),
        ("ops", "invariant checks", "errors", len(ops["invariant_errors"]), 0),
        ("engine", f"{eng['requests']} requests, "
         f"{sum(c['kind'] != 'finished' for c in eng['cancels'])} cancelled",
         "survivors with other tokens", eng["survivors"] - eng["survivors_identical"], 0),
        ("engine", "freed pages = ceil(tokens held / page)", "mismatches",
         int(not eng["freed_matches_tokens"]), 0),
        ("engine", "end of run", "leaked pages", eng["pages_leaked"], 0),
        ("engine, shared", "prefix + fork, 3 cancels", "survivors with other tokens",
         shared["survivors"] - shared["survivors_identical"], 0),
        ("engine, shared", "end of run", "leaked pages", shared["pages_leaked"], 0),
        ("fork", f"{fork['children']} children of a {fork['prompt_len']}-token prompt",
         "survivors with other tokens", int(not fork["survivors_identical"]), 0),
        ("fork", "end of run", "leaked pages", fork["pages_leaked"], 0),
    ]
    print()
    print_table(["part", "what", "measure", "got", "target"],
                [[p, w, m, g, t] for p, w, m, g, t in checks])
    return (all(g == t for *_, g, t in checks) and ops["all_freed_in_same_call"]
            and eng["all_freed_in_same_call"] and shared["all_freed_in_same_call"]
            and fork["all_freed_in_same_call"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = parser(__doc__, quick="1,000 ops, 12 engine requests")
    ap.add_argument("--ops", type=int, default=10_000)
    ap.add_argument("--requests", type=int, default=24, help="engine requests (part 2)")
    ap.add_argument("--children", type=int, default=4, help="forked rows (part 3)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.quick:
        args.ops, args.requests = 1_000, 12
    return args


def run(args: argparse.Namespace, lm: Any) -> dict[str, Any]:
    """All three parts; prints the tables; returns the record."""
    started = provenance()
    ops = random_ops(args.ops, seed=args.seed)
    print(f"part 1: {args.ops:,} random page-table ops done")
    eng = engine_run(lm, requests=args.requests, seed=args.seed)
    print(f"part 2: engine run done ({eng['steps']} steps)")
    shared = engine_sharing_run(lm, seed=args.seed)
    print("part 2b: engine sharing run done")
    fork = fork_run(lm, children=args.children, seed=args.seed)
    print("part 3: fork run done\n")
    ok = report(ops, eng, shared, fork)
    print(f"\nall checks passed: {ok}")
    return record(dict(vars(args), model=lm.name, **started),
                  dict(ops=ops, engine=eng, engine_sharing=shared, fork=fork,
                       all_checks_passed=ok))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rec = run(args, models.load())
    finish(result_name("cancel", args.quick), rec, rec["results"]["all_checks_passed"],
           "a cancellation check failed")


if __name__ == "__main__":
    main()
