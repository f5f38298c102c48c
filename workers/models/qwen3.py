"""Qwen3: Llama's decoder with an RMSNorm over each q and k head before RoPE
(ModelConfig.qk_norm: q_norm / k_norm, weights of head_dim), and biases only with
attention_bias (q/k/v and o)."""
from __future__ import annotations

from pagedserve.workers.models.causal_lm import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    pass
