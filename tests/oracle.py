"""HF transformers as the outside oracle: the same GGUF, loaded and run by PyTorch.

Test-only. The HF parts need the ``oracle`` extra (torch==2.13.0, transformers, accelerate) and
import them lazily; the GGUF writer (``write_gguf``, ``random_llama_state``) needs only gguf and
numpy, so loader tests run without torch. Import it as ``import oracle`` from tests (pytest puts
``tests/`` on ``sys.path``).

``hf_greedy`` results are cached on disk (under the pytest cache dir, keyed by the inputs and the
library versions), so a rerun of the decode tests never loads the HF model at all.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from paxkv import models
from paxkv.models.hf_loader import hf_name
from paxkv.models.params import checkpoint_shapes

# NOTE: tests import this module both as ``oracle`` (conftest) and as ``tests.oracle``. One
# module object under both names means one HF model load and one cache dir per session.
sys.modules.setdefault("oracle", sys.modules[__name__])
sys.modules.setdefault("tests.oracle", sys.modules[__name__])
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_cache_dir = os.path.join(_REPO, ".pytest_cache", "d", "paxkv_oracle")


@dataclasses.dataclass(frozen=True)
class HF:
    """An HF causal LM (float32, eval mode) and its tokenizer, loaded from one GGUF."""

    model: Any
    tokenizer: Any
    path: str


def set_cache_dir(path: str | os.PathLike) -> None:
    """Where ``hf_greedy`` keeps its results (conftest points it at pytest's cache dir)."""
    global _cache_dir
    _cache_dir = os.fspath(path)


def load_hf(path: str | None = None) -> HF:
    """Loads model + tokenizer with ``from_pretrained(dir, gguf_file=name)`` (float32), once.

    transformers dequantises and un-permutes the GGUF itself, so it is an independent check of
    ``models.gguf_loader``, not a copy of it.
    """
    return _load_hf(os.path.abspath(path or models.default_model_path()))


@functools.cache
def _load_hf(path: str) -> HF:
    import torch
    import transformers

    # NOTE: one intra-op thread. With XLA (or a neighbour) busy on the other core, OpenMP's
    # two-thread barriers make each small matmul ~15x slower (33 ms vs 2 ms measured).
    torch.set_num_threads(1)
    folder, name = os.path.split(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32)
    return HF(model.eval(), tokenizer, path)


def hf_logits(hf: HF, prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """float32 ``[len(prompt), vocab]`` logits per prompt, each run alone (no padding at all)."""
    import torch

    out = []
    with torch.no_grad():
        for ids in prompts:
            logits = hf.model(torch.tensor([list(ids)], dtype=torch.long)).logits[0]
            out.append(logits.float().numpy())
    return out


def manual_greedy(hf: HF, ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy by full recomputation, one prompt, no EOS logic: the check on ``hf_greedy``."""
    import torch

    seq = list(ids)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = hf.model(torch.tensor([seq], dtype=torch.long)).logits[0, -1]
            seq.append(int(torch.argmax(logits)))
    return seq[len(ids):]


def _generate(hf: HF, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int
              ) -> list[list[int]]:
    """One batched, left-padded ``generate`` call with EOS stopping switched off."""
    import torch
    import transformers

    pad = 0 if hf.tokenizer.pad_token_id is None else int(hf.tokenizer.pad_token_id)
    width = max(len(p) for p in prompt_ids)
    input_ids = torch.full((len(prompt_ids), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for row, ids in enumerate(prompt_ids):
        input_ids[row, width - len(ids):] = torch.tensor(list(ids), dtype=torch.long)
        mask[row, width - len(ids):] = 1
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens,
                                           pad_token_id=pad, eos_token_id=None)
    # No EOS at all (a suppressed EOS, as with min_new_tokens, would change the argmax instead).
    # generate() fills every None from the model's own generation config, so clear it there.
    saved = hf.model.generation_config
    hf.model.generation_config = copy.deepcopy(saved)
    hf.model.generation_config.eos_token_id = None
    try:
        with torch.no_grad():
            out = hf.model.generate(input_ids, attention_mask=mask, generation_config=config)
    finally:
        hf.model.generation_config = saved
    new = out[:, width:].tolist()
    if any(len(row) != max_new_tokens for row in new):
        raise RuntimeError(f"HF generate stopped early: {[len(r) for r in new]} tokens, "
                           f"asked for {max_new_tokens}")
    return new


def hf_greedy(prompt_ids: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations of ``prompt_ids`` from HF on the default model, EOS ignored.

    Args:
      prompt_ids: token ids per prompt (any lengths; left-padded into one batch).
      max_new_tokens: exactly this many tokens come back per prompt.

    Returns:
      ``[len(prompt_ids)][max_new_tokens]`` generated ids (prompt not included).
    """
    import torch
    import transformers

    path = models.default_model_path()
    prompts = [[int(t) for t in p] for p in prompt_ids]
    key = hashlib.sha256(json.dumps({
        "model": os.path.basename(path), "size": os.path.getsize(path), "prompts": prompts,
        "max_new_tokens": int(max_new_tokens), "torch": torch.__version__,
        "transformers": transformers.__version__}).encode()).hexdigest()[:24]
    file = os.path.join(_cache_dir, f"greedy-{key}.json")
    if os.path.isfile(file):
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    result = _generate(load_hf(path), prompts, int(max_new_tokens))
    os.makedirs(_cache_dir, exist_ok=True)
    tmp = f"{file}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(result, f)
    os.replace(tmp, file)
    return result


def tiny_hf_model(kind: str, vocab_size: int = 256, seed: int = 0) -> Any:
    """A 2-layer random HF model whose attention is sharp enough for RoPE errors to show.

    ``kind``: ``"llama3"`` (Llama-3 RoPE scaling, untied head) or ``"qwen2"`` (q/k/v bias,
    tied head). Norm weights and biases are randomised too, so a mis-mapped one cannot hide.
    """
    import torch
    import transformers

    torch.manual_seed(seed)
    shape = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 initializer_range=0.2, max_position_embeddings=256)
    if kind == "llama3":
        rope = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                    high_freq_factor=4.0, original_max_position_embeddings=64)
        config = transformers.LlamaConfig(**shape, head_dim=16, rope_parameters=rope,
                                          rms_norm_eps=1e-5, tie_word_embeddings=False,
                                          bos_token_id=1, eos_token_id=[2, 0])
        model = transformers.LlamaForCausalLM(config)
    elif kind == "qwen2":
        config = transformers.Qwen2Config(**shape, rope_theta=1e6, tie_word_embeddings=True,
                                          eos_token_id=2)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def hf_state(model: Any) -> dict[str, np.ndarray]:
    """An HF model's weights as float32 numpy, by HF name."""
    return {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}


def set_hf_state(model: Any, state: dict[str, np.ndarray]) -> None:
    """Loads (possibly dequantised) numpy weights back into an HF model."""
    import torch

    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=False)


