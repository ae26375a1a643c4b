"""Scoring requests on the host: token ids, truncation, grouping by context, rolling windows.

Plain Python, nothing traced. A request is a ``(context, continuation)`` pair of token ids; a
:class:`Group` is one distinct context and the requests that continue it::

    requests:  (ctx A, " Paris")  (ctx A, " London")  (ctx B, " 4")  (ctx A, " Rome")
    groups:    A -> [0, 1, 3]     B -> [2]

A group's context is prefilled once; each member whose continuation has more than one token
becomes a row of its own (a fork of the context's row) for the rest of it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Sequence

from paxkv.engine.setup import encode, token_ids

Pair = tuple[tuple[int, ...], tuple[int, ...]]


def token_pairs(lm: Any, requests: Sequence[Any]) -> list[Pair]:
    """``requests`` (``(context, continuation)`` pairs of strings or token-id lists) -> token
    ids. A string pair is tokenised as lm-eval's causal models do: ``encode(context +
    continuation)`` split at ``len(encode(context))``. Raises ``ValueError`` naming the bad
    request (an empty context or continuation, an id outside the vocabulary, float or bool
    ids, text for a model without ``encode``)."""
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Sequence):
        raise TypeError("requests must be a list of (context, continuation) pairs")
    out = []
    for i, req in enumerate(requests):
        if not isinstance(req, Sequence) or isinstance(req, (str, bytes)) or len(req) != 2:
            raise TypeError(f"request {i} is not a (context, continuation) pair: {req!r}; pass "
                            "a list of pairs, [(context, continuation), ...]")
        ctx, cont = req
        if isinstance(ctx, str) != isinstance(cont, str):
            raise TypeError(f"request {i} mixes text and token ids: give both as strings or "
                            "both as lists of ids")
        if isinstance(ctx, str):
            whole, head = (encode(lm, t, f"request {i}") for t in (ctx + cont, ctx))
            ctx, cont = head, whole[len(head):]
        ctx, cont = (tuple(token_ids(x, f"request {i}'s {part}", text=True))
                     for x, part in ((ctx, "context"), (cont, "continuation")))
        if not ctx:
            raise ValueError(f"request {i} has an empty context: give at least one token "
                             "(lm-eval's hf backend uses the BOS token)")
        if not cont:
            raise ValueError(f"request {i}'s continuation is empty (it tokenises to nothing): "
                             "give at least one continuation token")
        bad = [t for t in ctx + cont if not 0 <= t < lm.vocab_size]
        if bad:
            raise ValueError(f"request {i} has token id {bad[0]} outside [0, {lm.vocab_size})")
        out.append((ctx, cont))
    return out


def truncate(pairs: Sequence[Pair], max_length: int | None) -> list[Pair]:
    """The hf backend's left truncation: the model sees at most ``max_length`` tokens, so a
    context is cut from the left to its last ``max_length + 1 - len(continuation)`` tokens.
    A continuation longer than ``max_length`` fits no window: ``ValueError``."""
    if max_length is None:
        return list(pairs)
    if not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"max_length must be None or an int >= 1, got {max_length!r}")
    out = []
    for i, (ctx, cont) in enumerate(pairs):
        if len(cont) > max_length:
            raise ValueError(f"request {i}'s continuation has {len(cont)} tokens, more than "
                             f"max_length={max_length} (no window holds it): raise max_length "
                             "or score it with score_rolling")
        keep = max_length + 1 - len(cont)
        out.append((ctx[-keep:] if len(ctx) > keep else ctx, cont))
    return out


@dataclasses.dataclass
class Group:
    """One context and the requests that continue it (indices into the request list)."""

    context: tuple[int, ...]
    members: list[int]

    def firsts(self, pairs: Sequence[Pair]) -> list[int]:
        """The distinct first continuation tokens, in order of first appearance."""
        return list(dict.fromkeys(pairs[m][1][0] for m in self.members))

    def children(self, pairs: Sequence[Pair]) -> list[int]:
        """Members with more than one continuation token: each needs a row of its own."""
        return [m for m in self.members if len(pairs[m][1]) > 1]


def group(pairs: Sequence[Pair], *, share: bool, max_children: int) -> list[Group]:
    """Requests grouped by identical context (``share``; else one group per request), longest
    context first (ties by token ids, so contexts sharing a prefix sit together). A group with
    more than ``max_children`` multi-token continuations is split into several (their shared
    pages then come from the prefix cache)."""
    by_context: dict[tuple[int, ...], list[int]] = {}
    groups = []
    for i, (ctx, _) in enumerate(pairs):
        if share:
            by_context.setdefault(ctx, []).append(i)
        else:
            groups.append(Group(ctx, [i]))
    groups += [Group(ctx, members) for ctx, members in by_context.items()]
    out = []
    for g in sorted(groups, key=lambda g: (-len(g.context), g.context)):
        out += _split(g, pairs, max_children)
    return out


def _split(g: Group, pairs: Sequence[Pair], max_children: int) -> Iterator[Group]:
    singles = [m for m in g.members if len(pairs[m][1]) == 1]
    multi = g.children(pairs)
    if len(multi) <= max_children:
        yield g
        return
    for i in range(0, len(multi), max_children):
        yield Group(g.context, multi[i:i + max_children] + (singles if i == 0 else []))


def rolling_windows(tokens: Sequence[int], *, prefix_token: int,
                    max_length: int) -> list[Pair]:
    """lm-eval's rolling loglikelihood windows (``get_rolling_token_windows`` with
    ``context_len=1``, each made disjoint by ``make_disjoint_window``): every token of
    ``tokens`` is predicted exactly once, the first after ``prefix_token``, each with as much
    preceding text as fits ``max_length``. Returns ``(context, continuation)`` pairs."""
    tokens = token_ids(tokens, "the text")
    if not tokens:
        return []
    if not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"max_length must be an int >= 1, got {max_length!r}")
    first = min(max_length, len(tokens))
    out = [((prefix_token,), tuple(tokens[:first]))]
    done = first
    while done < len(tokens):
        n = min(len(tokens) - done, max_length)
        end = done + n
        out.append((tuple(tokens[end - max_length - 1: end - n]), tuple(tokens[done:end])))
        done = end
    return out
