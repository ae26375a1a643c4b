"""A Flax (linen) Llama decoder that delegates attention to a cache object.

The layers run under ``nn.scan`` over stacked per-layer params, so the HLO holds one layer, not
thirty, and the KV cache rides in the scan *carry*: XLA updates a carried buffer in place,
while a cache passed as scan ``xs``/``ys`` would be copied whole on every step (NOTES.md).

Every layer hands its RoPE'd q/k and its v to the cache protocol::

    cache, attn = cache.attend(layer_index, q, k, v, step, sm_scale=head_dim ** -0.5)

with ``q [b, t, num_heads, head_dim]``, ``k, v [b, t, num_kv_heads, head_dim]`` and
``layer_index`` the int32 scan counter, so the model never knows how (or whether) KV is stored
(:class:`paxkv.core.protocol.KVCache`); the step's attention plan rides on ``step``.

Params (what the loaders build; ``L`` layers, ``D`` hidden, ``H``/``K`` q/kv heads, ``Dh`` head dim,
``F`` FFN width, ``V`` vocab)::

    embed/embedding [V, D]            final_norm/scale [D]          lm_head [D, V] (untied only)
    layers/input_norm/scale [L, D]    layers/post_attn_norm/scale [L, D]
    layers/attn/{q,k,v}_proj/kernel [L, D, H|K, Dh]  (+ bias [L, H|K, Dh] with attention_bias)
    layers/attn/o_proj/kernel [L, H, Dh, D]
    layers/mlp/{gate,up}_proj/kernel [L, D, F]       layers/mlp/down_proj/kernel [L, F, D]

RoPE is the rotate-half convention of HF checkpoints; GGUF q/k rows are un-permuted on load.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from .config import LlamaConfig
from paxkv.core.step_info import StepInfo

Cache = Any  # a paxkv.core.protocol.KVCache (or the cache-less paxkv.cache.full.NoCache)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 whatever the activation dtype (as HF does)."""

    eps: float
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """``[..., D] -> [..., D]``."""
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = scale.astype(jnp.float32).reshape((1,) * (x.ndim - 1) + (-1,))
        return (y * scale).astype(self.dtype)


def rope_tables(config: LlamaConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """int32 ``[b, t]`` positions (-1 = padding, clipped to 0) -> cos, sin ``[b, t, 1, Dh/2]``."""
    inv_freq = jnp.asarray(config.inv_freq())[None, None, :]  # [1, 1, Dh/2]
    angles = jnp.maximum(positions, 0).astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE: ``[b, t, heads, Dh]`` with cos/sin ``[b, t, 1, Dh/2]``, in float32."""
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class Attention(nn.Module):
    """GQA self-attention whose KV storage and softmax live in the cache."""

    config: LlamaConfig
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, cache: Cache,
                 layer: jax.Array, step: StepInfo) -> tuple[Cache, jax.Array]:
        """x ``[b, t, D]`` -> ``(cache, [b, t, D])``."""
        c = self.config
        proj = lambda heads, name: nn.DenseGeneral(  # noqa: E731
            (heads, c.head_dim), use_bias=c.attention_bias, dtype=self.dtype, name=name)
        q = apply_rope(proj(c.num_heads, "q_proj")(x), cos, sin)
        k = apply_rope(proj(c.num_kv_heads, "k_proj")(x), cos, sin)
        v = proj(c.num_kv_heads, "v_proj")(x)
        cache, out = cache.attend(layer, q, k, v, step, sm_scale=c.head_dim ** -0.5)
        out = nn.DenseGeneral(c.hidden_size, axis=(-2, -1), use_bias=False, dtype=self.dtype,
                              name="o_proj")(out.astype(self.dtype))
        return cache, out


class Mlp(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    config: LlamaConfig
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """``[b, t, D] -> [b, t, D]``."""
        f = self.config.intermediate_size
        gate = nn.Dense(f, use_bias=False, dtype=self.dtype, name="gate_proj")(x)
        up = nn.Dense(f, use_bias=False, dtype=self.dtype, name="up_proj")(x)
        return nn.Dense(self.config.hidden_size, use_bias=False, dtype=self.dtype,
                        name="down_proj")(nn.silu(gate) * up)


class Block(nn.Module):
    """One decoder layer, shaped as a scan body: ``(carry, *broadcast) -> (carry, None)``."""

    config: LlamaConfig
    dtype: Any

    @nn.compact
    def __call__(self, carry: tuple[jax.Array, Cache, jax.Array], cos: jax.Array,
                 sin: jax.Array, step: StepInfo) -> tuple[tuple[jax.Array, Cache, jax.Array], None]:
        """carry = (hidden ``[b, t, D]``, cache, int32 layer index)."""
        x, cache, layer = carry
        eps = self.config.rms_norm_eps
        h = RMSNorm(eps, self.dtype, name="input_norm")(x)
        cache, attn = Attention(self.config, self.dtype, name="attn")(
            h, cos, sin, cache, layer, step)
        x = x + attn
        h = RMSNorm(eps, self.dtype, name="post_attn_norm")(x)
        x = x + Mlp(self.config, self.dtype, name="mlp")(h)
        return (x, cache, layer + 1), None


class Llama(nn.Module):
    """The decoder: embed -> scanned blocks -> norm -> vocab projection.

    Attributes:
      dtype: activation / matmul dtype; norms, RoPE and logits stay float32.
    """

    config: LlamaConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array, step: StepInfo, cache: Cache, *,
                 all_logits: bool = False) -> tuple[jax.Array, Cache]:
        """tokens int32 ``[b, t]`` -> (float32 logits ``[b, vocab]`` or ``[b, t, vocab]``, cache).

        With ``all_logits=False`` only each row's last real token (``query_lengths - 1``) is
        projected onto the vocabulary: the ``[D, V]`` matmul is the largest in a decode step.
        """
        c = self.config
        embed = nn.Embed(c.vocab_size, c.hidden_size, dtype=self.dtype, name="embed")
        x = embed(tokens)
        cos, sin = rope_tables(c, step.positions)
        layers = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                         in_axes=(nn.broadcast, nn.broadcast, nn.broadcast), length=c.num_layers)
        (x, cache, _), _ = layers(c, self.dtype, name="layers")(
            (x, cache, jnp.zeros((), jnp.int32)), cos, sin, step)
        if not all_logits:
            last = jnp.maximum(step.query_lengths - 1, 0)
            x = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]  # [b, D]
        x = RMSNorm(c.rms_norm_eps, self.dtype, name="final_norm")(x)
        if c.tie_word_embeddings:
            table = embed.embedding  # [V, D]
            logits = jnp.einsum("...d,vd->...v", x, table.astype(self.dtype),
                                preferred_element_type=jnp.float32)
        else:
            kernel = self.param("lm_head", nn.initializers.lecun_normal(),
                                (c.hidden_size, c.vocab_size), jnp.float32)
            logits = jnp.einsum("...d,dv->...v", x, kernel.astype(self.dtype),
                                preferred_element_type=jnp.float32)
        return logits.astype(jnp.float32), cache
