"""Gemma 3's text model (Gemma3ForCausalLM, or the language model of a Gemma 3 checkpoint
with a vision tower, whose vision weights are skipped).

Beside Llama: embeddings scaled by sqrt(hidden) (rounded to the model dtype first, as
transformers does); RMSNorm scaling by (1 + weight), computed in fp32; norms before and after
attention and MLP; a GELU-tanh gated MLP; q/k norms; attention scale query_pre_attn_scalar^-0.5;
sliding-window and global layers interleaved, each kind with its own RoPE base and scaling
(ModelConfig.layer_windows / layer_rope_*); and optional final logit soft-capping.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pagedserve.kernels import native_elementwise
from pagedserve.workers.distributed import TPGroup
from pagedserve.workers.model_config import ModelConfig
from pagedserve.workers.models.causal_lm import DecoderForCausalLM
from pagedserve.workers.models.decoder import SandwichDecoderLayer
from pagedserve.workers.models.layers import RMSNorm, native_cpu_elementwise


class GemmaRMSNorm(RMSNorm):
    """rmsnorm(x) * (1 + weight) in fp32, rounded once to x's dtype (checkpoints store w - 1)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        scale = self.weight.float() + 1.0
        if x.dtype == torch.float32 and native_cpu_elementwise() \
                and native_elementwise.supports(*((x,) if residual is None else (x, residual))):
            if residual is None:
                return native_elementwise.rms_norm(x, scale, self.eps)
            return native_elementwise.fused_add_rms_norm(x, residual, scale, self.eps), residual
        if residual is not None:
            residual.add_(x)
            x = residual
        out = F.rms_norm(x.float(), scale.shape, None, self.eps).mul_(scale).to(x.dtype)
        return out if residual is None else (out, residual)


class Gemma3DecoderLayer(SandwichDecoderLayer):
    norm_class = GemmaRMSNorm
    # before attention, after it, before the MLP, after it
    norm_names = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm")


# prefixes of a Gemma 3 checkpoint with a vision tower -> the text model's names
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
                    "multi_modal_projector.")


class Gemma3ForCausalLM(DecoderForCausalLM):
    layer_class = Gemma3DecoderLayer

    def __init__(self, config: ModelConfig, tp: TPGroup = TPGroup(),
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__(config, tp, dtype, device)
        # transformers keeps sqrt(hidden) as an fp32 tensor and casts it to the weights' dtype
        self.embed_scale = float(torch.tensor(math.sqrt(config.hidden_size)).to(dtype))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_lookup(input_ids).mul_(self.embed_scale)

    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith(_VISION_PREFIXES):
            return None
        for prefix, text_prefix in _TEXT_PREFIXES:
            if name.startswith(prefix):
                name = text_prefix + name[len(prefix):]
                break
        return super().checkpoint_name(name)
