"""What an HF ``config.json`` of each supported family means for :class:`DecoderConfig`.

One decoder runs every family; a family is a row of switches plus how its ``config.json`` reads
(which keys, which defaults when a key is absent — transformers' class defaults — and how its
sliding windows are laid out). Read against transformers 5.25's ``modeling_{family}.py``::

    model_type   q/k norm  Gemma layer  windows (when sliding_window is set)
    llama        -         -            never
    qwen2        -         -            if use_sliding_window: layer_types, or from
                                        layer max_window_layers on
    qwen3        yes       -            as qwen2
    mistral      -         -            every layer
    gemma2       -         yes          layer_types, or every 2nd layer global
    gemma3_text  yes       yes          layer_types, or every 6th layer global; the
                                        sliding ones have their own RoPE base

"Gemma layer": ``(1 + w)`` norms, four norms per layer, GeGLU (``hidden_activation``),
embeddings times ``sqrt(hidden)``, ``query_pre_attn_scalar ** -0.5`` softmax scale, soft caps
(Gemma-3's attention ignores ``attn_logit_softcapping``, as HF's does).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .config import DecoderConfig, LinearRopeScaling, RopeScaling, Scaling

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text")
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
_LAYER_TYPES = ("sliding_attention", "full_attention")
_GEMMA_DEFAULTS = {"tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh",
                   "query_pre_attn_scalar": 256, "sliding_window": 4096, "head_dim": 256}


@dataclasses.dataclass(frozen=True)
class Family:
    """How one ``model_type`` reads.

    Attributes:
      qk_norm: per-head q/k RMSNorm before RoPE.
      gemma: the Gemma layer (see the module docstring).
      qkv_bias: q/k/v projections always carry a bias (Qwen2).
      windows: ``"never"``, ``"all"`` (every layer), ``"qwen"`` (only with
        ``use_sliding_window``) or ``"types"`` (``layer_types``, else every ``pattern``-th
        layer global).
      pattern: the default ``sliding_window_pattern`` (``"types"``; ``"qwen"`` counts from
        ``max_window_layers`` instead).
      attn_softcap: whether ``attn_logit_softcapping`` applies.
      local_rope: sliding layers have their own RoPE base (``rope_local_base_freq``, or
        ``rope_parameters["sliding_attention"]``).
      defaults: ``config.json`` values when a key is absent.
    """

    qk_norm: bool = False
    gemma: bool = False
    qkv_bias: bool = False
    windows: str = "never"
    pattern: int = 0
    attn_softcap: bool = False
    local_rope: bool = False
    defaults: dict[str, Any] = dataclasses.field(default_factory=dict)


FAMILIES = {
    "llama": Family(),
    "qwen2": Family(qkv_bias=True, windows="qwen", defaults={"max_window_layers": 28}),
    "qwen3": Family(qk_norm=True, windows="qwen", defaults={"max_window_layers": 28}),
    "mistral": Family(windows="all", defaults={"sliding_window": 4096}),
    "gemma2": Family(gemma=True, windows="types", pattern=2, attn_softcap=True, defaults={
        **_GEMMA_DEFAULTS, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0}),
    "gemma3_text": Family(qk_norm=True, gemma=True, windows="types", pattern=6,
                          local_rope=True, defaults={**_GEMMA_DEFAULTS, "rope_theta": 1e6,
                                                     "rope_local_base_freq": 1e4}),
}


def _check_supported(cfg: dict[str, Any], source: str) -> str:
    """The config's ``model_type``, or a ``ValueError`` saying what is not supported."""
    model_type = cfg.get("model_type")
    supported = f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
    if "vision_config" in cfg or "text_config" in cfg:
        raise ValueError(f"{source!r}: model_type {model_type!r} is a multimodal checkpoint "
                         f"(vision_config / text_config); only text decoders load ({supported})")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{source!r}: model_type {model_type!r} is not supported ({supported})")
    experts = [k for k in _MOE_KEYS if cfg.get(k)]
    if experts:
        raise ValueError(f"{source!r}: mixture-of-experts configs ({experts[0]}="
                         f"{cfg[experts[0]]}) are not supported ({supported}, dense only)")
    for key in ("mlp_bias", "use_bidirectional_attention"):
        if cfg.get(key):
            raise ValueError(f"{source!r}: {key}=True is not supported")
    if cfg.get("attention_bias") and model_type != "qwen2":
        raise ValueError(f"{source!r}: attention_bias=True (an o_proj bias) is not supported")
    return model_type


