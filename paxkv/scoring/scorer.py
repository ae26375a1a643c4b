"""The scorer: one cache, its prefix index and the scoring steps, driven batch by batch.

One batch (as many contexts as the rows and pages allow)::

    admit      each context takes a row; a prefix-cache hit attaches its cached pages
    prefill    the rest of each context, in chunks; the last chunk scores every distinct first
               continuation token from the last position's logits (score_last_step)
    index      the contexts' full pages go into the prefix index (later contexts reuse them)
    fork       a context with k multi-token continuations: its row is child 0, k - 1 forks
               share its pages (the partial last page is copied by each writer but one)
    score      every child row feeds its continuation but the last token, teacher-forced,
               rows of like lengths per step (score_step); chunks when longer than a step
    release    every row; after the last batch the index lets go too: the pool is all free

Everything the device does is a jitted function with the cache donated; the host keeps token
lists, rows and counts.
"""

from __future__ import annotations

import collections
from typing import Any, Iterable, Sequence

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from paxkv.core.compiles import CompileStats, metered, use_persistent_cache
from paxkv.core.protocol import check_model
from paxkv.engine import policy
from paxkv.scale import routing as shard_routing
from paxkv.engine.cache_ops import CacheOps
from paxkv.engine.setup import build_cache, place_model
from paxkv.prefix.index import Hit
from paxkv.scoring.batches import (ChildRow, ContextRow, candidates_width, check_pairs,
                                   child_groups, context_step, continuation_step, pages_needed,
                                   step_width)
from paxkv.scoring.requests import Pair, group
from paxkv.scoring.results import ScoreResult, ScoreStats
from paxkv.scoring.programs import Programs
from paxkv.scoring.shapes import StepShape
from paxkv.scoring.shared import SharedContexts


