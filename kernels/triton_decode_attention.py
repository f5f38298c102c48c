"""Decode attention over a paged KV cache: one query token per sequence.

Sequence b's query sits at position p = context_lens[b] - 1 and attends to keys
0 .. context_lens[b] - 1, which are already stored in the blocks block_tables[b, :]; with a sliding
`window` > 0 only to keys p - window < j <= p, and blocks wholly before p - window + 1 are never
read (the scheduler may have freed them: their table entries can name any block). GQA: query
head h reads kv head h // (Hq // Hkv). The cache may be narrower than q (kernels/kv_format.py):
its elements are widened to q's dtype as they are read.
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
    _check_decode, gather_pages, window_start, window_tables, paged_decode_attention_ref)


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr,
    part_out_ptr, part_ml_ptr, scale_log2e,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_table,
    stride_cache_block, stride_cache_offset, stride_cache_head,
    group_size, head_dim, partition_tokens, window,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_FORMAT: tl.constexpr, DTYPE: tl.constexpr,
):
    # One program per (sequence, kv head, partition of the context): the kv head's whole query
    # group shares each K/V tile load; the group is padded to BLOCK_G >= 16 rows so the scores
    # are one tl.dot. A tile is BLOCK_N tokens (several cache blocks: more loads in flight).
    # Without SPLIT there is one partition and the program writes the output; with SPLIT it
    # writes its normalised partial output and (max, sum) for _paged_decode_reduce_kernel.
    # A window > 0 shows keys [first, context_len) only; partitions then count from the tile
    # holding `first` (so every tile sees a key), and the masked loads never touch a block wholly
    # before it.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    num_parts = tl.num_programs(2)
    context_len = tl.load(context_lens_ptr + seq)
    first = tl.where(window > 0, tl.maximum(context_len - window, 0), 0)
    start = first - first % BLOCK_N + part * partition_tokens
    end = tl.minimum(context_len, start + partition_tokens)

    group = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    tile = tl.arange(0, BLOCK_N)
    q_heads = kv_head * group_size + group
    q_mask = (group[:, None] < group_size) & (dims[None, :] < head_dim)
    q = tl.load(q_ptr + seq * stride_qb + q_heads[:, None] * stride_qh + dims[None, :],
                mask=q_mask, other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    head_base = kv_head * stride_cache_head
    for tile_start in range(start, end, BLOCK_N):
        positions = tile_start + tile
        visible = (positions < end) & (positions >= first)
        blocks = tl.load(block_tables_ptr + seq * stride_table + positions // BLOCK_SIZE,
                         mask=visible, other=0).to(tl.int64)
        kv_mask = visible[:, None] & (dims[None, :] < head_dim)
        kv_offsets = (blocks[:, None] * stride_cache_block
                      + (positions % BLOCK_SIZE)[:, None] * stride_cache_offset
                      + head_base + dims[None, :])
        k = load_kv(k_cache_ptr + kv_offsets, kv_mask, KV_FORMAT, DTYPE)
        v = load_kv(v_cache_ptr + kv_offsets, kv_mask, KV_FORMAT, DTYPE)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e
        scores = tl.where(visible[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if SPLIT:
        # An empty partition (past the context) leaves m = -inf, l = 0: weight 0 in the reduce.
        out = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
        rows = ((seq * tl.num_programs(1) + kv_head) * BLOCK_G + group) * num_parts + part
        row_ok = group < group_size
        tl.store(part_out_ptr + rows[:, None] * BLOCK_D + dims[None, :], out,
                 mask=row_ok[:, None])
        tl.store(part_ml_ptr + rows * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + rows * 2 + 1, l_i, mask=row_ok)
    else:
        out = acc / l_i[:, None]
        tl.store(out_ptr + seq * stride_ob + q_heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _paged_decode_reduce_kernel(
    part_out_ptr, part_ml_ptr, out_ptr, stride_ob, stride_oh, num_q_heads, num_kv_heads,
    num_parts, head_dim,
    BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per (sequence, query head): out = sum_p w_p o_p / sum_p w_p with
    # w_p = l_p * 2^(m_p - max m) (flash-decoding's combine step).
    seq = tl.program_id(0)
    head = tl.program_id(1)
    group_size = num_q_heads // num_kv_heads
    kv_head = head // group_size
    row0 = ((seq * num_kv_heads + kv_head) * BLOCK_G + head - kv_head * group_size) * num_parts
    parts = tl.arange(0, BLOCK_P)
    dims = tl.arange(0, BLOCK_D)
    valid = parts < num_parts
    m = tl.load(part_ml_ptr + (row0 + parts) * 2, mask=valid, other=float("-inf"))
    l = tl.load(part_ml_ptr + (row0 + parts) * 2 + 1, mask=valid, other=0.0)
    w = l * tl.exp2(m - tl.max(m, 0))
    w = tl.where(valid, w, 0.0)
    o = tl.load(part_out_ptr + (row0 + parts)[:, None] * BLOCK_D + dims[None, :],
                mask=valid[:, None], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < head_dim)


# Contexts are split into partitions of this many tokens (a multiple of every BLOCK_N) when the
# batch alone would leave the GPU's multiprocessors idle.
PARTITION_TOKENS = 512


def _tile_tokens(block_size: int, block_d: int, element_bytes: int) -> int:
    """Keys per tile: several cache blocks (more loads in flight), fewer for wide fp32 heads."""
    return kv_tile_tokens(max(64, block_size), block_d, element_bytes)


def _num_partitions(num_seqs: int, num_kv_heads: int, max_tokens: int,
                    device: torch.device) -> int:
    """1 (no split) when the batch's (sequence, kv head) programs fill the device twice over;
    else enough partitions of PARTITION_TOKENS for the longest context the tables can hold.

    Decided from shapes alone (no read of context_lens), so it holds inside a CUDA graph."""
    parts = triton.cdiv(max_tokens, PARTITION_TOKENS)
    if parts <= 1 or device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return parts if num_seqs * num_kv_heads < 2 * sms else 1


def paged_decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, context_lens: torch.Tensor,
                                  scale: float, window: int = 0,
                                  num_partitions: int | None = None) -> torch.Tensor:
    """Triton version of paged_decode_attention_ref (same signature and result).

    `num_partitions`: split every context into this many partitions (tests); None decides from
    the shapes (_num_partitions)."""
    num_seqs, num_q_heads, num_kv_heads, head_dim = _check_decode(
        q, k_cache, v_cache, block_tables, context_lens)
    check_triton_cache("paged_decode_attention", k_cache, v_cache)
    require(block_tables.stride(1) == 1,
            f"paged_decode_attention: block_tables rows must be contiguous, got {block_tables.stride()}")
    out = _checks.new_output((num_seqs, num_q_heads, head_dim), q)
    if num_seqs == 0:
        return out
    block_size = k_cache.shape[1]
    block_d = triton.next_power_of_2(head_dim)
    tile = _tile_tokens(block_size, block_d, q.element_size())
    max_tokens = block_tables.shape[1] * block_size
    if window > 0:      # a row's keys lie in the tiles from its window's first on
        max_tokens = min(max_tokens, window + tile - 1)
    parts = num_partitions or _num_partitions(num_seqs, num_kv_heads, max_tokens, q.device)
    partition_tokens = triton.cdiv(triton.cdiv(max_tokens, parts), tile) * tile
    group_size = num_q_heads // num_kv_heads
    block_g = max(16, triton.next_power_of_2(group_size))
    split = parts > 1
    if split:
        rows = num_seqs * num_kv_heads * block_g * parts
        part_out = torch.empty(rows, block_d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(rows, 2, dtype=torch.float32, device=q.device)
    else:
        part_out = part_ml = out                     # unused
    _paged_decode_kernel[(num_seqs, num_kv_heads, parts)](
        q, raw(k_cache), raw(v_cache), block_tables, context_lens, out, part_out, part_ml,
        scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        group_size, head_dim, partition_tokens, max(window, 0),
        BLOCK_SIZE=block_size, BLOCK_N=tile, BLOCK_G=block_g, BLOCK_D=block_d, SPLIT=split,
        DOT_PRECISION=dot_precision(q.dtype),
        KV_FORMAT=triton_format(k_cache.dtype), DTYPE=triton_dtype(q.dtype),
    )
    if split:
        _paged_decode_reduce_kernel[(num_seqs, num_q_heads)](
            part_out, part_ml, out, out.stride(0), out.stride(1), num_q_heads, num_kv_heads,
            parts, head_dim,
            BLOCK_G=block_g, BLOCK_P=triton.next_power_of_2(parts), BLOCK_D=block_d,
        )
    return out
