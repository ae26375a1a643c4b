"""Stacks per-layer checkpoint tensors into the Flax param tree of :class:`models.llama.Llama`.

Both loaders (GGUF and HF safetensors) speak one vocabulary here: a ``fetch(name)`` that returns
one float32 numpy tensor in HF orientation (``[out, in]`` for matrices). Tensors are fetched one
at a time and copied straight into preallocated ``[L, ...]`` stacks, so peak host memory is the
float32 model plus one tensor, never a list of layers plus their stack.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from .config import DecoderConfig

Fetch = Callable[[str], np.ndarray]
Params = dict[str, Any]


def _layer_layout(c: DecoderConfig
                  ) -> dict[tuple[str, ...], tuple[str, tuple[int, ...], Callable]]:
    """Flax path under ``layers`` -> (checkpoint name, HF shape, HF -> Flax transform); the
    per-head q/k norms (``qk_norm``) and Gemma's feed-forward norms (``sandwich_norms``) only
    where the config has them."""
    d, dh, f = c.hidden_size, c.head_dim, c.intermediate_size
    h, k = c.num_heads, c.num_kv_heads
    heads_in = lambda n: lambda w: w.T.reshape(d, n, dh)  # noqa: E731  [n*Dh, D] -> [D, n, Dh]
    layout = {
        ("input_norm", "scale"): ("input_norm", (d,), lambda w: w),
        ("post_attn_norm", "scale"): ("post_attn_norm", (d,), lambda w: w),
        ("attn", "q_proj", "kernel"): ("q_proj", (h * dh, d), heads_in(h)),
        ("attn", "k_proj", "kernel"): ("k_proj", (k * dh, d), heads_in(k)),
        ("attn", "v_proj", "kernel"): ("v_proj", (k * dh, d), heads_in(k)),
        ("attn", "o_proj", "kernel"): ("o_proj", (d, h * dh), lambda w: w.T.reshape(h, dh, d)),
        ("mlp", "gate_proj", "kernel"): ("gate_proj", (f, d), lambda w: w.T),
        ("mlp", "up_proj", "kernel"): ("up_proj", (f, d), lambda w: w.T),
        ("mlp", "down_proj", "kernel"): ("down_proj", (d, f), lambda w: w.T),
    }
    if c.attention_bias:
        for proj, n in (("q_proj", h), ("k_proj", k), ("v_proj", k)):
            layout[("attn", proj, "bias")] = (f"{proj}.bias", (n * dh,),
                                              lambda w, n=n: w.reshape(n, dh))
    if c.qk_norm:
        for name in ("q_norm", "k_norm"):
            layout[("attn", name, "scale")] = (name, (dh,), lambda w: w)
    if c.sandwich_norms:
        for name in ("pre_ffw_norm", "post_ffw_norm"):
            layout[(name, "scale")] = (name, (d,), lambda w: w)
    return layout


def checkpoint_shapes(config: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor :func:`build_params` fetches -> its HF-orientation shape, in fetch order:
    ``embed``, ``final_norm``, ``lm_head`` (untied heads only), then ``layers.{i}.{name}``
    for each layer. Writers of synthetic checkpoints (test oracles, GPU experiments that cannot
    ship the GGUF) draw their tensors from it, so they cannot drift from what the loaders read.
    """
    c = config
    shapes = {"embed": (c.vocab_size, c.hidden_size), "final_norm": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head"] = (c.vocab_size, c.hidden_size)
    layout = _layer_layout(c).values()
    for i in range(c.num_layers):
        shapes.update({f"layers.{i}.{name}": shape for name, shape, _ in layout})
    return shapes


def _checked(fetch: Fetch, name: str, shape: tuple[int, ...]) -> np.ndarray:
    w = fetch(name)
    if tuple(w.shape) != shape:
        raise ValueError(f"tensor {name!r} has shape {tuple(w.shape)}, expected {shape} "
                         "from the model config")
    return w


def build_params(config: DecoderConfig, fetch: Fetch, dtype: Any = jnp.float32) -> Params:
    """Assembles the param tree, casting every leaf to ``dtype``.

    Args:
      fetch: ``fetch("embed")``, ``fetch("final_norm")``, ``fetch("lm_head")`` (untied only) and
        ``fetch(f"layers.{i}.{name}")`` for each per-layer name (``q_proj``, ``q_proj.bias``,
        ``input_norm``, ...), each a float32 array in HF orientation.

    Returns:
      ``{"params": {...}}`` with the layout documented in :mod:`models.llama`.
    """
    c = config
    layers: dict[str, Any] = {}
    for path, (name, shape, to_flax) in _layer_layout(c).items():
        stack = None
        for i in range(c.num_layers):
            w = to_flax(_checked(fetch, f"layers.{i}.{name}", shape).astype(np.float32))
            if stack is None:
                stack = np.empty((c.num_layers, *w.shape), np.float32)
            stack[i] = w
        node = layers
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = jnp.asarray(stack, dtype=dtype)
        del stack
    params: Params = {
        "embed": {"embedding": jnp.asarray(
            _checked(fetch, "embed", (c.vocab_size, c.hidden_size)), dtype=dtype)},
        "layers": layers,
        "final_norm": {"scale": jnp.asarray(
            _checked(fetch, "final_norm", (c.hidden_size,)), dtype=dtype)},
    }
    if not c.tie_word_embeddings:
        params["lm_head"] = jnp.asarray(
            _checked(fetch, "lm_head", (c.vocab_size, c.hidden_size)).T, dtype=dtype)
    return {"params": params}
