"""GRPO's two formulas over :class:`paxkv.rl.rollouts.Rollouts` arrays: group-relative
advantages and the clipped policy loss (DeepSeekMath's GRPO, the sequence-mean variant).

Both are plain jnp over the rollout layout, jittable and differentiable; the loss takes the
trainer's log-probabilities (:func:`paxkv.rl.logprobs.token_logprobs`, differentiated) and the
sampler's (:attr:`Rollouts.logprobs`, constants), so the importance ratio of an on-policy step
is exp(trainer - sampler) = 1 up to the float noise the two agree within.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def group_advantages(rewards: jax.Array, group_ids: jax.Array, num_groups: int, *,
                     eps: float = 1e-4, scale: bool = True) -> jax.Array:
    """float32 ``[N]``: each row's reward minus its group's mean (divided by the group's
    standard deviation + ``eps`` when ``scale``). rewards float ``[N]``; group_ids int
    ``[N]`` in ``[0, num_groups)`` (static). A group whose rows all scored alike gets 0: it
    teaches nothing."""
    rewards = rewards.astype(jnp.float32)
    count = jax.ops.segment_sum(jnp.ones_like(rewards), group_ids, num_groups)
    mean = jax.ops.segment_sum(rewards, group_ids, num_groups) / jnp.maximum(count, 1)
    centred = rewards - mean[group_ids]
    if not scale:
        return centred
    var = jax.ops.segment_sum(centred ** 2, group_ids, num_groups) / jnp.maximum(count, 1)
    return centred / (jnp.sqrt(var)[group_ids] + eps)


def policy_loss(logprobs: jax.Array, old_logprobs: jax.Array, advantages: jax.Array,
                mask: jax.Array, *, clip: float = 0.2) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The clipped surrogate, averaged over each row's tokens, then over rows.

    Args:
      logprobs: float32 ``[N, C]``: the trainer's (differentiated).
      old_logprobs: float32 ``[N, C]``: the sampler's (no gradient flows into them).
      advantages: float32 ``[N]``; mask: bool ``[N, C]`` (the completion tokens).
      clip: the ratio's trust region ``[1 - clip, 1 + clip]``.

    Returns:
      ``(loss scalar, stats)``: stats ``ratio_max`` and ``clipped`` (the share of tokens whose
      ratio was clipped), both without gradient.
    """
    mask = mask.astype(jnp.float32)
    ratio = jnp.exp(jnp.where(mask > 0, logprobs - jax.lax.stop_gradient(old_logprobs), 0.0))
    adv = advantages[:, None]
    surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - clip, 1 + clip) * adv)
    per_row = jnp.sum(surrogate * mask, axis=1) / jnp.maximum(mask.sum(axis=1), 1)
    loss = -jnp.mean(per_row)
    clipped = jnp.sum((jnp.abs(ratio - 1) > clip) * mask) / jnp.maximum(mask.sum(), 1)
    stats = {"ratio_max": jax.lax.stop_gradient(jnp.max(jnp.where(mask > 0, ratio, 0.0))),
             "clipped": jax.lax.stop_gradient(clipped)}
    return loss, stats
