"""A fixed batch decoded in one compiled loop: prefill through the engine, then a single
``lax.while_loop`` that reserves pages inside jit until every row stops
(:func:`paxkv.core.steps.decode_loop`). For evaluation pipelines that want no host round trip per
token; ``generate(..., loop="jit")`` runs it."""

from __future__ import annotations

import numpy as np

from paxkv.core import steps
from paxkv.core.sampling import NON_FINITE
from paxkv.engine import Engine
from paxkv.engine.requests import GenerationResult


def run_fixed_batch(engine: Engine) -> dict[int, GenerationResult]:
    """Runs ``engine``'s queued requests as one batch; results by request id. All requests
    must fit in the cache at once; ``n > 1`` needs :meth:`Engine.run`."""
    table, sched, ops = engine.table, engine.scheduler, engine.ops
    if any(r.n > 1 for r in table.waiting):
        raise ValueError("n > 1 samples need run() (continuous batching), not the jit loop")
    admitted = []
    while table.waiting and table.free_rows():
        batch = sched.admit()
        if not batch:
            break
        sched.prefill(batch)
        admitted += batch
    if table.waiting:
        raise ValueError(f"{len(table.waiting)} requests do not fit at once (max_seqs="
                         f"{ops.max_seqs}, num_pages={ops.cache.num_pages}): raise them or use "
                         "run() (continuous batching)")
    reqs = [r for r in admitted if r.finish_reason is None]
    s = ops.max_seqs
    width = max([r.max_new_tokens for r in reqs], default=1)
    first, limit = np.zeros(s, np.int32), np.zeros(s, np.int32)
    stop_ids = sorted(set().union(*[r.stop_ids for r in reqs])) or [-1]
    stops = np.zeros((s, len(stop_ids)), bool)
    for r in reqs:
        first[r.row], limit[r.row] = r.output[0], r.max_new_tokens
        stops[r.row] = [t in r.stop_ids for t in stop_ids]
    # Shared pages are read once; the work list covers every row's longest context.
    ends = [min(ops.cache.max_len, len(r.tokens) + r.max_new_tokens) for r in reqs]
    plan = sched.plan(reqs, ops.cache.max_len, decode_lengths=ends)
    ops.cache, out, count, dry = steps.decode_loop(
        engine.model.forward, engine.weights.params, ops.cache, first, limit,
        np.asarray(stop_ids, np.int32), stops,
        engine.lifecycle.rows.sampling_for(None), max_new_tokens=width, plan=plan)
    out, count, dry = np.asarray(out), np.asarray(count), np.asarray(dry)
    for r in reqs:
        r.output = [int(t) for t in out[r.row, : count[r.row]]]
        non_finite = r.output[-1] == NON_FINITE  # the row stopped: its logits were not finite
        r.output = r.output[:-1] if non_finite else r.output
        r.versions = [engine.weights.version] * len(r.output)
        r.cached = len(r.tokens) - 1
        engine.counters.decode_tokens += len(r.output) - 1
        r.finish_reason = ("non_finite" if non_finite else
                           "stop" if r.output[-1] in r.stop_ids else
                           "out_of_pages" if dry[r.row] else "length")
    ops.refresh_free()
    engine.lifecycle.finish(reqs)
    return engine.run()
