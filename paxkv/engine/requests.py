"""The engine's request table: requests, cache rows, the queue and ids, and each row's
sampling settings and next token (:class:`RowState`, numpy ``[max_seqs]`` arrays the jitted
steps take whole, so requests of different settings share one step). Plain Python, no JAX.

A request moves through::

    submit -> waiting -> (admitted to a row) prefilling -> decoding -> finished
                 ^                                           |
                 +------------ preempted (recomputed) -------+

A finished request that holds no row is *done*: the engine hands its result out once (from
``step()``) and drops it from the table, so a long-lived engine holds only live requests.
A request with ``n > 1`` samples is done when every sample is; its samples are dropped with it.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Sequence

import numpy as np

from paxkv.core.sampling import RowSampling, SamplingParams
from paxkv.prefix.index import salt_bytes


def epoch_salt(salt: str | bytes | None, epoch: int) -> str | bytes | None:
    """The prefix cache's salt for K/V computed in weight epoch ``epoch``: ``salt`` itself in
    epoch 0, ``salt`` with the epoch appended after (:meth:`paxkv.Engine.update_params`), so a
    prompt's pages cached under other weights never match."""
    return salt if epoch == 0 else salt_bytes(salt) + b"\x00paxkv-weights-%d" % epoch


@dataclasses.dataclass
class GenerationResult:
    """One request's outcome: ``token_ids`` are the generated tokens (a stop token included),
    ``text`` their decoding without stop tokens; ``finish_reason`` is "stop", "length",
    "cancelled", "aborted" (by :meth:`paxkv.Engine.update_params`; the tokens made so far),
    "non_finite" (the logits of its next token were not finite: diverged weights; no token
    was drawn), "forked" (branched into children), "continued" (carried on by
    :meth:`paxkv.Engine.extend`), "prefilled" (a shared prefix), "out_of_pages" or
    "running"; ``num_cached_tokens`` counts prompt tokens served from shared pages; with
    ``n > 1``, ``samples`` holds the n results (the fields above then repeat sample 0).
    ``weight_versions[i]`` is the engine's weight version (:meth:`paxkv.Engine.update_params`)
    that sampled ``token_ids[i]``. With ``SamplingParams(logprobs=k)``, ``logprobs[i]`` is
    the log-probability of ``token_ids[i]`` in the engine's ``logprobs_mode`` and
    ``top_logprobs[i]`` its ``k`` most likely ``(token, logprob)`` at that step; None
    otherwise."""

    token_ids: list[int]
    text: str
    prompt_ids: list[int]
    finish_reason: str
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    samples: list["GenerationResult"] | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    weight_versions: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What one ``Engine.step()`` changed.

    Attributes:
      new_tokens: request id -> tokens it generated in this step (samples and forked children
        under their own ids).
      finished: request id -> result, for requests that are done (each is handed out once and
        then dropped from the engine).
    """

    new_tokens: dict[int, list[int]]
    finished: dict[int, GenerationResult]


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
    cache_salt: str | bytes | None = None  # the user's prefix-cache tenant
    kv_epoch: int = 0  # the weight epoch its row's K/V was computed in (set at admission)
    n: int = 1  # > 1: prefill prompt[:-1] once, then fork into n children
    hold: bool = False  # keep the row after finishing, to fork it later
    is_prefix: bool = False  # a shared prefix: prefilled, then held ("prefilled") for forks
    prefix_of: int | None = None  # the held prefix request this one forks at admission
    sample_of: int | None = None  # the n > 1 request this one is a sample of
    output: list[int] = dataclasses.field(default_factory=list)
    row: int | None = None
    cached: int = 0  # tokens[:cached] are in the row
    finish_reason: str | None = None
    preemptions: int = 0
    admitted_at: int = 0
    num_cached_tokens: int = 0
    children: list[int] = dataclasses.field(default_factory=list)
    logprobs: int | None = None  # alternatives to return per token (None: no logprobs)
    token_logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)  # weight version per token
    refill: str | None = None  # a held row being prefilled again: the finish reason it keeps

    @classmethod
    def make(cls, rid: int, prompt_ids: list[int], params: SamplingParams,
             stop_ids: frozenset[int], key_data: np.ndarray, **fields) -> "Request":
        """A request with ``params``' settings (``stop_ids``: resolved for the model)."""
        return cls(rid, prompt_ids, params.max_new_tokens, stop_ids, float(params.temperature),
                   int(params.top_k or 0), 1.0 if params.top_p is None else float(params.top_p),
                   key_data, n=params.n, logprobs=params.logprobs, **fields)

    def params(self) -> SamplingParams:
        """This request's settings (stop ids resolved) as :class:`SamplingParams`, n = 1."""
        return SamplingParams(self.max_new_tokens, self.temperature, self.top_k or None,
                              self.top_p, stop_token_ids=tuple(sorted(self.stop_ids)),
                              logprobs=self.logprobs)

    @property
    def salt(self) -> str | bytes | None:
        """What the prefix cache keys this request's pages under: its tenant and the weight
        epoch of its K/V (:func:`epoch_salt`)."""
        return epoch_salt(self.cache_salt, self.kv_epoch)

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
        """Tokens to hold before sampling (an n > 1 parent stops one short and forks; a held
        row prefilled again holds all but its last token, as it did)."""
        held_again = self.refill is not None and not self.is_prefix
        return len(self.prompt_ids) + len(self.output) - (self.n > 1 or held_again)

    @property
    def decoding(self) -> bool:
        return (self.row is not None and self.finish_reason is None
                and self.cached == len(self.prompt_ids) + len(self.output) - 1)


