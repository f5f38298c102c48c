"""A GGUF file's tensors under Hugging Face names, read from the file one tensor at a time.

Tensors of a block type the kernels multiply as stored (kernels/quant_formats.py: Q4_0, Q4_1,
Q5_0, Q8_0, Q4_K, Q5_K, Q6_K) come out as `QuantizedWeight`s holding the file's own bytes,
unless `keep_quantized` is off; every other tensor is dequantized on its own to `dtype` (one log line
per type). What llama.cpp's converter changed is undone here, as transformers' GGUF reader does:
llama's q/k rows are permuted back (on the raw rows, whole blocks), Gemma's norms lose the 1 the
converter added.
"""
from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from pagedserve.kernels.quant_formats import QType, QuantizedWeight
from pagedserve.pipeline.load_error import ModelLoadError
from pagedserve.workers.gguf_files import gguf_tensors

logger = logging.getLogger("pagedserve.loader")

_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_BLOCK = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
          "attn_k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
          "ffn_norm": "post_attention_layernorm"}
# Gemma 3 has four norms a layer; llama.cpp names them differently
_GEMMA3_BLOCK = {**_BLOCK, "post_attention_norm": "post_attention_layernorm",
                 "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_SKIPPED = {"rope_freqs.weight"}   # llama 3's RoPE scaling: the config carries it
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str, arch: str) -> str | None:
    """The Hugging Face name of a GGUF tensor; None for one the model does not load."""
    if gguf_name in _SKIPPED:
        return None
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    match = _LAYER.fullmatch(gguf_name)
    names = _GEMMA3_BLOCK if arch == "gemma3" else _BLOCK
    if match is None or match[2] not in names:
        raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no counterpart in a {arch} model")
    return f"model.layers.{match[1]}.{names[match[2]]}.{match[3]}"


def _unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation (per head: pairs interleaved back
    into halves)."""
    dim = rows // heads // 2
    return torch.arange(rows).view(heads, dim, 2).transpose(1, 2).reshape(rows)


def iter_gguf_weights(path: Path, config: dict, dtype: torch.dtype, keep_quantized: bool = True
                      ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """(Hugging Face name, tensor) for every tensor of the GGUF at `path`; `config` is the
    model's config.json (heads, for llama's permutation)."""
    meta, data_start, tensors = gguf_tensors(path)
    arch = meta.get("general.architecture")
    with open(path, "rb") as file:
        yield from _tensors(path, file, arch, tensors, data_start, config, dtype, keep_quantized)


def _lookup_table(file, tensor, data_start: int) -> torch.Tensor:
    """A tensor that is only ever looked up by rows (an embedding table whose model has its own
    LM head), kept as a private mapping of the file: a process's RSS holds only the pages of the
    rows it has looked up, not the whole table (Qwen2.5-Coder-1.5B's Q4_K table: 125 MiB)."""
    import mmap   # (gguf_tensors has checked that every tensor lies inside the file)
    mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)   # the tensor keeps it
    return torch.frombuffer(mapping, dtype=torch.uint8, count=tensor.nbytes,
                            offset=data_start + tensor.offset)


def _tensors(path: Path, file, arch: str, tensors: list, data_start: int, config: dict,
             dtype: torch.dtype, keep_quantized: bool):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    heads = {"q_proj": config.get("num_attention_heads"),
             "k_proj": config.get("num_key_value_heads") or config.get("num_attention_heads")}
    dequantized: Counter[str] = Counter()
    untied = any(t.name == "output.weight" for t in tensors)
    for tensor in tensors:
        name = hf_name(tensor.name, arch)
        if name is None:
            continue
        qtype, cols = tensor.qtype, int(tensor.dims[0])   # ggml's dims[0]: the row length
        rows = int(np.prod(tensor.dims[1:])) if len(tensor.dims) > 1 else 1
        if untied and keep_quantized and tensor.name == "token_embd.weight" \
                and qtype in QType._value2member_map_ and len(tensor.dims) == 2:
            table = _lookup_table(file, tensor, data_start)
            yield name, QuantizedWeight(QType(qtype), table.view(rows, -1), cols)
            continue
        # read, not mapped: the kernels read a mapping's 4 KiB pages at a third of the speed of
        # anonymous (huge-page) memory, and mapped pages would count twice while loading
        raw = np.empty(tensor.nbytes, dtype=np.uint8)
        file.seek(data_start + tensor.offset)
        if file.readinto(memoryview(raw)) != tensor.nbytes:
            raise ModelLoadError(f"{path}: truncated GGUF file: tensor {tensor.name} ends past "
                                 f"the end of the file")
        if qtype in QType._value2member_map_ and len(tensor.dims) == 2:
            value: torch.Tensor | QuantizedWeight = QuantizedWeight(
                QType(qtype), torch.from_numpy(raw.reshape(rows, -1)), cols)
            if not keep_quantized:   # the native dequantization is gguf-py's, bit for bit
                value = _dequantized(value, dtype)
        elif qtype == GGMLQuantizationType.F32:
            value = torch.from_numpy(raw.view(np.float32)).to(dtype)
        elif qtype == GGMLQuantizationType.F16:
            value = torch.from_numpy(raw.view(np.float16).astype(np.float32)).to(dtype)
        else:
            type_name = _type_name(qtype)
            try:
                array = dequantize(raw.reshape(rows, -1), GGMLQuantizationType(qtype))
            except (NotImplementedError, ValueError) as e:
                raise ModelLoadError(f"{path}: tensor {tensor.name} is of type {type_name}, "
                                     f"which this engine cannot read") from e
            value = torch.from_numpy(np.ascontiguousarray(array)).to(dtype)
            dequantized[type_name] += 1
        value = _undo_conversion(name, value, arch, heads, rows, cols)
        yield name, value
    for type_name, count in sorted(dequantized.items()):
        logger.info("%s: %d %s tensors dequantized to %s at load (no kernel multiplies "
                    "%s as stored)", path.name, count, type_name, dtype, type_name)


def _dequantized(weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The weight as `dtype` (the native kernels' rows when they load: gguf-py's numpy takes
    tens of seconds for a 0.5B model)."""
    from pagedserve.kernels import native_linear_gguf
    if native_linear_gguf.available():
        rows = native_linear_gguf.dequantize_rows(weight, torch.arange(weight.shape[0]))
    else:
        rows = weight.dequantize()
    return rows if rows.dtype == dtype else rows.to(dtype)


def _type_name(qtype: int) -> str:
    from gguf import GGMLQuantizationType
    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"unknown type {qtype}"


def _undo_conversion(name: str, value, arch: str, heads: dict, rows: int, cols: int):
    if isinstance(value, torch.Tensor) and len(value.shape) >= 1:
        value = value.reshape(rows, cols) if rows > 1 else value.reshape(cols)
    if arch == "llama":
        for proj in ("q_proj", "k_proj"):
            if f".{proj}." in name and heads[proj]:
                order = _unpermute_rows(rows, heads[proj])
                value = value.rows(order) if isinstance(value, QuantizedWeight) else value[order]
    if arch == "gemma3" and name.endswith("norm.weight") and isinstance(value, torch.Tensor):
        value = value - 1
    return value
