"""The decoder layer every family here is made of, over a flattened, unpadded batch.

`DecoderAttention` (fused q/k/v projection with optional bias, optional q/k RMSNorm per head,
RoPE and the KV store, paged attention through this layer's window, output projection),
`GatedMLP` (gate|up in one matmul, SiLU or GELU-tanh, down projection) and two layer shapes:
`DecoderLayer`, norms before attention and MLP (Llama, Mistral, Qwen), and
`SandwichDecoderLayer`, norms before and after each (Gemma 3, GLM-4). A family picks its norm
class and the checkpoint names of its norms; ModelConfig says the rest.

The residual adds happen inside the norms (fused on CPU), so between layers the residual stream
is `hidden + residual`, carried as the pair.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels import native_rope_store
from pagedserve.kernels.quant_formats import QuantizedWeight
from pagedserve.workers.distributed import TPGroup
from pagedserve.workers.model_config import ModelConfig
from pagedserve.workers.models.attention import AttentionMetadata, attend, paged_attention
from pagedserve.workers.models.layers import (MergedColumnParallelLinear, QKVParallelLinear,
                                              RMSNorm, RowParallelLinear,
                                              even_split, gelu_tanh_and_mul,
                                              native_cpu_elementwise, partition_heads,
                                              silu_and_mul)
from pagedserve.workers.models.rotary import RotaryEmbedding, head_perm

ACT_AND_MUL = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul}


class DecoderAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tp: TPGroup, dtype: torch.dtype,
                 device: torch.device | str, norm_class: type[nn.Module] = RMSNorm) -> None:
        super().__init__()
        d = config.head_dim
        part = partition_heads(config.num_attention_heads, config.num_key_value_heads,
                               tp.size, tp.rank)
        self.num_heads, self.num_kv_heads, self.head_dim = len(part.q_heads), len(part.kv_heads), d
        self.scale = config.attention_scale
        self.window = config.layer_windows[layer]
        perm = head_perm(d, config.rotary_dim, config.rope_interleaved)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, config.num_attention_heads,
                                          config.num_key_value_heads, part, dtype, device,
                                          bias=config.qkv_bias, head_perm=perm)
        cols = slice(part.q_heads.start * d, part.q_heads.stop * d)
        self.o_proj = RowParallelLinear(cols, config.hidden_size, tp, dtype, device,
                                        bias=config.o_bias)
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            if perm is not None:
                raise ValueError("q/k norms with a permuted RoPE layout are not supported")
            self.q_norm = norm_class(d, config.rms_norm_eps, dtype, device)
            self.k_norm = norm_class(d, config.rms_norm_eps, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        t, nq, nkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        if self.q_norm is not None:
            self._norm_heads(qkv, t)
        if native_cpu_elementwise() and native_rope_store.supports(qkv, k_cache):
            # one native call rotates q and k and stores k and v (fp32/bf16 CPU, fp32/bf16 cache)
            q = native_rope_store.rope_store(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping,
                                             nq, nkv, prepared=meta.prepared_calls)
            out = attend(q, k_cache, v_cache, meta, self.scale, window=self.window)
            return self.o_proj(out.reshape(t, nq * d))
        qkv = qkv.view(t, nq + 2 * nkv, d)
        qk = RotaryEmbedding.apply(qkv[:, :nq + nkv], cos, sin)    # q and k rotated in one op
        out = paged_attention(qk[:, :nq], qk[:, nq:], qkv[:, nq + nkv:], k_cache, v_cache,
                              meta, self.scale, window=self.window)
        return self.o_proj(out.reshape(t, nq * d))

    def _norm_heads(self, qkv: torch.Tensor, t: int) -> None:
        """RMSNorm each q and k head in place (before RoPE, so the fused RoPE + store still
        reads them from the projection's buffer)."""
        nq, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q = qkv[:, :nq * d].view(t, nq, d)
        k = qkv[:, nq * d:(nq + nkv) * d].view(t, nkv, d)
        q.copy_(self.q_norm(q))
        k.copy_(self.k_norm(k))

    def load(self, part: str, tensor: torch.Tensor) -> None:
        """One checkpoint tensor under self_attn.: q_proj.weight, o_proj.bias, q_norm.weight..."""
        module, what = part.rsplit(".", 1)
        if module in ("q_proj", "k_proj", "v_proj"):
            self.qkv_proj.load(module[0], tensor, what)
        elif module == "o_proj":
            self.o_proj.load(tensor, what)
        elif module in ("q_norm", "k_norm") and self.q_norm is not None and what == "weight":
            getattr(self, module).load(tensor)
        else:
            raise KeyError(part)

    def expected(self) -> list[str]:
        names = [f"{p}_proj.weight" for p in "qkvo"]
        if self.qkv_proj.bias is not None:
            names += [f"{p}_proj.bias" for p in "qkv"]
        if self.o_proj.bias is not None:
            names.append("o_proj.bias")
        if self.q_norm is not None:
            names += ["q_norm.weight", "k_norm.weight"]
        return names


# A long CPU step's MLP runs over slices of this many rows: its [rows, 2 x intermediate]
# activations are the largest of a step (Qwen2.5-Coder-1.5B: 70 KB a token, so a 512-token prefill
# held ~100 MiB more than the weights and the cache at its peak, a 2,048-token one ~380 MiB).
MLP_ROWS = 256


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); `merged`: the checkpoint stores gate|up as one gate_up_proj."""

    def __init__(self, config: ModelConfig, tp: TPGroup, dtype: torch.dtype,
                 device: torch.device | str, merged: bool = False) -> None:
        super().__init__()
        inter, self.merged = config.intermediate_size, merged
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, inter, 2, tp, dtype,
                                                       device)
        self.down_proj = RowParallelLinear(even_split(inter, tp.size, tp.rank), config.hidden_size,
                                           tp, dtype, device)
        self.act_and_mul = ACT_AND_MUL[config.hidden_act]
        self.intermediate_size = inter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.shape[0] <= MLP_ROWS or x.device.type != "cpu" or self.down_proj.tp.size > 1
                or self.down_proj.lora is not None):  # LoRA rows index the whole step
            return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))
        return torch.cat([self.down_proj(self.act_and_mul(self.gate_up_proj(part)))
                          for part in x.split(MLP_ROWS)])

    def load(self, part: str, tensor: torch.Tensor) -> None:
        if part in ("gate_proj.weight", "up_proj.weight") and not self.merged:
            self.gate_up_proj.load(part == "up_proj.weight", tensor)
        elif part == "gate_up_proj.weight" and self.merged:
            if tensor.shape[0] != 2 * self.intermediate_size:
                raise ValueError(f"expected {2 * self.intermediate_size} rows (gate|up), got "
                                 f"shape {tuple(tensor.shape)}")
            half = self.intermediate_size
            gate, up = (tensor.rows(slice(0, half)), tensor.rows(slice(half, 2 * half))) \
                if isinstance(tensor, QuantizedWeight) else tensor.chunk(2)
            self.gate_up_proj.load(0, gate)
            self.gate_up_proj.load(1, up)
        elif part == "down_proj.weight":
            self.down_proj.load(tensor)
        else:
            raise KeyError(part)

    def expected(self) -> list[str]:
        gate_up = ["gate_up_proj.weight"] if self.merged else ["gate_proj.weight", "up_proj.weight"]
        return gate_up + ["down_proj.weight"]


class DecoderLayer(nn.Module):
    """Norm, attention, add; norm, MLP, add (Llama)."""

    norm_class: type[nn.Module] = RMSNorm
    norm_names: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    merged_gate_up = False       # the checkpoint's MLP has one gate_up_proj

    def __init__(self, config: ModelConfig, layer: int, tp: TPGroup, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config, layer, tp, dtype, device, self.norm_class)
        self.mlp = GatedMLP(config, tp, dtype, device, merged=self.merged_gate_up)
        for name in self.norm_names:
            setattr(self, name, self.norm_class(config.hidden_size, config.rms_norm_eps, dtype,
                                                device))

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(previous sublayer output, residual stream before it; None for the first layer) ->
        (this layer's MLP output, residual stream before it)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, k_cache, v_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def load(self, part: str, tensor: torch.Tensor) -> None:
        """One checkpoint tensor under model.layers.<i>. (KeyError: not one of this layer's)."""
        module, _, rest = part.partition(".")
        if module == "self_attn":
            self.self_attn.load(rest, tensor)
        elif module == "mlp":
            self.mlp.load(rest, tensor)
        elif module in self.norm_names and rest == "weight":
            getattr(self, module).load(tensor)
        else:
            raise KeyError(part)

    def expected(self) -> list[str]:
        return ([f"self_attn.{n}" for n in self.self_attn.expected()]
                + [f"mlp.{n}" for n in self.mlp.expected()]
                + [f"{n}.weight" for n in self.norm_names])


class SandwichDecoderLayer(DecoderLayer):
    """Norm, attention, norm, add; norm, MLP, norm, add (Gemma 3, GLM-4). `norm_names` are the
    checkpoint's names of those four norms in that order."""

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        attn_in, attn_out, mlp_in, mlp_out = (getattr(self, n) for n in self.norm_names)
        if residual is None:
            residual, hidden = hidden, attn_in(hidden)
        else:
            hidden, residual = attn_in(hidden, residual)
        hidden = attn_out(self.self_attn(hidden, cos, sin, k_cache, v_cache, meta))
        hidden, residual = mlp_in(hidden, residual)
        return mlp_out(self.mlp(hidden)), residual
