"""GRPO in one process: paxkv rollouts, a verifiable reward, the policy loss on paxkv's trainer
log-probabilities, an optax step, ``engine.update_params``, and again.

    python -m experiments.grpo            # 5-10 min on 2 cores, the supervised warm start included
    python -m experiments.grpo --quick    # a smoke run (~20 s with a warm compile cache)
    python -m experiments.grpo --plot results/grpo.json   # redraws the figure

**The task** (verifiable): two-digit addition, ``"a+b="`` -> the sum as three digits and EOS
(``47+38=085``), over a vocabulary of 16 ids (the digits, ``+``, ``=``, EOS, BOS). Of the
10,000 pairs, ``--held-out`` (1,000) are never trained on, neither supervised nor by RL: the
held-out accuracy is greedy decoding of them through the paxkv engine, exact match. Reward 1
for a correct completion (its three digits, then EOS), plus ``--format-reward`` for three
digits then EOS (off by default).

**The model.** Not SmolLM2-135M: on these 2 cores it prefills ~480 tok/s, so one forward and
backward over a GRPO batch (256 completions of 16 tokens) would take ~25 s (three forwards'
worth), and the few dozen steps 15 minutes allow would teach it no arithmetic. A small Llama
(2 layers, hidden 64, 4 query heads over 2 kv heads of 16, vocabulary 16; ~100k parameters)
from random weights instead, which the experiment FIRST TEACHES the task partially: supervised
steps (optax ``adamw`` on :func:`paxkv.rl.token_logprobs`, the trainer forward GRPO uses) until
the greedy accuracy on training pairs reaches ``--sft-target`` (25%, checked every 25 steps:
the accuracy climbs steeply there, so it stops between 25% and 55%), then GRPO from there.

**One GRPO step**: ``--prompts`` (32) training pairs x ``--group`` (8) completions sampled at
temperature 1 by :func:`paxkv.rl.rollout` (paged engine, one prefill per prompt); rewards;
:func:`paxkv.rl.group_advantages`; one jitted ``value_and_grad`` of :func:`paxkv.rl.policy_loss`
over :func:`paxkv.rl.token_logprobs` (on-policy: one update per rollout, no KL term) plus
``optax.adamw``; ``engine.update_params(new_params)`` (nothing is in flight between rollouts, so
``in_flight=None``). Engine and trainer both use ``logprobs_mode="raw"`` (temperature 1, no
top-k: the distribution sampled). Each step reports the sampler-vs-trainer max |logprob
difference| and the largest importance ratio, and its time split into rollout / loss and update
/ weight swap. Programs compiled or loaded after the first step are counted where they happen:
``update_params`` (none expected), rollouts and evaluations (a new step shape or attention plan
when completion lengths vary), the trainer.

**Dense twin.** Every engine call also runs on an ``Engine(cache="dense")`` holding the same
K/V tokens (``max_seqs * max_len`` = the paged pool's tokens), with the same prompts, weights
and request ids (so the same sampling keys: the two engines see the same calls in the same
order): greedy evaluations must give identical tokens (no figure stands otherwise); sampled
rollouts are compared row by row (identical rows, and the max |logprob difference| on them);
rollout wall times side by side. At the end every page of both engines must be free.

Writes ``results/grpo.json`` (``grpo_quick.json``) and ``experiments/figures/grpo.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import paxkv
from paxkv import models, rl
from paxkv.core.compiles import CompileStats, counting
from paxkv.models.params import build_params, checkpoint_shapes
from experiments.common import (Stopwatch, cpu_model, fill_defaults, finish, parser,
                                print_table, provenance, record, result_name)

FIGURE = "experiments/figures/grpo.png"
PLUS, EQ, EOS, BOS = 10, 11, 12, 13
MODE = "raw"  # the engine's logprobs_mode and the trainer's


# -- the task ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Addition:
    """``a+b=`` with ``digits``-digit operands (zero-padded) -> the sum in ``digits + 1``
    digits, then EOS. Prompt ``[BOS, a..., +, b..., =]``."""

    digits: int = 2

    def prompt(self, a: int, b: int) -> list[int]:
        return [BOS, *self._digits(a, self.digits), PLUS, *self._digits(b, self.digits), EQ]

    def answer(self, a: int, b: int) -> list[int]:
        return [*self._digits(a + b, self.digits + 1), EOS]

    @staticmethod
    def _digits(x: int, n: int) -> list[int]:
        return [int(c) for c in str(int(x)).zfill(n)]

    def split(self, held_out: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """Every pair ``[N, 2]``, shuffled by ``seed``: (training pairs, held-out pairs)."""
        n = 10 ** self.digits
        pairs = np.stack(np.divmod(np.arange(n * n), n), axis=1)
        pairs = pairs[np.random.default_rng(seed).permutation(len(pairs))]
        return pairs[held_out:], pairs[:held_out]

    def rewards(self, completions: np.ndarray, mask: np.ndarray, pairs: np.ndarray,
                format_reward: float) -> np.ndarray:
        """float32 ``[N]``: 1 for exactly the answer (EOS included), else ``format_reward``
        for ``digits + 1`` digits then EOS, else 0."""
        out = np.zeros(len(pairs), np.float32)
        for i, ((a, b), row, m) in enumerate(zip(pairs, completions, mask)):
            got = row[m].tolist()
            if got == self.answer(a, b):
                out[i] = 1.0
            elif len(got) == self.digits + 2 and got[-1] == EOS and max(got[:-1]) < 10:
                out[i] = format_reward
        return out

    def text(self, tokens: list[int]) -> str:
        return "".join("0123456789+=$^"[t] if t < 14 else "?" for t in tokens)


def small_llama(hidden: int, layers: int, seed: int) -> models.LanguageModel:
    """A Llama of the task's vocabulary with random weights (std 0.02, norms 1), built from the
    checkpoint layout (no flax init)."""
    cfg = models.LlamaConfig(vocab_size=16, hidden_size=hidden, intermediate_size=3 * hidden,
                             num_layers=layers, num_heads=4, num_kv_heads=2,
                             head_dim=hidden // 4, tie_word_embeddings=True,
                             eos_token_ids=(EOS,), bos_token_id=BOS)
    rng, shapes = np.random.default_rng(seed), checkpoint_shapes(cfg)

    def fetch(name: str) -> np.ndarray:
        if name.endswith("norm"):
            return np.ones(shapes[name], np.float32)
        return rng.normal(0.0, 0.02, shapes[name]).astype(np.float32)

    return models.LanguageModel(cfg, build_params(cfg, fetch), None, f"llama-{hidden}x{layers}")


# -- the trainer: one jitted step each for supervised and GRPO ----------------------------------
def make_trainer(lm: models.LanguageModel, args: argparse.Namespace) -> dict[str, Any]:
    """The jitted steps. ``sft(params, state, P, PM, C, CM) -> (params, state, loss)``;
    ``grpo(params, state, P, PM, C, CM, old, adv) -> (params, state, stats)``, stats: loss,
    the sampler-vs-trainer max |logprob difference| (the params the gradient is taken at are
    the ones that sampled), the largest importance ratio, the clipped share, the gradient norm."""
    logprobs = rl.logprobs_fn(lm, mode=MODE)
    sft_opt = optax.adamw(optax.linear_schedule(0.0, args.sft_lr, 100), weight_decay=0.01)
    rl_opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(args.lr, weight_decay=0.0))

    @jax.jit
    def sft(params, state, p, pm, c, cm):
        loss, grads = jax.value_and_grad(
            lambda w: -jnp.mean(jnp.sum(logprobs(w, p, pm, c, cm), axis=1)))(params)
        updates, state = sft_opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    @jax.jit
    def grpo(params, state, p, pm, c, cm, old, adv):
        def loss_fn(w):
            new = logprobs(w, p, pm, c, cm)
            loss, stats = rl.policy_loss(new, old, adv, cm, clip=args.clip)
            gap = jnp.max(jnp.where(cm, jnp.abs(new - old), 0.0))
            return loss, dict(stats, logprob_gap=jax.lax.stop_gradient(gap))

        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, state = rl_opt.update(grads, state, params)
        return (optax.apply_updates(params, updates), state,
                dict(stats, loss=loss, grad_norm=jnp.sqrt(sum(
                    jnp.sum(g ** 2) for g in jax.tree.leaves(grads)))))

    return dict(sft=sft, grpo=grpo, sft_init=sft_opt.init, rl_init=rl_opt.init,
                paid=CompileStats())


# -- the engines: paged, and the dense twin of the same K/V tokens ------------------------------
def make_engines(lm: models.LanguageModel, args: argparse.Namespace) -> dict[str, paxkv.Engine]:
    """``paged``: ``kv_tokens / page_size`` pages, up to ``paged_rows`` rows; ``dense``:
    ``kv_tokens / max_len`` rows of ``max_len``: the same K/V bytes."""
    common = dict(max_len=args.max_len, logprobs_mode=MODE, prefill_chunk=64)
    return dict(
        paged=paxkv.Engine(lm, max_seqs=args.paged_rows, page_size=args.page_size,
                           num_pages=args.kv_tokens // args.page_size, **common),
        dense=paxkv.Engine(lm, cache="dense", max_seqs=args.kv_tokens // args.max_len,
                           **common))


def rollouts(engines: dict[str, paxkv.Engine], prompts: list[list[int]], group: int,
             sampling: paxkv.SamplingParams, args: argparse.Namespace
             ) -> tuple[dict[str, rl.Rollouts], dict[str, float], dict[str, int]]:
    """The same rollout on every engine (same calls in the same order: the same request ids,
    so the same sampling keys): the rollouts, each one's wall seconds and the programs each
    engine compiled or loaded for it."""
    out, seconds, paid = {}, {}, {}
    for name, engine in engines.items():
        before, start = programs(engine), time.perf_counter()
        out[name] = rl.rollout(engine, prompts, group, sampling, prompt_width=args.prompt_width,
                               completion_width=args.completion_width)
        seconds[name], paid[name] = time.perf_counter() - start, programs(engine) - before
    return out, seconds, paid


def agreement(outs: dict[str, rl.Rollouts]) -> dict[str, Any]:
    """Paged vs dense, row by row: the share of rows with identical tokens and the max
    |logprob difference| over those rows' tokens."""
    a, b = outs["paged"], outs["dense"]
    same = np.all((a.completion_tokens == b.completion_tokens)
                  & (a.completion_mask == b.completion_mask), axis=1)
    mask = a.completion_mask & same[:, None]
    gap = float(np.max(np.abs(a.logprobs - b.logprobs)[mask], initial=0.0))
    return dict(rows_identical=float(same.mean()), logprob_gap=gap)


