"""An adapter's tensors loaded into host memory, from the files pipeline/lora_files.py checked.

Per layer and projection: A [r, in] and B [out, r] times the adapter's scaling, in the model's
dtype, unsharded (each linear cuts its rank's part when a slot takes them: stack.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.pipeline.lora_files import AdapterFiles, BaseShapes, check_adapter
from pagedserve.pipeline.lora_request import LoRARequest


@dataclass(slots=True)
class LoadedAdapter:
    lora_int_id: int
    rank: int
    layers: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for parts in self.layers.values()
                   for pair in parts.values() for t in pair)


def load_adapter(lora: LoRARequest, base: BaseShapes, max_rank: int, dtype: torch.dtype,
                 architecture: str = "") -> LoadedAdapter:
    """Check the adapter's files against the model again (they may have changed since the
    ingress checked them) and read its tensors."""
    files = check_adapter(lora.lora_path, base, max_rank)
    tensors = _read_peft(files) if files.format == "peft" else _read_gguf(files, base)
    layers: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for (layer, module), target in files.targets.items():
        a = tensors[target.a_name].to(dtype=torch.float32)
        b = tensors[target.b_name].to(dtype=torch.float32) * target.scaling
        layers.setdefault(layer, {})[module] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
    return LoadedAdapter(lora.lora_int_id, files.rank, layers)


def _read_peft(files: AdapterFiles) -> dict[str, torch.Tensor]:
    from safetensors import safe_open
    names = {n for t in files.targets.values() for n in (t.a_name, t.b_name)}
    with safe_open(files.weights, framework="pt") as f:
        return {name: f.get_tensor(name) for name in names}


def _read_gguf(files: AdapterFiles, base: BaseShapes) -> dict[str, torch.Tensor]:
    from pagedserve.workers.lora.gguf_adapter import read_gguf_tensors
    return read_gguf_tensors(files, base)
