"""Gemma 3 270M (Q4_K_M GGUF, the test-only ``gemma`` extra): the second real-weights model,
against HF transformers on the same file.

* ``models.load`` reads it: every tensor type (Q5_0, Q4_K, Q6_K, Q8_0, F32), its config
  (5 sliding layers of 512 to 1 global, two RoPE bases, q/k norms, tied embeddings).
* Greedy tokens of the paged cache, the dense cache and the engine (its layer-grouped cache)
  equal HF's ``generate`` on a prompt past the 512-token window and on a chat prompt.
* Its SentencePiece tokenizer is HF's: the same ``tokenizers`` serialisation, the same ids
  on a varied text set (chat turns included), the same decoded text, exact round trips.

HF's greedy tokens are kept on disk under pytest's cache dir (keyed by the inputs and the
library versions), so a rerun loads only HF's tokenizer (~25 s), not its model (~35 s more).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import gguf
import jax
import numpy as np
import pytest

import paxkv
from paxkv import models
from paxkv.cache import grouped

# NOTE: loads a real model: out of `make test-fast`, in the Makefile's first pass (XLA's usual
# flags) with the default model's tests.
pytestmark = pytest.mark.model

WINDOW, NEW = 512, 32
LONG_TEXT = (Path(__file__).parent / "data" / "lighthouse.txt").read_text(encoding="utf-8")
CHAT = [{"role": "system", "content": "Answer in one line."},
        {"role": "user", "content": "Write a haiku about the sea."}]
TEXTS = [
    "Hello world", "", " ", "  two leading spaces", "trailing spaces   ", "a  b   c    d",
    "tabs\tand\t\tmore\ttabs", "line\nbreaks\n\n\nand\r\nwindows\r\n", "\n\n\n\n\n",
    " " * 40 + "indented", "0123456789 00 007 3.14159 -42 1,000,000 2024-12-06",
    "!!!???...,,,;;;:::---___((()))[[]]{{}}", "can't won't it's y'all", "x" * 60,
    "def f(x):\n    return x ** 2  # squares\n", "<html><body class=\"a\">Hi</body></html>",
    "Ünïcödé — naïve café, façade, Ångström", "日本語のテキストです。中文测试：你好，世界！",
    "한국어 텍스트, русский текст, العربية, עברית, ελληνικά, हिन्दी",
    "🙂🚀 emoji 🎉👍🏽👨‍👩‍👧 done", "e\u0301 ﬁ ½ ™ ∑∫√ → ⇒ ∞",
    "\x00\x01\x7f control bytes", "\ue000\U000f0000 private use", "𠀀𪚥 rare CJK",
    "<bos>inline special<eos> <pad><unk><mask> [multimodal]",
    "<start_of_turn>user\nWhat is 2 + 2?<end_of_turn>\n<start_of_turn>model\n",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello! 👋<end_of_turn>\n",
    "<start_of_image> <end_of_turn>x<start_of_turn>",
    LONG_TEXT,
]


@pytest.fixture(scope="module")
def gemma_path() -> str:
    try:
        return models.gemma3_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def gemma(gemma_path) -> models.LanguageModel:
    return models.load(gemma_path)


@pytest.fixture(scope="module")
def hf_tokenizer(gemma_path):
    """HF's tokenizer from the same GGUF (``AutoTokenizer.from_pretrained(dir, gguf_file)``)."""
    transformers = pytest.importorskip("transformers")
    folder, name = os.path.split(gemma_path)
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


def prompts(lm: models.LanguageModel) -> list[list[int]]:
    """A prompt past the window (real prose and code) and a chat prompt (Gemma's turns)."""
    return [lm.encode(LONG_TEXT), lm.encode(lm.chat_prompt(CHAT))]


