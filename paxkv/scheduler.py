"""The engine's inner loop: admission (with prefix-cache hits), prefill, decode, release.

:class:`Scheduler` owns the rows, the queue and the cache; :class:`paxkv.engine.Engine` adds the
public API on top. One ``step``::

    (admit -> prefill)+ -> evict for decode -> decode one token per running row -> release

Admission runs in rounds within a step: a request whose next uncached page is being prefilled
by a request admitted earlier in the same round waits for the next round, when that page is
cached, so fifty users of one system prompt prefill it once. A request's row holds
``tokens[:cached]``; it decodes when only its newest token is missing (``cached ==
len(tokens) - 1``). When the pool runs dry mid-decode, the youngest running request is
preempted and recomputed later (its written pages go to the prefix index first, if any).
"""

from __future__ import annotations

import collections
from typing import Any

import jax.numpy as jnp
import numpy as np

from paxkv.attention import chunked
from paxkv import steps
from paxkv.paged_cache import prefix_bucket
from paxkv.prefix_cache import Hit, PrefixIndex
from paxkv.request import Request
from paxkv.sampling import SamplingParams
from paxkv.sharing import Sharing


def _bucket(n: int, lo: int, hi: int) -> int:
    """The power of two >= n, clamped to [lo, hi]: a handful of compiled shapes."""
    return int(min(hi, max(lo, 1 << max(0, int(n) - 1).bit_length())))


