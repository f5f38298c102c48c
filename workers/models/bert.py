"""BERT (`BertModel`, as in all-MiniLM-L6-v2): an encoder for embeddings.

Word + absolute position + token-type embeddings (type 0: one text per input, as
sentence-transformers encodes it), then post-LayerNorm layers: bidirectional self-attention
with biases, residual, LayerNorm; a GELU MLP, residual, LayerNorm. Attention is over each input
alone and whole (encoder_attention.py): the scheduler computes an encoder input in one step
from position 0 (pipeline/pooling.py), so nothing is read from or written to the paged KV
cache. The linears are PackableLinears (q, k and v fused), prepacked as the decoders' are.
The output is the last layer's hidden states; pooling them is the runner's (workers/pooling.py).
"""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.workers.distributed import TPGroup
from pagedserve.workers.model_config import ModelConfig
from pagedserve.workers.models.attention import AttentionMetadata
from pagedserve.workers.models.encoder_attention import Group, attend, plan_groups
from pagedserve.workers.models.layers import PackableLinear

_LAYER = re.compile(r"encoder\.layer\.(\d+)\.(.+)")
# checkpoint module inside a layer -> (ours, row offset in it as a multiple of hidden_size)
_LAYER_PARTS = {"attention.self.query": ("qkv", 0), "attention.self.key": ("qkv", 1),
                "attention.self.value": ("qkv", 2), "attention.output.dense": ("attn_out", 0),
                "attention.output.LayerNorm": ("attn_norm", 0), "intermediate.dense": ("up", 0),
                "output.dense": ("down", 0), "output.LayerNorm": ("out_norm", 0)}


class BiasedLinear(PackableLinear):
    """x W^T + b, W prepacked for the CPU kernel like the decoders' linears (layers.py)."""

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype,
                                               device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device),
                                 requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x).add_(self.bias)


class BertLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device) -> None:
        super().__init__()
        h, inter, eps = config.hidden_size, config.intermediate_size, config.rms_norm_eps
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.qkv = BiasedLinear(3 * h, h, dtype, device)  # query, key, value rows
        self.attn_out = BiasedLinear(h, h, dtype, device)
        self.attn_norm = nn.LayerNorm(h, eps=eps, dtype=dtype, device=device)
        self.up, self.down = BiasedLinear(inter, h, dtype, device), \
            BiasedLinear(h, inter, dtype, device)
        self.out_norm = nn.LayerNorm(h, eps=eps, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, groups: list[Group]) -> torch.Tensor:
        t, heads, d = x.shape[0], self.num_heads, self.head_dim
        attended = attend(self.qkv(x).view(t, 3, heads, d), groups).reshape(t, heads * d)
        x = self.attn_norm(x + self.attn_out(attended))
        return self.out_norm(x + self.down(F.gelu(self.up(x))))


class BertModel(nn.Module):
    """input_ids, positions [T] of whole inputs -> last hidden states [T, hidden]."""

    def __init__(self, config: ModelConfig, tp: TPGroup = TPGroup(),
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__()
        if tp.size != 1:
            raise ValueError("BERT runs on one rank (tensor parallel size 1)")
        self.config, self.tp, self.dtype = config, tp, dtype
        h, kw = config.hidden_size, {"dtype": dtype, "device": device}
        self.word_embeddings = nn.Embedding(config.vocab_size, h, **kw)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, h, **kw)
        self.token_type_embeddings = nn.Embedding(max(config.type_vocab_size, 1), h, **kw)
        self.embed_norm = nn.LayerNorm(h, eps=config.rms_norm_eps, **kw)
        self.layers = nn.ModuleList(BertLayer(config, dtype, device)
                                    for _ in range(config.num_hidden_layers))
        for p in self.parameters():
            p.requires_grad_(False)

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_key_value_heads

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        groups = plan_groups(_input_spans(meta, input_ids.shape[0]), input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) \
            + self.token_type_embeddings.weight[0]
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x, groups)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise ValueError("an encoder has no language-model head: it serves embeddings only")

    # ------------------------------------------------------------ weights

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy every tensor of a BertModel checkpoint (a `bert.` prefix is dropped; the
        pooler and position_ids are not used); ValueError names a wrong or missing one."""
        params = dict(self.named_parameters())
        expected = {(name, 0) for name in params if ".qkv." not in name}
        expected |= {(name, part) for name in params if ".qkv." in name for part in range(3)}
        h = self.config.hidden_size
        for name, tensor in weights:
            ours = _our_name(name.removeprefix("bert."))
            if ours is None:
                continue
            ours, part = ours
            if ours not in params:
                raise ValueError(f"unexpected weight {name!r} for a BERT model")
            target = params[ours]
            if ".qkv." in ours:
                target = target[part * h:(part + 1) * h]
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name!r}: expected shape {tuple(target.shape)}, got "
                                 f"{tuple(tensor.shape)}")
            with torch.no_grad():
                target.copy_(tensor)
            expected.discard((ours, part))
        if expected:
            raise ValueError(f"checkpoint is missing {len(expected)} tensors, "
                             f"e.g. {sorted(expected)[:4]}")


def _input_spans(meta: AttentionMetadata, total: int) -> list[tuple[int, int]]:
    """Each input's rows: the single-token ones first, then the prefill offsets."""
    d = meta.num_decode_tokens
    spans = [(i, i + 1) for i in range(d)]
    cu = meta.prefill_cu_seqlens_q.tolist()
    spans += [(d + a, d + b) for a, b in zip(cu, cu[1:])]
    if (spans[-1][1] if spans else 0) != total:
        raise ValueError(f"attention metadata covers {spans[-1][1] if spans else 0} of "
                         f"{total} rows")
    return spans


def _our_name(name: str) -> tuple[str, int] | None:
    """(our parameter, which third of a fused q/k/v) of a checkpoint name; None: unused."""
    if name.startswith(("pooler.", "cls.")) or name.endswith("position_ids"):
        return None
    if name.startswith("embeddings."):
        part = name.removeprefix("embeddings.")
        return ("embed_norm." + part.split(".", 1)[1] if part.startswith("LayerNorm.")
                else part), 0
    match = _LAYER.fullmatch(name)
    if match is None:
        return name, 0  # unknown: load_weights names it
    module, _, kind = match[2].rpartition(".")
    if module not in _LAYER_PARTS:
        return name, 0
    ours, part = _LAYER_PARTS[module]
    return f"layers.{match[1]}.{ours}.{kind}", part
