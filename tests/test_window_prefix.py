"""The window-aware prefix cache (:mod:`paxkv.prefix.window_index`) and the engine on it.

A hypothesis state machine drives the index alone (host only, so thousands of operations run
in seconds) against a plain model: a dict from each cached block (the tokens up to its end,
and its salt) to the page each group holds for it, kept from what every call returns. After
every operation the index names exactly the model's pages, each window group holds at most
its budget, and every lookup is a hit the cache can serve (each group's pages from its first
block on, the right first block, no page past the end) and is at least as long as the longest
whole-page prefix the model says every group can serve. Evictions drop only pages nobody
else holds, never a protected one, as many as ``evictable`` counted.

Then the engine, on tiny models with window layers: a shared system prompt followed by
suffixes longer than the window hits, with the same tokens as with no prefix cache, and
every page is back after ``clear_prefix_cache``.
"""

from __future__ import annotations

import sys

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule, run_state_machine_as_test)

from paxkv.core.buckets import cdiv
from paxkv.prefix.window_index import GroupHit, WindowPrefixIndex

CONFIGS = (((None, 6), 2, 6), ((None, 5, 8), 3, 8), ((6,), 2, 10), ((None, 4), 4, 0))
SALTS = (None, "b")
HITS: list[bool] = []  # lookups the machine made: served or not


def first_block(window: int | None, length: int, ps: int) -> int:
    return 0 if window is None else max(length - window + 1, 0) // ps