class Scorer:
    """Scores ``(context, continuation)`` token pairs through one cache, reused across calls.

    Args:
      lm: a :class:`paxkv.core.protocol.Model`.
      cache: "paged" or "dense" (the comparison twin: a fork copies the row).
      share: prefill each distinct context once and fork it; with a paged cache the prefix
        cache also shares full pages across contexts. False: every pair alone (the baseline).
      max_seqs: cache rows (contexts + continuations in flight at once).
      max_len: the most tokens one row holds (context + continuation - 1).
      page_size, num_pages, kv_dtype, attention_impl: the cache's layout (``num_pages``
        defaults to ``max_seqs`` full rows).
      prefill_chunk: widest context chunk per step; prefill_tokens, score_tokens: batch x
        width budgets of a context step and of a continuation step (whose ``[b, t, vocab]``
        logits stay inside the step).
      mesh: a ``("data", "model")`` mesh for the paged cache (:func:`paxkv.engine.setup.
        build_cache`): each context and its continuations share pages in one data shard
        (:func:`paxkv.engine.routing.pick_shard`); no prefix index across contexts there.
      compile_cache: JAX's persistent compilation cache (:class:`paxkv.Engine`'s argument).
      remember_shapes: keep the programs run beside that cache: a later scorer of this layout,
        in any process, plans with them (:class:`~paxkv.scoring.programs.Programs`).
    """

    def __init__(self, lm: Any, *, cache: str = "paged", share: bool = True,
                 max_seqs: int = 32, max_len: int = 2048, page_size: int = 16,
                 num_pages: int | None = None, kv_dtype: Any = jnp.float32,
                 attention_impl: str = "auto", prefill_chunk: int = 512,
                 prefill_tokens: int = 4096, score_tokens: int = 2048,
                 mesh: Mesh | None = None, compile_cache: str | bool | None = None,
                 remember_shapes: bool = True):
        check_model(lm)
        self.compile_cache = use_persistent_cache(compile_cache)  # before the first compile
        if not isinstance(max_seqs, int) or max_seqs < 1:
            raise ValueError(f"max_seqs must be an int >= 1, got {max_seqs!r}")
        if cache not in ("paged", "dense"):
            raise ValueError(f"cache must be 'paged' or 'dense', got {cache!r}")
        kv = build_cache(lm, cache, max_seqs=max_seqs, max_len=max_len, page_size=page_size,
                         num_pages=num_pages, kv_dtype=kv_dtype, attention_impl=attention_impl,
                         scrub=True, mesh=mesh)
        self.lm, self.share = place_model(lm, mesh), share
        self.ops = CacheOps(kv, max_len)
        # the prefix index reads one page table: on a sharded cache contexts fork, unindexed
        indexable = kv.shares_pages and self.ops.num_shards == 1
        self.shared = SharedContexts(self.ops) if share and indexable else None
        self.prefill_chunk, self.prefill_tokens = prefill_chunk, prefill_tokens
        self.score_tokens = score_tokens
        # its step shapes, kept across calls (and processes, beside the compilation cache)
        self.programs = Programs(self.lm, self.ops,
                                 self.compile_cache if remember_shapes else None)
        self.stats = ScoreStats()

    @property
    def cache(self) -> Any:
        """The cache as of the last operation (replaced by every step: do not keep it)."""
        return self.ops.cache

    @property
    def compile_stats(self) -> CompileStats:
        """The compiles the calls paid since the last :meth:`reset_stats`."""
        return self.stats.compiles

    def reset_stats(self) -> None:
        self.stats = ScoreStats()

    def warm_up(self, shapes: Iterable[StepShape] | str, threads: int = 2) -> CompileStats:
        """Compiles step programs before the first request, ``threads`` at a time, and has the
        planners prefer them (:mod:`paxkv.scoring.shapes`).

        Args:
          shapes: :class:`~paxkv.scoring.shapes.StepShape` s, or their JSON: what a scorer
            of the same model and layout ran (``other.programs.shapes.shapes()``; with the
            persistent compilation cache populated, each is a load, not a compile).
          threads: compiles at once (on 2 CPU cores no faster than 1: XLA uses both).

        Returns:
          what the compiles cost (also added to ``stats.compiles``).
        """
        paid = self.programs.warm_up(shapes, threads)
        self.stats.compiles.add(paid)
        return paid

    # -- the whole call -------------------------------------------------------------------
    @metered
    def score(self, pairs: Sequence[Pair]) -> list[ScoreResult]:
        """Scores token pairs (:func:`paxkv.scoring.requests.token_pairs`), in order."""
        cache = self.ops.cache
        check_pairs(pairs, self.ops.max_len, cache.page_size,
                    cache.num_pages if cache.shares_pages else None)
        lps: list[list[float]] = [[0.0] * len(c) for _, c in pairs]
        greedy: list[list[bool]] = [[True] * len(c) for _, c in pairs]
        queue = collections.deque(group(pairs, share=self.share,
                                        max_children=self.ops.rows_per_shard))
        self.stats.requests += len(pairs)
        try:
            while queue:
                live = self._admit(queue, pairs)
                self._prefill(live, pairs, lps, greedy)
                children = self._fork(live, pairs)
                self._score_children(children, lps, greedy)
                if children:
                    self.ops.release([c.row for c in children])
        finally:
            self._clear()
            self.programs.save()
        return [ScoreResult(float(np.sum(lp, dtype=np.float64)), all(g), tuple(lp))
                for lp, g in zip(lps, greedy)]

    # -- admission ------------------------------------------------------------------------
    def _admit(self, queue: collections.deque, pairs: Sequence[Pair]) -> list[ContextRow]:
        """Takes contexts off ``queue`` while rows and pages allow; one whose next uncached
        page another context of this batch writes waits for the next batch (then cached)."""
        live: list[ContextRow] = []
        ops, pending = self.ops, set()
        rows_left = np.full(ops.num_shards, ops.rows_per_shard)  # a context and its forks
        free = ops.shard_free.copy()  # share one shard (shard_routing.pick_shard)
        while queue:
            g = queue[0]
            kids = g.children(pairs)
            rows = max(1, len(kids))
            hit, digests = self.shared.lookup(g.context) if self.shared else (Hit(), [])
            shard = shard_routing.pick_shard(rows_left, free, rows)
            if shard is None or (hit.num_full < len(digests)
                                 and digests[hit.num_full] in pending):
                break
            need = (pages_needed(g.context, [pairs[k][1] for k in kids],
                                 ops.cache.page_size, hit.num_full)
                    if ops.cache.shares_pages else rows)
            if need > free[shard] and self.shared is not None:
                free[shard] += self.shared.evict(need - free[shard], hit.pages)
            if need > free[shard]:
                if not live:
                    raise ValueError(f"a context of {len(g.context)} tokens with {len(kids)} "
                                     f"continuations needs {need} pages, {free[shard]} are "
                                     "free: raise num_pages")
                break
            queue.popleft()
            row = (shard + 1) * ops.rows_per_shard - int(rows_left[shard])
            if hit.num_tokens:
                self.shared.attach(row, g.context, hit)
            live.append(ContextRow(g, row, hit.num_tokens))
            rows_left[shard] -= rows
            free[shard] -= need
            pending.update(digests)
        self.stats.contexts += len(live)
        self.stats.cached_tokens += sum(r.cached for r in live)
        return live

    def _clear(self) -> None:
        """Every row and cached page back in the pool."""
        active = np.flatnonzero(np.asarray(self.ops.cache.active))
        if active.size:
            self.ops.release(active.tolist())
        if self.shared is not None:
            self.shared.clear()
        self.ops.refresh_free()

    # -- the device steps -----------------------------------------------------------------
    def _step(self, shape: StepShape, tokens: np.ndarray, rows: np.ndarray, qlen: np.ndarray,
              extra: np.ndarray) -> tuple[np.ndarray, ...]:
        """One jitted, donated step of program ``shape``; counts tokens, pages and copies."""
        copies = self.ops.cow_copies
        lp, greedy, ok = self.programs.run(shape, tokens, rows, qlen, extra)
        s = self.stats
        s.peak_pages = max(s.peak_pages, self.ops.cache.total_pages - self.ops.free)
        s.steps += 1
        s.padded_tokens += tokens.size
        s.cow_copies += self.ops.cow_copies - copies
        if not ok[qlen > 0].all():
            raise RuntimeError("a scoring step found no room in the cache (the admission "
                               "count was wrong): please report this")
        return lp, greedy

    def _prefill(self, live: list[ContextRow], pairs: Sequence[Pair], lps: list[list[float]],
                 greedy: list[list[bool]]) -> None:
        """Feeds every context; its last chunk scores each member's first token."""
        todo = sorted(live, key=lambda r: r.left, reverse=True)
        while todo:
            t = policy.prefill_width(todo[0].left, self.prefill_chunk)
            n = policy.prefill_rows(t, self.prefill_tokens)
            batch, todo = todo[:n], todo[n:]
            while batch:
                batch = self._prefill_chunk(batch, t, pairs, lps, greedy)
                t = policy.prefill_width(max([r.left for r in batch], default=1), t)

    def _prefill_chunk(self, batch: list[ContextRow], t: int, pairs: Sequence[Pair],
                       lps: list[list[float]], greedy: list[list[bool]]) -> list[ContextRow]:
        plan = self.programs.plan([r.group.context[:min(x.cached for x in batch)] for r in batch],
                                  max(r.cached + min(r.left, t) for r in batch))
        shape, n = self.programs.choose("context", len(batch), t, candidates_width(batch, pairs),
                                        plan, self.prefill_chunk, [min(r.left, t) for r in batch])
        batch, later = batch[:n], batch[n:]
        tokens, rows, qlen, cands, firsts = context_step(batch, shape.width, pairs, shape.rows,
                                                         shape.extra, feed=t)
        lp, gr = self._step(shape, tokens, rows, qlen, cands)
        self.stats.prefill_tokens += int(qlen.sum())
        more = later
        for i, r in enumerate(batch):
            r.cached += int(qlen[i])
            if r.left:
                more.append(r)
                continue
            for m in r.group.members:
                j = firsts[i].index(pairs[m][1][0])
                lps[m][0], greedy[m][0] = float(lp[i, j]), bool(gr[i, j])
        return more

    def _fork(self, live: list[ContextRow], pairs: Sequence[Pair]) -> list[ChildRow]:
        """Indexes the contexts' full pages, then turns each context row into its children
        (child 0 keeps the row); a context with no multi-token continuation is released."""
        if self.shared is not None:
            self.shared.insert([r.row for r in live], [r.group.context for r in live])
        used, shard_of = {r.row for r in live}, self.ops.shard_of
        spare = collections.defaultdict(list)  # shard -> rows no context holds
        for x in range(self.ops.max_seqs):
            if x not in used:
                spare[shard_of(x)].append(x)
        children, done = [], []
        for r in live:
            kids = r.group.children(pairs)
            if not kids:
                done.append(r.row)
                continue
            rows = [r.row] + [spare[shard_of(r.row)].pop() for _ in kids[1:]]
            self.ops.fork(r.row, rows[1:])
            self.stats.forks += len(rows) - 1
            children += [ChildRow(m, row, r.group.context, pairs[m][1])
                         for m, row in zip(kids, rows)]
        if done:
            self.ops.release(done)
        return children

    def _score_children(self, children: list[ChildRow], lps: list[list[float]],
                        greedy: list[list[bool]]) -> None:
        """Teacher-forced steps over every child row: rows of like lengths share a step
        (:func:`~paxkv.scoring.batches.child_groups`), each in chunks of at most a step's
        width."""
        cap = self.programs.width_limit or self.prefill_chunk
        todo = sorted([c for c in children if c.left], key=lambda c: c.left, reverse=True)
        groups = child_groups([c.left for c in todo], cap, self.ops.max_seqs, self.score_tokens,
                              self.programs.shapes.owned("continuation"), self.programs.packs)
        for start, end in groups:
            batch = todo[start:end]
            t = step_width(batch[0].left, cap)
            while batch:
                batch = self._score_chunk(batch, t, lps, greedy)
                if batch:
                    t = step_width(max(c.left for c in batch), t)

    def _score_chunk(self, batch: list[ChildRow], t: int, lps: list[list[float]],
                     greedy: list[list[bool]]) -> list[ChildRow]:
        lengths = np.asarray(self.ops.cache.lengths)
        plan = self.programs.plan([c.context for c in batch],
                                  int(max(lengths[c.row] + min(c.left, t) for c in batch)))
        cap = self.programs.width_limit or self.prefill_chunk
        shape, n = self.programs.choose("continuation", len(batch), t, t, plan, cap,
                                        [min(c.left, t) for c in batch])
        batch, later = batch[:n], batch[n:]
        tokens, targets, rows, qlen = continuation_step(batch, shape.width, shape.rows, t)
        lp, gr = self._step(shape, tokens, rows, qlen, targets)
        self.stats.scored_tokens += int(qlen.sum())
        for i, c in enumerate(batch):
            n = int(qlen[i])
            lps[c.request][c.done + 1:c.done + 1 + n] = lp[i, :n].tolist()
            greedy[c.request][c.done + 1:c.done + 1 + n] = gr[i, :n].tolist()
            c.done += n
        return later + [c for c in batch if c.left]
