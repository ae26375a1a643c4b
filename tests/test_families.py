"""Every supported family against HF transformers, and the HF-folder loader's errors.

Each family is a tiny random HF model (seeded, ``initializer_range`` raised so greedy tokens
have no near-ties, norm weights randomised so a mis-mapped norm cannot hide) saved with
``save_pretrained`` and read back by :func:`paxkv.models.load`. Prompts first stay within one
sliding window (``WINDOW`` tokens), so they test the layers alone; the long tests (3+ windows)
need the caches to apply the model's ``layer_windows``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

import family_oracle as fo
import oracle
import paxkv
from paxkv import models
from paxkv.cache import dense as dense_cache
from paxkv.cache import paged as paged_cache
from paxkv.cache.full import NoCache
from paxkv.core.step_info import StepInfo
from paxkv.models.hf_loader import config_from_dict

TOL = 1e-4
WINDOW, VOCAB = fo.WINDOW, fo.VOCAB
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text")
WINDOWED = ("mistral", "gemma2", "gemma3_text")
EXPECTED_WINDOWS = {"mistral": (WINDOW,) * 3, "gemma2": (WINDOW, None),
                    "gemma3_text": (WINDOW,) * 5 + (None,)}
# Switches each test must be able to see: turned off, the logits move far past TOL.
BLIND = {"gemma2": dict(attn_logit_softcap=None, final_logit_softcap=None,
                        query_pre_attn_scalar=None),
         "gemma3_text": dict(local_rope_theta=None, rope_scaling=None)}


def _windows_supported() -> bool:
    takes = lambda f: "layer_windows" in inspect.signature(f).parameters  # noqa: E731
    return takes(paged_cache.create) and takes(dense_cache.create) and takes(NoCache)


needs_windows = pytest.mark.skipif(not _windows_supported(),
                                   reason="the caches do not take layer_windows yet")


@pytest.fixture(autouse=True)
def _strict_ranks():
    with jax.numpy_rank_promotion("raise"):
        yield


@dataclasses.dataclass
class Case:
    family: str
    hf: object  # the torch model
    lm: models.LanguageModel


@pytest.fixture(scope="module", params=FAMILIES)
def case(request, tmp_path_factory) -> Case:
    pytest.importorskip("transformers")
    hf = fo.tiny_hf(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return Case(request.param, hf, models.load(folder))


@functools.cache
def _forward(lm: models.LanguageModel, config: models.DecoderConfig | None = None):
    """``lm.forward`` (or its decoder with another ``config``) jitted, all positions."""
    if config is None:
        return jax.jit(functools.partial(lm.forward, all_logits=True))
    module = models.Llama(config)
    return jax.jit(functools.partial(module.apply, all_logits=True))


def full_logits(lm: models.LanguageModel, seqs: list[list[int]], windows: bool = False,
                config: models.DecoderConfig | None = None) -> list[np.ndarray]:
    """Every position's logits of ``seqs``, one right-padded batch through ``NoCache``."""
    width = max(map(len, seqs))
    tokens = np.zeros((len(seqs), width), np.int32)
    for row, ids in enumerate(seqs):
        tokens[row, : len(ids)] = ids
    lengths = jnp.asarray([len(s) for s in seqs], jnp.int32)
    cache = NoCache(layer_windows=lm.layer_windows) if windows else NoCache()
    logits, _ = _forward(lm, config)(lm.params, jnp.asarray(tokens),
                                     StepInfo.make(lengths, lengths, width), cache)
    return [np.asarray(logits[row, : len(s)]) for row, s in enumerate(seqs)]


def worst_error(ours: list[np.ndarray], refs: list[np.ndarray]) -> float:
    """Max absolute logit error; asserts it and the argmax per position."""
    worst = max(float(np.abs(a - b).max()) for a, b in zip(ours, refs))
    assert worst < TOL, f"max |logit error| {worst:.2e}"
    for a, b in zip(ours, refs):
        np.testing.assert_array_equal(a.argmax(-1), b.argmax(-1))
    return worst


def prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, n).tolist() for n in lengths]


@pytest.mark.oracle
def test_config_switches(case: Case) -> None:
    c, hf_cfg = case.lm.config, case.hf.config
    assert case.lm.layer_windows == EXPECTED_WINDOWS.get(case.family)
    assert c.qk_norm == (case.family in ("qwen3", "gemma3_text"))
    assert c.sandwich_norms == c.embed_scale == case.family.startswith("gemma")
    assert c.attention_bias == (case.family == "qwen2")
    assert c.tie_word_embeddings == hf_cfg.tie_word_embeddings
    if case.family == "gemma3_text":
        inv = case.hf.model.rotary_emb
        np.testing.assert_allclose(c.inv_freq(), inv.full_attention_inv_freq.numpy(), rtol=1e-6)
        np.testing.assert_allclose(c.inv_freq(local=True),
                                   inv.sliding_attention_inv_freq.numpy(), rtol=1e-6)
    hash(c)


