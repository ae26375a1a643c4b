"""The XLA attention path (every backend; the fast path on a CPU) and the maths it shares with
the Pallas kernels' references: :mod:`blocks` (masked softmax over gathered blocks, cascade),
:mod:`chunked` (decode over a ragged chunk list, prefill in query tiles)."""
