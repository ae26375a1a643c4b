"""Tree of thought on one engine: branch live sequences, continue them, prune, keep winners —
without prefilling anything twice.

    python -m experiments.tree_of_thought                 # the worked example + memory table
    python -m experiments.tree_of_thought --quick         # a 2 x 2 x 2 tree, 4 tokens a level

The loop, using only the public API of :class:`paxkv.Engine`::

    engine = paxkv.Engine(lm, max_seqs=64, max_len=256, prefix_cache=False)
    root = engine.submit(prompt_ids, max_new_tokens=8, temperature=0.8, hold=True,
                         stop_token_ids=[])   # EOS ignored: every node writes 8 tokens
    engine.run()                                  # the root writes 8 tokens, keeps its row
    frontier = [root]
    for level in range(depth):
        last = level == depth - 1
        kids = [c for node in frontier              # each node -> k children sharing its pages;
                for c in engine.fork(node, k, max_new_tokens=8, hold=not last)]
        results = engine.run()                    # children decode (their first write copies
        ranked = sorted(kids, key=lambda c: score(results[c]),  # the shared partial page,
                        reverse=True)                           # nothing more)
        for loser in ranked[keep:]:
            engine.cancel(loser)                  # pruned: pages only it held are free at once
        frontier = ranked[:keep]

``hold=True`` keeps a finished node's row (and pages) so it can be forked; ``fork`` ends the
parent and hands its row to child 0. ``run()`` returns the results of what finished during it,
held nodes included. Child ``i`` of a node samples from ``fold_in(node key, i)``, so a leaf is
reproducible: the check below recomputes leaves from scratch with their keys. The engines run
without the prefix cache, so the memory figures count the tree's own sharing only.

:func:`measure` (used by ``experiments/branching.py``) runs the full ``k ** depth`` tree and
``n``-sample decoding, reporting peak pages and KV bytes with sharing against what private
copies would take (``k ** depth`` copies of each leaf's sequence, ``n`` copies of each sample).
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import jax

from paxkv import models
import paxkv
from experiments.common import parser, print_table, record, result_name, write_json

PROMPT = "List creative names for a small bakery that sells bread made with ancient grains."


def grow_tree(engine: paxkv.Engine, prompt_ids: list[int], *, branch: int, depth: int,
              tokens: int, temperature: float, seed: int, keep: int | None = None,
              score: Callable[[paxkv.GenerationResult], float] | None = None
              ) -> dict[str, Any]:
    """Root + ``depth`` levels of ``branch`` children each (``tokens`` new tokens per node, EOS
    ignored); with ``keep``, only the ``keep`` best of each level (by ``score``) branch on.
    Returns the ids of every level, the key path of each leaf and the leaves' results."""
    root = engine.submit(prompt_ids, max_new_tokens=tokens, temperature=temperature, seed=seed,
                         hold=True, stop_token_ids=[])
    results = engine.run()  # the root's (held)
    paths = {root: (jax.random.fold_in(jax.random.PRNGKey(seed), root),)}
    levels, frontier = [[root]], [root]
    for level in range(depth):
        last = level == depth - 1
        kids = []
        for node in frontier:
            ids = engine.fork(node, branch, max_new_tokens=tokens, hold=not last)
            for i, child in enumerate(ids):
                paths[child] = paths[node] + (jax.random.fold_in(paths[node][-1], i),)
            kids += ids
        results = engine.run()  # the kids' results (held ones too)
        levels.append(kids)
        frontier = kids
        if keep is not None and not last:
            ranked = sorted(kids, key=lambda c: score(results[c]), reverse=True)
            for loser in ranked[keep:]:
                engine.cancel(loser)
            frontier = ranked[:keep]
    return dict(levels=levels, keys={leaf: paths[leaf][-1] for leaf in levels[-1]},
                results={leaf: results[leaf] for leaf in levels[-1]})


