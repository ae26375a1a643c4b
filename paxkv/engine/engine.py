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
:meth:`Engine.cancel` the losers). The parts: :mod:`paxkv.engine.requests` (the table),
:class:`~paxkv.engine.requests.RowState` (per-row settings), :mod:`paxkv.engine.cache_ops` (the cache),
:mod:`paxkv.engine.prefix_sharing`, :mod:`paxkv.engine.lifecycle` (who holds a row), :mod:`paxkv.engine.policy`,
:mod:`paxkv.engine.scheduler` (the step) and :mod:`paxkv.engine.accounting`.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from paxkv.core.compiles import CompileStats, counting, metered, use_persistent_cache
from paxkv.core.protocol import KVCache, check_model
from paxkv.core.sampling import SamplingParams
from paxkv.engine import accounting, policy
from paxkv.engine.accounting import Counters, EngineStats, SequenceStats
from paxkv.engine.cache_ops import CacheOps
from paxkv.engine.lifecycle import Lifecycle
from paxkv.engine.policy import Growth, Shapes
from paxkv.engine.requests import GenerationResult, Request, RequestTable, StepOutput
from paxkv.engine.requests import RowState
from paxkv.engine.scheduler import Scheduler
from paxkv.engine import setup
from paxkv.engine.setup import build_cache, place_model, token_ids

__all__ = ["Engine", "EngineStats", "GenerationResult", "SequenceStats", "StepOutput"]


