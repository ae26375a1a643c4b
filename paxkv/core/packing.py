"""Packed tokens: a prefill or scoring step's token-wise layers run over its real tokens only.

A prefill call feeds ``[batch, q_len]`` slots, and rows of unequal prompts leave many of them
padding: the offline workload's calls (8 rows of 300-511 tokens in an 8 x 512 call, say) were
27% padding, and the projections and the MLP, nearly all of a step's arithmetic, cost the same
for a padding slot as for a token. :class:`Packing` gathers the real tokens into ``[1, T]``
(``T`` static, at least their count) so those layers run over ``T`` tokens; attention, which
reads and writes the cache by row, gets them back as ``[batch, q_len]`` around ``attend``.

The step asks for it with :attr:`paxkv.core.plan.AttentionPlan.packed_tokens` (a static hint,
like the attention plan's): a model that does not pack ignores it. ``T`` below the step's real
tokens is a caller's error the step cannot repair (the tokens past ``T`` were never computed):
:attr:`Packing.overflow` is then true and :class:`models.llama.Llama` returns NaN logits.

Scoring steps pack too (:mod:`paxkv.scoring.steps`): a continuation step asks the model for its
logits still packed (``forward(..., all_logits=True, packed_logits=True)``), so the vocab
projection and the log-softmax, a third of such a step, skip the padding as well.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp


# What a packed step's slots cost: attention, the cache's writes and the unpacking still run
# over every ``[batch, q_len]`` slot. SmolLM2-135M on 2 CPU cores (12-05, scoring steps at
# the same packed size): a context slot added 0.18-0.19 ms and a continuation slot 0.39 ms,
# where a packed token costs 1.5 ms: a sixth, between the two.
SLOT_SHARE = 6


def step_work(slots: int, packed: int | None) -> int:
    """A step's work in tokens, what shape planners weigh against a compile
    (:data:`paxkv.core.buckets.COMPILE_TOKENS`): every slot of an unpacked step, or a packed
    step's tokens plus its slots' share (:data:`SLOT_SHARE`)."""
    return slots if packed is None else packed + slots // SLOT_SHARE


@functools.partial(jax.tree_util.register_dataclass, data_fields=["index", "back", "overflow"],
                   meta_fields=["batch", "q_len"])
@dataclasses.dataclass(frozen=True)
class Packing:
    """Where each real token of a ``[batch, q_len]`` step sits among ``T`` packed ones.

    Attributes:
      index: int32 ``[T]``: the flat slot (``b * q_len + t``) of each packed token, in slot
        order; entries past the real count repeat the last slot (computed, never read back).
      back: int32 ``[batch * q_len]``: each slot's packed index, ``T`` for padding.
      overflow: bool ``[]``: the step has more real tokens than ``T``.
    """

    index: jax.Array
    back: jax.Array
    overflow: jax.Array
    batch: int
    q_len: int

    @classmethod
    def make(cls, valid: jax.Array, size: int) -> "Packing":
        """``valid`` bool ``[batch, q_len]`` (:attr:`paxkv.core.step_info.StepInfo.valid`)
        -> the packing of its true slots into ``size`` tokens."""
        b, t = valid.shape
        flat = valid.reshape(-1)
        (index,) = jnp.nonzero(flat, size=size, fill_value=b * t - 1)
        back = jnp.where(flat, jnp.cumsum(flat) - 1, size).astype(jnp.int32)
        return cls(index=index.astype(jnp.int32), back=back,
                   overflow=jnp.sum(flat) > size, batch=b, q_len=t)

    @classmethod
    def of(cls, valid: jax.Array, size: int | None) -> "Packing | None":
        """The packing a step of ``valid`` slots runs with when its plan packs ``size``
        tokens (:attr:`paxkv.core.plan.AttentionPlan.packed_tokens`), or None: no size, or
        one token a row (a decode step has no padding to drop). The one rule a model and the
        scoring steps both read, so they agree on where each token sits."""
        if size is None or valid.shape[1] == 1:
            return None
        return cls.make(valid, size)

    @property
    def size(self) -> int:
        return self.index.shape[0]

    def pack(self, x: jax.Array) -> jax.Array:
        """``[batch, q_len, ...] -> [1, T, ...]``."""
        flat = x.reshape((self.batch * self.q_len,) + x.shape[2:])
        return jnp.take(flat, self.index, axis=0)[None]

    def unpack(self, y: jax.Array) -> jax.Array:
        """``[1, T, ...] -> [batch, q_len, ...]``, padding slots zero."""
        out = jnp.take(y[0], self.back, axis=0, mode="fill", fill_value=0)
        return out.reshape((self.batch, self.q_len) + y.shape[2:])

    def last(self, y: jax.Array, query_lengths: jax.Array) -> jax.Array:
        """``[1, T, D]`` -> ``[batch, D]``: each row's last real token (a row with none gets
        the zero row)."""
        slot = jnp.arange(self.batch) * self.q_len + jnp.maximum(query_lengths - 1, 0)
        return jnp.take(y[0], jnp.take(self.back, slot), axis=0, mode="fill", fill_value=0)
