"""The Llama family (Llama 2/3, Mistral, SmolLM2, TinyLlama) over a flattened, unpadded batch.

One `forward` computes any mix of decode tokens and prefill chunks of many sequences: the
projections and MLP run on all T tokens at once, attention reads the paged KV cache (see
attention.py). Weights are loaded by Hugging Face name and cut to this rank's shard.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels import native_rope_store
from pagedserve.workers.distributed import TPGroup
from pagedserve.workers.loader import ModelConfig
from pagedserve.workers.models.attention import AttentionMetadata, attend, paged_attention
from pagedserve.workers.models.layers import (MergedColumnParallelLinear, PackableLinear, QKVParallelLinear,
                                   RMSNorm, RotaryEmbedding, RowParallelLinear, even_split,
                                   native_cpu_elementwise, partition_heads, silu_and_mul)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        d = config.head_dim
        part = partition_heads(config.num_attention_heads, config.num_key_value_heads,
                               tp.size, tp.rank)
        self.num_heads, self.num_kv_heads, self.head_dim = len(part.q_heads), len(part.kv_heads), d
        self.scale = d ** -0.5
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, config.num_attention_heads,
                                          config.num_key_value_heads, part, dtype, device)
        cols = slice(part.q_heads.start * d, part.q_heads.stop * d)
        self.o_proj = RowParallelLinear(cols, config.hidden_size, tp, dtype, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        t, nq, nkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        if native_cpu_elementwise() and native_rope_store.supports(qkv, k_cache):
            # one native call rotates q and k and stores k and v (fp32/bf16 CPU, fp32/bf16 cache)
            q = native_rope_store.rope_store(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping,
                                             nq, nkv)
            return self.o_proj(attend(q, k_cache, v_cache, meta, self.scale).reshape(t, nq * d))
        qkv = qkv.view(t, nq + 2 * nkv, d)
        qk = RotaryEmbedding.apply(qkv[:, :nq + nkv], cos, sin)    # q and k rotated in one op
        out = paged_attention(qk[:, :nq], qk[:, nq:], qkv[:, nq + nkv:], k_cache, v_cache,
                              meta, self.scale)
        return self.o_proj(out.reshape(t, nq * d))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, inter, 2, tp, dtype, device)
        self.down_proj = RowParallelLinear(even_split(inter, tp.size, tp.rank), config.hidden_size,
                                           tp, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, tp, dtype, device)
        self.mlp = LlamaMLP(config, tp, dtype, device)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(previous sublayer output, residual stream before it; None for the first layer) ->
        (this layer's MLP output, residual stream before it). The residual adds happen inside
        the norms (fused on CPU fp32), so the stream is hidden + residual between layers."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, k_cache, v_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)\.weight")


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup = TPGroup(),
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.config, self.tp = config, tp
        h = config.hidden_size
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, h, dtype=dtype, device=device),
                                         requires_grad=False)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, tp, dtype, device)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps, dtype, device)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                      config.rope_theta, config.rope_scaling, dtype, device)
        self.lm_head = self.embed_tokens if config.tie_word_embeddings else nn.Parameter(
            torch.empty(config.vocab_size, h, dtype=dtype, device=device), requires_grad=False)
        # The same weight as a PackableLinear, so prepack_linears packs the LM head too (fp32,
        # 2 threads, [64 x 576] @ [576 x 49152]: torch.mm 75 ms, packed 29 ms; at 16 rows 28 -> 11).
        self.lm_head_linear = PackableLinear()
        self.lm_head_linear.weight = self.lm_head

    @property
    def num_kv_heads(self) -> int:
        """kv heads held on this rank (what the KV cache is shaped for)."""
        return self.layers[0].self_attn.num_kv_heads

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden] (norm applied)."""
        cos, sin = self.rotary.cos_sin(positions)
        hidden, residual = F.embedding(input_ids, self.embed_tokens), None
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache[i, 0], kv_cache[i, 1],
                                     meta)
        return self.norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] of the rows that sample -> fp32 logits [N, vocab], valid until the
        next call (the caller samples from them within its step).

        The logits live in buffers this model reuses: at batch 256 they are 50 MB, and a fresh
        allocation that size is mmapped and page-faulted on every step (measured on the 2-core
        box: 47 ms for the fp32 conversion alone, 2.7 ms into a reused buffer).
        """
        rows, vocab = hidden.shape[0], self.lm_head.shape[0]
        if self.lm_head_linear.prepacked:  # fresh output: still faster than the mm below
            logits = self.lm_head_linear.matmul(hidden)
            if logits.dtype == torch.float32:
                return logits
            out = self._logits_buffer("fp32", rows * vocab, torch.float32, hidden.device)
            return out.view(rows, vocab).copy_(logits)
        raw = self._logits_buffer("raw", rows * vocab, hidden.dtype, hidden.device)
        torch.mm(hidden, self.lm_head.t(), out=raw.view(rows, vocab))
        if raw.dtype == torch.float32:
            return raw.view(rows, vocab)
        out = self._logits_buffer("fp32", rows * vocab, torch.float32, hidden.device)
        return out.view(rows, vocab).copy_(raw.view(rows, vocab))

    def _logits_buffer(self, name: str, numel: int, dtype: torch.dtype,
                       device: torch.device) -> torch.Tensor:
        buffers = self.__dict__.setdefault("_logit_buffers", {})
        buffer = buffers.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype \
                or buffer.device != device:
            buffer = buffers[name] = torch.empty(numel, dtype=dtype, device=device)
        return buffer[:numel]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy this rank's shard of every Hugging Face tensor; raises on unknown or missing names."""
        expected = self._expected_names()
        for name, tensor in weights:
            if "rotary_emb" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            self._load_one(name, tensor)
            expected.discard(name)
        if expected:
            raise ValueError(f"checkpoint is missing {len(expected)} tensors, e.g. {sorted(expected)[:4]}")

    def _expected_names(self) -> set[str]:
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not self.config.tie_word_embeddings:
            names.add("lm_head.weight")
        per_layer = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
                     "post_attention_layernorm")
        for i in range(self.config.num_hidden_layers):
            names.update(f"model.layers.{i}.{p}.weight" for p in per_layer)
        return names

    @torch.no_grad()
    def _load_one(self, name: str, tensor: torch.Tensor) -> None:
        if name == "model.embed_tokens.weight":
            self.embed_tokens.copy_(tensor)
            return
        if name == "lm_head.weight":
            self.lm_head.copy_(tensor)
            return
        if name == "model.norm.weight":
            self.norm.weight.copy_(tensor)
            return
        match = _LAYER_NAME.fullmatch(name)
        if match is None or int(match[1]) >= len(self.layers):
            raise ValueError(f"unexpected weight {name!r} for a Llama model")
        layer, part = self.layers[int(match[1])], match[2]
        if part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            layer.self_attn.qkv_proj.load(part[-6], tensor)
        elif part == "self_attn.o_proj":
            layer.self_attn.o_proj.load(tensor)
        elif part in ("mlp.gate_proj", "mlp.up_proj"):
            layer.mlp.gate_up_proj.load(part == "mlp.up_proj", tensor)
        elif part == "mlp.down_proj":
            layer.mlp.down_proj.load(tensor)
        elif part in ("input_layernorm", "post_attention_layernorm"):
            getattr(layer, part).weight.copy_(tensor)
        else:
            raise ValueError(f"unexpected weight {name!r} for a Llama model")
