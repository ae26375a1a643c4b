"""A SentencePiece vocabulary from GGUF metadata (``tokenizer.ggml.model == "llama"``: Gemma,
Llama 2, Mistral files) rebuilt as a byte-fallback BPE of the ``tokenizers`` library.

llama.cpp stores such a vocabulary as its pieces, their scores and token types, and no merges.
As HF transformers' GGUF converter does (5.25, ``integrations/gguf/gguf_tokenizer_mapping.py``
and the ``GemmaTokenizer`` / ``LlamaTokenizer`` classes it hands the vocabulary to), every split
of a piece into two pieces of the vocabulary becomes a merge, ranked best first; a character no
piece spells falls back to its UTF-8 bytes (the ``<0xNN>`` pieces). Two flavours, chosen by
architecture as HF chooses them::

    flavour  archs                  spaces (before BPE)            merge rank
    gemma    gemma, gemma2, gemma3  each " " -> "▁", no prefix     the merged piece's position
                                                                   in the file, first best
    llama    every other            Metaspace: " " -> "▁", and a   the merged piece's score,
                                    "▁" before the first piece     highest best

Gemma files store the pieces of two or more spaces as real spaces; they are spelled with "▁"
again here (so the merges built from them match), and Gemma's scores do not follow its merge
order while the order of the pieces in the file does. Ties within one merged piece go to the
longer left part, then the longer right part. Decoding turns "▁" back into spaces, joins byte
pieces into UTF-8 and (llama) strips the one leading space the encoder added.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, normalizers, pre_tokenizers

SPACE = "\u2581"  # "▁": SentencePiece's spelling of a space
GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")


def bpe_merges(vocab: dict[str, int], rank: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a vocabulary implies: every ``(left, right)`` whose parts and join are all
    pieces, best first: by ``rank`` of the joined piece (highest first), then the longer left
    part, then the longer right part."""
    merges = []
    for piece, score in rank.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((score, len(left), len(right), left, right))
    merges.sort(key=lambda m: m[:3], reverse=True)
    return [(left, right) for _, _, _, left, right in merges]


def sentencepiece_backend(tokens: Sequence[str], scores: Sequence[float] | None, arch: str,
                          unk_token: str | None) -> Backend:
    """The BPE tokenizer of a GGUF SentencePiece vocabulary (special tokens not yet added).

    Args:
      tokens: ``tokenizer.ggml.tokens``, in id order.
      scores: ``tokenizer.ggml.scores`` (the llama flavour's merge rank); unused for Gemma.
      arch: ``general.architecture``: picks the flavour (module docstring).
      unk_token: the piece of ``tokenizer.ggml.unknown_token_id``, if any: Gemma's BPE
        names it (as HF's ``GemmaTokenizer`` does); the llama flavour falls back to bytes
        alone (as HF's ``LlamaTokenizer``).
    """
    gemma = arch in GEMMA_ARCHS
    if gemma:
        tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        rank = {t: -float(i) for i, t in enumerate(tokens)}
    else:
        if scores is None or len(scores) != len(tokens):
            raise ValueError("a SentencePiece GGUF vocabulary needs tokenizer.ggml.scores, one a "
                             "token")
        rank = {t: float(s) for t, s in zip(tokens, scores)}
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = Backend(models.BPE(vocab, bpe_merges(vocab, rank), unk_token=unk_token if gemma
                                 else None, fuse_unk=True, byte_fallback=True))
    to_text = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        backend.normalizer = normalizers.Replace(" ", SPACE)
        # NOTE: HF's GemmaTokenizer splits on " " after its normalizer has replaced every " ":
        # a no-op, kept so the two serialise alike.
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        backend.decoder = decoders.Sequence(to_text)
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first",
                                                         split=False)
        backend.decoder = decoders.Sequence([*to_text, decoders.Strip(" ", 1, 0)])
    return backend