class WindowIndexMachine(RuleBasedStateMachine):
    @initialize(config=st.sampled_from(CONFIGS))
    def setup(self, config) -> None:
        self.windows, self.ps, self.budget = config
        self.ix = WindowPrefixIndex(self.ps, self.windows, self.budget)
        self.groups = len(self.windows)
        self.next_page = [0] * self.groups
        self.model: dict[tuple, list[int]] = {}  # (salt, tokens to block end) -> page per group
        self.others: list[set[int]] = [set() for _ in self.windows]  # pages a "row" also holds
        self.ops = 0
        self.seen: list[tuple] = []  # inserted prompts: (tokens, window end block, salt)

    # -- what the index holds, as the model says ---------------------------------------------
    def _apply(self, key_pages: dict[tuple, list[int]], taken, dropped) -> None:
        for g in range(self.groups):
            for page in taken[g]:
                key = next(k for k, p in key_pages.items() if p[g] == page)
                self.model.setdefault(key, [-1] * self.groups)[g] = page
            for page in dropped[g]:
                key = next(k for k, p in self.model.items() if p[g] == page)
                self.model[key][g] = -1
        self.model = {k: p for k, p in self.model.items() if any(x >= 0 for x in p)}

    def _refs(self) -> list[np.ndarray]:
        refs = [np.zeros(max(self.next_page[g], 1), np.int64) for g in range(self.groups)]
        for g in range(self.groups):
            for page in self.ix.group_pages(g):
                refs[g][page] += 1 + (page in self.others[g])
        return refs

    @rule(salt=st.sampled_from(SALTS), data=st.data())
    def insert(self, salt, data) -> None:
        ps = self.ps
        tokens = data.draw(st.lists(st.integers(0, 2), min_size=ps, max_size=6 * ps))
        blocks = len(tokens) // ps
        pages, key_pages = [[-1] * blocks for _ in self.windows], {}
        # a window group held the blocks of one chunk's window; a global group all of them
        end = data.draw(st.integers(1, blocks))
        for g, w in enumerate(self.windows):
            lo = 0 if w is None else first_block(w, (end - 1) * ps, ps)
            for b in range(lo, blocks if w is None else end):
                pages[g][b], self.next_page[g] = self.next_page[g], self.next_page[g] + 1
                if data.draw(st.booleans()):
                    self.others[g].add(pages[g][b])
        for b in range(blocks):
            key_pages[(salt, tuple(tokens[:(b + 1) * ps]))] = [pages[g][b] for g in
                                                                 range(self.groups)]
        taken, dropped = self.ix.insert(tokens, pages, salt)
        self.seen.append((tokens, end, salt))
        self._apply(key_pages, taken, dropped)
        self.ops += 1

    @rule(salt=st.sampled_from(SALTS), data=st.data())
    def lookup(self, salt, data) -> None:
        ps = self.ps
        tokens = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=6 * ps))
        limit = data.draw(st.integers(0, len(tokens)))
        if self.seen and data.draw(st.booleans()):  # a cached prompt to its window's end
            seen, end, salt = data.draw(st.sampled_from(self.seen))
            tokens, limit = seen[:end * ps] + tokens, end * ps
        hit = self.ix.match(tokens, salt, max_tokens=limit)
        HITS.append(hit.num_tokens > 0)
        assert isinstance(hit, GroupHit) and hit.num_tokens <= limit
        best = 0  # the longest whole-page prefix every group can serve, by the model
        for length in range(ps, limit + 1, ps):
            keys = [(salt, tuple(tokens[:(b + 1) * ps])) for b in range(length // ps)]
            if all(k in self.model and self.model[k][g] >= 0
                   for g, w in enumerate(self.windows)
                   for k in keys[first_block(w, length, ps):]):
                best = length
        assert hit.num_tokens >= best, (hit, best)
        if not hit.num_tokens:
            assert hit.groups == () and hit.pages == ()
            return
        blocks = cdiv(hit.num_tokens, ps)
        for g, w in enumerate(self.windows):
            first = first_block(w, hit.num_tokens, ps)
            assert hit.first[g] == first and len(hit.groups[g]) == blocks
            assert all(p == -1 for p in hit.groups[g][:first])
            for b in range(first, blocks):
                page = hit.groups[g][b]
                assert page in self.ix.group_pages(g)
                key = next(k for k, p in self.model.items() if p[g] == page)
                want = tuple(tokens[b * ps:min((b + 1) * ps, hit.num_tokens)])
                assert key[0] == salt and key[1][b * ps:b * ps + len(want)] == want
                assert key[1][:b * ps] == tuple(tokens[:b * ps])
        assert hit.pages == hit.groups[0]
        self.ops += 1

    @precondition(lambda self: len(self.ix))
    @rule(num=st.integers(1, 6), data=st.data())
    def evict(self, num, data) -> None:
        refs = self._refs()
        protect = data.draw(st.lists(st.sampled_from(self.ix.pages()), max_size=3))
        room = self.ix.evictable(refs, protect)
        before = [set(self.ix.group_pages(g)) for g in range(self.groups)]
        dropped = self.ix.evict(num, refs, protect)
        assert len(dropped[0]) == min(num, room)
        for page in dropped[0]:
            assert refs[0][page] == 1 and page not in protect
        for g in range(self.groups):
            assert set(dropped[g]) <= before[g]
        self._apply({}, [[] for _ in self.windows], dropped)
        self.ops += 1

    @rule()
    def clear(self) -> None:
        pages = self.ix.clear()
        assert [sorted(p) for p in pages] == [
            sorted(v[g] for v in self.model.values() if v[g] >= 0) for g in range(self.groups)]
        self.model, self.seen = {}, []

    @invariant()
    def index_names_the_models_pages(self) -> None:
        if not hasattr(self, "ix"):
            return
        for g, w in enumerate(self.windows):
            held = self.ix.group_pages(g)
            assert held == sorted(v[g] for v in self.model.values() if v[g] >= 0)
            if g and w is not None:
                assert len(held) <= self.budget
        assert len(self.ix) == len(self.ix.group_pages(0))


def test_window_index_state_machine() -> None:
    """Thousands of random inserts (a window group holding one chunk's window), lookups,
    evictions and clears against the plain model (module docstring)."""
    total = []

    class Counted(WindowIndexMachine):
        def teardown(self) -> None:
            total.append(getattr(self, "ops", 0))

    run_state_machine_as_test(Counted, settings=settings(
        max_examples=150, stateful_step_count=50, deadline=None, derandomize=True,
        database=None, suppress_health_check=list(HealthCheck)))  # seeded: random runs saw 88
    assert sum(total) >= 1_000, sum(total)
    assert sum(HITS) >= 100, (sum(HITS), len(HITS))  # lookups are served, often


def test_the_docstring_example_hits_where_every_window_is_whole() -> None:
    """Page 4, window 8: block 5's window page is gone, so 28 and 24 tokens cannot be
    served and the hit is 20 (blocks 3..4 in the window group, 0..4 in the global one)."""
    ix = WindowPrefixIndex(4, (None, 8), budget=10)
    tokens = list(range(100, 128))
    window = [-1, -1, -1, 13, 14, -1, 16]
    taken, dropped = ix.insert(tokens, [list(range(7)), window])
    assert taken == [list(range(7)), [13, 14, 16]] and dropped == [[], []]
    hit = ix.match(tokens + [0], max_tokens=28)
    assert (hit.num_tokens, hit.first) == (20, (0, 3))
    assert hit.groups == ((0, 1, 2, 3, 4), (-1, -1, -1, 13, 14))


def test_a_window_group_never_holds_more_than_its_budget() -> None:
    """Past the budget the least recently used window pages go (the earliest block first
    among equals); the global pages stay."""
    ix = WindowPrefixIndex(2, (None, 4), budget=3)
    taken, dropped = ix.insert(list(range(10)), [list(range(5)), [10, 11, 12, 13, 14]])
    assert taken[1] == [10, 11, 12, 13, 14] and dropped == [[], [10, 11]]
    assert ix.group_pages(1) == [12, 13, 14] and ix.group_pages(0) == list(range(5))
    hit = ix.match(list(range(8)) + [99], max_tokens=8)  # window blocks 2..3: pages 12, 13
    assert hit.num_tokens == 8 and hit.groups[1] == (-1, -1, 12, 13)
    _, dropped = ix.insert([7] * 4, [[20, 21], [30, 31]])
    assert dropped[1] == [14, 12]  # block 4 was not used since; then the earliest block


# -- the engine ------------------------------------------------------------------------------
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))


