"""paxkv: PagedAttention and KV-cache management for JAX.

The pieces, in the order data flows through them:

* :mod:`paxkv.page_table` — block tables, lengths, ref counts; pure ``reserve`` / ``release`` /
  ``fork`` / ``copy_on_write`` / ``stats`` that return a new table and a status.
* :mod:`paxkv.pool` — the fixed K/V page arrays of every layer.
* :mod:`paxkv.paged_cache` / :mod:`paxkv.dense_cache` — the two caches behind one protocol.
* :mod:`paxkv.steps` — jitted, donated prefill / decode steps and the compiled decode loop.
* :mod:`paxkv.engine` / :func:`paxkv.generate` — continuous batching for research loops.
* :mod:`paxkv.prefix_cache` — chained-hash index of cached pages; the engine shares pages through
  it, through ``n`` samples and through :meth:`paxkv.Engine.fork` (trees of thought).
"""

from paxkv import dense_cache, page_table, paged_cache, pool, prefix_cache, steps
from paxkv.beam_search import Beam, beam_search
from paxkv.dense_cache import DenseCache
from paxkv.engine import Engine, EngineStats, GenerationResult, SequenceStats
from paxkv.generate import generate
from paxkv.paged_cache import PagedCache
from paxkv.page_table import PageTable, PoolUpdate, SharingStats, TableStats
from paxkv.pool import KVPool
from paxkv.prefix_cache import PrefixIndex
from paxkv.sampling import SamplingParams
from paxkv.step_info import StepInfo

__all__ = [
    "Beam", "DenseCache", "Engine", "EngineStats", "GenerationResult", "KVPool", "PageTable",
    "PagedCache", "PoolUpdate", "PrefixIndex", "SamplingParams", "SequenceStats",
    "SharingStats", "StepInfo", "TableStats", "beam_search", "dense_cache", "generate",
    "page_table", "paged_cache", "pool", "prefix_cache", "steps",
]
