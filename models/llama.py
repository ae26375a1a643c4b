"""A Flax (linen) decoder of the Llama family that delegates attention to a cache object.

One decoder serves Llama, Qwen2/3, Mistral and Gemma-2/3: their differences are switches of
:class:`models.config.DecoderConfig` (q/k norms, ``(1 + w)`` norms, Gemma's four norms per
layer, GeGLU, embedding scale, soft caps, per-layer windows and local RoPE).

The layers run under ``nn.scan`` over stacked per-layer params, so the HLO holds one layer, not
thirty, and the KV cache rides in the scan *carry*: XLA updates a carried buffer in place,
while a cache passed as scan ``xs``/``ys`` would be copied whole on every step (NOTES.md).
What differs between layers (local vs global RoPE) is chosen by the traced int32 layer counter
from a per-layer constant; a layer's sliding window is the cache's business (the cache is made
with the model's ``layer_windows``).

Every layer hands its RoPE'd q/k and its v to the cache protocol::

    cache, attn = cache.attend(layer_index, q, k, v, step, sm_scale=config.sm_scale,
                               logit_soft_cap=config.attn_logit_softcap)

with ``q [b, t, num_heads, head_dim]``, ``k, v [b, t, num_kv_heads, head_dim]`` and
``layer_index`` the int32 scan counter, so the model never knows how (or whether) KV is stored
(:class:`paxkv.core.protocol.KVCache`); the step's attention plan rides on ``step``.

A prefill step whose plan names ``packed_tokens`` runs everything but attention (embedding,
norms, projections, RoPE, MLP) over its real tokens packed into ``[1, T]``
(:class:`paxkv.core.packing.Packing`) and hands the cache ``[b, t]`` again around ``attend``:
rows of unequal prompts leave a quarter of a call's slots padding, and those layers are nearly
all of its arithmetic.

Params (what the loaders build; ``L`` layers, ``D`` hidden, ``H``/``K`` q/kv heads, ``Dh`` head dim,
``F`` FFN width, ``V`` vocab)::

    embed/embedding [V, D]            final_norm/scale [D]          lm_head [D, V] (untied only)
    layers/input_norm/scale [L, D]    layers/post_attn_norm/scale [L, D]
    layers/pre_ffw_norm/scale, layers/post_ffw_norm/scale [L, D]     (sandwich_norms only)
    layers/attn/{q,k,v}_proj/kernel [L, D, H|K, Dh]  (+ bias [L, H|K, Dh] with attention_bias)
    layers/attn/{q,k}_norm/scale [L, Dh]                             (qk_norm only)
    layers/attn/o_proj/kernel [L, H, Dh, D]
    layers/mlp/{gate,up}_proj/kernel [L, D, F]       layers/mlp/down_proj/kernel [L, F, D]

``post_attn_norm`` is HF's ``post_attention_layernorm`` either way: the MLP's input norm in a
Llama layer, the attention output's norm in a Gemma (sandwich) layer.

RoPE is the rotate-half convention of HF checkpoints; GGUF q/k rows are un-permuted on load.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from paxkv.core.packing import Packing
from paxkv.core.step_info import StepInfo

from .config import DecoderConfig

Cache = Any  # a paxkv.core.protocol.KVCache (or the cache-less paxkv.cache.full.NoCache)
Rope = tuple[jax.Array, jax.Array]  # cos, sin [R, b, t, 1, Dh/2]: R tables (global[, local])

ACTIVATIONS = {"silu": nn.silu, "gelu_tanh": functools.partial(nn.gelu, approximate=True)}


class RMSNorm(nn.Module):
    """Root-mean-square norm times ``offset + weight``, computed in float32 whatever the
    activation dtype (as HF does; Gemma's ``offset`` is 1)."""

    eps: float
    dtype: Any = jnp.float32
    offset: float = 0.0

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """``[..., D] -> [..., D]``."""
        init = nn.initializers.zeros if self.offset else nn.initializers.ones
        scale = self.param("scale", init, (x.shape[-1],), jnp.float32)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = scale.astype(jnp.float32).reshape((1,) * (x.ndim - 1) + (-1,))
        if self.offset:
            scale = self.offset + scale
        return (y * scale).astype(self.dtype)


def rope_tables(config: DecoderConfig, positions: jax.Array, local: bool = False
                ) -> tuple[jax.Array, jax.Array]:
    """int32 ``[b, t]`` positions (-1 = padding, clipped to 0) -> cos, sin ``[b, t, 1, Dh/2]``
    of the global (or, with ``local``, the windowed layers') RoPE."""
    inv_freq = jnp.asarray(config.inv_freq(local))[None, None, :]  # [1, 1, Dh/2]
    angles = jnp.maximum(positions, 0).astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]


