"""Continuous batching over cache rows: the public API of a Python loop around jitted steps.

Requests wait in a queue and are admitted into free cache rows while pages allow. Each
``step()`` prefills what was admitted (bucketed, chunked), decodes one token for every running
row, releases what finished, and returns what changed (:class:`StepOutput`), so a loop can
stream. A finished request's result is handed out once and the request is dropped. When the
pool runs dry mid-decode, a running request is preempted and recomputed later (vLLM's recompute
preemption): no live token is overwritten.

Sharing (paged cache): the prefix cache (on by default) reuses cached pages of identical
prompt prefixes; ``submit_prefix`` + ``submit(..., prefix=id)`` forks one prefilled prefix into
every request that names it; ``n > 1`` prefills a prompt once and forks it into ``n`` samples;
:meth:`Engine.fork` branches a live sequence (a tree of thought: branch, continue,
:meth:`Engine.cancel` the losers). The parts: :mod:`paxkv.requests` (the table),
:mod:`paxkv.cache_ops` (the cache), :mod:`paxkv.prefix_sharing`, :mod:`paxkv.policy`,
:mod:`paxkv.scheduler` (the step) and :mod:`paxkv.accounting`.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from paxkv import accounting, buckets, dense_cache, paged_cache
from paxkv.accounting import Counters, EngineStats, SequenceStats
from paxkv.cache_ops import CacheOps
from paxkv.policy import Growth
from paxkv.prefix_sharing import SharedPrefixes
from paxkv.protocol import KVCache, check_model
from paxkv.requests import GenerationResult, Request, RequestTable, StepOutput
from paxkv.sampling import SamplingParams
from paxkv.scheduler import Scheduler

__all__ = ["Engine", "EngineStats", "GenerationResult", "SequenceStats", "StepOutput"]


class Engine:
    """A paged (or dense) KV cache serving many requests through jitted steps.

    Args:
      model: a :class:`paxkv.protocol.Model` (``paxkv.models.load()``, or your own).
      cache: "paged", "dense" (the comparison twin), or a :class:`paxkv.protocol.KVCache`
        you built (say NaN-filled, to prove no stray reads); the sizes below are then its own.
      max_seqs: cache rows (the most requests running at once).
      max_len: the most tokens (prompt + output) one request may hold.
      page_size, num_pages: paged layout; ``num_pages`` defaults to the dense reservation
        ``max_seqs * ceil(max_len / page_size)``.
      kv_dtype: K/V dtype (``jnp.bfloat16``: half the bytes; stored as bits on a CPU).
      attention_impl: "auto" (Pallas on GPU, XLA elsewhere), "pallas" or "xla".
      prefill_chunk: longest prompt chunk per prefill call; prefill_tokens: batch x chunk budget.
      prefix_cache: reuse cached full pages across requests (default: on for a paged cache).
        Cached pages stay after their requests finish, until evicted for room or dropped by
        :meth:`clear_prefix_cache`.
      growth: how admission projects the running requests' growth
        (:class:`paxkv.policy.Growth`; ``Growth(start=0, floor=0)`` admits whatever fits now).
    """

    def __init__(self, model: Any, *, cache: str | KVCache = "paged", max_seqs: int = 32,
                 max_len: int = 2048, page_size: int = 16, num_pages: int | None = None,
                 kv_dtype: Any = jnp.float32, attention_impl: str = "auto",
                 prefill_chunk: int = 512, prefill_tokens: int = 4096, scrub: bool = True,
                 prefix_cache: bool | None = None, growth: Growth | None = None):
        check_model(model)
        dims = dict(num_layers=model.num_layers, num_kv_heads=model.num_kv_heads,
                    head_dim=model.head_dim, max_seqs=max_seqs, max_len=max_len, dtype=kv_dtype)
        if isinstance(cache, KVCache):
            kv = cache
        elif cache == "paged":
            kv = paged_cache.create(
                num_pages=num_pages or max_seqs * buckets.cdiv(max_len, page_size),
                page_size=page_size, scrub=scrub, attention_impl=attention_impl, **dims)
        elif cache == "dense":
            kv = dense_cache.create(**dims)
        else:
            raise ValueError(f"cache must be 'paged', 'dense' or a KVCache, got {cache!r}")
        if prefix_cache and not kv.shares_pages:
            raise ValueError("prefix_cache needs a paged cache (a dense row cannot be shared)")
        self.model = model
        self.table = RequestTable(kv.max_seqs)
        self.ops = CacheOps(kv, None if isinstance(cache, KVCache) else max_len)
        use_index = kv.shares_pages if prefix_cache is None else prefix_cache
        self.prefixes = SharedPrefixes(self.ops, kv.page_size) if use_index else None
        self.counters = Counters()
        self.scheduler = Scheduler(model, self.table, self.ops, self.prefixes, self.counters,
                                   growth or Growth(), prefill_chunk=prefill_chunk,
                                   prefill_tokens=prefill_tokens)

    @property
    def cache(self) -> Any:
        """The cache as of the last operation (replaced by every step: do not keep it)."""
        return self.ops.cache

    # -- requests -------------------------------------------------------------------------
    def submit(self, prompt_ids: Sequence[int], params: SamplingParams | None = None, *,
               max_new_tokens: int | None = None, temperature: float | None = None,
               top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
               n: int | None = None, stop_token_ids: Sequence[int] | None = None,
               hold: bool = False, cache_salt: str | bytes | None = None,
               key: jax.Array | None = None, prefix: int | None = None) -> int:
        """Queues a request; returns its id. Raises ValueError naming what to change.

        Args:
          params: the request's :class:`SamplingParams`; the keyword forms override fields.
          key: a PRNG key to sample from instead of ``fold_in(PRNGKey(seed), request id)``.
          hold: after finishing keep the row and its pages, so :meth:`fork` can branch it;
            :meth:`cancel` releases it.
          cache_salt: prefix-cache tenant: requests with different salts never share pages.
          prefix: a :meth:`submit_prefix` id: the prompt is that prefix + ``prompt_ids``, and
            the request starts from the prefix's pages (forked, none recomputed).
        """
        p = SamplingParams.of(params, max_new_tokens=max_new_tokens, temperature=temperature,
                              top_k=top_k, top_p=top_p, seed=seed, n=n,
                              stop_token_ids=stop_token_ids)
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        if prefix is not None:
            holder = self.table.requests.get(prefix)
            if holder is None or not holder.is_prefix:
                raise ValueError(f"prefix={prefix!r} is not a live id from submit_prefix()")
            prompt_ids = holder.prompt_ids + prompt_ids
        self.ops.check_fits(len(prompt_ids), p.max_new_tokens)
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.model.vocab_size:
            raise ValueError(f"prompt token ids must lie in [0, {self.model.vocab_size})")
        rid = self.table.new_id()
        if key is None:
            key = jax.random.fold_in(jax.random.PRNGKey(p.seed), rid)
        elif jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.key_data(key)
        req = Request.make(rid, prompt_ids, p, p.stops(self.model), np.asarray(key, np.uint32),
                           salt=cache_salt, hold=hold, prefix_of=prefix)
        self.table.add(req)
        self.table.waiting.append(req)
        return rid

    def submit_prefix(self, prompt_ids: Sequence[int], *,
                      cache_salt: str | bytes | None = None) -> int:
        """Queues a shared prefix (a system prompt): prefilled once, then it holds its row
        ("prefilled"); requests submitted with ``prefix=`` this id fork its pages, a partly
        filled last page included. :meth:`cancel` releases it."""
        rid = self.submit(prompt_ids, max_new_tokens=1, stop_token_ids=(),
                          cache_salt=cache_salt)
        self.table.requests[rid].is_prefix = True
        return rid

    def fork(self, request_id: int, n: int, params: SamplingParams | None = None, *,
             max_new_tokens: int | None = None, temperature: float | None = None,
             top_k: int | None = None, top_p: float | None = None,
             stop_token_ids: Sequence[int] | None = None, hold: bool = False) -> list[int]:
        """Branches a live request into ``n`` children that continue it, sharing its pages
        (nothing is prefilled again). Returns the children's ids.

        The request must be decoding (between steps) or finished with ``hold=True``; it ends
        ("forked", or keeps its finish reason if held) and its row goes to the children. Child
        i samples from ``fold_in(parent key, i)``. Settings come from ``params`` (default:
        the parent's), then the keyword forms.
        """
        parent = self.table.get(request_id)
        held = parent.hold and parent.finish_reason in ("stop", "length")
        if parent.row is None or not (parent.decoding or held):
            raise ValueError(f"request {request_id} is not live: fork a running request between "
                             "steps, or one submitted with hold=True that has finished")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        p = SamplingParams.of(params or parent.params(), max_new_tokens=max_new_tokens,
                              temperature=temperature, top_k=top_k, top_p=top_p,
                              stop_token_ids=stop_token_ids)
        self.ops.check_fits(len(parent.tokens), p.max_new_tokens)
        children = self.scheduler.spawn(parent, n, params=p, stops=p.stops(self.model),
                                        hold=hold)
        self.scheduler.branch(parent, children)
        return [c.id for c in children]

    def cancel(self, request_id: int) -> None:
        """Stops a request now (and its samples); a running or held one releases its row in
        this call: pages nobody else holds are free at once."""
        req = self.table.get(request_id)
        if req.finish_reason is None:
            if req.row is None and req in self.table.waiting:
                self.table.waiting.remove(req)
            req.finish_reason = "cancelled"
        for child in (req.children if req.n > 1 else []):
            self.cancel(child)
        self.scheduler.release([req])

    # -- running --------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.table.has_work()

    def step(self) -> StepOutput:
        """One iteration (see :mod:`paxkv.scheduler`): the tokens each request generated and
        the requests now done (handed out here once, then dropped)."""
        new_tokens = self.scheduler.step() if self.has_work() else {}
        return StepOutput(new_tokens, self._hand_out())

    def run(self) -> dict[int, GenerationResult]:
        """Steps until nothing runs; results by request id of every request that finished
        (held and prefix requests included: they stay until forked or cancelled)."""
        results = self._hand_out()
        while self.has_work():
            results.update(self.step().finished)
        held = {r.id: self._result(r) for r in self.table.requests.values()
                if r.finish_reason is not None and r.sample_of is None}
        return {**results, **held}

    def result(self, request_id: int) -> GenerationResult:
        """A live request's result so far (finish_reason "running" until it ends)."""
        return self._result(self.table.get(request_id))

    def _hand_out(self) -> dict[int, GenerationResult]:
        return self.table.hand_out(getattr(self.model, "decode", None))

    def _result(self, req: Request) -> GenerationResult:
        return self.table.result(req, getattr(self.model, "decode", None))

    # -- sharing and accounting -----------------------------------------------------------
    def clear_prefix_cache(self) -> int:
        """Drops every cached page's index reference; returns how many pages the index held
        (those no running request holds are free at once)."""
        return 0 if self.prefixes is None else self.prefixes.clear()

    def stats(self) -> EngineStats:
        """Pool, sharing and prefix-cache accounting now (see :class:`EngineStats`)."""
        return accounting.engine_stats(self.ops, self.table, self.counters,
                                       None if self.prefixes is None else self.prefixes.index)

    def reset_stats(self) -> None:
        """Zeroes the running totals and peaks (a timed run after a warm-up starts clean)."""
        self.counters = self.scheduler.counters = Counters()
        self.ops.peak_used = self.ops.cache.num_pages - self.ops.free
        self.ops.cow_copies = 0
