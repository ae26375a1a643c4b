"""What the entry points refuse, and what they say to pass instead; defaults that fit.

``paxkv.generate``, ``Engine.submit`` and ``paxkv.score`` check token ids in one place
(:func:`paxkv.engine.setup.token_ids`): float or bool ids are refused, never truncated; a flat
list where a list of prompts belongs, an empty prompt list, text for a model without a
tokenizer, a single int or a nested list each get a ``ValueError`` (a ``TypeError`` for what is
no list at all) naming what to pass. Integer lists, numpy and JAX integer arrays keep working.
The default ``max_seqs`` fits a mesh's data axis, and ``Engine.stats()`` counts the pages the
prefix cache keeps as reclaimable, so free + reclaimable is the whole pool once every request
has ended. All on the tiny random model (``tests/tiny.py``); the mesh run on forced CPU devices
in a subprocess (``devices``).
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import paxkv
from paxkv.engine import setup
from tiny import tiny_lm


@pytest.fixture(scope="module")
def tiny():
    return tiny_lm()


@pytest.fixture(scope="module")
def engine(tiny):
    """Only ever handed bad prompts: nothing is queued, so nothing compiles."""
    return paxkv.Engine(tiny, max_seqs=2, max_len=32, page_size=4)


def without_tokenizer(lm):
    """``lm``'s sizes, params and forward: a :class:`paxkv.Model` with no ``encode``."""
    return types.SimpleNamespace(num_layers=lm.num_layers, num_kv_heads=lm.num_kv_heads,
                                 head_dim=lm.head_dim, vocab_size=lm.vocab_size,
                                 params=lm.params, forward=lm.forward)


FLOATS_AND_BOOLS = {
    "float list": [5.7, 17.2],
    "numpy float": np.array([5.7, 17.2]),
    "jax float": jnp.array([5.7, 17.2]),
    "integral floats": [5.0, 17.0],
    "bool list": [True, False],
    "numpy bool": np.array([True, False]),
    "bool among ints": [5, True],
}


@pytest.mark.parametrize("name", list(FLOATS_AND_BOOLS))
def test_float_and_bool_token_ids_are_refused_not_truncated(tiny, engine, name):
    ids = FLOATS_AND_BOOLS[name]
    with pytest.raises(ValueError, match="prompt 0 holds .*pass a list of int token ids"):
        paxkv.generate(tiny, [ids], max_new_tokens=2)
    with pytest.raises(ValueError, match="the prompt holds .*pass a list of int token ids"):
        engine.submit(ids, max_new_tokens=2)
    with pytest.raises(ValueError, match="request 0's context holds .*int token ids"):
        paxkv.score(tiny, [(ids, [3])])
    with pytest.raises(ValueError, match="request 0's continuation holds .*int token ids"):
        paxkv.score(tiny, [([3], ids)])
    with pytest.raises(ValueError, match="prompt 0 holds .*pass a list of int token ids"):
        paxkv.beam_search(tiny, [ids], beam_width=2, max_new_tokens=2)
    assert not engine.has_work()


def test_integer_arrays_and_numpy_ints_give_the_list_s_tokens(tiny):
    ids = [5, 17, 42, 99]
    forms = [ids, tuple(ids), np.array(ids), np.array(ids, np.uint8), jnp.array(ids),
             [np.int64(5), 17, jnp.int32(42), 99]]
    got = paxkv.generate(tiny, forms + [np.array([ids, ids])[1]], max_new_tokens=3,
                         stop_token_ids=[], page_size=4, max_seqs=8)
    assert all(r.prompt_ids == ids and r.token_ids == got[0].token_ids for r in got)
    batch = paxkv.generate(tiny, np.array([ids, ids]), max_new_tokens=3, stop_token_ids=[],
                           page_size=4, max_seqs=8)  # a 2-D int array: one prompt a row
    assert [r.token_ids for r in batch] == [got[0].token_ids] * 2
    engine = paxkv.Engine(tiny, max_seqs=2, max_len=32, page_size=4)
    rid = engine.submit(jnp.array(ids), max_new_tokens=3, stop_token_ids=[])
    assert engine.run()[rid].token_ids == got[0].token_ids
    want = paxkv.score(tiny, [(ids[:2], ids[2:])], max_seqs=8)[0].logprob
    for ctx, cont in ((np.array(ids[:2]), jnp.array(ids[2:])), ((5, np.int32(17)), [42, 99])):
        assert paxkv.score(tiny, [(ctx, cont)], max_seqs=8)[0].logprob == want


@pytest.mark.parametrize("prompts, error, match", [
    ([], ValueError, r"prompts is empty: pass a list of at least one prompt"),
    ([5, 17, 42], ValueError, r"flat list of numbers: pass a list of prompts, \[\[5, 17, 42\]\]"),
    (np.array([5, 17, 42]), ValueError, r"flat list .* \[\[5, 17, 42\]\]"),
    ([5.7, 17.2], ValueError, r"flat list .* \[\[5.7, 17.2\]\]"),
    ("Hello", TypeError, r"one string: pass a list of prompts, \['Hello'\]"),
    ([[5, [17]]], ValueError, r"prompt 0 is not a flat list of token ids"),
    ([[[5, 17]]], ValueError, r"prompt 0 is nested \(shape \(1, 2\)\)"),
    ({"a": 1}, TypeError, r"prompts must be a list of prompts"),
])
def test_generate_names_what_to_pass(tiny, prompts, error, match):
    with pytest.raises(error, match=match):
        paxkv.generate(tiny, prompts, max_new_tokens=2)


