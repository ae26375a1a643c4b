"""What one scoring step feeds, built on the host: the rows in flight and their padded arrays.

A step's arrays have bucketed shapes (a power of two of rows, a bucketed width), so a workload
compiles a handful of steps; padding rows repeat the first row with length 0::

    context step        tokens [b, t]  the next chunk of each context
                        candidates [b, k]  each context's distinct first continuation tokens
    continuation step   tokens [b, t]  cont[done : done + t]       (cont[:-1] in all)
                        targets [b, t] cont[done + 1 : done + 1 + t]  (cont[1:] in all)
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from paxkv.core import buckets
from paxkv.core.packing import step_work
from paxkv.engine.policy import packed_tokens
from paxkv.scoring.requests import Group, Pair


@dataclasses.dataclass
class ContextRow:
    """A context being prefilled in a cache row; ``cached``: its tokens in the row so far."""

    group: Group
    row: int
    cached: int

    @property
    def left(self) -> int:
        return len(self.group.context) - self.cached


@dataclasses.dataclass
class ChildRow:
    """A continuation scored in a cache row (a fork of its context's row): it feeds
    ``cont[:-1]`` and scores ``cont[1:]``; ``done`` tokens fed so far."""

    request: int
    row: int
    context: tuple[int, ...]
    cont: tuple[int, ...]
    done: int = 0

    @property
    def left(self) -> int:
        return len(self.cont) - 1 - self.done


def pages_needed(ctx: Sequence[int], conts: Sequence[Sequence[int]], page_size: int,
                 cached_pages: int = 0) -> int:
    """Pages a context and its continuations take beyond ``cached_pages`` full cached pages:
    the context's, then each multi-token continuation's growth plus a private copy of the
    shared partial last page (one writer keeps it in place; counting it too keeps this an
    upper bound)."""
    base = buckets.cdiv(len(ctx), page_size)
    copy = int(len(ctx) % page_size != 0)
    grow = sum(buckets.cdiv(len(ctx) + len(c) - 1, page_size) - base + copy
               for c in conts if len(c) > 1)
    return base - cached_pages + grow


def check_pairs(pairs: Sequence[Pair], max_len: int, page_size: int,
                num_pages: int | None) -> None:
    """Raises ValueError naming the first pair a scorer of rows of ``max_len`` tokens and a
    pool of ``num_pages`` pages (None: a dense cache, no page limit) cannot hold."""
    for i, (ctx, cont) in enumerate(pairs):
        n = len(ctx) + len(cont) - 1
        if n > max_len:
            raise ValueError(f"request {i} needs {n} tokens of cache (context {len(ctx)} + "
                             f"continuation {len(cont)} - 1) but max_len={max_len}: raise "
                             "max_len, or truncate with max_length")
        pages = pages_needed(ctx, [cont], page_size)
        if num_pages is not None and pages > num_pages:
            raise ValueError(f"request {i} needs {pages} pages but num_pages={num_pages}: "
                             "raise num_pages")


def context_step(batch: Sequence[ContextRow], t: int, pairs: Sequence[Pair], b: int, k: int,
                 feed: int | None = None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[list[int]]]:
    """``(tokens [b, t], rows [b], query_lengths [b], candidates [b, k], firsts)`` for the next
    chunk of each context, at most ``feed`` tokens (default ``t``: a program wider than the
    step was planned for feeds no more than planned, so its packed size holds them;
    ``len(batch) <= b``; :func:`candidates_width` for ``k``); ``firsts[i]``: row ``i``'s
    candidates in order."""
    firsts = [r.group.firsts(pairs) for r in batch]
    tokens, candidates = np.zeros((b, t), np.int32), np.zeros((b, k), np.int32)
    rows, qlen = np.full(b, batch[0].row, np.int32), np.zeros(b, np.int32)
    for i, r in enumerate(batch):
        chunk = r.group.context[r.cached:r.cached + min(t, feed or t)]
        tokens[i, :len(chunk)], rows[i], qlen[i] = chunk, r.row, len(chunk)
        candidates[i, :len(firsts[i])] = firsts[i]
    return tokens, rows, qlen, candidates, firsts


def candidates_width(batch: Sequence[ContextRow], pairs: Sequence[Pair]) -> int:
    """Candidates per row of a context step: a power of two >= 8 (tasks of up to 8 choices
    share one width; a gather of 8 costs what one of 4 does)."""
    return buckets.pow2(max(len(r.group.firsts(pairs)) for r in batch), 8)


# What a step costs beyond its tokens, in tokens: reading the weights, the page table's ops,
# the host's arrays. SmolLM2-135M on 2 CPU cores (12-05): a packed 2 x 256 context step of
# 440 tokens took 0.74 s alone and ~0.97 s inside a scoring run, where its tokens account
# for ~0.6 s. The shape planners weigh one more step against the padding it saves; at 64, a
# two-choice task's 16 contexts ran as eight 2-row steps of ~1 s, not one of ~5 s.
STEP_TOKENS = 128


def child_groups(lefts: Sequence[int], cap: int, max_rows: int, budget: int,
                 compiled: set[tuple[int, int]] | None = None, packs: bool = False
                 ) -> list[tuple[int, int]]:
    """Splits child rows into steps: ``lefts`` (tokens each still feeds, longest first) ->
    ``[(start, end)]`` ranges, one step each, chosen to minimise the padded work.

    A step's shape is ``pow2(rows) x pow2(longest left)`` (width 4 .. ``cap``, rows at most
    ``max_rows`` and ``budget // width``, or when it ``packs``, rows feeding at most
    ``budget`` tokens): one step for 32 continuations of 2-20 tokens is
    32 x 32 = 1,024 tokens for ~350 real ones; steps of like lengths pad far less, at
    :data:`STEP_TOKENS` per extra step and :data:`paxkv.core.buckets.COMPILE_TOKENS` per shape not in
    ``compiled`` (which the chosen shapes join). A step that ``packs`` its tokens
    (:class:`paxkv.core.packing.Packing`) costs its packed tokens and a share of its slots
    (:func:`paxkv.core.packing.step_work`), so wide steps pad little. A shortest path over the
    sorted rows (a batch of children is at most the cache's rows: O(n^2) on the host)."""
    compiled = set() if compiled is None else compiled
    n = len(lefts)
    fed = np.concatenate([[0], np.cumsum(np.minimum(lefts, cap))])  # what rows feed a step
    best = [0] + [1 << 60] * n  # best[i]: the cheapest plan of the first i rows
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        for start in range(end - 1, -1, -1):
            t = step_width(lefts[start], cap)
            rows = fed[end] - fed[start] if packs else (end - start) * t  # the budget's count
            if end - start > max(1, max_rows) or (end - start > 1 and rows > budget):
                break
            shape = (buckets.pow2(end - start), t)
            slots = shape[0] * t
            work = (step_work(slots, packed_tokens(int(fed[end] - fed[start]), slots))
                    if packs else slots)
            cost = (best[start] + work + STEP_TOKENS
                    + (0 if shape in compiled else buckets.COMPILE_TOKENS))
            if cost < best[end]:
                best[end], cut[end] = cost, start
    groups, end = [], n
    while end:
        groups.append((cut[end], end))
        compiled.add((buckets.pow2(end - cut[end]), step_width(lefts[cut[end]], cap)))
        end = cut[end]
    return groups[::-1]


def step_width(left: int, cap: int) -> int:
    """Width of a continuation step whose longest row still feeds ``left`` tokens: a power of
    two, 4 .. ``cap`` (1 for a model that scores one token a step)."""
    return buckets.pow2(left, 4, cap) if cap > 1 else 1


def continuation_step(batch: Sequence[ChildRow], t: int, b: int, feed: int | None = None
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(tokens [b, t], targets [b, t], rows [b], query_lengths [b])`` for the next chunk of
    each continuation, at most ``feed`` tokens (default ``t``; as :func:`context_step`'s;
    ``len(batch) <= b``)."""
    tokens, targets = np.zeros((b, t), np.int32), np.zeros((b, t), np.int32)
    rows, qlen = np.full(b, batch[0].row, np.int32), np.zeros(b, np.int32)
    for i, c in enumerate(batch):
        n = min(t, feed or t, c.left)
        tokens[i, :n] = c.cont[c.done:c.done + n]
        targets[i, :n] = c.cont[c.done + 1:c.done + 1 + n]
        rows[i], qlen[i] = c.row, n
    return tokens, targets, rows, qlen
