"""The architecture of a Llama-family decoder, as one hashable value.

``LlamaConfig`` is frozen and holds only Python scalars and tuples, so it hashes and can ride as
a static ``jax.jit`` argument or a Flax module field; changing it means a different model, and
so a recompile, never a silently reused trace.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style RoPE frequency scaling (``rope_type == "llama3"`` in HF configs)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shapes and constants of a Llama / Qwen2 decoder.

    Attributes:
      rope_scaling: ``None`` for plain RoPE, or Llama-3 scaling parameters.
      rope_freq_factors: per-frequency divisors (``head_dim // 2`` of them), as GGUF files from
        llama.cpp store Llama-3 scaling (the ``rope_freqs`` tensor); ``None`` when absent.
      attention_bias: q/k/v projections carry a bias (Qwen2).
      eos_token_ids: every id that ends a turn (a model may have several).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rope_freq_factors: tuple[float, ...] | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(f"rope_freq_factors has {len(self.rope_freq_factors)} entries, "
                             f"expected head_dim // 2 = {self.head_dim // 2}")

    def inv_freq(self) -> np.ndarray:
        """float32 ``[head_dim // 2]``: RoPE inverse frequencies, scaling applied.

        Computed in float64 and rounded once, so it matches HF's float32 table to the last bit
        or one ulp; a constant at trace time, never recomputed per step.
        """
        dim = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        if self.rope_scaling is not None:
            inv = _llama3_scale(inv, self.rope_scaling)
        if self.rope_freq_factors is not None:
            inv = inv / np.asarray(self.rope_freq_factors, np.float64)
        return inv.astype(np.float32)


def _llama3_scale(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
    """Llama-3 scaling: long wavelengths divided by ``factor``, short kept, middle blended."""
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
              / (s.high_freq_factor - s.low_freq_factor))
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, blended, scaled)