def _hf_generate(model, ids: list[int], new: int) -> list[int]:
    """HF ``generate``'s ``new`` greedy tokens after ``ids`` (one prompt), EOS ignored."""
    import copy

    import torch

    saved = model.generation_config  # generate() fills eos_token_id=None from it: clear it
    model.generation_config = copy.deepcopy(saved)
    model.generation_config.eos_token_id = None
    try:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones((1, len(ids)),
                                 dtype=torch.long), max_new_tokens=new, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
    finally:
        model.generation_config = saved
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def hf_greedy(gemma, gemma_path, pytestconfig) -> list[list[int]]:
    """HF's greedy tokens for :func:`prompts`, from the disk cache or HF's model."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    ids = prompts(gemma)
    key = hashlib.sha256(json.dumps({
        "file": os.path.basename(gemma_path), "size": os.path.getsize(gemma_path),
        "prompts": ids, "new": NEW, "torch": torch.__version__,
        "transformers": transformers.__version__}).encode()).hexdigest()[:24]
    cache = getattr(pytestconfig, "cache", None)
    file = None if cache is None else cache.mkdir("paxkv_gemma3") / f"greedy-{key}.json"
    if file is not None and file.is_file():
        return json.loads(file.read_text())
    torch.set_num_threads(1)  # XLA or a neighbour is busy on the other core (tests/oracle.py)
    folder, name = os.path.split(gemma_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32).eval()
    out = [_hf_generate(model, p, NEW) for p in ids]
    if file is not None:
        file.write_text(json.dumps(out))
    return out


# -- the file loads ----------------------------------------------------------------------------

def test_every_tensor_type_loads_and_the_config_is_gemma3s(gemma, gemma_path):
    reader = gguf.GGUFReader(gemma_path)
    q = gguf.GGMLQuantizationType
    assert {t.tensor_type for t in reader.tensors} == {q.F32, q.Q5_0, q.Q4_K, q.Q6_K, q.Q8_0}
    c = gemma.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == \
        (18, 640, 4, 1, 256)
    assert gemma.layer_windows == tuple(None if (i + 1) % 6 == 0 else WINDOW for i in range(18))
    assert (c.rope_theta, c.local_rope_theta, c.rope_scaling) == (1e6, 1e4, None)
    assert c.qk_norm and c.sandwich_norms and c.embed_scale and c.tie_word_embeddings
    assert c.norm_offset == 0.0, "GGUF stores Gemma's norms as 1 + w"
    assert c.sm_scale == 256 ** -0.5 and c.final_logit_softcap is None
    assert c.bos_token_id == 2 and c.eos_token_ids == (1, 106)  # <eos>, <end_of_turn>
    for leaf in jax.tree_util.tree_leaves(gemma.params):
        assert np.isfinite(np.asarray(leaf)).all()


# -- greedy tokens against HF --------------------------------------------------------------

@pytest.mark.oracle
@pytest.mark.parametrize("path", ["paged", "dense", "engine"])
def test_greedy_tokens_equal_hf(gemma, hf_greedy, path: str):
    """Past the window (the long prompt is > 512 tokens: its last tokens' local layers see
    only the window) and on a chat prompt, ``NEW`` greedy tokens each, EOS ignored."""
    ids = prompts(gemma)
    assert len(ids[0]) > WINDOW + 64 and ids[1][:2] == [2, 105]  # BOS, <start_of_turn>
    if path == "engine":
        engine = paxkv.Engine(gemma, max_seqs=2, max_len=1024, page_size=16)
        assert isinstance(engine.cache, grouped.GroupedPagedCache)  # window pages released
        rids = [engine.submit(p, max_new_tokens=NEW, stop_token_ids=[]) for p in ids]
        done = engine.run()
        got = [done[r].token_ids for r in rids]
    else:
        got = [r.token_ids for r in paxkv.generate(gemma, ids, max_new_tokens=NEW,
                                                   stop_token_ids=[], cache=path)]
    assert got == hf_greedy


# -- the tokenizer against HF's ------------------------------------------------------------

@pytest.mark.oracle
def test_the_tokenizer_is_hfs(gemma, hf_tokenizer):
    """The same ``tokenizers`` pipeline as HF builds from the file: the vocabulary, the merges
    rebuilt from it (Gemma's order), the normalizer, decoder, added tokens and BOS."""
    ours = json.loads(gemma.tokenizer.backend.to_str())
    assert ours == json.loads(hf_tokenizer.backend_tokenizer.to_str())


@pytest.mark.oracle
def test_ids_and_text_equal_hfs(gemma, hf_tokenizer):
    for text in TEXTS:
        ids = gemma.encode(text)
        assert ids == hf_tokenizer(text).input_ids, text
        assert ids[0] == 2 and ids.count(2) == 1 + text.count("<bos>")
        assert gemma.decode(ids) == hf_tokenizer.decode(ids), text
        assert gemma.decode(ids[1:]) == text, "round trip"
    batch = gemma.tokenizer.encode_batch(TEXTS)
    assert batch == [hf_tokenizer(t).input_ids for t in TEXTS]
    turns = gemma.encode("<start_of_turn>user\nHi<end_of_turn>\n")
    assert turns == [2, 105, 2364, 107, 10979, 106, 107]  # each marker one control token


def test_chat_prompt_is_gemmas_turns(gemma):
    """The file has no chat template: Gemma's turns, the system message opening the first
    user turn, "assistant" as "model", no BOS in the text (``encode`` adds it)."""
    assert gemma.tokenizer.chat_template is not None
    assert gemma.chat_prompt(CHAT) == ("<start_of_turn>user\nAnswer in one line.\n\n"
                                       "Write a haiku about the sea.<end_of_turn>\n"
                                       "<start_of_turn>model\n")
    turns = [{"role": "user", "content": " Hi "}, {"role": "assistant", "content": "Hello."},
             {"role": "user", "content": "Bye"}]
    assert gemma.chat_prompt(turns, add_generation_prompt=False) == (
        "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n")
    with pytest.raises(Exception, match="alternate"):
        gemma.chat_prompt(turns[1:])
