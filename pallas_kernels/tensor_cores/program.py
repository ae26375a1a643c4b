"""What one tensor-core decode program is given (:mod:`pallas_kernels.tensor_cores.decode`):
its static geometry and options, its share of a row (traced scalars) and the compute side's
scratch, so the kernel body passes three objects where it passed nineteen arguments."""

from __future__ import annotations

import dataclasses
from typing import Any

from pallas_kernels._tiles import KVTiles


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """A decode program's static geometry and options (the kernel's closure)."""

    tiles: KVTiles
    group: int
    group_pad: int  # output rows written back: the group rounded up to 8
    stages: int
    num_splits: int  # each row's own blocks are shared out among them
    min_blocks: int  # ... at least this many a split
    sm_scale: float
    soft_cap: float | None
    stream_only: bool
    producer: bool  # a second warpgroup issues every copy (warp specialisation)
    table_span: int = 0  # block-table columns a split's producer copies to SMEM

    @property
    def max_split_blocks(self) -> int:
        """The most blocks a split can get (a row as long as the table)."""
        total = -(-self.tiles.max_pages // self.tiles.pages_per_block)
        return max(-(-total // self.num_splits), self.min_blocks)


@dataclasses.dataclass(frozen=True)
class RowShare:
    """What one program reads: sequence ``b``'s kv head ``h``, split ``split`` of it, which runs
    blocks ``start .. start + n_blocks`` of the row's ``length`` tokens (traced scalars)."""

    b: Any
    h: Any
    split: Any
    length: Any
    start: Any
    n_blocks: Any
    live_pages: Any
    layer: Any


@dataclasses.dataclass(frozen=True)
class ComputeSmem:
    """The compute side's scratch: q, the transposed keys (interpret only), the probabilities,
    the output, the split's statistics, q's barrier and the stages' release barriers (a
    producer's only)."""

    q: Any
    kt: Any
    p: Any
    o: Any
    stats: Any
    q_bar: Any
    consumed: Any
