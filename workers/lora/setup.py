"""What a rank needs to serve LoRA adapters, from --enable-lora's settings
(pipeline/lora_config.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.pipeline.lora_config import LoRAArgs
from pagedserve.pipeline.lora_files import FAMILIES, BaseShapes
from pagedserve.workers.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class LoRASetup:
    num_slots: int      # --max-loras: adapters one step may use
    max_rank: int       # --max-lora-rank
    cpu_slots: int      # --max-cpu-loras: adapters kept in host memory

    @classmethod
    def from_args(cls, args: LoRAArgs) -> "LoRASetup | None":
        if not args.enable_lora:
            return None
        return cls(args.max_loras, args.max_lora_rank, args.cpu_slots)


def base_shapes(config: ModelConfig) -> BaseShapes:
    return BaseShapes(config.architecture, config.num_hidden_layers, config.hidden_size,
                      config.num_attention_heads * config.head_dim,
                      config.num_key_value_heads * config.head_dim, config.intermediate_size,
                      config.num_attention_heads, config.num_key_value_heads)


def lora_manager(model: nn.Module, config: ModelConfig, setup: LoRASetup | None,
                 dtype: torch.dtype, device: torch.device):
    """A LoRAManager with its slots on `model`'s linears, or None without LoRA; ValueError for
    a family whose projections adapters cannot name."""
    if setup is None:
        return None
    if config.architecture not in FAMILIES:
        raise ValueError(f"--enable-lora: LoRA adapters serve {', '.join(FAMILIES)} models; "
                         f"this one is {config.architecture}")
    from pagedserve.workers.lora.manager import LoRAManager
    return LoRAManager(model, base_shapes(config), setup.num_slots, setup.max_rank,
                       setup.cpu_slots, dtype, device)
