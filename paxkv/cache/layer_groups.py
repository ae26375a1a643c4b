"""How a model's layers split into page groups by sliding window, and where each layer's
pages lie in the layer-grouped cache's flat pool (:mod:`paxkv.cache.grouped`)::

    layer_windows (6, None, 6, 3)   ->  group 0: window None, layer 1   (P0 + 1 pages)
                                        group 1: window 3,    layer 3   (P1 + 1 pages)
                                        group 2: window 6,    layers 0, 2 (P2 + 1 pages each)
    flat page axis: [ layer 1 | layer 3 | layer 0 | layer 2 ]   each range's sentinel last

Static (hashable): it rides on the cache as a pytree meta field, so every size here is a
Python int at trace time.
"""

from __future__ import annotations

import dataclasses
import functools


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
