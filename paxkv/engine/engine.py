"""Continuous batching over cache rows: the public API of a Python loop around jitted steps.

Requests wait in a queue and are admitted into free cache rows while pages allow. Each
``step()`` prefills what was admitted, decodes one token for every running row, releases what
finished and returns what changed (:class:`StepOutput`); a finished result is handed out once.
When the pool runs dry mid-decode a request is preempted and recomputed later. Sharing (paged
cache): the prefix cache, ``submit_prefix`` + ``submit(..., prefix=id)``, ``n > 1`` samples,
:meth:`Engine.fork` and :meth:`Engine.extend`; weights change between steps through
:meth:`Engine.update_params`. The parts are listed in :mod:`paxkv.engine`.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from paxkv.core.compiles import CompileStats, metered, use_persistent_cache
from paxkv.core.protocol import KVCache, check_model
from paxkv.core.sampling import SamplingParams, check_logprobs_mode
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
from paxkv.engine.weights import ParamsUpdate, Weights, WeightSwap

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
        window groups keep cached prompts' window pages: :mod:`paxkv.prefix.window_index`).
        Cached pages stay until evicted for room or :meth:`clear_prefix_cache`
        (``reclaimable_pages`` in :meth:`stats`, not free ones).
      growth: how admission projects running requests' growth (:class:`~paxkv.engine.policy.Growth`).
      shapes: which prefill shapes compile (:class:`~paxkv.engine.policy.Shapes`: a call runs
        in a compiled wider shape until the padding has cost ``buy`` tokens).
      mesh: a ``("data", "model")`` mesh (:func:`paxkv.scale.mesh.make_mesh`) for
        ``cache="paged"``: rows and pages split over ``data`` (``max_seqs`` and ``num_pages``
        divide by it; a request goes to the shard holding its cached prefix if it has room,
        else the least loaded: :mod:`paxkv.scale.routing`); kv heads and weights over
        ``model`` (:func:`paxkv.engine.setup.place_model`). None: one device. Across
        processes every process builds the same engine and makes the same calls.
      host_cache_bytes: a host-memory tier under the prefix cache (0 = off; on a mesh one per
        data shard): evicted pages are copied there and back instead of prefilled again
        (:mod:`paxkv.prefix.host_tier`; ``stats().host``); ``host_ttl_s`` drops pages unused
        that long.
      compile_cache: JAX's persistent compilation cache
        (:func:`paxkv.core.compiles.use_persistent_cache`): None, the user's cache folder
        (``$PAXKV_COMPILE_CACHE`` moves it, "off" turns it off); a folder; False: off.
      logprobs_mode: what ``logprobs`` report (:func:`paxkv.core.sampling.mode_logits`): "raw"
        (the model's), "temperature" or "processed" (exactly the distribution sampled);
        :func:`paxkv.rl.token_logprobs` computes the same on the trainer's side.
    """

    def __init__(self, model: Any, *, cache: str | KVCache = "paged",
                 max_seqs: int | None = None, max_len: int = 2048, page_size: int = 16,
                 num_pages: int | None = None, kv_dtype: Any = jnp.float32,
                 attention_impl: str = "auto",
                 prefill_chunk: int = 512, prefill_tokens: int = 4096, scrub: bool = True,
                 prefix_cache: bool | None = None, growth: Growth | None = None,
                 shapes: Shapes | None = None, mesh: Mesh | None = None,
                 compile_cache: str | bool | None = None, host_cache_bytes: int = 0,
                 host_ttl_s: float | None = None, logprobs_mode: str = "raw"):
        check_model(model)
        check_logprobs_mode(logprobs_mode)
        self.compile_cache = use_persistent_cache(compile_cache)  # before the first compile
        self.compile_stats = CompileStats()
        kv = build_cache(model, cache, max_seqs=max_seqs, max_len=max_len, page_size=page_size,
                         num_pages=num_pages, kv_dtype=kv_dtype,
                         attention_impl=attention_impl, scrub=scrub, mesh=mesh,
                         step_tokens=prefill_tokens, prefix_cache=prefix_cache is not False,
                         step_rows=policy.most_prefill_rows(prefill_chunk, prefill_tokens))
        self.model = place_model(model, mesh)
        self.weights = Weights(self.model.params)  # what every step reads; update_params swaps
        self.table = RequestTable(kv.max_seqs)
        self.ops = CacheOps(kv, None if isinstance(cache, KVCache) else max_len)
        self.prefixes = setup.prefix_cache(self.ops, prefix_cache, host_ttl_s=host_ttl_s,
                                           host_cache_bytes=host_cache_bytes)
        self.counters = Counters()
        rows, growth = RowState(self.table), growth or Growth()
        self.lifecycle = Lifecycle(self.model, self.table, rows, self.ops, self.prefixes,
                                   self.counters, growth, self.weights)
        self.swap = WeightSwap(self.weights, self.lifecycle, self.prefixes)
        self.scheduler = Scheduler(  # the placed model: its weights already lie on the mesh
            model=self.model, table=self.table, rows=rows, ops=self.ops, prefixes=self.prefixes,
            counters=self.counters, growth=growth, life=self.lifecycle,
            prefill_chunk=prefill_chunk, prefill_tokens=prefill_tokens, shapes=shapes,
            logprobs_mode=logprobs_mode)

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
                           cache_salt=cache_salt, hold=hold, prefix_of=prefix)
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
    def extend(self, request_id: int, token_ids: Sequence[int],
               params: SamplingParams | None = None, *, max_new_tokens: int | None = None,
               temperature: float | None = None, top_k: int | None = None,
               top_p: float | None = None, stop_token_ids: Sequence[int] | None = None,
               logprobs: int | None = None, hold: bool | None = None) -> int:
        """Continues a finished ``hold=True`` request after ``token_ids`` (a tool's result, the
        next turn: ids in, ids out) in its own row: only its last token and ``token_ids``
        are prefilled. It ends "continued"; returns the new request's id (its prompt: the
        whole history). Settings: ``params`` (default: the request's), then the keywords."""
        req = self.table.get(request_id)
        p = SamplingParams.of(params or req.params(), max_new_tokens=max_new_tokens,
                              temperature=temperature, top_k=top_k, top_p=top_p,
                              stop_token_ids=stop_token_ids, logprobs=logprobs)
        ids = self.table.prompt(setup.token_ids(token_ids), self.model.vocab_size)
        return self.lifecycle.extend(request_id, ids, p, hold)

    @metered
    def update_params(self, params: Any, *, in_flight: str | None = None,
                      keep_prefix_cache: bool = False) -> ParamsUpdate:
        """Replaces the weights every later step runs on (RL: the policy after an optax step):
        same tree, shapes and dtypes (else a ``ValueError`` naming the leaf, old weights
        kept); leaves placed as the engine's are taken uncopied, others placed once; no step
        compiles again; the weight version goes up by one (each token's is in its result).

        ``in_flight``: "abort", "keep" or "recompute" (:mod:`paxkv.engine.weights`); None only
        when nothing is in flight. ``keep_prefix_cache``: serve K/V cached under earlier
        weights (stale; off: dropped now, and pins carry over to the new weights' pages).
        """
        return self.swap.update(params, in_flight, keep_prefix_cache)

    @property
    def params(self) -> Any:
        """The params tree the steps run on now (:meth:`update_params` replaces it)."""
        return self.weights.params

    @property
    def weight_version(self) -> int:
        """How many times :meth:`update_params` replaced the weights."""
        return self.weights.version

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

    warm_up = setup.warm_up  # what an engine runs before its first request (set-up)

    # -- sharing and accounting -----------------------------------------------------------
    @metered
    def clear_prefix_cache(self) -> int:
        """Drops every cached page's index reference, pins too; returns how many pages the
        index held (those no running request holds are free at once)."""
        return self.swap.forget(keep_pins=False)

    def pin_prefix(self, prompt_ids: Sequence[int], *,
                   cache_salt: str | bytes | None = None) -> int:
        """Keeps the cached full pages of ``prompt_ids`` (``cache_salt``'s), now or once
        cached, from eviction (and, with a host tier, from being dropped there) until
        :meth:`unpin_prefix` or :meth:`clear_prefix_cache`, across weight updates; returns
        how many pages it names."""
        return self.swap.pin(token_ids(prompt_ids), cache_salt)

    def unpin_prefix(self, prompt_ids: Sequence[int], *,
                     cache_salt: str | bytes | None = None) -> int:
        """Lets :meth:`pin_prefix`'s pages go again (least recently used first)."""
        return self.swap.unpin(token_ids(prompt_ids), cache_salt)

    @metered
    def stats(self) -> EngineStats:
        """Pool, sharing and prefix-cache accounting now, and the compiles paid (see
        :class:`EngineStats`)."""
        return accounting.engine_stats(self.ops, self.table, self.counters, self.prefixes,
                                       self.compile_stats)

    def reset_stats(self) -> None:
        """Zeroes the running totals and peaks (a timed run after a warm-up starts clean)."""
        accounting.reset_totals(self.counters, self.ops, self.prefixes)
        self.compile_stats.reset()
