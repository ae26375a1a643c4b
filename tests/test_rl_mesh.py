"""``Engine.update_params`` on a ``(data, model)`` mesh of forced CPU devices: weights already
laid out as the engine lays them (the model axis split by the tensor-parallel rules) are taken
as they are, uncopied; host arrays and other layouts are placed once; neither compiles a step
again (an update of weights laid out as the engine's compiles nothing at all), and the tokens
after an update of the same values equal those before.

Same harness as ``tests/test_mesh.py`` (a subprocess with ``JAX_NUM_CPU_DEVICES`` set, JSON
back)."""

from __future__ import annotations

import pytest

from test_mesh import _start, run_worker

pytestmark = pytest.mark.devices  # `make test` runs it, `make test-fast` not


def worker_updates() -> dict:
    _start()
    import warnings  # noqa: PLC0415

    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    import paxkv  # noqa: PLC0415
    from paxkv.scale.mesh import make_mesh  # noqa: PLC0415
    from test_mesh_model import tiny_tp_lm  # noqa: PLC0415

    warnings.simplefilter("default")  # placing host arrays may warn about donation elsewhere
    lm = tiny_tp_lm()
    mesh = make_mesh(2, 2)
    engine = paxkv.Engine(lm, mesh=mesh, max_seqs=4, max_len=32, page_size=4, num_pages=24,
                          compile_cache=False)
    prompt = [5, 17, 99, 3, 250, 7, 7, 1, 42]

    def tokens() -> list[int]:
        rid = engine.submit(prompt, max_new_tokens=6, stop_token_ids=[])
        return engine.run()[rid].token_ids

    first = tokens()
    compiled = engine.stats().compiles.compiles
    laid_out = jax.tree.map(lambda x: x.copy(), engine.params)  # the engine's own layout
    taken = engine.update_params(laid_out)
    same_arrays = all(a is b for a, b in zip(jax.tree.leaves(engine.params),
                                             jax.tree.leaves(laid_out)))
    after_taken = tokens()
    taken_compiles = engine.stats().compiles.compiles - compiled
    host = engine.update_params(jax.tree.map(np.asarray, lm.params))
    after_host = tokens()
    one_device = jax.tree.map(lambda x: jax.device_put(x, jax.devices()[0]), lm.params)
    moved = engine.update_params(one_device)
    after_moved = tokens()
    shardings = [str(x.sharding.spec) for x in jax.tree.leaves(engine.params)]
    want = [str(x.sharding.spec) for x in jax.tree.leaves(laid_out)]
    return dict(first=first, after=[after_taken, after_host, after_moved],
                placed=[len(taken.placed), len(host.placed), len(moved.placed)],
                leaves=len(jax.tree.leaves(lm.params)), same_arrays=same_arrays,
                compiles=taken_compiles,
                shardings_kept=shardings == want,
                split=sum("model" in s for s in want))


@pytest.mark.slow  # a subprocess on 4 forced devices (~30 s)
def test_updates_on_a_mesh_take_laid_out_weights_and_place_the_rest():
    found = run_worker("updates", devices=4, module="test_rl_mesh")
    assert found["same_arrays"] and found["placed"][0] == 0  # taken as they are
    assert found["placed"][1] == found["leaves"] == found["placed"][2]  # placed once each
    assert found["split"] > 0 and found["shardings_kept"]  # still split over "model"
    assert found["compiles"] == 0  # placing others may compile a transfer, never a step
    assert all(t == found["first"] for t in found["after"]), found