def _rope_spec(spec: dict[str, Any], theta: float, source: str) -> tuple[float, Scaling | None]:
    """One ``rope_parameters`` (or ``rope_scaling``) dict -> (base, scaling)."""
    if float(spec.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"{source!r}: partial_rotary_factor is not supported")
    theta = float(spec.get("rope_theta", theta))
    kind = spec.get("rope_type", spec.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, LinearRopeScaling(factor=float(spec["factor"]))
    if kind != "llama3":
        raise ValueError(f"{source!r}: RoPE scaling {kind!r} is not supported "
                         "(default, linear, llama3)")
    return theta, RopeScaling(
        factor=float(spec["factor"]), low_freq_factor=float(spec["low_freq_factor"]),
        high_freq_factor=float(spec["high_freq_factor"]),
        original_max_position_embeddings=int(spec["original_max_position_embeddings"]))


def _ropes(cfg: dict[str, Any], family: Family, source: str) -> dict[str, Any]:
    """The RoPE fields of :class:`DecoderConfig`, from ``rope_parameters`` (transformers 5;
    Gemma-3 keys it by layer type) or the older ``rope_theta`` / ``rope_scaling`` /
    ``rope_local_base_freq``."""
    params = cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta", params.get("rope_theta", 10000.0)))
    if not family.local_rope:
        theta, scaling = _rope_spec(cfg.get("rope_scaling") or params, theta, source)
        return {"rope_theta": theta, "rope_scaling": scaling}
    by_type = "full_attention" in params or "sliding_attention" in params
    full = (params.get("full_attention") if by_type else cfg.get("rope_scaling")) or {}
    local = (params.get("sliding_attention") if by_type else None) or {}
    theta, scaling = _rope_spec(full, theta, source)
    local_theta, local_scaling = _rope_spec(local, float(cfg["rope_local_base_freq"]), source)
    return {"rope_theta": theta, "rope_scaling": scaling, "local_rope_theta": local_theta,
            "local_rope_scaling": local_scaling}


def _layer_types(cfg: dict[str, Any], family: Family, n: int, source: str) -> list[str]:
    """Each layer's ``"sliding_attention"`` / ``"full_attention"``, as HF's config computes
    them when ``layer_types`` is absent."""
    types = cfg.get("layer_types")
    if types is None and family.windows == "qwen":
        first = int(cfg["max_window_layers"])
        types = [_LAYER_TYPES[i < first] for i in range(n)]
    elif types is None:
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
                      or family.pattern)
        types = [_LAYER_TYPES[(i + 1) % pattern == 0] for i in range(n)]
    if len(types) != n or not set(types) <= set(_LAYER_TYPES):
        raise ValueError(f"{source!r}: layer_types {types!r} must give one of {_LAYER_TYPES} "
                         f"for each of the {n} layers")
    return list(types)


def _windows(cfg: dict[str, Any], family: Family, n: int, source: str
             ) -> tuple[int | None, ...] | None:
    """``layer_windows``: the sliding window of each layer (None: global), or None."""
    window = cfg.get("sliding_window")
    if family.windows == "never" or (family.windows == "qwen"
                                     and not cfg.get("use_sliding_window")):
        return None
    if family.windows == "all":
        return None if window is None else (int(window),) * n
    types = _layer_types(cfg, family, n, source)
    if window is None:
        if family.local_rope and "sliding_attention" in types:
            raise ValueError(f"{source!r}: sliding layers need a sliding_window")
        return None
    windows = tuple(int(window) if t == "sliding_attention" else None for t in types)
    return windows if any(w is not None for w in windows) else None


def _gemma_fields(cfg: dict[str, Any], family: Family, source: str) -> dict[str, Any]:
    """The switches of a Gemma layer (none for other families)."""
    if not family.gemma:
        act = cfg.get("hidden_act") or "silu"
    else:
        act = cfg.get("hidden_activation") or _GEMMA_DEFAULTS["hidden_activation"]
    if act not in _ACTIVATIONS:
        raise ValueError(f"{source!r}: activation {act!r} is not supported "
                         f"({', '.join(_ACTIVATIONS)})")
    fields: dict[str, Any] = {"hidden_act": _ACTIVATIONS[act], "qk_norm": family.qk_norm}
    if family.gemma:
        cap = cfg.get("attn_logit_softcapping") if family.attn_softcap else None
        final = cfg.get("final_logit_softcapping")
        fields.update(norm_offset=1.0, sandwich_norms=True, embed_scale=True,
                      query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]),
                      attn_logit_softcap=None if cap is None else float(cap),
                      final_logit_softcap=None if final is None else float(final))
    return fields


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def config_from_dict(cfg: dict[str, Any], extra_eos: Any = None, source: str = "<config>"
                     ) -> DecoderConfig:
    """An HF ``config.json`` dict (or ``PretrainedConfig.to_dict()``) -> :class:`DecoderConfig`.

    ``extra_eos``: generation-config EOS id(s), listed before the model config's own.

    Raises:
      ValueError: an unsupported ``model_type`` (naming the supported ones), a mixture of
        experts, a multimodal config, or a feature of a supported family that paxkv lacks.
    """
    model_type = _check_supported(cfg, source)
    family = FAMILIES[model_type]
    cfg = {**family.defaults, **cfg}
    hidden, heads, n = (int(cfg[k]) for k in ("hidden_size", "num_attention_heads",
                                              "num_hidden_layers"))
    return DecoderConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=n,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=family.qkv_bias,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(
            _as_ids(extra_eos) + _as_ids(cfg.get("eos_token_id")))),
        layer_windows=_windows(cfg, family, n, source),
        **_ropes(cfg, family, source),
        **_gemma_fields(cfg, family, source),
    )
