"""Text <-> token ids and chat prompts, from GGUF metadata or an HF ``tokenizer.json``.

The GGUF path rebuilds what ``tokenizer.ggml.*`` describes, byte-level BPE (``gpt2``) or
SentencePiece (``llama``, :mod:`models.sentencepiece`), with the ``tokenizers`` library (Rust,
batched) as HF transformers' GGUF converter builds it, so neither path needs transformers at run
time. The chat template is rendered with jinja2 in the same sandboxed environment transformers
uses, so ``chat_prompt`` equals HF's ``apply_chat_template(..., tokenize=False)``; a Gemma
vocabulary whose file has no template gets Gemma's turns (:data:`GEMMA_TURNS`).
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import warnings
from collections.abc import Sequence
from typing import Any

import gguf
import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import AddedToken, Regex
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, processors

from .sentencepiece import sentencepiece_backend

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
# Gemma's turns (its instruction-tuned models' template, Gemma 1 to 3), for a Gemma vocabulary
# whose file carries no template: a system message opens the first user turn, "assistant" is
# "model". No BOS: ``encode`` adds it.
GEMMA_TURNS = (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set prefix = messages[0]['content'] + '\\n\\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for m in turns -%}"
    "{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n'"
    " + (prefix if loop.first else '') + m['content'] | trim + '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}")
GGUF_TOKENIZERS = ("gpt2", "llama")  # tokenizer.ggml.model: byte-level BPE, SentencePiece
_GGUF_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                     "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the spelling of byte-level BPE tokens)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _byte_level(use_regex: bool = True) -> pre_tokenizers.PreTokenizer:
    """GPT-2 byte mapping, with (``use_regex``) or without GPT-2's own split regex."""
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                    _byte_level(use_regex=False)])


# llama.cpp's ``tokenizer.ggml.pre`` -> how text is split before BPE. "smollm" isolates every
# \p{N} character first (llama.cpp's regex "\p{N}", SmolLM2's ``Digits(individual_digits)``).
_PRE_TOKENIZERS = {
    "gpt2": _byte_level, "default": _byte_level,
    "smollm": lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _byte_level()]),
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "llama3": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "smaug-bpe": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "qwen2": lambda: _split_then_bytes(_QWEN2_SPLIT),
}


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre not in _PRE_TOKENIZERS:
        warnings.warn(f"GGUF pre-tokenizer {pre!r} is unknown to paxkv; splitting text the GPT-2 "
                      "way, which may tokenize some text differently from llama.cpp", stacklevel=4)
    return _PRE_TOKENIZERS.get(pre, _byte_level)()


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str | None) -> Backend:
    """Byte-level BPE: the vocabulary in GPT-2's byte spelling, the file's merges, and the
    pre-tokenizer ``tokenizer.ggml.pre`` names."""
    alphabet = byte_alphabet()
    spelled = set(alphabet.values())
    vocab = {(t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode())): i
             for i, t in enumerate(tokens)}
    backend = Backend(models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges],
                                 fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    return backend


def _bos_eos_processor(special: dict[str, str], ids: dict[str, int], add_bos: bool,
                       add_eos: bool) -> processors.TemplateProcessing | None:
    """The post-processor that adds BOS/EOS around every encoded text, if the file asks for it."""
    wanted = [name for name, on in (("bos_token", add_bos), ("eos_token", add_eos)) if on]
    if not wanted:
        return None
    missing = [name for name in wanted if name not in special]
    if missing:
        raise ValueError(f"GGUF asks to add {missing} but defines no such token id")

    def around(seq: str, type_id: int) -> list[str]:
        return ([f"{special['bos_token']}:{type_id}"] if add_bos else []) + [f"${seq}:{type_id}"] \
            + ([f"{special['eos_token']}:{type_id}"] if add_eos else [])

    return processors.TemplateProcessing(  # a pair as HF's tokenizers frame it
        single=" ".join(around("A", 0)), pair=" ".join(around("A", 0) + around("B", 1)),
        special_tokens=[(special[n], ids[n]) for n in wanted])


