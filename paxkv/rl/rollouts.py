"""Group rollouts: G completions of each prompt through one engine, as arrays a loss reads.

GRPO samples a group of G completions per prompt and scores each against its group. Through
paxkv a group costs one prompt prefill: each distinct prompt is submitted once with ``n``
samples (:meth:`paxkv.Engine.submit`), which prefills it once and forks the samples into rows
that share its pages (copy-on-write at the first divergent page). Identical prompts handed in
repeated, as Tunix does (``np.repeat(prompts, G)``), are found and share one prefill too.
The engine batches continuously across groups: a sample that stops frees its row and pages at
once, and the next group's samples take them, so one long completion holds one row, not the
batch::

    prompts  [q0, q1, q0]      G = 2        distinct: q0 (n = 4), q1 (n = 2)
    rows of the result         group_ids    q0 q0 | q1 q1 | q0 q0   (the input's order)

:func:`rollout` returns :class:`Rollouts`: padded arrays (prompt and completion tokens with
masks, the sampler's per-token log-probabilities in the engine's ``logprobs_mode``, the weight
version of every token, finish reasons, group ids) in the layout
:func:`paxkv.rl.logprobs.token_logprobs` takes, so the trainer's log-probabilities of the
same tokens line up with the sampler's slot for slot.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from paxkv.core.sampling import SamplingParams
from paxkv.engine import Engine, GenerationResult


@dataclasses.dataclass(frozen=True)
class Rollouts:
    """``N = len(prompts) * group_size`` completions, row ``i`` of group ``group_ids[i]``.

    Attributes:
      prompt_tokens: int32 ``[N, P]``, left-padded (the real tokens end at column ``P``);
        prompt_mask: bool ``[N, P]``.
      completion_tokens: int32 ``[N, C]``, right-padded (a stop token included, as generated);
        completion_mask: bool ``[N, C]``.
      logprobs: float32 ``[N, C]``: each generated token's log-probability under the engine's
        weights and ``logprobs_mode`` (0 where masked).
      weight_versions: int32 ``[N, C]``: the engine's weight version that sampled each token
        (-1 where masked).
      group_ids: int32 ``[N]``: the index in ``prompts`` of each row's prompt.
      finish_reasons: each row's ("stop", "length", "aborted", "non_finite", ...).
      request_ids: each row's engine request id (:meth:`paxkv.Engine.extend` takes it when
        the rollout held its rows).
    """

    prompt_tokens: np.ndarray
    prompt_mask: np.ndarray
    completion_tokens: np.ndarray
    completion_mask: np.ndarray
    logprobs: np.ndarray
    weight_versions: np.ndarray
    group_ids: np.ndarray
    finish_reasons: list[str]
    request_ids: list[int]

    @property
    def completion_lengths(self) -> np.ndarray:
        """int32 ``[N]``: tokens each row generated."""
        return self.completion_mask.sum(axis=1).astype(np.int32)


def distinct_prompts(prompts: Sequence[Sequence[int]]) -> dict[tuple[int, ...], list[int]]:
    """Each distinct prompt (as a tuple) -> the indices where it appears, first seen first."""
    found: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prompts):
        found.setdefault(tuple(int(t) for t in p), []).append(i)
    return found


def _width(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


def rollout(engine: Engine, prompts: Sequence[Sequence[int]], group_size: int,
            params: SamplingParams | None = None, *, hold: bool = False,
            prompt_width: int | None = None, completion_width: int | None = None,
            multiple: int = 16) -> Rollouts:
    """Samples ``group_size`` completions of every prompt; returns them as :class:`Rollouts`.

    Args:
      engine: an engine with no request queued or running (held rows may stay); its weights
        are the policy (:meth:`paxkv.Engine.update_params` between calls).
      prompts: token ids per prompt (repeats are shared: one prefill per distinct prompt).
      group_size: G, completions per prompt.
      params: the sampling (``n`` is set here; ``logprobs`` defaults to 0: the sampled
        token's log-probability only). Each call draws fresh keys: request ids grow.
      hold: keep every completion's row after it finishes, for :meth:`paxkv.Engine.extend`
        (multi-turn); cancel them (``engine.cancel(request_ids[i])``) when done.
      prompt_width, completion_width: the arrays' widths (default: the longest, rounded up
        to ``multiple``, so a trainer's jitted loss compiles for a few shapes only).

    Returns:
      :class:`Rollouts` with ``len(prompts) * group_size`` rows in the order of ``prompts``.
    """
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    if engine.has_work():
        raise ValueError("rollout runs an engine with nothing queued or running: finish or "
                         "cancel its requests first (their results would be handed out here)")
    params = params or SamplingParams()
    if params.logprobs is None:
        params = dataclasses.replace(params, logprobs=0)
    groups = distinct_prompts(prompts)
    parents = {key: engine.submit(list(key), dataclasses.replace(
        params, n=len(where) * group_size), hold=hold) for key, where in groups.items()}
    results = engine.run()
    rows: list[tuple[int, GenerationResult, int]] = []  # (group id, result, request id)
    for key, where in groups.items():
        parent = results[parents[key]]
        samples = parent.samples or [parent]
        ids = engine.table.requests[parents[key]].children if hold and parent.samples else \
            [parents[key]] * len(samples)
        for k, group in enumerate(where):
            for j in range(k * group_size, (k + 1) * group_size):
                rows.append((group, samples[j], ids[j]))
    rows.sort(key=lambda r: r[0])  # stable: the input's order, samples in order
    return _arrays([(list(prompts[g]), r, rid, g) for g, r, rid in rows],
                   prompt_width, completion_width, multiple)


def _arrays(rows: list[tuple[list[int], GenerationResult, int, int]], prompt_width: int | None,
            completion_width: int | None, multiple: int) -> Rollouts:
    n = len(rows)
    p = prompt_width or _width(max(len(x[0]) for x in rows), multiple)
    c = completion_width or _width(max(len(x[1].token_ids) for x in rows), multiple)
    out: dict[str, Any] = dict(
        prompt_tokens=np.zeros((n, p), np.int32), prompt_mask=np.zeros((n, p), bool),
        completion_tokens=np.zeros((n, c), np.int32), completion_mask=np.zeros((n, c), bool),
        logprobs=np.zeros((n, c), np.float32), weight_versions=np.full((n, c), -1, np.int32))
    for i, (prompt, r, _, _) in enumerate(rows):
        if len(prompt) > p or len(r.token_ids) > c:
            raise ValueError(f"row {i} has {len(prompt)} prompt and {len(r.token_ids)} "
                             f"completion tokens: raise prompt_width ({p}) or "
                             f"completion_width ({c})")
        k = len(r.token_ids)
        out["prompt_tokens"][i, p - len(prompt):] = prompt
        out["prompt_mask"][i, p - len(prompt):] = True
        out["completion_tokens"][i, :k] = r.token_ids
        out["completion_mask"][i, :k] = True
        out["logprobs"][i, :k] = r.logprobs or 0.0
        out["weight_versions"][i, :k] = r.weight_versions
    return Rollouts(**out, group_ids=np.array([x[3] for x in rows], np.int32),
                    finish_reasons=[x[1].finish_reason for x in rows],
                    request_ids=[x[2] for x in rows])
