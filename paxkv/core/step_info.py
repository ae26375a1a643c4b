"""What one forward step processes, shared by the model and every cache.

A step feeds ``[batch, q_len]`` tokens. Row ``b``'s real tokens are left-aligned: tokens
``t < query_lengths[b]`` sit at absolute positions ``lengths[b] - query_lengths[b] + t``; the
rest is padding with position -1. Decode is ``q_len == 1``; prefill and chunked prefill are
``q_len > 1``. ``lengths`` counts the context *after* this step (the new tokens included).
Batch row ``i`` is cache row ``rows[i]``: a prefill of 4 new sequences runs at batch 4 against a
cache of 64 rows. The step's :class:`~paxkv.core.plan.AttentionPlan` (static hints, each
checked by the cache) rides along, so a model passes it to every ``attend`` without knowing it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from paxkv.core.plan import NO_PLAN, AttentionPlan


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["positions", "lengths", "query_lengths", "rows"],
                   meta_fields=["plan"])
@dataclasses.dataclass(frozen=True)
class StepInfo:
    """Positions of the tokens fed in one step.

    Attributes:
      positions: int32 ``[batch, q_len]``: absolute position of each token, -1 for padding.
      lengths: int32 ``[batch]``: tokens in context after the step (0 for idle rows).
      query_lengths: int32 ``[batch]``: real tokens in this step per row.
      rows: int32 ``[batch]``: the cache row of each batch row, or None when the batch is
        the whole cache in row order (decode), which spares the caches a gather.
      plan: static attention hints for this step (default: none).
    """

    positions: jax.Array
    lengths: jax.Array
    query_lengths: jax.Array
    rows: jax.Array | None = None
    plan: AttentionPlan = NO_PLAN

    @classmethod
    def make(cls, lengths: jax.Array, query_lengths: jax.Array, q_len: int,
             rows: jax.Array | None = None, plan: AttentionPlan = NO_PLAN) -> "StepInfo":
        """Builds the positions from ``lengths`` (after the step) and ``query_lengths``;
        ``rows=None`` means the batch is the whole cache in row order."""
        lengths = jnp.asarray(lengths, jnp.int32)
        query_lengths = jnp.asarray(query_lengths, jnp.int32)
        t = jnp.arange(q_len, dtype=jnp.int32)[None, :]
        positions = lengths[:, None] - query_lengths[:, None] + t
        positions = jnp.where(t < query_lengths[:, None], positions, -1)
        return cls(positions=positions, lengths=lengths, query_lengths=query_lengths,
                   rows=None if rows is None else jnp.asarray(rows, jnp.int32), plan=plan)

    @property
    def valid(self) -> jax.Array:
        """bool ``[batch, q_len]``: which tokens are real."""
        return self.positions >= 0
