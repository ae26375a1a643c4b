"""The whole model's decode step on a GPU: paged through the Pallas kernels, paged through the
XLA reference, and dense.

The lent GPU machine cannot receive the 98 MB GGUF file, so the model here has SmolLM2-135M's
exact shapes (30 layers, 9 query / 3 kv heads of 64, hidden 576, vocab 49,152) and random
weights; speed does not depend on the weights, and the correctness checks compare the three
paths with each other on identical K/V:

1. **prefill**: a batch of ragged random prompts through ``steps.prefill_step`` on a fresh
   paged cache made with ``attention_impl="pallas"`` (``write_kv`` + the prefill kernel) and
   one made with ``"xla"``; greedy next tokens must agree.
2. **decode**: per (batch, context) cell, one cache of each kind filled with the same hashed K/V
   (``experiments.hashed_kv.filled_cache``); one step's logits of paged-pallas and paged-xla
   against dense (per-row relative error, float32 matmuls at "highest" precision: XLA's
   default on a GPU is TF32), then donated ``steps.decode_step`` calls timed
   (warm-up, ``block_until_ready``, median), the three variants interleaved step by step.

    python -m experiments.gpu_model             # < 3 min on an H200
    python -m experiments.gpu_model --tiny      # 2 layers, interpret mode: a CPU smoke run

Writes ``results/gpu_model.json`` and prints a table.
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paxkv import models
from experiments.common import parser, print_table, provenance, record, timed_rounds, write_json
from experiments.hashed_kv import filled_cache, step_logits, window_plan
from paxkv.models.params import build_params, checkpoint_shapes
from paxkv.cache import paged as paged_cache
from paxkv.core import steps

SMOLLM2_135M = models.LlamaConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
    num_kv_heads=3, head_dim=64, rope_theta=100000.0, tie_word_embeddings=True)
CELLS = [(64, 2048), (64, 512), (256, 2048), (8, 2048)]
TINY_CELLS = [(2, 64)]
VARIANTS = (("paged", "pallas"), ("paged", "pallas_mma"), ("paged", "xla"), ("dense", "xla"))


def random_model(config: models.LlamaConfig, seed: int = 0) -> models.LanguageModel:
    """SmolLM2-shaped weights drawn at the scale of a trained model's (std 0.05; norms 1)."""
    rng = np.random.default_rng(seed)
    shapes = checkpoint_shapes(config)

    def fetch(name: str) -> np.ndarray:
        if name.rsplit(".", 1)[-1] in ("input_norm", "post_attn_norm") or name == "final_norm":
            return np.ones(shapes[name], np.float32)
        return rng.normal(0.0, 0.05, shapes[name]).astype(np.float32)

    return models.LanguageModel(config, build_params(config, fetch), tokenizer=None,
                                name="random-smollm2-135m")


def prefill_check(lm: models.LanguageModel, batch: int, max_prompt: int,
                  kv_dtype: Any = jnp.float32) -> dict[str, Any]:
    """Greedy next tokens after a ragged prefill, Pallas vs XLA, on fresh paged caches."""
    c = lm.config
    rng = np.random.default_rng(1)
    query_lengths = jnp.asarray(rng.integers(1, max_prompt + 1, batch), jnp.int32)
    tokens = jnp.asarray(rng.integers(0, c.vocab_size, (batch, max_prompt)), jnp.int32)
    rows = jnp.arange(batch, dtype=jnp.int32)
    out = {}
    for impl in ("pallas", "xla"):
        cache = paged_cache.create(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
                                   head_dim=c.head_dim, num_pages=batch * (max_prompt // 16 + 1),
                                   page_size=16, max_seqs=batch, max_len=max_prompt,
                                   attention_impl=impl, dtype=kv_dtype)
        _, nxt, ok, _ = steps.prefill_step(lm.forward, lm.params, cache, tokens, rows,
                                           query_lengths, None)
        assert bool(ok.all()), f"{impl} prefill failed to reserve"
        out[impl] = np.asarray(nxt)
    return dict(batch=batch, max_prompt=max_prompt,
                tokens_equal_fraction=float((out["pallas"] == out["xla"]).mean()))


def decode_cell(lm: models.LanguageModel, batch: int, context: int, args) -> dict[str, Any]:
    filled = context - (args.warmup + args.repeats) - 1
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, lm.config.vocab_size, batch),
                         jnp.int32)
    plan = window_plan(context)
    caches = {v: filled_cache(lm, v[0], batch, context, filled, attention_impl=v[1],
                              kv_dtype=jnp.dtype(args.kv_dtype)) for v in VARIANTS}
    with jax.default_matmul_precision("highest"):  # XLA's einsums would otherwise run in TF32
        logits = {v: np.asarray(step_logits(lm.forward, lm.params, caches[v], tokens, plan))
                  for v in VARIANTS}
    dense = logits["dense", "xla"]
    rel = lambda x: float((np.linalg.norm(x - dense, axis=1)  # noqa: E731
                           / np.linalg.norm(dense, axis=1)).max())
    row: dict[str, Any] = dict(batch=batch, context=context, filled=filled,
                               pallas_logit_rel_err=rel(logits["paged", "pallas"]),
                               mma_logit_rel_err=rel(logits["paged", "pallas_mma"]),
                               xla_logit_rel_err=rel(logits["paged", "xla"]),
                               argmax_equal=bool(all((logits[v].argmax(1) == dense.argmax(1)).all()
                                                     for v in VARIANTS)))
    live = jnp.ones((batch,), bool)
    state, oks = {v: (caches.pop(v), tokens) for v in VARIANTS}, []

    def step(v: tuple[str, str]):
        def call():
            cache, last = state[v]
            cache, nxt, ok, _ = steps.decode_step(lm.forward, lm.params, cache, last, live, None,
                                                  plan=plan)
            state[v] = (cache, nxt)
            oks.append(ok)
            return nxt
        return call

    timings = timed_rounds({v: step(v) for v in VARIANTS}, repeats=args.repeats,
                           warmup=args.warmup)
    assert all(bool(ok.all()) for ok in oks), "a decode step failed to reserve"
    nxt = {v: state[v][1] for v in VARIANTS}
    state.clear()
    for (kind, impl), t in timings.items():
        row[f"{kind}_{impl}_ms"] = 1e3 * t.median_s
        row[f"{kind}_{impl}_tok_s"] = batch / t.median_s
    row["pallas_vs_xla"] = row["paged_xla_ms"] / row["paged_pallas_ms"]
    row["pallas_vs_dense"] = row["dense_xla_ms"] / row["paged_pallas_ms"]
    row["mma_vs_pallas"] = row["paged_pallas_ms"] / row["paged_pallas_mma_ms"]
    # timed steps run at the default precision (TF32 in XLA's einsums, f32 in the kernels), so
    # with random weights' near-flat logits a greedy token can flip: reported, not asserted
    row["timed_tokens_equal_fraction"] = float(np.mean(
        [(nxt[v] == nxt["dense", "xla"]).mean() for v in VARIANTS]))
    return row


