"""The paged cache over a ``(data, model)`` mesh: per-device pool bytes, capacity on a fixed
per-device budget, collectives per step, and tokens against one device.

    python -m experiments.mesh            # SmolLM2-135M's K/V dims for the memory table
    python -m experiments.mesh --quick    # a tiny random Llama's dims throughout (< 3 min)

Runs on 8 forced CPU devices (``JAX_NUM_CPU_DEVICES=8``, set here before JAX starts). They
share this machine's two cores, so **no timing here is a result** and none is reported.

* **memory**: for meshes (1..8, 1) and, with kv heads split, (1, 3), (2, 3) (SmolLM2's 3 kv
  heads; (4, 2), (2, 4) with ``--quick``'s 4), a :func:`paxkv.scale.sharded_cache.create` pool of
  ``--pages`` pages: bytes each device holds (read from ``addressable_shards``), and the most
  sequences of ``--seq-len`` tokens that fit ``--budget-mib`` per device (each shard's pages
  less its sentinel, whole sequences per shard; a model axis holds a page's heads over
  ``model`` devices, so each holds ``1 / model`` of it).
* **collectives**: the compiled prefill and decode steps of a random Llama with 4 kv heads on
  each mesh, weights split by :mod:`paxkv.scale.tensor_parallel`, with each collective's kind and
  result bytes, and how many sit in the scanned layer body (listed once in the HLO, run once
  per layer; bytes per step count them per layer). A data-only decode needs two scalars; a
  model axis adds two ``[b / data, 1, D]`` all-reduces per layer. A (1, 1) prefill lists one
  all-reduce over single-device groups (the psum over a data axis of 1: moves nothing).
* **correctness**: greedy tokens of 12 requests through :class:`paxkv.Engine` on each mesh
  (a tight pool that preempts) against the single-device paged cache.

Writes ``results/mesh.json`` (``mesh_quick.json`` with ``--quick``).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import argparse  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments.common import parser, print_table, record, result_name, write_json  # noqa: E402
from paxkv.scale import mesh as pmesh
from paxkv.cache import paged as paged_cache
from paxkv.scale import sharded_cache
from paxkv.core import steps  # noqa: E402
from paxkv.scale import tensor_parallel  # noqa: E402

DATA_MESHES = ((1, 1), (2, 1), (4, 1), (8, 1))
MODEL_MESHES = {3: ((1, 3), (2, 3)), 4: ((4, 2), (2, 4))}  # by kv heads
TIGHT = {8: 48, 4: 24, 2: 16, 1: 8}  # data -> num_pages that make the engine preempt
BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
         "s64": 8, "u64": 8, "f64": 8}


def tiny():
    """``tests/test_mesh_model.py``'s random Llama: 8 q heads over 4 kv heads."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from test_mesh_model import tiny_tp_lm  # noqa: PLC0415

    return tiny_tp_lm()


def meshes(kv_heads: int) -> tuple[tuple[int, int], ...]:
    return DATA_MESHES + MODEL_MESHES[kv_heads]


