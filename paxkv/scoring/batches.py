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

from paxkv import buckets
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


def context_step(batch: Sequence[ContextRow], t: int, pairs: Sequence[Pair], max_rows: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[list[int]]]:
    """``(tokens [b, t], rows [b], query_lengths [b], candidates [b, k], firsts)`` for the next
    chunk of each context; ``firsts[i]``: row ``i``'s candidates in order."""
    b = buckets.pow2(len(batch), 1, max_rows)
    firsts = [r.group.firsts(pairs) for r in batch]
    k = buckets.pow2(max(map(len, firsts)), 4)
    tokens, candidates = np.zeros((b, t), np.int32), np.zeros((b, k), np.int32)
    rows, qlen = np.full(b, batch[0].row, np.int32), np.zeros(b, np.int32)
    for i, r in enumerate(batch):
        chunk = r.group.context[r.cached:r.cached + t]
        tokens[i, :len(chunk)], rows[i], qlen[i] = chunk, r.row, len(chunk)
        candidates[i, :len(firsts[i])] = firsts[i]
    return tokens, rows, qlen, candidates, firsts


def continuation_step(batch: Sequence[ChildRow], t: int, max_rows: int
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(tokens [b, t], targets [b, t], rows [b], query_lengths [b])`` for the next chunk of
    each continuation."""
    b = buckets.pow2(len(batch), 1, max_rows)
    tokens, targets = np.zeros((b, t), np.int32), np.zeros((b, t), np.int32)
    rows, qlen = np.full(b, batch[0].row, np.int32), np.zeros(b, np.int32)
    for i, c in enumerate(batch):
        n = min(t, c.left)
        tokens[i, :n] = c.cont[c.done:c.done + n]
        targets[i, :n] = c.cont[c.done + 1:c.done + 1 + n]
        rows[i], qlen[i] = c.row, n
    return tokens, targets, rows, qlen
