"""What each model family's config.json says beyond Llama's fields, as ModelConfig keywords.

One function per family takes the config dict (transformers' `to_dict()`, or a raw config.json
of transformers 4 or 5) and returns the ModelConfig fields it sets, refusing what we cannot run
with the field and value that is the problem.
"""
from __future__ import annotations

from pagedserve.pipeline.load_error import ModelLoadError

SLIDING, FULL = "sliding_attention", "full_attention"


def rope(cfg: dict) -> tuple[float, dict | None]:
    """(theta, scaling): transformers 5 keeps both in rope_parameters, 4 in rope_theta and
    rope_scaling."""
    params = dict(cfg.get("rope_parameters") or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ModelLoadError(f"config: per-layer-type rope_parameters are not supported for "
                             f"model_type {cfg.get('model_type')!r}")
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    return theta, _scaling(dict(cfg.get("rope_scaling") or params))


def _scaling(scaling: dict) -> dict | None:
    for key in ("rope_theta", "partial_rotary_factor"):
        scaling.pop(key, None)
    rope_type = scaling.pop("type", None) or scaling.get("rope_type") or "default"
    return None if rope_type == "default" else {**scaling, "rope_type": rope_type}


def _activation(cfg: dict, key: str, allowed: str) -> str:
    act = cfg.get(key) or allowed
    if act != allowed:
        raise ModelLoadError(f"config: unsupported {key} {act!r} for model_type "
                             f"{cfg.get('model_type')!r} (only {allowed})")
    return {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}[act]


def _windows(cfg: dict, layer_types: list[str]) -> tuple[int, ...]:
    """Per-layer windows from HF layer_types: sliding layers get sliding_window, others 0."""
    if len(layer_types) != cfg["num_hidden_layers"]:
        raise ModelLoadError(f"config: layer_types has {len(layer_types)} entries for "
                             f"{cfg['num_hidden_layers']} layers")
    unknown = sorted(set(layer_types) - {SLIDING, FULL})
    if unknown:
        raise ModelLoadError(f"config: layer type(s) {unknown} are not supported "
                             f"(supported: {SLIDING}, {FULL})")
    window = cfg.get("sliding_window")
    if SLIDING in layer_types and (not isinstance(window, int) or window < 1):
        raise ModelLoadError(f"config: sliding layers need a positive sliding_window, got "
                             f"{window!r}")
    return tuple(window if kind == SLIDING else 0 for kind in layer_types)


def _no_bias(cfg: dict) -> None:
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ModelLoadError(f"config: attention_bias / mlp_bias are not supported for "
                             f"{cfg['model_type']}")


def llama(cfg: dict) -> dict:
    _no_bias(cfg)
    return {"hidden_act": _activation(cfg, "hidden_act", "silu")}


def mistral(cfg: dict) -> dict:
    """Mistral: Llama whose every layer attends through sliding_window (when set)."""
    _no_bias(cfg)
    window = cfg.get("sliding_window") or 0
    return {"hidden_act": _activation(cfg, "hidden_act", "silu"),
            "layer_windows": (int(window),) * cfg["num_hidden_layers"]}


def _qwen_windows(cfg: dict) -> tuple[int, ...]:
    """Qwen 2/3: windows only with use_sliding_window, on the layers from max_window_layers on
    (transformers' rule), unless layer_types names them."""
    n = cfg["num_hidden_layers"]
    if not cfg.get("use_sliding_window") or not cfg.get("sliding_window"):
        return (0,) * n
    types = cfg.get("layer_types") or [
        SLIDING if i >= cfg.get("max_window_layers", 28) else FULL for i in range(n)]
    return _windows(cfg, list(types))


def qwen2(cfg: dict) -> dict:
    return {"hidden_act": _activation(cfg, "hidden_act", "silu"), "qkv_bias": True,
            "layer_windows": _qwen_windows(cfg)}


def qwen3(cfg: dict) -> dict:
    bias = bool(cfg.get("attention_bias"))
    return {"hidden_act": _activation(cfg, "hidden_act", "silu"), "qkv_bias": bias,
            "o_bias": bias, "qk_norm": True, "layer_windows": _qwen_windows(cfg)}


def glm4(cfg: dict) -> dict:
    params = cfg.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5))
    return {"hidden_act": _activation(cfg, "hidden_act", "silu"),
            "qkv_bias": bool(cfg.get("attention_bias", True)),
            "partial_rotary_factor": float(factor), "rope_interleaved": True}


def _gemma3_ropes(cfg: dict) -> dict[str, tuple[float, dict | None]]:
    """(theta, scaling) of the sliding and the full layers: transformers 5's rope_parameters per
    layer type, or 4's rope_local_base_freq (sliding) and rope_theta + rope_scaling (full)."""
    params = cfg.get("rope_parameters") or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        missing = sorted({SLIDING, FULL} - set(params))
        if missing:
            raise ModelLoadError(f"config: rope_parameters has no entry for {missing}")
        return {kind: (float(params[kind].get("rope_theta", default)),
                       _scaling(dict(params[kind])))
                for kind, default in ((SLIDING, 10000.0), (FULL, 1000000.0))}
    full_theta, full_scaling = rope({**cfg, "rope_theta": cfg.get("rope_theta", 1000000.0)})
    return {SLIDING: (float(cfg.get("rope_local_base_freq", 10000.0)), None),
            FULL: (full_theta, full_scaling)}


def _optional_float(value) -> float | None:
    return None if value is None else float(value)


def gemma3(cfg: dict) -> dict:
    if cfg.get("attn_logit_softcapping") is not None:
        raise ModelLoadError(f"config: attn_logit_softcapping="
                             f"{cfg['attn_logit_softcapping']!r} (soft-capped attention scores) "
                             "is not supported; set it to null")
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError("config: use_bidirectional_attention is not supported (a causal "
                             "decoder only)")
    n, pattern = cfg["num_hidden_layers"], cfg.get("sliding_window_pattern", 6)
    types = list(cfg.get("layer_types") or [
        SLIDING if (i + 1) % pattern else FULL for i in range(n)])
    ropes = _gemma3_ropes(cfg)
    bias = bool(cfg.get("attention_bias"))
    return {"hidden_act": _activation(cfg, "hidden_activation", "gelu_pytorch_tanh"),
            "qkv_bias": bias, "o_bias": bias, "qk_norm": True,
            "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)),
            "final_logit_softcapping": _optional_float(cfg.get("final_logit_softcapping")),
            "layer_windows": _windows(cfg, types), "rope": ropes[FULL],
            "layer_rope_thetas": tuple(ropes[kind][0] for kind in types),
            "layer_rope_scalings": tuple(ropes[kind][1] for kind in types)}


def bert(cfg: dict) -> dict:
    """BERT: post-LayerNorm (its eps is `norm_eps`), exact GELU, absolute positions only."""
    if cfg.get("hidden_act", "gelu") != "gelu":
        raise ModelLoadError(f"config: unsupported hidden_act {cfg.get('hidden_act')!r} for "
                             "model_type 'bert' (only gelu)")
    kind = cfg.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise ModelLoadError(f"config: position_embedding_type {kind!r} is not supported for "
                             "model_type 'bert' (only absolute)")
    return {"norm_eps": float(cfg.get("layer_norm_eps", 1e-12)),
            "type_vocab_size": int(cfg.get("type_vocab_size", 2)),
            "qkv_bias": True, "o_bias": True, "hidden_act": "gelu"}


FAMILY_FIELDS = {"llama": llama, "mistral": mistral, "qwen2": qwen2, "qwen3": qwen3,
                 "gemma3": gemma3, "glm4": glm4, "bert": bert}
