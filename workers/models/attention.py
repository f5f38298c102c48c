"""Paged attention over a flattened step: decode rows first, then prefill chunks.

The runner orders the step's tokens so that every sequence computing exactly one token comes
first; those rows go through one `paged_decode_attention` call and all remaining rows (prefill
chunks of any length, each attending to its cached prefix) through one `paged_prefill_attention`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step tensors shared by every layer (built once per step by the model runner)."""

    slot_mapping: torch.Tensor          # [T] int64: cache slot of each new token (-1 = skip)
    num_decode_tokens: int              # rows [0, D) are single-token sequences
    decode_block_tables: torch.Tensor   # [D, max_blocks] int32
    decode_context_lens: torch.Tensor   # [D] int32, including the token being computed
    prefill_block_tables: torch.Tensor  # [S, max_blocks] int32
    prefill_cu_seqlens_q: torch.Tensor  # [S+1] int32, offsets into rows [D, T)
    prefill_context_lens: torch.Tensor  # [S] int32, including this chunk

    @property
    def num_prefill_seqs(self) -> int:
        return self.prefill_context_lens.shape[0]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Store this step's k/v [T, Hkv, D] into their slots, then attend; returns [T, Hq, D]."""
    kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return attend(q, k_cache, v_cache, meta, scale)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
           scale: float) -> torch.Tensor:
    """Attention of q [T, Hq, D] over caches that already hold this step's k/v."""
    num_decode = meta.num_decode_tokens
    decode_out = prefill_out = None
    if num_decode:
        decode_out = kernels.paged_decode_attention(
            q[:num_decode], k_cache, v_cache, meta.decode_block_tables,
            meta.decode_context_lens, scale)
    if meta.num_prefill_seqs:
        prefill_out = kernels.paged_prefill_attention(
            q[num_decode:], k_cache, v_cache, meta.prefill_block_tables,
            meta.prefill_cu_seqlens_q, meta.prefill_context_lens, scale)
    if prefill_out is None:
        return decode_out
    if decode_out is None:
        return prefill_out
    return torch.cat((decode_out, prefill_out))
