"""K/V dtypes side by side: float32 / bfloat16 / int8 (/ fp8): bytes, capacity, speed, quality.

    python -m experiments.kv_dtype            # 2,048 tokens of text; batch 32, 64 x 512, 2,048
    python -m experiments.kv_dtype --quick    # a smoke run: 256 tokens; batch 4 x 128
    python -m experiments.kv_dtype --dtypes float32 bfloat16 int8 float8_e4m3fn

One run, every dtype measured alike:

* **bytes per token**: K + V of one token over all layers, the scales of int8 / fp8 included
  (``kv_bytes_per_page`` of a paged cache / page size).
* **capacity**: tokens and sequences that fit the capacity experiment's fixed budget
  (``experiments.capacity``: 3 sequences x max_len 2,048 of float32 K/V = 6,144 float32 token
  slots, in bytes); sequences = tokens / the mean page-rounded length (prompt + output) of
  that experiment's request stream.
* **decode tok/s**: ``steps.decode_step`` (real model, paged, XLA path, the engine's window)
  at batch x context, the cache built with the context already in it
  (``hashed_kv.filled_cache``); medians of ``--repeats`` steps after ``--warmup`` (the first
  compiles), dtypes interleaved step by step when their caches fit ``--interleave-gib``.
* **quality**: the default model teacher-forced over ``--tokens`` tokens of real text
  (CPython's ``pydoc_data.topics``, the Language Reference prose behind ``help()``), in
  chunks of ``--chunk`` (each chunk attends to the cached K/V before it, so every score and
  value comes out of the dtype's pool): perplexity, top-1 agreement with float32 and mean
  KL(float32 || dtype) per predicted token. This is the run's correctness check.

Writes ``results/kv_dtype.json`` (``kv_dtype_quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from experiments import capacity
from experiments.common import (Stopwatch, fill_defaults, parser, print_table, prose_tokens, record,
                                result_name, timed_rounds, write_json)
from experiments.hashed_kv import PAGE_SIZE, decode, filled_cache, kv_bytes, window_plan
from paxkv import models
from paxkv.cache import paged as paged_cache
from paxkv.core.step_info import StepInfo

TARGETS = dict(int8_vs_bf16_tokens=1.85, int8_vs_f32_tokens=3.7, ppl_pct=0.5, top1=0.98,
               kl=1e-3)


# -- quality: teacher-forced real text -------------------------------------------------------
real_text = prose_tokens  # the first n tokens of CPython's prose (tests/test_int8.py too)


@functools.partial(jax.jit, static_argnames=("forward",), donate_argnums=(2,))
def _chunk(forward, params, cache, tokens: jax.Array):
    """One prefill chunk ``tokens [1, t]`` after what ``cache`` holds -> ``(cache, float32
    log-probabilities [t, vocab] of the next token at each position, ok)``."""
    n = jnp.full((1,), tokens.shape[1], jnp.int32)
    cache, ok = cache.reserve(n, max_new=tokens.shape[1])
    step = StepInfo.make(cache.lengths, jnp.where(ok, n, 0), tokens.shape[1])
    logits, cache = forward(params, tokens, step, cache, all_logits=True)
    return cache, jax.nn.log_softmax(logits[0], axis=-1), ok


def teacher_forced(lm, tokens: list[int], dtypes: list[str], chunk: int) -> dict[str, Any]:
    """Each dtype's paged cache teacher-forced over ``tokens`` in lockstep, ``chunk`` tokens a
    step -> per dtype: perplexity, and against ``dtypes[0]`` (the reference): top-1
    agreement and mean KL(reference || dtype) over the ``len(tokens) - 1`` predictions."""
    if len(tokens) % chunk:
        raise ValueError(f"--tokens ({len(tokens)}) must be a multiple of --chunk ({chunk})")
    caches = {d: paged_cache.create(num_layers=lm.num_layers, num_kv_heads=lm.num_kv_heads,
                                    head_dim=lm.head_dim, num_pages=-(-len(tokens) // PAGE_SIZE),
                                    page_size=PAGE_SIZE, max_seqs=1, max_len=len(tokens),
                                    dtype=jnp.dtype(d), attention_impl="xla") for d in dtypes}
    ids = np.asarray(tokens, np.int32)
    nll = {d: [] for d in dtypes}
    agree = {d: [] for d in dtypes}
    kl = {d: [] for d in dtypes}
    for start in range(0, len(ids), chunk):
        block = jnp.asarray(ids[None, start:start + chunk])
        nxt = ids[start + 1:start + chunk + 1]  # the last chunk's last position has none
        logp = {}
        for d in dtypes:
            caches[d], lp, ok = _chunk(lm.forward, lm.params, caches[d], block)
            assert bool(ok.all()), "the teacher-forcing reserve failed"
            logp[d] = np.asarray(lp)[:len(nxt)]
        ref = logp[dtypes[0]]
        for d in dtypes:
            nll[d].append(-logp[d][np.arange(len(nxt)), nxt])
            agree[d].append(logp[d].argmax(-1) == ref.argmax(-1))
            kl[d].append(np.sum(np.exp(ref) * (ref - logp[d]), axis=-1))
    out = {}
    for d in dtypes:
        ppl = float(np.exp(np.concatenate(nll[d]).mean()))
        out[d] = dict(perplexity=ppl, top1_agreement=float(np.concatenate(agree[d]).mean()),
                      mean_kl=float(np.concatenate(kl[d]).mean()),
                      max_kl=float(np.concatenate(kl[d]).max()))
    base = out[dtypes[0]]["perplexity"]
    for d in dtypes:
        out[d]["perplexity_pct"] = 100.0 * (out[d]["perplexity"] / base - 1.0)
    return dict(tokens=len(tokens), predictions=len(tokens) - 1, chunk=chunk, per_dtype=out)


# -- memory ----------------------------------------------------------------------------------
def bytes_per_token(lm, dtype: str) -> float:
    """K + V bytes of one token over all layers, scales included (from a real paged cache)."""
    cache = paged_cache.create(num_layers=lm.num_layers, num_kv_heads=lm.num_kv_heads,
                               head_dim=lm.head_dim, num_pages=1, page_size=PAGE_SIZE,
                               max_seqs=1, max_len=PAGE_SIZE, dtype=jnp.dtype(dtype),
                               attention_impl="xla")
    return cache.kv_bytes_per_page / PAGE_SIZE


def capacity_fit(lm, dtypes: list[str]) -> dict[str, Any]:
    """Tokens and sequences of each dtype in the capacity experiment's budget (its default
    config's float32 token slots, as bytes)."""
    cfg = capacity.Config()
    lengths = capacity.sample_lengths(96, cfg.max_len, prompt_median=96, prompt_sigma=1.0,
                                      output_median=48, output_sigma=1.0)
    mean_slots = float(np.mean(-(-lengths.sum(1) // cfg.page_size) * cfg.page_size))
    budget = cfg.budget_slots * bytes_per_token(lm, "float32")
    out = {}
    for d in dtypes:
        per_token = bytes_per_token(lm, d)
        tokens = int(budget // per_token)
        out[d] = dict(bytes_per_token=per_token, tokens=tokens, sequences=tokens / mean_slots)
    return dict(budget_bytes=budget, mean_sequence_slots=mean_slots, per_dtype=out)


# -- speed -----------------------------------------------------------------------------------
def decode_cell(lm, batch: int, context: int, dtypes: list[str], args) -> dict[str, Any]:
    """Decode tok/s of every dtype at one (batch, context): paged, XLA path, window = context.
    Dtypes whose caches fit ``--interleave-gib`` together alternate step by step."""
    n = args.warmup + args.repeats
    filled = context - n
    first = jnp.asarray(np.random.default_rng(0).integers(0, lm.vocab_size, batch), jnp.int32)
    groups, group, used = [], [], 0
    for d in dtypes:  # greedy packing into groups that fit the interleave budget together
        size = kv_bytes(lm, batch, context, jnp.dtype(d))
        if group and used + size > args.interleave_gib * 2**30:
            groups.append(group)
            group, used = [], 0
        group.append(d)
        used += size
    groups.append(group)
    timings, oks = {}, []
    for group in groups:
        state = {d: (filled_cache(lm, "paged", batch, context, filled, kv_dtype=jnp.dtype(d)),
                     first) for d in group}

        def step(d: str):
            def call():
                cache, tokens = state[d]
                cache, nxt, ok = decode(lm, cache, tokens, plan=window_plan(context))
                state[d] = (cache, nxt)
                oks.append(ok)
                return nxt
            return call

        timings.update(timed_rounds({d: step(d) for d in group}, repeats=args.repeats,
                                    warmup=args.warmup))
        state.clear()  # every step donated its input
    assert all(bool(ok.all()) for ok in oks), "a decode step failed to reserve"
    return dict(batch=batch, context=context, filled=filled,
                per_dtype={d: dict(tok_s=batch / timings[d].median_s,
                                   step_ms=1e3 * timings[d].median_s,
                                   first_call_s=timings[d].warmup_s[0],
                                   kv_mib=kv_bytes(lm, batch, context, jnp.dtype(d)) / 2**20,
                                   times_ms=[1e3 * t for t in timings[d].times_s])
                           for d in dtypes})


# -- the report ------------------------------------------------------------------------------
def table(result: dict[str, Any], dtypes: list[str]) -> tuple[list[str], list[list[str]]]:
    """One column per dtype: bytes, capacity, each decode cell's tok/s, quality."""
    cap, quality = result["capacity"]["per_dtype"], result["quality"]["per_dtype"]
    rows = [["bytes per token"] + [f"{cap[d]['bytes_per_token']:,.0f}" for d in dtypes],
            ["tokens in the capacity budget"] + [f"{cap[d]['tokens']:,}" for d in dtypes],
            ["sequences in the capacity budget"] + [f"{cap[d]['sequences']:.1f}" for d in dtypes]]
    for cell in result["decode"]:
        per = cell["per_dtype"]
        rows.append([f"decode tok/s, batch {cell['batch']} x {cell['context']}"]
                    + [f"{per[d]['tok_s']:.1f}" for d in dtypes])
    q = result["quality"]
    rows += [[f"perplexity ({q['tokens']:,} tokens of text)"]
             + [f"{quality[d]['perplexity']:.4f} ({quality[d]['perplexity_pct']:+.2f}%)"
                for d in dtypes],
             [f"top-1 agreement with {dtypes[0]}"]
             + [f"{100 * quality[d]['top1_agreement']:.2f}%" for d in dtypes],
             [f"mean KL from {dtypes[0]}"] + [f"{quality[d]['mean_kl']:.1e}" for d in dtypes]]
    return ["", *dtypes], rows


def targets(result: dict[str, Any]) -> list[list[str]]:
    """The issue's targets for int8 (reported, not asserted)."""
    cap, quality = result["capacity"]["per_dtype"], result["quality"]["per_dtype"]
    if not {"float32", "bfloat16", "int8"} <= set(cap):
        return []
    tok = {d: cap[d]["tokens"] for d in cap}
    q8 = quality["int8"]
    rows = [["int8 tokens / bfloat16 tokens", f"{tok['int8'] / tok['bfloat16']:.2f}x",
             f">= {TARGETS['int8_vs_bf16_tokens']}x",
             tok["int8"] / tok["bfloat16"] >= TARGETS["int8_vs_bf16_tokens"]],
            ["int8 tokens / float32 tokens", f"{tok['int8'] / tok['float32']:.2f}x",
             f">= {TARGETS['int8_vs_f32_tokens']}x",
             tok["int8"] / tok["float32"] >= TARGETS["int8_vs_f32_tokens"]],
            ["int8 perplexity vs float32", f"{q8['perplexity_pct']:+.2f}%",
             f"within {TARGETS['ppl_pct']}%", abs(q8["perplexity_pct"]) <= TARGETS["ppl_pct"]],
            ["int8 top-1 agreement", f"{100 * q8['top1_agreement']:.2f}%",
             f">= {100 * TARGETS['top1']:.0f}%", q8["top1_agreement"] >= TARGETS["top1"]],
            ["int8 mean KL", f"{q8['mean_kl']:.1e}", f"<= {TARGETS['kl']:.0e}",
             q8["mean_kl"] <= TARGETS["kl"]]]
    last = result["decode"][-1]["per_dtype"]
    if "bfloat16" in last:
        cell = result["decode"][-1]
        rows.append([f"int8 / bfloat16 decode, batch {cell['batch']} x {cell['context']}",
                     f"{last['int8']['tok_s'] / last['bfloat16']['tok_s']:.2f}x", ">= 1.0x",
                     last["int8"]["tok_s"] >= last["bfloat16"]["tok_s"]])
    return [[a, b, t, "yes" if met else "no"] for a, b, t, met in rows]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = parser(__doc__)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "int8"],
                    help="K/V dtypes; the first is the quality reference")
    ap.add_argument("--batches", type=int, nargs="+")
    ap.add_argument("--contexts", type=int, nargs="+")
    ap.add_argument("--tokens", type=int, help="tokens of real text, teacher-forced")
    ap.add_argument("--chunk", type=int, help="tokens per teacher-forced prefill step")
    ap.add_argument("--warmup", type=int, default=2, help="untimed decode steps (compile)")
    ap.add_argument("--repeats", type=int, default=5, help="timed decode steps (median)")
    ap.add_argument("--interleave-gib", type=float, default=6.0,
                    help="alternate dtypes step by step when their caches fit in this")
    args = fill_defaults(ap.parse_args(argv),
                         full=dict(batches=[32, 64], contexts=[512, 2048], tokens=2048, chunk=512),
                         quick=dict(batches=[4], contexts=[128], tokens=256, chunk=128))
    if args.warmup + args.repeats >= min(args.contexts) // 2:
        ap.error("warmup + repeats decode steps must fit in half the smallest context")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    watch = Stopwatch()
    lm = models.load()
    dtypes = list(args.dtypes)
    result: dict[str, Any] = dict(capacity=capacity_fit(lm, dtypes))
    t = time.perf_counter()
    result["quality"] = teacher_forced(lm, real_text(lm, args.tokens), dtypes, args.chunk)
    result["quality"]["seconds"] = time.perf_counter() - t
    print(f"quality: {args.tokens} tokens teacher-forced in {result['quality']['seconds']:.0f} s")
    result["decode"] = []
    for batch in args.batches:
        for context in args.contexts:
            t = time.perf_counter()
            result["decode"].append(decode_cell(lm, batch, context, dtypes, args))
            print(f"decode batch {batch} x {context}: {time.perf_counter() - t:.0f} s")
    header, rows = table(result, dtypes)
    print(f"\n## K/V dtypes ({lm.name}, page {PAGE_SIZE}, {jax.default_backend()})\n")
    print_table(header, rows)
    goals = targets(result)
    if goals:
        print("\n## targets (reported, not asserted)\n")
        print_table(["figure", "measured", "target", "met"], goals)
    result.update(table=[header, *rows], targets=goals, **watch.elapsed())
    write_json(result_name("kv_dtype", args.quick), record(vars(args), result))


if __name__ == "__main__":
    main()
