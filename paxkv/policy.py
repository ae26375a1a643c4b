"""The scheduling policy: pure functions from what the engine knows to a decision.

Nothing here touches the cache or the request table; the scheduler asks and acts. A different
policy (admission against projected growth, another preemption victim) is a change here.
"""

from __future__ import annotations

from typing import Sequence

from paxkv import buckets
from paxkv.requests import Request


def pages_to_admit(num_tokens: int, cached: int, page_size: int) -> int:
    """Pages a request of ``num_tokens`` tokens (prompt and output so far) needs to be admitted
    with ``cached`` tokens already in shared pages: room for all of them plus its first
    decoded token, past the cached pages, and a private copy of a partly filled cached page."""
    return (buckets.cdiv(num_tokens + 1, page_size) - buckets.cdiv(cached, page_size)
            + int(cached % page_size != 0))


def admits(need: int, free: int, busy: bool) -> bool:
    """Admit while the free pages cover the request; with nothing else running (``busy``
    False) admit anyway, so a request larger than the free pool still runs alone."""
    return need <= free or not busy


def prefill_width(longest: int, prefill_chunk: int) -> int:
    """Tokens per row of one prefill call for a batch whose longest remaining prompt is
    ``longest`` (:func:`paxkv.buckets.fine`, 16 .. ``prefill_chunk``)."""
    return buckets.fine(longest, 16, prefill_chunk)


def prefill_rows(width: int, prefill_tokens: int) -> int:
    """Rows per prefill call at ``width``: the largest power of two within the token budget
    (a batch is padded to a power of two anyway)."""
    return 1 << (max(1, prefill_tokens // width).bit_length() - 1)


def prefill_order(reqs: Sequence[Request]) -> list[Request]:
    """Longest remaining prompt first, so each batch pads prompts of similar lengths."""
    return sorted(reqs, key=lambda r: r.target - r.cached, reverse=True)


def decode_width(num_live: int, max_seqs: int) -> int:
    """Rows of a decode call with ``num_live`` live rows: a power of two >= 8; the whole cache
    (``max_seqs``) runs as the plain decode step."""
    return buckets.pow2(num_live, 8, max_seqs)


def preemption_victim(running: Sequence[Request]) -> Request:
    """The request to preempt when the pool runs dry mid-decode: the youngest admitted (it has
    the least work to recompute and the others keep their progress)."""
    return max(running, key=lambda r: (r.admitted_at, r.row))
