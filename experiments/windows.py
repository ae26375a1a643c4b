"""Sliding-window layers from one K/V byte budget: window pages released inside the step vs
every layer kept whole vs a dense cache, on a Gemma-3-shaped model.

    python -m experiments.windows            # 12 layers (5:1), window 64, 8 windows of context
    python -m experiments.windows --quick    # a smoke run
    python -m experiments.windows --model gemma3 --windows 2 --requests 4   # Gemma 3 270M

**Model**: random weights in Gemma 3's text decoder (``gemma3_text``: q/k norms, ``(1 + w)``
norms, four norms a layer, GeGLU, scaled embeddings, local and global RoPE) with its layer
pattern, five sliding-window layers of ``--window`` tokens for every global one, at a size two
CPU cores run; or (``--model gemma3``) Gemma 3 270M itself (Q4_K_M GGUF, the ``gemma``
extra: 18 layers, window 512, so ``--layers`` and ``--window`` are its own). **Requests**: ``--requests`` of ``--windows`` windows of context each (prompt
``windows x window - output`` random tokens, ``--output`` greedy tokens, EOS ignored), all
queued at step 0.

**Budget**: the bytes of ``--budget-seqs`` sequences of ``max_len`` tokens with every layer
kept whole. **Systems** (one engine each, same requests, prefix cache off):

* ``released``: the layer-grouped cache (:mod:`paxkv.cache.grouped`): the most rows whose
  window groups, sized so no row waits for them, leave the global layers room for that many
  whole contexts; window pages return to the pool inside the step that moves past them.
* ``whole``: the paged cache with the same windows applied as masks only: every layer keeps
  every page (``budget / (layers x page bytes)`` pages, as many rows).
* ``dense``: ``max_len`` slots a row, ``--budget-seqs`` rows.

**Figures**: peak running sequences; tok/s (output tokens over the steps' wall time, less
the compiles inside them, from ``jax.monitoring``); K/V bytes held per running sequence at its peak,
against keeping every layer whole and against the computed ideal (global layers: every page
of the context; window layers: ``ceil(w / page) + 1`` pages); waste at steady state (held
bytes that no query can read: a window layer's keys before its window, empty page tails);
leaked pages after the run; greedy tokens equal across the systems.

**Shared system prompt** (the second table): every request starts with the same
``--system-windows`` windows, then its own tokens up to the same context; the released cache
with its window-aware prefix cache (:mod:`paxkv.prefix.window_index`) against the released
cache without one and the whole-layer cache with the plain prefix cache (same rows and
global pages as the first table). Figures: prompt tokens served from the cache and computed,
tok/s, the pool's K/V bytes (the window groups grow by the index's budget), leaked pages once
the cache is cleared, tokens equal. Writes ``results/windows.json``.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np

import paxkv
from experiments import common
from experiments.accounting import CompileClock
from paxkv import models
from paxkv.cache import dense as dense_cache
from paxkv.cache import grouped, layer_groups
from paxkv.cache import paged as paged_cache
from paxkv.core.buckets import cdiv
from paxkv.engine.policy import most_prefill_rows
from paxkv.models import LanguageModel
from paxkv.models.hf_loader import config_from_dict
from paxkv.models.params import build_params, checkpoint_shapes


def gemma3_shaped(args: Any) -> LanguageModel:
    """A random-weight Gemma 3 text decoder: ``--layers`` layers, every 6th global."""
    config = config_from_dict({
        "model_type": "gemma3_text", "vocab_size": 512, "hidden_size": 128,
        "intermediate_size": 512, "num_hidden_layers": args.layers, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 32, "query_pre_attn_scalar": 32,
        "sliding_window": args.window, "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True})
    rng = np.random.default_rng(0)
    shapes = checkpoint_shapes(config)
    params = build_params(config, lambda name: (rng.standard_normal(shapes[name]) * 0.05
                                                ).astype(np.float32))
    return LanguageModel(config, params, None, "gemma3-shaped")


def real_gemma3(args: Any) -> LanguageModel:
    """Gemma 3 270M: ``args.layers`` and ``args.window`` become the model's own."""
    lm = models.load(models.gemma3_model_path())
    args.layers, args.window = lm.num_layers, next(w for w in lm.layer_windows if w)
    return lm


