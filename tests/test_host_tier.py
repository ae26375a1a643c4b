"""The prefix cache's host tier (issue 33): pages evicted for room go to host memory and come
back on a later hit instead of a prefill, with tokens identical to an engine without the tier.

Agents share a system prompt and keep private histories that grow over turns, through a pool
far smaller than all histories: without the tier every returning history is prefilled again.
Device and host pools are NaN-poisoned where they hold nothing, so a stray read shows in the
tokens. The tier's own bookkeeping (LRU over leaves, pins, time-to-live) is tested on
:class:`paxkv.prefix.host_tier.HostTier` directly with a fake clock.
"""

from __future__ import annotations

import dataclasses
import hashlib

import jax.numpy as jnp
import numpy as np
import pytest

import paxkv
from paxkv.cache import paged
from paxkv.prefix.host_pages import PinnedPages
from paxkv.prefix.host_tier import HostTier
from paxkv.prefix.index import root_digest
from tiny import tiny_lm

PAGE, MAX_LEN, PAGES, ROWS = 8, 256, 40, 2


def _lm():
    return tiny_lm(scale=1.0)


def _engine(host_bytes: int, *, poison: bool = True, memory: str = "numpy",
            **kw) -> paxkv.Engine:
    """An engine over a NaN-filled pool (``poison``) with a host tier of ``host_bytes`` whose
    pages live in ``memory``: "numpy" (NaN-filled too; a CPU's default) or "pinned_host" (a
    GPU's: a page per buffer, nothing stale to read)."""
    lm = _lm()
    cfg = lm.config
    cache = paged.create(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                         head_dim=cfg.head_dim, num_pages=PAGES, page_size=PAGE, max_seqs=ROWS,
                         max_len=MAX_LEN, fill=float("nan") if poison else 0.0,
                         attention_impl="xla")
    e = paxkv.Engine(lm, cache=cache, prefill_chunk=64, host_cache_bytes=host_bytes, **kw)
    if host_bytes:
        host = e.prefixes.host
        assert host.store.memory_kind == "numpy"  # a CPU's default (setup.host_memory_kind)
        if memory == "pinned_host":  # what a GPU gets: the path runs on this CPU too
            host.store = PinnedPages(host.capacity)
        elif poison:  # the host pool too: only slots a copy filled may be read
            host.store.arrays = [np.full((host.capacity, a.shape[0]) + a.shape[2:], np.nan,
                                         a.dtype) for a in e.cache.pool.arrays()]
    return e


def _agents(engine: paxkv.Engine, *, agents: int = 6, turns: int = 3, seed: int = 0,
            temperature: float = 0.0, salts: list | None = None) -> list[list[int]]:
    """Each agent's reply per turn: a shared 40-token system prompt, a private 60-token task,
    then per turn its reply and a 10-token tool result appended."""
    rng = np.random.default_rng(seed)
    system = [int(t) for t in rng.integers(10, 250, 40)]
    hist = [system + [int(t) for t in rng.integers(10, 250, 60)] for _ in range(agents)]
    out = []
    for turn in range(turns):
        ids = [engine.submit(h, max_new_tokens=6, stop_token_ids=[], temperature=temperature,
                             key=np.array([seed, turn * 100 + i], np.uint32),
                             cache_salt=None if salts is None else salts[i])
               for i, h in enumerate(hist)]
        res = engine.run()
        for i, rid in enumerate(ids):
            out.append(res[rid].token_ids)
            hist[i] = hist[i] + res[rid].token_ids + [int(t) for t in rng.integers(10, 250, 10)]
    return out


def _no_leaks(engine: paxkv.Engine) -> None:
    engine.clear_prefix_cache()
    assert int(engine.cache.free_pages()) == PAGES, "a leaked device page"
    host = engine.stats().host
    if host is not None:
        assert host.pages == 0 and host.bytes == 0 and host.in_flight == 0, host


@pytest.mark.parametrize("temperature, memory", [(0.0, "numpy"), (1.0, "numpy"),
                                                 (0.0, "pinned_host")],
                         ids=["greedy", "sampled", "greedy-pinned"])
