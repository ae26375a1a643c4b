"""What the engine tracks per request, and what it hands back."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class GenerationResult:
    """One request's outcome: ``token_ids`` are the generated tokens (a stop token included),
    ``text`` their decoding without stop tokens; ``finish_reason`` is "stop", "length",
    "cancelled", "forked" (branched into children), "prefilled" (a shared prefix) or
    "out_of_pages"; ``num_cached_tokens``
    counts prompt tokens served from shared pages; with ``n > 1``, ``samples`` holds the n
    results (the fields above then repeat sample 0)."""

    token_ids: list[int]
    text: str
    prompt_ids: list[int]
    finish_reason: str
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    samples: list["GenerationResult"] | None = None


@dataclasses.dataclass(eq=False)
class Request:
    id: int
    prompt_ids: list[int]
    max_new_tokens: int
    stop_ids: frozenset[int]
    temperature: float
    top_k: int
    top_p: float
    key_data: np.ndarray
    salt: str | bytes | None = None
    n: int = 1  # > 1: prefill prompt[:-1] once, then fork into n children
    hold: bool = False  # keep the row after finishing, to fork it later
    is_prefix: bool = False  # a shared prefix: prefilled, then held ("prefilled") for forks
    prefix_of: int | None = None  # the held prefix request this one forks at admission
    output: list[int] = dataclasses.field(default_factory=list)
    row: int | None = None
    cached: int = 0  # tokens[:cached] are in the row
    finish_reason: str | None = None
    preemptions: int = 0
    admitted_at: int = 0
    num_cached_tokens: int = 0
    children: list[int] = dataclasses.field(default_factory=list)

    @property
    def keeps_row(self) -> bool:
        """Finished but holding its row: a held request, or a prefilled shared prefix."""
        return self.finish_reason == "prefilled" or (
            self.hold and self.finish_reason in ("stop", "length"))

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output

    @property
    def target(self) -> int:
        """Tokens to hold before sampling (an n > 1 parent stops one short and forks)."""
        return len(self.prompt_ids) + len(self.output) - (self.n > 1)

    @property
    def decoding(self) -> bool:
        return (self.row is not None and self.finish_reason is None
                and self.cached == len(self.prompt_ids) + len(self.output) - 1)