def _serve(lm, prompts, poisoned: bool = False, **kw):
    """Each prompt alone through one engine; ``poisoned``: on a grouped cache whose pages
    start as NaN and are never scrubbed (a read of a page a row does not hold, a sentinel
    included, would poison its tokens)."""
    import paxkv  # noqa: PLC0415
    from paxkv.cache import grouped, layer_groups  # noqa: PLC0415

    sizes = dict(max_seqs=4, max_len=96, page_size=4)
    if poisoned:
        index = layer_groups.prefix_index_pages(lm.layer_windows, **sizes)
        kw["cache"] = grouped.create(
            num_layers=lm.num_layers, num_kv_heads=lm.num_kv_heads, head_dim=lm.head_dim,
            num_pages=kw.pop("num_pages", 96), layer_windows=lm.layer_windows, step_tokens=16,
            index_pages=index if kw.get("prefix_cache", True) else 0, fill=float("nan"),
            scrub=False, **sizes)
    engine = paxkv.Engine(lm, prefill_chunk=8, prefill_tokens=16, **sizes, **kw)
    out = []
    for p in prompts:
        rid = engine.submit(p, max_new_tokens=6, stop_token_ids=[])
        out.append(engine.run()[rid].token_ids)
    return engine, out


@pytest.mark.parametrize("windows", [(6, None, 5), (6, 6)])
def test_a_shared_system_prompt_hits_through_window_layers(windows) -> None:
    """A 30-token system prompt, then suffixes past the window: each later request hits the
    system prompt's 7 whole pages (its window pages were indexed at a prefill chunk's
    end before they slid out), with the tokens of an engine without a prefix cache; every
    window group keeps at most its budget; every page is back after the clear; NaN in every
    page at the start, never scrubbed, reaches no token. (6, 6): a model whose every layer
    slides (no global group)."""
    from tiny import tiny_lm  # noqa: PLC0415

    lm = tiny_lm(scale=1.0, windows=windows)
    system = list(range(10, 40))
    prompts = [system + [50 + i] * (7 + 2 * i) for i in range(4)]
    plain, want = _serve(lm, prompts, prefix_cache=False)
    engine, got = _serve(lm, prompts, poisoned=True)
    assert got == want
    stats = engine.stats()
    assert stats.prefix_hit_tokens >= 3 * 28, stats.prefix_hit_tokens  # 7 pages each at least
    ix = engine.prefixes.index
    for g in range(1, len(engine.cache.tables)):
        assert len(ix.group_pages(g)) <= engine.cache.index_pages
    assert stats.kv_bytes_used > 0 and stats.cached_pages == len(ix)
    engine.clear_prefix_cache()
    assert all(int(jnp.sum(t.ref_counts)) == 0 for t in engine.cache.tables)
    assert engine.stats().kv_bytes_used == 0


def test_admission_evicts_cached_pages_of_a_window_model_for_room() -> None:
    """A pool of 20 global pages: the cached prompts' pages are evicted for later requests
    (tokens as without a prefix cache), and nothing leaks."""
    from tiny import tiny_lm  # noqa: PLC0415

    lm = tiny_lm(scale=1.0, windows=(6, None, 5))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 200, 40).tolist() for _ in range(5)]
    prompts.append(prompts[4][:36] + [3, 4, 5])
    _, want = _serve(lm, prompts, prefix_cache=False, num_pages=20)
    engine, got = _serve(lm, prompts, num_pages=20, poisoned=True)
    assert got == want
    stats = engine.stats()
    assert stats.evictions > 0 and stats.prefix_hit_tokens > 0
    engine.clear_prefix_cache()
    assert all(int(jnp.sum(t.ref_counts)) == 0 for t in engine.cache.tables)