class RequestTable:
    """Every live request by id, which row holds which, and the queue (front first)."""

    def __init__(self, max_seqs: int):
        self.requests: dict[int, Request] = {}
        self.rows: list[Request | None] = [None] * max_seqs
        self.waiting: collections.deque[Request] = collections.deque()
        self.resuming: list[Request] = []  # placed in a row, their new tokens not yet fed
        self.clock = 0  # engine steps so far: admission order for preemption
        self._next_id = 0

    def new_id(self) -> int:
        rid, self._next_id = self._next_id, self._next_id + 1
        return rid

    def add(self, req: Request) -> None:
        self.requests[req.id] = req

    def prompt(self, prompt_ids: Sequence[int], vocab_size: int,
               prefix: int | None = None) -> list[int]:
        """A new request's full prompt (a :meth:`paxkv.Engine.submit_prefix` ``prefix``'s
        tokens first); a ``ValueError`` naming what to change if it is empty, out of the
        vocabulary, or names no live prefix."""
        ids = [int(t) for t in prompt_ids]
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise ValueError(f"prompt token ids must lie in [0, {vocab_size})")
        if prefix is None:
            return ids
        holder = self.requests.get(prefix)
        if holder is None or not holder.is_prefix:
            raise ValueError(f"prefix={prefix!r} is not a live id from submit_prefix()")
        return holder.prompt_ids + ids

    def get(self, request_id: int) -> Request:
        """The live request ``request_id``; a ``ValueError`` naming it otherwise."""
        req = self.requests.get(request_id)
        if req is None:
            raise ValueError(f"unknown request id {request_id!r}: not submitted to this engine, "
                             "or already done and handed out by step() / run()")
        return req

    def free_rows(self) -> list[int]:
        return [i for i, r in enumerate(self.rows) if r is None]

    def place(self, req: Request, row: int) -> None:
        self.rows[row], req.row, req.cached, req.admitted_at = req, row, 0, self.clock

    def vacate(self, req: Request) -> None:
        if req.row is not None:
            self.rows[req.row], req.row = None, None

    def running(self) -> list[Request]:
        """Requests in a row and not finished (prefilling or decoding)."""
        return [r for r in self.rows if r is not None and r.finish_reason is None]

    def has_work(self) -> bool:
        return bool(self.waiting) or bool(self.running())

    def is_done(self, req: Request) -> bool:
        """Finished, holding no row, and (with samples) every sample done too."""
        if req.finish_reason is None or req.row is not None:
            return False
        return all(self.is_done(self.requests[c]) for c in req.children if req.n > 1)

    def done(self) -> list[Request]:
        """The done requests users see (not samples: they leave with their request)."""
        return [r for r in self.requests.values() if r.sample_of is None and self.is_done(r)]

    def drop(self, req: Request) -> None:
        """Forgets a done request and its samples."""
        for c in (req.children if req.n > 1 else []):
            self.requests.pop(c, None)
        self.requests.pop(req.id)

    def result(self, req: Request,
               decode: Callable[[list[int]], str] | None = None) -> GenerationResult:
        """``req``'s outcome so far (``decode``: the model's, for ``text``)."""
        if req.n > 1 and req.children:
            samples = [self.result(self.requests[c], decode) for c in req.children]
            first = samples[0]
            return GenerationResult(first.token_ids, first.text, req.prompt_ids,
                                    first.finish_reason, req.num_cached_tokens,
                                    req.preemptions, samples, first.logprobs,
                                    first.top_logprobs, first.weight_versions)
        kept = [t for t in req.output if t not in req.stop_ids]
        asked = req.logprobs is not None
        return GenerationResult(list(req.output), decode(kept) if decode else "",
                                req.prompt_ids, req.finish_reason or req.refill or "running",
                                req.num_cached_tokens, req.preemptions,
                                logprobs=list(req.token_logprobs) if asked else None,
                                top_logprobs=list(req.top_logprobs) if asked else None,
                                weight_versions=list(req.versions))

    def hand_out(self, decode: Callable[[list[int]], str] | None = None
                 ) -> dict[int, GenerationResult]:
        """The results of the done requests, which are then dropped."""
        done = self.done()
        results = {r.id: self.result(r, decode) for r in done}
        for r in done:
            self.drop(r)
        return results


# -- what the host keeps per cache row between steps -----------------------------------
class RowState:
    """Per-row sampling settings and last tokens (numpy ``[max_seqs]``) beside a table."""

    def __init__(self, table: RequestTable):
        self.table = table
        s = len(table.rows)
        self.last_tokens = np.zeros(s, np.int32)
        self.sampling = dict(temperature=np.zeros(s, np.float32), top_k=np.zeros(s, np.int32),
                             top_p=np.ones(s, np.float32), seed=np.zeros((s, 2), np.uint32))

    def place(self, req: Request, row: int) -> None:
        """Puts ``req`` in ``row`` (see :meth:`RequestTable.place`) with its settings."""
        self.table.place(req, row)
        for name, value in (("temperature", req.temperature), ("top_k", req.top_k),
                            ("top_p", req.top_p), ("seed", req.key_data)):
            self.sampling[name][row] = value

    def vacate(self, req: Request) -> None:
        """Takes ``req`` out of its row; the idle row samples greedily (no sort compiled)."""
        if req.row is not None:
            self.sampling["temperature"][req.row] = 0.0
        self.table.vacate(req)

    def sampling_for(self, rows: np.ndarray | None) -> RowSampling | None:
        """Sampling settings of ``rows`` (None = all); None when every row is greedy, so
        greedy work compiles without the sampling sort."""
        if not (self.sampling["temperature"] > 0).any():
            return None
        pick = (lambda a: a) if rows is None else (lambda a: a[rows])
        # copies (np.array): the rows change these arrays while a step may still read them
        return RowSampling(**{k: np.array(pick(v)) for k, v in self.sampling.items()})
