"""Continuous batching over cache rows: a Python loop around the jitted steps.

Requests wait in a queue and are admitted into free cache rows while pages allow. Each
``step()`` prefills what was admitted (bucketed, chunked) and then decodes one token for every
running row. A finished or cancelled request releases its row at once, so its pages are free
for the next admission in the same call. When the pool runs dry mid-decode, the youngest
running request is preempted: its pages are released and it re-enters the queue front with its
tokens so far, to be recomputed (vLLM's recompute preemption) — no live token is overwritten.

Sharing (paged cache): with ``prefix_cache=True`` full pages are indexed by chained hashes
(:mod:`paxkv.prefix_cache`) and a new prompt attaches its longest cached prefix, prefilling
only the rest; ``submit_prefix`` + ``submit(..., prefix=id)`` prefills a shared prefix once
and forks it into every request that names it (no hashing); ``submit(..., n=k)`` prefills a
prompt once and forks it into k samples; and
:meth:`Engine.fork` branches any live sequence into children that share its pages (a tree of
thought: branch, continue, :meth:`Engine.cancel` the losers). A shared partly filled page is
copied by whichever holder writes first. The loop itself lives in :mod:`paxkv.scheduler`.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from paxkv import dense_cache, paged_cache, sharing, steps
from paxkv.sampling import validate
from paxkv.request import GenerationResult, Request
from paxkv.scheduler import Scheduler
from paxkv.sharing import EngineStats, SequenceStats

__all__ = ["Engine", "EngineStats", "GenerationResult", "SequenceStats"]


class Engine(Scheduler):
    """A paged (or dense) KV cache serving many requests through jitted steps.

    Args:
      lm: a ``models.LanguageModel``.
      cache: "paged" or "dense".
      max_seqs: cache rows (the most requests running at once).
      max_len: the most tokens (prompt + output) one request may hold.
      page_size, num_pages: paged layout; ``num_pages`` defaults to the dense reservation
        ``max_seqs * ceil(max_len / page_size)``.
      kv_dtype: the K/V values' dtype (``jnp.bfloat16``: half the bytes; stored as bits on a
        CPU, :mod:`paxkv.kv_storage`, where the Pallas kernels refuse it).
      attention_impl: "auto" (Pallas on GPU, XLA elsewhere), "pallas" or "xla".
      prefill_chunk: longest prompt chunk per prefill call; prefill_tokens: batch x chunk budget.
      prefix_cache: index full pages by chained hashes and reuse them across requests (paged
        only). Cached pages stay in the pool after their requests finish, until evicted for
        room or dropped by :meth:`clear_prefix_cache`.
    """

    def __init__(self, lm: Any, *, cache: str = "paged", max_seqs: int = 32, max_len: int = 2048,
                 page_size: int = 16, num_pages: int | None = None,
                 kv_dtype: Any = jnp.float32, attention_impl: str = "auto",
                 prefill_chunk: int = 512, prefill_tokens: int = 4096, scrub: bool = True,
                 prefix_cache: bool = False):
        if cache not in ("paged", "dense"):
            raise ValueError(f"cache must be 'paged' or 'dense', got {cache!r}")
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        if attention_impl not in ("auto", "pallas", "xla"):
            raise ValueError(f"attention_impl must be 'auto', 'pallas' or 'xla', got "
                             f"{attention_impl!r}")
        if prefix_cache and cache != "paged":
            raise ValueError("prefix_cache needs cache='paged' (a dense row cannot be shared)")
        if attention_impl == "auto":
            attention_impl = "pallas" if jax.default_backend() == "gpu" else "xla"
        cfg = lm.config
        dims = dict(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                    head_dim=cfg.head_dim, max_seqs=max_seqs, max_len=max_len, dtype=kv_dtype)
        if cache == "paged":
            num_pages = num_pages or max_seqs * -(-max_len // page_size)
            kv = paged_cache.create(num_pages=num_pages, page_size=page_size, scrub=scrub,
                                    **dims)
        else:
            page_size, num_pages = max_len, max_seqs
            kv = dense_cache.create(**dims)
        super().__init__(lm, kv, kind=cache, max_seqs=max_seqs, max_len=max_len,
                         page_size=page_size, num_pages=num_pages,
                         attention_impl=attention_impl, prefill_chunk=prefill_chunk,
                         prefill_tokens=prefill_tokens, prefix_cache=prefix_cache)

    # -- requests -------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], *, max_new_tokens: int, temperature: float = 0.0,
               top_k: int | None = None, top_p: float | None = None, seed: int = 0,
               stop_token_ids: Sequence[int] = (), n: int = 1, hold: bool = False,
               cache_salt: str | bytes | None = None, key: jax.Array | None = None,
               prefix: int | None = None) -> int:
        """Queues a request; returns its id. Raises ValueError naming what to change.

        Args:
          seed: the request samples from ``fold_in(PRNGKey(seed), request_id)``, or from
            ``key`` (a PRNG key) when given.
          n: samples of this prompt: it is prefilled once and forked into ``n`` children
            sharing its pages; child i samples from ``fold_in(request key, i)``. The result
            carries ``samples``.
          hold: after finishing ("stop" / "length") keep the row and its pages, so
            :meth:`fork` can branch it; :meth:`cancel` releases it.
          cache_salt: prefix-cache tenant: requests with different salts never share pages.
          prefix: a :meth:`submit_prefix` id: the prompt is that prefix + ``prompt_ids``, and
            the request starts from the prefix's pages (forked, none recomputed).
        """
        validate(temperature, top_k, top_p)
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        if prefix is not None:
            holder = self._requests.get(prefix)
            if holder is None or not holder.is_prefix:
                raise ValueError(f"prefix={prefix!r} is not an id from submit_prefix()")
            prompt_ids = holder.prompt_ids + prompt_ids
        self._check_length(len(prompt_ids), max_new_tokens)
        vocab = self.lm.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        rid = self._next_id
        self._next_id += 1
        if key is None:
            key = jax.random.fold_in(jax.random.PRNGKey(seed), rid)
        elif jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.key_data(key)
        req = Request(rid, prompt_ids, max_new_tokens, frozenset(int(t) for t in stop_token_ids),
                      float(temperature), int(top_k or 0), 1.0 if top_p is None else top_p,
                      np.asarray(key, np.uint32), salt=cache_salt, n=n, hold=hold,
                      prefix_of=prefix)
        self._requests[rid] = req
        self._waiting.append(req)
        return rid

    def submit_prefix(self, prompt_ids: list[int], *,
                      cache_salt: str | bytes | None = None) -> int:
        """Queues a shared prefix (a system prompt): it is prefilled once and then holds its
        row ("prefilled"); requests submitted with ``prefix=`` this id fork its pages, a
        partly filled last page included (each copies that page on its first write). No
        hashing is involved. :meth:`cancel` releases it once no more requests need it."""
        rid = self.submit(prompt_ids, max_new_tokens=1, cache_salt=cache_salt)
        self._requests[rid].is_prefix = True
        return rid

    def fork(self, request_id: int, k: int, *, max_new_tokens: int,
             temperature: float | None = None, top_k: int | None = None,
             top_p: float | None = None, stop_token_ids: Sequence[int] | None = None,
             hold: bool = False) -> list[int]:
        """Branches a live request into ``k`` children that continue it, sharing its pages:
        nothing is prefilled again (each child feeds only the parent's newest token, and its
        first write copies the shared partial page). Returns the children's ids.

        The request must be decoding (between steps) or finished with ``hold=True``; it ends
        ("forked", or keeps its finish reason if held) and its row goes to the children.
        Child i samples from ``fold_in(parent key, i)``; settings left None are inherited.
        Children that find no free row wait at the queue front and are recomputed.
        """
        parent = self._requests[request_id]
        held = parent.hold and parent.finish_reason in ("stop", "length")
        if parent.row is None or not (parent.decoding or held):
            raise ValueError(f"request {request_id} is not live: fork a running request between "
                             "steps, or one submitted with hold=True that has finished")
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be an int >= 1, got {k!r}")
        self._check_length(len(parent.tokens), max_new_tokens)
        validate(parent.temperature if temperature is None else temperature, top_k, top_p)
        stops = None if stop_token_ids is None else frozenset(int(t) for t in stop_token_ids)
        children = self._spawn(parent, k, max_new_tokens=max_new_tokens, hold=hold,
                               temperature=temperature, top_k=top_k, top_p=top_p,
                               stop_ids=stops)
        self._branch(parent, children)
        return [c.id for c in children]

    def cancel(self, request_id: int) -> None:
        """Stops a request now (and its samples, with ``n > 1``); a running or held one
        releases its row in this call: pages nobody else holds are free at once."""
        req = self._requests[request_id]
        if req.finish_reason is None:
            if req.row is None:
                self._waiting.remove(req)
            req.finish_reason = "cancelled"
        elif req.n > 1:
            for child in req.children:
                self.cancel(child)
        self._release([req])

    def has_work(self) -> bool:
        return bool(self._waiting) or any(r is not None and r.finish_reason is None
                                          for r in self._rows)

    def result(self, request_id: int) -> GenerationResult:
        req = self._requests[request_id]
        if req.n > 1 and req.children:
            samples = [self.result(c) for c in req.children]
            first = samples[0]
            return GenerationResult(first.token_ids, first.text, req.prompt_ids,
                                    first.finish_reason, req.num_cached_tokens,
                                    req.preemptions, samples)
        text = self.lm.decode([t for t in req.output if t not in req.stop_ids])
        return GenerationResult(list(req.output), text, req.prompt_ids,
                                req.finish_reason or "running", req.num_cached_tokens,
                                req.preemptions)

    def run(self) -> dict[int, GenerationResult]:
        """Steps until every request is finished; results by request id (children too)."""
        while self.has_work():
            self.step()
        return {rid: self.result(rid) for rid in self._requests}

    def run_compiled(self) -> dict[int, GenerationResult]:
        """Runs the queued requests as one fixed batch: prefill, then a single compiled
        ``lax.while_loop`` that reserves pages inside jit until every row stops. All requests
        must fit in the cache at once; ``n > 1`` needs :meth:`run`."""
        if any(r.n > 1 for r in self._waiting):
            raise ValueError("n > 1 samples need run() (continuous batching), not the jit loop")
        admitted = []
        while self._waiting and None in self._rows:
            batch = self._admit()
            if not batch:
                break
            self._prefill(batch)
            admitted += batch
        if self._waiting:
            raise ValueError(f"{len(self._waiting)} requests do not fit at once (max_seqs="
                             f"{self.max_seqs}, num_pages={self.num_pages}): raise them or use "
                             "run() (continuous batching)")
        reqs = [r for r in admitted if r.finish_reason is None]
        width = max([r.max_new_tokens for r in reqs], default=1)
        first, limit = np.zeros(self.max_seqs, np.int32), np.zeros(self.max_seqs, np.int32)
        stop_ids = sorted(set().union(*[r.stop_ids for r in reqs])) or [-1]
        stops = np.zeros((self.max_seqs, len(stop_ids)), bool)
        for r in reqs:
            first[r.row], limit[r.row] = r.output[0], r.max_new_tokens
            stops[r.row] = [t in r.stop_ids for t in stop_ids]
        # Shared pages are read once; the work list covers every row's longest context.
        self.cache = self._attention_view(
            reqs, self.max_len,
            decode_lengths=[min(self.max_len, len(r.tokens) + r.max_new_tokens) for r in reqs])
        probe = self._cow_probe()
        self.cache, out, count, dry = steps.decode_loop(
            self.lm.forward, self.lm.params, self.cache, jnp.asarray(first), jnp.asarray(limit),
            jnp.asarray(stop_ids, jnp.int32), jnp.asarray(stops), self._sampling_for(None),
            max_new_tokens=width, attention_impl=self.attention_impl)
        self._count_copies(probe)
        out, count, dry = np.asarray(out), np.asarray(count), np.asarray(dry)
        for r in reqs:
            r.output = [int(t) for t in out[r.row, : count[r.row]]]
            r.cached = len(r.tokens) - 1
            self.num_decode_tokens += len(r.output) - 1
            r.finish_reason = ("stop" if r.output[-1] in r.stop_ids else
                               "out_of_pages" if dry[r.row] else "length")
        self._note_free(int(steps.free_pages(self.cache)))
        self._finish(reqs)
        return {rid: self.result(rid) for rid in self._requests}

    # -- sharing and accounting -----------------------------------------------------------
    def clear_prefix_cache(self) -> int:
        """Drops every cached page's index reference; returns how many pages the index held
        (those no running request holds are free at once)."""
        if self.index is None:
            return 0
        pages = self.index.clear()
        self._retain(pages, -1)
        self._free = int(steps.free_pages(self.cache))
        return len(pages)

    def stats(self) -> EngineStats:
        """Pool, sharing and prefix-cache accounting now (see :class:`EngineStats`)."""
        rows = {r.id: r for r in self._rows if r is not None}
        if self.kind == "paged":
            ts = jax.device_get(sharing.table_stats(self.cache.table))
            sh = jax.device_get(sharing.sharing_stats(self.cache.table))
            used, shared = int(ts.used_pages), int(ts.shared_pages)
            refs, distinct = int(sh.row_references), int(sh.row_pages)
            seqs = {i: SequenceStats(r.cached, int(sh.pages_held[r.row]),
                                     int(sh.shared_held[r.row])) for i, r in rows.items()}
            page_bytes = 2 * self.cache.pool.k.nbytes // (self.num_pages + 1)
        else:
            shared, used = 0, len(rows)
            refs = distinct = used
            seqs = {i: SequenceStats(r.cached, 1, 0) for i, r in rows.items()}
            page_bytes = 2 * self.cache.k.nbytes // self.max_seqs
        index = self.index
        counts = (dict(cached_pages=len(index), prefix_lookup_tokens=index.lookup_tokens,
                       prefix_hit_tokens=index.hit_tokens, prefix_hit_rate=index.hit_rate,
                       evictions=index.evicted) if index is not None else
                  dict(cached_pages=0, prefix_lookup_tokens=0, prefix_hit_tokens=0,
                       prefix_hit_rate=0.0, evictions=0))
        return EngineStats(
            num_pages=self.num_pages, free_pages=self.num_pages - used, used_pages=used,
            shared_pages=shared, row_references=refs, row_pages=distinct,
            cow_copies=self.num_cow_copies, prefill_tokens=self.num_prefill_tokens,
            decode_tokens=self.num_decode_tokens, peak_pages_used=self.peak_pages_used,
            preemptions=self.num_preemptions, **counts,
            kv_bytes_per_page=page_bytes, sequences=seqs)

    def _check_length(self, prompt_len: int, max_new_tokens: int) -> None:
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        total = prompt_len + max_new_tokens
        if total > self.max_len:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_new_tokens "
                             f"({max_new_tokens}) = {total} exceeds max_len={self.max_len}: "
                             "raise max_len or shorten the request")
        if self.kind == "paged" and -(-total // self.page_size) > self.num_pages:
            raise ValueError(f"a request of {total} tokens needs {-(-total // self.page_size)} "
                             f"pages but the pool has num_pages={self.num_pages}: raise it")
