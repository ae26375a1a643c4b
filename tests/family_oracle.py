"""HF transformers as the oracle of the model families (test-only; the HF parts need torch and
transformers, imported lazily): tiny seeded random models of each family, their logits and
greedy tokens, a GGUF writer that lays them out as llama.cpp's converter does, and the paxkv
side's step-by-step run through a cache. Import as ``import family_oracle`` from tests.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from oracle import hf_state
from paxkv.core.step_info import StepInfo

WINDOW = 16
VOCAB = 160


def hf_config(family: str) -> Any:
    """A tiny config of ``family``: hidden 64, 4 heads of 16, 2 kv heads, window 16."""
    import transformers

    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 initializer_range=0.2, max_position_embeddings=256, bos_token_id=1,
                 eos_token_id=2, pad_token_id=0)
    gemma = dict(sliding_window=WINDOW, query_pre_attn_scalar=24, final_logit_softcapping=10.0)
    rope3 = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
             "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}}
    return {
        "llama": lambda: transformers.LlamaConfig(**shape),
        "qwen2": lambda: transformers.Qwen2Config(**shape, tie_word_embeddings=True),
        "qwen3": lambda: transformers.Qwen3Config(**shape),
        "mistral": lambda: transformers.MistralConfig(**shape, sliding_window=WINDOW),
        "gemma2": lambda: transformers.Gemma2Config(
            **{**shape, "num_hidden_layers": 2}, **gemma, attn_logit_softcapping=5.0),
        "gemma3_text": lambda: transformers.Gemma3TextConfig(
            **{**shape, "num_hidden_layers": 6}, **gemma, rope_parameters=rope3),
    }[family]()


def tiny_hf(family: str, **changes: Any) -> Any:
    """The seeded random float32 HF model of ``family`` (``changes``: config attributes)."""
    import torch
    import transformers

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = hf_config(family)
    for key, value in changes.items():
        setattr(config, key, value)
    hf = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.3 * torch.randn_like(p))
    return hf


def hf_logits(hf: Any, ids: list[int]) -> np.ndarray:
    """float32 ``[len(ids), vocab]``: every position's logits, the prompt alone."""
    import torch

    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


def hf_greedy(hf: Any, ids: list[int], new: int) -> list[int]:
    """HF ``generate``'s ``new`` greedy tokens after ``ids``, EOS ignored."""
    import torch

    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def cached_logits(lm: Any, cache: Any, ids: list[int], chunks: list[int], *,
                  exact: bool = False) -> np.ndarray:
    """``ids`` fed through ``cache`` (one row) in steps of ``chunks`` tokens, each step
    right-padded to the widest (one compile), or with ``exact`` as wide as its chunk (a step of
    one token then takes the decode path: the Pallas decode kernel, not the prefill one) ->
    every position's logits ``[len(ids), vocab]``."""
    return cached_run(lm, cache, ids, chunks, exact=exact)[0]


def cached_run(lm: Any, cache: Any, ids: list[int], chunks: list[int], *,
               exact: bool = False) -> tuple[np.ndarray, Any]:
    """:func:`cached_logits` and the cache it leaves (``cache`` itself is donated)."""
    widest = max(chunks)

    @functools.partial(jax.jit, donate_argnums=1)
    def step(params, cache, tokens, n):
        width = tokens.shape[1]
        cache, ok = cache.reserve(n, max_new=width)
        info = StepInfo.make(cache.lengths, jnp.where(ok, n, 0), width)
        logits, cache = lm.forward(params, tokens, info, cache, all_logits=True)
        return cache, logits[0], ok

    out, start = [], 0
    for size in chunks:
        tokens = np.zeros((1, size if exact else widest), np.int32)
        tokens[0, :size] = ids[start:start + size]
        cache, logits, ok = step(lm.params, cache, jnp.asarray(tokens),
                                 jnp.asarray([size], jnp.int32))
        assert bool(ok[0])
        out.append(np.asarray(logits[:size]))
        start += size
    assert start == len(ids)
    return np.concatenate(out), cache


GGUF_ARCHS = {"qwen3": "qwen3", "gemma2": "gemma2", "gemma3_text": "gemma3"}


def _family_rope(w: Any, config: Any) -> None:
    """RoPE metadata as llama.cpp's converter writes it (Gemma-3: the global base and linear
    scaling, the local base as ``freq_base_swa``)."""
    import gguf

    params = config.rope_parameters
    full = params.get("full_attention", params)
    w.add_rope_freq_base(full["rope_theta"])
    if "sliding_attention" in params:
        w.add_rope_freq_base_swa(params["sliding_attention"]["rope_theta"])
    if full.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])


def write_family_gguf(path: str, hf_model: Any) -> None:
    """Writes an HF Qwen3 / Gemma-2 / Gemma-3 text model as llama.cpp's converter would: F32
    tensors named by gguf-py's own ``TensorNameMap`` (not paxkv's table), Gemma norm weights
    stored as ``1 + w``, the family's metadata and a byte-level vocab."""
    import gguf

    from paxkv.models.tokenizer import byte_alphabet

    c = hf_model.config
    arch = GGUF_ARCHS[c.model_type]
    w = gguf.GGUFWriter(path, arch)
    for add, value in ((w.add_block_count, c.num_hidden_layers), (w.add_context_length, 256),
                       (w.add_embedding_length, c.hidden_size),
                       (w.add_feed_forward_length, c.intermediate_size),
                       (w.add_head_count, c.num_attention_heads),
                       (w.add_head_count_kv, c.num_key_value_heads),
                       (w.add_key_length, c.head_dim), (w.add_value_length, c.head_dim),
                       (w.add_layer_norm_rms_eps, c.rms_norm_eps),
                       (w.add_tokenizer_model, "gpt2"), (w.add_tokenizer_pre, "gpt2"),
                       (w.add_eos_token_id, 2), (w.add_bos_token_id, 1)):
        add(value)
    _family_rope(w, c)
    gemma = arch.startswith("gemma")
    if gemma:
        w.add_sliding_window(c.sliding_window)
        if c.final_logit_softcapping is not None:
            w.add_final_logit_softcapping(c.final_logit_softcapping)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
    w.add_token_list(list(byte_alphabet().values())[: c.vocab_size])
    w.add_token_types([1] * c.vocab_size)
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), c.num_hidden_layers)
    for name, data in hf_state(hf_model).items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        base, suffix = name.rsplit(".", 1)
        if gemma and name.endswith("norm.weight"):
            data = data + np.float32(1.0)
        w.add_tensor(f"{names.get_name(base)}.{suffix}", data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
