"""Paged attention and KV-page kernels for JAX: Mosaic GPU Pallas kernels and their jnp oracles.

Every attention function takes ``q, k_pages, v_pages, block_tables, lengths`` with pages laid
out ``[num_pages, num_kv_heads, page_size, head_dim]``; the kernels (and ``write_kv``) also take
a whole ``[num_layers, num_pages, ...]`` pool with ``layer=``, read inside the kernel, so no
layer is sliced (copied) out of it. The attention functions take an optional sliding
``window=`` (an int32 scalar, may be traced: each query sees its last ``window`` keys). The
kernels run on Hopper-class GPUs, or on CPU with ``interpret=True`` (slow; for tests).
Both contractions on tensor cores (WGMMA), for bfloat16 / float16 pages, are in
:mod:`pallas_kernels.tensor_cores` (imported from there: a cache loads them only when made
with ``attention_impl="pallas_mma"``); not yet the caches' default: they wait for a GPU
measurement.

The names below load their module on first use (PEP 562): ``import pallas_kernels``, and the
storage format a CPU cache needs (``from pallas_kernels import quant, kv_storage``), load no
Pallas and no Mosaic GPU; ``pallas_kernels.paged_decode_attention`` loads its kernel.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {  # public name -> the submodule that defines it
    "copy_pages": "kv_write",
    "copy_pages_reference": "kv_write",
    "dense_attention_reference": "reference",
    "paged_decode_attention": "paged_decode",
    "paged_decode_attention_reference": "reference",
    "paged_prefill_attention": "paged_prefill",
    "paged_prefill_attention_reference": "reference",
    "write_kv": "kv_write",
    "write_kv_reference": "kv_write",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'pallas_kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"pallas_kernels.{home}"), name)
    globals()[name] = value  # later reads skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
