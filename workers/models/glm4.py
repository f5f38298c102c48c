"""GLM-4 (Glm4ForCausalLM): norms before and after attention and MLP, a bias on q/k/v, gate|up
stored as one gate_up_proj, and RoPE on the first half of each head (partial_rotary_factor)
over interleaved pairs (2i, 2i + 1), which the q/k weights are permuted into rotate-halves
order for as they load (rotary.head_perm)."""
from __future__ import annotations

from pagedserve.workers.models.causal_lm import DecoderForCausalLM
from pagedserve.workers.models.decoder import SandwichDecoderLayer


class Glm4DecoderLayer(SandwichDecoderLayer):
    # before attention, after it, before the MLP, after it
    norm_names = ("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm",
                  "post_mlp_layernorm")
    merged_gate_up = True


class Glm4ForCausalLM(DecoderForCausalLM):
    layer_class = Glm4DecoderLayer
