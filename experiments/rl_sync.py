"""RL weight sync and sampler / trainer agreement on SmolLM2-135M: ``Engine.update_params``
between rollouts (compiles, host time, stale prefix-cache hits), and the engine's per-token
log-probabilities against ``rl.token_logprobs`` on the same tokens and params.

    python -m experiments.rl_sync                 # both parts
    python -m experiments.rl_sync --only sync     # one part: sync | logprobs
    python -m experiments.rl_sync --quick         # a tiny random Llama (tests/tiny.py)

1. **sync**: one GRPO gradient (``rl.policy_loss`` over ``rl.token_logprobs`` of a first
   rollout, advantages from a toy reward), then ``--updates`` (100) optax ``adamw`` steps of
   every leaf; each step's params are ready before the clock starts, and only
   ``engine.update_params`` is timed (host work: the engine steps the new arrays uncopied).
   The loop keeps the previous params until the call has returned, then drops them, timed
   apart ("freeing the old tree": 540 MB of float32 buffers; where the engine holds the last
   reference, that free runs inside ``update_params``). After each update: a prompt ``X``
   alone (``num_cached_tokens`` must be 0: no K/V of older weights is served), a short
   ``rl.rollout`` of ``X`` (every token must carry the new weight version), ``X`` alone
   again (``num_cached_tokens > 0``: pages computed under the new weights are served).
   Compiles: the engine's ``stats().compiles`` around each call, after one untimed iteration
   (target 0); the rollouts ignore EOS, so every iteration runs the same shapes.
2. **logprobs**: ``rl.rollout`` of Q prompts x G samples at T = 0.7 (EOS ignored, so every row
   is ``--new`` tokens: Q * G * new >= 10,000 tokens per case), then ``rl.token_logprobs`` of
   the same tokens with the same params and the rows' ``RowSampling``; max |delta| and RMS over
   every generated token. Cases: float32 in modes "temperature", "raw" and "processed" (top-k
   50, top-p 0.95), and bfloat16 weights + bfloat16 compute in "temperature". In "processed" a
   token at the edge of the top-k / top-p set can be in the sampler's set and out of the
   trainer's (-inf): such tokens are counted and left out of the max and RMS.

Precision: ``jax_default_matmul_precision`` is set once for the process (``--precision``,
default "highest", what ``tests/conftest.py`` sets), before anything is traced, so the engine's
steps and the trainer's forward compile under the same setting. XLA:CPU computes float32 dots
in float32 at every setting; on a GPU "default" would use TF32 for float32 and miss 1e-4.

Writes ``results/rl_sync.json`` (``rl_sync_quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import paxkv
from paxkv import rl
from paxkv.core.sampling import make_params
from experiments.common import (Stopwatch, english_prompts, fill_defaults, finish, parser,
                                print_table, provenance, record, result_name)

TARGETS = dict(update_compiles=0, update_host_ms=5.0, stale_hit_tokens=0, float32_max=1e-4)
FIELD = dict(float32_rms=2e-3, bfloat16_rms=3e-2, sync_ms_0_5b=(150, 200))
CASES = (("float32", "temperature", None, None), ("float32", "raw", None, None),
         ("float32", "processed", 50, 0.95), ("bfloat16", "temperature", None, None))


# -- 1. weight sync ------------------------------------------------------------------------------
def grpo_gradient(lm: Any, out: rl.Rollouts, temperature: float) -> Any:
    """d(GRPO loss)/d(params) at ``lm.params`` over ``out`` (a toy reward: the share of
    distinct tokens in each completion), in mode "temperature"."""
    mask = jnp.asarray(out.completion_mask)
    rewards = jnp.asarray([len(set(t[m].tolist())) / max(1, m.sum()) for t, m in
                           zip(out.completion_tokens, out.completion_mask)])
    adv = rl.group_advantages(rewards, jnp.asarray(out.group_ids), int(out.group_ids.max()) + 1)
    sampling = make_params(len(out.group_ids), temperature=temperature)

    def loss(params: Any) -> jax.Array:
        lp = rl.token_logprobs(lm, params, out.prompt_tokens, out.prompt_mask,
                               out.completion_tokens, mask, sampling, mode="temperature")
        return rl.policy_loss(lp, jnp.asarray(out.logprobs), adv, mask)[0]

    return jax.jit(jax.grad(loss))(lm.params)


def alone(engine: paxkv.Engine, prompt: list[int]) -> paxkv.GenerationResult:
    """``prompt`` alone, one new token: its result (``num_cached_tokens``: prefix-cache hits)."""
    rid = engine.submit(prompt, max_new_tokens=1, stop_token_ids=())
    return engine.run()[rid]


class CompileNames(logging.Handler):
    """The programs XLA compiles while attached to the ``jax`` logger (with
    ``jax_log_compiles`` on): what a compile count is made of."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Finished XLA compilation of "):
            self.names.append(message.split(" of ", 1)[1].rsplit(" in ", 1)[0])


