"""Reads a llama.cpp GGUF file: config from metadata, weights dequantised to float32.

Weights are dequantised one tensor at a time (``gguf.quants.dequantize``) straight into the
stacked param tree, so a quantised file never sits in memory as float32 twice.

llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` (llama arch only; qwen2/3
and gemma2/3 are stored as-is) so its RoPE can rotate adjacent pairs; we undo that here and use
HF's rotate-half RoPE, so GGUF and HF checkpoints share one model. Within each head, GGUF row
``2i + j`` holds HF row ``j * Dh/2 + i``::

    one head, Dh = 8:  GGUF row  0 1 2 3 4 5 6 7
                       HF row    0 4 1 5 2 6 3 7   (pairs (x_i, x_{i+Dh/2}) made adjacent)

Gemma files keep llama.cpp's conventions: norm weights stored as ``1 + w``, the sliding-window
layout as a pattern (every 2nd / 6th layer global), and the 27B models' softmax scale
``(hidden / heads) ** -0.5`` implied by their layer count. What a Gemma-3 file leaves out takes
HF's ``Gemma3TextConfig`` defaults, as transformers' GGUF loader does: local RoPE base 10,000
(unless ``rope.freq_base_swa``), ``query_pre_attn_scalar`` = head_dim, no final soft cap (unless
``final_logit_softcapping``); tied embeddings when there is no ``output.weight``. Gemma-3 270M in
Q4_K_M (``tests/test_gemma3_real.py``) matches HF's logits to ~3e-6 per row.

Every tensor type the installed ``gguf`` library dequantises loads (:data:`SUPPORTED_TYPES`,
asked of the library, not listed here); another fails before any weight is read, naming it.
"""

from __future__ import annotations

import os
from importlib.metadata import version
from typing import Any

import gguf
import jax.numpy as jnp
import numpy as np

from .config import DecoderConfig, LinearRopeScaling
from .params import Params, build_params


def _dequantizable() -> frozenset[gguf.GGMLQuantizationType]:
    """Every tensor type the installed ``gguf`` library dequantises, asked of the library: one
    all-zero block of each type it knows the size of, through ``gguf.quants.dequantize``."""
    readable = set()
    for qtype, (_, nbytes) in gguf.GGML_QUANT_SIZES.items():
        try:
            gguf.quants.dequantize(np.zeros((1, nbytes), np.uint8), qtype)
        except (NotImplementedError, ValueError):  # gguf-py: "not yet implemented"
            continue
        readable.add(qtype)
    return frozenset(readable)


SUPPORTED_TYPES = _dequantizable()
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")

_LAYER_NAMES = {
    "input_norm": "attn_norm.weight", "post_attn_norm": "ffn_norm.weight",
    "q_proj": "attn_q.weight", "k_proj": "attn_k.weight", "v_proj": "attn_v.weight",
    "o_proj": "attn_output.weight", "gate_proj": "ffn_gate.weight", "up_proj": "ffn_up.weight",
    "down_proj": "ffn_down.weight", "q_proj.bias": "attn_q.bias", "k_proj.bias": "attn_k.bias",
    "v_proj.bias": "attn_v.bias", "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
}
# Gemma's four norms: its "ffn_norm" is the MLP's input norm (a Llama's post-attention norm).
_GEMMA_LAYER_NAMES = {**_LAYER_NAMES, "post_attn_norm": "post_attention_norm.weight",
                      "pre_ffw_norm": "ffn_norm.weight", "post_ffw_norm": "post_ffw_norm.weight"}
_GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}  # every n-th layer global (llama.cpp's swa pattern)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp scales 27B by hidden / heads
_GLOBAL_NAMES = {"embed": "token_embd.weight", "final_norm": "output_norm.weight",
                 "lm_head": "output.weight"}


