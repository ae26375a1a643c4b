"""The model axis (kv heads, tensor parallel) of the sharded cache on forced CPU devices.

Same harness as ``tests/test_mesh.py`` (each check in a subprocess with ``JAX_NUM_CPU_DEVICES``
set, warnings as errors, JSON back). Checked: greedy tokens through :class:`paxkv.Engine`
(a tight, NaN-filled pool that preempts) and through the compiled fixed-batch loop
(``generate(loop="jit")``'s path) on meshes (4, 2) and (2, 4) with a random Llama of 4 kv
heads, and (2, 3) with the default model, equal one device's; every cache leaf keeps
its sharding and is donated (a "not usable" donation warning fails the worker); each device
holds 1 / (data x model) of the pool; a model-axis step compiles to 2 all-reduces per layer
([b, t, D] activations after the row-parallel o_proj and down_proj) plus the data-only
step's, and no all-gather; meshes and weights that do not fit name the fix; the least-loaded
shard's row is picked for a new request.
"""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest

from test_mesh import ROOT, REF_PAGES, TIGHT, _engine_run, _start, _workload, run_worker

# Forced CPU devices in subprocesses: `make test` runs these, `make test-fast` not.
pytestmark = pytest.mark.devices

TINY_MESHES = [[4, 2], [2, 4], [1, 4]]  # both axes, model only
# data only, both axes (a model-only mesh is the tiny model's (1, 4): a leg of the default
# model takes 21-33 s here, and (1, 3) checked no path that (2, 3) and (1, 4) leave out)
REAL_MESHES = [[2, 3]]  # both axes; a data axis alone: the tiny models' tests