def test_tokens_identical_with_the_tier_and_far_fewer_prefilled(temperature, memory):
    off, on = _engine(0), _engine(1 << 20, memory=memory)
    want = _agents(off, temperature=temperature)
    got = _agents(on, temperature=temperature)
    assert got == want
    s_off, s_on = off.stats(), on.stats()
    host = s_on.host
    assert s_off.host is None and s_off.evictions > 0  # the pool is far too small for all
    assert host.copy_out_pages > 0 and host.copy_in_pages > 0 and host.hit_tokens > 0
    # every returning history comes back from host: only new tokens (and a page's worth of
    # tail each) are prefilled
    assert s_on.prefill_tokens <= 0.5 * s_off.prefill_tokens, (s_on.prefill_tokens,
                                                               s_off.prefill_tokens)
    assert host.bytes == host.pages * on.cache.kv_bytes_per_page <= host.capacity_bytes
    assert host.memory_kind == memory
    on.reset_stats()  # the host tier's totals restart too (its pages stay)
    after = on.stats().host
    assert (after.hit_tokens, after.copy_in_pages, after.copy_out_pages) == (0, 0, 0)
    assert after.pages == host.pages
    _no_leaks(on)
    _no_leaks(off)


def test_a_small_host_budget_drops_least_recent_pages_and_stays_exact():
    want = _agents(_engine(0))
    e = _engine(12 * _engine(0).cache.kv_bytes_per_page)  # 12 host pages for ~100 evicted
    assert _agents(e) == want
    host = e.stats().host
    assert host.capacity_pages == 12 and host.pages <= 12 and host.dropped > 0
    assert host.hit_tokens > 0
    _no_leaks(e)


def test_salts_are_isolated_across_both_tiers():
    e = _engine(1 << 20)
    _agents(e, agents=4, turns=2, salts=["a"] * 4)
    assert e.stats().host.hit_tokens > 0
    rng = np.random.default_rng(0)  # agent 0's first prompt, cached by tenant a
    prompt = [int(t) for t in rng.integers(10, 250, 40)] + [int(t) for t in
                                                            rng.integers(10, 250, 60)]
    for salt, served in (("b", False), ("a", True)):
        before = e.stats()
        e.submit(prompt, max_new_tokens=2, stop_token_ids=[], cache_salt=salt)
        e.run()
        after = e.stats()
        hit = after.prefix_hit_tokens - before.prefix_hit_tokens
        from_host = after.host.hit_tokens - before.host.hit_tokens
        assert (hit > 0) == served and (from_host > 0 or not served) and (
            served or from_host == 0), (salt, hit, from_host)
    _no_leaks(e)


def test_cancel_right_after_a_copy_back_returns_every_page():
    e = _engine(1 << 20, prefill_tokens=64)
    _agents(e, agents=6, turns=1)  # histories on host now
    rng = np.random.default_rng(0)
    system = [int(t) for t in rng.integers(10, 250, 40)]
    first = system + [int(t) for t in rng.integers(10, 250, 60)]  # agent 0's history
    before = e.stats().host.copy_in_pages
    rid = e.submit(first + list(range(20, 120)), max_new_tokens=4, stop_token_ids=[])
    e.step()  # admitted: pages copied back, the rest prefilled, a first token
    assert e.stats().host.copy_in_pages > before
    req = e.table.requests[rid]
    assert req.row is not None and req.finish_reason is None  # running on restored pages
    e.cancel(rid)
    assert req.row is None and req.finish_reason == "cancelled"
    assert e.run()[rid].finish_reason == "cancelled"
    _no_leaks(e)