@pytest.mark.oracle
def test_logits_match_hf(case: Case) -> None:
    """All positions of prompts within one window (one of exactly ``WINDOW`` tokens)."""
    seqs = prompts((WINDOW, 9, 1))
    worst = worst_error(full_logits(case.lm, seqs), [fo.hf_logits(case.hf, s) for s in seqs])
    print(f"{case.family}: max |logit error| vs HF {worst:.2e}")
    for key, value in BLIND.get(case.family, {}).items():
        config = dataclasses.replace(case.lm.config, **{key: value})
        off = full_logits(case.lm, seqs[:1], config=config)[0]
        assert np.abs(off - fo.hf_logits(case.hf, seqs[0])).max() > 100 * TOL, f"blind to {key}"


@pytest.mark.oracle
def test_greedy_matches_hf(case: Case) -> None:
    """``paxkv.generate`` (paged cache, batched) = HF ``generate``, all within one window."""
    seqs, new = prompts((6, 3), seed=1), 8
    out = paxkv.generate(case.lm, seqs, max_new_tokens=new, stop_token_ids=[],
                         prefix_cache=False)
    assert [r.token_ids for r in out] == [fo.hf_greedy(case.hf, s, new) for s in seqs]


@pytest.fixture(scope="module")
def windowed(case: Case) -> Case:
    if case.family not in WINDOWED:
        pytest.skip(f"{case.family} has no sliding window")
    return case


@pytest.mark.oracle
@needs_windows
def test_long_logits_match_hf(windowed: Case) -> None:
    """Prompts 3+ windows long: the full forward through ``NoCache(layer_windows=...)``."""
    seqs = prompts((3 * WINDOW + 5, 2 * WINDOW), seed=2)
    refs = [fo.hf_logits(windowed.hf, s) for s in seqs]
    worst_error(full_logits(windowed.lm, seqs, windows=True), refs)
    blind = full_logits(windowed.lm, seqs[:1])[0]
    assert np.abs(blind - refs[0]).max() > 100 * TOL, "test blind to the windows"


@pytest.mark.oracle
@needs_windows
def test_long_cached_steps_match_hf(case: Case) -> None:
    """A 3-window prompt through paged and dense caches made with
    ``layer_windows=lm.layer_windows`` (None for a family without windows: then 7 pages of one
    row): prefill chunks that straddle window edges, then decode steps; every position's
    logits = HF's."""
    lm = case.lm
    ids = prompts((3 * WINDOW + 8,), seed=3)[0]  # 4 chunks of 13, then 4 decode steps
    sizes = dict(num_layers=lm.num_layers, num_kv_heads=lm.num_kv_heads, head_dim=lm.head_dim,
                 max_seqs=1, max_len=64, layer_windows=lm.layer_windows)
    ref = fo.hf_logits(case.hf, ids)
    for cache in (paged_cache.create(num_pages=8, page_size=8, **sizes),
                  dense_cache.create(**sizes)):
        worst_error([fo.cached_logits(lm, cache, ids, [13] * 4 + [1] * 4)], [ref])


@pytest.mark.oracle
@needs_windows
def test_long_generate_matches_hf(windowed: Case) -> None:
    """End to end once (the family with local RoPE and mixed layers): ``paxkv.generate``
    makes its cache with the model's windows and decodes past window edges like HF."""
    if windowed.family != "gemma3_text":
        pytest.skip("one family end to end is enough (each costs two compiles)")
    ids = prompts((3 * WINDOW + 4,), seed=4)[0]
    out = paxkv.generate(windowed.lm, [ids], max_new_tokens=6, stop_token_ids=[],
                         prefix_cache=False)
    assert out[0].token_ids == fo.hf_greedy(windowed.hf, ids, 6)


@pytest.mark.oracle
@pytest.mark.parametrize("family", list(fo.GGUF_ARCHS))
def test_gguf_matches_hf(tmp_path, family: str) -> None:
    """A GGUF written as llama.cpp's converter would (F32) loads with the family's switches
    and runs like HF. (Below 27B llama.cpp scales scores by ``head_dim ** -0.5``, so the HF
    model here has ``query_pre_attn_scalar = head_dim``.)"""
    hf = fo.tiny_hf(family, **({"query_pre_attn_scalar": 16} if "gemma" in family else {}))
    path = str(tmp_path / f"{family}.gguf")
    fo.write_family_gguf(path, hf)
    lm = models.load(path)
    assert lm.layer_windows == EXPECTED_WINDOWS.get(family) and lm.encode("hi") == [104, 105]
    seqs = prompts((WINDOW, 5))
    print(f"{family} GGUF: max |logit error| vs HF "
          f"{worst_error(full_logits(lm, seqs), [fo.hf_logits(hf, s) for s in seqs]):.2e}")