def test_text_for_a_model_without_a_tokenizer_asks_for_token_ids(tiny):
    bare = without_tokenizer(tiny)
    with pytest.raises(ValueError, match=r"prompt 1 is text, but this model .* has no "
                                         r"tokenizer \(encode\): pass token ids"):
        paxkv.generate(bare, [[5, 17], "Hello"], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"request 0 is text, .* no tokenizer"):
        paxkv.score(bare, [("The sky is", " blue")])
    with pytest.raises(ValueError, match=r"text 0 is text, .* no tokenizer"):
        paxkv.score_rolling(bare, ["Hello"], max_length=8, prefix_token=1)


@pytest.mark.parametrize("prompt, match", [
    (5, r"the prompt is a single int: pass a list of int token ids, e.g. \[5, 17, 42\]"),
    ([[5, 17]], r"the prompt is nested \(shape \(1, 2\)\)"),
    ("The sky is", r"the prompt is a string: pass a list of int token ids .*encode\(text\)"),
    ([], r"the prompt is empty"),
])
def test_submit_names_what_to_pass(engine, prompt, match):
    with pytest.raises(ValueError, match=match):
        engine.submit(prompt, max_new_tokens=2)
    assert not engine.has_work()


def test_score_names_what_to_pass(tiny):
    with pytest.raises(TypeError, match=r"request 0 is not a \(context, continuation\) pair: "
                                        r"5; pass a list of pairs"):
        paxkv.score(tiny, [5, 17])
    with pytest.raises(TypeError, match="pass a list of pairs"):
        paxkv.score(tiny, ("The sky is", " blue"))  # one pair, not a list of them
    with pytest.raises(ValueError, match=r"request 0's context is a single int"):
        paxkv.score(tiny, [(5, [17])])


def fake_mesh(data: int) -> Mesh:
    """A ``(data, 1)`` mesh of one device repeated: enough for reading its axis sizes."""
    return Mesh(np.array([jax.devices()[0]] * data).reshape(data, 1), ("data", "model"))


def test_the_default_max_seqs_fits_the_data_axis():
    assert setup.default_max_seqs(None) == setup.DEFAULT_MAX_SEQS == 32
    assert [setup.default_max_seqs(None, fake_mesh(d)) for d in (1, 2, 3, 6, 8, 64)] == [
        32, 32, 33, 36, 32, 64]
    assert setup.default_max_seqs(10, fake_mesh(6)) == 10  # the caller's own: checked later


def test_after_every_request_free_plus_reclaimable_is_the_pool(tiny):
    """With the prefix cache on (the default), the prompts' full pages stay cached after
    their requests end: free_pages < num_pages, but those pages are reclaimable (only the
    index holds them), so free + reclaimable == num_pages. A held request's pages are not
    reclaimable until it is cancelled."""
    engine = paxkv.Engine(tiny, max_seqs=4, max_len=48, page_size=4)
    system = list(range(10, 30))  # 5 full pages shared by every prompt
    for i in range(3):
        engine.submit(system + [40 + i, 50 + i], max_new_tokens=3, stop_token_ids=[])
    held = engine.submit(list(range(60, 73)), max_new_tokens=2, stop_token_ids=[], hold=True)
    engine.run()
    stats = engine.stats()
    assert stats.cached_pages > 0 and stats.free_pages < stats.num_pages
    assert 0 < stats.reclaimable_pages <= stats.cached_pages
    assert stats.available_pages == stats.free_pages + stats.reclaimable_pages < stats.num_pages
    engine.cancel(held)  # its row's pages: free, or (its full prompt pages) reclaimable
    stats = engine.stats()
    assert stats.free_pages < stats.num_pages
    assert stats.free_pages + stats.reclaimable_pages == stats.num_pages == stats.available_pages
    assert stats.reclaimable_pages == stats.cached_pages == stats.used_pages
    assert engine.clear_prefix_cache() == stats.cached_pages
    stats = engine.stats()
    assert (stats.free_pages, stats.reclaimable_pages) == (stats.num_pages, 0)


def worker_mesh_defaults() -> dict:
    """In a subprocess on 6 CPU devices: ``generate`` and an ``Engine`` on a (6, 1) mesh with
    the default ``max_seqs``, and the engine's pages once its requests end."""
    from test_mesh import _start  # noqa: PLC0415

    _start()
    from paxkv.scale import mesh  # noqa: PLC0415

    lm, m = tiny_lm(), mesh.make_mesh(6, 1)
    out = paxkv.generate(lm, [[5, 17, 42]], max_new_tokens=2, stop_token_ids=[], mesh=m)
    engine = paxkv.Engine(lm, mesh=m, max_len=32, page_size=4)
    for i in range(2):
        engine.submit(list(range(10, 22)) + [40 + i], max_new_tokens=2, stop_token_ids=[])
    engine.run()
    stats = engine.stats()
    return dict(tokens=out[0].token_ids, max_seqs=engine.cache.max_seqs,
                num_pages=stats.num_pages, free=stats.free_pages,
                reclaimable=stats.reclaimable_pages)


@pytest.mark.devices
def test_mesh_defaults_fit_a_data_axis_of_six():
    from test_mesh import run_worker  # noqa: PLC0415

    got = run_worker("mesh_defaults", devices=6, module="test_bad_input")
    assert len(got["tokens"]) == 2 and got["max_seqs"] == 36
    assert got["reclaimable"] > 0 and got["free"] + got["reclaimable"] == got["num_pages"]


def test_beam_search_runs_with_rank_promotion_raising(tiny):
    """No silent rank promotion in beam selection: the stop-token test broadcast ``[P, K, 1]``
    against ``[S]`` and raised under ``jax.numpy_rank_promotion("raise")``."""
    with jax.numpy_rank_promotion("raise"):
        beams = paxkv.beam_search(tiny, [[5, 6, 7]], beam_width=2, max_new_tokens=2,
                                  stop_token_ids=[3])
    assert len(beams[0]) == 2
