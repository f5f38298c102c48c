"""Model implementations, looked up by `ModelConfig.architecture`."""
from __future__ import annotations

from torch import nn


def model_class(architecture: str) -> type[nn.Module]:
    from pagedserve.workers.models.llama import LlamaForCausalLM

    registry = {"llama": LlamaForCausalLM}
    try:
        return registry[architecture]
    except KeyError:
        raise ValueError(f"model architecture {architecture!r} is not supported "
                         f"(supported: {', '.join(sorted(registry))})") from None
