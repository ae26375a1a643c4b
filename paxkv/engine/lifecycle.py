"""How a request's row ends or divides: finish, release, preempt, spawn samples, branch, fork,
extend, cancel, and what a weight update does to the rows in flight (abort, recompute, refill).

Every change of who holds a row goes through :class:`Lifecycle`, so the three places that
must agree stay together: the request table (who is in which row), the row state (what each
row samples and feeds) and the cache (which pages each row holds; released through one
jitted call, written pages indexed first in the prefix index of the row's shard).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paxkv.core.sampling import SamplingParams
from paxkv.engine.accounting import Counters
from paxkv.engine.cache_ops import CacheOps
from paxkv.engine.policy import Growth
from paxkv.engine.prefix_sharing import SharedPrefixes
from paxkv.engine.requests import Request, RequestTable
from paxkv.engine.requests import RowState
from paxkv.engine.weights import Weights


class Lifecycle:
    """Row hand-overs for one engine's parts (see the module docstring)."""

    def __init__(self, model: Any, table: RequestTable, rows: RowState, ops: CacheOps,
                 prefixes: SharedPrefixes | None, counters: Counters, growth: Growth,
                 weights: Weights | None = None):
        self.model, self.table, self.rows, self.ops = model, table, rows, ops
        self.prefixes, self.counters, self.growth = prefixes, counters, growth
        self.weights = weights or Weights(getattr(model, "params", None))  # the engine's

    def finish(self, reqs: list[Request]) -> None:
        """Releases finished requests' rows, except those held for forking."""
        self.release([r for r in reqs if r.finish_reason is not None and not r.keeps_row])

    def release(self, reqs: list[Request]) -> None:
        """Frees the rows of ``reqs`` (pages nobody else holds are free after this call)."""
        reqs = [r for r in reqs if r.row is not None]
        if not reqs:
            return
        if self.prefixes is not None:  # K/V of other weights is never indexed
            self.prefixes.index_rows([r for r in reqs if r.kv_epoch == self.weights.epoch])
        rows = [r.row for r in reqs]
        for r in reqs:
            self.rows.vacate(r)
        self.ops.release(rows)

    def preempt(self, req: Request) -> None:
        """Releases a running request and queues it first, to be recomputed."""
        self.requeue(req)
        req.preemptions += 1
        self.counters.preemptions += 1
        self.growth.preempted()

    def requeue(self, req: Request) -> None:
        """Releases ``req``'s row and queues it first: its tokens so far are prefilled again
        (under the weights of that time) before it goes on."""
        if req in self.table.resuming:
            self.table.resuming.remove(req)
        self.release([req])
        req.cached = 0
        self.table.waiting.appendleft(req)

    def refill(self, req: Request) -> None:
        """A held row (a finished ``hold=True`` request, a shared prefix) computed again: it
        releases its row and waits first; prefilled again, it keeps its finish reason and its
        row, as before (:attr:`Request.refill`)."""
        req.refill, req.finish_reason = req.finish_reason, None
        self.requeue(req)

    def abort(self, req: Request) -> None:
        """Ends ``req`` now with the tokens it made ("aborted"); its row is free at once."""
        if req in self.table.waiting:
            self.table.waiting.remove(req)
        if req in self.table.resuming:
            self.table.resuming.remove(req)
        req.finish_reason = "aborted"
        self.release([req])

    def spawn(self, parent: Request, k: int, *, sample: bool = False,
              params: SamplingParams | None = None, stops: frozenset[int] | None = None,
              hold: bool | None = None) -> list[Request]:
        """``k`` child requests continuing ``parent`` (its samples with ``sample``), with
        ``params`` / ``stops`` / ``hold`` (default: the parent's); child i samples from
        ``fold_in(parent key, i)``."""
        parent_key = jax.random.wrap_key_data(jnp.asarray(parent.key_data))
        params = dataclasses.replace(params or parent.params(), n=1)
        children = []
        for i in range(k):
            key = np.asarray(jax.random.key_data(jax.random.fold_in(parent_key, i)), np.uint32)
            child = Request.make(self.table.new_id(), parent.tokens, params,
                                 parent.stop_ids if stops is None else stops, key,
                                 cache_salt=parent.cache_salt, kv_epoch=parent.kv_epoch,
                                 hold=parent.hold if hold is None else hold,
                                 sample_of=parent.id if sample else None)
            self.table.add(child)
            children.append(child)
        parent.children = [c.id for c in children]
        return children

    def branch(self, parent: Request, children: list[Request]) -> None:
        """Child 0 takes over the parent's row; the others fork into free rows of the parent's
        shard sharing its pages (no KV moves; each child's first decode feeds the pending last
        token). Children left without a row wait at the queue front and are recomputed."""
        if parent.finish_reason is None:
            parent.finish_reason = "forked"
        if parent.row is None or not parent.cached:
            self.release([parent])
            self.table.waiting.extendleft(reversed(children))
            return
        row, cached = parent.row, parent.cached
        shard = self.ops.shard_of(row)  # pages are shared only within a shard
        kids = [r for r in self.table.free_rows()
                if self.ops.shard_of(r) == shard][:len(children) - 1]
        self.ops.fork(row, kids)
        if kids and not self.ops.cache.shares_pages:
            self.ops.refresh_free()  # a dense fork fills a free row
        self.table.vacate(parent)
        for child, r in zip(children, [row] + kids):
            self.rows.place(child, r)
            child.cached = child.num_cached_tokens = cached
            self.rows.last_tokens[r] = child.tokens[-1]
        self.table.waiting.extendleft(reversed(children[1 + len(kids):]))

    def fork(self, request_id: int, n: int, params: SamplingParams, *, hold: bool) -> list[int]:
        """:meth:`paxkv.Engine.fork`: ``n`` children of a live request, sharing its pages."""
        parent = self.table.get(request_id)
        held = parent.hold and parent.finish_reason in ("stop", "length")
        if parent.row is None or not (parent.decoding or held):
            raise ValueError(f"request {request_id} is not live: fork a running request between "
                             "steps, or one submitted with hold=True that has finished")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        self.ops.check_fits(len(parent.tokens), params.max_new_tokens)
        children = self.spawn(parent, n, params=params, stops=params.stops(self.model),
                              hold=hold)
        self.branch(parent, children)
        return [c.id for c in children]

    def in_flight(self) -> tuple[list[Request], list[Request], list[Request]]:
        """What a weight update finds: requests running (in a row or waiting to feed new
        tokens), held rows (finished ``hold=True`` requests, shared prefixes) and waiting
        requests that made tokens already (preempted)."""
        running = self.table.running()
        held = [r for r in self.table.rows if r is not None and r.keeps_row]
        waited = [r for r in self.table.waiting if r.output and r.refill is None]
        return running, held, waited

    def update(self, mode: str) -> tuple[list[int], list[int], list[int]]:
        """What :meth:`paxkv.Engine.update_params` does to the rows in flight (``mode``:
        "abort", "keep" or "recompute"); returns the ids aborted, recomputed and kept."""
        running, held, waited = self.in_flight()
        if mode == "keep":
            return [], [], [r.id for r in running + held + waited]
        for r in held:  # their K/V must not serve a fork or an extension under new weights
            self.refill(r)
        if mode == "abort":
            for r in running + waited:
                self.abort(r)
            return [r.id for r in running + waited], [r.id for r in held], []
        for r in running:
            self.requeue(r)
        return [], [r.id for r in running + held + waited], []

    def extend(self, request_id: int, ids: list[int], params: SamplingParams,
               hold: bool | None) -> int:
        """:meth:`paxkv.Engine.extend`: a held, finished request goes on after ``ids`` (a tool's
        result, the next user turn) in its own row: its pages stay, only its last token and
        ``ids`` are prefilled, at the next step. Returns the new request's id."""
        parent = self.table.get(request_id)
        refilling = parent.refill is not None and parent in self.table.waiting
        if not (parent.hold and (parent.finish_reason or parent.refill) in ("stop", "length")
                and (parent.row is not None or refilling)):
            raise ValueError(f"request {request_id} cannot be extended: submit it with "
                             "hold=True and extend it once it has finished (and before it is "
                             "cancelled)")
        child = Request.make(self.table.new_id(), parent.tokens + list(ids), params,
                             params.stops(self.model), parent.key_data,
                             cache_salt=parent.cache_salt, kv_epoch=parent.kv_epoch,
                             hold=parent.hold if hold is None else hold)
        self.ops.check_fits(len(child.tokens), child.max_new_tokens)
        self.table.add(child)
        if refilling:  # its K/V is being computed again after an update: the child does it
            self.table.waiting.remove(parent)
            parent.finish_reason, parent.refill = "continued", None
            self.table.waiting.appendleft(child)
            return child.id
        row, cached = parent.row, parent.cached
        parent.finish_reason = "continued"
        self.table.vacate(parent)
        self.rows.place(child, row)
        child.cached = child.num_cached_tokens = cached
        self.table.resuming.append(child)  # the next step makes room and feeds it
        return child.id

    def cancel(self, request_id: int) -> None:
        """:meth:`paxkv.Engine.cancel`: ends a request (and its samples) and frees its row."""
        req = self.table.get(request_id)
        if req.finish_reason is None:
            if req.row is None and req in self.table.waiting:
                self.table.waiting.remove(req)
            if req in self.table.resuming:
                self.table.resuming.remove(req)
            req.finish_reason = "cancelled"
        for child in (req.children if req.n > 1 else []):
            self.cancel(child)
        self.release([req])