def open_gguf(path: str | os.PathLike) -> gguf.GGUFReader:
    """Parses the header and tensor index, turning the reader's low-level errors into clear ones.

    Raises:
      FileNotFoundError: no file at ``path``.
      ValueError: the file is not GGUF, or is truncated or corrupt (names the file and why).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no GGUF file at {path!r}")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path!r} is not a GGUF file: it starts with {magic!r}, not b'GGUF' "
                         f"({size} bytes)")
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError, MemoryError) as e:
        raise ValueError(f"{path!r} is truncated or corrupt ({size} bytes): the GGUF header or "
                         f"tensor index cannot be parsed ({type(e).__name__}: {e})") from e
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != int(t.n_bytes):
            raise ValueError(f"{path!r} is truncated: tensor {t.name!r} needs bytes up to {end} "
                             f"but the file has {size}")
    return reader


def metadata(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """One metadata value as a Python scalar, string or list (``default`` when absent)."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def config_from_gguf(reader: gguf.GGUFReader, path: str = "<gguf>") -> DecoderConfig:
    """Builds the :class:`DecoderConfig` from ``{arch}.*`` and ``tokenizer.ggml.*`` metadata."""
    arch = metadata(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"{path!r}: architecture {arch!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ARCHS)})")

    def need(key: str) -> Any:
        value = metadata(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"{path!r} is missing metadata key {arch}.{key!s}")
        return value

    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path!r} has no token_embd.weight tensor")
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    layers = int(need("block_count"))
    head_dim = int(metadata(reader, f"{arch}.attention.key_length", hidden // heads))
    scalar = hidden // heads if _GEMMA_27B_LAYERS.get(arch) == layers else head_dim
    eos = [metadata(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    if arch in _GEMMA_PATTERN:
        eos.append(_token_id(reader, "<end_of_turn>"))
    return DecoderConfig(
        vocab_size=int(tensors["token_embd.weight"].shape[-1]),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(metadata(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        max_position_embeddings=int(metadata(reader, f"{arch}.context_length", 4096)),
        bos_token_id=metadata(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        **_rope_fields(reader, arch, tensors, path),
        **_gemma_fields(reader, arch, layers, scalar),
    )


def _token_id(reader: gguf.GGUFReader, text: str) -> int | None:
    """The id of the vocabulary's token ``text`` (None if absent). llama.cpp ends a generation
    at Gemma's ``<end_of_turn>`` though its files name only ``<eos>``, as HF's Gemma
    instruction-tuned generation configs do."""
    tokens = metadata(reader, "tokenizer.ggml.tokens") or []
    return tokens.index(text) if text in tokens else None


def _rope_fields(reader: gguf.GGUFReader, arch: str, tensors: dict[str, Any], path: str
                 ) -> dict[str, Any]:
    """RoPE base and scaling: none, linear (``rope.scaling.factor``) or Llama-3 as
    llama.cpp stores it (the ``rope_freqs`` tensor); Gemma-3's local layers have their own
    base (``rope.freq_base_swa``, else llama.cpp's 10000)."""
    kind = metadata(reader, f"{arch}.rope.scaling.type")
    if kind not in (None, "none", "linear"):
        raise ValueError(f"{path!r}: RoPE scaling type {kind!r} is not supported")
    freqs = tensors.get("rope_freqs.weight")
    fields: dict[str, Any] = {
        "rope_theta": float(metadata(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rope_freq_factors": None if freqs is None else tuple(
            float(x) for x in _dequantize(freqs)),
        "rope_scaling": None if kind in (None, "none") else LinearRopeScaling(
            float(metadata(reader, f"{arch}.rope.scaling.factor", 1.0)))}
    if arch == "gemma3":
        fields["local_rope_theta"] = float(metadata(reader, f"{arch}.rope.freq_base_swa", 1e4))
    return fields


def _gemma_fields(reader: gguf.GGUFReader, arch: str, layers: int, scalar: int
                  ) -> dict[str, Any]:
    """A Gemma layer's switches (none for other archs). llama.cpp's converter stores every
    norm weight as ``1 + w``, so the norms here multiply by the weight alone (offset 0)."""
    if arch not in _GEMMA_PATTERN:
        return {}
    window = metadata(reader, f"{arch}.attention.sliding_window")
    pattern = metadata(reader, f"{arch}.attention.sliding_window_pattern", _GEMMA_PATTERN[arch])
    sliding = ([bool(x) for x in pattern] if isinstance(pattern, list)
               else [(i + 1) % int(pattern) != 0 for i in range(layers)])
    cap = metadata(reader, f"{arch}.attn_logit_softcapping") if arch == "gemma2" else None
    final = metadata(reader, f"{arch}.final_logit_softcapping")
    return dict(
        norm_offset=0.0, sandwich_norms=True, hidden_act="gelu_tanh", embed_scale=True,
        query_pre_attn_scalar=float(scalar),
        attn_logit_softcap=None if cap is None else float(cap),
        final_logit_softcap=None if final is None else float(final),
        layer_windows=None if window is None or not any(sliding) else tuple(
            int(window) if s else None for s in sliding))


def _check_types(reader: gguf.GGUFReader, path: str) -> None:
    """Fails before any dequantising if a tensor's type is one we cannot read."""
    for t in reader.tensors:
        if t.tensor_type not in SUPPORTED_TYPES:
            supported = ", ".join(sorted(x.name for x in SUPPORTED_TYPES))
            raise ValueError(f"{path!r}: tensor {t.name!r} has type {t.tensor_type.name}, which "
                             f"the installed gguf library ({version('gguf')}) cannot dequantise "
                             f"(it reads: {supported})")


def _dequantize(t: Any) -> np.ndarray:
    """One GGUF tensor -> float32 numpy in numpy (row-major ``[out, in]``) order."""
    return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row permutation: ``[heads*Dh, ...]`` -> same shape, HF order."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(name: str, arch: str = "llama") -> str:
    """Our name -> the GGUF tensor name (``"layers.3.q_proj"`` -> ``"blk.3.attn_q.weight"``)."""
    if name.startswith("layers."):
        _, layer, short = name.split(".", 2)
        names = _GEMMA_LAYER_NAMES if arch in _GEMMA_PATTERN else _LAYER_NAMES
        return f"blk.{layer}.{names[short]}"
    return _GLOBAL_NAMES[name]


def load_gguf(path: str | os.PathLike, dtype: Any = jnp.float32
              ) -> tuple[DecoderConfig, Params, gguf.GGUFReader]:
    """``path`` -> (config, params cast to ``dtype``, the open reader for the tokenizer)."""
    path = os.fspath(path)
    reader = open_gguf(path)
    _check_types(reader, path)
    config = config_from_gguf(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    arch = metadata(reader, "general.architecture")
    permuted = arch == "llama"

    def fetch(name: str) -> np.ndarray:
        gguf_name = _gguf_name(name, arch)
        if gguf_name not in tensors:
            raise ValueError(f"{path!r} has no tensor {gguf_name!r}")
        w = _dequantize(tensors[gguf_name])
        kind = name.split(".")[2] if name.startswith("layers.") else name
        if permuted and kind in ("q_proj", "k_proj"):
            w = _unpermute(w, config.num_heads if kind == "q_proj" else config.num_kv_heads)
        return w

    return config, build_params(config, fetch, dtype), reader
