"""One step of beam selection as HF transformers does it, a pure function over the search state.

The rule (HF 5.24 ``generate(num_beams=W, do_sample=False)``): of the ``W x V`` candidates of a
prompt, the top ``K`` (``2W``, or ``(1 + number of stop ids) * W``) are considered; the best W
that did not just end survive; only the best W candidates may finish, scored
``sum(log p) / n ** length_penalty``; the search of a prompt stays open while its best running
beam could still beat its worst finished hypothesis. :mod:`paxkv.beam_search` runs this inside
its compiled loop and reorders the cache by the returned parents.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

NEG = -1.0e9  # HF's "impossible" score: added, not assigned, exactly as HF does


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Beams:
    """Search state for P prompts x W beams, N = ``max_new_tokens``.

    Attributes:
      run_tokens: int32 ``[P, W, N]``; run_scores: float32 ``[P, W]``: running beams (log-prob
        sums), best first.
      fin_tokens: int32 ``[P, W, N]``; fin_scores: float32 ``[P, W]`` (length-penalised);
        fin_lens: int32 ``[P, W]``; is_fin: bool ``[P, W]``: the best finished hypotheses.
      open_: bool ``[P]``: the finished list can still improve (HF's heuristic unsatisfied).
      t: int32 ``[]``: tokens each running beam holds.  done: bool ``[]``.
    """

    run_tokens: jax.Array
    run_scores: jax.Array
    fin_tokens: jax.Array
    fin_scores: jax.Array
    fin_lens: jax.Array
    is_fin: jax.Array
    open_: jax.Array
    t: jax.Array
    done: jax.Array

    @classmethod
    def start(cls, p: int, w: int, n: int) -> "Beams":
        zeros = jnp.zeros((p, w, n), jnp.int32)
        run_scores = jnp.full((p, w), NEG, jnp.float32).at[:, 0].set(0.0)  # only beam 0 seeds
        return cls(zeros, run_scores, zeros, jnp.full((p, w), NEG, jnp.float32),
                   jnp.zeros((p, w), jnp.int32), jnp.zeros((p, w), bool), jnp.ones((p,), bool),
                   jnp.zeros((), jnp.int32), jnp.zeros((), bool))


def gather(a: jax.Array, idx: jax.Array) -> jax.Array:
    """``a [P, M, ...]`` indexed along axis 1 by ``idx [P, k]`` -> ``[P, k, ...]``."""
    return jnp.take_along_axis(a, idx.reshape(idx.shape + (1,) * (a.ndim - 2)), axis=1)


def select(b: Beams, logp: jax.Array, stop_ids: jax.Array, lp: jax.Array, early: jax.Array
            ) -> tuple[Beams, jax.Array]:
    """One beam step from log-probs ``[P, W, V]``; returns the new state and each survivor's
    parent beam int32 ``[P, W]``."""
    p, w, v = logp.shape
    n_max = b.run_tokens.shape[2]
    k = max(2, 1 + stop_ids.shape[0]) * w
    top, idx = jax.lax.top_k((logp + b.run_scores[..., None]).reshape(p, w * v), k)  # [P, K]
    src, tok = idx // v, idx % v
    seqs = gather(b.run_tokens, src).at[:, :, b.t].set(tok)  # [P, K, N]
    n = b.t + 1
    hits = jnp.any(tok[..., None] == stop_ids[None, None, :], axis=-1) | (n >= n_max)  # [P, K]
    # Survivors: the best W candidates that did not just end.
    run_scores, keep = jax.lax.top_k(top + jnp.where(hits, NEG, 0.0), w)
    # Finished: only the best W candidates may enter, and only while the list can improve.
    just = hits & (jnp.arange(k) < w)[None, :]
    full = jnp.all(b.is_fin, axis=1, keepdims=True) & (early == 1)
    fin = (top / jnp.power(n.astype(jnp.float32), lp) + jnp.where(full, NEG, 0.0)
           + jnp.where(b.open_[:, None], 0.0, NEG) + jnp.where(just, 0.0, NEG))
    fin_scores, pick = jax.lax.top_k(jnp.concatenate([b.fin_scores, fin], axis=1), w)
    merged = lambda old, new: gather(jnp.concatenate([old, new], axis=1), pick)
    fin_tokens = merged(b.fin_tokens, seqs)
    fin_lens = merged(b.fin_lens, jnp.broadcast_to(n, (p, k)))
    is_fin = merged(b.is_fin, just)
    # HF's heuristic: can the best running beam still beat the worst finished hypothesis?
    hyp_len = jnp.where((early == 2) & (lp > 0), n_max, n).astype(jnp.float32)
    best = run_scores[:, :1] / jnp.power(hyp_len, lp)
    worst = jnp.where(is_fin, jnp.min(fin_scores, axis=1, keepdims=True), NEG)
    open_ = b.open_ & jnp.any(best > worst, axis=1)
    done = (~jnp.any(open_) | (jnp.all(is_fin) & (early == 1)) | jnp.all(hits))
    return Beams(gather(seqs, keep), run_scores, fin_tokens, fin_scores, fin_lens, is_fin,
                  open_, n, done), gather(src, keep)