def evaluate(engines: dict[str, paxkv.Engine], task: Addition, pairs: np.ndarray,
             args: argparse.Namespace) -> dict[str, Any]:
    """Greedy accuracy (exact match) of ``pairs`` on every engine, under its current weights;
    ``identical``: the engines gave the same tokens on every row."""
    greedy = paxkv.SamplingParams(max_new_tokens=args.max_new, temperature=0.0,
                                  stop_token_ids=(EOS,))
    outs, seconds, paid = rollouts(engines, [task.prompt(a, b) for a, b in pairs], 1, greedy,
                                   args)
    acc = {n: float(task.rewards(o.completion_tokens, o.completion_mask, pairs, 0.0).mean())
           for n, o in outs.items()}
    return dict(accuracy=acc["paged"], dense_accuracy=acc["dense"],
                identical=agreement(outs)["rows_identical"] == 1.0, seconds=seconds,
                programs=paid)


def update(engines: dict[str, paxkv.Engine], params: Any) -> dict[str, Any]:
    """``update_params`` on every engine (nothing in flight: ``in_flight=None``): the paged
    engine's wall seconds, and the programs any update compiled or loaded."""
    paid, seconds = CompileStats(), {}
    for name, engine in engines.items():
        start = time.perf_counter()
        with counting(paid):
            engine.update_params(params)
        seconds[name] = time.perf_counter() - start
    return dict(seconds=seconds["paged"], programs=paid.compiles + paid.cache_loads)


