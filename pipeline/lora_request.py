"""A request's LoRA adapter, as every role sees it (vLLM's LoRARequest): data only.

The ingress (or the Python API) resolves a model name to one of these; the scheduler keys the
prefix cache by it and records it with the request, so that every NewSeq carries it to the
workers, which load `lora_path` once into host memory and give it a device slot while it runs.
"""
from __future__ import annotations

import msgspec

# Prefixed to a request's cache salt for its adapter: no client salt may start with it, so a
# base-model request never reads an adapter's KV blocks, nor one adapter another's.
LORA_SALT_PREFIX = "\x00lora\x00"


class LoRARequest(msgspec.Struct, frozen=True, kw_only=True):
    """An adapter by name: `lora_int_id` (> 0) is unique per loaded adapter (a reload of the same
    name under another path gets a new id), `lora_path` its PEFT folder or GGUF file,
    `base_model_name` the model it adapts (listed as its `parent`)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not self.lora_name or self.lora_int_id < 1:
            raise ValueError(f"a LoRA adapter needs a name and an id >= 1, got "
                             f"{self.lora_name!r} with id {self.lora_int_id}")


def lora_cache_salt(lora: LoRARequest | None, cache_salt: str | None) -> str | None:
    """The salt the prefix cache keys a request's blocks by: its own, or with an adapter the
    adapter's id in front of it (two adapters, or an adapter and the base, never share KV)."""
    if lora is None:
        return cache_salt
    return f"{LORA_SALT_PREFIX}{lora.lora_int_id}\x00{cache_salt or ''}"
