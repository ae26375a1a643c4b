"""Bucketing rules: the few sizes a changing count is rounded to, so a handful of shapes
compile instead of one per count. Every rounding in paxkv goes through one of these, and
:data:`COMPILE_TOKENS` prices one more compiled shape against the padding it would save."""

from __future__ import annotations

# What compiling one more step shape costs, in tokens of step work: the one price every shape
# planner uses (:class:`paxkv.engine.policy.Shapes` for prefill calls,
# :class:`paxkv.scoring.shapes.StepShapes` and ``scoring.batches.child_groups`` for scoring
# steps). SmolLM2-135M on 2 CPU cores compiles a step in 1.1-2.0 s plus ~0.4 s tracing and
# lowering, and a padded token costs 1.6-2.8 ms in a scoring step (logits at every position)
# and 1.8-2.2 ms in an engine prefill (a 1 x 512 call, a 32 x 48 one; 12-05): one compile is
# ~700-1,300 tokens. Priced at 2,048 (an earlier estimate), a two-choice task rented a 4 x 512
# program for 2-row steps six times (24 s of steps where its own compile cost 2), and a shared
# prompt's followers ran ~0.9 s calls of 1 x 512 for 48 tokens. On a GPU a token is far cheaper
# than a compile: pass a larger ``buy``.
COMPILE_TOKENS = 1024


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints (pages for tokens, chunks for pages)."""
    return -(-a // b)


def pow2(n: int, lo: int = 1, hi: int | None = None) -> int:
    """The power of two >= ``n``, clamped to ``[lo, hi]``: batch widths."""
    p = max(lo, 1 << max(0, int(n) - 1).bit_length())
    return p if hi is None else min(hi, p)


def fine(n: int, lo: int, hi: int) -> int:
    """The first of ..., 16, 24, 32, 48, 64, 96, 128, 192, ... (powers of two and 1.5 x powers
    of two) >= ``n``, clamped to ``[lo, hi]``: attention windows and prefill widths. Powers of
    two waste up to half of the padded work; these cap it at a third for two shapes per
    doubling."""
    p = 1 << max(0, int(n) - 1).bit_length()
    if 4 * n <= 3 * p:
        p = 3 * p // 4
    return int(min(hi, max(lo, p)))


def eighths(n: int, lo: int, hi: int) -> int:
    """The first multiple of ``2 ** (bit_length(n) - 4)`` >= ``n`` (eight sizes per doubling,
    at most an eighth padding), clamped to ``[lo, hi]``: a prefill call's packed tokens,
    whose padding costs as much as a real token."""
    step = 1 << max(0, int(n).bit_length() - 4)
    return int(min(hi, max(lo, cdiv(n, step) * step)))


def prefix_bucket(num_pages: int) -> int:
    """The largest of 0, 1, 2, 3, 4, 6, 8, 12, 16, 24, ... <= ``num_pages``: a shared-prefix
    hint is rounded *down* (a shorter shared prefix is still shared)."""
    if num_pages < 1:
        return 0
    p = 1 << (int(num_pages).bit_length() - 1)
    return int(3 * p // 2 if p >= 2 and 3 * p // 2 <= num_pages else p)