@functools.lru_cache(maxsize=None)
def tiny_tp_lm():
    """A random Llama like ``tests/tiny.py``'s but with 8 q heads over 4 kv heads (head_dim 8,
    FFN 64), so model axes 2 and 4 split it."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from paxkv import models  # noqa: PLC0415
    from paxkv.cache.full import NoCache  # noqa: PLC0415
    from paxkv.models.config import LlamaConfig  # noqa: PLC0415
    from paxkv.models.llama import Llama  # noqa: PLC0415
    from paxkv.core.step_info import StepInfo  # noqa: PLC0415
    from tiny import Bytes  # noqa: PLC0415

    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=8, num_kv_heads=4, head_dim=8, tie_word_embeddings=True)
    step = StepInfo.make(jnp.array([4]), jnp.array([4]), 4)
    shapes = jax.eval_shape(lambda: Llama(cfg).init(
        jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32), step, NoCache()))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: jnp.asarray(rng.normal(0, 1.0, s.shape), s.dtype), shapes)
    return models.LanguageModel(cfg, params, Bytes(), "tiny-tp")


def _dims(lm, max_seqs: int = 16, max_len: int = 24) -> dict:
    return dict(num_layers=lm.num_layers, num_kv_heads=lm.num_kv_heads, head_dim=lm.head_dim,
                page_size=4, max_len=max_len, max_seqs=max_seqs)


def _fixed_batch(lm, cache, workload) -> list[list[int]]:
    """The workload as one batch through the compiled decode loop (``loop="jit"``)."""
    import paxkv  # noqa: PLC0415
    from paxkv.decoding.compiled_loop import run_fixed_batch  # noqa: PLC0415

    engine = paxkv.Engine(lm, cache=cache, prefix_cache=False)
    ids = [engine.submit(p, max_new_tokens=n, stop_token_ids=()) for p, n in workload]
    results = run_fixed_batch(engine)
    return [results[i].token_ids for i in ids]


def _placement(cache) -> dict:
    """Bytes of the pool's K each device holds; K and V of one device against
    ``kv_bytes_per_device``."""
    import jax  # noqa: PLC0415

    shards = cache.pools.k.addressable_shards
    mine = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(cache.pools))
    return dict(total=cache.pools.k.nbytes, devices=len({s.device for s in shards}),
                per_device=sorted({s.data.nbytes for s in shards}), kv_bytes=mine,
                kv_bytes_per_device=cache.kv_bytes_per_device)


def _on_meshes(lm, meshes: list[list[int]]) -> dict:
    """One device's tokens, then each mesh's: the engine on a NaN pool tight enough to preempt
    (per-step shard checks), the fixed batch on a roomy one."""
    import jax  # noqa: PLC0415

    from paxkv.scale import mesh as pmesh

    from paxkv.cache import paged as paged_cache

    from paxkv.scale import sharded_cache  # noqa: PLC0415
    from paxkv.scale import tensor_parallel  # noqa: PLC0415

    dims, work = _dims(lm), _workload()
    out = {"ref": _engine_run(lm, paged_cache.create(num_pages=REF_PAGES, **dims), False),
           "ref_fixed": _fixed_batch(lm, paged_cache.create(num_pages=REF_PAGES, **dims), work)}
    for data, model in meshes:
        mesh = pmesh.make_mesh(data, model)
        tp_lm = tensor_parallel.shard_model(lm, mesh)
        # rows split over data: 12 rows (the workload's count) where 16 does not divide
        mesh_dims = _dims(lm, 16 if 16 % data == 0 else 12)
        cache = sharded_cache.create(mesh=mesh, num_pages={1: 8, **TIGHT}[data],
                                     fill=float("nan"), **mesh_dims)
        placement = _placement(cache)  # before the engine donates the cache
        run = dict(_engine_run(tp_lm, cache, True), placement=placement,
                   donated=all(x.is_deleted() for x in jax.tree.leaves(cache)))
        roomy = sharded_cache.create(mesh=mesh, num_pages=REF_PAGES, **mesh_dims)
        run["fixed"] = _fixed_batch(tp_lm, roomy, work)
        out[f"{data}x{model}"] = run
    return out


def worker_tiny(meshes: list[list[int]]) -> dict:
    _start()
    return _on_meshes(tiny_tp_lm(), meshes)


def worker_real(meshes: list[list[int]]) -> dict:
    """The meshes, then the mesh guide's first block in the same process, so the model
    loads once (in a subprocess of its own the block took 46 s, 31 s of it its own run: the
    model axis's slow prefill, experiments/LOG.md 12-04)."""
    _start()
    from paxkv import models  # noqa: PLC0415

    return dict(_on_meshes(models.load(), meshes), docs=_docs_block())


def _docs_block() -> dict:
    """The first block of ``docs/mesh.md`` as written (its (2, 3) mesh fits in 6 devices;
    its ``models.load()`` returns the loaded model), then two requests through its engine.
    ``tests/test_docs.py`` skips this block: it needs devices JAX fixes when it starts."""
    text = (ROOT / "docs" / "mesh.md").read_text()
    block = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S)
             if "mesh.make_mesh(data=2, model=3)" in b]
    assert len(block) == 1, f"{len(block)} blocks of docs/mesh.md build that mesh"
    namespace: dict = {}
    exec(compile(block[0], "docs/mesh.md", "exec"), namespace)  # noqa: S102
    engine, lm = namespace["engine"], namespace["lm"]
    ids = [engine.submit(lm.encode(q), max_new_tokens=4) for q in ("The sky is", "Hi")]
    results = engine.run()
    return dict(lengths=[len(results[i].token_ids) for i in ids],
                free=int(engine.cache.stats().free_pages), pages=engine.cache.total_pages)


def _all_reduces(text: str) -> list[dict]:
    """Every all-reduce of a compiled module: its result type and whether it sits in the
    scanned layer body (run once per layer) or outside."""
    found = []
    for line in text.splitlines():
        if "=" in line and (" all-reduce(" in line or " all-reduce-start(" in line):
            result = line.split("=", 1)[1].split("all-reduce")[0].strip()
            result = re.sub(r"\{[\d,]*\}", "", result)  # the layout: f32[4,1,32]{2,1,0}
            found.append(dict(type=result, in_layer="/while/body" in line))
    return found


def _pool_copies(text: str, block: list[int]) -> int:
    """Copies (``copy`` ops and copy fusions) of a device's pool block (``block``: its shape,
    size-1 axes aside) in a compiled module: a step should write the pool in place."""
    def sizes(dims):
        return [d for d in dims if d != 1]
    return sum(sizes(int(x) for x in m.group(1).split(",") if x) == sizes(block)
               for m in re.finditer(r"%\S*copy\S* = \w+\[([\d,]*)\]", text))