def test_a_pinned_prefix_outlives_a_flood():
    e = _engine(0)
    rng = np.random.default_rng(3)
    keep = [int(t) for t in rng.integers(10, 250, 48)]
    e.submit(keep + [1], max_new_tokens=2, stop_token_ids=[])
    e.run()
    assert e.pin_prefix(keep) == 48 // PAGE
    for _ in range(8):  # each fills most of the pool, evicting everything not pinned
        e.submit([int(t) for t in rng.integers(10, 250, 200)], max_new_tokens=2,
                 stop_token_ids=[])
        e.run()
    e.submit(keep + [2], max_new_tokens=2, stop_token_ids=[])
    e.run()
    assert e.stats().prefix_hit_tokens == 48  # the only hit so far
    e.unpin_prefix(keep)
    for _ in range(3):
        e.submit([int(t) for t in rng.integers(10, 250, 200)], max_new_tokens=2,
                 stop_token_ids=[])
        e.run()
    e.submit(keep + [3], max_new_tokens=2, stop_token_ids=[])
    e.run()
    assert e.stats().prefix_hit_tokens == 48  # unpinned: evicted like any other
    with pytest.raises(ValueError, match="past half the pool"):
        e.pin_prefix(list(range(PAGES * PAGE)))
    _no_leaks(e)


def test_a_refused_pin_pins_nothing_in_either_tier():
    """16 pages fit the device's pin room (half of 40) but not a 12-page host tier: the pin
    raises and neither tier keeps any of it; 24 pages, past both, neither."""
    e = _engine(12 * _engine(0).cache.kv_bytes_per_page)
    prompt = list(range(10, 10 + 24 * PAGE))
    with pytest.raises(ValueError, match="raise host_cache_bytes"):
        e.pin_prefix(prompt[:16 * PAGE])
    assert not e.prefixes.pinned and not e.prefixes.host.pinned
    with pytest.raises(ValueError, match="past the host tier's 12|past half the pool"):
        e.pin_prefix(prompt)
    assert not e.prefixes.pinned and not e.prefixes.host.pinned
    assert e.pin_prefix(prompt[:8 * PAGE]) == 8
    assert e.prefixes.pinned == e.prefixes.host.pinned and len(e.prefixes.pinned) == 8
    _no_leaks(e)


@pytest.mark.parametrize("host_bytes, lengths", [(0, [100, 60]), (1 << 20, [150] * 3)],
                         ids=["device", "tiered"])
def test_warm_up_keeps_the_prefix_cache_and_its_pins(host_bytes, lengths):
    """A cached prompt and a pinned one, then a warm-up: its placeholders' pages all go (from
    the host tier too) and both prompts hit after it. "tiered": the placeholders overflow the
    pool, evicting the cached prompt to host (it comes back from there) and their own pages
    (dropped from host after)."""
    e = _engine(host_bytes)
    rng = np.random.default_rng(5)
    cached, pinned = ([int(t) for t in rng.integers(10, 250, 40)] for _ in range(2))
    for prompt in (cached, pinned):
        e.submit(prompt + [1], max_new_tokens=2, stop_token_ids=[])
        e.run()
    assert e.pin_prefix(pinned) == 5
    before, free = e.stats(), int(e.cache.free_pages())
    e.warm_up(lengths, max_new_tokens=3)
    after = e.stats()
    assert len(e.prefixes.pinned) == 5
    if host_bytes:
        assert after.host.pages == 5 and e.prefixes.host.stats().pinned_pages == 0
        assert all(entry.salt == b"" for entry in e.prefixes.host._entries.values())
    else:
        assert after.cached_pages == before.cached_pages and int(e.cache.free_pages()) == free
    for prompt in (cached, pinned):
        hits = e.stats().prefix_hit_tokens
        e.submit(prompt + [2], max_new_tokens=2, stop_token_ids=[])
        e.run()
        assert e.stats().prefix_hit_tokens - hits == 40
    _no_leaks(e)


def test_bad_host_arguments_name_the_fix():
    lm = _lm()
    with pytest.raises(ValueError, match="host_cache_bytes"):
        paxkv.Engine(lm, cache="dense", max_seqs=2, max_len=64, host_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match="host_cache_bytes must be an int >= 0"):
        paxkv.Engine(lm, max_seqs=2, max_len=64, host_cache_bytes=-1)
    with pytest.raises(ValueError, match="raise host_cache_bytes"):
        paxkv.Engine(lm, max_seqs=2, max_len=64, host_cache_bytes=10)
    with pytest.raises(ValueError, match="prefix_cache=True"):
        paxkv.Engine(lm, max_seqs=2, max_len=64, prefix_cache=False).pin_prefix([1, 2, 3])


