"""Interpret-mode plumbing for the Mosaic GPU kernels: the one private JAX import lives here.

jax 0.10.2 runs ``plgpu`` kernels on CPU when given ``interpret=InterpretGPUParams()``: every
ref access becomes a host callback against simulated GMEM/SMEM (uninitialised memory is NaN,
out-of-bounds reads raise), TMA copies and mbarriers are simulated, grid points run one after
another. What that interpreter cannot do, checked on this version, and how the kernels here
step around it:

- ``plgpu.layout_cast`` (and ``plgpu.broadcasted_iota(..., layout=)``) has no CPU lowering.
  Layouts only steer register placement on the GPU, never values, so :class:`Layouts` drops
  them in interpret mode and applies them when compiling for CUDA.
- ``plgpu.load`` is not interpreted: kernels read SMEM with ``ref[...]`` plus a layout cast.
- ``plgpu.wgmma`` is interpreted only for plain SMEM operands: a ``plgpu.transpose_ref``
  operand (needed for ``Q @ K^T``) fails in the interpreter, and a register LHS (``P @ V``)
  is read as an SMEM allocation. The attention kernels therefore do their two contractions
  on CUDA cores (broadcast-multiply + row/column reductions), the design FlashInfer and vLLM
  use for decode, and the one whose every instruction is exercised on CPU.
- ``pl.program_id`` always reads 0: kernels use ``lax.axis_index`` over named grid axes.
- Barriers passed as ``pl.kernel(scratch_types=...)`` are not interpreted: kernels allocate
  SMEM and barriers with ``pl.run_scoped`` inside the body (what ``plgpu.kernel`` does).
- A ``jax.new_ref`` handed to a kernel for in-place update must say ``memory_space=GMEM``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax import lax
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as _interp_call
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

__all__ = ["InterpretGPUParams", "Layouts", "interpret_params", "races_found",
           "reset_interpret_state"]

Interpret = bool | InterpretGPUParams


def interpret_params(interpret: Interpret) -> InterpretGPUParams | None:
    """``False`` -> compile for the GPU; ``True`` -> default interpreter; or pass your own
    :class:`InterpretGPUParams` (e.g. ``detect_races=True``)."""
    if isinstance(interpret, InterpretGPUParams):
        return interpret
    if interpret is True:
        return InterpretGPUParams()
    if interpret is False or interpret is None:
        return None
    raise TypeError(f"interpret must be a bool or InterpretGPUParams, got {interpret!r}")


def reset_interpret_state() -> None:
    """Clears the interpreter's global state; needed after a kernel raised in interpret mode."""
    _interp_call.reset_gpu_interpret_mode_state()


def races_found() -> bool:
    """Whether the last kernel run with ``InterpretGPUParams(detect_races=True)`` raced."""
    return bool(_interp_call.get_races().races_found)


@dataclasses.dataclass(frozen=True)
class Layouts:
    """Register layouts for a ``[rows, head_dim]`` tile in the WGMMA layout and its two
    reductions, applied only when compiling (see the module docstring)."""

    interpret: bool

    tile = plgpu.Layout.WGMMA  # [rows, head_dim]; rows % 64 == 0
    row = plgpu.Layout.WGMMA.reduce(1)  # [rows]: one value per key (scores)
    col = plgpu.Layout.WGMMA.reduce(0)  # [head_dim]: one value per feature (q, acc)

    def cast(self, x: jax.Array, layout: Any) -> jax.Array:
        return x if self.interpret else plgpu.layout_cast(x, layout)

    def load(self, ref, idx, layout: Any) -> jax.Array:
        """``ref[idx]`` in ``layout``: the cast must directly follow the read to steer it."""
        return self.cast(ref[idx], layout)

    def iota(self, shape: tuple[int, ...], dim: int, layout: Any) -> jax.Array:
        if self.interpret:
            return lax.broadcasted_iota(jax.numpy.int32, shape, dim)
        return plgpu.broadcasted_iota(jax.numpy.int32, shape, dim, layout=layout)
