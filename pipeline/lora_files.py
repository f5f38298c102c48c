"""LoRA adapter files checked against the base model before anything loads them.

A PEFT folder (adapter_config.json + adapter_model.safetensors) is read as its config and
the safetensors header (names, dtypes, shapes: no tensor data); a GGUF adapter as llama.cpp's
convert_lora_to_gguf.py writes it (general.type "adapter", adapter.lora.alpha, tensors
blk.N.<name>.weight.lora_a / .lora_b). Every tensor must be an A or B of one of the seven
projections of a decoder layer the model has, of the shapes its config gives and of a rank
within --max-lora-rank: otherwise LoRAFileError names the cause. The ingress and the Python
API check here when an adapter is added; the workers load the tensors the result names.
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# llama.cpp's tensor names of the same projections
GGUF_TARGETS = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj",
                "attn_output": "o_proj", "ffn_gate": "gate_proj", "ffn_up": "up_proj",
                "ffn_down": "down_proj"}
# Families whose layers name their projections as TARGETS (workers/models/)
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
MAX_HEADER_BYTES = 64 << 20
MAX_CONFIG_BYTES = 1 << 20
_PEFT_NAME = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
                        r"(?:\.default)?\.weight")
_GGUF_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight\.lora_([ab])")
FLOAT_DTYPES = {"F32", "F16", "BF16"}


class LoRAFileError(ValueError):
    """An adapter that cannot serve this model; the message names the cause."""


@dataclass(frozen=True, slots=True)
class BaseShapes:
    """What an adapter must fit: the family and each projection's (in, out) features."""

    architecture: str   # the config's model_type
    num_layers: int
    hidden: int
    q_size: int
    kv_size: int
    intermediate: int
    num_heads: int = 0      # (a llama GGUF adapter's q/k rows are permuted per head)
    num_kv_heads: int = 0

    @classmethod
    def from_config(cls, config: dict) -> "BaseShapes":
        """From a Hugging Face config.json's fields."""
        arch = config.get("model_type", "")
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        kv_heads = config.get("num_key_value_heads") or heads
        return cls(arch, config["num_hidden_layers"], config["hidden_size"], heads * head_dim,
                   kv_heads * head_dim, config["intermediate_size"], heads, kv_heads)

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike) -> "BaseShapes":
        return cls.from_config(json.loads((Path(model_dir) / "config.json").read_text()))

    def features(self, module: str) -> tuple[int, int]:
        h, q, kv, i = self.hidden, self.q_size, self.kv_size, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}[module]


@dataclass(frozen=True, slots=True)
class AdapterTensors:
    """One projection's adapter: the names of A [r, in] and B [out, r] in the file, r, and the
    scaling (alpha / r, or alpha / sqrt(r) with rsLoRA)."""

    a_name: str
    b_name: str
    rank: int
    scaling: float


@dataclass(frozen=True, slots=True)
class AdapterFiles:
    """A checked adapter: its format ("peft" or "gguf"), weights file, and tensors by
    (layer, projection)."""

    format: str
    weights: str
    targets: dict[tuple[int, str], AdapterTensors] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return max(t.rank for t in self.targets.values())


def check_adapter(path: str, base: BaseShapes, max_rank: int) -> AdapterFiles:
    """The adapter at `path` (a PEFT folder or a GGUF file), checked against `base`."""
    if base.architecture not in FAMILIES:
        raise LoRAFileError(f"LoRA adapters serve {', '.join(FAMILIES)} models; this one is "
                            f"{base.architecture or 'of an unknown family'}")
    target = Path(path)
    if not target.is_absolute():
        raise LoRAFileError("a LoRA adapter's path must be absolute")
    if target.is_dir():
        found = _peft_targets(target, base)
        files = AdapterFiles("peft", str(target / PEFT_WEIGHTS), found)
    elif target.is_file() and target.suffix == ".gguf":
        files = AdapterFiles("gguf", str(target), _gguf_targets(target, base))
    else:
        raise LoRAFileError("a LoRA adapter's path must be a PEFT folder (adapter_config.json "
                            "and adapter_model.safetensors) or a .gguf file")
    if not files.targets:
        raise LoRAFileError("the adapter has no LoRA weights")
    if files.rank > max_rank:
        raise LoRAFileError(f"the adapter's rank is {files.rank}, above --max-lora-rank "
                            f"{max_rank}")
    return files


def _peft_targets(folder: Path, base: BaseShapes) -> dict[tuple[int, str], AdapterTensors]:
    config = _peft_config(folder / PEFT_CONFIG)
    header = safetensors_header(folder / PEFT_WEIGHTS)
    pairs = _pair_tensors(header, _PEFT_NAME, lambda m: m, "AB")
    targets = {}
    for (layer, module), (a_name, b_name) in pairs.items():
        rank = _check_pair(layer, module, header[a_name], header[b_name], base)
        alpha = _pattern_value(config.get("alpha_pattern") or {}, layer, module,
                               config.get("lora_alpha", 8))
        root = math.sqrt(rank) if config.get("use_rslora") else rank
        targets[layer, module] = AdapterTensors(a_name, b_name, rank, alpha / root)
    return targets