@pytest.mark.oracle
def test_bfloat16_folder_loads_exactly(tmp_path) -> None:
    """bfloat16 safetensors, as real checkpoints ship, read bit for bit."""
    import torch

    hf = fo.tiny_hf("gemma3_text").to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    params = models.load(tmp_path).params["params"]
    state = {k: v.float().numpy() for k, v in hf.state_dict().items()}
    np.testing.assert_array_equal(params["embed"]["embedding"],
                                  state["model.embed_tokens.weight"])
    np.testing.assert_array_equal(params["layers"]["attn"]["k_norm"]["scale"][5],
                                  state["model.layers.5.self_attn.k_norm.weight"])


# --- config.json readings and the loader's errors (no torch needed) -------------------------

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16)


def test_config_defaults_as_hf_computes_them() -> None:
    """Older config.json spellings read as transformers reads them."""
    gemma2 = config_from_dict({"model_type": "gemma2", **TINY, "num_hidden_layers": 4})
    assert gemma2.layer_windows == (4096, None, 4096, None)
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (50.0, 30.0)
    assert gemma2.sm_scale == 256 ** -0.5 and gemma2.hidden_act == "gelu_tanh"
    old = {"model_type": "gemma3_text", **TINY, "num_hidden_layers": 3, "rope_theta": 1e6,
           "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
           "sliding_window": 8, "sliding_window_pattern": 3}
    new = {**old, "layer_types": ["sliding_attention"] * 2 + ["full_attention"],
           "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                  "rope_theta": 1e6},
                               "sliding_attention": {"rope_type": "default",
                                                     "rope_theta": 1e4}}}
    for key in ("rope_theta", "rope_local_base_freq", "rope_scaling", "sliding_window_pattern"):
        del new[key]
    assert config_from_dict(old) == config_from_dict(new)
    assert config_from_dict(new).layer_windows == (8, 8, None)
    assert config_from_dict(new).rope_scaling == models.LinearRopeScaling(8.0)
    qwen = {"model_type": "qwen3", **TINY, "num_hidden_layers": 3, "sliding_window": 8}
    assert config_from_dict(qwen).layer_windows is None, "use_sliding_window is off"
    on = config_from_dict({**qwen, "use_sliding_window": True, "max_window_layers": 1})
    assert on.layer_windows == (None, 8, 8)
    assert config_from_dict({"model_type": "mistral", **TINY, "sliding_window": None}
                            ).layer_windows is None


@pytest.mark.parametrize("extra, match", [
    ({"model_type": "gpt2"}, r"'gpt2' is not supported \(supported: llama, qwen2, qwen3, "
                             r"mistral, gemma2, gemma3_text\)"),
    ({"model_type": "qwen3", "num_experts": 8}, "mixture-of-experts.*num_experts=8"),
    ({"model_type": "mistral", "num_local_experts": 8}, "mixture-of-experts"),
    ({"model_type": "gemma3", "text_config": {}, "vision_config": {}}, "multimodal.*gemma3_text"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "yarn"),
])
def test_unsupported_configs(tmp_path, extra: dict, match: str) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**TINY, **extra}))
    with pytest.raises(ValueError, match=match):
        models.load(tmp_path)


def write_folder(folder, config: dict) -> None:
    """config.json and random weights (no tokenizer files)."""
    (folder / "config.json").write_text(json.dumps(config))
    state = oracle.random_llama_state(config_from_dict(config))
    save_file(state, str(folder / "model.safetensors"))


def test_missing_files(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="no config.json"):
        models.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **TINY}))
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors"):
        models.load(tmp_path)
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="missing: model-00001-of-00002.safetensors"):
        models.load(tmp_path)


def test_no_tokenizer_runs_token_ids(tmp_path) -> None:
    write_folder(tmp_path, {"model_type": "qwen3", **TINY, "eos_token_id": 2})
    lm = models.load(tmp_path)
    assert lm.tokenizer is None and not hasattr(lm, "encode")
    for method, arg in (("encode", "hi"), ("decode", [1]), ("chat_prompt", [])):
        with pytest.raises(models.MissingTokenizerError, match=f"without a tokenizer.*{method}"):
            getattr(lm, method)(arg)
    out = paxkv.generate(lm, [[5, 6, 7]], max_new_tokens=3, stop_token_ids=[])
    assert len(out[0].token_ids) == 3 and out[0].text == ""
    with pytest.raises(ValueError, match="no tokenizer"):
        paxkv.generate(lm, ["text"], max_new_tokens=1)
