"""The attention plan: one step's compile-time choices, beside the state, never on it.

A step's attention can be cheaper when the caller knows something about its rows: the longest
row fits a short window, every row starts with the same pages (a system prompt, the prompt of
beams or samples), the rows' keys fill only so many decode chunks. Those are *static* choices
(they change array shapes, so they are part of the compiled step's key), and they are *hints*:
the step checks each one inside jit against the page table and falls back to the plain path
when it does not hold, so a wrong plan costs time, never a token::

    plan = AttentionPlan(window=384, prefix_pages=8, decode_chunks=24)
    step = StepInfo.make(lengths, query_lengths, q_len, plan=plan)   # travels with the step
    logits, cache = model.forward(params, tokens, step, cache)       # every attend reads it

The plan rides on :class:`paxkv.core.step_info.StepInfo` as a static field, so a researcher's model
passes it through without knowing it exists, and nothing of it is left on the cache after the
step. :func:`plan_step` builds one from the rows of a step (what the engine does each step);
the buckets keep the number of distinct plans, and so of compiled steps, small.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
from jax.typing import ArrayLike

from paxkv.core import buckets
from paxkv.core.buckets import cdiv


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """Static, hashable hints for one step's attention; every field is checked in the step.

    Attributes:
      window: tokens every live row holds at most after the step; attention reads only that
        many per row. A row longer than the window makes the step read whole rows instead.
        None: whole rows.
      prefix_pages: every live row's first ``prefix_pages`` block-table columns hold the same
        pages and every query sits past them: those pages are read once for all rows
        (cascade attention). If the pages differ or a query falls inside the prefix, the step
        attends per row. 0: no hint. Paged caches only (a dense cache ignores it).
      decode_chunks: a decode step's live rows need at most this many chunks of
        :data:`CHUNK_TOKENS` past the shared prefix (the XLA decode
        path's work list); more makes the step cover every row's whole window. None: the
        whole window. Paged caches only.
      packed_tokens: a prefill or scoring step's real tokens number at most this: the model
        runs its token-wise layers over them packed (:class:`paxkv.core.packing.Packing`),
        not over every ``[batch, q_len]`` slot. Not a checked hint: a step with more real tokens
        returns NaN logits. None: every slot (a model that does not pack ignores it).
    """

    window: int | None = None
    prefix_pages: int = 0
    decode_chunks: int | None = None
    packed_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.window is not None and (not isinstance(self.window, int) or self.window < 1):
            raise ValueError(f"AttentionPlan.window must be None or an int >= 1, got "
                             f"{self.window!r}")
        if not isinstance(self.prefix_pages, int) or self.prefix_pages < 0:
            raise ValueError(f"AttentionPlan.prefix_pages must be an int >= 0, got "
                             f"{self.prefix_pages!r}")
        if self.decode_chunks is not None and (not isinstance(self.decode_chunks, int)
                                               or self.decode_chunks < 1):
            raise ValueError(f"AttentionPlan.decode_chunks must be None or an int >= 1, got "
                             f"{self.decode_chunks!r}")
        if self.packed_tokens is not None and (not isinstance(self.packed_tokens, int)
                                               or self.packed_tokens < 1):
            raise ValueError(f"AttentionPlan.packed_tokens must be None or an int >= 1, got "
                             f"{self.packed_tokens!r}")

    def covers(self, other: "AttentionPlan") -> bool:
        """Whether a step compiled for this plan serves ``other``'s rows on its fast path:
        every hint that holds for them holds for this one (the same shared prefix, a window
        and a chunk list at least as long, at least as many packed tokens or every slot), so a
        caller may reuse this compiled step."""
        longer = lambda a, b: a is None if b is None else a is None or a >= b  # noqa: E731
        return (self.prefix_pages == other.prefix_pages and longer(self.window, other.window)
                and longer(self.packed_tokens, other.packed_tokens)
                and (self.decode_chunks is None) == (other.decode_chunks is None)
                and longer(self.decode_chunks, other.decode_chunks))


NO_PLAN = AttentionPlan()

# The XLA decode path's work list (:mod:`paxkv.attention.chunked`): chunks of 128 tokens, 32
# chunks a tile (K + V of a tile: 32 x 128 x kv_heads x head_dim x 8 bytes = 6 MB at SmolLM2's
# 3 x 64 in float32). 16 chunks kept the copies in L2 but ran the small products slower.
CHUNK_TOKENS = 128
TILE_CHUNKS = 32


def chunk_pages(page_size: int, width: int | None = None) -> int:
    """Pages per chunk of the XLA decode path (:data:`CHUNK_TOKENS` tokens), or the whole
    ``width``-page window when it is shorter (a chunk never reads past the window)."""
    pages = max(1, CHUNK_TOKENS // page_size)
    return pages if width is None else min(width, pages)


def shared_prefix_pages(rows_tokens: Sequence[Sequence[int]], page_size: int) -> int:
    """Full pages that hold the same tokens at the start of every row (``rows_tokens``: each
    row's cached tokens, the ones before its queries), rounded down by
    :func:`paxkv.core.buckets.prefix_bucket`. Equal tokens are a hint, not a proof: the step checks
    that the pages are the same."""
    if len(rows_tokens) < 2:
        return 0
    n = min(len(r) for r in rows_tokens)
    first = np.asarray(rows_tokens[0][:n])
    for r in rows_tokens[1:]:
        differ = np.flatnonzero(np.asarray(r[:n]) != first[:n])
        n = int(differ[0]) if differ.size else n
    return buckets.prefix_bucket(n // page_size)


def list_shape(needed: int, max_tile: int) -> tuple[int, int]:
    """``(num_chunks, tile_chunks)`` for a list of at least ``needed`` chunks: one tile of the
    next power of two up to ``max_tile`` chunks (a single short row pays for no padding tiles),
    else whole tiles of ``max_tile``: up to 15 of them exactly, then 8 steps per doubling
    (16-31 tiles in steps of 2, 32-63 in steps of 4, ...), so at most 1/16 of the list is
    rounding and nearby counts share one compiled shape."""
    needed = max(1, int(needed))
    if needed <= max_tile:
        n = 1 << (needed - 1).bit_length()
        return n, n
    tiles = cdiv(needed, max_tile)
    step = 1 << max(0, tiles.bit_length() - 4)
    return cdiv(tiles, step) * step * max_tile, max_tile


def chunks_needed(lengths: ArrayLike, *, start_page: int, page_size: int,
                  chunk_pages: int) -> ArrayLike:
    """Chunks a row of ``lengths`` tokens needs past ``start_page`` (numpy or jnp, elementwise):
    the caller's side of the work list, for sizing ``num_chunks``."""
    span = chunk_pages * page_size
    past = lengths - start_page * page_size
    return cdiv(past, span) * (past > 0)


def plan_step(*, longest: int, max_len: int, page_size: int, prefix_pages: int = 0,
              decode_lengths: Sequence[int] | None = None,
              max_seqs: int | None = None) -> AttentionPlan:
    """The plan for a step whose longest row holds ``longest`` tokens after it.

    Args:
      longest: tokens of the longest stepping row after the step.
      max_len, page_size: the cache's.
      prefix_pages: pages every stepping row shares (:func:`shared_prefix_pages`; 0 without).
      decode_lengths: for a decode step, each stepping row's context after the step (or an
        upper bound); sizes the work list. None for prefill.
      max_seqs: the cache's rows (needed with ``decode_lengths``: a list no shorter than whole
        rows is dropped, it would only add a compiled variant).
    """
    shared = prefix_pages * page_size
    if shared:
        window = min(max_len, shared + buckets.fine(longest - shared, 64, max_len))
    else:
        window = buckets.fine(longest, 64, max_len)
    if decode_lengths is not None and max_seqs is not None:
        # A decode step's chunk list reads only each row's own keys, whatever the window, so
        # its plan names no window (one compiled step per list length, not per length x
        # window); the window then only sizes the fallback, which is whole rows.
        pages = buckets.cdiv(max_len, page_size)
        per_chunk = chunk_pages(page_size, pages)
        needed = int(np.sum(chunks_needed(np.asarray(decode_lengths),
                                                  start_page=prefix_pages,
                                                  page_size=page_size, chunk_pages=per_chunk)))
        chunks = list_shape(needed, TILE_CHUNKS)[0]
        if chunks < max_seqs * buckets.cdiv(pages - prefix_pages, per_chunk):
            return AttentionPlan(prefix_pages=prefix_pages, decode_chunks=chunks)
    return AttentionPlan(window=window, prefix_pages=prefix_pages)
