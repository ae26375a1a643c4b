"""Continuous batching over cache rows: a Python loop around the jitted steps.

Requests wait in a queue and are admitted into free cache rows while pages allow. Each
``step()`` prefills what was admitted (bucketed, chunked) and then decodes one token for every
running row. A finished or cancelled request releases its row at once, so its pages are free
for the next admission in the same call. When the pool runs dry mid-decode, the youngest
running request is preempted: its pages are released and it re-enters the queue front with its
tokens so far, to be recomputed (vLLM's recompute preemption) — no live token is overwritten.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paxkv import dense_cache, paged_cache, steps
from paxkv.sampling import SamplingParams, validate


@dataclasses.dataclass
class GenerationResult:
    """One request's outcome: ``token_ids`` are the generated tokens (a stop token included),
    ``text`` their decoding without stop tokens; ``finish_reason`` is "stop", "length" or
    "cancelled"."""

    token_ids: list[int]
    text: str
    prompt_ids: list[int]
    finish_reason: str
    num_cached_tokens: int = 0
    num_preemptions: int = 0


@dataclasses.dataclass
class _Request:
    id: int
    prompt_ids: list[int]
    max_new_tokens: int
    stop_ids: frozenset[int]
    temperature: float
    top_k: int
    top_p: float
    key_data: np.ndarray
    output: list[int] = dataclasses.field(default_factory=list)
    row: int | None = None
    prefilled: int = 0  # tokens of `context` already in the cache
    context: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    preemptions: int = 0
    admitted_at: int = 0


def _bucket(n: int, lo: int, hi: int) -> int:
    """The power of two >= n, clamped to [lo, hi]: a handful of compiled shapes."""
    return int(min(hi, max(lo, 1 << max(0, int(n) - 1).bit_length())))


class Engine:
    """A paged (or dense) KV cache serving many requests through jitted steps.

    Args:
      lm: a ``models.LanguageModel``.
      cache: "paged" or "dense".
      max_seqs: cache rows (the most requests running at once).
      max_len: the most tokens (prompt + output) one request may hold.
      page_size, num_pages: paged layout; ``num_pages`` defaults to the dense reservation
        ``max_seqs * ceil(max_len / page_size)``.
      attention_impl: "auto" (Pallas on GPU, XLA elsewhere), "pallas" or "xla".
      prefill_chunk: longest prompt chunk per prefill call; prefill_tokens: batch x chunk budget.
    """

    def __init__(self, lm: Any, *, cache: str = "paged", max_seqs: int = 32, max_len: int = 2048,
                 page_size: int = 16, num_pages: int | None = None,
                 kv_dtype: Any = jnp.float32, attention_impl: str = "auto",
                 prefill_chunk: int = 512, prefill_tokens: int = 4096, scrub: bool = True):
        if cache not in ("paged", "dense"):
            raise ValueError(f"cache must be 'paged' or 'dense', got {cache!r}")
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        if attention_impl not in ("auto", "pallas", "xla"):
            raise ValueError(f"attention_impl must be 'auto', 'pallas' or 'xla', got "
                             f"{attention_impl!r}")
        if attention_impl == "auto":
            attention_impl = "pallas" if jax.default_backend() == "gpu" else "xla"
        cfg = lm.config
        self.lm, self.kind, self.max_seqs, self.max_len = lm, cache, max_seqs, max_len
        self.page_size = page_size if cache == "paged" else max_len
        self.attention_impl = attention_impl
        self.prefill_chunk, self.prefill_tokens = prefill_chunk, prefill_tokens
        dims = dict(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                    head_dim=cfg.head_dim, max_seqs=max_seqs, max_len=max_len, dtype=kv_dtype)
        if cache == "paged":
            self.num_pages = num_pages or max_seqs * -(-max_len // page_size)
            self.cache = paged_cache.create(num_pages=self.num_pages, page_size=page_size,
                                            scrub=scrub, **dims)
        else:
            self.num_pages = max_seqs
            self.cache = dense_cache.create(**dims)
        self._free = self.num_pages
        self._rows: list[_Request | None] = [None] * max_seqs
        self._waiting: collections.deque[_Request] = collections.deque()
        self._requests: dict[int, _Request] = {}
        self._next_id = 0
        self._clock = 0
        self._last_token = np.zeros(max_seqs, np.int32)
        self._sampling = dict(temperature=np.zeros(max_seqs, np.float32),
                              top_k=np.zeros(max_seqs, np.int32),
                              top_p=np.ones(max_seqs, np.float32),
                              seed=np.zeros((max_seqs, 2), np.uint32))
        self.peak_running = 0
        self.peak_pages_used = 0
        self.num_preemptions = 0

    # -- requests -------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], *, max_new_tokens: int, temperature: float = 0.0,
               top_k: int | None = None, top_p: float | None = None, seed: int = 0,
               stop_token_ids: list[int] | tuple[int, ...] = ()) -> int:
        """Queues a request; returns its id. Raises ValueError naming what to change."""
        validate(temperature, top_k, top_p)
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        total = len(prompt_ids) + max_new_tokens
        if total > self.max_len:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens "
                             f"({max_new_tokens}) = {total} exceeds max_len={self.max_len}: "
                             "raise max_len or shorten the request")
        if self.kind == "paged" and -(-total // self.page_size) > self.num_pages:
            raise ValueError(f"a request of {total} tokens needs {-(-total // self.page_size)} "
                             f"pages but the pool has num_pages={self.num_pages}: raise it")
        vocab = self.lm.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        rid = self._next_id
        self._next_id += 1
        key = jax.random.key_data(jax.random.fold_in(jax.random.PRNGKey(seed), rid))
        req = _Request(rid, prompt_ids, max_new_tokens, frozenset(int(t) for t in stop_token_ids),
                       float(temperature), int(top_k or 0), 1.0 if top_p is None else top_p,
                       np.asarray(key, np.uint32))
        self._requests[rid] = req
        self._waiting.append(req)
        return rid

    def cancel(self, request_id: int) -> None:
        """Stops a request now; a running one releases its pages in this call."""
        req = self._requests[request_id]
        if req.finish_reason is not None:
            return
        if req.row is None:
            self._waiting.remove(req)
        req.finish_reason = "cancelled"
        self._release([req])

    def has_work(self) -> bool:
        return bool(self._waiting) or any(r is not None for r in self._rows)

    def result(self, request_id: int) -> GenerationResult:
        req = self._requests[request_id]
        stops = req.stop_ids
        text = self.lm.decode([t for t in req.output if t not in stops])
        return GenerationResult(list(req.output), text, req.prompt_ids,
                                req.finish_reason or "running", 0, req.preemptions)

    def run(self) -> dict[int, GenerationResult]:
        """Steps until every request is finished; results by request id."""
        while self.has_work():
            self.step()
        return {rid: self.result(rid) for rid in self._requests}

    def run_compiled(self) -> dict[int, GenerationResult]:
        """Runs the queued requests as one fixed batch: prefill, then a single compiled
        ``lax.while_loop`` that reserves pages inside jit until every row stops. All requests
        must fit in the cache at once."""
        admitted = self._admit()
        if self._waiting:
            raise ValueError(f"{len(self._waiting)} requests do not fit at once (max_seqs="
                             f"{self.max_seqs}, num_pages={self.num_pages}): raise them or use "
                             "run() (continuous batching)")
        self._prefill(admitted)
        reqs = [r for r in admitted if r.finish_reason is None]
        width = max([r.max_new_tokens for r in reqs], default=1)
        first = np.zeros(self.max_seqs, np.int32)
        limit = np.zeros(self.max_seqs, np.int32)
        live = np.zeros(self.max_seqs, bool)
        stop_ids = sorted(set().union(*[r.stop_ids for r in reqs])) or [-1]
        stop_rows = np.array([[t in r.stop_ids for t in stop_ids] for r in reqs]).reshape(
            len(reqs), len(stop_ids))
        stops = np.zeros((self.max_seqs, len(stop_ids)), bool)
        for i, r in enumerate(reqs):
            first[r.row], limit[r.row], live[r.row] = r.output[0], r.max_new_tokens, True
            stops[r.row] = stop_rows[i]
        self.cache = self.cache.with_window(self.max_len)
        self.cache, out, count, dry = steps.decode_loop(
            self.lm.forward, self.lm.params, self.cache, jnp.asarray(first), jnp.asarray(limit),
            jnp.asarray(stop_ids, jnp.int32), jnp.asarray(stops), self._sampling_for(None),
            max_new_tokens=width, attention_impl=self.attention_impl)
        out, count, dry = np.asarray(out), np.asarray(count), np.asarray(dry)
        for r in reqs:
            r.output = [int(t) for t in out[r.row, : count[r.row]]]
            r.finish_reason = ("stop" if r.output[-1] in r.stop_ids else
                               "out_of_pages" if dry[r.row] else "length")
        self._release(reqs)
        return {rid: self.result(rid) for rid in self._requests}

    # -- one scheduler iteration -----------------------------------------------------------
    def step(self) -> None:
        """Admits what fits, prefills it, decodes one token for every running row, and
        releases what finished."""
        self._clock += 1
        admitted = self._admit()
        if admitted:
            self._prefill(admitted)
        live = np.array([r is not None and r.prefilled == len(r.context) for r in self._rows])
        self.peak_running = max(self.peak_running, int(live.sum()))
        if live.any():
            self._decode(live)

    def _admit(self) -> list[_Request]:
        admitted = []
        running = sum(r is not None for r in self._rows)
        while self._waiting and None in self._rows:
            req = self._waiting[0]
            req.context = req.prompt_ids + req.output
            need = -(-(len(req.context) + 1) // self.page_size)
            if need > self._free and (running or admitted):
                break
            self._waiting.popleft()
            row = self._rows.index(None)
            self._rows[row], req.row, req.prefilled, req.admitted_at = req, row, 0, self._clock
            for name, value in (("temperature", req.temperature), ("top_k", req.top_k),
                                ("top_p", req.top_p), ("seed", req.key_data)):
                self._sampling[name][row] = value
            self._free -= need
            admitted.append(req)
        return admitted

    def _prefill(self, group: list[_Request]) -> None:
        while group:
            longest = max(len(r.context) - r.prefilled for r in group)
            t = _bucket(longest, 16, self.prefill_chunk)
            b_max = max(1, self.prefill_tokens // t)
            batch, group = group[:b_max], group[b_max:]
            while batch:
                batch = self._prefill_chunk(batch, t)

    def _prefill_chunk(self, batch: list[_Request], t: int) -> list[_Request]:
        """Feeds the next ``t`` tokens of each request; returns those with more to feed."""
        b = _bucket(len(batch), 1, self.max_seqs)
        tokens = np.zeros((b, t), np.int32)
        rows = np.full(b, batch[0].row, np.int32)
        qlen = np.zeros(b, np.int32)
        for i, r in enumerate(batch):
            chunk = r.context[r.prefilled: r.prefilled + t]
            tokens[i, : len(chunk)], rows[i], qlen[i] = chunk, r.row, len(chunk)
        window = _bucket(max(r.prefilled + int(q) for r, q in zip(batch, qlen)), 64, self.max_len)
        self.cache = self.cache.with_window(window)
        self.cache, nxt, ok, free = steps.prefill_step(
            self.lm.forward, self.lm.params, self.cache, jnp.asarray(tokens), jnp.asarray(rows),
            jnp.asarray(qlen), self._sampling_for(rows), attention_impl=self.attention_impl)
        nxt, ok = np.asarray(nxt), np.asarray(ok)
        self._note_free(int(free))
        more, done = [], []
        for i, r in enumerate(batch):
            if not ok[i]:  # the pool could not hold it after all: back to the queue
                self._preempt(r)
                continue
            r.prefilled += int(qlen[i])
            if r.prefilled < len(r.context):
                more.append(r)
            else:
                done.append(r)
                self._append(r, int(nxt[i]))
        self._release([r for r in done if r.finish_reason is not None])
        return more

    def _decode(self, live: np.ndarray) -> None:
        # A running row holds its prompt and all but its newest token, which it feeds now.
        window = _bucket(max(len(r.prompt_ids) + len(r.output) for r in self._rows
                             if r is not None), 64, self.max_len)
        self.cache = self.cache.with_window(window)
        self.cache, nxt, ok, free = steps.decode_step(
            self.lm.forward, self.lm.params, self.cache, jnp.asarray(self._last_token),
            jnp.asarray(live), self._sampling_for(None), attention_impl=self.attention_impl)
        nxt, ok = np.asarray(nxt), np.asarray(ok)
        self._note_free(int(free))
        for row in np.flatnonzero(ok):
            self._append(self._rows[row], int(nxt[row]))
        finished = [r for r in self._rows if r is not None and r.finish_reason is not None]
        self._release(finished)
        if (live & ~ok).any():  # out of pages: free the youngest running request's pages
            running = [r for r in self._rows if r is not None]
            self._preempt(max(running, key=lambda r: (r.admitted_at, r.row)))

    # -- bookkeeping -----------------------------------------------------------------------
    def _sampling_for(self, rows: np.ndarray | None) -> SamplingParams | None:
        """Sampling settings of ``rows`` (None = all); None when every row is greedy, so
        greedy work compiles without the sampling sort."""
        if not (self._sampling["temperature"] > 0).any():
            return None
        pick = (lambda a: a) if rows is None else (lambda a: a[rows])
        return SamplingParams(**{k: jnp.asarray(pick(v)) for k, v in self._sampling.items()})

    def _note_free(self, free: int) -> None:
        self._free = free
        self.peak_pages_used = max(self.peak_pages_used, self.num_pages - free)

    def _append(self, req: _Request, token: int) -> None:
        req.output.append(token)
        self._last_token[req.row] = token
        if token in req.stop_ids:
            req.finish_reason = "stop"
        elif len(req.output) >= req.max_new_tokens:
            req.finish_reason = "length"

    def _release(self, reqs: list[_Request]) -> None:
        rows = np.zeros(self.max_seqs, bool)
        for r in reqs:
            if r.row is not None:
                rows[r.row] = True
                self._sampling["temperature"][r.row] = 0.0  # an idle row is greedy
                self._rows[r.row], r.row = None, None
        if rows.any():
            self.cache, _ = steps.release_rows(self.cache, jnp.asarray(rows))
            self._free = int(steps.free_pages(self.cache))

    def _preempt(self, req: _Request) -> None:
        self._release([req])
        req.prefilled, req.preemptions = 0, req.preemptions + 1
        self.num_preemptions += 1
        self._waiting.appendleft(req)
