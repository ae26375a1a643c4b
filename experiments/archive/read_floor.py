"""How much of paged decode attention is the read of K/V itself (CPU, XLA path).

At one (batch, context) with the default model's attention shape (SmolLM2-135M: 30 layers,
9 query heads over 3 kv heads of 64, page 16), one float32 pool of random K/V whose pages
are scattered (a random permutation, as after churn), and three jitted functions over it, each
a scan over the layers as in the model's step, timed alternately in one process:

* **attention**: the XLA decode path (``chunked.paged_decode_attention_chunked`` with the
  cache's chunk and tile sizes): what a decode step's attention runs, minus the K/V write;
* **gather**: the same work list and tiles, each tile only gathering its K and V pages and
  summing them: the read as the tiles do it, without the products;
* **slice**: each layer's K and V read by contiguous slices of the pool and summed: the read
  with no gather at all (pages in order, so not a paged layout's cost).

and two that are not paged at all, the ceiling of any paged layout:

* **unpaged**: each layer's K and V in their own contiguous arrays ``[batch, kv_heads,
  context, head_dim]`` (separate arguments, so nothing is sliced out of a pool) and the two
  products as plain ``einsum``s, which XLA:CPU hands to its YNNPACK library whole;
* **unpaged, K transposed**: the same with keys ``[batch, kv_heads, head_dim, context]``.

They hold the same K/V as the pool (gathered out of it), so all three attention variants
compute the same output (checked). Every row holds the full context.

Between the variants, each round also times the model's decode step without attention (the
sweep's ``NoAttention`` step on a paged cache of the same cell), so the table gives the share
of a step each variant's attention would be: ``ms / (ms + rest of the step)``. Paged
attention cannot fall below ``gather`` without reading fewer bytes, and ``unpaged`` reads the
same bytes and does the same products with no page table in the way: a paged layout that
beat it would have to beat XLA's own contiguous path.

Archived (out of the test suite): it answered its question on 2026-12-01 (see
``experiments/LOG.md``) and is kept to re-check that answer on another machine. Usage::

    python -m experiments.archive.read_floor              # batch 64, context 512 (~2 min)
    python -m experiments.archive.read_floor --batch 32 --context 2048 --repeats 21
    python -m experiments.archive.read_floor --in-order --quick   # pages in order; smoke
    python -m experiments.archive.read_floor --no-step     # no model: the variants only

Writes ``results/read_floor.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from paxkv import models
from experiments.common import print_table, record, timed_rounds, write_json
from paxkv.models.config import LlamaConfig
from paxkv.models.gguf_loader import config_from_gguf, open_gguf
from paxkv.attention import chunked
from paxkv.cache import paged as paged_cache

PAGE_SIZE = 16
REST = "the step without attention"


def default_config() -> LlamaConfig:
    """The default model's config, read from its GGUF header (no weights loaded)."""
    path = models.default_model_path()
    return config_from_gguf(open_gguf(path), path)


def _slice_pages(num_pages: int, width: int) -> int:
    """Pages per contiguous slice: a full tile's worth (the tiles' copy size), or all."""
    per_tile = paged_cache.TILE_CHUNKS * paged_cache.decode_chunk_pages(width, PAGE_SIZE)
    return min(num_pages, per_tile)


