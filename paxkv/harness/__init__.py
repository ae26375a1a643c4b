"""paxkv as an lm-evaluation-harness backend: importing this module registers model "paxkv".

    python -m paxkv.harness run --model paxkv --tasks <task> --include_path tests/data/tasks
    lm_eval.simple_evaluate(model="paxkv", model_args="page_size=16", tasks=[...])

:class:`PaxkvLM` subclasses lm-eval's ``TemplateLM``, so a (context, continuation) pair is
tokenised exactly as the ``hf`` backend does it, and follows that backend's conventions: an
empty context becomes the BOS token, contexts are cut from the left to ``max_length``, the
rolling windows of a perplexity task are lm-eval's own. ``loglikelihood`` sends the whole
workload to :class:`paxkv.Scorer` (grouped by context token ids, so each context is prefilled
once and forked into its choices), ``generate_until`` runs the engine and cuts each text at
its first stop string. Needs the ``eval`` extra (``lm-eval==0.4.13``).

May import: everything in paxkv, and :mod:`paxkv.models` (it loads the checkpoint named
in ``model_args``). Must not be imported by the rest of paxkv: importing it needs lm-eval.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any

import jax
import jax.numpy as jnp
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (handle_stop_sequences, normalize_gen_kwargs,
                                  postprocess_generated_text)

from paxkv import models
from paxkv.core.compiles import OFF, CompileStats, metered, use_persistent_cache
from paxkv.engine import Engine
from paxkv.harness.stops import StopScan
from paxkv.scoring import Scorer, ScoreResult, rolling_windows, scorer_for, truncate

ARGS = ("pretrained", "batch_size", "max_batch_size", "device", "page_size", "kv_dtype",
        "max_length", "cache", "share", "max_gen_toks", "compile_cache")
LOG = logging.getLogger("lm_eval.paxkv")  # under lm-eval's logger: its level and handler
DEFAULT_ROWS = 32
# The scorer's rows hold at least this many tokens (up to max_length), so tasks of different
# lengths share one scorer, its compiled step programs and, in a later process, the persistent
# compilation cache's entries (:mod:`paxkv.scoring.shapes`); the pool is capped in bytes.
ROW_TOKENS = 2048
_PLATFORMS = {"cpu": "cpu", "cuda": "gpu", "gpu": "gpu", "tpu": "tpu"}


def _rows(batch_size: Any, max_batch_size: Any) -> int:
    """Cache rows from lm-eval's ``batch_size`` (an int, or "auto" / "auto:N": the default,
    capped by ``max_batch_size``)."""
    if batch_size is None or str(batch_size).startswith("auto"):
        cap = int(max_batch_size) if max_batch_size else DEFAULT_ROWS
        return min(DEFAULT_ROWS, cap)
    rows = int(batch_size)
    if rows < 1:
        raise ValueError(f"batch_size must be >= 1 or 'auto', got {batch_size!r}")
    return rows


def _check_device(device: Any) -> str:
    """JAX's backend; a ``device`` of another platform falls back to it with a warning (as the
    ``hf`` backend does when CUDA is missing: lm-eval's command line passes "cuda:0" by
    default), a name that is no platform is an error."""
    backend = jax.default_backend()
    if device is None:
        return backend
    platform = _PLATFORMS.get(str(device).split(":")[0].lower())
    if platform is None:
        raise ValueError(f"device={device!r} is not one of {sorted(_PLATFORMS)} (with an "
                         f"optional ':N'); paxkv runs on JAX's default backend, {backend!r}")
    if platform != backend:
        warnings.warn(f"device={device!r}, but JAX runs on {backend!r}: using {backend!r}")
        return backend
    return str(device)


@register_model("paxkv")
class PaxkvLM(TemplateLM):
    """lm-eval's view of a paxkv model (see the module docstring).

    Args:
      pretrained: a ``.gguf`` file or HF folder (default: SmolLM2-135M-Instruct).
      batch_size: cache rows (contexts + continuations in flight); "auto": 32.
      max_batch_size: caps "auto".
      device: must name JAX's backend ("cpu", "cuda"...), or None.
      page_size, kv_dtype, cache: the cache (``kv_dtype`` "float32" / "bfloat16", ``cache``
        "paged" / "dense").
      max_length: tokens the model sees per request (default: the model's context length,
        as the ``hf`` backend reads it).
      share: prefill each distinct context once and fork it (False: each pair alone).
      max_gen_toks: default generation length (the ``hf`` backend's 256).
      compile_cache: JAX's persistent compilation cache (default: on, in the user's cache
        folder, so a new lm-eval process loads the steps an earlier one compiled; a folder;
        "off"): :func:`paxkv.core.compiles.use_persistent_cache`. Each call logs the
        compiles it paid.
    """

    def __init__(self, pretrained: str | None = None, batch_size: Any = None,
                 max_batch_size: Any = None, device: Any = None, page_size: int = 16,
                 kv_dtype: str = "float32", max_length: int | None = None,
                 cache: str = "paged", share: bool = True, max_gen_toks: int = 256,
                 compile_cache: Any = None, **unknown: Any):
        super().__init__()
        if unknown:
            raise ValueError(f"unknown model_args for paxkv: {', '.join(sorted(unknown))}; "
                             f"it accepts {', '.join(ARGS)}")
        if isinstance(compile_cache, str) and compile_cache.strip().lower() in OFF:
            compile_cache = False
        self.compile_cache = use_persistent_cache(compile_cache)
        self.compile_stats = CompileStats()  # every call's, summed
        self.lm = models.load(pretrained)
        self.tokenizer = self.lm.tokenizer
        self.rows = _rows(batch_size, max_batch_size)
        self._device = _check_device(device)
        self.cache_kind, self.share = cache, bool(share)
        self.page_size, self.kv_dtype = int(page_size), jnp.dtype(kv_dtype)
        self._max_length = int(max_length or self.lm.config.max_position_embeddings)
        self._max_gen_toks = int(max_gen_toks)
        self.scorer: Scorer | None = None  # kept across calls (its compiled steps too)

    # -- what lm-eval reads ---------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.lm.eos_token_ids[0]

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context becomes: BOS where the model has one (the ``hf``
        backend's choice), else EOS."""
        bos = self.lm.config.bos_token_id
        return self.eot_token_id if bos is None else bos

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self.rows

    @property
    def tokenizer_name(self) -> str:
        return self.lm.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   left_truncate_len: int | None = None, **kwargs: Any) -> list[int]:
        """The ``hf`` backend's rule: the tokenizer's own special tokens unless told, none
        when the text already starts with BOS."""
        bos = self.lm.tokenizer.special_tokens.get("bos_token")
        if add_special_tokens is None and bos and string.startswith(bos):
            add_special_tokens = False
        if add_special_tokens is None:
            ids = self.lm.encode(string)
        else:
            ids = self.lm.tokenizer.backend.encode(
                string, add_special_tokens=add_special_tokens).ids
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.lm.tokenizer.backend.decode(list(tokens),
                                                skip_special_tokens=skip_special_tokens)

    # -- scoring --------------------------------------------------------------------------
    def _score(self, pairs: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[ScoreResult]:
        """Scores token pairs through a kept :class:`Scorer` (made anew only when a request
        needs longer rows than it has)."""
        need = max(len(c) + len(x) - 1 for c, x in pairs)
        if self.scorer is None or self.scorer.ops.max_len < need:
            self.scorer = scorer_for(self.lm, pairs, cache=self.cache_kind, share=self.share,
                                     page_size=self.page_size, max_seqs=self.rows,
                                     kv_dtype=self.kv_dtype, min_len=min(ROW_TOKENS, self._max_length),
                                     compile_cache=self.compile_cache or False)
        return self.scorer.score(pairs)

    def _log_compiles(self, call: str) -> None:
        c = self.compile_stats
        LOG.info("paxkv %s: %d compiles and %d loads from the persistent cache (%s) so far, "
                 "%.1f s", call, c.compiles, c.cache_loads, self.compile_cache or "off",
                 c.compile_seconds)

    @metered
    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False
                      ) -> list[tuple[float, bool]]:
        for req in requests:
            if not req.args[1]:
                raise ValueError(f"an empty continuation cannot be scored (context "
                                 f"{req.args[0][-40:]!r}): give the task a non-empty choice")
        out = super().loglikelihood(requests, disable_tqdm=disable_tqdm)
        self._log_compiles("loglikelihood")
        return out

    def _loglikelihood_tokens(self, requests: list[Any], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        pairs = []
        for (strings, ctx, cont) in requests:
            if not cont:
                raise ValueError(f"the continuation {strings[1]!r} tokenises to nothing after "
                                 f"context {strings[0][-40:]!r}: it cannot be scored")
            pairs.append((tuple(ctx), tuple(cont)))
        if not pairs:
            return []
        out = [(r.logprob, r.is_greedy) for r in self._score(truncate(pairs, self.max_length))]
        for (strings, _, _), answer in zip(requests, out):
            self.cache_hook.add_partial("loglikelihood", strings, answer)
        return out

    @metered
    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False
                              ) -> list[float]:
        windows, owner = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for w in rolling_windows(self.tok_encode(text), prefix_token=self.prefix_token_id,
                                     max_length=self.max_length):
                windows.append(w)
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, r in zip(owner, self._score(windows) if windows else []):
            totals[i] += r.logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        self._log_compiles("loglikelihood_rolling")
        return totals

    # -- generation -----------------------------------------------------------------------
    @metered
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled) continuations through the engine, each stopped as soon as its
        text holds a stop string (:class:`~paxkv.harness.stops.StopScan`: only the tail is
        decoded each step) and cut at the first one (the ``hf`` backend's output)."""
        out: list[str | None] = [None] * len(requests)
        by_kwargs: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            by_kwargs.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        for idx in by_kwargs.values():
            texts = self._generate([requests[i].args[0] for i in idx], requests[idx[0]].args[1])
            for i, text in zip(idx, texts):
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        self._log_compiles("generate_until")
        return out

    def _generate(self, contexts: list[str], gen_kwargs: dict) -> list[str]:
        kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        until = handle_stop_sequences(kwargs.pop("until", None),
                                      eos=self.tok_decode([self.eot_token_id], False))
        max_new = int(kwargs.pop("max_gen_toks"))
        if max_new >= self.max_length:
            raise ValueError(f"max_gen_toks={max_new} leaves no room for a context in "
                             f"max_length={self.max_length}: lower it or raise max_length")
        prompts = [self.tok_encode(c, left_truncate_len=self.max_length - max_new) or
                   [self.prefix_token_id] for c in contexts]
        temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
        longest = max(map(len, prompts)) + max_new
        engine = Engine(self.lm, cache=self.cache_kind, max_seqs=self.rows,
                        max_len=-(-longest // self.page_size) * self.page_size,
                        page_size=self.page_size, kv_dtype=self.kv_dtype,
                        compile_cache=self.compile_cache or False)
        rids = [engine.submit(p, max_new_tokens=max_new, temperature=temperature,
                              seed=int(kwargs.get("seed", 0) or 0)) for p in prompts]
        tokens: dict[int, list[int]] = {r: [] for r in rids}
        scans = {r: StopScan(self.tok_decode, until) for r in rids}
        while engine.has_work():
            for rid, new in engine.step().new_tokens.items():
                tokens[rid] += new
                if scans[rid].found(tokens[rid]):
                    engine.cancel(rid)
        return [postprocess_generated_text(self.tok_decode(tokens[r]), until, None)
                for r in rids]

    # -- chat -----------------------------------------------------------------------------
    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.lm.tokenizer.chat_template if chat_template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """The model's chat template, as the ``hf`` backend applies it: without a generation
        prompt the last message is continued (the text ends with its content)."""
        try:
            text = self.lm.chat_prompt(chat_history, add_generation_prompt)
        except Exception:  # noqa: BLE001 - the hf backend's fallback: drop system messages
            chat_history = [m for m in chat_history if m["role"] != "system"]
            text = self.lm.chat_prompt(chat_history, add_generation_prompt)
        if add_generation_prompt:
            return text
        final = chat_history[-1]["content"]
        at = text.rindex(final.strip())
        keep = len(final.lstrip()) if text[at:at + len(final.lstrip())] == final.lstrip() \
            else len(final.strip())
        return text[:at + keep]

    def get_model_info(self) -> dict:
        return dict(model_name=self.lm.name, backend="paxkv", cache=self.cache_kind,
                    page_size=self.page_size, kv_dtype=self.kv_dtype.name, share=self.share)


def main(argv: list[str] | None = None) -> None:
    """lm-eval's own command line, with "paxkv" registered."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0]] + list(argv)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    cli_evaluate()
