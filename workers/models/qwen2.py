"""Qwen2: Llama's decoder with a bias on the q/k/v projections (ModelConfig.qkv_bias) and, with
use_sliding_window, windowed attention on the layers from max_window_layers on."""
from __future__ import annotations

from pagedserve.workers.models.causal_lm import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    pass
