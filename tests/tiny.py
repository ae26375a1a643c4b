"""A tiny random Llama (2 layers, 32 wide, byte "tokenizer") for tests about logic, not model
quality: the engine's state machine and soak, the experiments' smoke tests."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from paxkv import models
from paxkv.cache.full import NoCache
from paxkv.models.config import LlamaConfig
from paxkv.models.llama import Llama
from paxkv.core.step_info import StepInfo


class Bytes:
    """Text <-> byte ids: enough tokenizer for prompts and results."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(i % 256 for i in ids).decode("latin-1")


@functools.lru_cache(maxsize=None)
def tiny_lm(eos: tuple[int, ...] = (), scale: float = 0.3,
            windows: tuple[int | None, ...] | None = None) -> models.LanguageModel:
    """Vocab 256, hidden 32, 2 layers (or one per entry of ``windows``: each layer's sliding
    window, None for a global one), 2 query heads over 1 kv head of 16; weights
    N(0, ``scale``) (0.3 soon repeats one token; 1.0 keeps a greedy run varied, so a wrong
    key or value shows in the tokens)."""
    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                      num_layers=2 if windows is None else len(windows), num_heads=2,
                      num_kv_heads=1, head_dim=16, tie_word_embeddings=True, eos_token_ids=eos,
                      layer_windows=windows)
    step = StepInfo.make(jnp.array([4]), jnp.array([4]), 4)
    shapes = jax.eval_shape(lambda: Llama(cfg).init(jax.random.PRNGKey(0),
                                                    jnp.zeros((1, 4), jnp.int32), step, NoCache()))
    rng = np.random.default_rng(0)  # random weights without compiling flax's init
    params = jax.tree.map(lambda s: jnp.asarray(rng.normal(0, scale, s.shape), s.dtype), shapes)
    return models.LanguageModel(cfg, params, Bytes(), "tiny")


@functools.partial(jax.jit, static_argnums=0)
def _all_logits(lm: models.LanguageModel, ids: jax.Array) -> jax.Array:
    n = jnp.array([ids.shape[1]])
    return lm.forward(lm.params, ids, StepInfo.make(n, n, ids.shape[1]),
                      NoCache(layer_windows=lm.layer_windows), all_logits=True)[0]


def full_logits(lm: models.LanguageModel, seq: list[int], multiple: int = 64) -> np.ndarray:
    """float32 ``[len(seq), vocab]``: the cache-less forward's logits at every position of
    ``seq``, the reference the cached paths must equal. Compiled once per ``multiple`` of
    length: ``seq`` is padded at the end, which a causal model's earlier positions never see
    (an eager forward compiles every op again for each new length)."""
    width = -(-len(seq) // multiple) * multiple
    ids = np.zeros((1, width), np.int32)
    ids[0, :len(seq)] = seq
    return np.asarray(_all_logits(lm, jnp.asarray(ids))[0, :len(seq)])
