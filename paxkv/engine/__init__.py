"""The engine: continuous batching over cache rows, composed of parts that each test alone.

* :mod:`engine` — :class:`Engine`, the public API (submit, step, fork, cancel, stats).
* :mod:`requests` — the request table (plain Python) and per-row sampling state.
* :mod:`setup` — the cache built by name, the model placed on a mesh, the size checks.
* :mod:`cache_ops` — the cache and its jitted, donated operations.
* :mod:`lifecycle` — who holds a row: finish, release, preempt, fork, cancel.
* :mod:`scheduler` — one step: admit, prefill, decode; :mod:`admission` — whether a request
  fits now; :mod:`policy` — the pure decisions (growth projection, victims, step shapes);
  :mod:`routing` — the data shard for a request.
* :mod:`prefix_sharing` — the prefix cache kept in step with the pages; :mod:`tiered_prefixes`
  — the same with a host tier under it.
* :mod:`accounting` — the counters and :class:`EngineStats`.

May import: :mod:`paxkv.core`, :mod:`paxkv.table`, :mod:`paxkv.cache`, :mod:`paxkv.scale`,
:mod:`paxkv.prefix`. Must not import any model, the decoding front ends or scoring: a model
reaches the engine only through :class:`paxkv.Model`.
"""

from paxkv.engine.engine import Engine, EngineStats, GenerationResult, SequenceStats, StepOutput

__all__ = ["Engine", "EngineStats", "GenerationResult", "SequenceStats", "StepOutput"]