def _pages(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def measure(lm: Any, *, prompt: str | list[int] | None = None, branch: int = 4, depth: int = 3,
            tokens: int = 8, n: int = 4, page_size: int = 16, temperature: float = 0.8,
            seed: int = 0, check_leaves: int = 2) -> dict[str, Any]:
    """Memory of a ``branch ** depth`` tree and of ``n``-sample decoding, shared vs copied.

    Returns a dict with ``tree`` and ``samples`` entries, each holding ``peak_pages`` and
    ``peak_kv_bytes`` with sharing, ``unshared_pages`` / ``unshared_kv_bytes`` (what private
    copies of every leaf / sample would hold), ``saving`` (1 - shared / unshared),
    ``prefill_tokens`` (the prompt once: nothing is prefilled again) and ``cow_copies``; the
    tree also carries ``check``: ``check_leaves`` leaves recomputed alone from their keys
    give the same tokens.
    """
    if prompt is None:
        prompt = lm.chat_prompt([{"role": "user", "content": PROMPT}])
    ids = lm.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    leaves, leaf_len = branch ** depth, len(ids) + (depth + 1) * tokens
    size = max(leaves, n)
    max_len = _pages(leaf_len + 1, page_size) * page_size
    engine = paxkv.Engine(lm, max_seqs=size, max_len=max_len, page_size=page_size,
                          prefix_cache=False)
    tree = grow_tree(engine, ids, branch=branch, depth=depth, tokens=tokens,
                     temperature=temperature, seed=seed)
    stats = engine.stats()
    results = tree["results"]
    check = []
    for leaf in list(results)[:check_leaves]:
        rid = engine.submit(results[leaf].prompt_ids, max_new_tokens=tokens,
                            temperature=temperature, key=tree["keys"][leaf], stop_token_ids=[])
        check.append(engine.run()[rid].token_ids == results[leaf].token_ids)
    page_bytes = stats.kv_bytes_per_page
    out = dict(tree=_memory(stats.peak_pages_used, leaves * _pages(leaf_len, page_size),
                            page_bytes, stats, branch=branch, depth=depth, leaves=leaves,
                            check=all(check), leaves_checked=len(check)))

    engine = paxkv.Engine(lm, max_seqs=size, max_len=max_len, page_size=page_size,
                          prefix_cache=False)
    rid = engine.submit(ids, n=n, max_new_tokens=(depth + 1) * tokens, temperature=temperature,
                        seed=seed, stop_token_ids=[])
    samples = engine.run()[rid].samples
    out["samples"] = _memory(engine.stats().peak_pages_used,
                             n * _pages(leaf_len, page_size), page_bytes, engine.stats(), n=n,
                             distinct=len({tuple(s.token_ids) for s in samples}))
    out["config"] = dict(prompt_tokens=len(ids), tokens_per_level=tokens, page_size=page_size,
                         temperature=temperature, seed=seed, kv_bytes_per_page=page_bytes)
    return out


def _memory(peak: int, unshared: int, page_bytes: int, stats: Any, **extra: Any) -> dict:
    return dict(peak_pages=peak, peak_kv_bytes=peak * page_bytes, unshared_pages=unshared,
                unshared_kv_bytes=unshared * page_bytes, saving=1 - peak / unshared,
                prefill_tokens=stats.prefill_tokens, cow_copies=stats.cow_copies, **extra)


def worked_example(lm: Any, args: argparse.Namespace) -> list[str]:
    """The loop of the module docstring with pruning: keep the 2 most varied children."""
    engine = paxkv.Engine(lm, max_seqs=args.branch ** 2, max_len=256, prefix_cache=False)
    ids = lm.encode(lm.chat_prompt([{"role": "user", "content": PROMPT}]))
    tree = grow_tree(engine, ids, branch=args.branch, depth=args.depth, tokens=args.tokens,
                     temperature=0.8, seed=args.seed, keep=2,
                     score=lambda r: len(set(r.token_ids)))
    return [lm.decode(r.prompt_ids[len(ids):] + r.token_ids) for r in tree["results"].values()
            if r.finish_reason != "cancelled"]


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, quick="a 2 x 2 x 2 tree, 4 tokens a level")
    ap.add_argument("--branch", type=int, default=4)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=8, help="new tokens per node")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.quick:
        args.branch, args.depth, args.tokens = 2, 2, 4
    lm = models.load()
    for text in worked_example(lm, args)[:4]:
        print("leaf:", repr(text))
    m = measure(lm, branch=args.branch, depth=args.depth, tokens=args.tokens, n=args.branch,
                seed=args.seed)
    rows = [[f"tree {args.branch}^{args.depth} ({m['tree']['leaves']} leaves)", m["tree"]],
            [f"n={args.branch} samples", m["samples"]]]
    print_table(["workload", "peak pages (shared)", "pages (private copies)", "KV MiB shared",
                 "KV MiB copies", "saving", "prefill tokens", "COW copies"],
                [[name, r["peak_pages"], r["unshared_pages"], f"{r['peak_kv_bytes'] / 2**20:.1f}",
                  f"{r['unshared_kv_bytes'] / 2**20:.1f}", f"{r['saving']:.0%}",
                  r["prefill_tokens"], r["cow_copies"]] for name, r in rows])
    print(f"leaves recomputed alone from their keys match: {m['tree']['check']}")
    write_json(result_name("tree_of_thought", args.quick),
               record(dict(vars(args)), m))


if __name__ == "__main__":
    main()