def worker_hlo(meshes: list[list[int]]) -> dict:
    """Collectives of the compiled prefill and decode steps of the 4-kv-head model per mesh."""
    _start()
    import jax.numpy as jnp  # noqa: PLC0415

    from paxkv.scale import mesh as pmesh

    from paxkv.scale import sharded_cache

    from paxkv.core import steps

    from paxkv.scale import tensor_parallel  # noqa: PLC0415

    lm, out = tiny_tp_lm(), {}
    for data, model in meshes:
        mesh = pmesh.make_mesh(data, model)
        tp_lm = tensor_parallel.shard_model(lm, mesh)
        cache = sharded_cache.create(mesh=mesh, num_pages=64, **_dims(lm))
        s = cache.max_seqs
        rows, qlens = jnp.arange(8, dtype=jnp.int32), jnp.full((8,), 16, jnp.int32)
        block = list(cache.pools.k.addressable_shards[0].data.shape)
        found = {}
        for name, fn, rest in (
                ("prefill", steps.prefill_step, (jnp.ones((8, 16), jnp.int32), rows, qlens,
                                                 None)),
                ("decode", steps.decode_step, (jnp.ones((s,), jnp.int32),
                                               jnp.ones((s,), bool), None))):
            text = fn.lower(tp_lm.forward, tp_lm.params, cache, *rest).compile().as_text()
            found[name] = dict(counts=pmesh.count_collectives(text),
                               all_reduces=_all_reduces(text),
                               pool_copies=_pool_copies(text, block))
        out[f"{data}x{model}"] = dict(found, placement=_placement(cache), pool_block=block)
    return out


def worker_errors() -> dict:
    """Messages for a Pallas cache on a model axis and for weights that do not split."""
    _start()
    from paxkv.scale import mesh as pmesh
    from paxkv.scale import sharded_cache
    from paxkv.scale import tensor_parallel  # noqa: PLC0415

    out = {}
    lm = tiny_tp_lm()
    cases = {
        "pallas": lambda: sharded_cache.create(mesh=pmesh.make_mesh(1, 2), num_pages=8,
                                               attention_impl="pallas", **_dims(lm, 4)),
        "weights": lambda: tensor_parallel.shard_params(lm.params, pmesh.make_mesh(1, 3)),
        "rules": lambda: tensor_parallel.shard_params(
            lm.params, pmesh.make_mesh(1, 2), [(r"attention/wq$", None)]),
    }
    for name, fn in cases.items():
        try:
            fn()
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    return out


