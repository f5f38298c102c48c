"""Model implementations, one module per family, looked up by `ModelConfig.architecture`
(workers/model_config.py reads it from config.json)."""
from __future__ import annotations

import importlib

from torch import nn

# architecture -> (module in this package, class)
REGISTRY = {"llama": ("llama", "LlamaForCausalLM"), "mistral": ("llama", "MistralForCausalLM"),
            "qwen2": ("qwen2", "Qwen2ForCausalLM"), "qwen3": ("qwen3", "Qwen3ForCausalLM"),
            "gemma3": ("gemma3", "Gemma3ForCausalLM"), "glm4": ("glm4", "Glm4ForCausalLM"),
            "bert": ("bert", "BertModel")}


def model_class(architecture: str) -> type[nn.Module]:
    try:
        module, name = REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"model architecture {architecture!r} is not supported "
                         f"(supported: {', '.join(sorted(REGISTRY))})") from None
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
