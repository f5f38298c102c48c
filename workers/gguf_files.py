"""GGUF files: checking a header fast, describing one as a weightless Hugging Face directory.

workers.loader decides when (once per file, under its cache lock); this module does the work;
workers/builtin_models.py fetches the built-in models' files.
"""
from __future__ import annotations

import json
import logging
import os
import struct
import time
from pathlib import Path
from typing import NamedTuple

from pagedserve.pipeline.load_error import ModelLoadError

# The loader's logger: converting is a step of loading a model, and its log lines keep that name.
logger = logging.getLogger("pagedserve.loader")

# GGUF general.architecture values we can convert.
GGUF_ARCHITECTURES = {"llama", "qwen2", "qwen3", "gemma3"}

# llama.cpp's general.sampling.* keys -> generation_config.json's names
GGUF_SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
                      "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
                      "general.sampling.penalty_repeat": "repetition_penalty"}


# llama.cpp pre-tokenizer types (tokenizer.ggml.pre) whose Hugging Face originals split digits
# one by one before the byte-level regex; transformers' GGUF reading drops that step (found
# against llama.cpp on ShareGPT: SmolLM2 agreed on 855 of 1,000 texts without it, all with it).
DIGIT_SPLITTING_PRE_TOKENIZERS = {"smollm", "starcoder", "refact"}


# ---------------------------------------------------------------- the header check

_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
           12: "d"}
_STRING, _ARRAY = 8, 9


def check_gguf(path: Path) -> str:
    """Parse the GGUF header (no tensor data); return general.architecture.

    Catches random bytes, truncated files and unsupported architectures in well under a second,
    before the slow conversion starts.
    """
    try:
        meta, data_end, _, _ = _scan_gguf(path)
    except (struct.error, ValueError, KeyError, UnicodeDecodeError, EOFError) as e:
        raise ModelLoadError(f"{path}: corrupt or truncated GGUF file ({e})") from e
    size = path.stat().st_size
    if data_end > size:
        raise ModelLoadError(f"{path}: truncated GGUF file: its header describes {data_end} "
                             f"bytes but the file has {size}")
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"{path}: unsupported GGUF architecture {arch!r} "
                             f"(supported: {', '.join(sorted(GGUF_ARCHITECTURES))})")
    return arch


def gguf_metadata(path: Path) -> dict:
    """The header's scalar and string values (arrays are skipped: None)."""
    return _scan_gguf(Path(path))[0]


def gguf_sampling_defaults(path: Path) -> dict:
    """The file's general.sampling.* values under generation_config.json's names."""
    meta = gguf_metadata(path)
    return {name: meta[key] for key, name in GGUF_SAMPLING_KEYS.items()
            if isinstance(meta.get(key), (int, float))}


class TensorInfo(NamedTuple):
    name: str
    dims: tuple[int, ...]    # ggml's order: dims[0] is the row length
    qtype: int               # GGMLQuantizationType
    offset: int              # from the start of the data section
    nbytes: int


def gguf_tensors(path: Path) -> tuple[dict, int, list[TensorInfo]]:
    """(header values, where the data section starts, every tensor's info): the header read
    fast (the tokenizer's arrays skipped), for reading the tensors through a mapping."""
    try:
        meta, data_end, data_start, tensors = _scan_gguf(Path(path))
    except (struct.error, ValueError, KeyError, UnicodeDecodeError, EOFError) as e:
        raise ModelLoadError(f"{path}: corrupt or truncated GGUF file ({e})") from e
    if data_end > Path(path).stat().st_size:
        raise ModelLoadError(f"{path}: truncated GGUF file: its header describes {data_end} "
                             f"bytes but the file has {Path(path).stat().st_size}")
    return meta, data_start, tensors


