"""Paged decode kernel vs dense decode vs JAX's Triton paged attention, on one GPU.

For each (batch, context, page_size) point: build one bf16 paged pool (Llama-3-8B-like heads,
ragged lengths in [context/2, context]) and its int8 twin (codes + per-token scales, quantised
once, untimed), check every implementation against the jnp oracle on the device (the int8
kernel against the oracle on the same codes and scales; no speed figure for a wrong answer),
then time it (warm-up, ``block_until_ready``, median of many). Bandwidth is the K/V bytes the
sequences actually hold (int8: codes plus float32 scales) over the median time, also as a
fraction of a measured device-to-device copy rate.

    python -m experiments.kernels            # full sweep, < 10 min on an H200
    python -m experiments.kernels --quick    # two small points
    python -m experiments.kernels --interpret  # tiny CPU smoke run of the Mosaic kernel
    python -m experiments.kernels --tune       # paxkv kernel only: pages_per_block x num_splits
    python -m experiments.kernels --mma        # the tensor-core kernel over stages x splits,
                                               # its stream-only ceiling, the CUDA-core kernel
                                               # and JAX's Triton one (issue 34's cells)

``stream`` rows are :mod:`pallas_kernels.tensor_cores.decode` with ``stream_only=True``: the
same page copies and ring, no arithmetic (returns zeros, so not checked): the ceiling of one
copy per page at that page size. ``mma_*`` rows' ``frac_of_stream`` is their bandwidth over it;
``mma_*_producer`` rows have a second warpgroup issue every copy.

Writes ``results/kernels.json`` (config, versions, device, git SHA, rows) and prints a table.
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import parser, provenance, record, result_name, timed, write_json
from pallas_kernels.tensor_cores import geometry
from pallas_kernels.tensor_cores.decode import paged_decode_attention_mma
from pallas_kernels.paged_decode import paged_decode_attention
from pallas_kernels.reference import paged_decode_attention_reference
from pallas_kernels import quant
from paxkv.attention.blocks import gather_pages

FULL_SWEEP = (  # (batch, context, page_size): batch x context sweep, then page sizes
    [(b, c, 16) for b in (1, 16, 64, 256) for c in (512, 4096, 32768) if b * c <= 2**21]
    + [(32, 8192, p) for p in (16, 32, 64, 128)])
QUICK_SWEEP = [(4, 512, 16), (16, 4096, 64)]
INTERPRET_SWEEP = [(2, 128, 16)]
TUNE_SWEEP = [(64, 32768, 16), (16, 4096, 16), (256, 512, 16), (1, 32768, 16)]
TUNE_GRID = [(ppb, splits) for ppb in (4, 8) for splits in (1, 2, 4, 8, 16, 32)]
MMA_SWEEP = ([(b, c, p) for p in (16, 64) for b, c in
              ((64, 32768), (16, 4096), (1, 32768), (256, 512), (32, 8192))]
             + [(32, 8192, p) for p in (32, 128)])
MMA_GRID = ([(stages, None, False) for stages in (2, 3, 4)] + [(3, n, False) for n in (1, 8, 32)]
            + [(stages, None, True) for stages in (2, 3)])  # (stages, splits, producer)


def parse_args(argv=None):
    p = parser(__doc__, quick="two small points, few iterations")
    p.add_argument("--interpret", action="store_true", help="tiny CPU run in interpret mode")
    p.add_argument("--tune", action="store_true",
                   help="the paxkv kernel alone over pages_per_block x num_splits")
    p.add_argument("--mma", action="store_true",
                   help="the tensor-core kernel over stages x splits, with its stream ceiling")
    p.add_argument("--num-q-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None,
                   help="JSON path (default results/kernels[_quick|_interpret|_tune].json)")
    return p.parse_args(argv)


def make_problem(args, batch, context, page_size, dtype=jnp.bfloat16):
    """Ragged lengths, a permuted page pool and the same K/V laid out densely."""
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(max(1, context // 2), context + 1, batch).astype(np.int32)
    max_pages = -(-context // page_size)
    need = -(-lengths // page_size)
    num_pages = int(need.sum()) + 1
    perm = rng.permutation(num_pages).astype(np.int32)
    table = np.full((batch, max_pages), num_pages - 1, np.int32)
    starts = np.concatenate([[0], np.cumsum(need)[:-1]])
    for b in range(batch):
        table[b, :need[b]] = perm[starts[b]:starts[b] + need[b]]
    keys = jax.random.split(jax.random.key(args.seed), 3)
    shape = (num_pages, args.num_kv_heads, page_size, args.head_dim)
    k_pages = jax.random.normal(keys[0], shape, dtype)
    v_pages = jax.random.normal(keys[1], shape, dtype)
    q = jax.random.normal(keys[2], (batch, args.num_q_heads, args.head_dim), dtype)
    return q, k_pages, v_pages, jnp.asarray(table), jnp.asarray(lengths)


def dense_kv(pages, table):
    """``[batch, max_pages * page_size, kv_heads, head_dim]``: the dense twin's layout."""
    g = gather_pages(pages, table)  # [b, m, kvh, s, d]
    b, m, h, s, d = g.shape
    return g.transpose(0, 1, 3, 2, 4).reshape(b, m * s, h, d)


