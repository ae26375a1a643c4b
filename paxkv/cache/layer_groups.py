"""How a model's layers split into page groups by sliding window, and where each layer's
pages lie in the layer-grouped cache's flat pool (:mod:`paxkv.cache.grouped`)::

    layer_windows (6, None, 6, 3)   ->  group 0: window None, layer 1   (P0 + 1 pages)
                                        group 1: window 3,    layer 3   (P1 + 1 pages)
                                        group 2: window 6,    layers 0, 2 (P2 + 1 pages each)
    flat page axis: [ layer 1 | layer 3 | layer 0 | layer 2 ]   each range's sentinel last

Static (hashable): it rides on the cache as a pytree meta field, so every size here is a
Python int at trace time. How many pages each window group needs (for its rows, and for a
prefix index's holds) is sized here too: :func:`window_group_pages`,
:func:`prefix_index_pages`.
"""

from __future__ import annotations

import dataclasses
import functools

from paxkv.core.buckets import cdiv


@dataclasses.dataclass(frozen=True)
class LayerGroups:
    """Which layers share a page table, and where each layer's pages lie in the flat pool.

    Attributes:
      windows: per group, its window (None: global).
      members: per group, its layers in order.
      num_pages: per group, the real pages of each of its layers (each layer's range has one
        more, its sentinel).
    """

    windows: tuple[int | None, ...]
    members: tuple[tuple[int, ...], ...]
    num_pages: tuple[int, ...]

    @property
    def num_layers(self) -> int:
        return sum(len(m) for m in self.members)

    @functools.cached_property
    def layer_group(self) -> tuple[int, ...]:
        """Per layer: its group."""
        out = [0] * self.num_layers
        for g, members in enumerate(self.members):
            for layer in members:
                out[layer] = g
        return tuple(out)

    @functools.cached_property
    def layer_base(self) -> tuple[int, ...]:
        """Per layer: the flat index of its range's first page."""
        out, base = [0] * self.num_layers, 0
        for members, pages in zip(self.members, self.num_pages):
            for layer in members:
                out[layer], base = base, base + pages + 1
        return tuple(out)

    @property
    def flat_pages(self) -> int:
        """Length of the flat page axis, every range's sentinel included."""
        return sum(len(m) * (p + 1) for m, p in zip(self.members, self.num_pages))

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        return tuple(self.windows[g] for g in self.layer_group)

    @staticmethod
    def of(layer_windows: tuple[int | None, ...], pages: dict[int | None, int]) -> "LayerGroups":
        """Groups by window value, the global group (if any) first, then by window size;
        ``pages[w]``: real pages for each layer of the group of window ``w``."""
        windows = sorted(set(layer_windows), key=lambda w: (w is not None, w or 0))
        members = tuple(tuple(i for i, w in enumerate(layer_windows) if w == g) for g in windows)
        return LayerGroups(tuple(windows), members, tuple(pages[w] for w in windows))


def window_pages_per_row(window: int, page_size: int, step_tokens: int, max_len: int) -> int:
    """Pages a window group's row holds at most while it adds ``step_tokens`` in one step: the
    ``window - 1`` keys before its first query plus those tokens, on ``ceil(. / page) + 1``
    pages (the keys need not start at a page edge), at most a whole row."""
    return min(cdiv(window - 1 + step_tokens, page_size) + 1, cdiv(max_len, page_size))


def window_group_pages(window: int, page_size: int, max_seqs: int, max_len: int,
                       step_tokens: int, step_rows: int | None = None) -> int:
    """Pages a window group needs so that no row ever waits for them: every row decoding
    (``ceil(w / page) + 1`` pages each) while at most ``step_rows`` rows (default: all) add
    ``step_tokens`` tokens between them in one step; a row adding ``t`` holds at most
    ``ceil((t - 1) / page)`` pages more than decoding, so together at most
    ``ceil(step_tokens / page)`` plus one rounding a row."""
    per_row = window_pages_per_row(window, page_size, 1, max_len)
    rows = max_seqs if step_rows is None else min(max_seqs, step_rows)
    extra = cdiv(step_tokens, page_size) + min(rows, step_tokens)
    return min(max_seqs * per_row + extra, max_seqs * cdiv(max_len, page_size))


def prefix_index_pages(layer_windows: tuple[int | None, ...], page_size: int, max_seqs: int,
                       max_len: int) -> int:
    """The default :func:`create` ``index_pages`` when an engine keeps a prefix cache: the
    window pages of one whole row (every page a prompt of ``max_len`` tokens held at some
    prefill chunk's end, so a later prompt that shares any prefix of it, a system prompt,
    finds the window layers' keys where it diverges) plus a window tail in the largest window
    per four rows (prompts served again, conversations' next turns). Least recently used
    pages go first past it, and a hit keeps its pages recently used."""
    windows = [w for w in layer_windows if w is not None]
    if not windows:
        return 0
    tails = cdiv(max_seqs, 4) * window_pages_per_row(max(windows), page_size, 1, max_len)
    return cdiv(max_len, page_size) + tails