class Engine:
    """A paged (or dense) KV cache serving many requests through jitted steps.

    Args:
      model: a :class:`paxkv.core.protocol.Model` (``paxkv.models.load()``, or your own).
      cache: "paged", "dense" (the comparison twin), or a :class:`paxkv.core.protocol.KVCache`
        you built (say NaN-filled, to prove no stray reads); the sizes below are then its own.
      max_seqs: cache rows (the most requests running at once); default 32, on a ``mesh``
        rounded up to a multiple of its data axis.
      max_len: the most tokens (prompt + output) one request may hold.
      page_size, num_pages: paged layout; ``num_pages`` defaults to the dense reservation
        ``max_seqs * ceil(max_len / page_size)``.
      kv_dtype: K/V dtype (``jnp.bfloat16``: half the bytes; stored as bits on a CPU).
      attention_impl: "auto" (Pallas on a GPU for pages the kernels accept, else XLA),
        "pallas", "pallas_mma" (the kernels on tensor cores where they serve the pages) or "xla".
      prefill_chunk: longest prompt chunk per prefill call; prefill_tokens: batch x chunk budget.
      prefix_cache: reuse cached full pages across requests (default: on for a paged cache;
        on a model with window layers each window group keeps the window pages of cached
        prompts too: :mod:`paxkv.prefix.window_index`).
        Cached pages stay after their requests finish, until evicted for room or dropped by
        :meth:`clear_prefix_cache`: :meth:`stats` counts them as ``reclaimable_pages``, not
        free ones.
      growth: how admission projects the running requests' growth
        (:class:`paxkv.engine.policy.Growth`; ``Growth(start=0, floor=0)`` admits whatever fits now).
      shapes: which prefill shapes compile (:class:`paxkv.engine.policy.Shapes`: a call runs padded
        in a compiled wider shape until the padding has cost ``buy`` tokens, default
        :data:`paxkv.core.buckets.COMPILE_TOKENS`; ``Shapes(buy=0)`` compiles every call's own shape).
      mesh: a ``("data", "model")`` :class:`jax.sharding.Mesh` (:func:`paxkv.scale.mesh.make_mesh`)
        for ``cache="paged"``: rows and pages split over ``data`` (``max_seqs`` and
        ``num_pages`` must divide by it; :mod:`paxkv.scale.sharded_cache`), each request placed in
        the shard holding its cached prefix if it has room, else in the least-loaded one
        (the prefix cache keeps one index per shard: page ids are shard-local); kv heads and
        the weights split over ``model`` (:func:`paxkv.engine.setup.place_model`). None: one
        device. Across processes (:func:`paxkv.scale.distributed.process_mesh`): every process
        builds the same engine and makes the same calls in the same order.
      host_cache_bytes: a host-memory tier under the prefix cache (a paged cache; on a mesh
        one per data shard, each ``1 / data`` of the bytes):
        pages evicted for room are copied to host memory within this many bytes and copied
        back, instead of prefilled, when a prompt runs past the device's cached chain
        (:mod:`paxkv.prefix.host_tier`; 0 = off). ``stats().host`` reports it; ``host_ttl_s``
        drops host pages unused for that long. :meth:`pin_prefix` keeps a prefix in either.
      compile_cache: JAX's persistent compilation cache, so a new process loads the steps an
        earlier one compiled (:func:`paxkv.core.compiles.use_persistent_cache`): None, the
        user's cache folder (``$PAXKV_COMPILE_CACHE`` moves it or, "off", turns it off); a
        folder; False: off. A cache you configured in JAX stays yours.
    """

    def __init__(self, model: Any, *, cache: str | KVCache = "paged",
                 max_seqs: int | None = None, max_len: int = 2048, page_size: int = 16,
                 num_pages: int | None = None, kv_dtype: Any = jnp.float32,
                 attention_impl: str = "auto",
                 prefill_chunk: int = 512, prefill_tokens: int = 4096, scrub: bool = True,
                 prefix_cache: bool | None = None, growth: Growth | None = None,
                 shapes: Shapes | None = None, mesh: Mesh | None = None,
                 compile_cache: str | bool | None = None, host_cache_bytes: int = 0,
                 host_ttl_s: float | None = None):
        check_model(model)
        self.compile_cache = use_persistent_cache(compile_cache)  # before the first compile
        self.compile_stats = CompileStats()
        kv = build_cache(model, cache, max_seqs=max_seqs, max_len=max_len, page_size=page_size,
                         num_pages=num_pages, kv_dtype=kv_dtype,
                         attention_impl=attention_impl, scrub=scrub, mesh=mesh,
                         step_tokens=prefill_tokens, prefix_cache=prefix_cache is not False,
                         step_rows=policy.most_prefill_rows(prefill_chunk, prefill_tokens))
        self.model = place_model(model, mesh)
        self.table = RequestTable(kv.max_seqs)
        self.ops = CacheOps(kv, None if isinstance(cache, KVCache) else max_len)
        self.prefixes = setup.prefix_cache(self.ops, prefix_cache, host_ttl_s=host_ttl_s,
                                           host_cache_bytes=host_cache_bytes)
        self.counters = Counters()
        rows, growth = RowState(self.table), growth or Growth()
        self.lifecycle = Lifecycle(self.model, self.table, rows, self.ops, self.prefixes,
                                   self.counters, growth)
        self.scheduler = Scheduler(  # the placed model: its weights already lie on the mesh
            model=self.model, table=self.table, rows=rows, ops=self.ops, prefixes=self.prefixes,
            counters=self.counters, growth=growth, life=self.lifecycle,
            prefill_chunk=prefill_chunk, prefill_tokens=prefill_tokens, shapes=shapes)

    @property
    def cache(self) -> Any:
        """The cache as of the last operation (replaced by every step: do not keep it)."""
        return self.ops.cache

    # -- requests -------------------------------------------------------------------------
    def submit(self, prompt_ids: Sequence[int], params: SamplingParams | None = None, *,
               max_new_tokens: int | None = None, temperature: float | None = None,
               top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
               n: int | None = None, stop_token_ids: Sequence[int] | None = None,
               logprobs: int | None = None, hold: bool = False,
               cache_salt: str | bytes | None = None,
               key: jax.Array | None = None, prefix: int | None = None) -> int:
        """Queues a request; returns its id. Raises ValueError naming what to change.

        Args:
          prompt_ids: int token ids (a list, or a 1-D integer numpy / JAX array); floats,
            bools and text are refused (``model.encode(text)`` first).
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
                              stop_token_ids=stop_token_ids, logprobs=logprobs)
        prompt_ids = self.table.prompt(token_ids(prompt_ids), self.model.vocab_size, prefix)
        self.ops.check_fits(len(prompt_ids), p.max_new_tokens)
        rid = self.table.new_id()
        req = Request.make(rid, prompt_ids, p, p.stops(self.model), p.key_data(rid, key),
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

    @metered
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
        p = SamplingParams.of(params or self.table.get(request_id).params(),
                              max_new_tokens=max_new_tokens, temperature=temperature,
                              top_k=top_k, top_p=top_p, stop_token_ids=stop_token_ids)
        return self.lifecycle.fork(request_id, n, p, hold=hold)

    @metered
    def cancel(self, request_id: int) -> None:
        """Stops a request now (and its samples); a running or held one releases its row in
        this call: pages nobody else holds are free at once (full prompt pages the prefix
        cache keeps are reclaimable: :attr:`EngineStats.reclaimable_pages`)."""
        self.lifecycle.cancel(request_id)

    # -- running --------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.table.has_work()

    @metered
    def step(self) -> StepOutput:
        """One iteration (see :mod:`paxkv.engine.scheduler`): the tokens each request generated and
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

    @metered
    def warm_up(self, prompt_lengths: Sequence[int], max_new_tokens: int = 4,
                params: SamplingParams | None = None) -> CompileStats:
        """Compiles the steps a batch of prompts of ``prompt_lengths`` tokens takes (its
        prefill calls, its decode steps at each width it passes) before the first request, by
        running that batch on placeholder tokens: for steady timings from the first real
        batch, warm up with one like it. The results are dropped, every page returns, the
        prefix cache forgets them, admission's growth projection and the running totals
        restart (``compile_stats`` keeps what this paid). Returns what this paid.

        Args:
          prompt_lengths: one placeholder prompt of each length (distinct random tokens, so
            no prompt is served from another's pages).
          max_new_tokens: decode steps to run.
          params: the sampling the real requests will use (the default: greedy).
        """
        if self.has_work():
            raise ValueError("warm_up runs before any request: the engine has work queued or "
                             "running (finish or cancel it first)")
        paid = CompileStats()
        with counting(paid):
            rng = np.random.default_rng(0)
            p = SamplingParams.of(params, max_new_tokens=max_new_tokens, stop_token_ids=[])
            for n in prompt_lengths:
                self.submit(rng.integers(0, self.model.vocab_size, int(n)).tolist(), p)
            self.run()  # hands every result out: the table keeps none of them
            self.clear_prefix_cache()
        self._reset_totals()
        self.scheduler.growth.reset()
        return paid

    # -- sharing and accounting -----------------------------------------------------------
    @metered
    def clear_prefix_cache(self) -> int:
        """Drops every cached page's index reference; returns how many pages the index held
        (those no running request holds are free at once)."""
        return 0 if self.prefixes is None else self.prefixes.clear()

    def pin_prefix(self, prompt_ids: Sequence[int], *,
                   cache_salt: str | bytes | None = None) -> int:
        """Keeps the cached full pages of ``prompt_ids`` (``cache_salt``'s), now or once
        cached, from eviction (and, with a host tier, from being dropped there) until
        :meth:`unpin_prefix` or :meth:`clear_prefix_cache`; returns how many pages it names."""
        return len(self._prefix_cache("pin_prefix").pin(token_ids(prompt_ids), cache_salt))

    def unpin_prefix(self, prompt_ids: Sequence[int], *,
                     cache_salt: str | bytes | None = None) -> int:
        """Lets :meth:`pin_prefix`'s pages go again (least recently used first)."""
        return len(self._prefix_cache("unpin_prefix").unpin(token_ids(prompt_ids), cache_salt))

    def _prefix_cache(self, what: str) -> Any:
        if self.prefixes is None or not hasattr(self.prefixes, "pin"):
            raise ValueError(f"{what} needs the prefix cache of a paged cache without window "
                             "groups: build the engine with prefix_cache=True")
        return self.prefixes

    @metered
    def stats(self) -> EngineStats:
        """Pool, sharing and prefix-cache accounting now, and the compiles paid (see
        :class:`EngineStats`)."""
        return accounting.engine_stats(self.ops, self.table, self.counters, self.prefixes,
                                       self.compile_stats)

    def reset_stats(self) -> None:
        """Zeroes the running totals and peaks (a timed run after a warm-up starts clean)."""
        self._reset_totals()
        self.compile_stats.reset()

    def _reset_totals(self) -> None:
        """The counters, peaks and host-tier totals from now (compiles kept)."""
        self.counters.reset()
        self.ops.reset_counts()
        for host in getattr(self.prefixes, "hosts", ()):
            host.reset_counts()
