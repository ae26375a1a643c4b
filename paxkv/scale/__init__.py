"""Scale-out: a ``("data", "model")`` mesh and several processes.

* :mod:`mesh` — the mesh and per-shard calls (``shard_map`` over the data axis).
* :mod:`sharded_cache` / :mod:`sharded_attention` — the paged cache with a page table per data
  shard and kv heads on the model axis; its attention in one ``shard_map``.
* :mod:`tensor_parallel` — Megatron-style weight placement by parameter-path rules.
* :mod:`routing` — which data shard takes a new request (plain numpy; the engine and the
  scorer ask it).
* :mod:`distributed` / :mod:`launch` — several JAX processes (whole shards each, inputs fed per
  process, outputs gathered) and the launcher that starts them.

May import: :mod:`paxkv.core`, :mod:`paxkv.table`, :mod:`paxkv.cache`. Must not import the
engine or any model (a model is placed by rules the caller passes).
"""
