"""The page table: block tables, lengths and ref counts over a fixed pool, and the pure,
vectorised operations on it (the heart of paxkv). Every operation returns a new table and a
per-row status; none raises inside jit and none touches K/V (the pool is the cache's).

* :mod:`state` — :class:`PageTable` and ``create``.
* :mod:`page_table` — ``reserve`` / ``release`` / ``fork`` / ``copy_on_write`` / ``retain`` /
  ``slot_mapping`` (and re-exports of the rest: the table's one front door).
* :mod:`alloc` — the arithmetic of one grant of pages (which free pages, in one cumsum).
* :mod:`share` — rows that point at stored pages (beam reorder, prefix attach).
* :mod:`stats` — its accounting (free, used, shared pages).

May import: :mod:`paxkv.core`. Must not import the caches, the engine or any model.
"""
