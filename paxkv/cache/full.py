"""A cache-less attention "cache": the full forward pass the caches are tested against."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from paxkv.attention.blocks import attend_blocks, default_sm_scale, layer_window
from paxkv.core.step_info import StepInfo


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NoCache:
    """Attends only among the tokens of the current step (positions from 0, no history).

    It honours the cache protocol (``attend``) so the model runs unchanged without a cache:
    ``paged == dense == full forward`` is a test, not a hope.

    Attributes:
      layer_windows: each layer's sliding window (None: global), or None (static).
    """

    layer_windows: tuple[int | None, ...] | None = dataclasses.field(
        default=None, metadata=dict(static=True))

    def attend(self, layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
               step: StepInfo, *, sm_scale: float | None = None,
               logit_soft_cap: float | None = None) -> tuple["NoCache", jax.Array]:
        """q ``[b, t, h, d]``, k/v ``[b, t, kv_heads, d]`` -> ``(self, [b, t, h, d])``."""
        k_blocks = jnp.swapaxes(k, 1, 2)[:, None]  # [b, 1, kv_heads, t, d]
        v_blocks = jnp.swapaxes(v, 1, 2)[:, None]
        out = attend_blocks(q, k_blocks, v_blocks, step.positions, step.query_lengths,
                            sm_scale=default_sm_scale(q.shape[-1], sm_scale),
                            logit_soft_cap=logit_soft_cap,
                            window=layer_window(self.layer_windows, layer))
        return self, out