# -- the tier's own bookkeeping ------------------------------------------------------------
def _chain(salt: bytes, pages: list[tuple[int, ...]]) -> list[tuple]:
    """``pages``' chain as :attr:`paxkv.prefix.index.PrefixIndex.dropped` names it: (digest,
    parent digest, tokens, position, salt) per page."""
    parent, out = root_digest(salt), []
    for i, tokens in enumerate(pages):
        digest = hashlib.sha256(parent + salt + bytes(tokens)).digest()
        out.append((digest, parent, tokens, i, salt))
        parent = digest
    return out


def _put(tier: HostTier, pages: list, start: float = 0.0) -> list[int]:
    """Puts ``pages`` with K/V column j holding the value j + start."""
    n = len(pages)
    data = jnp.broadcast_to(jnp.arange(n, dtype=jnp.float32)[None, :, None] + start, (2, n, 3))
    return tier.put(pages, (data, data))


def test_a_later_copy_lands_first_when_read_first():
    """Two copies out in flight; reading the second's page lands it alone (the first stays in
    flight), then the first lands on settle; both read back their own values."""
    tier = HostTier(8, 100)
    a, b = _chain(b"", [(1,), (2,), (3,)]), _chain(b"", [(7,), (8,), (9,)])
    _put(tier, a)
    _put(tier, b, start=10.0)
    k, _ = tier.read([b[1][0]])
    np.testing.assert_array_equal(k[:, 0], 11.0)
    assert len(tier.store._pending) == 1  # a's copy: not landed by the read of b's page
    assert tier.settle(block=True) == 0
    np.testing.assert_array_equal(tier.read([a[2][0]])[1][:, 0], 2.0)


def test_in_flight_counts_pages_on_either_memory_kind():
    """Three pages of two pool arrays, still being computed (a slow step ahead of them):
    both stores report 3 in flight (pages: not the 6 arrays of pinned memory, nor numpy's 1
    transfer), then 0 once landed."""
    import jax  # noqa: PLC0415

    @jax.jit
    def slow(x):  # ~1 s of CPU: the pages are not ready when put
        s = jax.lax.fori_loop(0, 2000, lambda i, a: jnp.tanh(a @ a.T / 100.0), x).sum()
        data = jnp.broadcast_to(jnp.arange(3.0)[None, :, None], (2, 3, 3))
        return data + 0.0 * s, data - 0.0 * s

    x = jnp.ones((256, 256))
    jax.block_until_ready(slow(x))  # compiled: the next call is dispatched at once
    arrays = slow(x)
    tiers = [HostTier(4, 100, memory_kind=kind) for kind in ("pinned_host", "numpy")]
    for tier in tiers:
        assert tier.put(_chain(b"", [(1,), (2,), (3,)]), arrays) == [0, 1, 2]
    assert [t.stats().in_flight for t in tiers] == [3, 3]
    assert [t.settle(block=True) for t in tiers] == [0, 0]
    assert [t.stats().in_flight for t in tiers] == [0, 0]


