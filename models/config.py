"""The architecture of a decoder of the Llama family tree, as one hashable value.

``DecoderConfig`` (also ``LlamaConfig``, its first name) is frozen and holds only Python
scalars and tuples, so it hashes and can ride as a static ``jax.jit`` argument or a Flax module
field; changing it means a different model, and so a recompile, never a silently reused trace.

One decoder serves every family; what sets a family apart is a switch here
(:mod:`models.families` maps each HF ``config.json`` onto them)::

    family       qk_norm  norm_offset  sandwich_norms  hidden_act  embed_scale  softcaps  windows
    llama/qwen2  -        0            -               silu        -            -         -
    qwen3        yes      0            -               silu        -            -         (opt.)
    mistral      -        0            -               silu        -            -         all layers
    gemma2       -        1            yes             gelu_tanh   yes          attn+final alternate
    gemma3_text  yes      1            yes             gelu_tanh   yes          (final)   5 : 1
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

HIDDEN_ACTS = ("silu", "gelu_tanh")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style RoPE frequency scaling (``rope_type == "llama3"`` in HF configs)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class LinearRopeScaling:
    """Linear (position interpolation) scaling, ``rope_type == "linear"``: every inverse
    frequency divided by ``factor`` (Gemma-3's global layers)."""

    factor: float


Scaling = RopeScaling | LinearRopeScaling


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Shapes, constants and family switches of a decoder.

    Attributes:
      rope_scaling: ``None`` for plain RoPE, or the (global layers') scaling.
      rope_freq_factors: per-frequency divisors (``head_dim // 2`` of them), as GGUF files from
        llama.cpp store Llama-3 scaling (the ``rope_freqs`` tensor); ``None`` when absent.
      attention_bias: q/k/v projections carry a bias (Qwen2).
      eos_token_ids: every id that ends a turn (a model may have several).
      qk_norm: an RMSNorm over each head of q and of k (weights ``[head_dim]``), before RoPE.
      norm_offset: every RMSNorm multiplies by ``norm_offset + weight`` (Gemma: 1).
      sandwich_norms: Gemma's four norms per layer: the attention and MLP outputs are normed
        before their residual adds, and a separate norm feeds the MLP.
      hidden_act: the gated MLP's activation, one of :data:`HIDDEN_ACTS`.
      embed_scale: embeddings times ``sqrt(hidden_size)`` (in the activation dtype).
      attn_logit_softcap: attention scores become ``cap * tanh(score / cap)`` (None: off).
      final_logit_softcap: the same on the output logits.
      query_pre_attn_scalar: the softmax scale is its ``** -0.5`` (None: ``head_dim ** -0.5``).
      layer_windows: per layer, None (global attention) or ``w``: a query sees its last ``w``
        tokens, itself included (HF's ``kv_idx > q_idx - w``); None when no layer slides. The
        cache applies them (the model only declares them).
      local_rope_theta: RoPE base of the windowed (local) layers, None when they share the
        global table; ``local_rope_scaling`` is their scaling.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: Scaling | None = None
    rope_freq_factors: tuple[float, ...] | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    qk_norm: bool = False
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    hidden_act: str = "silu"
    embed_scale: bool = False
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    query_pre_attn_scalar: float | None = None
    layer_windows: tuple[int | None, ...] | None = None
    local_rope_theta: float | None = None
    local_rope_scaling: Scaling | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(f"rope_freq_factors has {len(self.rope_freq_factors)} entries, "
                             f"expected head_dim // 2 = {self.head_dim // 2}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not one of {HIDDEN_ACTS}")
        windows = self.layer_windows
        if windows is not None and (len(windows) != self.num_layers or any(
                w is not None and (not isinstance(w, int) or w < 1) for w in windows)):
            raise ValueError(f"layer_windows={windows!r}: expected {self.num_layers} entries, "
                             "each None or an int >= 1")

    @property
    def sm_scale(self) -> float:
        """The softmax scale every layer passes to ``cache.attend``."""
        scalar = self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar
        return float(scalar) ** -0.5

    @property
    def windowed(self) -> tuple[bool, ...]:
        """Per layer: whether it attends through a sliding window (a local layer)."""
        return tuple(w is not None for w in (self.layer_windows or (None,) * self.num_layers))

    @property
    def local_rope(self) -> bool:
        """Whether the windowed layers use a RoPE table of their own."""
        return self.local_rope_theta is not None and any(self.windowed)

    def inv_freq(self, local: bool = False) -> np.ndarray:
        """float32 ``[head_dim // 2]``: RoPE inverse frequencies of the global (or, with
        ``local``, the windowed) layers, scaling applied.

        Computed in float64 and rounded once, so it matches HF's float32 table to the last bit
        or one ulp; a constant at trace time, never recomputed per step.
        """
        dim = self.head_dim
        theta = self.local_rope_theta if local else self.rope_theta
        scaling = self.local_rope_scaling if local else self.rope_scaling
        inv = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
        if isinstance(scaling, RopeScaling):
            inv = _llama3_scale(inv, scaling)
        elif isinstance(scaling, LinearRopeScaling):
            inv = inv / scaling.factor
        if self.rope_freq_factors is not None and not local:
            inv = inv / np.asarray(self.rope_freq_factors, np.float64)
        return inv.astype(np.float32)


LlamaConfig = DecoderConfig


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