def main(argv=None) -> dict[str, Any]:
    ap = parser(__doc__, quick=None)
    ap.add_argument("--tiny", action="store_true", help="2 layers, interpret mode on CPU")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--kv-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="pages' dtype (bfloat16: the model computes in it too, and "
                         "'pallas_mma' decodes on tensor cores; float32: it falls back)")
    args = ap.parse_args(argv)
    if jax.default_backend() != "gpu" and not args.tiny:
        sys.exit("experiments.gpu_model needs a GPU; --tiny runs a CPU smoke test")
    config = SMOLLM2_135M
    if args.tiny:
        import dataclasses  # noqa: PLC0415
        config = dataclasses.replace(config, num_layers=2)
        args.warmup, args.repeats = 1, 2
    started = provenance()
    lm = random_model(config)
    if args.kv_dtype == "bfloat16":
        lm = models.LanguageModel(lm.config, lm.params, None, lm.name, jnp.bfloat16)
    dev = jax.devices()[0]
    print(f"device {dev.platform}:{dev.device_kind}, jax {jax.__version__}", flush=True)
    with jax.default_matmul_precision("highest"):
        pre = prefill_check(lm, batch=4 if args.tiny else 16,
                            max_prompt=32 if args.tiny else 256,
                            kv_dtype=jnp.dtype(args.kv_dtype))
    print(f"prefill: Pallas vs XLA greedy tokens equal: {pre['tokens_equal_fraction']:.0%}",
          flush=True)
    rows = []
    for batch, context in TINY_CELLS if args.tiny else CELLS:
        try:
            rows.append(decode_cell(lm, batch, context, args))
        except Exception as e:  # noqa: BLE001 - report the cell, keep the sweep going
            rows.append(dict(batch=batch, context=context, error=f"{type(e).__name__}: {e}"[:300]))
        print(rows[-1], flush=True)
    ok = [r for r in rows if "error" not in r]
    print_table(["batch", "context", "pallas ms", "mma ms", "xla ms", "dense ms",
                 "pallas tok/s", "xla/pallas", "dense/pallas", "logit err (pallas)",
                 "argmax equal"],
                [[r["batch"], r["context"], f"{r['paged_pallas_ms']:.2f}",
                  f"{r['paged_pallas_mma_ms']:.2f}",
                  f"{r['paged_xla_ms']:.2f}", f"{r['dense_xla_ms']:.2f}",
                  f"{r['paged_pallas_tok_s']:.0f}", f"{r['pallas_vs_xla']:.2f}x",
                  f"{r['pallas_vs_dense']:.2f}x", f"{r['pallas_logit_rel_err']:.1e}",
                  r["argmax_equal"]] for r in ok])
    result = record(dict(vars(args), model=lm.name, **started), dict(prefill=pre, cells=rows))
    suffix = "" if args.kv_dtype == "float32" else f"_{args.kv_dtype}"
    write_json(("gpu_model_tiny" if args.tiny else "gpu_model") + suffix, result)
    return result


if __name__ == "__main__":
    main()
