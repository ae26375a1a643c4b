"""The scheduling policy: pure functions from what the engine knows to a decision.

Nothing here touches the cache or the request table; the scheduler asks and acts. A different
policy (admission against projected growth, another preemption victim) is a change here.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np

from paxkv.core import buckets
from paxkv.core import plan as plan_rules
from paxkv.core.plan import AttentionPlan
from paxkv.engine.requests import Request


def pages_to_admit(num_tokens: int, cached: int, page_size: int) -> int:
    """Pages a request of ``num_tokens`` tokens (prompt and output so far) needs to be admitted
    with ``cached`` tokens already in shared pages: room for all of them plus its first
    decoded token, past the cached pages, and a private copy of a partly filled cached page."""
    return (buckets.cdiv(num_tokens + 1, page_size) - buckets.cdiv(cached, page_size)
            + int(cached % page_size != 0))


def admits(need: int, free: int, busy: bool) -> bool:
    """Admit while the free pages (less what running requests are projected to grow into,
    :class:`Growth`) cover the request; with nothing else running (``busy`` False) admit
    anyway, so a request larger than the free pool still runs alone."""
    return need <= free or not busy


@dataclasses.dataclass
class Growth:
    """How many pages the running requests will still grow into: SGLang's admission rule.

    Every running request is assumed to generate ``ratio`` of its remaining ``max_new_tokens``.
    The ratio starts at ``start`` (admission keeps room for most of the growth), decays by
    ``(start - floor) / decay_steps`` a step as requests prove to finish (more admitted, more
    concurrency), and returns to ``start`` whenever the pool ran dry and a request had to be
    preempted. Without it, paging's extra concurrency is spent on recompute: a pool-bound run
    admitted everything that fit now and preempted two requests in three.
    """

    start: float = 0.7
    floor: float = 0.1
    decay_steps: int = 600
    ratio: float = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.ratio = self.start

    def reset(self) -> None:
        """Back to ``start`` (a new workload: :meth:`paxkv.Engine.warm_up`'s end)."""
        self.ratio = self.start

    def stepped(self) -> None:
        self.ratio = max(self.floor, self.ratio - (self.start - self.floor) / self.decay_steps)

    def preempted(self) -> None:
        self.ratio = self.start

    def pages_ahead(self, running: Sequence[Request], page_size: int) -> int:
        """Pages the ``running`` requests will take beyond their tokens so far."""
        total = 0
        for r in running:
            now = len(r.tokens)
            later = now + math.ceil(self.ratio * max(0, r.max_new_tokens - len(r.output)))
            total += buckets.cdiv(later, page_size) - buckets.cdiv(now, page_size)
        return total


MIN_PREFILL_WIDTH = 16  # the narrowest prefill call (a shorter chunk is padded to it)


def prefill_width(longest: int, prefill_chunk: int) -> int:
    """Tokens per row of one prefill call for a batch whose longest remaining prompt is
    ``longest`` (:func:`paxkv.core.buckets.fine`, :data:`MIN_PREFILL_WIDTH` ..
    ``prefill_chunk``)."""
    return buckets.fine(longest, MIN_PREFILL_WIDTH, prefill_chunk)


def packed_tokens(real: int, slots: int) -> int | None:
    """The packed size of a prefill call of ``real`` tokens in ``slots`` (rows x width):
    :func:`paxkv.core.buckets.eighths` of ``real`` (at most an eighth padding; a call of
    another size rents a compiled one, :meth:`Shapes.plan`), or None when that saves no slot
    (the call runs unpacked)."""
    size = buckets.eighths(real, MIN_PREFILL_WIDTH, slots)
    return size if size < slots else None


def prefill_rows(width: int, prefill_tokens: int) -> int:
    """Rows per prefill call at ``width``: the largest power of two within the token budget
    (a batch is padded to a power of two anyway)."""
    return 1 << (max(1, prefill_tokens // width).bit_length() - 1)


def most_prefill_rows(prefill_chunk: int, prefill_tokens: int) -> int:
    """The most rows one prefill call can hold: :func:`prefill_rows` at the narrowest width
    (what sizes a sliding-window group's pages: :func:`paxkv.cache.layer_groups.window_group_pages`)."""
    return prefill_rows(min(MIN_PREFILL_WIDTH, prefill_chunk), prefill_tokens)


def prefill_batch_rows(lefts: Sequence[int], width: int, prefill_tokens: int,
                       prefill_chunk: int, packed: bool) -> int:
    """Rows of the next prefill call at ``width``, for rows still feeding ``lefts`` tokens
    (longest first). Unpacked, the budget counts slots (:func:`prefill_rows`). Packed
    (:class:`paxkv.core.packing.Packing`), it counts real tokens: all the rows when their
    tokens fit it, else a power of two of the rows that fit (at least one); their slots at
    most twice it (a slot costs a sixth of a token, :data:`paxkv.core.packing.SLOT_SHARE`)
    and at most :func:`most_prefill_rows`. Sixteen prompts of 100-300 tokens then prefill in
    one 16 x 384 call, not two of 8 x 384 that paid a step's fixed cost twice and compiled two
    packed sizes; 32 prompts of 440 tokens still run as four calls of 8 rows (not 9, 9, 9
    and 5 in calls of 16 rows)."""
    if not packed:
        return prefill_rows(width, prefill_tokens)
    fed = np.cumsum(np.minimum(lefts, width))
    fit = int(np.searchsorted(fed, prefill_tokens, side="right"))
    rows = len(lefts) if fit == len(lefts) else prefill_rows(1, max(1, fit))
    return min(rows, prefill_rows(width, 2 * prefill_tokens),
               most_prefill_rows(prefill_chunk, prefill_tokens))


def prefill_order(reqs: Sequence[Request]) -> list[Request]:
    """Longest remaining prompt first, so each batch pads prompts of similar lengths."""
    return sorted(reqs, key=lambda r: r.target - r.cached, reverse=True)


def decode_width(num_live: int, max_seqs: int) -> int:
    """Rows of a decode call with ``num_live`` live rows: a power of two >= 8; the whole cache
    (``max_seqs``) runs as the plain decode step."""
    return buckets.pow2(num_live, 8, max_seqs)


def decode_window_tokens(longest: int, final: int, shared: int) -> int:
    """The row length a decode step's window is sized for: ``final`` (the longest stepping
    row's keys at its end) when its own part past the ``shared`` prefix is at most twice what
    it is now (``longest``), else ``longest``.

    Every window bucket a decode run crosses compiles a step of its own (~1.7 s for SmolLM2 on
    2 cores, some 14 of its decode steps). Short answers on long contexts (chat turns, an
    evaluation's generations, the shared-prompt workload W2: 448 -> 480 -> 512) then compile
    their one last window at the start and run it padded by at most their own part; a long
    generation keeps the window of its length now (a padded window would be read every step
    for thousands of steps)."""
    own = max(1, longest - shared)
    return final if shared + 2 * own >= final >= longest else longest


def tokens_to_write(req: Request) -> int:
    """Tokens ``req`` will still write to its row: prompt tokens not yet prefilled and tokens
    still to generate (the last generated token is never fed, so never written)."""
    return max(0, len(req.prompt_ids) + req.max_new_tokens - 1 - req.cached)


def queued_tokens(running: Sequence[Request], rows_per_shard: int,
                  num_shards: int) -> np.ndarray:
    """int64 ``[num_shards]``: :func:`tokens_to_write` summed over each shard's ``running``
    requests (row ``r`` in shard ``r // rows_per_shard``): the load
    :func:`paxkv.engine.routing.pick_row` weighs."""
    out = np.zeros(num_shards, np.int64)
    for r in running:
        out[r.row // rows_per_shard] += tokens_to_write(r)
    return out


def preemption_victims(running: Sequence[Request], failed_rows: Sequence[int],
                       rows_per_shard: int, page_size: int, cached: bool) -> list[Request]:
    """The requests to preempt after a decode step whose ``failed_rows`` found no page: one
    per shard that ran dry, chosen by :func:`preemption_victim` among that shard's own
    ``running`` requests only (another shard's pages would not help it). Lowest shard
    first."""
    victims = []
    for shard in sorted({int(row) // rows_per_shard for row in failed_rows}):
        mine = [r for r in running if r.row // rows_per_shard == shard]
        if mine:
            victims.append(preemption_victim(mine, page_size, cached))
    return victims


def preemption_victim(running: Sequence[Request], page_size: int, cached: bool) -> Request:
    """The request to preempt when the pool runs dry mid-decode: the one whose recompute is
    cheapest — its tokens, less its full pages when the prefix cache keeps them (``cached``:
    they are indexed on release, so its recompute finds them) — the youngest among equals."""
    def cost(r: Request) -> tuple[int, int, int]:
        n = len(r.tokens)
        return (n % page_size if cached else n), -r.admitted_at, -r.row
    return min(running, key=cost)


@dataclasses.dataclass
class Shapes:
    """Which prefill shapes have compiled, and when a call runs in a wider one: ski rental.

    Every new ``(rows, width)`` of a prefill call compiles a step of its own, which on a CPU
    costs about what one full prefill call does (3-5 s for SmolLM2-135M; the offline workload's
    first pass spent 27 s of its 213 s compiling six step variants). So a call that a compiled
    shape can hold, at most ``rows`` rows of at most ``width`` tokens, runs there, padded,
    until the padding paid in place of its own shape would pass ``buy`` tokens (counting every
    call a batch needs in a shape of fewer rows); then its own shape compiles. That is the
    ski-rental rule: it never pays more than twice the better of "always compile" and "always
    pad" in hindsight, and a workload of a few calls compiles a few shapes where fine buckets
    would compile one per length class. ``buy=0`` compiles every tight shape; the default is
    :data:`paxkv.core.buckets.COMPILE_TOKENS`.
    """

    buy: int = buckets.COMPILE_TOKENS
    owned: set[tuple[int, int]] = dataclasses.field(default_factory=set)
    rent: dict[tuple[int, int], int] = dataclasses.field(default_factory=dict)
    plans: dict[tuple[int, int], list[AttentionPlan]] = dataclasses.field(default_factory=dict)
    plan_rent: dict[tuple[tuple[int, int], AttentionPlan], int] = dataclasses.field(
        default_factory=dict)

    def choose(self, rows: int, width: int, max_rows: int) -> tuple[int, int]:
        """``(b, t)`` for a call of ``rows`` requests of at most ``width`` tokens each: the
        tight shape ``(pow2(rows), width)`` (``b`` at most ``max_rows``), or a compiled one
        with ``t >= width`` while the rent allows (``b < rows`` then runs only ``b`` of the
        requests now)."""
        tight = (buckets.pow2(rows, 1, max_rows), width)
        if tight in self.owned or not self.owned:
            self.owned.add(tight)
            return tight
        # A shape of fewer rows runs the batch in several calls: the rent is judged on all of
        # them (a 31-row batch of 48 tokens in a 1 x 512 step pays 31 x 464, not 464: before
        # this, a shared prompt's 31 followers ran one by one, four calls of ~0.9 s each, until
        # the rent passed the price), and charged call by call.
        options = [(buckets.cdiv(rows, b) * b * t - tight[0] * width,
                    b * t - buckets.pow2(min(rows, b)) * width, (b, t))
                   for b, t in self.owned if t >= width]
        if options:
            whole, extra, shape = min(options)
            paid = self.rent.get(tight, 0)
            if paid + whole <= self.buy:
                self.rent[tight] = paid + extra
                return shape
        self.owned.add(tight)
        return tight

    def plan(self, shape: tuple[int, int], plan: AttentionPlan) -> AttentionPlan:
        """A plan already compiled at ``shape`` that covers ``plan``
        (:meth:`~paxkv.core.plan.AttentionPlan.covers`: a longer window, say), else
        ``plan`` itself, from now on compiled there. A covering plan that packs more tokens
        (or none: every slot) is rented like a shape: while the tokens it pads past
        ``plan``'s, summed over the calls of ``plan``, stay within ``buy``."""
        compiled = self.plans.setdefault(shape, [])
        size = lambda p: p.packed_tokens or shape[0] * shape[1]  # noqa: E731
        options = [(size(p) - size(plan), i) for i, p in enumerate(compiled) if p.covers(plan)]
        if options:
            extra, i = min(options)
            paid = self.plan_rent.get((shape, plan), 0) + extra
            if paid <= self.buy:
                if extra:
                    self.plan_rent[(shape, plan)] = paid
                return compiled[i]
        compiled.append(plan)
        return plan


def step_plan(cache: Any, shares: bool, stepping: list[Request], longest: int,
              decode_lengths: list[int] | None = None,
              final: int | None = None) -> AttentionPlan:
    """A step's attention plan over ``cache``: the window of the ``longest`` row, the pages
    every stepping row shares (their cached tokens' common prefix, when rows may share pages:
    ``shares``) and, for a decode step, the chunk list of the rows' own tokens
    (``decode_lengths``). ``final``: a decode step's longest row at its end
    (:func:`decode_window_tokens`)."""
    prefix = 0
    if cache.shares_pages and shares:
        prefix = plan_rules.shared_prefix_pages(
            [r.tokens[:min(x.cached for x in stepping)] for r in stepping], cache.page_size)
    if final is not None:
        longest = decode_window_tokens(longest, final, prefix * cache.page_size)
    return plan_rules.plan_step(
        longest=longest, max_len=cache.max_len, page_size=cache.page_size,
        prefix_pages=prefix, decode_lengths=decode_lengths if cache.shares_pages else None,
        max_seqs=cache.max_seqs)