def random_llama_state(config: models.LlamaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights for ``config`` by HF name (no torch needed); ``lm_head.weight``
    is drawn for tied configs too (:func:`write_gguf` skips it there)."""
    rng = np.random.default_rng(seed)
    untied = dataclasses.replace(config, tie_word_embeddings=False)
    return {hf_name(name): (0.2 * rng.standard_normal(shape)).astype(np.float32)
            for name, shape in checkpoint_shapes(untied).items()}


def llama3_rope_factors(config: models.LlamaConfig) -> np.ndarray:
    """The ``rope_freqs`` tensor llama.cpp's converter writes for Llama-3 scaling."""
    s, dim = config.rope_scaling, config.head_dim
    freqs = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    old, factor = s.original_max_position_embeddings, s.factor
    low, high = s.low_freq_factor, s.high_freq_factor
    wavelen = 2 * np.pi / freqs
    smooth = (old / wavelen - low) / (high - low)
    out = np.where(wavelen < old / high, 1.0,
                   np.where(wavelen > old / low, factor, 1 / ((1 - smooth) / factor + smooth)))
    return out.astype(np.float32)


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's q/k row permutation (the inverse of the loader's)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


_GGUF_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
_GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[hf_name]
    parts = hf_name.split(".")  # model.layers.{i}.{module...}.{weight|bias}
    return f"blk.{parts[2]}.{_GGUF_LAYER['.'.join(parts[3:-1])]}.{parts[-1]}"


def write_gguf(path: str, config: models.LlamaConfig, state: dict[str, np.ndarray],
               types: dict[str, Any] | None = None, add_bos: bool = False
               ) -> dict[str, np.ndarray]:
    """Writes a Llama as llama.cpp would: permuted q/k, ``rope_freqs``, a byte-level vocab.

    Args:
      state: float32 weights by HF name (``lm_head.weight`` is skipped for tied configs).
      types: GGUF tensor name -> ``GGMLQuantizationType`` (default F32). A type gguf-py
        cannot quantise is written as zero bytes of the right size (for error tests).

    Returns:
      ``state`` with each quantised tensor replaced by its dequantised value, so an HF model
      loaded with it (:func:`set_hf_state`) is an exact oracle for the file.
    """
    import gguf

    from paxkv.models.tokenizer import byte_alphabet

    c, types, state = config, dict(types or {}), dict(state)
    w = gguf.GGUFWriter(path, "llama")
    for add, value in ((w.add_block_count, c.num_layers), (w.add_context_length, 256),
                       (w.add_embedding_length, c.hidden_size),
                       (w.add_feed_forward_length, c.intermediate_size),
                       (w.add_head_count, c.num_heads), (w.add_head_count_kv, c.num_kv_heads),
                       (w.add_key_length, c.head_dim), (w.add_value_length, c.head_dim),
                       (w.add_rope_freq_base, c.rope_theta),
                       (w.add_layer_norm_rms_eps, c.rms_norm_eps), (w.add_tokenizer_model, "gpt2"),
                       (w.add_tokenizer_pre, "gpt2"), (w.add_eos_token_id, 2),
                       (w.add_bos_token_id, 1), (w.add_add_bos_token, add_bos)):
        add(value)
    w.add_token_list(list(byte_alphabet().values())[: c.vocab_size])
    w.add_token_types([1] * c.vocab_size)
    if c.rope_scaling is not None:
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(c))
    for hf_name, data in state.items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        name, qtype = _gguf_name(hf_name), types.pop(_gguf_name(hf_name), None)
        if qtype is not None:
            try:
                raw = gguf.quants.quantize(data, qtype)
                state[hf_name] = gguf.quants.dequantize(raw, qtype).astype(np.float32)
            except NotImplementedError:
                block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
                raw = np.zeros((data.shape[0], data.shape[1] // block * nbytes), np.uint8)
            data = raw
        heads = {"attn_q": c.num_heads, "attn_k": c.num_kv_heads}.get(name.split(".")[-2])
        if heads is not None:
            data = _llama_cpp_permute(data, heads)
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return state
