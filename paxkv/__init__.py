"""paxkv: PagedAttention and KV-cache management for JAX.

The pieces, in the order data flows through them:

* :mod:`paxkv.protocol` — what a cache (:class:`KVCache`) and a model (:class:`Model`) provide.
* :mod:`paxkv.page_table` — block tables, lengths, ref counts; pure ``reserve`` / ``release`` /
  ``fork`` / ``copy_on_write`` / ``stats`` that return a new table and a status.
* :mod:`paxkv.pool` — the fixed K/V page arrays of every layer.
* :mod:`paxkv.paged_cache` / :mod:`paxkv.dense_cache` — the two caches behind one protocol.
* :mod:`paxkv.steps` — jitted, donated prefill / decode steps and the compiled decode loop.
* :mod:`paxkv.engine` / :func:`paxkv.generate` — continuous batching for research loops, built
  from :mod:`paxkv.requests`, :mod:`paxkv.rows`, :mod:`paxkv.cache_ops`,
  :mod:`paxkv.lifecycle`, :mod:`paxkv.scheduler`, :mod:`paxkv.policy`,
  :mod:`paxkv.prefix_sharing` and :mod:`paxkv.accounting`.
* :mod:`paxkv.prefix_cache` — chained-hash index of cached pages; the engine shares pages through
  it, through ``n`` samples and through :meth:`paxkv.Engine.fork` (trees of thought).
"""

from paxkv import dense_cache, page_table, paged_cache, policy, pool, prefix_cache, steps
from paxkv.attention.plan import AttentionPlan
from paxkv.beam_search import Beam, beam_search
from paxkv.dense_cache import DenseCache
from paxkv.engine import Engine, EngineStats, GenerationResult, SequenceStats, StepOutput
from paxkv.generate import generate
from paxkv.paged_cache import PagedCache
from paxkv.page_table import PageTable, PoolUpdate, SharingStats, TableStats
from paxkv.pool import KVPool
from paxkv.prefix_cache import PrefixIndex
from paxkv.protocol import KVCache, Model
from paxkv.sampling import SamplingParams
from paxkv.step_info import StepInfo

__all__ = [
    "AttentionPlan", "Beam", "DenseCache", "Engine", "EngineStats", "GenerationResult",
    "KVCache", "KVPool", "Model", "PageTable", "PagedCache", "PoolUpdate", "PrefixIndex",
    "SamplingParams", "SequenceStats", "SharingStats", "StepInfo", "StepOutput", "TableStats",
    "beam_search", "dense_cache", "generate", "page_table", "paged_cache", "policy", "pool",
    "prefix_cache", "steps",
]

# Scoring (log-likelihoods for evaluation pipelines): paxkv.scoring.
from paxkv.scoring import Scorer, ScoreResult, score, score_rolling  # noqa: E402

__all__ += ["ScoreResult", "Scorer", "score", "score_rolling"]
