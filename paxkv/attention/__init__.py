"""The XLA attention path (every backend; the fast path on a CPU) and the maths it shares with
the Pallas kernels' references: :mod:`blocks` (masked softmax over gathered blocks, cascade),
:mod:`chunked` (decode over a ragged chunk list), :mod:`query_tiles` (prefill one row's query tile
at a time), :mod:`paged_xla` (the paged cache's use of both), :mod:`plan` (the per-step plan)."""