def caches(lm: LanguageModel, args: Any) -> dict[str, Any]:
    """The three systems' caches from one byte budget. The released system gets the most rows
    whose window groups (:func:`paxkv.cache.layer_groups.window_group_pages`) leave the global
    layers room for that many whole contexts."""
    ps, max_len, layers, windows = args.page_size, args.max_len, lm.num_layers, lm.layer_windows
    dims = dict(num_layers=layers, num_kv_heads=lm.num_kv_heads, head_dim=lm.head_dim,
                max_len=max_len)
    layer_pages = args.budget_seqs * layers * cdiv(max_len, ps)  # the budget, in layer-pages
    num_global = sum(w is None for w in windows)

    step_rows = most_prefill_rows(args.prefill_chunk, args.prefill_tokens)

    def split(rows: int) -> tuple[int, int]:  # (window pages a layer, global pages a layer)
        window = layer_groups.window_group_pages(args.window, ps, rows, max_len,
                                                 args.prefill_tokens, step_rows)
        return window, (layer_pages - (layers - num_global) * (window + 1)) // num_global - 1

    rows = max(r for r in range(1, 8 * args.budget_seqs * layers)
               if split(r)[1] >= r * cdiv(max_len, ps))
    window_pages, global_pages = split(rows)
    return {
        "released": grouped.create(num_pages=global_pages, page_size=ps, max_seqs=rows,
                                   layer_windows=windows, window_pages=window_pages,
                                   step_tokens=args.prefill_tokens, **dims),
        "whole": paged_cache.create(num_pages=layer_pages // layers - 1, page_size=ps,
                                    max_seqs=rows, layer_windows=windows, **dims),
        "dense": dense_cache.create(max_seqs=args.budget_seqs, layer_windows=windows, **dims),
    }


def held_bytes(cache: Any) -> int:
    """K/V bytes the cache holds for rows now, every layer, scales included."""
    if isinstance(cache, dense_cache.DenseCache):  # a "page" is a whole row, every layer
        return int(np.sum(np.asarray(cache.active))) * cache.kv_bytes_per_page
    if isinstance(cache, grouped.GroupedPagedCache):
        return int(cache.layer_pages_used()) * cache.layer_page_bytes
    return int(np.sum(np.asarray(cache.table.ref_counts) > 0)) * cache.kv_bytes_per_page


def readable_bytes(lm: LanguageModel, lengths: np.ndarray, token_bytes: int) -> int:
    """Bytes of K/V some query can still read: every token in a global layer, the last
    ``w`` in a window layer."""
    return int(sum(np.minimum(lengths, w).sum() if w else lengths.sum()
                   for w in lm.layer_windows)) * token_bytes


def run(lm: LanguageModel, cache: Any, prompts: list[list[int]], args: Any) -> dict[str, Any]:
    """One pass of ``prompts`` through an engine over ``cache``; per-step accounting."""
    engine = paxkv.Engine(lm, cache=cache, prefix_cache=False, prefill_chunk=args.prefill_chunk,
                          prefill_tokens=args.prefill_tokens)
    token_bytes = cache.kv_bytes_per_device // max(1, _slots(cache))
    ids = [engine.submit(p, max_new_tokens=args.output, stop_token_ids=[]) for p in prompts]
    series, wall, done = [], 0.0, {}
    with CompileClock() as compiling:
        while engine.has_work():
            start, compiled = time.perf_counter(), compiling.total
            out = engine.step()
            jax.block_until_ready(engine.cache)
            wall += time.perf_counter() - start - (compiling.total - compiled)
            done.update(out.finished)
            _account(lm, engine, series, token_bytes)
    return dict(tokens=[done[i].token_ids for i in ids], wall=wall, series=series,
                leaked=_leaked(engine.cache), out_tokens=args.output * len(prompts))