def quantised(k_pages, v_pages):
    """int8 ``(k_codes, v_codes, scales [pages, kv_heads, 2, page_size])`` of a pool."""
    (kc, ks), (vc, vs) = (quant.quantise(x, quant.INT8) for x in (k_pages, v_pages))
    return jax.block_until_ready((kc, vc, jnp.stack([ks, vs], axis=2)))


def implementations(args, q, k_pages, v_pages, table, lengths, interpret, int8=None):
    """name -> zero-argument callable; each builds its inputs once, outside the timing.
    ``int8``: the pool's :func:`quantised` twin, timed as ``paxkv_paged_int8``."""
    scale = args.head_dim ** -0.5
    if args.tune:  # the paxkv kernel at each (pages_per_block, num_splits) that fits
        blocks = lambda ppb: -(-table.shape[1] // ppb)  # noqa: E731
        return {f"paxkv_ppb{ppb}_splits{n}": functools.partial(
                    paged_decode_attention, q, k_pages, v_pages, table, lengths,
                    pages_per_block=ppb, num_splits=n, interpret=interpret)
                for ppb, n in TUNE_GRID if n <= blocks(ppb)}
    impls = {"paxkv_paged": lambda: paged_decode_attention(q, k_pages, v_pages, table, lengths,
                                                            interpret=interpret)}
    impls |= mma_implementations(args, q, k_pages, v_pages, table, lengths, interpret)
    if args.mma:
        impls |= triton_paged(args, q, k_pages, v_pages, table, lengths, interpret)
        return impls
    if int8 is not None:
        impls["paxkv_paged_int8"] = lambda: paged_decode_attention(
            q, *int8[:2], table, lengths, scales=int8[2], interpret=interpret)
    k, v = jax.block_until_ready((dense_kv(k_pages, table), dense_kv(v_pages, table)))
    xla = jax.jit(lambda q, k, v, n: jax.nn.dot_product_attention(
        q[:, None], k, v, scale=scale, key_value_seq_lengths=n)[:, 0])
    impls["dense_xla"] = lambda: xla(q, k, v, lengths)
    if interpret:
        return impls
    try:
        from jax.experimental.pallas.ops.gpu import decode_attention
    except ImportError as e:  # pragma: no cover - depends on the jax build
        print(f"JAX Triton ops unavailable: {e}")
        return impls
    impls["dense_triton_decode"] = lambda: decode_attention.gqa(q, k, v, kv_seq_len=lengths,
                                                                sm_scale=scale)
    return impls | triton_paged(args, q, k_pages, v_pages, table, lengths, interpret)


def triton_paged(args, q, k_pages, v_pages, table, lengths, interpret):
    """JAX's Triton ``paged_attention`` (the speed anchor), or nothing off a GPU."""
    if interpret:
        return {}
    try:
        from jax.experimental.pallas.ops.gpu import paged_attention
    except ImportError as e:  # pragma: no cover - depends on the jax build
        print(f"JAX Triton paged_attention unavailable: {e}")
        return {}
    scale = args.head_dim ** -0.5
    kt, vt = jax.block_until_ready((k_pages.transpose(1, 0, 2, 3), v_pages.transpose(1, 0, 2, 3)))
    qs = (q.astype(jnp.float32) * scale).astype(q.dtype)  # it applies no scale itself
    ppcb = max(1, min(table.shape[1], 128 // k_pages.shape[2]))
    return {"jax_triton_paged": lambda: paged_attention.paged_attention(
        qs, kt, vt, table, lengths, pages_per_compute_block=ppcb)}


def mma_implementations(args, q, k_pages, v_pages, table, lengths, interpret):
    """The tensor-core kernel (each ``(stages, splits)`` of :data:`MMA_GRID` with ``--mma``,
    else its defaults) and its stream-only ceiling, where the geometry allows them."""
    page_size = k_pages.shape[2]
    ppb = geometry.default_pages_per_block(page_size)
    grid = MMA_GRID if args.mma else [(None, None, False)]
    out = {}
    for stages, splits, producer in grid:
        n = stages or geometry.default_stages(ppb * page_size, args.head_dim)
        if geometry.mma_refusal(q.dtype, page_size, args.head_dim, ppb, n):
            continue
        name = (f"mma_st{n}" + (f"_splits{splits}" if splits else "")
                + ("_producer" if producer else ""))
        out[name] = functools.partial(paged_decode_attention_mma, q, k_pages, v_pages, table,
                                      lengths, stages=n, num_splits=splits, producer=producer,
                                      interpret=interpret)
    if out:
        out["stream"] = functools.partial(paged_decode_attention_mma, q, k_pages, v_pages,
                                          table, lengths, stream_only=True,
                                          interpret=interpret)
    return out


def copy_rate(interpret) -> float:
    """Device-to-device bytes/s of ``x + 1`` over 1 GiB (read + write)."""
    n = (2**20 if interpret else 2**29)
    x = jnp.ones((n,), jnp.bfloat16)
    f = jax.jit(lambda x: x + jnp.asarray(1, x.dtype))
    return 2 * x.nbytes / timed(lambda: f(x), repeats=10, warmup=3).median_s


def run_point(args, point, copy_bps, interpret):
    batch, context, page_size = point
    q, k_pages, v_pages, table, lengths = make_problem(args, batch, context, page_size)
    check = min(batch, 8)  # the oracle materialises scores: check a slice of the batch
    int8 = None if args.tune or args.mma else quantised(k_pages, v_pages)
    pools = {"bf16": (k_pages, v_pages, None)} | ({} if int8 is None else {"int8": int8})
    refs = {kind: np.asarray(paged_decode_attention_reference(
        q[:check], k, v, table[:check], lengths[:check],
        scales=s), np.float32) for kind, (k, v, s) in pools.items()}
    tokens = 2 * int(lengths.sum()) * args.num_kv_heads  # K and V vectors held
    kv_bytes = {"bf16": tokens * args.head_dim * 2, "int8": tokens * (args.head_dim + 4)}
    rows = []
    for name, fn in implementations(args, q, k_pages, v_pages, table, lengths, interpret,
                                    int8).items():
        kind = "int8" if name.endswith("_int8") else "bf16"
        ref, nbytes = refs[kind], kv_bytes[kind]
        row = dict(batch=batch, context=context, page_size=page_size, impl=name, ok=False)
        try:
            out = np.asarray(fn()[:check], np.float32)
            if name == "stream":  # copies only: its output is zeros by design
                row.update(ok=not out.any())
            else:
                err = np.linalg.norm(out - ref, axis=-1) / np.maximum(
                    np.linalg.norm(ref, axis=-1), 1e-6)
                row.update(max_rel_err=float(err.max()), ok=bool(err.max() < 2e-2))
            if row["ok"]:
                sec = timed(fn, repeats=args.iters, warmup=3).median_s
                row.update(median_ms=1e3 * sec, gbps=nbytes / sec / 1e9,
                           frac_of_copy=nbytes / sec / copy_bps)
        except Exception as e:  # noqa: BLE001 - one failing baseline must not end the sweep
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        rows.append(row)
    stream = next((r for r in rows if r["impl"] == "stream" and "gbps" in r), None)
    for row in rows:
        if stream and row["impl"].startswith("mma") and "gbps" in row:
            row["frac_of_stream"] = row["gbps"] / stream["gbps"]
        print(format_row(row), flush=True)
    return rows


def format_row(r):
    timing = (f"{r['median_ms']:9.3f} ms {r['gbps']:8.1f} GB/s {100 * r['frac_of_copy']:5.1f}%"
              if "median_ms" in r else f"{'-':>9}    {'-':>8}       {'-':>5} ")
    status = "ok" if r["ok"] else r.get("error", f"WRONG (err {r.get('max_rel_err', 0):.2g})")
    ceiling = (f"  {100 * r['frac_of_stream']:5.1f}% of stream" if "frac_of_stream" in r
               else "")
    return (f"{r['batch']:5d} {r['context']:6d} {r['page_size']:4d}  {r['impl']:22s} {timing}"
            f"  {status}{ceiling}")


def main(argv=None):
    args = parse_args(argv)
    if jax.default_backend() != "gpu" and not args.interpret:
        sys.exit(f"experiments.kernels needs a GPU (default backend: {jax.default_backend()});"
                 " pass --interpret for a tiny CPU smoke run of the Mosaic kernel.")
    if args.interpret:
        args.num_q_heads, args.num_kv_heads, args.head_dim, args.iters = 4, 2, 64, 2
    sweep = (INTERPRET_SWEEP if args.interpret else TUNE_SWEEP if args.tune
             else MMA_SWEEP if args.mma else QUICK_SWEEP if args.quick else FULL_SWEEP)
    if args.quick:
        args.iters = min(args.iters, 5)
    started = provenance()
    copy_bps = copy_rate(args.interpret)
    print(f"device-to-device copy: {copy_bps / 1e9:.1f} GB/s\n"
          f"{'batch':>5} {'ctx':>6} {'page':>4}  {'impl':20s} {'median':>12} {'bandwidth':>13}"
          " of copy")
    name = ("kernels_interpret" if args.interpret else "kernels_tune" if args.tune
            else "kernels_mma" if args.mma else result_name("kernels", args.quick))
    rows = []
    for point in sweep:  # written after each point: a stage's time limit keeps what ran
        rows += run_point(args, point, copy_bps, args.interpret)
        write_json(name, record(dict(vars(args), **started),
                                dict(copy_gbps=copy_bps / 1e9, rows=rows)), path=args.out)
    return rows


if __name__ == "__main__":
    main()