def test_pinned_pages_round_trip_and_free_on_drop():
    """Pinned host memory: each page its own ``pinned_host`` buffer, read back onto the device
    padded to the width asked for; a dropped entry's buffer is gone at once."""
    tier = HostTier(4, 100, memory_kind="pinned_host")
    a = _chain(b"", [(1,), (2,), (3,)])
    _put(tier, a, start=5.0)
    assert {p[0].sharding.memory_kind for p in tier.store.pages.values()} == {"pinned_host"}
    k, v = tier.read([a[2][0], a[0][0]], width=4)
    assert k.shape == (2, 4, 3) and k.sharding.memory_kind == "device"
    np.testing.assert_array_equal(np.asarray(k)[:, :, 0], [[7.0, 5.0, 7.0, 7.0]] * 2)
    _put(tier, _chain(b"", [(9,), (8,)]))  # room: a's tail goes
    assert len(tier.store.pages) == 4 and a[2][0] not in tier
    assert tier.clear() == 4 and not tier.store.pages
    with pytest.raises(ValueError, match="memory_kind"):
        HostTier(4, 100, memory_kind="gpu")


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_lru_drops_leaves_only_so_every_entry_stays_reachable():
    tier = HostTier(4, 100)
    a = _chain(b"", [(1,), (2,), (3,)])
    b = _chain(b"", [(9,), (8,), (7,)])
    assert _put(tier, a[::-1]) == [0, 1, 2]  # evicted tail first, as the device drops them
    assert _put(tier, b[::-1]) == [0, 1, 2]  # room by dropping a's leaves, deepest first
    assert len(tier) == 4 and tier.stats().dropped == 2
    held = {d for d, *_ in a + b if d in tier}
    for digest, parent, *_ in a + b:  # a held entry's parent is held, or the root
        assert digest not in held or parent in held or parent == root_digest(b"")
    found = tier.match([d for d, *_ in a], [1, 2, 3], 1, 0, root_digest(b""))
    assert found == [a[0][0]]  # a's first page only: its tail went
    tier.settle(block=True)
    k, v = tier.read(found)  # [layers, n, 3]: column 2 of the first put (a[0] came last)
    np.testing.assert_array_equal(k[:, 0], 2.0)
    # another salt's chain of the same tokens never matches
    other = _chain(b"x", [(1,)])
    assert tier.match([other[0][0]], [1], 1, 0, root_digest(b"x")) == []
    for _ in range(500):  # lookups queue stale LRU items; the queue stays bounded
        tier.match([d for d, *_ in b], [9, 8, 7], 1, 0, root_digest(b""))
    assert len(tier._heap) <= 4 * len(tier) + 65
    assert tier.clear() == 4 and len(tier) == 0


def test_pins_hold_and_time_to_live_ages_chains_from_their_tails():
    clock = Clock()
    tier = HostTier(3, 100, ttl_s=10.0, clock=clock)
    a = _chain(b"", [(1,), (2,)])
    b = _chain(b"", [(5,)])
    tier.pin([a[0][0]])
    _put(tier, a[::-1])
    clock.now = 5.0
    _put(tier, b)
    clock.now = 12.0  # a unused for 12 s, b for 7
    tier.expire()
    assert a[1][0] not in tier and a[0][0] in tier and b[0][0] in tier  # pinned a[0] stays
    c = _chain(b"", [(6,), (7,), (8,)])
    _put(tier, c[:2])  # full: drops b (unpinned), never the pinned a[0]
    assert a[0][0] in tier and b[0][0] not in tier
    assert _put(tier, c[2:]) == []  # the rest is pinned or c's own chain: not taken
    tier.unpin([a[0][0]])
    assert _put(tier, c[2:]) == [0] and a[0][0] not in tier
    with pytest.raises(ValueError, match="raise host_cache_bytes"):
        tier.pin([d for d, *_ in _chain(b"", [(i,) for i in range(4)])])
    with pytest.raises(ValueError, match="host_ttl_s"):
        HostTier(3, 100, ttl_s=0)


def test_drop_salt_forgets_that_salts_entries_only():
    tier = HostTier(6, 100)
    a, x = _chain(b"", [(1,), (2,)]), _chain(b"x", [(1,), (2,), (3,)])
    _put(tier, a[::-1])
    _put(tier, x[::-1])
    tier.pin([x[0][0]])
    assert tier.drop_salt("x") == 3 and len(tier) == 2 and all(d in tier for d, *_ in a)
    assert tier.stats().dropped == 0 and x[0][0] in tier.pinned  # a pin names a digest
    assert tier.drop_salt(b"y") == 0 and _put(tier, x) == [0, 1, 2]  # their slots are free