def _peft_config(path: Path) -> dict:
    if not path.is_file():
        raise LoRAFileError(f"the adapter folder has no {PEFT_CONFIG}")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise LoRAFileError(f"{PEFT_CONFIG} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise LoRAFileError(f"{PEFT_CONFIG} is not valid JSON: {exc}") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise LoRAFileError(f"{PEFT_CONFIG}: peft_type must be LORA")
    refused = [name for name, bad in (("use_dora", config.get("use_dora")),
                                      ("modules_to_save", config.get("modules_to_save")),
                                      ("fan_in_fan_out", config.get("fan_in_fan_out")),
                                      ("bias", config.get("bias", "none") != "none")) if bad]
    if refused:
        raise LoRAFileError(f"{PEFT_CONFIG}: {', '.join(refused)} is not supported")
    return config


def _pattern_value(patterns: dict, layer: int, module: str, default: float) -> float:
    """PEFT's alpha_pattern: the first key that names this module (by its full name's tail)."""
    name = f"layers.{layer}.{module}"
    for key, value in patterns.items():
        if re.search(rf"(^|\.){re.escape(str(key))}$", name) or str(key) == module:
            return float(value)
    return float(default)


def _pair_tensors(header: dict, pattern: re.Pattern, rename, letters: str
                  ) -> dict[tuple[int, str], tuple[str, str]]:
    """(layer, projection) -> (A name, B name); LoRAFileError for any other tensor."""
    halves: dict[tuple[int, str], dict[str, str]] = {}
    for name in header:
        match = pattern.fullmatch(name)
        module = rename(match[2]) if match else None
        if module not in TARGETS:
            raise LoRAFileError(f"tensor {name!r} is not a LoRA A or B of a decoder layer's "
                                f"{'/'.join(TARGETS)}")
        halves.setdefault((int(match[1]), module), {})[match[3].upper()] = name
    pairs = {}
    for key, found in halves.items():
        if set(found) != set(letters.upper()):
            raise LoRAFileError(f"layer {key[0]} {key[1]}: LoRA A and B must both be given")
        pairs[key] = (found["A"], found["B"])
    return pairs


def _check_pair(layer: int, module: str, a: tuple[str, list[int]], b: tuple[str, list[int]],
                base: BaseShapes) -> int:
    """The pair's rank, after checking dtypes and shapes (A [r, in], B [out, r])."""
    if layer >= base.num_layers:
        raise LoRAFileError(f"the adapter has layer {layer}, the model {base.num_layers} layers")
    for dtype, _ in (a, b):
        if dtype not in FLOAT_DTYPES:
            raise LoRAFileError(f"layer {layer} {module}: dtype {dtype} is not one of "
                                f"{', '.join(sorted(FLOAT_DTYPES))}")
    fan_in, fan_out = base.features(module)
    rank = a[1][0] if len(a[1]) == 2 else -1
    if list(a[1]) != [rank, fan_in] or list(b[1]) != [fan_out, rank] or rank < 1:
        raise LoRAFileError(f"layer {layer} {module}: A {list(a[1])} and B {list(b[1])} do not "
                            f"fit the model's {fan_in} -> {fan_out} projection (A [r, {fan_in}], "
                            f"B [{fan_out}, r])")
    return rank


def safetensors_header(path: Path) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) from a safetensors file's header (its JSON is bounded)."""
    if not path.is_file():
        raise LoRAFileError(f"the adapter folder has no {path.name}")
    with open(path, "rb") as f:
        raw = f.read(8)
        size = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
        if not 0 < size <= MAX_HEADER_BYTES:
            raise LoRAFileError(f"{path.name} is not a safetensors file")
        try:
            header = json.loads(f.read(size))
        except (ValueError, UnicodeDecodeError):
            raise LoRAFileError(f"{path.name} is not a safetensors file") from None
    header.pop("__metadata__", None)
    return {name: (info["dtype"], list(info["shape"])) for name, info in header.items()}


def _gguf_targets(path: Path, base: BaseShapes) -> dict[tuple[int, str], AdapterTensors]:
    alpha, header, _ = read_gguf_adapter(path)
    pairs = _pair_tensors(header, _GGUF_NAME, GGUF_TARGETS.get, "AB")
    targets = {}
    for (layer, module), (a_name, b_name) in pairs.items():
        rank = _check_pair(layer, module, header[a_name], header[b_name], base)
        targets[layer, module] = AdapterTensors(a_name, b_name, rank,
                                                (alpha or rank) / rank)
    return targets


# llama.cpp's LoRA GGUF header (convert_lora_to_gguf.py): tensor shapes are given as torch sees
# them, lora_a [r, in] and lora_b [out, r] (GGUF lists dimensions innermost first).
GGUF_FLOAT_TYPES = {0: "F32", 1: "F16", 30: "BF16"}


def read_gguf_adapter(path: Path) -> tuple[float, dict[str, tuple[str, list[int]]], str]:
    """(alpha, name -> (dtype, shape), general.architecture)."""
    from gguf import GGUFReader
    try:
        reader = GGUFReader(str(path))
    except Exception as exc:   # gguf-py raises ValueError, struct.error, ... on a bad file
        raise LoRAFileError(f"{path.name} is not a GGUF file: {type(exc).__name__}") from None
    kind = _string(reader, "general.type")
    if kind != "adapter" or _string(reader, "adapter.type") != "lora":
        raise LoRAFileError(f"{path.name} is not a LoRA adapter GGUF (general.type {kind!r}, "
                            f"adapter.type {_string(reader, 'adapter.type')!r})")
    field = reader.get_field("adapter.lora.alpha")
    alpha = float(field.parts[field.data[0]][0]) if field is not None else 0.0
    header = {}
    for tensor in reader.tensors:
        dtype = GGUF_FLOAT_TYPES.get(int(tensor.tensor_type), tensor.tensor_type.name)
        header[tensor.name] = (dtype, [int(d) for d in reversed(tensor.shape.tolist())])
    return alpha, header, _string(reader, "general.architecture") or ""


def _string(reader, key: str) -> str | None:
    field = reader.get_field(key)
    if field is None:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
