"""The real model through the Pallas kernels: interpret mode on CPU against the XLA path, and
the CUDA lowering of one ``PagedCache.attend`` (the whole pool handed to the kernels).

Interpret mode turns every SMEM/GMEM access of a kernel into a host callback (a few ms each on
a busy CPU), and each of the model's 30 layers runs two kernels per step (``write_kv``, then
prefill or decode), so the generation is the shortest that still crosses every kernel: one
2-token prompt (causal prefill, padded to a 16-token chunk), two new tokens (one decode step,
next to an idle length-0 row). Measured on 2 shared cores at load ~11: ~100 s for the Pallas
run (~35 s of CPU), ~20 s for the XLA one, plus ~25 s to load the model; a 3-token prompt
already took ~160 s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import paxkv
from paxkv.cache import paged as paged_cache
from test_pallas_kernels import (custom_call_operands, lowered_attend, mlir_type,
                                 pool_slices)


def test_pallas_generates_the_xla_greedy_tokens(lm):
    prompt = lm.encode("Once upon")  # -> " a time"
    kw = dict(max_new_tokens=2, max_seqs=2, page_size=16, num_pages=4, prefix_cache=False)
    xla = paxkv.generate(lm, [prompt], attention_impl="xla", **kw)
    pallas = paxkv.generate(lm, [prompt], attention_impl="pallas", **kw)
    assert [r.token_ids for r in pallas] == [r.token_ids for r in xla]
    assert len(pallas[0].token_ids) == 2


def test_attend_hands_the_whole_pool_to_the_kernels(monkeypatch):
    """On the GPU path ``attend`` writes and reads the carried 5-D pool through the kernels:
    no layer is sliced out of it and no XLA scatter touches it."""
    # As on a GPU: compile, do not interpret; store bfloat16 as itself (not as bits).
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    cache = paged_cache.create(num_layers=4, num_kv_heads=2, head_dim=64, num_pages=8,
                               page_size=16, max_seqs=2, max_len=64, dtype=jnp.bfloat16,
                               attention_impl="pallas")
    assert cache.pool.k.dtype == jnp.bfloat16
    hlo = lowered_attend(cache, 1)
    pool = cache.pool.k
    operands = custom_call_operands(hlo)
    assert len(operands) == 2, "write_kv and the decode kernel"
    assert all(o.count(mlir_type(pool)) == 2 for o in operands), operands
    assert not pool_slices(hlo, pool), pool_slices(hlo, pool)
    assert "scatter" not in hlo and "dynamic_update_slice" not in hlo, "no XLA write"
