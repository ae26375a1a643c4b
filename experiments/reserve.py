"""The cost of one decode-style ``page_table.reserve`` on a large, half-full table.

    python -m experiments.reserve            # 1,024 sequences x 65,536 pages, 50 calls (< 1 min)
    python -m experiments.reserve --quick    # 10 calls

Jitted, donated ``page_table.reserve(max_new=1)`` at 1,024 sequences x 65,536 pages, the table
filled first to rows of 1 to ~60% of a row (about half the pool in use), so ~1/16 of the rows
cross a page boundary on every call and every call really allocates. Each call's allocation
must succeed for every row.

Writes ``results/reserve.json`` (``reserve_quick.json``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import parser, print_table, record, result_name, timed, write_json
from paxkv.table import page_table as pt

PAGE_SIZE = 16
TARGET_MS = 2.0


def reserve_cost(seqs: int, pages: int, row_pages: int, *, repeats: int,
                 warmup: int) -> dict[str, Any]:
    table = pt.create(num_pages=pages, page_size=PAGE_SIZE, max_seqs=seqs,
                      max_pages_per_seq=row_pages)
    lengths = np.random.default_rng(0).integers(1, row_pages * PAGE_SIZE * 6 // 10, seqs)
    fill = jax.jit(pt.reserve, static_argnames=("max_new",))
    table, _, ok = fill(table, jnp.asarray(lengths, jnp.int32), max_new=int(lengths.max()))
    assert bool(ok.all())
    used = int(jnp.sum(table.ref_counts > 0))
    step = jax.jit(pt.reserve, static_argnames=("max_new",), donate_argnums=(0,))
    ones = jnp.ones((seqs,), jnp.int32)
    state, updates = dict(table=table), []

    def call():
        state["table"], update, ok = step(state["table"], ones, max_new=1)
        updates.append((update, ok))
        return state["table"], update, ok

    timing = timed(call, repeats=repeats, warmup=warmup)
    assert all(bool(ok.all()) for _, ok in updates), "a reserve failed"
    allocated = [int(jnp.sum(u.fresh_pages < pages)) for u, _ in updates]
    ms = 1e3 * timing.median_s
    print(f"page_table.reserve, {seqs:,} seqs x {pages:,} pages ({used:,} in use), max_new=1: "
          f"median {ms:.3f} ms over {repeats}, {np.mean(allocated):.0f} pages allocated per "
          f"call (target <= {TARGET_MS} ms)")
    return dict(max_seqs=seqs, num_pages=pages, max_pages_per_seq=row_pages, pages_in_use=used,
                median_ms=ms, times_ms=[1e3 * t for t in timing.warmup_s + timing.times_s],
                mean_pages_allocated=float(np.mean(allocated)))


def main(argv=None) -> None:
    ap = parser(__doc__, quick="10 timed calls")
    ap.add_argument("--shape", type=int, nargs=3, default=[1024, 65536, 128],
                    metavar=("SEQS", "PAGES", "PAGES_PER_SEQ"))
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats = 10
    result = reserve_cost(*args.shape, repeats=args.repeats, warmup=args.warmup)
    met = result["median_ms"] <= TARGET_MS
    rows = [[f"reserve, {args.shape[0]:,} seqs x {args.shape[1]:,} pages",
             f"{result['median_ms']:.2f} ms", f"<= {TARGET_MS} ms", "yes" if met else "no"]]
    print()
    print_table(["figure", "measured", "target", "met"], rows)
    write_json(result_name("reserve", args.quick),
               record(vars(args), dict(result, targets=rows)))


if __name__ == "__main__":
    main()
