"""ModelConfig: what the workers need to know about a model, read from its config.json.

One frozen dataclass for every family; `from_hf` picks the family from `model_type` (or the
`architectures` class names) and fills the fields that family uses. The defaults are Llama's, so
a config of another family states only where it differs: biases, q/k norms, per-layer attention
windows and RoPE tables, the MLP's activation, the attention scale, logit soft-capping.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.pipeline.load_error import ModelLoadError
from pagedserve.workers import family_configs

# HF model_type -> our architecture name (workers/models/ holds one module per name).
ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                 "gemma3_text": "gemma3", "gemma3": "gemma3", "glm4": "glm4", "bert": "bert"}
# HF class names (config.json "architectures") -> our architecture name, for configs without
# a model_type.
HF_CLASSES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
              "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
              "Gemma3ForCausalLM": "gemma3", "Gemma3ForConditionalGeneration": "gemma3",
              "Glm4ForCausalLM": "glm4", "BertModel": "bert"}
SUPPORTED = tuple(sorted(set(ARCHITECTURES.values())))
ENCODERS = frozenset({"bert"})  # bidirectional: embeddings only (workers/models/bert.py)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str                 # one of SUPPORTED
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None         # None for plain RoPE, else a dict with "rope_type"
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    hidden_act: str = "silu"          # the gated MLP's activation: silu | gelu_tanh
    qkv_bias: bool = False            # q/k/v projections carry a bias
    o_bias: bool = False              # the output projection carries a bias
    qk_norm: bool = False             # RMSNorm over each q and k head before RoPE
    partial_rotary_factor: float = 1.0   # RoPE turns the first head_dim * this dims of a head
    rope_interleaved: bool = False    # RoPE pairs dims (2i, 2i+1) (GLM) instead of (i, i + D/2)
    query_pre_attn_scalar: float | None = None   # attention scale = this ** -0.5 (else head_dim)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    type_vocab_size: int = 0          # BERT's token-type (segment) embeddings
    # Per layer (filled in __post_init__ when left empty): attention window (0: global; a query
    # at position p sees keys p - window < j <= p), and the RoPE base and scaling.
    layer_windows: tuple[int, ...] = ()
    layer_rope_thetas: tuple[float, ...] = ()
    layer_rope_scalings: tuple[dict | None, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ModelLoadError(f"config: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(f"config: num_attention_heads ({self.num_attention_heads}) is not "
                                 f"a multiple of num_key_value_heads ({self.num_key_value_heads})")
        n = self.num_hidden_layers
        defaults = {"layer_windows": (0,) * n, "layer_rope_thetas": (self.rope_theta,) * n,
                    "layer_rope_scalings": (self.rope_scaling,) * n}
        for name, default in defaults.items():
            value = tuple(getattr(self, name)) or default
            if len(value) != n:
                raise ModelLoadError(f"config: {name} has {len(value)} entries for "
                                     f"{n} layers")
            object.__setattr__(self, name, value)
        if any(not isinstance(w, int) or w < 0 for w in self.layer_windows):
            raise ModelLoadError(f"config: attention windows must be integers >= 0, got "
                                 f"{self.layer_windows}")
        rotary = self.head_dim * self.partial_rotary_factor
        if not 0 < rotary <= self.head_dim or int(rotary) % 2:
            raise ModelLoadError(f"config: partial_rotary_factor {self.partial_rotary_factor} "
                                 f"gives {rotary} rotary dims of head_dim {self.head_dim} "
                                 "(needs an even number, at least 2)")

    @property
    def sliding_window(self) -> int:
        """The window when every layer attends through the same window, else 0: the KV cache
        may then drop each sequence's blocks that every layer has left behind."""
        windows = set(self.layer_windows)
        return windows.pop() if len(windows) == 1 else 0

    @property
    def is_encoder(self) -> bool:
        """Bidirectional attention over the whole input (BERT): serves embeddings only."""
        return self.architecture in ENCODERS

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_scale(self) -> float:
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_hf(cls, hf_config: Any) -> "ModelConfig":
        """From a transformers PretrainedConfig or a config.json dict (transformers 4 or 5)."""
        cfg = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
        architecture = _architecture(cfg)
        if architecture == "gemma3" and isinstance(cfg.get("text_config"), dict):
            cfg = _gemma3_text_config(cfg)
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                               "num_hidden_layers", "num_attention_heads") if k not in cfg]
        if missing:
            raise ModelLoadError(f"config: missing {', '.join(missing)}")
        family = family_configs.FAMILY_FIELDS[architecture](cfg)
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or _divide(cfg["hidden_size"], heads, "hidden_size")
        rope_theta, rope_scaling = family.pop("rope", None) or family_configs.rope(cfg)
        return cls(
            architecture=architecture,
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads, head_dim=head_dim,
            rms_norm_eps=family.pop("norm_eps", None) or float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"), eos_token_ids=id_tuple(cfg.get("eos_token_id")),
            **family)


def _architecture(cfg: dict) -> str:
    model_type = cfg.get("model_type")
    if model_type in ARCHITECTURES:
        return ARCHITECTURES[model_type]
    classes = cfg.get("architectures") or []
    if model_type is None:
        for name in classes:
            if name in HF_CLASSES:
                return HF_CLASSES[name]
    raise ModelLoadError(f"config: unsupported architecture model_type={model_type!r} "
                         f"(architectures {classes}); supported: {', '.join(SUPPORTED)}")


def _gemma3_text_config(cfg: dict) -> dict:
    """A Gemma 3 config with a vision part: its text model, with the outer ids and tying."""
    text = dict(cfg["text_config"])
    for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):
        if cfg.get(key) is not None:
            text[key] = cfg[key]
    text["model_type"] = "gemma3_text"
    return text


def _divide(total: int, parts: int, name: str) -> int:
    if total % parts:
        raise ModelLoadError(f"config: no head_dim and {name} ({total}) is not divisible by "
                             f"num_attention_heads ({parts})")
    return total // parts


def id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)
