"""The prefix cache: a chained-hash index of full pages (:mod:`index`, plain Python), the same
over a layer-grouped cache with a page per group and window-aware hits (:mod:`window_index`),
and the jitted operations that attach a row to stored pages and keep the index's holds on
them, on one device, per data shard or per layer group (:mod:`holds`). The engine keeps the two in step
(:mod:`paxkv.engine.prefix_sharing`).

May import: :mod:`paxkv.core`, :mod:`paxkv.table`, :mod:`paxkv.cache`, :mod:`paxkv.scale`.
Must not import the engine.
"""