def _account(lm: LanguageModel, engine: Any, series: list, token_bytes: int) -> None:
    """One step's figures, outside the timed region: running and queued requests, K/V bytes
    held and the bytes of them some query can still read."""
    kv = engine.cache
    series.append(dict(running=int(np.sum(np.asarray(kv.active))),
                       queued=len(engine.table.waiting), held=held_bytes(kv),
                       readable=readable_bytes(lm, np.asarray(kv.lengths), token_bytes)))


def _slots(cache: Any) -> int:
    """Token slots of one layer over the whole pool (for bytes per token per layer)."""
    if isinstance(cache, dense_cache.DenseCache):
        return cache.max_seqs * cache.max_len * cache.k.shape[0]
    if isinstance(cache, grouped.GroupedPagedCache):
        return cache.groups.flat_pages * cache.page_size
    return (cache.num_pages + 1) * cache.page_size * cache.pool.k.shape[0]


def _leaked(cache: Any) -> int:
    if isinstance(cache, dense_cache.DenseCache):
        return int(np.sum(np.asarray(cache.active)))
    tables = cache.tables if isinstance(cache, grouped.GroupedPagedCache) else (cache.table,)
    return int(sum(np.sum(np.asarray(t.ref_counts)) for t in tables))


def summarise(lm: LanguageModel, name: str, r: dict[str, Any], args: Any) -> dict[str, Any]:
    steady = [s for s in r["series"] if s["queued"] > 0] or r["series"]
    per_seq = [s["held"] / s["running"] for s in r["series"] if s["running"]]
    waste = [1 - s["readable"] / s["held"] for s in steady if s["held"]]
    return dict(system=name, peak_running=max(s["running"] for s in r["series"]),
                tok_per_s=r["out_tokens"] / r["wall"], peak_bytes_per_seq=max(per_seq),
                waste_steady=float(np.median(waste)) if waste else 0.0, leaked=r["leaked"])


def ideal_ratio(lm: LanguageModel, args: Any) -> float:
    """Pages per sequence at ``windows x window`` tokens: window pages released / kept."""
    pages = cdiv(args.windows * args.window, args.page_size)
    window_pages = cdiv(args.window, args.page_size) + 1
    kept = [pages if w is None else min(pages, window_pages) for w in lm.layer_windows]
    return sum(kept) / (pages * lm.num_layers)