def memory(args: argparse.Namespace, dims: dict) -> list[dict[str, Any]]:
    """Per-device bytes and sequences on a fixed per-device budget, per data axis."""
    rows = []
    for data, model in meshes(dims["num_kv_heads"]):
        cache = sharded_cache.create(mesh=pmesh.make_mesh(data, model), num_pages=args.pages,
                                     max_seqs=data, max_len=args.seq_len, **dims)
        per_device = sorted({s.data.nbytes for s in cache.pools.k.addressable_shards})
        per_page = 2 * per_device[-1] // (cache.pages_per_shard + 1)  # K + V, its heads
        pages_fit = args.budget_mib * 2**20 // per_page - 1  # less the shard's sentinel
        per_seq = -(-args.seq_len // dims["page_size"])
        rows.append(dict(data=data, model=model, pool_bytes_per_device=2 * per_device[-1],
                         distinct_block_sizes=len(per_device), kv_bytes_per_page=per_page,
                         pages_per_device_on_budget=int(pages_fit),
                         sequences_on_budget=int(data * (pages_fit // per_seq))))
        del cache
    return rows


def collectives(compiled_text: str) -> list[tuple[str, int, bool]]:
    """(kind, result bytes, in the layer body) of every collective in a compiled module."""
    found = []
    for line in compiled_text.splitlines():
        for kind in pmesh.COLLECTIVES:
            if "=" in line and re.search(rf" {kind}(-start)?\(", line.split("=", 1)[1]):
                shapes = re.findall(r"(\w+)\[([\d,]*)\]", line.split("=", 1)[1].split(kind)[0])
                size = sum(BYTES.get(t, 4) * int(np.prod([int(d) for d in s.split(",") if d]))
                           for t, s in shapes)
                found.append((kind, size, "/while/body" in line))
    return found


def step_collectives(lm, mesh: tuple[int, int], max_seqs: int) -> dict[str, Any]:
    """Collectives of the compiled prefill (8 rows x 16 tokens) and full decode steps."""
    lm, cache = _on_mesh(lm, mesh, max_seqs, 8 * max_seqs)
    rows = jnp.arange(8, dtype=jnp.int32) % max_seqs
    tokens, qlens = jnp.ones((8, 16), jnp.int32), jnp.full((8,), 16, jnp.int32)
    out = {}
    for name, fn, rest in (
            ("prefill", steps.prefill_step, (tokens, rows, qlens, None)),
            ("decode", steps.decode_step, (jnp.ones((max_seqs,), jnp.int32),
                                           jnp.ones((max_seqs,), bool), None))):
        found = collectives(fn.lower(lm.forward, lm.params, cache, *rest).compile().as_text())
        layer = [b for _, b, inside in found if inside]
        once = sum(b for _, b, inside in found if not inside)
        out[name] = dict(count=len(found), step_bytes=once + lm.num_layers * sum(layer),
                         per_layer=len(layer), per_layer_bytes=sum(layer),
                         ops=[f"{k} {b}B{' (layer)' if i else ''}" for k, b, i in found])
    return out


def _on_mesh(lm, mesh: tuple[int, int] | None, max_seqs: int, num_pages: int,
             fill: float = 0.0):
    """``(lm, cache)``, both on ``mesh`` (None: one device, the plain paged cache)."""
    dims = dict(num_layers=lm.num_layers, num_kv_heads=lm.num_kv_heads, head_dim=lm.head_dim,
                page_size=4, max_len=24, max_seqs=max_seqs, num_pages=num_pages, fill=fill)
    if mesh is None:
        dims.pop("fill")
        return lm, paged_cache.create(**dims)
    m = pmesh.make_mesh(*mesh)
    return tensor_parallel.shard_model(lm, m), sharded_cache.create(mesh=m, **dims)


def engine_tokens(lm, mesh: tuple[int, int] | None,
                  num_pages: int) -> tuple[list[list[int]], int]:
    """Greedy tokens of 12 requests (mesh None: the single-device paged cache)."""
    import paxkv  # noqa: PLC0415

    lm, cache = _on_mesh(lm, mesh, 16, num_pages, float("nan"))
    engine = paxkv.Engine(lm, cache=cache, prefix_cache=False, prefill_chunk=16,
                          prefill_tokens=64)
    rng = np.random.default_rng(0)
    ids = [engine.submit(rng.integers(8, 256, int(rng.integers(2, 12))).tolist(),
                         max_new_tokens=int(rng.integers(2, 10)), stop_token_ids=())
           for _ in range(12)]
    results = engine.run()
    return [results[i].token_ids for i in ids], engine.counters.preemptions


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = parser(__doc__, quick="tiny model dims, 2 meshes checked")
    ap.add_argument("--pages", type=int, default=2048, help="pool pages (all shards)")
    ap.add_argument("--seq-len", type=int, default=512, help="tokens per sequence")
    ap.add_argument("--budget-mib", type=int, default=512, help="K/V bytes per device")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    jax.config.update("jax_default_matmul_precision", "highest")
    lm = tiny()
    if args.quick:
        args.pages, args.seq_len, args.budget_mib = 256, 64, 1
        dims = dict(num_layers=lm.num_layers, num_kv_heads=lm.num_kv_heads,
                    head_dim=lm.head_dim, page_size=4)
    else:  # SmolLM2-135M's K/V: 30 layers x 3 kv heads x 64, page 16
        dims = dict(num_layers=30, num_kv_heads=3, head_dim=64, page_size=16)
    mem = memory(args, dims)
    print_table(["mesh", "pool bytes / device", "KV bytes / page / device",
                 f"pages on {args.budget_mib} MiB / device", f"sequences of {args.seq_len} tokens"],
                [[f"({m['data']}, {m['model']})", f"{m['pool_bytes_per_device']:,}",
                  f"{m['kv_bytes_per_page']:,}", m["pages_per_device_on_budget"],
                  m["sequences_on_budget"]] for m in mem])
    coll = {f"{d}x{m}": step_collectives(lm, (d, m), 16) for d, m in meshes(lm.num_kv_heads)}
    print()
    print_table(["mesh", "prefill collectives (per layer)", "bytes / step", "decode "
                 "collectives (per layer)", "bytes / step"],
                [[k, f"{c['prefill']['count']} ({c['prefill']['per_layer']})",
                  f"{c['prefill']['step_bytes']:,}",
                  f"{c['decode']['count']} ({c['decode']['per_layer']})",
                  f"{c['decode']['step_bytes']:,}"] for k, c in coll.items()])
    checked = ((8, 1), (2, 1), (4, 2), (2, 4)) if args.quick else meshes(lm.num_kv_heads)
    ref, _ = engine_tokens(lm, None, 96)
    correct = {}
    for d, m in checked:
        tokens, preempted = engine_tokens(lm, (d, m), TIGHT[d])
        correct[f"{d}x{m}"] = dict(equal=tokens == ref, preemptions=preempted)
    print()
    print_table(["mesh", "tokens == one device", "preemptions (tight pool)"],
                [[k, c["equal"], c["preemptions"]] for k, c in correct.items()])
    print("\nForced CPU devices share two cores: no timing from them is a result.")
    config = dict(vars(args), dims=dims, devices=len(jax.devices()))
    data = record(config, dict(memory=mem, collectives=coll, correctness=correct,
                               note="forced CPU devices share two cores: no timing here"))
    write_json(result_name("mesh", args.quick), data)
    return data


if __name__ == "__main__":
    main()
