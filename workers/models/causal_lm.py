"""A decoder-only language model over a flattened, unpadded batch, the base of every family.

One `forward` computes any mix of decode tokens and prefill chunks of many sequences: the
projections and MLP run on all T tokens at once, attention reads the paged KV cache (see
attention.py). Weights are loaded by Hugging Face name and cut to this rank's shard. A family
subclasses `DecoderForCausalLM` and names its layer class (decoder.py); embeddings, RoPE tables
per layer, the final norm, the LM head and logit soft-capping are here.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels.quant_formats import QuantizedWeight
from pagedserve.workers.distributed import TPGroup
from pagedserve.workers.model_config import ModelConfig
from pagedserve.workers.models.attention import AttentionMetadata
from pagedserve.workers.models.decoder import DecoderLayer
from pagedserve.workers.models.layers import PackableLinear, finish_loading
from pagedserve.workers.models.quantized import embed_rows
from pagedserve.workers.models.rotary import LayerRopes

_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")


class DecoderForCausalLM(nn.Module):
    layer_class: type[DecoderLayer] = DecoderLayer
    # the embedding table kept in its quantized format (CPU): rows dequantized when looked up
    embed_quantized: QuantizedWeight | None = None

    def __init__(self, config: ModelConfig, tp: TPGroup = TPGroup(),
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.config, self.tp, self.dtype = config, tp, dtype
        h = config.hidden_size
        self.embed_tokens = nn.Parameter(
            torch.empty(config.vocab_size, h, dtype=dtype, device=device), requires_grad=False)
        self.layers = nn.ModuleList(self.layer_class(config, i, tp, dtype, device)
                                    for i in range(config.num_hidden_layers))
        self.norm = self.layer_class.norm_class(h, config.rms_norm_eps, dtype, device)
        self.ropes = LayerRopes(config, dtype, device)
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

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_lookup(input_ids)

    def embed_lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of input_ids, in the model dtype (a fresh tensor)."""
        if self.embed_quantized is not None:
            return embed_rows(self.embed_quantized, input_ids, self.dtype)
        return F.embedding(input_ids, self.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden] (norm applied)."""
        tables = self.ropes.cos_sin(positions)
        hidden, residual = self.embed(input_ids), None
        for i, layer in enumerate(self.layers):
            cos, sin = tables[i]
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache[i, 0], kv_cache[i, 1],
                                     meta)
        return self.norm(hidden, residual)[0]

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """final_logit_softcapping, in place: cap * tanh(logits / cap) (a no-op without one)."""
        cap = self.config.final_logit_softcapping
        return logits.div_(cap).tanh_().mul_(cap) if cap else logits

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
                return self.cap_logits(logits)
            out = self._logits_buffer("fp32", rows * vocab, torch.float32, hidden.device)
            return self.cap_logits(out.view(rows, vocab).copy_(logits))
        raw = self._logits_buffer("raw", rows * vocab, hidden.dtype, hidden.device)
        torch.mm(hidden, self.lm_head.t(), out=raw.view(rows, vocab))
        if raw.dtype == torch.float32:
            return self.cap_logits(raw.view(rows, vocab))
        out = self._logits_buffer("fp32", rows * vocab, torch.float32, hidden.device)
        return self.cap_logits(out.view(rows, vocab).copy_(raw.view(rows, vocab)))

    def _logits_buffer(self, name: str, numel: int, dtype: torch.dtype,
                       device: torch.device) -> torch.Tensor:
        buffers = self.__dict__.setdefault("_logit_buffers", {})
        buffer = buffers.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype \
                or buffer.device != device:
            buffer = buffers[name] = torch.empty(numel, dtype=dtype, device=device)
        return buffer[:numel]

    # ------------------------------------------------------------ weights

    def checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor's name as this model knows it; None: not part of the model."""
        if "rotary_emb" in name:
            return None
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy this rank's shard of every Hugging Face tensor; raises ValueError naming the
        tensor on an unknown name or a wrong shape, and the missing ones after the last."""
        expected = self._expected_names()
        for name, tensor in weights:
            name = self.checkpoint_name(name)
            if name is None:
                continue
            try:
                self._load_one(name, tensor)
            except KeyError:
                raise ValueError(f"unexpected weight {name!r} for a {self.config.architecture} "
                                 f"model") from None
            except ValueError as e:
                raise ValueError(f"weight {name!r}: {e}") from e
            expected.discard(name)
        if expected:
            raise ValueError(f"checkpoint is missing {len(expected)} tensors, "
                             f"e.g. {sorted(expected)[:4]}")
        finish_loading(self)
        if self.embed_quantized is not None and self.config.tie_word_embeddings \
                and self.lm_head_linear.quantized is not None:
            # the LM head may hold the table packed (workers/models/quantized.py): look rows up
            # in that one copy
            (_, head), = self.lm_head_linear.quantized.stored
            self.embed_quantized = head
        if self.embed_quantized is not None:   # its plain table was never filled: meta now
            self.embed_tokens = nn.Parameter(torch.empty(self.embed_tokens.shape,
                                                         dtype=self.dtype, device="meta"),
                                             requires_grad=False)
            if self.config.tie_word_embeddings:
                self.lm_head = self.embed_tokens

    def _expected_names(self) -> set[str]:
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not self.config.tie_word_embeddings:
            names.add("lm_head.weight")
        for i, layer in enumerate(self.layers):
            names.update(f"model.layers.{i}.{part}" for part in layer.expected())
        return names

    @torch.no_grad()
    def _load_one(self, name: str, tensor: torch.Tensor) -> None:
        whole = {"model.embed_tokens.weight": self.embed_tokens, "lm_head.weight": self.lm_head,
                 "model.norm.weight": self.norm.weight}
        if isinstance(tensor, QuantizedWeight) and name in whole:
            self._load_quantized_table(name, tensor)
            return
        if name in whole:
            target = whole[name]
            if target.shape != tensor.shape:
                raise ValueError(f"expected shape {tuple(target.shape)}, got {tuple(tensor.shape)}")
            target.copy_(tensor)
            return
        match = _LAYER_NAME.fullmatch(name)
        if match is None or int(match[1]) >= len(self.layers):
            raise KeyError(name)
        self.layers[int(match[1])].load(match[2], tensor)

    def _load_quantized_table(self, name: str, tensor: QuantizedWeight) -> None:
        """The embedding table or the LM head kept quantized on CPU (dequantized elsewhere)."""
        table = self.embed_tokens if name == "model.embed_tokens.weight" else self.lm_head
        if tensor.shape != tuple(table.shape):
            raise ValueError(f"expected shape {tuple(table.shape)}, got {tensor.shape}")
        if table.device.type != "cpu":
            table.copy_(tensor.dequantize(table.dtype))
        elif name == "lm_head.weight":
            self.lm_head_linear.stage_quantized(0, tensor)
        else:
            self.embed_quantized = tensor
            if self.config.tie_word_embeddings:
                self.lm_head_linear.stage_quantized(0, tensor)