def one_update(engine: paxkv.Engine, params: Any, prompt: list[int], g: int,
               sp: paxkv.SamplingParams) -> dict[str, Any]:
    """``update_params(params)`` timed (the caller's previous params kept alive across it,
    then dropped and timed apart: freeing the old tree is the trainer's cost, and where the
    engine held its last reference the free would run inside the call), then ``prompt`` alone,
    a rollout of G samples, ``prompt`` alone again; compiles counted around each."""
    compiles = lambda: engine.stats().compiles.compiles  # noqa: E731
    previous, c0 = engine.params, compiles()
    t0 = time.perf_counter()
    update = engine.update_params(params)
    t1 = time.perf_counter()
    del previous  # the last reference to the old tree: its buffers are freed here
    t2 = time.perf_counter()
    c1 = compiles()
    first = alone(engine, prompt)
    out = rl.rollout(engine, [prompt], g, sp)
    again = alone(engine, prompt)
    versions = set(out.weight_versions[out.completion_mask].tolist())
    versions |= set(first.weight_versions) | set(again.weight_versions)
    return dict(update_ms=1e3 * (t1 - t0), release_ms=1e3 * (t2 - t1), placed=len(update.placed),
                compiles_update=c1 - c0, compiles_rollouts=compiles() - c1,
                dropped_pages=update.dropped_prefix_pages, stale_hit=first.num_cached_tokens,
                fresh_hit=again.num_cached_tokens, versions_ok=versions == {update.version})