def shared_prompt(lm: LanguageModel, args: Any) -> tuple[list[dict[str, Any]], bool]:
    """The second table (module docstring): rows and whether the tokens agree."""
    rng = np.random.default_rng(2)
    system = rng.integers(1, lm.vocab_size, args.system_windows * args.window).tolist()
    prompts = [system + rng.integers(1, lm.vocab_size, args.max_len - args.output
                                     - len(system)).tolist() for _ in range(args.requests)]
    built = caches(lm, args)
    released, whole = built["released"], built["whole"]
    sizes = dict(max_seqs=released.max_seqs, max_len=args.max_len, page_size=args.page_size,
                 prefill_chunk=args.prefill_chunk, prefill_tokens=args.prefill_tokens)
    systems = {
        "released + prefix cache": lambda: paxkv.Engine(lm, num_pages=released.num_pages,
                                                        **sizes),
        "released, no prefix cache": lambda: paxkv.Engine(lm, cache=released,
                                                          prefix_cache=False, **sizes),
        "whole + prefix cache": lambda: paxkv.Engine(lm, cache=whole, prefix_cache=True,
                                                     **sizes),
    }
    rows, tokens = [], {}
    for name, make in systems.items():
        engine = make()
        ids = [engine.submit(p, max_new_tokens=args.output, stop_token_ids=[]) for p in prompts]
        wall, done = 0.0, {}
        with CompileClock() as compiling:
            while engine.has_work():
                start, compiled = time.perf_counter(), compiling.total
                done.update(engine.step().finished)
                jax.block_until_ready(engine.cache)
                wall += time.perf_counter() - start - (compiling.total - compiled)
        stats = engine.stats()
        engine.clear_prefix_cache()
        tokens[name] = [done[i].token_ids for i in ids]
        rows.append(dict(system=name, hit_tokens=stats.prefix_hit_tokens,
                         computed_tokens=engine.counters.prefill_tokens,
                         tok_per_s=args.output * len(prompts) / wall,
                         pool_bytes=engine.cache.kv_bytes_per_device,
                         leaked=_leaked(engine.cache)))
    equal = all(t == tokens["whole + prefix cache"] for t in tokens.values())
    common.print_table(
        ["system", "prompt tokens cached", "computed", "tok/s", "pool KiB", "leaked"],
        [[r["system"], str(r["hit_tokens"]), str(r["computed_tokens"]),
          f"{r['tok_per_s']:.1f}", f"{r['pool_bytes'] / 1024:,.0f}", str(r["leaked"])]
         for r in rows])
    print(f"shared system prompt of {len(system)} tokens; tokens equal: {equal}")
    return rows, equal


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--windows", type=int, default=8, help="context per request, in windows")
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--budget-seqs", type=int, default=6)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--prefill-chunk", type=int, default=128)
    ap.add_argument("--prefill-tokens", type=int, default=128)
    ap.add_argument("--system-windows", type=int, default=4,
                    help="the shared system prompt of the second table, in windows")
    ap.add_argument("--model", choices=("shaped", "gemma3"), default="shaped",
                    help="random weights of Gemma 3's shape, or Gemma 3 270M (its own layers "
                    "and window; pip install -e '.[gemma]')")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.window, args.requests, args.output = 6, 16, 12, 8
        args.budget_seqs, args.page_size, args.prefill_chunk, args.prefill_tokens = 3, 4, 32, 64
        args.system_windows = 2
    lm = real_gemma3(args) if args.model == "gemma3" else gemma3_shaped(args)
    args.max_len = args.windows * args.window
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, lm.vocab_size, args.max_len - args.output).tolist()
               for _ in range(args.requests)]
    results = {}
    for name in ("released", "whole", "dense"):
        results[name] = run(lm, caches(lm, args)[name], prompts, args)
    rows = [summarise(lm, n, r, args) for n, r in results.items()]
    whole = next(r for r in rows if r["system"] == "whole")
    for r in rows:
        r["bytes_per_seq_vs_whole"] = r["peak_bytes_per_seq"] / whole["peak_bytes_per_seq"]
        r["seqs_vs_whole"] = r["peak_running"] / whole["peak_running"]
        r["tok_per_s_vs_whole"] = r["tok_per_s"] / whole["tok_per_s"]
    equal = {n: results[n]["tokens"] == results["whole"]["tokens"] for n in results}
    common.print_table(
        ["system", "peak seqs", "x whole", "tok/s", "x whole", "peak KiB/seq", "x whole",
         "waste", "leaked"],
        [[r["system"], str(r["peak_running"]), f"{r['seqs_vs_whole']:.2f}",
          f"{r['tok_per_s']:.1f}", f"{r['tok_per_s_vs_whole']:.2f}",
          f"{r['peak_bytes_per_seq'] / 1024:.1f}", f"{r['bytes_per_seq_vs_whole']:.3f}",
          f"{r['waste_steady']:.1%}", str(r["leaked"])] for r in rows])
    ideal = ideal_ratio(lm, args)
    print(f"ideal bytes per sequence, released / whole: {ideal:.3f}; tokens equal: {equal}")
    shared, shared_equal = shared_prompt(lm, args)
    ok = (all(equal.values()) and shared_equal
          and all(r["leaked"] == 0 for r in rows + shared))
    common.finish(common.result_name("windows", args.quick,
                                     "gemma3" if args.model == "gemma3" else ""),
                  common.record(vars(args), dict(systems=rows, ideal_ratio=ideal,
                                                 tokens_equal=equal, shared_prompt=shared,
                                                 shared_tokens_equal=shared_equal)), ok)


if __name__ == "__main__":
    main()
