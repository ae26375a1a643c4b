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

from paxkv import dense_cache, page_table, paged_cache, pool, steps
from paxkv.beam_search import Beam, beam_search
from paxkv.dense_cache import DenseCache
from paxkv.engine import Engine, GenerationResult
from paxkv.generate import generate
from paxkv.paged_cache import PagedCache
from paxkv.page_table import PageTable, PoolUpdate, TableStats
from paxkv.pool import KVPool
from paxkv.sampling import SamplingParams
from paxkv.step_info import StepInfo

__all__ = [
    "DenseCache", "Engine", "GenerationResult", "KVPool", "PageTable", "PagedCache",
    "PoolUpdate", "SamplingParams", "StepInfo", "TableStats", "dense_cache", "generate",
    "page_table", "paged_cache", "pool", "steps",
]
__all__ += ["Beam", "beam_search"]

from paxkv import prefix_cache  # noqa: E402 - shared pages (issue 3): index, engine accounting
from paxkv.engine import EngineStats, SequenceStats  # noqa: E402
from paxkv.page_table import SharingStats  # noqa: E402
from paxkv.prefix_cache import PrefixIndex  # noqa: E402

__all__ += ["EngineStats", "PrefixIndex", "SequenceStats", "SharingStats", "prefix_cache"]
