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
"""

from pallas_kernels.kv_write import copy_pages, copy_pages_reference, write_kv, write_kv_reference
from pallas_kernels.paged_decode import paged_decode_attention
from pallas_kernels.paged_prefill import paged_prefill_attention
from pallas_kernels.reference import (dense_attention_reference, paged_decode_attention_reference,
                                      paged_prefill_attention_reference)

__all__ = [
    "copy_pages",
    "copy_pages_reference",
    "dense_attention_reference",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "paged_prefill_attention",
    "paged_prefill_attention_reference",
    "write_kv",
    "write_kv_reference",
]
