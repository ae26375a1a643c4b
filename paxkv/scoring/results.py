"""What scoring returns: one :class:`ScoreResult` per request, and :class:`ScoreStats` (the
work a :class:`paxkv.scoring.Scorer` did)."""

from __future__ import annotations

import dataclasses

from paxkv.core.compiles import CompileStats


@dataclasses.dataclass(frozen=True)
class ScoreResult:
    """One request's score.

    Attributes:
      logprob: the sum of the continuation's token log-probabilities.
      is_greedy: every continuation token was the argmax of its position.
      token_logprobs: each continuation token's log-probability, in order.
    """

    logprob: float
    is_greedy: bool
    token_logprobs: tuple[float, ...]


@dataclasses.dataclass
class ScoreStats:
    """What scoring did, summed over calls (:meth:`Scorer.reset_stats` zeroes it).

    ``prefill_tokens`` (context tokens fed) + ``scored_tokens`` (continuation tokens fed) =
    ``model_tokens``; ``cached_tokens``: context tokens served by the prefix cache instead;
    ``padded_tokens``: batch x width of every step (the work, padding included);
    ``compiles``: what the calls paid for compiles (:mod:`paxkv.core.compiles`)."""

    requests: int = 0
    contexts: int = 0
    prefill_tokens: int = 0
    cached_tokens: int = 0
    scored_tokens: int = 0
    padded_tokens: int = 0
    steps: int = 0
    forks: int = 0
    cow_copies: int = 0
    peak_pages: int = 0
    compiles: CompileStats = dataclasses.field(default_factory=CompileStats)

    @property
    def model_tokens(self) -> int:
        return self.prefill_tokens + self.scored_tokens
