"""The engine's step: admission (with prefix-cache hits), prefill, decode, release.

:class:`Scheduler` is built from parts it is handed, each testable alone: the request table
(:mod:`paxkv.engine.requests`), the row state (:class:`~paxkv.engine.requests.RowState`), the cache and its jitted
operations (:mod:`paxkv.engine.cache_ops`), the prefix cache (:mod:`paxkv.engine.prefix_sharing`, or None),
the row hand-overs (:mod:`paxkv.engine.lifecycle`), admission (:mod:`paxkv.engine.admission`), the policy
(:mod:`paxkv.engine.policy`) and the attention plan (:mod:`paxkv.core.plan`). One ``step``::

    (admit -> prefill)+ -> evict for decode -> decode one token per running row -> release

Admission runs in rounds within a step: a request whose next uncached page is being prefilled
by a request admitted earlier in the same round waits for the next round, when that page is
cached, so fifty users of one system prompt prefill it once. A request's row holds
``tokens[:cached]``; it decodes when only its newest token is missing (``cached ==
len(tokens) - 1``). When the pool runs dry mid-decode, the policy's victim is preempted and
recomputed later (its written pages go to the prefix index first, if any).

On a sharded cache (:class:`paxkv.core.protocol.Shards`) a row draws only on its shard's pages, so
every page decision is a shard's (:mod:`paxkv.engine.admission`): a new request goes to a row of the
shard whose prefix index serves the most of its prompt, when that shard has a free row and
room, else of the least-loaded one, and is admitted against that shard's free pages; a request
forking a held prefix waits for a row in the prefix's shard; a shard that runs dry preempts one
of its own requests and evicts only its own cached pages.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from paxkv.core import plan as attention_plan
from paxkv.core.sampling import NON_FINITE, Sampled
from paxkv.engine import admission, policy
from paxkv.engine.accounting import Counters
from paxkv.engine.cache_ops import CacheOps
from paxkv.engine.lifecycle import Lifecycle
from paxkv.engine.prefix_sharing import SharedPrefixes
from paxkv.engine.requests import Request, RequestTable
from paxkv.engine.requests import RowState
from paxkv.engine.weights import Weights
from paxkv.prefix.index import Hit


class Scheduler:
    """Runs steps over the parts it is given; see :class:`paxkv.engine.Engine`."""

    def __init__(self, *, model: Any, table: RequestTable, rows: RowState, ops: CacheOps,
                 prefixes: SharedPrefixes | None, counters: Counters, growth: policy.Growth,
                 life: Lifecycle, prefill_chunk: int, prefill_tokens: int,
                 shapes: policy.Shapes | None = None, logprobs_mode: str = "raw"):
        self.model, self.table, self.rows, self.ops = model, table, rows, ops
        self.weights: Weights = life.weights  # one object: update_params swaps its params
        self.logprobs_mode = logprobs_mode
        self.prefixes, self.counters, self.growth, self.life = prefixes, counters, growth, life
        self.admission = admission.Admission(table, ops, prefixes, growth)
        # Rent a wider shape until a compile's price (buckets.COMPILE_TOKENS) is padded.
        self.shapes = shapes if shapes is not None else policy.Shapes()
        self.prefill_chunk, self.prefill_tokens = prefill_chunk, prefill_tokens
        self.new_tokens: dict[int, list[int]] = {}
        self.last_plan: attention_plan.AttentionPlan | None = None  # the latest step's plan

    @property
    def cache(self) -> Any:
        return self.ops.cache

    # -- one iteration ---------------------------------------------------------------------
    def step(self) -> dict[int, list[int]]:
        """Admits what fits (in rounds), prefills it, decodes one token for every running
        row, and releases what finished. Returns the tokens generated, by request id."""
        self.table.clock += 1
        self.growth.stepped()
        self.new_tokens = {}
        if self.table.resuming:  # extended held rows: feed their new tokens first
            self._resume()
        while self.table.waiting and self.table.free_rows():
            admitted = self.admit()
            if not admitted:
                break
            self.prefill(admitted)
        live = np.array([r is not None and r.decoding for r in self.table.rows])
        self.counters.peak_running = max(self.counters.peak_running, int(live.sum()))
        if live.any():
            self._decode(live)
        elif self.table.waiting:
            raise RuntimeError("requests are waiting but none can run: finished hold=True "
                               "requests hold the rows or pages; fork or cancel them")
        return self.new_tokens

    def _resume(self) -> None:
        """Feeds extended rows (:meth:`paxkv.Engine.extend`) their new tokens, with room made
        first (:meth:`paxkv.engine.admission.Admission.make_room`)."""
        resuming, self.table.resuming = self.table.resuming, []
        for r in resuming:
            self.admission.make_room(r)
        self.prefill(resuming)

    def _holder(self, req: Request) -> Request | None:
        """The held prefix ``req`` forks at admission; ``req`` itself while that prefix is
        still waiting or prefilling; None without one (or once it was released)."""
        holder = self.table.requests.get(req.prefix_of) if req.prefix_of is not None else None
        if holder is None:
            return None
        if holder.finish_reason is None:
            return req
        return holder if holder.finish_reason == "prefilled" and holder.row is not None else None

    def admit(self) -> list[Request]:
        """One admission round (see the module docstring): each request goes to a row of the
        shard :meth:`paxkv.engine.admission.Admission.route` picks if it fits that shard's free pages."""
        admitted: list[Request] = []
        pending: set[tuple[int, bytes]] = set()  # (shard, digest) being prefilled this round
        while self.table.waiting and self.table.free_rows():
            req = self.table.waiting[0]
            req.kv_epoch = self.weights.epoch  # its K/V is computed now (or forked from holder)
            holder = self._holder(req)
            if holder is req:
                break  # its shared prefix is still being prefilled
            hits, digests = (([], []) if holder or self.prefixes is None
                             else self.prefixes.lookup(req))
            row = self.admission.route(req, holder, hits)
            if row is None:
                break  # the prefix's shard has no free row: wait for one
            shard = self.ops.shard_of(row)
            hit = hits[shard] if hits else Hit()
            if hit.num_full < len(digests) and (shard, digests[hit.num_full]) in pending:
                break  # an earlier admission of this round is prefilling that page there
            cached = holder.cached if holder else hit.num_tokens
            need = policy.pages_to_admit(len(req.tokens), cached, self.ops.cache.page_size)
            if not self.admission.fits(row, need, hit):
                break
            self.table.waiting.popleft()
            self.rows.place(req, row)
            if holder:
                self.ops.fork(holder.row, [req.row])
                req.cached, req.kv_epoch = holder.cached, holder.kv_epoch
            elif hit.num_tokens:
                self.prefixes.attach(req, hit)
            if req.preemptions == 0:
                req.num_cached_tokens = cached
                if self.prefixes is not None:
                    self.prefixes.record(shard, len(req.prompt_ids), hit.num_tokens)
            self.ops.take(row, need)
            pending.update((shard, d) for d in digests)
            admitted.append(req)
        return admitted

    def prefill(self, group: list[Request]) -> None:
        full = [r for r in group if r.cached >= r.target]  # before _prefilled moves targets
        group = policy.prefill_order([r for r in group if r.cached < r.target])
        if full:  # fully cached: no step runs for them, so count what admission booked
            self._prefilled(full)
            self.ops.refresh_free()
        while group:
            t = policy.prefill_width(max(r.target - r.cached for r in group), self.prefill_chunk)
            b_max = policy.prefill_batch_rows([r.target - r.cached for r in group], t,
                                              self.prefill_tokens, self.prefill_chunk,
                                              packed=self.ops.num_shards == 1)
            batch, group = group[:b_max], group[b_max:]
            while batch:  # the last chunk of a long prompt runs at a smaller width
                batch = self._prefill_chunk(batch, t)
                t = policy.prefill_width(max([r.target - r.cached for r in batch], default=1), t)

    def _prefill_chunk(self, batch: list[Request], t: int) -> list[Request]:
        """Feeds the next ``t`` tokens of each request (or of the first ``b`` of them, when
        :class:`paxkv.engine.policy.Shapes` runs the call in a compiled shape of ``b`` rows); returns
        those with more to feed."""
        b, t = self.shapes.choose(len(batch), t, self.ops.max_seqs)
        batch, later = batch[:b], batch[b:]
        tokens = np.zeros((b, t), np.int32)
        rows = np.full(b, batch[0].row, np.int32)
        qlen = np.zeros(b, np.int32)
        for i, r in enumerate(batch):
            chunk = r.tokens[r.cached: min(r.cached + t, r.target)]
            tokens[i, : len(chunk)], rows[i], qlen[i] = chunk, r.row, len(chunk)
        plan = self.plan(batch, max(r.cached + int(q) for r, q in zip(batch, qlen)))
        if self.ops.num_shards == 1:  # packing would mix the data shards' rows
            plan = dataclasses.replace(
                plan, packed_tokens=policy.packed_tokens(int(qlen.sum()), b * t))
        plan = self.shapes.plan((b, t), plan)
        self.last_plan = plan
        drawn, ok = self.ops.prefill(self.model, self.weights.params, tokens, rows, qlen,
                                     self.rows.sampling_for(rows), plan, _logprobs(batch),
                                     self.logprobs_mode)
        more, done = list(later), []
        for i, r in enumerate(batch):
            if not ok[i]:  # its shard could not hold it after all: back to the queue
                shard = self.ops.shard_of(r.row)
                if not any(o not in batch and self.ops.shard_of(o.row) == shard
                           for o in self.table.running()):
                    raise RuntimeError(f"request {r.id} does not fit even alone: finished "
                                       "hold=True requests hold the pages; fork or cancel them")
                self.life.preempt(r)
                continue
            self.counters.prefill_tokens += int(qlen[i])
            r.cached += int(qlen[i])
            (more if r.cached < r.target else done).append(r)
        if self.prefixes is not None and self.prefixes.each_chunk:
            self.prefixes.index_rows(more[len(later):])  # before their windows slide on
        self._prefilled(done, drawn, [batch.index(r) for r in done])
        return more

    def _prefilled(self, done: list[Request], drawn: Any = None,
                   where: list[int] | None = None) -> None:
        """Prompts fully in the cache: index their pages, then sample (``drawn`` at batch
        index ``where[i]`` is request ``i``'s token) or fork."""
        if self.prefixes is not None:
            self.prefixes.index_rows(done)
        for i, r in enumerate(done):
            if r.refill is not None:  # a held row computed again: held as it was
                r.finish_reason, r.refill = r.refill, None
            elif r.is_prefix:
                r.finish_reason = "prefilled"  # keeps its row for the requests that fork it
            elif r.n > 1:
                self.life.branch(r, self.life.spawn(r, r.n, sample=True))
            else:
                self._append(r, drawn, where[i])
        self.life.finish(done)

    def _decode(self, live: np.ndarray) -> None:
        if self.prefixes is not None:  # a page or a copy per live row, from its shard
            rps = self.ops.rows_per_shard
            for shard, num in enumerate(live.reshape(-1, rps).sum(axis=1)):
                if num > self.ops.shard_free[shard]:
                    self.prefixes.evict(int(num - self.ops.shard_free[shard]), shard=shard)
        live_rows = np.flatnonzero(live)
        stepping = [self.table.rows[i] for i in live_rows]
        plan = self.plan(stepping, max(len(r.tokens) for r in self.table.rows if r is not None),
                          decode_lengths=[len(r.tokens) for r in stepping],
                          final=max(r.cached + policy.tokens_to_write(r) for r in stepping))
        width, s = policy.decode_width(live_rows.size, self.ops.max_seqs), self.ops.max_seqs
        if width < s:
            # Few rows live: run only them (a batch of ``width`` rows gathered by ``rows``)
            # rather than every row of the cache; one token each is a one-token prefill.
            rows = np.full(width, live_rows[0], np.int32)
            rows[: live_rows.size] = live_rows
            qlen = (np.arange(width) < live_rows.size).astype(np.int32)
            drawn, ok_b = self.ops.prefill(self.model, self.weights.params,
                                           self.rows.last_tokens[rows][:, None], rows, qlen,
                                           self.rows.sampling_for(rows), plan,
                                           _logprobs(stepping), self.logprobs_mode)
            ok, where = np.zeros(s, bool), np.zeros(s, np.int64)
            ok[live_rows], where[live_rows] = ok_b[: live_rows.size], np.arange(live_rows.size)
        else:
            drawn, ok = self.ops.decode(self.model, self.weights.params, self.rows.last_tokens,
                                        live, self.rows.sampling_for(None), plan,
                                        _logprobs(stepping), self.logprobs_mode)
            where = np.arange(s)
        self.counters.decode_tokens += int(ok.sum())
        for row in np.flatnonzero(ok):
            self.table.rows[row].cached += 1
            self._append(self.table.rows[row], drawn, int(where[row]))
        self.life.finish([r for r in self.table.rows
                          if r is not None and r.finish_reason is not None])
        # A shard out of pages frees a victim's pages, among its own requests only.
        for victim in policy.preemption_victims(
                self.table.running(), np.flatnonzero(live & ~ok), self.ops.rows_per_shard,
                self.ops.cache.page_size, cached=self.prefixes is not None):
            self.life.preempt(victim)

    def plan(self, stepping: list[Request], longest: int,
             decode_lengths: list[int] | None = None,
             final: int | None = None) -> attention_plan.AttentionPlan:
        """The step's attention plan (:func:`paxkv.engine.policy.step_plan`), kept as
        :attr:`last_plan`."""
        self.last_plan = policy.step_plan(self.ops.cache, self.ops.shares, stepping, longest,
                                          decode_lengths, final)
        return self.last_plan

    # -- bookkeeping -----------------------------------------------------------------------
    def _append(self, req: Request, drawn: Any, i: int) -> None:
        """Appends the token ``drawn`` holds at batch index ``i`` (and, if ``req`` asked, its
        log-probabilities) to ``req``, and ends it on a stop token or its length; a row whose
        logits were not finite (:data:`paxkv.core.sampling.NON_FINITE`) ends "non_finite"
        with nothing appended."""
        sampled = isinstance(drawn, Sampled)
        token = int((drawn.tokens if sampled else drawn)[i])
        if token == NON_FINITE:
            req.finish_reason = "non_finite"
            return
        if sampled and req.logprobs is not None:
            req.token_logprobs.append(float(drawn.logprobs[i]))
            req.top_logprobs.append([(int(t), float(v)) for t, v in
                                     zip(drawn.top_ids[i, :req.logprobs],
                                         drawn.top_logprobs[i, :req.logprobs])])
        req.output.append(token)
        req.versions.append(self.weights.version)
        self.new_tokens.setdefault(req.id, []).append(token)
        self.rows.last_tokens[req.row] = token
        if token in req.stop_ids:
            req.finish_reason = "stop"
        elif len(req.output) >= req.max_new_tokens:
            req.finish_reason = "length"


def _logprobs(reqs: list[Request]) -> int | None:
    """The step's ``logprobs`` (the most alternatives any of ``reqs`` asked for; None: no
    request asked, so the step computes none)."""
    asked = [r.logprobs for r in reqs if r.logprobs is not None]
    return max(asked) if asked else None
