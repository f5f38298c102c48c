"""A llama.cpp LoRA GGUF's tensors as torch tensors in Hugging Face's layout: lora_a [r, in],
lora_b [out, r], and for a llama file the q/k rows of lora_b permuted back (llama.cpp's
converter permutes them as it does the base model's q/k weights: workers/gguf_weights.py)."""
from __future__ import annotations

import numpy as np
import torch

from pagedserve.pipeline.lora_files import AdapterFiles, BaseShapes, read_gguf_adapter


def unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation (per head, its interleaved pairs
    back into halves), as workers/gguf_weights.py undoes it on the base model's weights."""
    dim = rows // heads // 2
    return torch.arange(rows).view(heads, dim, 2).transpose(1, 2).reshape(rows)


def read_gguf_tensors(files: AdapterFiles, base: BaseShapes) -> dict[str, torch.Tensor]:
    from gguf import GGUFReader

    _, header, arch = read_gguf_adapter(files.weights)
    reader = GGUFReader(files.weights)
    heads = {"q_proj": base.num_heads, "k_proj": base.num_kv_heads}
    wanted = {t.b_name: module for (_, module), t in files.targets.items()}
    wanted.update({t.a_name: None for t in files.targets.values()})
    tensors = {}
    for tensor in reader.tensors:
        if tensor.name not in wanted:
            continue
        dtype, shape = header[tensor.name]
        value = torch.from_numpy(np.array(tensor.data, copy=True))
        if dtype == "BF16":   # gguf-py hands bf16 over as raw 16-bit words
            value = value.view(torch.int16).view(torch.bfloat16)
        value = value.reshape(shape).float()
        module = wanted[tensor.name]
        if arch == "llama" and module in heads and heads[module]:
            value = value[unpermute_rows(value.shape[0], heads[module])]
        tensors[tensor.name] = value
    return tensors
