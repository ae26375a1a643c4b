"""The engine end to end on a GPU: ``paxkv.generate`` against HF transformers' ``generate``
with a static cache, on the same device, and how much of the engine's time the device idles.

The lent GPU machine has no model files, so both sides run random weights of a real shape
(speed does not depend on the weights): SmolLM2-135M's, and a ~1.2B Llama (Llama-3.2-1B's
shape). Per model: 64 prompts of 512 random tokens, 256 new tokens each (no stop token), all
in bfloat16 (weights, activations, K/V). paxkv runs once untimed (compiles), then is timed
for each ``attention_impl`` ("pallas": the CUDA-core decode kernel; "pallas_mma": decode on
tensor cores); HF runs ``generate`` twice and the second is timed.

**Device idle share.** The same decode step is timed back to back on a cache of the same
shape (``steps.decode_step`` dispatched without waiting: device-bound), and a generation of
one new token gives the prefill's time; ``idle = 1 - (prefill + 255 x step) / generation``: the
share of the engine's wall time the device had nothing queued (host planning, transfers,
waits).

    python -m experiments.gpu_engine             # < 4 min on an H200
    python -m experiments.gpu_engine --tiny      # a CPU smoke run: 2 layers, XLA attention

Writes ``results/gpu_engine.json`` and prints a table.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import paxkv
from experiments.common import parser, print_table, provenance, record, timed, write_json
from experiments.gpu_model import SMOLLM2_135M, random_model
from experiments.hashed_kv import filled_cache
from paxkv import models
from paxkv.core import steps

LLAMA_1B = models.LlamaConfig(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
    num_kv_heads=8, head_dim=64, rope_theta=500000.0, tie_word_embeddings=True)
SHAPES = {"smollm2-135m": SMOLLM2_135M, "llama-1.2b": LLAMA_1B}


def paxkv_runs(lm, prompts: np.ndarray, new: int, impl: str) -> dict[str, float]:
    """Seconds of a warm ``generate`` of ``new`` tokens and of one token (the prefill)."""
    kw = dict(kv_dtype=jnp.bfloat16, attention_impl=impl, max_seqs=len(prompts),
              stop_token_ids=[], prefix_cache=False)
    out = {}
    for name, n in (("generate_s", new), ("prefill_s", 1)):
        paxkv.generate(lm, list(prompts), max_new_tokens=n, **kw)  # compiles
        start = time.perf_counter()
        results = paxkv.generate(lm, list(prompts), max_new_tokens=n, **kw)
        out[name] = time.perf_counter() - start
        assert all(len(r.token_ids) == n for r in results)
    return out


def device_step_s(lm, batch: int, context: int, impl: str, steps_timed: int = 20) -> float:
    """One decode step's device time: ``steps_timed`` steps dispatched back to back."""
    cache = filled_cache(lm, "paged", batch, context, context - steps_timed - 8,
                         kv_dtype=jnp.bfloat16, attention_impl=impl)
    tokens = jnp.zeros((batch,), jnp.int32)
    live = jnp.ones((batch,), bool)
    state = [cache, tokens]

    def run():
        for _ in range(steps_timed // 4):
            state[0], state[1], _, _ = steps.decode_step(lm.forward, lm.params, state[0],
                                                         state[1], live, None)
        return state[1]

    return timed(run, repeats=4, warmup=1).median_s / (steps_timed // 4)


def hf_generate_s(config: models.LlamaConfig, prompts: np.ndarray, new: int,
                  device: str) -> float:
    """Seconds of HF ``generate`` (greedy, static cache, bf16) on random weights, warm."""
    import torch  # noqa: PLC0415 - the oracle; never a runtime dependency
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    hf = LlamaConfig(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                     intermediate_size=config.intermediate_size,
                     num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
                     num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim,
                     rope_theta=config.rope_theta, tie_word_embeddings=True,
                     max_position_embeddings=prompts.shape[1] + new)
    torch.manual_seed(0)
    model = LlamaForCausalLM(hf).to(device=device, dtype=torch.bfloat16).eval()
    ids = torch.as_tensor(prompts, device=device)
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False,
              cache_implementation="static", attention_mask=torch.ones_like(ids),
              pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, **kw)
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        model.generate(ids, **kw)
        sync()
    return time.perf_counter() - start


def run_model(name: str, config: models.LlamaConfig, args) -> dict[str, Any]:
    lm = random_model(config)
    lm = models.LanguageModel(lm.config, lm.params, None, name, jnp.bfloat16)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, config.vocab_size, (args.batch, args.prompt)).astype(np.int32)
    row: dict[str, Any] = dict(model=name, batch=args.batch, prompt=args.prompt, new=args.new)
    tokens = args.batch * args.new
    for impl in args.impls:
        got = paxkv_runs(lm, prompts, args.new, impl)
        step = device_step_s(lm, args.batch, args.prompt + args.new, impl)
        busy = got["prefill_s"] + (args.new - 1) * step
        row.update({f"{impl}_s": got["generate_s"], f"{impl}_tok_s": tokens / got["generate_s"],
                    f"{impl}_prefill_s": got["prefill_s"], f"{impl}_device_step_ms": 1e3 * step,
                    f"{impl}_idle": max(0.0, 1.0 - busy / got["generate_s"])})
    try:
        hf_s = hf_generate_s(config, prompts, args.new, args.torch_device)
        row.update(hf_s=hf_s, hf_tok_s=tokens / hf_s)
        for impl in args.impls:
            row[f"{impl}_vs_hf"] = row[f"{impl}_tok_s"] / row["hf_tok_s"]
    except Exception as e:  # noqa: BLE001 - the paxkv figures stand without the oracle
        row["hf_error"] = f"{type(e).__name__}: {e}"[:300]
    print(row, flush=True)
    return row


def main(argv=None) -> dict[str, Any]:
    ap = parser(__doc__, quick=None)
    ap.add_argument("--tiny", action="store_true", help="2 layers, XLA attention, on CPU")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    args = ap.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not args.tiny:
        sys.exit("experiments.gpu_engine needs a GPU; --tiny runs a CPU smoke test")
    shapes = SHAPES
    args.impls = ("pallas", "pallas_mma")
    args.torch_device = "cuda" if on_gpu else "cpu"
    if args.tiny:
        shapes = {"smollm2-135m-2-layers": dataclasses.replace(SMOLLM2_135M, num_layers=2)}
        args.batch, args.prompt, args.new, args.impls = 4, 32, 8, ("xla",)
    started = provenance()
    name_out = "gpu_engine_tiny" if args.tiny else "gpu_engine"
    rows = []
    for name, config in shapes.items():  # written after each model: a stage limit keeps some
        rows.append(run_model(name, config, args))
        write_json(name_out, record(dict(vars(args), **started), dict(rows=rows)))
    impl = args.impls[-1]
    print_table(["model", "batch", "prompt", "new"]
                + [f"{i} tok/s" for i in args.impls] + ["hf tok/s", f"{impl} / hf",
                                                         f"{impl} idle"],
                [[r["model"], r["batch"], r["prompt"], r["new"]]
                 + [f"{r[f'{i}_tok_s']:.0f}" for i in args.impls]
                 + [f"{r.get('hf_tok_s', float('nan')):.0f}",
                    f"{r.get(f'{impl}_vs_hf', float('nan')):.2f}x",
                    f"{100 * r[f'{impl}_idle']:.0f}%"] for r in rows])
    return record(dict(vars(args), **started), dict(rows=rows))


if __name__ == "__main__":
    main()
