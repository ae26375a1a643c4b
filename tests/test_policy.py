"""The engine's pure parts, with no model and no JAX step: bucketing rules, the policy's
decisions, the attention plan builder and the request table."""

from __future__ import annotations

import numpy as np
import pytest

from paxkv.core import buckets

from paxkv.engine import policy
from paxkv.core.plan import AttentionPlan, plan_step, shared_prefix_pages
from paxkv.engine.requests import Request, RequestTable
from paxkv.core.sampling import SamplingParams


def test_fine_bucket_covers_the_longest_row_and_wastes_at_most_a_third():
    seen = set()
    for n in range(1, 2049):
        w = buckets.fine(n, 64, 2048)
        assert w >= n and w % 16 == 0
        if n > 64:
            assert (w - n) / w < 1 / 3  # a power-of-two window wastes up to 1/2
        seen.add(w)
    # Two shapes per doubling: 64, 96, 128, 192, ..., 1536, 2048.
    assert sorted(seen) == [64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
    assert buckets.fine(5000, 64, 2048) == 2048 and buckets.fine(1, 64, 100) == 64


def test_token_buckets_are_powers_of_two():
    assert [buckets.pow2(n, 16, 512) for n in (1, 16, 17, 300, 513)] == [16, 16, 32, 512, 512]
    assert [buckets.prefix_bucket(n) for n in (0, 1, 2, 3, 5, 7, 13, 25)] == [
        0, 1, 2, 3, 4, 6, 12, 24]


def _req(rid: int, prompt: int, output: int = 0, **kw) -> Request:
    r = Request.make(rid, list(range(prompt)), SamplingParams(max_new_tokens=8), frozenset(),
                     np.zeros(2, np.uint32), **kw)
    r.output = list(range(output))
    return r


def test_admission_counts_pages_past_the_cache_and_a_partial_copy():
    assert policy.pages_to_admit(31, 0, 16) == 2  # 31 tokens + the first decoded one
    assert policy.pages_to_admit(32, 0, 16) == 3
    assert policy.pages_to_admit(40, 16, 16) == 2  # one full page cached
    assert policy.pages_to_admit(40, 20, 16) == 2  # 1 new + a copy of the partial cached one
    assert policy.admits(3, 3, busy=True) and not policy.admits(4, 3, busy=True)
    assert policy.admits(4, 3, busy=False)  # alone, a request always gets its chance


def test_prefill_batches_fit_the_token_budget_longest_first():
    assert policy.prefill_width(100, 512) == 128 and policy.prefill_width(600, 512) == 512
    assert policy.prefill_rows(128, 4096) == 32 and policy.prefill_rows(96, 4096) == 32
    reqs = [_req(i, n) for i, n in enumerate([5, 50, 20])]
    assert [r.id for r in policy.prefill_order(reqs)] == [1, 2, 0]
    assert policy.decode_width(3, 64) == 8 and policy.decode_width(40, 64) == 64


def test_the_cheapest_recompute_is_preempted():
    old, young, long = _req(0, 4), _req(1, 4), _req(2, 30, output=3)
    for i, r in enumerate((old, young, long)):
        r.admitted_at, r.row = (1, 5, 3)[i], i
    assert policy.preemption_victim([old, young, long], 16, cached=False) is young
    # With the prefix cache a preempted request's full pages stay indexed: only the rest
    # (33 % 16 = 1 token) is recomputed.
    assert policy.preemption_victim([old, young, long], 16, cached=True) is long


def test_growth_projection_decays_and_resets_on_preemption():
    growth = policy.Growth(start=0.5, floor=0.1, decay_steps=4)
    r = _req(0, 16, output=0)  # max_new_tokens 8: 4 more at 0.5 -> one more page of 16
    assert growth.pages_ahead([r], 16) == 1 and growth.pages_ahead([r], 4) == 1
    for _ in range(10):
        growth.stepped()
    assert growth.ratio == pytest.approx(0.1)
    assert growth.pages_ahead([r], 4) == 1  # ceil(0.1 * 8) = 1 token: still a new page
    growth.preempted()
    assert growth.ratio == 0.5


def test_plans_round_to_few_shapes_and_drop_useless_hints():
    plan = plan_step(longest=100, max_len=2048, page_size=16)
    assert plan == AttentionPlan(window=128)
    with_prefix = plan_step(longest=300, max_len=2048, page_size=16, prefix_pages=8)
    assert with_prefix.window == 128 + 192 and with_prefix.prefix_pages == 8
    decode = plan_step(longest=300, max_len=2048, page_size=16, decode_lengths=[300, 20],
                       max_seqs=64)
    assert decode.decode_chunks == 4  # 3 + 1 chunks of 128, a power of two
    # A decode plan names no window: its chunk list reads only the rows' own keys, so rows of
    # 300 and of 500 tokens share one compiled step.
    assert decode.window is None
    assert plan_step(longest=500, max_len=2048, page_size=16, decode_lengths=[500, 20],
                     max_seqs=64) == AttentionPlan(decode_chunks=8)
    whole = plan_step(longest=300, max_len=320, page_size=16, decode_lengths=[300],
                      max_seqs=1)
    assert whole == AttentionPlan(window=320)  # no shorter than the row itself: no hint
    assert shared_prefix_pages([[1] * 40, [1] * 35 + [2] * 5], 16) == 2
    assert shared_prefix_pages([[1] * 40], 16) == 0
    with pytest.raises(ValueError, match="window"):
        AttentionPlan(window=0)


def test_the_request_table_hands_out_done_requests_once():
    table = RequestTable(max_seqs=2)
    a, b = _req(table.new_id(), 3), _req(table.new_id(), 3)
    b.n = 2
    for r in (a, b):
        table.add(r)
    table.place(a, 0)
    assert table.free_rows() == [1] and table.running() == [a]
    a.finish_reason = "length"
    assert table.done() == []  # still holds its row
    table.vacate(a)
    assert table.done() == [a]
    table.drop(a)
    assert table.done() == []
    with pytest.raises(ValueError, match="unknown request id 0"):
        table.get(a.id)
    kids = [_req(table.new_id(), 3, sample_of=b.id) for _ in range(2)]
    for k in kids:
        table.add(k)
    b.children, b.finish_reason = [k.id for k in kids], "forked"
    kids[0].finish_reason = "stop"
    assert table.done() == []  # a sample is still running
    kids[1].finish_reason = "length"
    assert table.done() == [b]
    table.drop(b)
    assert not table.requests  # samples leave with it


def test_prefill_shapes_rent_a_compiled_wider_shape_until_the_padding_costs_a_compile():
    shapes = policy.Shapes(buy=4096)
    assert shapes.choose(8, 512, 32) == (8, 512)  # the first call compiles its own shape
    # 8 rows of <= 384 tokens run in the 8 x 512 step: 8 x 128 padded tokens of rent.
    assert shapes.choose(8, 384, 32) == (8, 512) and shapes.rent[(8, 384)] == 1024
    # 16 rows of <= 192: one call of 8 there pads 8 x 320 = 2,560 (under the price), but the
    # batch needs two (5,120 > 4,096): its own shape compiles now, not after the first call.
    assert shapes.choose(16, 192, 32) == (16, 192) and (16, 192) not in shapes.rent
    assert shapes.choose(8, 192, 32) == (16, 192) and shapes.rent[(8, 192)] == 1536
    # 3 rows of 96 (tight 4 x 96) rent the 16 x 192 step once (3,072 - 384 = 2,688), then buy.
    assert shapes.choose(3, 96, 32) == (16, 192) and shapes.rent[(4, 96)] == 2688
    assert shapes.choose(3, 96, 32) == (4, 96)
    assert shapes.owned == {(8, 512), (16, 192), (4, 96)}
    # buy=0 compiles every call's own shape (the fine buckets alone); rows cap at max_rows.
    tight = policy.Shapes(buy=0)
    assert [tight.choose(r, w, 24) for r, w in ((8, 512), (8, 384), (20, 64))] == [
        (8, 512), (8, 384), (24, 64)]


def test_a_batch_is_not_rented_call_by_call_into_a_shape_of_fewer_rows():
    # A shared prompt's followers: the 1 x 512 step of its leader owned, 31 rows of 48 tokens
    # left. Each call alone pads 464 tokens (under the price), but the batch needs 31 of them.
    # Before the fix the first four calls ran one row each (~0.9 s a call on SmolLM2).
    shapes = policy.Shapes(buy=2048)
    assert shapes.choose(1, 512, 32) == (1, 512)
    assert shapes.choose(31, 48, 32) == (32, 48) and not shapes.rent


def test_a_compiled_plan_is_reused_where_it_covers_the_calls_plan():
    wide, narrow = AttentionPlan(window=512), AttentionPlan(window=384)
    assert wide.covers(narrow) and not narrow.covers(wide)
    assert AttentionPlan().covers(wide) and not wide.covers(AttentionPlan())
    assert not AttentionPlan(window=512, prefix_pages=2).covers(narrow)  # another prefix
    chunks = AttentionPlan(decode_chunks=64)
    assert chunks.covers(AttentionPlan(decode_chunks=32))
    assert not chunks.covers(AttentionPlan(decode_chunks=96)) and not chunks.covers(wide)
    shapes = policy.Shapes()
    assert shapes.plan((8, 512), wide) is wide
    assert shapes.plan((8, 512), narrow) is wide  # same compiled step
    assert shapes.plan((8, 384), narrow) is narrow  # another shape: its own


def test_a_decode_window_is_sized_for_the_rows_end_when_their_answers_are_short():
    # W2's rows: 384 shared tokens, 448 now, 510 at the end (own part 64 -> 126): the last
    # window from the start, one decode compile instead of three (448, 480, 512).
    assert policy.decode_window_tokens(448, 510, 384) == 510
    assert policy.decode_window_tokens(448, 513, 384) == 448  # own part past twice its size
    assert policy.decode_window_tokens(100, 2148, 0) == 100  # a long generation: its length
    assert policy.decode_window_tokens(100, 200, 0) == 200
    assert policy.decode_window_tokens(100, 90, 0) == 100  # never shorter than the rows now


def test_a_packed_prefill_call_takes_the_rows_whose_tokens_fit_the_budget():
    """Unpacked, the budget counts slots; packed, real tokens (slots at most twice it)."""
    assert policy.prefill_batch_rows([200] * 16, 384, 4096, 512, packed=False) == 8
    assert policy.prefill_batch_rows([200] * 16, 384, 4096, 512, packed=True) == 16  # all fit
    assert policy.prefill_batch_rows([440] * 32, 512, 4096, 512, packed=True) == 8  # 9 fit
    assert policy.prefill_batch_rows([10] * 64, 384, 4096, 512, packed=True) == 16  # slots
    assert policy.prefill_batch_rows([400, 10], 512, 256, 512, packed=True) == 1