def test_warm_up_keeps_a_window_models_cached_prompts() -> None:
    """A warm-up after a cached system prompt: every group's references are as before (the
    placeholders' pages all went, the prompt's stayed) and the prompt still hits."""
    from tiny import tiny_lm  # noqa: PLC0415

    lm = tiny_lm(scale=1.0, windows=(6, None, 5))
    system = list(range(10, 40))
    engine, _ = _serve(lm, [system + [50] * 9])
    refs = [np.asarray(t.ref_counts).tolist() for t in engine.cache.tables]
    engine.warm_up([30, 21], max_new_tokens=3)
    assert [np.asarray(t.ref_counts).tolist() for t in engine.cache.tables] == refs
    engine.submit(system + [60] * 9, max_new_tokens=2, stop_token_ids=[])
    engine.run()
    assert engine.stats().prefix_hit_tokens >= 28  # the system prompt's 7 pages


def test_pins_are_refused_on_a_window_model_naming_what_to_do() -> None:
    """A window group keeps a budget of pages, not whole prompts: pins are refused with a
    ValueError that names the alternatives, and nothing changes."""
    from tiny import tiny_lm  # noqa: PLC0415

    engine, _ = _serve(tiny_lm(scale=1.0, windows=(4, None)), [list(range(10, 30))])
    cached = len(engine.prefixes)
    for call in (engine.pin_prefix, engine.unpin_prefix):
        with pytest.raises(ValueError, match="sliding-window.*submit_prefix"):
            call(list(range(10, 30)))
    assert len(engine.prefixes) == cached


def test_attach_from_a_first_block_holds_only_the_window_pages() -> None:
    """``attach(..., first)``: cells before ``first`` become the sentinel and take no
    reference; a first block past the row's last, or an unheld page from it on, fails the
    row and changes nothing. On the grouped cache a row attaches in every group or none."""
    import jax  # noqa: PLC0415

    from paxkv.cache import grouped  # noqa: PLC0415
    from paxkv.table import page_table as pt  # noqa: PLC0415

    table = pt.create(num_pages=8, page_size=4, max_seqs=2, max_pages_per_seq=4)
    table = pt.retain(table, jnp.array([5, 6]), 1)  # an index holds pages 5 and 6
    s = table.sentinel
    got, ok = pt.attach(table, jnp.array([0]), jnp.array([[-1, -1, 5, 6]]), jnp.array([15]),
                        jnp.array([2]))
    assert bool(ok[0]) and got.block_tables[0].tolist() == [s, s, 5, 6]
    assert got.ref_counts.tolist() == [0, 0, 0, 0, 0, 2, 2, 0] and int(got.lengths[0]) == 15
    for first, pages in ((4, [-1, -1, 5, 6]), (1, [-1, 3, 5, 6])):  # past the end; unheld 3
        bad, ok = pt.attach(table, jnp.array([0]), jnp.array([pages]), jnp.array([15]),
                            jnp.array([first]))
        assert not bool(ok[0])
        assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool((a == b).all()), bad, table)))

    cache = grouped.create(num_layers=2, num_kv_heads=1, head_dim=4, num_pages=8, page_size=4,
                           max_seqs=2, max_len=16, layer_windows=(None, 6), window_pages=6)
    cache = cache.retain(jnp.array([[0, 1, 2], [2, 9, 9]]), 1)
    pages = jnp.array([[[0, 1, 2, -1]], [[-1, 2, 3, -1]]])  # group 1's page 3 has no holder
    after, ok = cache.attach(jnp.array([1]), pages, jnp.array([10]), jnp.array([[0], [1]]))
    assert not bool(ok[0]) and not bool(after.tables[0].active[1])
    assert after.tables[0].ref_counts.tolist() == cache.tables[0].ref_counts.tolist()
    pages = pages.at[1, 0, 2].set(2).at[1, 0, 1].set(-1)
    after, ok = cache.attach(jnp.array([1]), pages, jnp.array([10]), jnp.array([[0], [2]]))
    assert bool(ok[0]) and after.tables[1].block_tables[1].tolist()[:3] == [6, 6, 2]


def test_eviction_reads_only_the_live_blocks() -> None:
    """Block ids are never reused; what eviction reads is sized by the blocks the index holds
    now, not by every block it ever made (a long-running engine's admissions stay O(index))."""
    ix = WindowPrefixIndex(2, (None, 4), budget=4)
    for i in range(200):
        ix.insert([i, i + 1, 7, 7], [[2 * i, 2 * i + 1], [-1, 500 + i]])
        refs = [np.ones(400, np.int64), np.ones(800, np.int64)]
        ix.evict(2, refs)
    assert len(ix) == 0 and len(ix._node_refs(np.ones(400, np.int64))) == 0
    ix.insert([1, 2, 3, 4], [[0, 1], [-1, 9]])
    assert len(ix._node_refs(np.ones(400, np.int64))) == 2
