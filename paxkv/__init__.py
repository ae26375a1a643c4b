"""paxkv: PagedAttention and KV-cache management for JAX.

The parts, one subpackage each, lowest first; each imports only the layers below it
(``tests/test_layout.py`` reads the imports and holds this order):

* :mod:`pallas_kernels` (beside this package) — the Mosaic GPU kernels, their standalone jnp
  references, and the K/V storage format both sides share (``quant``, ``kv_storage``).
* :mod:`paxkv.core` — the protocols (:class:`KVCache`, :class:`Model`), :class:`StepInfo`, the
  :class:`AttentionPlan`, the rounding rules, sampling and the jitted donated steps.
* :mod:`paxkv.table` — the page table and its pure operations (the heart).
* :mod:`paxkv.attention` — the XLA attention maths.
* :mod:`paxkv.cache` — the pool and the paged, dense and cache-less caches.
* :mod:`paxkv.models` — the Llama-family decoder and its loaders (imports only the core).
* :mod:`paxkv.scale` — the ``("data", "model")`` mesh, the sharded cache, tensor parallel,
  several processes.
* :mod:`paxkv.prefix` — the prefix index and its holds on pages.
* :mod:`paxkv.engine` — continuous batching: requests, scheduling policy, lifecycle.
* :mod:`paxkv.decoding`, :mod:`paxkv.scoring` — the front ends: ``generate``, beam search,
  the compiled loop; log-likelihoods.
* :mod:`paxkv.harness` — the lm-evaluation-harness backend (imported on its own).

The names below are the public API; the module names bound here (``paged_cache``,
``page_table``, ``steps``, ``mesh``, ...) keep ``from paxkv import paged_cache`` working.
"""

from paxkv.cache import dense as dense_cache
from paxkv.cache import paged as paged_cache
from paxkv.cache import pool
from paxkv.cache.dense import DenseCache
from paxkv.cache.paged import PagedCache
from paxkv.cache.pool import KVPool
from paxkv.core import steps
from paxkv.core.plan import AttentionPlan
from paxkv.core.protocol import KVCache, Model
from paxkv.core.sampling import SamplingParams
from paxkv.core.step_info import StepInfo
from paxkv.decoding.beam_search import Beam, beam_search
from paxkv.decoding.generate import generate
from paxkv.engine import Engine, EngineStats, GenerationResult, SequenceStats, StepOutput, policy
from paxkv.scale import routing as shard_routing
from paxkv.prefix import index as prefix_cache
from paxkv.prefix.index import PrefixIndex
from paxkv.scale import distributed, mesh, sharded_cache, tensor_parallel
from paxkv.table import page_table
from paxkv.table.page_table import PageTable, PoolUpdate, SharingStats, TableStats

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

# RL rollouts and the trainer's side (group rollouts, log-probabilities, GRPO): paxkv.rl.
from paxkv import rl  # noqa: E402
