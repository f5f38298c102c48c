"""Llama (Llama 2/3, SmolLM2, TinyLlama) and Mistral: the plain pre-norm decoder.

Mistral differs only in its config: every layer attends through `sliding_window`
(ModelConfig.layer_windows), which the attention kernels apply.
"""
from __future__ import annotations

from pagedserve.workers.models.causal_lm import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    pass


class MistralForCausalLM(DecoderForCausalLM):
    pass
