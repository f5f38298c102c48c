"""Prefill / chunked-prefill attention over a paged KV cache.

Sequence s owns query rows cu_seqlens_q[s]:cu_seqlens_q[s+1]. context_lens[s] counts all its
tokens including this chunk, whose K/V are already stored; query i sits at position
context_lens[s] - q_len + i and attends causally to keys 0 .. that position; with a sliding
`window` > 0 only to keys position - window < j <= position (each row has its own window
start). Blocks wholly before the chunk's first window start are never read (the scheduler may have
freed them). This one kernel serves first prefills, later chunks of a chunked prefill and
prefix-cache hits alike.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _checks
from ._checks import (LOG2E, check_triton_cache,
                      dot_precision, kv_tile_tokens, require, triton_dtype)
from .kv_format import raw, triton_format
from .kv_format_triton import load_kv
from .attention_ref import (  # noqa: F401 (re-exported: the reference beside its kernel)
    _check_prefill, widen, _attend_sequence, paged_prefill_attention_ref)


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_ptr, context_lens_ptr, out_ptr,
    scale_log2e,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
    stride_cache_block, stride_cache_offset, stride_cache_head,
    group_size, head_dim, window,
    BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_FORMAT: tl.constexpr, DTYPE: tl.constexpr,
):
    # One program per (tile of BLOCK_M query rows, sequence, query head); it walks the
    # sequence's pages up to the tile's last query position with an online softmax, from the
    # page of the tile's first row's window start when window > 0. It reads BLOCK_N keys at a
    # time (a page, or a part of one where a whole page's K/V would not fit in shared memory).
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    q_head = tl.program_id(2)
    kv_head = q_head // group_size
    q_start = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    context_len = tl.load(context_lens_ptr + seq)
    prefix_len = context_len - q_len

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    offsets = tl.arange(0, BLOCK_N)
    row_valid = rows < q_len
    query_pos = prefix_len + rows
    q_mask = row_valid[:, None] & (dims[None, :] < head_dim)
    q = tl.load(q_ptr + (q_start + rows[:, None]) * stride_qt + q_head * stride_qh + dims[None, :],
                mask=q_mask, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Keys past the tile's last row are never visible; an empty tile (rows >= q_len) walks none.
    tile_end = tl.minimum(prefix_len + (tile + 1) * BLOCK_M, context_len)
    num_pages = tl.where(tile * BLOCK_M < q_len, tl.cdiv(tile_end, BLOCK_SIZE), 0)
    first_page = tl.where(window > 0,
                          tl.maximum(prefix_len + tile * BLOCK_M - window + 1, 0) // BLOCK_SIZE,
                          0)
    head_base = kv_head * stride_cache_head
    for key_start in range(first_page * BLOCK_SIZE, num_pages * BLOCK_SIZE, BLOCK_N):
        block = tl.load(block_tables_ptr + seq * stride_table + key_start // BLOCK_SIZE)
        block = block.to(tl.int64)
        key_pos = key_start + offsets
        kv_mask = (key_pos[:, None] < context_len) & (dims[None, :] < head_dim)
        kv_offsets = (block * stride_cache_block
                      + (key_start % BLOCK_SIZE + offsets)[:, None] * stride_cache_offset
                      + head_base + dims[None, :])
        k = load_kv(k_cache_ptr + kv_offsets, kv_mask, KV_FORMAT, DTYPE)
        v = load_kv(v_cache_ptr + kv_offsets, kv_mask, KV_FORMAT, DTYPE)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e
        visible = (key_pos[None, :] <= query_pos[:, None]) & (key_pos[None, :] < context_len)
        if window > 0:
            visible = visible & (key_pos[None, :] > query_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        # A row whose window starts in a later page sees no key here: m_new stays -inf, so
        # subtract 0 instead (alpha, p = 0) rather than -inf - -inf = NaN.
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # Rows of an empty tile saw no key (l_i == 0); they are masked out of the store.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + rows[:, None]) * stride_ot + q_head * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_prefill_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                   block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                   context_lens: torch.Tensor, scale: float,
                                   window: int = 0) -> torch.Tensor:
    """Triton version of paged_prefill_attention_ref (same signature and result).

    The grid is sized by the total token count rather than the longest chunk so that launching
    never reads cu_seqlens_q back to the host; tiles past a sequence's chunk exit at once.
    """
    num_tokens, num_q_heads, num_kv_heads, head_dim = _check_prefill(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens)
    check_triton_cache("paged_prefill_attention", k_cache, v_cache)
    require(block_tables.stride(1) == 1,
            f"paged_prefill_attention: block_tables rows must be contiguous, got {block_tables.stride()}")
    out = _checks.new_output((num_tokens, num_q_heads, head_dim), q)
    num_seqs = context_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_m = 32
    block_size, block_d = k_cache.shape[1], triton.next_power_of_2(head_dim)
    tile = kv_tile_tokens(block_size, block_d, q.element_size())
    grid = (triton.cdiv(num_tokens, block_m), num_seqs, num_q_heads)
    _paged_prefill_kernel[grid](
        q, raw(k_cache), raw(v_cache), block_tables, cu_seqlens_q, context_lens, out,
        scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_q_heads // num_kv_heads, head_dim, max(window, 0),
        BLOCK_M=block_m, BLOCK_SIZE=block_size, BLOCK_N=tile, BLOCK_D=block_d,
        DOT_PRECISION=dot_precision(q.dtype), KV_FORMAT=triton_format(k_cache.dtype),
        DTYPE=triton_dtype(q.dtype),
    )
    return out