def _scan_gguf(path: Path) -> tuple[dict, int, int, list[TensorInfo]]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    size = path.stat().st_size
    with open(path, "rb") as f:
        def read(fmt: str):
            n = struct.calcsize(fmt)
            data = f.read(n)
            if len(data) < n:
                raise EOFError("file ends inside the header")
            return struct.unpack("<" + fmt, data)[0]

        def read_str() -> str:
            n = read("Q")
            if n > size:
                raise ValueError(f"string length {n} exceeds the file size")
            return f.read(n).decode("utf-8")

        def read_value(vtype: int):
            if vtype == _STRING:
                return read_str()
            if vtype == _ARRAY:
                etype, count = read("I"), read("Q")
                if etype in _SCALAR:  # skip fixed-size arrays without decoding them
                    f.seek(count * struct.calcsize(_SCALAR[etype]), os.SEEK_CUR)
                    return None
                for _ in range(count):
                    read_value(etype)
                return None
            if vtype not in _SCALAR:
                raise ValueError(f"unknown metadata value type {vtype}")
            return read(_SCALAR[vtype])

        if f.read(4) != b"GGUF":
            raise ValueError("bad magic: not a GGUF file")
        version = read("I")
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        n_tensors, n_kv = read("Q"), read("Q")
        if n_tensors > size or n_kv > size:
            raise ValueError("implausible tensor or metadata count")
        meta = {}
        for _ in range(n_kv):
            key = read_str()
            meta[key] = read_value(read("I"))
        data_end = 0
        tensors = []
        for _ in range(n_tensors):
            name = read_str()
            dims = [read("Q") for _ in range(read("I"))]
            qtype = read("I")
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
            except (ValueError, KeyError):
                raise ValueError(f"tensor {name} has tensor type {qtype}, which this engine "
                                 f"does not know") from None
            n_elements = 1
            for d in dims:
                n_elements *= d
            offset, nbytes = read("Q"), n_elements // block * type_size
            tensors.append(TensorInfo(name, tuple(dims), qtype, offset, nbytes))
            data_end = max(data_end, offset + nbytes)
        alignment = meta.get("general.alignment") or 32
        data_start = -(-f.tell() // alignment) * alignment
    return meta, data_start + data_end, data_start, tensors


# ---------------------------------------------------------------- conversion

GGUF_POINTER = "gguf.json"   # in a described directory: which GGUF file holds the weights


def convert_gguf(gguf_path: Path, out_dir: Path, *, generation_config: dict | None = None) -> None:
    """Describe gguf_path in out_dir as a Hugging Face directory without weights: config.json
    (transformers' reading of the header), tokenizer, generation_config.json (transformers'
    reading, then the file's general.sampling.* values, then `generation_config`: a built-in's
    published defaults) and gguf.json naming the file, whose tensors the workers read through mmap
    (workers/gguf_weights.py). Nothing is dequantized here.

    A change to what it writes wants workers.loader.CACHE_FORMAT bumped, or old caches are reused.
    """
    start = time.monotonic()
    try:
        from transformers import AutoConfig, GenerationConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        tokenizer = gguf_tokenizer(gguf_path)
        hf_config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    except Exception as e:
        raise ModelLoadError(f"{gguf_path}: transformers could not read this GGUF file "
                             f"({type(e).__name__}: {e})") from e
    config = hf_config.to_dict()
    for key in ("quantization_config", "_model_name_or_path", "_name_or_path"):
        config.pop(key, None)  # the folder it was read from is not the model's
    architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(hf_config.model_type)
    config.update(dtype="float32", architectures=[architecture] if architecture else None)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    _write_generation_config(out_dir / "generation_config.json",
                             GenerationConfig.from_model_config(hf_config),
                             {**gguf_sampling_defaults(gguf_path), **(generation_config or {})})
    tokenizer.save_pretrained(out_dir)
    stat = gguf_path.stat()
    (out_dir / GGUF_POINTER).write_text(json.dumps(
        {"file": str(gguf_path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}, indent=1))
    logger.info("described %s in %.1f s (its weights stay in the file)", gguf_path.name,
                time.monotonic() - start)


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a described directory reads its weights from; None for another directory.
    ModelLoadError when the file is gone or changed since."""
    pointer = Path(model_dir) / GGUF_POINTER
    if not pointer.is_file():
        return None
    try:
        source = json.loads(pointer.read_text())
        path = Path(source["file"])
        stat = path.stat()
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{model_dir}: its weights file named in {GGUF_POINTER} cannot be "
                             f"read ({e})") from e
    if stat.st_size != source.get("size"):   # (a user file's cache key holds its mtime too)
        raise ModelLoadError(f"{path} changed since {model_dir} was made from it; remove that "
                             f"directory to describe the file again")
    return path


def _write_generation_config(path: Path, read: object, overrides: dict) -> None:
    values = {}
    if read is not None:
        read.to_json_file(path)  # only what differs from transformers' defaults
        values = json.loads(path.read_text())
    values.update(overrides)
    if values:
        path.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")


def gguf_tokenizer(gguf_path: Path):
    """The fast tokenizer transformers rebuilds from the GGUF's vocabulary, with what its
    reading loses put back (the chat template comes along)."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    restore_pre_tokenizer(tokenizer, gguf_metadata(gguf_path).get("tokenizer.ggml.pre"))
    return tokenizer


def restore_pre_tokenizer(tokenizer, pre_type: str | None) -> None:
    """Put back the digit split the original tokenizer of `pre_type` does first (in place)."""
    if pre_type not in DIGIT_SPLITTING_PRE_TOKENIZERS:
        return
    from tokenizers import pre_tokenizers
    backend = tokenizer.backend_tokenizer
    current = backend.pre_tokenizer
    digits = pre_tokenizers.Digits(individual_digits=True)
    backend.pre_tokenizer = digits if current is None else pre_tokenizers.Sequence([digits, current])
