"""Decode attention over a paged KV cache: one query token per sequence.

Sequence b's query sits at position context_lens[b] - 1 and attends to keys
0 .. context_lens[b] - 1, which are already stored in the blocks block_tables[b, :]. GQA: query
head h reads kv head h // (Hq // Hkv). The cache may be narrower than q (kernels/kv_format.py):
its elements are widened to q's dtype as they are read.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import _checks
from ._checks import (LOG2E, check_cache_pair, check_int_tensor, check_query, check_triton_cache,
                      dot_precision, require, triton_dtype)
from ._workspace import scratch
from .kv_format import load_kv, raw, triton_format


def _check_decode(q, k_cache, v_cache, block_tables, context_lens) -> tuple[int, int, int, int]:
    check_cache_pair("paged_decode_attention", k_cache, v_cache)
    dims = check_query("paged_decode_attention", q, k_cache)
    check_int_tensor("paged_decode_attention", "block_tables", block_tables, 2, torch.int32,
                     k_cache.device)
    check_int_tensor("paged_decode_attention", "context_lens", context_lens, 1, torch.int32,
                     k_cache.device)
    require(block_tables.shape[0] == q.shape[0] and context_lens.shape[0] == q.shape[0],
            f"paged_decode_attention: q has {q.shape[0]} sequences but block_tables has "
            f"{block_tables.shape[0]} rows and context_lens {context_lens.shape[0]}")
    return dims


def gather_pages(cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int,
                 purpose: str) -> torch.Tensor:
    """cache[block_tables[:, :num_blocks]] as [rows, num_blocks * block_size, Hkv, D] in scratch.

    Unused table entries may hold padding such as -1: they are clamped to block 0 and the caller
    masks the positions they produce.
    """
    rows = block_tables.shape[0]
    _, block_size, num_kv_heads, head_dim = cache.shape
    ids = block_tables[:, :num_blocks].clamp(min=0).reshape(-1)
    out = scratch(purpose, (rows * num_blocks, block_size, num_kv_heads, head_dim),
                  cache.dtype, cache.device)
    torch.index_select(raw(cache), 0, ids, out=raw(out))
    return out.view(rows, num_blocks * block_size, num_kv_heads, head_dim)


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """Torch reference and CPU serving path: gather, mask, batched SDPA (fp32 softmax inside).

    Pages are gathered only up to the longest context in the batch. GQA is handled by SDPA's
    enable_gqa (no repeat_interleave of K/V).
    """
    num_seqs, num_q_heads, _, head_dim = _check_decode(q, k_cache, v_cache, block_tables,
                                                       context_lens)
    if num_seqs == 0:
        return q.new_empty(q.shape)
    block_size = k_cache.shape[1]
    max_context = int(context_lens.max())
    num_blocks = triton.cdiv(max_context, block_size)
    keys = gather_pages(k_cache, block_tables, num_blocks, "decode_k").to(q.dtype).transpose(1, 2)
    values = gather_pages(v_cache, block_tables, num_blocks, "decode_v").to(q.dtype).transpose(1, 2)
    positions = torch.arange(num_blocks * block_size, device=q.device)
    visible = (positions[None, :] < context_lens[:, None]).view(num_seqs, 1, 1, -1)
    out = F.scaled_dot_product_attention(q.view(num_seqs, num_q_heads, 1, head_dim), keys, values,
                                         attn_mask=visible, scale=scale, enable_gqa=True)
    return out.view(num_seqs, num_q_heads, head_dim)


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr,
    scale_log2e,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_table,
    stride_cache_block, stride_cache_offset, stride_cache_head,
    group_size, head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_FORMAT: tl.constexpr, DTYPE: tl.constexpr,
):
    # One program per (sequence, kv head): the kv head's whole query group shares each K/V page
    # load; the group is padded to BLOCK_G >= 16 rows so the scores are one tl.dot.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)

    group = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    offsets = tl.arange(0, BLOCK_SIZE)
    q_heads = kv_head * group_size + group
    q_mask = (group[:, None] < group_size) & (dims[None, :] < head_dim)
    q = tl.load(q_ptr + seq * stride_qb + q_heads[:, None] * stride_qh + dims[None, :],
                mask=q_mask, other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    head_base = kv_head * stride_cache_head
    for logical_block in range(0, tl.cdiv(context_len, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + seq * stride_table + logical_block).to(tl.int64)
        positions = logical_block * BLOCK_SIZE + offsets
        kv_mask = (positions[:, None] < context_len) & (dims[None, :] < head_dim)
        kv_offsets = (block * stride_cache_block + offsets[:, None] * stride_cache_offset
                      + head_base + dims[None, :])
        k = load_kv(k_cache_ptr + kv_offsets, kv_mask, KV_FORMAT, DTYPE)
        v = load_kv(v_cache_ptr + kv_offsets, kv_mask, KV_FORMAT, DTYPE)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e
        scores = tl.where(positions[None, :] < context_len, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(out_ptr + seq * stride_ob + q_heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, context_lens: torch.Tensor,
                                  scale: float) -> torch.Tensor:
    """Triton version of paged_decode_attention_ref (same signature and result)."""
    num_seqs, num_q_heads, num_kv_heads, head_dim = _check_decode(
        q, k_cache, v_cache, block_tables, context_lens)
    check_triton_cache("paged_decode_attention", k_cache, v_cache)
    require(block_tables.stride(1) == 1,
            f"paged_decode_attention: block_tables rows must be contiguous, got {block_tables.stride()}")
    out = _checks.new_output((num_seqs, num_q_heads, head_dim), q)
    if num_seqs == 0:
        return out
    group_size = num_q_heads // num_kv_heads
    _paged_decode_kernel[(num_seqs, num_kv_heads)](
        q, raw(k_cache), raw(v_cache), block_tables, context_lens, out,
        scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        group_size, head_dim,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_G=max(16, triton.next_power_of_2(group_size)),
        BLOCK_D=triton.next_power_of_2(head_dim), DOT_PRECISION=dot_precision(q.dtype),
        KV_FORMAT=triton_format(k_cache.dtype), DTYPE=triton_dtype(q.dtype),
    )
    return out
