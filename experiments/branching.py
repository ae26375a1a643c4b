"""Branching workloads on CPU: beam search through the paged cache vs the dense one.

    python -m experiments.branching            # contexts 256 / 1,024 / 2,048 (~15 min, 2 cores)
    python -m experiments.branching --quick    # a smoke run (contexts 256 / 1,024, few steps)

1. **step**: ``paxkv.beam_search`` (width 4, SmolLM2-135M, float32, XLA attention) at prompt
   contexts 256 / 1,024 / 2,048 tokens of ``pydoc_data.topics`` prose, stop tokens off and
   ``early_stopping="never"`` so every run decodes exactly ``--new - 1`` steps. Per-step time is
   the compiled loop's wall time / steps, after a warm-up run of the same shapes (compile);
   median over ``--repeats``. Dense pays a copy of every layer's KV rows on each reorder; paged
   moves block-table rows. Paged and dense must give the same beams (tokens equal, scores within
   1e-4) before a time stands.
2. **memory**: width 4, a 512-token prompt, ``--memory-new`` new tokens: the most pages in use
   at once inside the loop vs four unshared copies of prompt + output (target >= 70% less).
3. **tree of thought**: ``experiments.tree_of_thought.measure(lm, ...)`` (another experiment)
   if that module is present; otherwise a printed note says it was skipped.

Writes ``results/branching.json`` (``branching_quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import statistics
from typing import Any

from paxkv import models
from experiments.common import fill_defaults, parser, print_table, record, result_name, write_json
from paxkv.decoding.beam_search import SearchResult, search

WIDTH, PAGE_SIZE = 4, 16
TARGETS = dict(paged_faster_from_context=1024, kv_saving=0.70)


def prose_ids(lm: Any, n: int) -> list[int]:
    """The first ``n`` tokens of the Language Reference prose CPython ships."""
    from pydoc_data.topics import topics

    ids = lm.encode("\n\n".join(topics[k].strip() for k in sorted(topics)))
    if len(ids) < n:
        raise ValueError(f"pydoc topics give {len(ids)} tokens, {n} needed")
    return ids[:n]


def run(lm: Any, prompt: list[int], cache: str, new: int) -> SearchResult:
    return search(lm, [prompt], beam_width=WIDTH, max_new_tokens=new, stop_token_ids=[],
                  early_stopping="never", cache=cache, page_size=PAGE_SIZE)


def same_beams(a: SearchResult, b: SearchResult) -> tuple[bool, float]:
    """(tokens equal and scores within 1e-4, largest score difference)."""
    pa, pb = a.beams[0], b.beams[0]
    diff = max(abs(x.score - y.score) for x, y in zip(pa, pb))
    return [x.token_ids for x in pa] == [y.token_ids for y in pb] and diff < 1e-4, diff


def step_times(lm: Any, contexts: list[int], new: int, repeats: int) -> list[dict[str, Any]]:
    rows = []
    for ctx in contexts:
        prompt = prose_ids(lm, ctx)
        cell: dict[str, Any] = dict(context=ctx, steps=new - 1)
        last = {}
        for cache in ("paged", "dense"):
            run(lm, prompt, cache, new)  # warm-up: compiles prefill and loop for these shapes
            runs = [run(lm, prompt, cache, new) for _ in range(repeats)]
            cell[f"{cache}_ms_per_step"] = 1e3 * statistics.median(r.loop_s / r.steps
                                                                   for r in runs)
            cell[f"{cache}_prefill_s"] = statistics.median(r.prefill_s for r in runs)
            cell[f"{cache}_all_free"] = all(r.all_free for r in runs)
            last[cache] = runs[-1]
        cell["paged_equals_dense"], cell["max_score_diff"] = same_beams(last["paged"],
                                                                        last["dense"])
        cell["dense_over_paged"] = cell["dense_ms_per_step"] / cell["paged_ms_per_step"]
        cell["top_beam"] = lm.decode(last["paged"].beams[0][0].token_ids)
        print(f"context {ctx}: paged {cell['paged_ms_per_step']:.1f} ms/step, dense "
              f"{cell['dense_ms_per_step']:.1f} ms/step, same beams: {cell['paged_equals_dense']}",
              flush=True)
        rows.append(cell)
    return rows


def memory(lm: Any, new: int) -> dict[str, Any]:
    prompt = prose_ids(lm, 512)
    paged, dense = run(lm, prompt, "paged", new), run(lm, prompt, "dense", new)
    cfg = lm.config
    page_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * PAGE_SIZE * cfg.head_dim * 4
    equal, diff = same_beams(paged, dense)
    return dict(prompt=512, new=new, width=WIDTH, page_size=PAGE_SIZE,
                peak_pages=paged.peak_pages, unshared_pages=paged.unshared_pages,
                dense_pages=dense.peak_pages, pool_pages=paged.num_pages,
                kv_saving=1.0 - paged.peak_pages / paged.unshared_pages,
                peak_kv_mib=paged.peak_pages * page_bytes / 2**20,
                unshared_kv_mib=paged.unshared_pages * page_bytes / 2**20,
                pages_freed_by_reorder=paged.pages_freed_by_reorder,
                stale_pages=paged.stale_pages, all_free=paged.all_free and dense.all_free,
                paged_equals_dense=equal, max_score_diff=diff)


def tree_of_thought(lm: Any, quick: bool) -> dict[str, Any] | None:
    """``experiments.tree_of_thought.measure`` (n=4 sampling, a 4 x 4 x 4 tree; 2 x 2 x 2 and
    n=2 with ``--quick``) when that module exists; None, with a printed note, otherwise."""
    if importlib.util.find_spec("experiments.tree_of_thought") is None:
        print("\nNOTE: experiments/tree_of_thought.py is not there: tree-of-thought rows skipped.")
        return None
    measure = getattr(importlib.import_module("experiments.tree_of_thought"), "measure", None)
    if measure is None:
        print("\nNOTE: experiments.tree_of_thought has no measure(): its rows are skipped.")
        return None
    wanted = dict(quick=True, branch=2, depth=2, tokens=4, n=2) if quick else {}
    accepted = inspect.signature(measure).parameters
    try:
        return measure(lm, **{k: v for k, v in wanted.items() if k in accepted})
    except Exception as e:  # another experiment's failure must not lose this one's results
        print(f"\nNOTE: experiments.tree_of_thought.measure failed, rows skipped: {e!r}")
        return dict(error=repr(e))


def print_report(steps: list[dict], mem: dict, tot: dict | None) -> None:
    print("\n### Beam search step time, width 4 (paged reorder moves table rows; dense copies "
          "KV)\n")
    print_table(["context", "paged ms/step", "dense ms/step", "dense / paged", "paged == dense"],
                [[c["context"], f"{c['paged_ms_per_step']:.1f}", f"{c['dense_ms_per_step']:.1f}",
                  f"{c['dense_over_paged']:.2f}x", c["paged_equals_dense"]] for c in steps])
    print(f"\n### Memory: width 4, {mem['prompt']}-token prompt, {mem['new']} new tokens\n")
    print_table(["", "pages", "KV MiB"],
                [["paged peak (inside the loop)", mem["peak_pages"], f"{mem['peak_kv_mib']:.1f}"],
                 ["4 unshared copies", mem["unshared_pages"], f"{mem['unshared_kv_mib']:.1f}"],
                 ["dense cache (4 rows x max_len)", mem["dense_pages"], ""]])
    print(f"\nKV saved vs unshared copies: {100 * mem['kv_saving']:.1f}% (target >= "
          f"{100 * TARGETS['kv_saving']:.0f}%); pages freed by reorders: "
          f"{mem['pages_freed_by_reorder']}; stale pages after any reorder: {mem['stale_pages']};"
          f" pool all free after: {mem['all_free']}; paged == dense: {mem['paged_equals_dense']}")
    if tot is not None and "error" not in tot:
        print("\n### Tree of thought and n-sampling (experiments.tree_of_thought.measure)\n")
        mems = {k: v for k, v in tot.items() if isinstance(v, dict) and "peak_pages" in v}
        print_table(["workload", "peak pages (shared)", "pages (private copies)", "KV saved"],
                    [[k, v["peak_pages"], v["unshared_pages"],
                      f"{100 * (1 - v['peak_pages'] / v['unshared_pages']):.1f}%"]
                     for k, v in mems.items()])


def parse_args(argv=None) -> argparse.Namespace:
    ap = parser(__doc__)
    ap.add_argument("--contexts", type=int, nargs="+")
    ap.add_argument("--new", type=int, help="new tokens per step-time run (steps + 1)")
    ap.add_argument("--repeats", type=int, help="timed runs per cell (median)")
    ap.add_argument("--memory-new", type=int, help="new tokens in the memory run")
    return fill_defaults(ap.parse_args(argv),
                         quick=dict(contexts=[256, 1024], new=6, repeats=1, memory_new=32),
                         full=dict(contexts=[256, 1024, 2048], new=17, repeats=3, memory_new=64))


def main(argv=None) -> None:
    args = parse_args(argv)
    lm = models.load()
    steps = step_times(lm, args.contexts, args.new, args.repeats)
    mem = memory(lm, args.memory_new)
    tot = tree_of_thought(lm, args.quick)
    print_report(steps, mem, tot)
    long = [c for c in steps if c["context"] >= TARGETS["paged_faster_from_context"]]
    targets = dict(
        paged_faster_at_long_context=bool(long) and all(c["dense_over_paged"] > 1 for c in long),
        kv_saving=mem["kv_saving"] >= TARGETS["kv_saving"],
        correct=all(c["paged_equals_dense"] for c in steps) and mem["paged_equals_dense"])
    print(f"\ntargets met: {targets}")
    config = dict(vars(args), width=WIDTH, page_size=PAGE_SIZE, model=lm.name, dtype="float32",
                  attention="xla", targets=TARGETS)
    results = dict(step_time=steps, memory=mem, tree_of_thought=tot, targets_met=targets)
    write_json(result_name("branching", args.quick), record(config, results))


if __name__ == "__main__":
    main()