def programs(engine: paxkv.Engine) -> int:
    """Programs the engine compiled or loaded from the persistent cache so far."""
    return engine.compile_stats.compiles + engine.compile_stats.cache_loads


# -- the two phases ------------------------------------------------------------------------------
def batch(task: Addition, pairs: np.ndarray, args: argparse.Namespace) -> tuple[np.ndarray, ...]:
    """Supervised rows in the rollout layout: prompts left-padded to ``prompt_width``, answers
    right-padded to ``completion_width``."""
    n = len(pairs)
    p = np.zeros((n, args.prompt_width), np.int32)
    c = np.zeros((n, args.completion_width), np.int32)
    pm, cm = np.zeros(p.shape, bool), np.zeros(c.shape, bool)
    for i, (a, b) in enumerate(pairs):
        prompt, answer = task.prompt(a, b), task.answer(a, b)
        p[i, -len(prompt):], pm[i, -len(prompt):] = prompt, True
        c[i, :len(answer)], cm[i, :len(answer)] = answer, True
    return p, pm, c, cm


def warm_start(params: Any, trainer: dict[str, Any], engines: dict[str, paxkv.Engine],
               task: Addition, train: np.ndarray, rng: np.random.Generator,
               args: argparse.Namespace) -> tuple[Any, list[dict[str, Any]]]:
    """Supervised steps until the greedy accuracy on ``check_pairs`` training pairs (through
    the engines) reaches ``sft_target``, checked every ``sft_every`` steps, at most
    ``sft_steps``."""
    state, history, check = trainer["sft_init"](params), [], train[:args.check_pairs]
    for step in range(1, args.sft_steps + 1):
        pairs = train[rng.integers(0, len(train), args.sft_batch)]
        params, state, loss = trainer["sft"](params, state, *batch(task, pairs, args))
        if step % args.sft_every == 0 or step == args.sft_steps:
            update(engines, params)
            ev = evaluate(engines, task, check, args)
            history.append(dict(step=step, loss=float(loss), train_accuracy=ev["accuracy"],
                                identical=ev["identical"]))
            print(f"  supervised step {step}: loss {float(loss):.3f}, greedy accuracy on "
                  f"training pairs {ev['accuracy']:.1%}", flush=True)
            if ev["accuracy"] >= args.sft_target:
                break
    return params, history


