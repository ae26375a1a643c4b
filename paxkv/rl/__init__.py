"""Reinforcement learning: paxkv as the rollout engine of a GRPO-style loop, and the trainer side
that must agree with it, in one JAX process.

The sampler (the engine) returns each generated token's log-probability; the trainer computes
the same quantity under its own (soon updated) params and differentiates it. Both run the same
``model.forward`` and the same definition of the log-probability mode
(:func:`paxkv.core.sampling.mode_logits`), so in float32 they agree to float noise.

* :mod:`paxkv.rl.logprobs` — :func:`token_logprobs`: the trainer's per-token log-probabilities
  of ``prompt ++ completion`` batches (left- or right-padded prompts), jittable and
  differentiable w.r.t. the params; :func:`logprobs_fn` (jitted for one model);
  :func:`join_rows` (each row's real prompt followed by its completion).
* :mod:`paxkv.rl.rollouts` — :func:`rollout`: G completions of each prompt through an
  :class:`paxkv.Engine` (one prefill per distinct prompt, samples forked onto its pages,
  continuous batching across groups), as :class:`Rollouts` arrays.
* :mod:`paxkv.rl.grpo` — :func:`group_advantages` and the clipped :func:`policy_loss`.

Between steps the trainer hands its new params to :meth:`paxkv.Engine.update_params` (no
compile, no copy); held completions go on with :meth:`paxkv.Engine.extend` (multi-turn).

May import the layers below it: :mod:`paxkv.core`, :mod:`paxkv.cache`, :mod:`paxkv.engine`,
and the front ends :mod:`paxkv.decoding` and :mod:`paxkv.scoring`. Must not import
:mod:`paxkv.models` or :mod:`paxkv.harness`: a model reaches this part only through the
:class:`paxkv.Model` protocol (``model.forward``, ``model.params``).
"""

from paxkv.rl.grpo import group_advantages, policy_loss
from paxkv.rl.logprobs import join_rows, logprobs_fn, token_logprobs
from paxkv.rl.rollouts import Rollouts, distinct_prompts, rollout

__all__ = ["Rollouts", "distinct_prompts", "group_advantages", "join_rows", "logprobs_fn",
           "policy_loss", "rollout", "token_logprobs"]
