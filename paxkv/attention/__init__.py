"""The XLA attention path (every backend; the fast path on a CPU): :mod:`blocks` (masked softmax
over gathered blocks, cascade), :mod:`partials` (softmax partials and their exact merge),
:mod:`chunked` (decode over a ragged chunk list), :mod:`query_tiles` (prefill one row's query
tile at a time). The paged cache's choice among them per step is
:mod:`paxkv.cache.paged_xla`.

May import: :mod:`paxkv.core`, and the storage format of the pages
(:mod:`pallas_kernels.kv_storage`, :mod:`pallas_kernels.quant`). Must not import the page
table, the caches or anything above them.
"""
