"""What the host keeps per cache row between steps: each row's sampling settings and the
token it feeds next.

The jitted steps take these as arrays over every row (``[max_seqs]``), so requests with
different settings share one compiled step; a row's entries are written when a request is
placed in it and reset (greedy) when it is released.
"""

from __future__ import annotations

import numpy as np

from paxkv.core.sampling import RowSampling
from paxkv.engine.requests import Request, RequestTable


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