def variants(config: LlamaConfig, batch: int, context: int
             ) -> dict[str, Callable[..., jax.Array]]:
    """name -> jitted ``f(q, k, v, block_tables, lengths)`` -> float32 scalar (a sum, so
    nothing is dropped as unused), over every layer of the pool.

    Shapes: q ``[batch, num_heads, head_dim]``; k, v ``[num_layers, pages + 1, kv_heads,
    PAGE_SIZE, head_dim]`` (the last page the sentinel); block_tables int32 ``[batch,
    context // PAGE_SIZE]``; lengths int32 ``[batch]``.
    """
    c = config
    width = context // PAGE_SIZE
    chunk_pages = paged_cache.decode_chunk_pages(width, PAGE_SIZE)  # as the cache
    needed = int(chunked.chunks_needed(np.full(batch, context), start_page=0,
                                       page_size=PAGE_SIZE, chunk_pages=chunk_pages).sum())
    num_chunks, tile_chunks = chunked.list_shape(needed, paged_cache.TILE_CHUNKS)

    def over_layers(one_layer: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
        def run(q: jax.Array, k: jax.Array, v: jax.Array, block_tables: jax.Array,
                lengths: jax.Array) -> jax.Array:
            def body(acc: jax.Array, layer: jax.Array) -> tuple[jax.Array, None]:
                return acc + one_layer(layer, q, k, v, block_tables, lengths), None
            return lax.scan(body, jnp.zeros(()), jnp.arange(c.num_layers))[0]
        return jax.jit(run)

    def attention(layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
                  block_tables: jax.Array, lengths: jax.Array) -> jax.Array:
        out = chunked.paged_decode_attention_chunked(
            q, k, v, block_tables, lengths, num_chunks=num_chunks, chunk_pages=chunk_pages,
            tile_chunks=tile_chunks, layer=layer)
        return jnp.sum(out)

    def gather(layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
               block_tables: jax.Array, lengths: jax.Array) -> jax.Array:
        work = chunked.chunk_work(lengths, lengths > 0, start_page=0, page_size=PAGE_SIZE,
                                  chunk_pages=chunk_pages, num_chunks=num_chunks)

        def tile(args: tuple[jax.Array, jax.Array]) -> jax.Array:
            row, first = args  # [tile_chunks] each
            pages = chunked.tile_pages(block_tables, row, first, chunk_pages)
            return (jnp.sum(chunked.read_in_range(k, layer, pages))
                    + jnp.sum(chunked.read_in_range(v, layer, pages)))

        split = lambda x: x.reshape(-1, tile_chunks)  # noqa: E731
        return jnp.sum(lax.map(tile, (split(work.row), split(work.first_page))))

    def slice_(layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
               block_tables: jax.Array, lengths: jax.Array) -> jax.Array:
        pages = _slice_pages(batch * width, width)
        tiles = batch * width // pages

        def tile(i: jax.Array) -> jax.Array:
            at = (layer, i * pages, 0, 0, 0)
            size = (1, pages) + k.shape[2:]
            return (jnp.sum(lax.dynamic_slice(k, at, size))
                    + jnp.sum(lax.dynamic_slice(v, at, size)))

        return jnp.sum(lax.map(tile, jnp.arange(tiles)))

    return dict(attention=over_layers(attention), gather=over_layers(gather),
                slice=over_layers(slice_))


def unpaged_layers(k: jax.Array, v: jax.Array, block_tables: jax.Array, *,
                   keys_transposed: bool) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """Each layer's rows out of the pool into its own contiguous arrays, pages in row order.

    Shapes: k, v ``[num_layers, pages + 1, kv_heads, page_size, head_dim]``; block_tables
    int32 ``[batch, width]``. Returns per-layer tuples: keys ``[batch, kv_heads, width *
    page_size, head_dim]`` (``[batch, kv_heads, head_dim, width * page_size]`` when
    ``keys_transposed``), values ``[batch, kv_heads, width * page_size, head_dim]``.
    """
    @functools.partial(jax.jit, static_argnames="transposed")
    def rows(pool_layer: jax.Array, transposed: bool = False) -> jax.Array:
        x = pool_layer[block_tables]  # [b, width, kv, page, d]
        b, w, h, s, d = x.shape
        return (x.transpose(0, 2, 4, 1, 3).reshape(b, h, d, w * s) if transposed
                else x.transpose(0, 2, 1, 3, 4).reshape(b, h, w * s, d))

    layers = range(k.shape[0])
    return (tuple(rows(k[i], keys_transposed) for i in layers),
            tuple(rows(v[i]) for i in layers))


def unpaged_variant(keys_transposed: bool) -> Callable[..., jax.Array]:
    """Jitted ``f(q, ks, vs)`` -> float32 scalar (the sum of every layer's attention output):
    attention over per-layer contiguous K/V from :func:`unpaged_layers`, every row attending
    to all its keys. Layers unrolled: each layer's K/V is its own argument, read in place."""
    score_spec = "bkgd,bkdt->bkgt" if keys_transposed else "bkgd,bktd->bkgt"

    def run(q: jax.Array, ks: tuple[jax.Array, ...], vs: tuple[jax.Array, ...]) -> jax.Array:
        batch, num_heads, head_dim = q.shape
        kv_heads = vs[0].shape[1]
        q_grouped = q.reshape(batch, kv_heads, num_heads // kv_heads, head_dim)
        total = jnp.zeros(())
        for k, v in zip(ks, vs):
            probs = jax.nn.softmax(jnp.einsum(score_spec, q_grouped, k) * head_dim ** -0.5, -1)
            total = total + jnp.sum(jnp.einsum("bkgt,bktd->bkgd", probs, v))
        return total
    return jax.jit(run)


def rest_of_step(config: LlamaConfig, batch: int, context: int,
                 steps: int) -> Callable[[], jax.Array]:
    """The default model's decode step without attention (the sweep's ``NoAttention`` step,
    XLA path) on a paged cache of ``batch`` rows holding about ``context`` tokens; each call
    runs one donated step and returns its tokens. Room for ``steps`` calls (each reserves a
    token). ``config`` must be the default model's (the variants' attention shape)."""
    from experiments import hashed_kv  # the model and the sweep's step: only with the step

    lm = models.load()
    if lm.config != config:
        raise ValueError("the step without attention is the default model's: run the "
                         "variants with its config (default_config()) or with_step=False")
    state = dict(cache=hashed_kv.filled_cache(lm, "paged", batch, context, context - steps),
                 tokens=jnp.zeros((batch,), jnp.int32))

    def step() -> jax.Array:
        state["cache"], nxt, _ = hashed_kv.decode(lm, state["cache"], state["tokens"],
                                                  no_attention=True)
        return nxt
    return step


def run(config: LlamaConfig, batch: int, context: int, repeats: int, *,
        scattered: bool = True, seed: int = 0, with_step: bool = True) -> dict[str, Any]:
    """Times every variant (and, ``with_step``, the step without attention) alternately;
    medians in ms, the K/V read rate and the share of a step. ``scattered``: rows' pages are
    a random permutation of the pool (else each row's pages in order, as in the decode
    sweep's filled caches)."""
    if context % PAGE_SIZE:
        raise ValueError(f"context must be a multiple of the page size {PAGE_SIZE}, "
                         f"got {context}")
    c = config
    width = context // PAGE_SIZE
    num_pages = batch * width
    key = jax.random.PRNGKey(seed)
    shape = (c.num_layers, num_pages + 1, c.num_kv_heads, PAGE_SIZE, c.head_dim)
    k = jax.random.normal(jax.random.fold_in(key, 0), shape, jnp.float32)
    v = jax.random.normal(jax.random.fold_in(key, 1), shape, jnp.float32)
    q = jax.random.normal(jax.random.fold_in(key, 2), (batch, c.num_heads, c.head_dim))
    order = (np.random.default_rng(seed).permutation(num_pages) if scattered
             else np.arange(num_pages)).astype(np.int32)
    block_tables = jnp.asarray(order.reshape(batch, width))
    lengths = jnp.full((batch,), context, jnp.int32)
    paged_args = (q, k, v, block_tables, lengths)
    calls: dict[str, Callable[[], jax.Array]] = {
        name: functools.partial(f, *paged_args) for name, f in variants(c, batch, context).items()}
    for name, transposed in (("unpaged", False), ("unpaged, K transposed", True)):
        ks, vs = unpaged_layers(k, v, block_tables, keys_transposed=transposed)
        calls[name] = functools.partial(unpaged_variant(transposed), q, ks, vs)
    sums = {name: float(call()) for name, call in calls.items()}
    rest = {REST: rest_of_step(c, batch, context, repeats + 2)} if with_step else {}
    timings = timed_rounds({**calls, **rest}, repeats=repeats, warmup=1)
    rest_times = timings.pop(REST).times_s if with_step else []
    times = {name: t.times_s for name, t in timings.items()}
    kv_bytes = 2 * c.num_layers * num_pages * c.num_kv_heads * PAGE_SIZE * c.head_dim * 4
    per_slice = _slice_pages(num_pages, width)
    read = dict.fromkeys(calls, kv_bytes)
    read["slice"] = kv_bytes * (num_pages // per_slice * per_slice) // num_pages  # whole slices
    rest_ms = 1e3 * statistics.median(rest_times) if rest_times else None
    rows = {}
    for name, ts in times.items():
        ms = 1e3 * statistics.median(ts)
        rows[name] = dict(median_ms=ms, times_ms=[1e3 * t for t in ts],
                          gb_per_s=read[name] / ms / 1e6, bytes_read=read[name],
                          share_of_step=None if rest_ms is None else ms / (ms + rest_ms))
    attention_sums = {name: sums[name] for name in ("attention", "unpaged",
                                                     "unpaged, K transposed")}
    return dict(batch=batch, context=context, num_layers=c.num_layers,
                kv_heads=c.num_kv_heads, head_dim=c.head_dim, page_size=PAGE_SIZE,
                kv_mib=kv_bytes / 2**20, pages="scattered" if scattered else "in order",
                variants=rows, rest_of_step_ms=rest_ms,
                rest_of_step_times_ms=[1e3 * t for t in rest_times],
                attention_output_sums=attention_sums,
                attention_outputs_agree=bool(np.allclose(list(attention_sums.values()),
                                                         sums["attention"], rtol=1e-4)))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=11, help="timed calls per variant (median)")
    ap.add_argument("--in-order", action="store_true",
                    help="each row's pages in order (as the decode sweep fills them)")
    ap.add_argument("--no-step", action="store_true",
                    help="skip the model's step without attention (no share column)")
    ap.add_argument("--quick", action="store_true", help="batch 8 x 128, 3 calls: a smoke run")
    args = ap.parse_args(argv)
    if args.quick:
        args.batch, args.context, args.repeats = 8, 128, 3
    result = run(default_config(), args.batch, args.context, args.repeats,
                 scattered=not args.in_order, with_step=not args.no_step)
    v = result["variants"]
    rest = result["rest_of_step_ms"]
    print(f"batch {args.batch} x context {args.context}: {result['kv_mib']:.0f} MiB of float32 "
          f"K/V over {result['num_layers']} layers, pages {result['pages']}; attention "
          f"outputs agree: {result['attention_outputs_agree']}")
    if rest is not None:
        print(f"the model's step without attention: {rest:.1f} ms (median)")
    print()
    print_table(["variant", "median ms", "GB/s of K/V", "x attention", "share of a step"],
                [[name, f"{r['median_ms']:.1f}", f"{r['gb_per_s']:.1f}",
                  f"{r['median_ms'] / v['attention']['median_ms']:.2f}",
                  "-" if r["share_of_step"] is None else f"{100 * r['share_of_step']:.0f}%"]
                 for name, r in v.items()])
    write_json("read_floor_quick" if args.quick else "read_floor", record(vars(args), result))


if __name__ == "__main__":
    main()
