"""Reads an HF checkpoint folder (``config.json`` + ``*.safetensors`` + tokenizer files).

Tensors are read lazily with safetensors' numpy API (one at a time, so a sharded bf16
checkpoint is never fully resident twice) and share the param builder with the GGUF loader.
HF checkpoints already use rotate-half RoPE order, so nothing is permuted here.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from .config import LlamaConfig, RopeScaling
from .params import Params, build_params

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")

_LAYER_NAMES = {
    "input_norm": "input_layernorm.weight", "post_attn_norm": "post_attention_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight", "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight", "o_proj": "self_attn.o_proj.weight",
    "q_proj.bias": "self_attn.q_proj.bias", "k_proj.bias": "self_attn.k_proj.bias",
    "v_proj.bias": "self_attn.v_proj.bias", "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight", "down_proj": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
                 "lm_head": "lm_head.weight"}


def hf_name(name: str) -> str:
    """A :mod:`models.params` fetch name -> the HF checkpoint's tensor name
    (``layers.3.q_proj`` -> ``model.layers.3.self_attn.q_proj.weight``)."""
    if name.startswith("layers."):
        _, layer, short = name.split(".", 2)
        return f"model.layers.{layer}.{_LAYER_NAMES[short]}"
    return _GLOBAL_NAMES[name]


def _read_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _rope(cfg: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from either ``rope_scaling`` (older files) or ``rope_parameters``."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or params
    theta = float(cfg.get("rope_theta", params.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ValueError(f"{source!r}: RoPE scaling {kind!r} is not supported (only llama3)")
    return theta, RopeScaling(
        factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def config_from_hf(folder: str) -> LlamaConfig:
    """Builds the :class:`LlamaConfig` from ``config.json`` (and ``generation_config.json``)."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in {folder!r}")
    gen_path = os.path.join(folder, "generation_config.json")
    gen = _read_json(gen_path) if os.path.isfile(gen_path) else {}
    return config_from_dict(_read_json(path), gen.get("eos_token_id"), folder)


def config_from_dict(cfg: dict[str, Any], extra_eos: Any = None, source: str = "<config>"
                     ) -> LlamaConfig:
    """An HF ``config.json`` dict (or ``PretrainedConfig.to_dict()``) -> :class:`LlamaConfig`.

    ``extra_eos``: generation-config EOS id(s), listed before the model config's own.
    """
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{source!r}: model_type {model_type!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if cfg.get("mlp_bias"):
        raise ValueError(f"{source!r}: mlp_bias=True is not supported")
    theta, scaling = _rope(cfg, source)
    heads = int(cfg["num_attention_heads"])
    return LlamaConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(
            _as_ids(extra_eos) + _as_ids(cfg.get("eos_token_id")))),
    )


def load_hf_folder(folder: str | os.PathLike, dtype: Any = jnp.float32
                   ) -> tuple[LlamaConfig, Params]:
    """``folder`` -> (config, params cast to ``dtype``)."""
    folder = os.fspath(folder)
    config = config_from_hf(folder)
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder!r}")
    handles = [safe_open(f, framework="numpy") for f in files]
    where = {name: h for h in handles for name in h.keys()}

    def fetch(name: str) -> np.ndarray:
        tensor = hf_name(name)
        if tensor not in where:
            raise ValueError(f"{folder!r} has no tensor {tensor!r}")
        return np.asarray(where[tensor].get_tensor(tensor), dtype=np.float32)

    return config, build_params(config, fetch, dtype)
