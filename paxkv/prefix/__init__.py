"""The prefix cache: a chained-hash index of full pages (:mod:`index`, plain Python) and the
jitted operations that attach a row to stored pages and keep the index's holds on them, on one
device or per data shard (:mod:`holds`). The engine keeps the two in step
(:mod:`paxkv.engine.prefix_sharing`).

May import: :mod:`paxkv.core`, :mod:`paxkv.table`, :mod:`paxkv.cache`, :mod:`paxkv.scale`.
Must not import the engine.
"""