def grpo_step(params: Any, state: Any, trainer: dict[str, Any],
              engines: dict[str, paxkv.Engine], task: Addition, pairs: np.ndarray,
              step: int, args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    """Rollout (paged, then the dense twin for comparison) -> rewards -> advantages -> the
    jitted loss, gradient and adamw step -> ``update_params``; the step's figures (the
    trainer's compiles counted in ``trainer["paid"]``)."""
    sampling = paxkv.SamplingParams(max_new_tokens=args.max_new, temperature=1.0,
                                    seed=args.seed, stop_token_ids=(EOS,), logprobs=0)
    outs, roll_s, roll_programs = rollouts(engines, [task.prompt(a, b) for a, b in pairs],
                                           args.group, sampling, args)
    ro = outs["paged"]
    start = time.perf_counter()
    rewards = task.rewards(ro.completion_tokens, ro.completion_mask, pairs[ro.group_ids],
                           args.format_reward)
    adv = rl.group_advantages(jnp.asarray(rewards), jnp.asarray(ro.group_ids), len(pairs))
    reward_s = time.perf_counter() - start
    start = time.perf_counter()
    with counting(trainer["paid"]):
        params, state, stats = trainer["grpo"](params, state, ro.prompt_tokens, ro.prompt_mask,
                                               ro.completion_tokens, ro.completion_mask,
                                               ro.logprobs, adv)
        stats = {k: float(v) for k, v in jax.block_until_ready(stats).items()}
    train_s = time.perf_counter() - start
    swap = update(engines, params)
    versions = ro.weight_versions[ro.completion_mask]
    return params, state, dict(
        step=step, reward=float(rewards.mean()), correct=float((rewards == 1.0).mean()),
        **stats, rollout_s=roll_s["paged"], dense_rollout_s=roll_s["dense"],
        reward_s=reward_s, train_s=train_s, swap_s=swap["seconds"],
        rollout_programs=roll_programs, swap_programs=swap["programs"],
        one_version=bool((versions == versions[0]).all()),
        mean_completion=float(ro.completion_lengths.mean()), **{
            f"dense_{k}": v for k, v in agreement(outs).items()})


def run_grpo(params: Any, trainer: dict[str, Any], engines: dict[str, paxkv.Engine],
             task: Addition, train: np.ndarray, held: np.ndarray, rng: np.random.Generator,
             args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """``steps`` GRPO steps, the held-out accuracy every ``eval_every``; the engines' and the
    trainer's programs compiled or loaded after the first step."""
    state, steps, evals = trainer["rl_init"](params), [], []
    evals.append(dict(step=0, **evaluate(engines, task, held, args)))
    print(f"  held-out greedy accuracy before GRPO: {evals[0]['accuracy']:.1%}", flush=True)
    trainer_paid, after_first = trainer["paid"], {}
    for step in range(1, args.steps + 1):
        pairs = train[rng.choice(len(train), args.prompts, replace=False)]
        params, state, row = grpo_step(params, state, trainer, engines, task, pairs, step, args)
        steps.append(row)
        if step % args.eval_every == 0 or step == args.steps:
            evals.append(dict(step=step, **evaluate(engines, task, held, args)))
            print(f"  step {step}: reward {np.mean([s['reward'] for s in steps[-10:]]):.3f} "
                  f"(last 10), held-out accuracy {evals[-1]['accuracy']:.1%}", flush=True)
        if step == 1:
            after_first = dict({n: programs(e) for n, e in engines.items()},
                               trainer=trainer_paid.compiles + trainer_paid.cache_loads)
    compiled = {n: programs(e) - after_first[n] for n, e in engines.items()}
    compiled["trainer"] = trainer_paid.compiles + trainer_paid.cache_loads - after_first["trainer"]
    compiled["rollouts"] = {n: sum(s["rollout_programs"][n] for s in steps[1:]) for n in engines}
    compiled["evaluations"] = {n: sum(e["programs"][n] for e in evals if e["step"] > 1)
                               for n in engines}
    return params, dict(steps=steps, evals=evals, programs_after_first_step=compiled,
                        swap_programs=sum(s["swap_programs"] for s in steps))


# -- the record, the report and the figure ------------------------------------------------------
def leaked_pages(engine: paxkv.Engine) -> int:
    """Pages (a dense cache: rows) not free once the prefix cache is cleared."""
    engine.clear_prefix_cache()
    stats = engine.stats()
    return stats.num_pages - stats.free_pages


def summarise(res: dict[str, Any]) -> dict[str, Any]:
    """The headline figures of a run's per-step rows and evaluations."""
    steps, evals = res["steps"], res["evals"]
    parts = ("rollout_s", "reward_s", "train_s", "swap_s")
    totals = {p: sum(s[p] for s in steps) for p in parts}
    step_s = [sum(s[p] for p in parts) for s in steps]
    before, after = evals[0]["accuracy"], evals[-1]["accuracy"]
    return dict(
        accuracy_before=before, accuracy_after=after, gain_points=100 * (after - before),
        time_split=dict(median_ms={p: 1e3 * statistics.median(s[p] for s in steps)
                                   for p in parts},
                        share={p: totals[p] / sum(totals.values()) for p in parts},
                        median_step_ms=1e3 * statistics.median(step_s)),
        rollout_ms=dict(paged=1e3 * statistics.median(s["rollout_s"] for s in steps),
                        dense=1e3 * statistics.median(s["dense_rollout_s"] for s in steps)),
        sampled_rows_identical=statistics.mean(s["dense_rows_identical"] for s in steps),
        paged_vs_dense_logprob_gap=max(s["dense_logprob_gap"] for s in steps),
        greedy_identical=all(e["identical"] for e in evals),
        logprob_gap_max=max(s["logprob_gap"] for s in steps),
        logprob_gap_median=statistics.median(s["logprob_gap"] for s in steps),
        ratio_max=max(s["ratio_max"] for s in steps),
        one_weight_version_per_rollout=all(s["one_version"] for s in steps))


def report(rec: dict[str, Any]) -> None:
    res, s, cfg = rec["results"], rec["results"]["summary"], rec["config"]
    print(f"\nCPU: {rec['cpu']}; model {res['model']} ({res['parameters']:,} parameters), "
          f"supervised warm start: {res['sft_steps']} steps ({res['sft_seconds']:.0f} s) to "
          f"{res['sft'][-1]['train_accuracy']:.1%} on training pairs, then GRPO.\n")
    print_table(["held-out greedy accuracy", "value"], [
        ["before GRPO (after the warm start)", f"{s['accuracy_before']:.1%}"],
        [f"after {len(res['steps'])} GRPO steps ({res['grpo_seconds']:.0f} s)",
         f"{s['accuracy_after']:.1%}"],
        ["gain (target: >= 20 points)", f"{s['gain_points']:+.1f} points"]])
    print()
    chunk = max(1, len(res["steps"]) // 10)
    rows = []
    for i in range(0, len(res["steps"]), chunk):
        part = res["steps"][i:i + chunk]
        rows.append([f"{part[0]['step']}-{part[-1]['step']}",
                     f"{np.mean([p['reward'] for p in part]):.3f}",
                     f"{max(p['logprob_gap'] for p in part):.1e}",
                     f"{max(p['ratio_max'] for p in part):.6f}",
                     f"{np.mean([p['rollout_s'] for p in part]) * 1e3:.0f} / "
                     f"{np.mean([p['dense_rollout_s'] for p in part]) * 1e3:.0f}"])
    print_table(["steps", "mean reward", "max |logprob gap|", "max ratio",
                 "rollout ms paged / dense"], rows)
    print()
    ts = s["time_split"]
    print_table(["step part", "median ms", "share of step time"], [
        [p.removesuffix("_s"), f"{ts['median_ms'][p]:.1f}", f"{ts['share'][p]:.1%}"]
        for p in ("rollout_s", "reward_s", "train_s", "swap_s")] +
        [["whole step", f"{ts['median_step_ms']:.1f}", "100%"]])
    print()
    ck = res["checks"]
    after = ck["programs_after_first_step"]
    print_table(["check", "value"], [
        ["rollout median ms, paged / dense (same KV tokens)",
         f"{s['rollout_ms']['paged']:.0f} / {s['rollout_ms']['dense']:.0f} "
         f"({s['rollout_ms']['dense'] / s['rollout_ms']['paged']:.2f}x)"],
        ["most rows decoding at once, paged / dense",
         f"{ck['peak_running']['paged']} / {ck['peak_running']['dense']}"],
        ["sampled rows identical, paged vs dense (same keys, weights)",
         f"{s['sampled_rows_identical']:.2%} (max |logprob diff| "
         f"{s['paged_vs_dense_logprob_gap']:.1e})"],
        ["greedy tokens identical, paged vs dense, every evaluation", str(s["greedy_identical"])],
        ["sampler vs trainer max |logprob gap| (median of steps)",
         f"{s['logprob_gap_max']:.1e} ({s['logprob_gap_median']:.1e})"],
        ["max importance ratio", f"{s['ratio_max']:.6f}"],
        ["programs compiled or loaded after step 1: paged / dense / trainer",
         " / ".join(str(after[k]) for k in ("paged", "dense", "trainer"))],
        ["  of them in rollouts, paged / dense (new step shapes or plans)",
         f"{after['rollouts']['paged']} / {after['rollouts']['dense']}"],
        ["  of them in held-out evaluations, paged / dense",
         f"{after['evaluations']['paged']} / {after['evaluations']['dense']}"],
        ["programs compiled by update_params (every step)", str(ck["swap_programs"])],
        ["leaked pages paged / dense rows", f"{ck['leaked']['paged']} / {ck['leaked']['dense']}"],
        ["whole run wall s", f"{res['wall_s']:.0f}"]])
    print(f"\n20-point target {'met' if s['gain_points'] >= 20 else 'NOT met'}"
          f"{' (quick run: sizes too small to train)' if cfg['quick'] else ''}.")


def plot(rec: dict[str, Any], path: str) -> None:
    """Reward per GRPO step (and its 20-step mean); held-out greedy accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from experiments.plots import stamp

    res = rec["results"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    x = [s["step"] for s in res["steps"]]
    r = np.array([s["reward"] for s in res["steps"]])
    a.plot(x, r, lw=0.6, alpha=0.5, label="mean reward of the step's rollouts")
    w = min(20, len(r))
    a.plot(x[w - 1:], np.convolve(r, np.ones(w) / w, "valid"), label=f"{w}-step mean")
    a.set(title="reward per GRPO step", xlabel="GRPO step", ylim=(0, 1))
    a.legend(fontsize=8)
    e = res["evals"]
    b.plot([v["step"] for v in e], [100 * v["accuracy"] for v in e], marker="o")
    b.axhline(100 * e[0]["accuracy"] + 20, color="grey", ls=":", label="before + 20 points")
    b.set(title=f"held-out greedy accuracy ({rec['config']['held_out']} pairs)",
          xlabel="GRPO step", ylabel="%", ylim=(0, 100))
    b.legend(fontsize=8)
    fig.suptitle(stamp(rec, "grpo"), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


# -- the command ---------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = parser(__doc__, quick="small sizes: proves it runs (no accuracy target)")
    for name, kind, what in (
            ("seed", int, "the data, init and sampling seed"),
            ("steps", int, "GRPO steps"), ("prompts", int, "prompts per GRPO step"),
            ("group", int, "completions per prompt (G)"), ("lr", float, "GRPO adamw rate"),
            ("clip", float, "the ratio's clip"), ("format_reward", float, "reward of a "
             "well-formed wrong answer"),
            ("sft_lr", float, "supervised adamw rate"), ("sft_steps", int, "most supervised "
             "steps"), ("sft_batch", int, "supervised rows a step"),
            ("sft_every", int, "supervised steps between accuracy checks"),
            ("sft_target", float, "stop the warm start at this training accuracy"),
            ("check_pairs", int, "training pairs the warm start checks"),
            ("held_out", int, "pairs never trained on"),
            ("eval_every", int, "GRPO steps between held-out evaluations"),
            ("hidden", int, "model width"), ("layers", int, "model layers"),
            ("max_new", int, "tokens a completion may have"),
            ("max_len", int, "the engines' max_len"),
            ("kv_tokens", int, "K/V tokens of each engine"), ("page_size", int, "paged"),
            ("paged_rows", int, "the paged engine's rows")):
        ap.add_argument("--" + name.replace("_", "-"), type=kind, help=what)
    ap.add_argument("--plot", help="redraw the figure from this record and exit")
    args = ap.parse_args(argv)
    common = dict(seed=0, clip=0.2, format_reward=0.0, sft_lr=3e-3, sft_batch=128,
                  hidden=64, layers=2, max_new=6, max_len=16, page_size=4, lr=1e-4)
    fill_defaults(args, quick=dict(common, steps=6, prompts=8, group=4, sft_steps=300,
                                   sft_every=100, sft_target=0.25, check_pairs=64,
                                   held_out=128, eval_every=3, kv_tokens=256, paged_rows=32),
                  full=dict(common, steps=400, prompts=32, group=8, sft_steps=2000,
                            sft_every=25, sft_target=0.25, check_pairs=256, held_out=1000,
                            eval_every=50, kv_tokens=2048, paged_rows=256))
    args.prompt_width = -(-(2 * 2 + 3) // 8) * 8  # [BOS, a, a, +, b, b, =]
    args.completion_width = -(-args.max_new // 8) * 8
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole experiment; returns its record."""
    config, watch = dict(vars(args), **provenance()), Stopwatch()
    task = Addition()
    train, held = task.split(args.held_out, args.seed)
    rng = np.random.default_rng(args.seed)
    lm = small_llama(args.hidden, args.layers, args.seed)
    trainer, engines = make_trainer(lm, args), make_engines(lm, args)
    print(f"model {lm.name}: a small Llama taught the task by a supervised warm start, then "
          f"GRPO (SmolLM2-135M cannot train in this time on these cores)", flush=True)
    start = time.perf_counter()
    params, sft = warm_start(lm.params, trainer, engines, task, train, rng, args)
    sft_seconds, start = time.perf_counter() - start, time.perf_counter()
    params, res = run_grpo(params, trainer, engines, task, train, held, rng, args)
    grpo_seconds = time.perf_counter() - start
    checks = dict(programs_after_first_step=res.pop("programs_after_first_step"),
                  swap_programs=res.pop("swap_programs"),
                  leaked={n: leaked_pages(e) for n, e in engines.items()},
                  peak_running={n: e.stats().peak_running for n, e in engines.items()},
                  paged_all_free=int(engines["paged"].cache.free_pages())
                  == engines["paged"].cache.num_pages)
    results = dict(res, model=lm.name, parameters=int(sum(x.size for x in
                                                          jax.tree.leaves(lm.params))),
                   sft=sft, sft_steps=sft[-1]["step"], sft_seconds=sft_seconds,
                   grpo_seconds=grpo_seconds, checks=checks, summary=summarise(res),
                   cpu=cpu_model(), **watch.elapsed())
    return record(config, results)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.plot:
        with open(args.plot) as f:
            plot(json.load(f), FIGURE)
        return
    rec = run(args)
    report(rec)
    s, ck = rec["results"]["summary"], rec["results"]["checks"]
    ok = (s["greedy_identical"] and s["logprob_gap_max"] < 1e-4 and ck["paged_all_free"]
          and not any(ck["leaked"].values()))
    if ok and not args.quick:
        plot(rec, FIGURE)
    finish(result_name("grpo", args.quick), rec, ok,
           failed="paged and dense disagreed, the logprobs drifted or pages leaked: no "
                  "figure stands")


if __name__ == "__main__":
    main()