def sync(lm: Any, prompt: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """Part 1: ``args.updates`` adamw steps, each handed to the engine and checked (one
    untimed iteration first, which compiles every shape the loop runs)."""
    import optax  # noqa: PLC0415

    engine = paxkv.Engine(lm, max_seqs=max(8, args.sync_group), logprobs_mode="temperature",
                          max_len=-(-(len(prompt) + args.sync_new + 1) // 16) * 16)
    sp = paxkv.SamplingParams(max_new_tokens=args.sync_new, temperature=args.temperature,
                              stop_token_ids=())
    grads = grpo_gradient(lm, rl.rollout(engine, [prompt], args.sync_group, sp),
                          args.temperature)
    opt = optax.adamw(args.lr)
    step = jax.jit(lambda p, s: (lambda u, s2: (optax.apply_updates(p, u), s2))(
        *opt.update(grads, s, p)))
    params, state = jax.block_until_ready(step(lm.params, opt.init(lm.params)))
    one_update(engine, params, prompt, args.sync_group, sp)
    rows, names = [], CompileNames()
    logging.getLogger("jax").addHandler(names)
    jax.config.update("jax_log_compiles", True)
    try:
        for _ in range(args.updates):
            params, state = jax.block_until_ready(step(params, state))  # ready before the clock
            rows.append(one_update(engine, params, prompt, args.sync_group, sp))
            rows[-1]["compiled"], names.names = names.names, []
    finally:
        jax.config.update("jax_log_compiles", False)
        logging.getLogger("jax").removeHandler(names)
    col = lambda k: [r[k] for r in rows]  # noqa: E731
    ms = dict(update=col("update_ms"), release=col("release_ms"))
    return dict(updates=len(rows), prompt_tokens=len(prompt), group=args.sync_group,
                new_tokens=args.sync_new, lr=args.lr,
                compiles=sum(col("compiles_update")) + sum(col("compiles_rollouts")),
                compiles_in_update=sum(col("compiles_update")),
                compiled={i: r["compiled"] for i, r in enumerate(rows) if r["compiled"]},
                **{f"{k}_ms_{stat}": f(v) for k, v in ms.items() for stat, f in
                   (("median", statistics.median), ("max", max),
                    ("p90", lambda x: float(np.percentile(x, 90))))},
                update_ms=ms["update"], release_ms=ms["release"],
                placed_leaves=sum(col("placed")), stale_hit_tokens=sum(col("stale_hit")),
                fresh_hits=sum(h > 0 for h in col("fresh_hit")),
                fresh_hit_tokens_median=statistics.median(col("fresh_hit")),
                dropped_pages_median=statistics.median(col("dropped_pages")),
                versions_ok=all(col("versions_ok")))


# -- 2. sampler vs trainer log-probabilities ------------------------------------------------------
def agreement(lm: Any, prompts: list[list[int]], args: argparse.Namespace, mode: str,
              top_k: int | None, top_p: float | None) -> dict[str, Any]:
    """One case: a rollout in ``mode``, the trainer's log-probabilities of its tokens, the
    differences over every generated token."""
    longest = max(map(len, prompts)) + args.new + 1
    engine = paxkv.Engine(lm, max_seqs=len(prompts) * args.group, logprobs_mode=mode,
                          max_len=-(-longest // 16) * 16, prefix_cache=False)
    sp = paxkv.SamplingParams(max_new_tokens=args.new, temperature=args.temperature,
                              top_k=top_k, top_p=top_p, seed=args.seed, stop_token_ids=())
    t0 = time.perf_counter()
    out = rl.rollout(engine, prompts, args.group, sp)
    rollout_s = time.perf_counter() - t0
    n = len(out.group_ids)
    sampling = make_params(n, temperature=args.temperature, top_k=top_k, top_p=top_p)
    chunk = next(c for c in (args.row_chunk, 8, 4, 2, 1) if c and n % c == 0)
    fn = rl.logprobs_fn(lm, mode=mode, row_chunk=chunk)
    t0 = time.perf_counter()
    trainer = np.asarray(fn(lm.params, out.prompt_tokens, out.prompt_mask,
                            out.completion_tokens, out.completion_mask, sampling))
    trainer_s = time.perf_counter() - t0
    mask = out.completion_mask
    finite = mask & np.isfinite(trainer) & np.isfinite(out.logprobs)
    delta = np.abs(trainer - out.logprobs)[finite]
    return dict(dtype=str(jnp.dtype(lm.compute_dtype)), mode=mode, top_k=top_k, top_p=top_p,
                tokens=int(mask.sum()), compared=int(delta.size),
                edge_tokens=int(mask.sum() - finite.sum()),
                max_abs=float(delta.max()), rms=float(np.sqrt(np.mean(delta ** 2))),
                mean_abs=float(delta.mean()), p99_abs=float(np.percentile(delta, 99)),
                sampler_mean_logprob=float(out.logprobs[finite].mean()),
                rollout_s=rollout_s, trainer_s=trainer_s, row_chunk=chunk)


def logprobs(models_by_dtype: dict[str, Any], prompts: list[list[int]],
             args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for dtype, mode, top_k, top_p in CASES:
        rows.append(agreement(models_by_dtype[dtype], prompts, args, mode, top_k, top_p))
        r = rows[-1]
        print(f"{dtype} {mode}: {r['compared']} tokens, max |d| {r['max_abs']:.2e}, RMS "
              f"{r['rms']:.2e} (rollout {r['rollout_s']:.0f} s, trainer {r['trainer_s']:.0f} s)",
              flush=True)
    return rows


# -- the report ----------------------------------------------------------------------------------
def report(results: dict[str, Any]) -> dict[str, bool]:
    met: dict[str, bool] = {}
    rows = []
    if "sync" in results:
        s = results["sync"]
        print(f"\n### update_params: {s['updates']} adamw updates of every leaf, each followed by "
              f"a {s['group']} x {s['new_tokens']}-token rollout of a {s['prompt_tokens']}-token "
              f"prompt")
        print_table(["compiles", "update_params ms median", "p90", "max",
                     "freeing the old tree ms median / max", "leaves copied",
                     "stale-hit tokens", "fresh hits", "every token on the new version"],
                    [[s["compiles"], f"{s['update_ms_median']:.3f}", f"{s['update_ms_p90']:.3f}",
                      f"{s['update_ms_max']:.3f}",
                      f"{s['release_ms_median']:.1f} / {s['release_ms_max']:.1f}",
                      s["placed_leaves"], s["stale_hit_tokens"],
                      f"{s['fresh_hits']} / {s['updates']}", s["versions_ok"]]])
        for name, value, goal, ok in (
                ("compiles over the updates", s["compiles"], "0", s["compiles"] == 0),
                ("update_params host ms (median)", f"{s['update_ms_median']:.3f}", "< 5",
                 s["update_ms_median"] < TARGETS["update_host_ms"]),
                ("update_params host ms (max)", f"{s['update_ms_max']:.3f}", "< 5",
                 s["update_ms_max"] < TARGETS["update_host_ms"]),
                ("stale prefix-cache hit tokens", s["stale_hit_tokens"], "0",
                 s["stale_hit_tokens"] == 0),
                ("fresh hits after the rollout", f"{s['fresh_hits']} / {s['updates']}", "all",
                 s["fresh_hits"] == s["updates"])):
            rows.append([name, value, goal, "met" if ok else "not met"])
            met[name] = bool(ok)
    if "logprobs" in results:
        print("\n### Sampler (engine) vs trainer (rl.token_logprobs) log-probabilities, T = "
              f"{results['config_temperature']}")
        print_table(["weights / compute", "mode", "tokens", "edge tokens (-inf)", "max |d| nats",
                     "RMS nats", "field's RMS"],
                    [[r["dtype"], r["mode"] + (f" (top-k {r['top_k']}, top-p {r['top_p']})"
                                               if r["top_k"] else ""),
                      r["compared"], r["edge_tokens"], f"{r['max_abs']:.2e}", f"{r['rms']:.2e}",
                      f"~{FIELD[r['dtype'] + '_rms']:.0e}"] for r in results["logprobs"]])
        for r in results["logprobs"]:
            if r["dtype"] == "float32":
                name = f"float32 {r['mode']} max |d|"
                ok = r["max_abs"] <= TARGETS["float32_max"]
                rows.append([name, f"{r['max_abs']:.2e}", "<= 1e-4", "met" if ok else "not met"])
                met[name] = bool(ok)
    print()
    print_table(["target", "measured", "goal", "met"], rows)
    return met


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = parser(__doc__, quick="a tiny random Llama, few updates and tokens: proves it runs")
    ap.add_argument("--only", choices=("sync", "logprobs"))
    ap.add_argument("--updates", type=int, help="update_params calls timed (default 100)")
    ap.add_argument("--sync-group", type=int, default=4, help="G of each short rollout")
    ap.add_argument("--sync-new", type=int, help="tokens per sample of each short rollout")
    ap.add_argument("--lr", type=float, default=1e-5, help="adamw learning rate")
    ap.add_argument("--prompts", type=int, help="Q prompts of the logprobs rollouts")
    ap.add_argument("--group", type=int, help="G samples per prompt (logprobs)")
    ap.add_argument("--new", type=int, help="tokens per sample (logprobs; EOS ignored)")
    ap.add_argument("--row-chunk", type=int, help="trainer rows per forward (default 8)")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--precision", default="highest",
                    choices=("default", "high", "highest"), help="jax_default_matmul_precision")
    ap.add_argument("--seed", type=int, default=0)
    return fill_defaults(ap.parse_args(argv),
                         full=dict(updates=100, sync_new=8, prompts=8, group=8, new=160),
                         quick=dict(updates=5, sync_new=4, prompts=2, group=4, new=16))


def load_models(quick: bool) -> tuple[dict[str, Any], Any]:
    """(float32 and bfloat16 models, the prompts' maker)."""
    if quick:
        from experiments.rl_rollouts import tiny_model  # noqa: PLC0415

        lm = tiny_model()
        lm16 = type(lm)(lm.config, jax.tree.map(lambda x: x.astype(jnp.bfloat16), lm.params),
                        lm.tokenizer, lm.name + "-bf16", jnp.bfloat16)
        return dict(float32=lm, bfloat16=lm16), lambda n: english_prompts(lm, n, 16, 40)
    from paxkv import models  # noqa: PLC0415
    from experiments.rl_rollouts import chat_prompts  # noqa: PLC0415

    lm = models.load()
    both = dict(float32=lm, bfloat16=models.load(dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16))
    return both, lambda n: chat_prompts(lm, n, 40, 80, 0)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    jax.config.update("jax_default_matmul_precision", args.precision)
    started, watch = provenance(), Stopwatch()
    lms, make_prompts = load_models(args.quick)
    prompts = make_prompts(max(args.prompts, 1))
    results: dict[str, Any] = dict(config_temperature=args.temperature)
    if args.only in (None, "sync"):
        results["sync"] = sync(lms["float32"], prompts[0], args)
        results["sync_s"] = watch.elapsed()["wall_s"]
    if args.only in (None, "logprobs"):
        results["logprobs"] = logprobs(lms, prompts, args)
    met = report(results)
    results.update(targets_met=met, **watch.elapsed())
    print(f"\nwall {results['wall_s']:.0f} s, CPU {results['cpu_s']:.0f} s")
    ok = "sync" not in results or (results["sync"]["versions_ok"]
                                   and results["sync"]["stale_hit_tokens"] == 0)
    config = dict(vars(args), **started, model=lms["float32"].name, targets=TARGETS,
                  field=FIELD, cases=CASES)
    finish(result_name("rl_sync", args.quick, args.only or ""), record(config, results), ok,
           "a rollout served K/V or tokens of older weights: no figure stands")


if __name__ == "__main__":
    main()