class Tokenizer:
    """Encodes, decodes and renders chat prompts for one model.

    Attributes:
      backend: the ``tokenizers.Tokenizer`` (batched encode lives there).
      chat_template: jinja2 source, or ``None`` when the checkpoint has none.
      special_tokens: ``bos_token``/``eos_token``/... -> token text, passed to the template.
    """

    def __init__(self, backend: Backend, chat_template: str | None,
                 special_tokens: dict[str, str]) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens = special_tokens

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> "Tokenizer":
        """The tokenizer a GGUF file's ``tokenizer.ggml.*`` metadata describes: byte-level BPE
        (``model == "gpt2"``) or SentencePiece (``"llama"``, :mod:`models.sentencepiece`).
        Without a chat template in the file, a Gemma vocabulary gets Gemma's turns."""
        field = lambda key: (f.contents() if (f := reader.fields.get(key)) else None)  # noqa: E731
        kind = field("tokenizer.ggml.model")
        tokens, types = field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type") or []
        ids = {name: int(i) for name, key in _GGUF_SPECIAL_IDS.items()
               if (i := field(f"tokenizer.ggml.{key}")) is not None}
        special = {name: tokens[i] for name, i in ids.items()}
        if kind == "gpt2":
            backend = _byte_level_bpe(tokens, field("tokenizer.ggml.merges") or [],
                                      field("tokenizer.ggml.pre"))
        elif kind == "llama":
            backend = sentencepiece_backend(tokens, field("tokenizer.ggml.scores"),
                                            field("general.architecture"),
                                            special.get("unk_token"))
        else:
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only 'gpt2', "
                             "byte-level BPE, and 'llama', SentencePiece)")
        # NOTE: a token is added whole only as the vocabulary spells it (HF's rule): one it
        # respells (byte-level bytes, Gemma's runs of spaces) would get a new id past the vocab.
        spelled = [t for t in tokens if backend.token_to_id(t) is not None]
        kinds = dict(zip(tokens, types))
        named = set(special.values())  # BOS, EOS, UNK, PAD: special whatever their type
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t in spelled if kinds.get(t) == _CONTROL or t in named])
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in spelled
                            if kinds.get(t) == _USER_DEFINED and t not in named])
        add_bos = field("tokenizer.ggml.add_bos_token")
        if add_bos is None:  # llama.cpp adds BOS to a SentencePiece vocabulary that is silent
            add_bos = kind == "llama"
        processor = _bos_eos_processor(special, ids, bool(add_bos),
                                       bool(field("tokenizer.ggml.add_eos_token")))
        if processor is not None:
            backend.post_processor = processor
        template = field("tokenizer.chat_template")
        if template is None and {"<start_of_turn>", "<end_of_turn>"} <= set(spelled):
            template = GEMMA_TURNS
        return cls(backend, template, special)

    @classmethod
    def from_hf_folder(cls, folder: str | os.PathLike) -> "Tokenizer":
        """``tokenizer.json`` + ``tokenizer_config.json`` (+ ``chat_template.jinja``)."""
        folder = os.fspath(folder)
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no tokenizer.json in {folder!r}")
        backend = Backend.from_file(path)
        config_path = os.path.join(folder, "tokenizer_config.json")
        config: dict[str, Any] = {}
        if os.path.isfile(config_path):
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        template = config.get("chat_template")
        jinja_path = os.path.join(folder, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        special = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = config.get(name)
            if isinstance(value, dict):
                value = value.get("content")
            if value is not None:
                special[name] = value
        return cls(backend, template, special)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, with BOS/EOS only where the checkpoint asks for them."""
        return self.backend.encode(text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Many texts at once (parallel in Rust)."""
        return [e.ids for e in self.backend.encode_batch(list(texts))]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens included (so round trips are exact)."""
        return self.backend.decode(list(ids), skip_special_tokens=False)

    def chat_prompt(self, messages: Sequence[dict[str, Any]],
                    add_generation_prompt: bool = True) -> str:
        """Renders ``[{"role": ..., "content": ...}, ...]`` with the model's chat template."""
        if self.chat_template is None:
            raise ValueError("this checkpoint has no chat template")
        return _compile(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            **self.special_tokens)


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    """Compiles the template as transformers does (sandboxed, trim/lstrip blocks, loopcontrols)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, \
        sort_keys=False: json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                                    separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)