# -- tests ---------------------------------------------------------------------------------
def _check(found: dict, meshes: list[list[int]]) -> None:
    ref = found["ref"]["tokens"]
    assert len({tuple(t) for t in ref}) > 6, "the workload's tokens should vary"
    for data, model in meshes:
        run = found[f"{data}x{model}"]
        assert run["tokens"] == ref, (data, model)
        assert run["fixed"] == found["ref_fixed"], (data, model)
        assert run["preemptions"] > 0, f"({data}, {model}): the pool never ran dry"
        assert run["donated"], "the engine's steps did not donate the sharded cache"
        assert run["problems"] == [], run["problems"][:5]
        assert run["free"] == [run["pages_per_shard"]] * data
        place = run["placement"]
        assert place["devices"] == data * model
        assert place["per_device"] == [place["total"] // (data * model)]
        assert place["kv_bytes_per_device"] == place["kv_bytes"] == 2 * place["per_device"][0]


@pytest.mark.slow  # two engine + fixed-batch runs on 8 forced devices (~1-2 minutes)
def test_tiny_model_axis_meshes_match_one_device():
    """(4, 2), (2, 4) and (1, 4), 4 kv heads: one device's greedy tokens, engine and jit
    loop."""
    found = run_worker("tiny", TINY_MESHES, module="test_mesh_model")
    _check(found, TINY_MESHES)


@pytest.mark.slow
@pytest.mark.model  # the default model, 3 kv heads, on 6 forced devices
def test_default_model_on_meshes_matches_one_device_and_the_docs_block_runs():
    """(2, 3): one device's greedy tokens, engine (preempting, per-step shard checks) and jit
    loop; then the first block of ``docs/mesh.md`` serves two requests and
    frees every page."""
    found = run_worker("real", REAL_MESHES, devices=6, timeout=900, module="test_mesh_model")
    _check(found, REAL_MESHES)
    docs = found["docs"]
    assert all(1 <= n <= 4 for n in docs["lengths"])
    assert docs["free"] == docs["pages"]


def test_model_axis_step_collectives():
    """A model axis adds exactly 2 all-reduces per layer, of the [b, t, D] activations after
    the row-parallel o_proj and down_proj; everything else is the data-only step's (prefill:
    one psum of the attention output over data per layer, a few scalars outside; decode: two
    scalars outside); no all-gather, no other collective; the pool split 1 / (data x model);
    no copy of a device's pool (one kv head a device once cost 4 a layer: 14 a step here).
    """
    found = run_worker("hlo", [[8, 1], [4, 2], [2, 4], [1, 4]], module="test_mesh_model")
    for mesh in ("4x2", "2x4", "1x4"):
        data, model = map(int, mesh.split("x"))
        for step, b, t in (("prefill", 8, 16), ("decode", 16 // data, 1)):
            run, base = found[mesh][step], found["8x1"][step]["all_reduces"]
            print(mesh, step, [(a["type"], a["in_layer"]) for a in run["all_reduces"]])
            assert run["pool_copies"] == found["8x1"][step]["pool_copies"] == 0, (mesh, step)
            assert sum(run["counts"].values()) == run["counts"]["all-reduce"], run["counts"]
            layer = [a["type"] for a in run["all_reduces"] if a["in_layer"]]
            hidden = [x for x in layer if x.endswith(",32]")]
            assert hidden == [f"f32[{b},{t},32]"] * 2, (mesh, step, layer)
            assert len(layer) - 2 == sum(a["in_layer"] for a in base), (mesh, step, layer)
            outside = [a["type"] for a in run["all_reduces"] if not a["in_layer"]]
            assert outside == ([a["type"] for a in base if not a["in_layer"]] if data > 1
                               else []), (mesh, step, outside)
        place = found[mesh]["placement"]
        assert place["devices"] == data * model
        assert place["per_device"] == [place["total"] // (data * model)]
        assert place["kv_bytes_per_device"] == place["kv_bytes"] == 2 * place["per_device"][0]
        assert found[mesh]["pool_block"][2] == 4 // model  # kv heads per device


def test_model_axis_errors_name_the_fix():
    found = run_worker("errors", module="test_mesh_model")
    assert "attention_impl='xla'" in found["pallas"]
    assert found["weights"] == (
        "params/layers/attn/k_proj/kernel (2, 32, 4, 8): its axis of 4 cannot be split over "
        "the mesh's 'model' axis of 3; that axis must divide 4 (1, 2 or 4)")
    assert "no tensor-parallel rule matches" in found["rules"]


def test_pick_row_takes_the_least_loaded_shard():
    """Equal shards fill round-robin as requests queue tokens; a shard without a free row or
    with its pages promised to queued tokens is passed over; ties go to more free rows."""
    from paxkv.scale.routing import pick_row  # noqa: PLC0415 - numpy only, no devices

    free, queued, rows = [4, 4, 4, 4], [0, 0, 0, 0], list(range(8))  # 2 rows a shard
    picked = []
    for _ in range(4):
        row = pick_row(rows, 2, free, queued, page_size=4)
        picked.append(row)
        rows.remove(row)
        queued[row // 2] += 9  # 3 pages promised
    assert picked == [0, 2, 4, 6]
    assert pick_row([1, 3, 5, 7], 2, [9, 2, 2, 2], [4, 0, 0, 0], page_size=4) == 1
    assert pick_row([3, 5], 2, [9, 5, 5, 2], [0, 0, 0, 0], page_size=4) == 3  # shard 0 full
    assert pick_row([2, 3, 4], 2, [0, 5, 5, 0], [0, 0, 0, 0], page_size=4) == 2  # 2 free rows
    with pytest.raises(ValueError, match="at least one free row"):
        pick_row([], 2, [1], [0], page_size=4)