def model_rope(config: DecoderConfig, positions: jax.Array) -> Rope:
    """Every RoPE table the layers use, stacked: ``[R, b, t, 1, Dh/2]`` each, R = 2 (global,
    local) when the windowed layers have their own base, else 1."""
    tables = [rope_tables(config, positions)]
    if config.local_rope:
        tables.append(rope_tables(config, positions, local=True))
    return jnp.stack([c for c, _ in tables]), jnp.stack([s for _, s in tables])


def layer_rope(config: DecoderConfig, rope: Rope, layer: jax.Array) -> Rope:
    """The cos, sin ``[b, t, 1, Dh/2]`` of ``layer`` (the traced int32 scan counter): the
    local table on windowed layers when there is one, else the global one."""
    cos, sin = rope
    if cos.shape[0] == 1:
        return cos[0], sin[0]
    local = jnp.asarray(np.asarray(config.windowed, np.int32))[layer]
    return cos[local], sin[local]


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE: ``[b, t, heads, Dh]`` with cos/sin ``[b, t, 1, Dh/2]``, in float32."""
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def _norm(config: DecoderConfig, dtype: Any, name: str) -> RMSNorm:
    return RMSNorm(config.rms_norm_eps, dtype, config.norm_offset, name=name)


class Attention(nn.Module):
    """GQA self-attention whose KV storage, window and softmax live in the cache."""

    config: DecoderConfig
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array, rope: Rope, cache: Cache, layer: jax.Array,
                 step: StepInfo, pack: Packing | None = None) -> tuple[Cache, jax.Array]:
        """x ``[b, t, D]`` (``[1, T, D]`` packed by ``pack``) -> ``(cache, x's shape)``."""
        c = self.config
        proj = lambda heads, name: nn.DenseGeneral(  # noqa: E731
            (heads, c.head_dim), use_bias=c.attention_bias, dtype=self.dtype, name=name)
        q, k = proj(c.num_heads, "q_proj")(x), proj(c.num_kv_heads, "k_proj")(x)
        if c.qk_norm:  # one norm over each head's Dh, before RoPE (Qwen3, Gemma-3)
            q, k = _norm(c, self.dtype, "q_norm")(q), _norm(c, self.dtype, "k_norm")(k)
        cos, sin = layer_rope(c, rope, layer)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = proj(c.num_kv_heads, "v_proj")(x)
        if pack is not None:  # the cache reads and writes by row
            q, k, v = pack.unpack(q), pack.unpack(k), pack.unpack(v)
        cache, out = cache.attend(layer, q, k, v, step, sm_scale=c.sm_scale,
                                  logit_soft_cap=c.attn_logit_softcap)
        if pack is not None:
            out = pack.pack(out)
        out = nn.DenseGeneral(c.hidden_size, axis=(-2, -1), use_bias=False, dtype=self.dtype,
                              name="o_proj")(out.astype(self.dtype))
        return cache, out


class Mlp(nn.Module):
    """Gated feed-forward: ``down(act(gate(x)) * up(x))`` (SwiGLU, or GeGLU for Gemma)."""

    config: DecoderConfig
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """``[b, t, D] -> [b, t, D]``."""
        f = self.config.intermediate_size
        gate = nn.Dense(f, use_bias=False, dtype=self.dtype, name="gate_proj")(x)
        up = nn.Dense(f, use_bias=False, dtype=self.dtype, name="up_proj")(x)
        act = ACTIVATIONS[self.config.hidden_act]
        return nn.Dense(self.config.hidden_size, use_bias=False, dtype=self.dtype,
                        name="down_proj")(act(gate) * up)


class Block(nn.Module):
    """One decoder layer, shaped as a scan body: ``(carry, *broadcast) -> (carry, None)``.

    Llama: ``x += attn(norm(x)); x += mlp(norm(x))``. With ``sandwich_norms`` (Gemma) each
    sublayer's output is normed too before its residual add.
    """

    config: DecoderConfig
    dtype: Any

    @nn.compact
    def __call__(self, carry: tuple[jax.Array, Cache, jax.Array], rope: Rope,
                 step: StepInfo, pack: Packing | None
                 ) -> tuple[tuple[jax.Array, Cache, jax.Array], None]:
        """carry = (hidden ``[b, t, D]`` or packed ``[1, T, D]``, cache, int32 layer index)."""
        x, cache, layer = carry
        c, norm = self.config, functools.partial(_norm, self.config, self.dtype)
        cache, attn = Attention(c, self.dtype, name="attn")(
            norm("input_norm")(x), rope, cache, layer, step, pack)
        if c.sandwich_norms:
            x = x + norm("post_attn_norm")(attn)
            h = norm("pre_ffw_norm")(x)
        else:
            x = x + attn
            h = norm("post_attn_norm")(x)
        out = Mlp(c, self.dtype, name="mlp")(h)
        if c.sandwich_norms:
            out = norm("post_ffw_norm")(out)
        return (x + out, cache, layer + 1), None


def _soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    return x if cap is None else cap * jnp.tanh(x / cap)


class Llama(nn.Module):
    """The decoder: embed -> scanned blocks -> norm -> vocab projection.

    Attributes:
      dtype: activation / matmul dtype; norms, RoPE and logits stay float32.
    """

    config: DecoderConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens: jax.Array, step: StepInfo, cache: Cache, *,
                 all_logits: bool = False, packed_logits: bool = False
                 ) -> tuple[jax.Array, Cache]:
        """tokens int32 ``[b, t]`` -> (float32 logits ``[b, vocab]`` or ``[b, t, vocab]``, cache).

        With ``all_logits=False`` only each row's last real token (``query_lengths - 1``) is
        projected onto the vocabulary: the ``[D, V]`` matmul is the largest in a decode step.
        ``packed_logits`` with ``all_logits`` and a packing step: ``[1, T, vocab]``, packed.
        """
        c = self.config
        pack = Packing.of(step.valid, step.plan.packed_tokens)
        positions = step.positions
        if pack is not None:  # token-wise layers over the real tokens only
            tokens, positions = pack.pack(tokens), pack.pack(positions)
        embed = nn.Embed(c.vocab_size, c.hidden_size, dtype=self.dtype, name="embed")
        x = embed(tokens)
        if c.embed_scale:  # HF rounds sqrt(D) to the activation dtype first (Gemma)
            x = x * jnp.asarray(np.float32(c.hidden_size ** 0.5), self.dtype)
        layers = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                         in_axes=(nn.broadcast, nn.broadcast, nn.broadcast),
                         length=c.num_layers)
        (x, cache, _), _ = layers(c, self.dtype, name="layers")(
            (x, cache, jnp.zeros((), jnp.int32)), model_rope(c, positions), step, pack)
        if pack is not None:
            if not all_logits:
                x = pack.last(x, step.query_lengths)
            elif not packed_logits:
                x = pack.unpack(x)
        elif not all_logits:
            last = jnp.maximum(step.query_lengths - 1, 0)
            x = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]  # [b, D]
        x = _norm(c, self.dtype, "final_norm")(x)
        if c.tie_word_embeddings:
            table = embed.embedding  # [V, D]
            logits = jnp.einsum("...d,vd->...v", x, table.astype(self.dtype),
                                preferred_element_type=jnp.float32)
        else:
            kernel = self.param("lm_head", nn.initializers.lecun_normal(),
                                (c.hidden_size, c.vocab_size), jnp.float32)
            logits = jnp.einsum("...d,dv->...v", x, kernel.astype(self.dtype),
                                preferred_element_type=jnp.float32)
        logits = _soft_cap(logits.astype(jnp.float32), c.final_logit_softcap)
        if pack is not None:  # packed_tokens below the step's tokens: never a silent answer
            logits = jnp.where(pack.overflow, jnp.nan, logits)
        return logits, cache


Decoder = Llama
