"""The caches behind :class:`paxkv.KVCache` and the K/V arrays they own.

* :mod:`pool` — :class:`KVPool`: the fixed ``[layers, pages + 1, kv_heads, page, head_dim]``
  K/V arrays (scrub, copy-on-write copies, writes).
* :mod:`paged` — :class:`PagedCache`: the page table and the pool, attention by the Pallas
  kernels or the XLA path (:mod:`paged_xla`, which picks the path per step from the plan).
* :mod:`grouped` — :class:`GroupedPagedCache`: for a model with sliding-window layers, one
  page table per layer group (:mod:`layer_groups`) over one flat pool; a window group
  releases the pages its window has passed inside the jitted step.
* :mod:`dense` — :class:`DenseCache`: ``max_len`` slots a row, the comparison twin.
* :mod:`full` — :class:`NoCache`: the cache-less full forward the caches are tested against.

May import: :mod:`paxkv.core`, :mod:`paxkv.table`, :mod:`paxkv.attention`, and
:mod:`pallas_kernels`. Must not import the engine, scale-out or any model.
"""