def _fine_bucket(n: int, lo: int, hi: int) -> int:
    """The first of ..., 16, 24, 32, 48, 64, 96, 128, 192, ... (powers of two and 1.5 x powers
    of two) >= n, clamped to [lo, hi]: attention windows (tokens every row reads, for a batch
    whose longest row holds ``n``) and prefill widths (tokens every row is padded to). Power-of-
    two sizes waste up to half of that work; these cap the waste at a third for two compiled
    shapes per doubling."""
    p = 1 << max(0, int(n) - 1).bit_length()
    if 4 * n <= 3 * p:
        p = 3 * p // 4
    return int(min(hi, max(lo, p)))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler(Sharing):
    """Rows, queue, cache and counters; see :class:`paxkv.engine.Engine` for the arguments."""

    def __init__(self, lm: Any, cache: Any, *, kind: str, max_seqs: int, max_len: int,
                 page_size: int, num_pages: int, attention_impl: str, prefill_chunk: int,
                 prefill_tokens: int, prefix_cache: bool):
        self.lm, self.cache, self.kind = lm, cache, kind
        self.max_seqs, self.max_len, self.page_size, self.num_pages = (
            max_seqs, max_len, page_size, num_pages)
        self.attention_impl = attention_impl
        self.prefill_chunk, self.prefill_tokens = prefill_chunk, prefill_tokens
        self.index = PrefixIndex(page_size) if prefix_cache else None
        self._free = num_pages
        self._rows: list[Request | None] = [None] * max_seqs
        self._waiting: collections.deque[Request] = collections.deque()
        self._requests: dict[int, Request] = {}
        self._next_id = self._clock = 0
        self._last_token = np.zeros(max_seqs, np.int32)
        self._sampling = dict(temperature=np.zeros(max_seqs, np.float32),
                              top_k=np.zeros(max_seqs, np.int32),
                              top_p=np.ones(max_seqs, np.float32),
                              seed=np.zeros((max_seqs, 2), np.uint32))
        self._shares = prefix_cache  # rows may share pages: probe for copy-on-write copies
        self.peak_running = self.peak_pages_used = self.num_preemptions = 0
        self.num_prefill_tokens = self.num_decode_tokens = self.num_cow_copies = 0

    # -- one iteration ---------------------------------------------------------------------
    def step(self) -> None:
        """Admits what fits (in rounds), prefills it, decodes one token for every running
        row, and releases what finished."""
        self._clock += 1
        while self._waiting and None in self._rows:
            admitted = self._admit()
            if not admitted:
                break
            self._prefill(admitted)
        live = np.array([r is not None and r.decoding for r in self._rows])
        self.peak_running = max(self.peak_running, int(live.sum()))
        if live.any():
            self._decode(live)
        elif self._waiting:
            raise RuntimeError("requests are waiting but none can run: finished hold=True "
                               "requests hold the rows or pages; fork or cancel them")

    def _admit(self) -> list[Request]:
        """One admission round (see the module docstring)."""
        admitted: list[Request] = []
        pending: set[bytes] = set()
        running = any(r is not None and r.finish_reason is None for r in self._rows)
        while self._waiting and None in self._rows:
            req = self._waiting[0]
            holder = self._holder(req)
            if holder is req:
                break  # its shared prefix is still being prefilled
            hit, digests = (Hit(), []) if holder else self._lookup(req)
            if hit.num_full < len(digests) and digests[hit.num_full] in pending:
                break  # an earlier admission of this round is prefilling that page
            ps, m = self.page_size, holder.cached if holder else hit.num_tokens
            need = _cdiv(len(req.tokens) + 1, ps) - _cdiv(m, ps) + int(m % ps != 0)
            if need > self._free:
                self._evict(need - self._free, protect=hit.pages)
            if need > self._free and (running or admitted):
                break
            self._waiting.popleft()
            self._place(req, self._rows.index(None))
            if holder:
                self._fork_prefix(holder, req)
            elif hit.num_tokens:
                self._attach(req, hit)
            if self.index is not None and req.preemptions == 0:
                self.index.record(len(req.prompt_ids), hit.num_tokens)
            if req.preemptions == 0:
                req.num_cached_tokens = m
            self._free -= need
            pending.update(digests)
            admitted.append(req)
        return admitted

    def _prefill(self, group: list[Request]) -> None:
        self._prefilled([r for r in group if r.cached >= r.target])  # fully cached
        # Longest first, so each batch pads its prompts to similar lengths (arrival order
        # padded 64-512 token prompts to a common bucket and wasted ~40% of prefill).
        group = sorted((r for r in group if r.cached < r.target),
                       key=lambda r: r.target - r.cached, reverse=True)
        while group:
            longest = max(r.target - r.cached for r in group)
            t = _fine_bucket(longest, 16, self.prefill_chunk)
            # A power of two: the batch is padded to one (10 rows would run as 16).
            b_max = 1 << (max(1, self.prefill_tokens // t).bit_length() - 1)
            batch, group = group[:b_max], group[b_max:]
            while batch:  # the last chunk of a long prompt runs at a smaller width
                batch = self._prefill_chunk(batch, t)
                t = _fine_bucket(max([r.target - r.cached for r in batch], default=1), 16, t)

    def _prefill_chunk(self, batch: list[Request], t: int) -> list[Request]:
        """Feeds the next ``t`` tokens of each request; returns those with more to feed."""
        b = _bucket(len(batch), 1, self.max_seqs)
        tokens = np.zeros((b, t), np.int32)
        rows = np.full(b, batch[0].row, np.int32)
        qlen = np.zeros(b, np.int32)
        for i, r in enumerate(batch):
            chunk = r.tokens[r.cached: min(r.cached + t, r.target)]
            tokens[i, : len(chunk)], rows[i], qlen[i] = chunk, r.row, len(chunk)
        self.cache = self._attention_view(batch, max(r.cached + int(q)
                                                     for r, q in zip(batch, qlen)))
        probe = self._cow_probe()
        self.cache, nxt, ok, free = steps.prefill_step(
            self.lm.forward, self.lm.params, self.cache, jnp.asarray(tokens), jnp.asarray(rows),
            jnp.asarray(qlen), self._sampling_for(rows), attention_impl=self.attention_impl)
        nxt, ok = np.asarray(nxt), np.asarray(ok)
        self._note_free(int(free))
        self._count_copies(probe)
        more, done = [], []
        for i, r in enumerate(batch):
            if not ok[i]:  # the pool could not hold it after all: back to the queue
                if not any(o is not None and o.finish_reason is None and o not in batch
                           for o in self._rows):
                    raise RuntimeError(f"request {r.id} does not fit even alone: finished "
                                       "hold=True requests hold the pages; fork or cancel them")
                self._preempt(r)
                continue
            self.num_prefill_tokens += int(qlen[i])
            r.cached += int(qlen[i])
            (more if r.cached < r.target else done).append(r)
        self._prefilled(done, [int(nxt[i]) for i, r in enumerate(batch) if r in done])
        return more

    def _prefilled(self, done: list[Request], tokens: list[int] | None = None) -> None:
        """Prompts fully in the cache: index their pages, then sample or fork."""
        self._cache_pages(done)
        for r, token in zip(done, tokens or [None] * len(done)):
            if r.is_prefix:
                r.finish_reason = "prefilled"  # keeps its row for the requests that fork it
            elif r.n > 1:
                self._branch(r, self._spawn(r, r.n))
            else:
                self._append(r, token)
        self._finish(done)

    def _decode(self, live: np.ndarray) -> None:
        if self.index is not None and int(live.sum()) > self._free:
            self._evict(int(live.sum()) - self._free)  # each row may need a page or a copy
        live_rows = np.flatnonzero(live)
        stepping = [self._rows[i] for i in live_rows]
        self.cache = self._attention_view(
            stepping, max(len(r.tokens) for r in self._rows if r is not None),
            decode_lengths=[len(r.tokens) for r in stepping])
        probe = self._cow_probe()
        width = _bucket(live_rows.size, 8, self.max_seqs)
        if width < self.max_seqs:
            # Few rows live: run only them (a batch of ``width`` rows gathered by ``rows``)
            # rather than every row of the cache; one token each is a one-token prefill.
            rows = np.full(width, live_rows[0], np.int32)
            rows[: live_rows.size] = live_rows
            qlen = (np.arange(width) < live_rows.size).astype(np.int32)
            self.cache, nxt_b, ok_b, free = steps.prefill_step(
                self.lm.forward, self.lm.params, self.cache,
                jnp.asarray(self._last_token[rows][:, None]), jnp.asarray(rows),
                jnp.asarray(qlen), self._sampling_for(rows), attention_impl=self.attention_impl)
            nxt, ok = np.zeros(self.max_seqs, np.int32), np.zeros(self.max_seqs, bool)
            nxt[live_rows] = np.asarray(nxt_b)[: live_rows.size]
            ok[live_rows] = np.asarray(ok_b)[: live_rows.size]
        else:
            self.cache, nxt, ok, free = steps.decode_step(
                self.lm.forward, self.lm.params, self.cache, jnp.asarray(self._last_token),
                jnp.asarray(live), self._sampling_for(None),
                attention_impl=self.attention_impl)
            nxt, ok = np.asarray(nxt), np.asarray(ok)
        self._note_free(int(free))
        self._count_copies(probe)
        self.num_decode_tokens += int(ok.sum())
        for row in np.flatnonzero(ok):
            self._rows[row].cached += 1
            self._append(self._rows[row], int(nxt[row]))
        self._finish([r for r in self._rows if r is not None and r.finish_reason is not None])
        if (live & ~ok).any():  # out of pages: free the youngest running request's pages
            running = [r for r in self._rows if r is not None and r.finish_reason is None]
            self._preempt(max(running, key=lambda r: (r.admitted_at, r.row)))

    def _attention_view(self, stepping: list[Request], longest: int,
                        decode_lengths: list[int] | None = None) -> Any:
        """The cache as this step's attention reads it. Without shared pages: a window of
        ``longest`` tokens rounded up by :func:`_fine_bucket`. With ``n`` pages all
        ``stepping`` rows (this step's batch) may share: the hint ``n`` (read once for the
        batch) and a window of those pages plus the rest rounded up on its own, so the per-row
        part is as short as the rows' own tokens allow. For a decode step, ``decode_lengths``
        (each stepping row's context after the step, or an upper bound) sizes the decode
        attention's work list: the chunks of the rows' own tokens, not rows x window."""
        shared = self._shared_prefix_pages(stepping) * self.page_size
        if shared:
            window = min(self.max_len, shared + _fine_bucket(longest - shared, 64, self.max_len))
        else:
            window = _fine_bucket(longest, 64, self.max_len)
        cache = self.cache.with_window(window)
        if self.kind != "paged":
            return cache
        chunks = None
        if decode_lengths is not None:
            chunks = int(np.sum(chunked.chunks_needed(
                np.asarray(decode_lengths), start_page=shared // self.page_size,
                page_size=self.page_size, chunk_pages=cache.chunk_pages)))
        return cache.with_shared_prefix(shared // self.page_size).with_decode_chunks(chunks)

    def _shared_prefix_pages(self, stepping: list[Request]) -> int:
        """Full pages before every query of ``stepping`` that hold the same tokens in every
        row (their cached tokens' common prefix, rounded down by
        :func:`paged_cache.prefix_bucket`); 0 unless rows can share pages at all. Equal tokens
        are a hint, not a proof: the step checks that the pages are the same."""
        if self.kind != "paged" or not self._shares or len(stepping) < 2:
            return 0
        n = min(r.cached for r in stepping)  # the shared pages lie before every query
        first = np.asarray(stepping[0].tokens[:n])
        for r in stepping[1:]:
            differ = np.flatnonzero(np.asarray(r.tokens[:n]) != first[:n])
            n = int(differ[0]) if differ.size else n
        return prefix_bucket(n // self.page_size)

    # -- bookkeeping -----------------------------------------------------------------------
    def _place(self, req: Request, row: int) -> None:
        self._rows[row], req.row, req.cached, req.admitted_at = req, row, 0, self._clock
        for name, value in (("temperature", req.temperature), ("top_k", req.top_k),
                            ("top_p", req.top_p), ("seed", req.key_data)):
            self._sampling[name][row] = value

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

    def _append(self, req: Request, token: int) -> None:
        req.output.append(token)
        self._last_token[req.row] = token
        if token in req.stop_ids:
            req.finish_reason = "stop"
        elif len(req.output) >= req.max_new_tokens:
            req.finish_reason = "length"

    def _finish(self, reqs: list[Request]) -> None:
        """Releases finished requests' rows, except those held for forking."""
        self._release([r for r in reqs if r.finish_reason is not None and not r.keeps_row])

    def _release(self, reqs: list[Request]) -> None:
        reqs = [r for r in reqs if r.row is not None]
        if not reqs:
            return
        self._cache_pages(reqs)
        rows = np.zeros(self.max_seqs, bool)
        for r in reqs:
            rows[r.row] = True
            self._sampling["temperature"][r.row] = 0.0  # an idle row is greedy
            self._rows[r.row], r.row = None, None
        self.cache, _ = steps.release_rows(self.cache, jnp.asarray(rows))
        self._free = int(steps.free_pages(self.cache))

    def _preempt(self, req: Request) -> None:
        self._release([req])
        req.cached, req.preemptions = 0, req.preemptions + 1
        self.num_preemptions += 1
        self._waiting.appendleft(req)