# -- the device side: restore_pages over random pools ---------------------------------------
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int8], ids=["float32", "int8"])
def test_restore_takes_the_first_free_pages_and_writes_every_array(dtype):
    """Random pools with random pages held: a restore of ``count`` pages writes each pool
    array (int8 codes and their scales too) into the first ``count`` free pages in id order,
    gives each one reference and touches nothing else; past the free pages it hands out the
    sentinel and holds nothing."""
    from paxkv.prefix import host_copies
    from paxkv.table import page_table as pt

    rng = np.random.default_rng(0)
    for trial in range(12):
        cache = paged.create(num_layers=2, num_kv_heads=1, head_dim=4, num_pages=12,
                             page_size=4, max_seqs=2, max_len=16, dtype=dtype,
                             attention_impl="xla")
        held = rng.choice(12, rng.integers(0, 12), replace=False)
        cache = dataclasses.replace(cache, table=pt.retain(
            cache.table, jnp.asarray(np.pad(held, (0, 12 - len(held)), constant_values=12),
                                     jnp.int32)))
        before = [np.asarray(a) for a in cache.pool.arrays()]
        refs = np.asarray(cache.table.ref_counts)
        data = tuple(rng.integers(-100, 100, (a.shape[0], 8) + a.shape[2:]).astype(a.dtype)
                     for a in before)
        count = int(rng.integers(0, 9))
        cache, ids = host_copies.restore_pages(cache, data, np.int32(count))
        free = np.flatnonzero(refs == 0)
        want = np.full(8, 12)
        want[:min(count, len(free))] = free[:count]
        np.testing.assert_array_equal(np.asarray(ids), want)
        got_refs = refs.copy()
        got_refs[want[want < 12]] += 1
        np.testing.assert_array_equal(np.asarray(cache.table.ref_counts), got_refs)
        for old, new, d in zip(before, cache.pool.arrays(), data):
            new, expect = np.asarray(new), old.copy()
            for j, page in enumerate(want):
                if page < 12:
                    expect[:, page] = d[:, j]
            np.testing.assert_array_equal(new[:, :12], expect[:, :12], f"trial {trial}")


# -- on a mesh: a host tier per data shard --------------------------------------------------
def worker_mesh(shapes: list[list[int]]) -> dict:
    """Runs in a subprocess with 4 forced CPU devices (``tests/test_mesh.py``'s harness): the
    agents through an engine on each ``(data, model)`` mesh with a host tier, checked after
    every turn, against one roomy device without one."""
    from test_mesh import _start, shard_problems  # noqa: PLC0415
    from test_mesh_model import tiny_tp_lm  # noqa: PLC0415

    from paxkv.scale import mesh as pmesh  # noqa: PLC0415

    _start()
    lm, out = tiny_tp_lm(), {}
    ref = paxkv.Engine(lm, max_seqs=4, max_len=MAX_LEN, page_size=PAGE, num_pages=200,
                       prefix_cache=False, prefill_chunk=64)
    out["ref"] = _agents(ref, agents=6, turns=3)
    for data, model in shapes:
        e = paxkv.Engine(lm, mesh=pmesh.make_mesh(data, model), max_seqs=4, max_len=MAX_LEN,
                         page_size=PAGE, num_pages=2 * PAGES, prefill_chunk=64,
                         host_cache_bytes=1 << 21)
        tokens = _agents(e, agents=6, turns=3)
        held = [ix.pages() for ix in e.prefixes.shards]
        host = e.stats().host
        problems = shard_problems(e.cache, held)
        e.clear_prefix_cache()
        free = [int(x) for x in e.cache.shard_free_pages()]
        out[f"{data}x{model}"] = dict(
            tokens=tokens, problems=problems, free=free, pages=e.cache.pages_per_shard,
            copy_in=[h.copy_in_pages for h in [t.stats() for t in e.prefixes.hosts]],
            copy_out=host.copy_out_pages, host_after=e.stats().host.pages)
    return out


@pytest.mark.devices
def test_each_data_shard_keeps_its_own_host_tier():
    """(2, 1) and (2, 2) meshes (the model axis splits the kv heads each device restores):
    the agents' tokens equal one device's, pages come back from host in every shard, ref
    counts equal each shard's tables plus its index, shardings stay put and clearing frees
    every shard's pages and host tier."""
    from test_mesh import run_worker  # noqa: PLC0415

    found = run_worker("mesh", [[2, 1], [2, 2]], devices=4, timeout=600,
                       module="test_host_tier")
    for shape in ("2x1", "2x2"):
        got = found[shape]
        assert got["tokens"] == found["ref"], shape
        assert got["problems"] == [], (shape, got["problems"])
        assert all(n > 0 for n in got["copy_in"]), (shape, got["copy_in"])
        assert got["free"] == [got["pages"]] * 2 and got["host_after"] == 0, (shape, got)
