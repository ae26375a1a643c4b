"""Reads an HF checkpoint folder (``config.json`` + ``*.safetensors`` + tokenizer files).

Tensors are memory-mapped straight from the safetensors files (the format is an 8-byte header
length, a JSON index, then raw little-endian arrays), one at a time, so a sharded bf16
checkpoint is never fully resident twice; bfloat16 / float8 read through ``ml_dtypes``, which
safetensors' own numpy API cannot. They share the param builder with the GGUF loader.
HF checkpoints already use rotate-half RoPE order, so nothing is permuted here. What each
family's ``config.json`` means is :mod:`models.families`.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .config import DecoderConfig
from .families import SUPPORTED_MODEL_TYPES, config_from_dict
from .params import Params, build_params

__all__ = ["SUPPORTED_MODEL_TYPES", "config_from_dict", "config_from_hf", "hf_name",
           "load_hf_folder", "read_tensor", "safetensors_index",
           "weight_files"]

_LAYER_NAMES = {
    "input_norm": "input_layernorm.weight", "post_attn_norm": "post_attention_layernorm.weight",
    "pre_ffw_norm": "pre_feedforward_layernorm.weight",
    "post_ffw_norm": "post_feedforward_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight", "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight", "o_proj": "self_attn.o_proj.weight",
    "q_proj.bias": "self_attn.q_proj.bias", "k_proj.bias": "self_attn.k_proj.bias",
    "v_proj.bias": "self_attn.v_proj.bias", "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight", "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight", "down_proj": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
                 "lm_head": "lm_head.weight"}
_INDEX = "model.safetensors.index.json"
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


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


def config_from_hf(folder: str) -> DecoderConfig:
    """Builds the :class:`DecoderConfig` from ``config.json`` (and ``generation_config.json``)."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in {folder!r}")
    gen_path = os.path.join(folder, "generation_config.json")
    gen = _read_json(gen_path) if os.path.isfile(gen_path) else {}
    return config_from_dict(_read_json(path), gen.get("eos_token_id"), folder)


def weight_files(folder: str) -> list[str]:
    """The folder's ``*.safetensors`` files; a ``FileNotFoundError`` naming what is missing
    (no weights at all, only PyTorch ``.bin`` weights, or a shard the index lists)."""
    index = os.path.join(folder, _INDEX)
    if os.path.isfile(index):
        shards = sorted(set(_read_json(index)["weight_map"].values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(folder, s))]
        if missing:
            raise FileNotFoundError(f"{folder!r}: {_INDEX} lists weight file(s) that are "
                                    f"missing: {', '.join(missing)}")
        return [os.path.join(folder, s) for s in shards]
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        other = sorted(os.path.basename(f) for f in glob.glob(os.path.join(folder, "*.bin")))
        found = f" (found only {', '.join(other)}; paxkv reads safetensors)" if other else ""
        raise FileNotFoundError(f"no model.safetensors (or *.safetensors weights) in "
                                f"{folder!r}{found}")
    return files


def safetensors_index(path: str) -> dict[str, tuple[str, str, tuple[int, ...], int]]:
    """Tensor name -> ``(path, safetensors dtype, shape, byte offset)`` from a file's header."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return {name: (path, spec["dtype"], tuple(spec["shape"]), 8 + size + spec["data_offsets"][0])
            for name, spec in header.items()}


def read_tensor(entry: tuple[str, str, tuple[int, ...], int], name: str = "") -> np.ndarray:
    """One :func:`safetensors_index` entry as a float32 copy (memory-mapped, then widened; a
    copy, so no param ever aliases the file)."""
    path, dtype, shape, offset = entry
    if dtype not in _DTYPES:
        raise ValueError(f"{path!r}: tensor {name!r} has dtype {dtype}, which paxkv cannot read "
                         f"(supported: {', '.join(_DTYPES)})")
    return np.array(np.memmap(path, _DTYPES[dtype], "r", offset=offset, shape=shape),
                    np.float32)


def load_hf_folder(folder: str | os.PathLike, dtype: Any = jnp.float32
                   ) -> tuple[DecoderConfig, Params]:
    """``folder`` -> (config, params cast to ``dtype``)."""
    folder = os.fspath(folder)
    config = config_from_hf(folder)
    where = {name: t for f in weight_files(folder) for name, t in safetensors_index(f).items()}

    def fetch(name: str) -> np.ndarray:
        tensor = hf_name(name)
        if tensor not in where:
            raise ValueError(f"{folder!r} has no tensor {tensor!r}")
        return read_tensor(where[tensor], tensor)

    return config, build_params(config, fetch, dtype)
