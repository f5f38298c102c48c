"""The torch references of the paged attention kernels, and the checks and helpers the CPU
paths share: decode (one query token per sequence) and prefill / chunked prefill. The Triton
kernels (triton_decode_attention.py, triton_prefill_attention.py, whose docstrings give the
semantics) are held to these; a CPU worker runs these or the native kernels and never imports
Triton."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _checks
from ._checks import check_cache_pair, check_int_tensor, check_query, require
from ._workspace import scratch
from .kv_format import raw


def _check_decode(q, k_cache, v_cache, block_tables, context_lens) -> tuple[int, int, int, int]:
    check_cache_pair("paged_decode_attention", k_cache, v_cache)
    dims = check_query("paged_decode_attention", q, k_cache)
    check_int_tensor("paged_decode_attention", "block_tables", block_tables, 2, torch.int32,
                     k_cache.device)
    check_int_tensor("paged_decode_attention", "context_lens", context_lens, 1, torch.int32,
                     k_cache.device)
    if block_tables.shape[0] != q.shape[0] or context_lens.shape[0] != q.shape[0]:
        raise ValueError(f"paged_decode_attention: q has {q.shape[0]} sequences but block_tables "
                         f"has {block_tables.shape[0]} rows and context_lens "
                         f"{context_lens.shape[0]}")
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


def window_start(context_lens: torch.Tensor, window: int) -> torch.Tensor:
    """Each row's first visible key: max(0, context_len - window); 0 everywhere without one."""
    if window <= 0:
        return torch.zeros_like(context_lens)
    return (context_lens - window).clamp(min=0)


def window_tables(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                  window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows' tables from the block holding each row's first visible key on, and each row's
    (first visible key, context length) counted from that block's first position.

    Entries shifted in past a row's table repeat its last entry; they lie past its context."""
    first_key = window_start(context_lens, window)
    first_block = first_key // block_size
    width = block_tables.shape[1]
    columns = torch.arange(width, device=block_tables.device)
    index = (first_block[:, None] + columns[None, :]).clamp(max=width - 1)
    offset = first_block * block_size
    return block_tables.gather(1, index), first_key - offset, context_lens - offset


def decode_inputs(q, k_cache, v_cache, block_tables, context_lens, window: int):
    """The decode paths' inputs checked (_check_decode) and seen through the window: (num_seqs,
    num_q_heads, head_dim, block_size, block tables, each row's first visible key or None,
    context lens), the tables and lens window_tables' with a window > 0; None for no sequence."""
    num_seqs, num_q_heads, _, head_dim = _check_decode(q, k_cache, v_cache, block_tables,
                                                       context_lens)
    if num_seqs == 0:
        return None
    block_size, first = k_cache.shape[1], None
    if window > 0:
        block_tables, first, context_lens = window_tables(block_tables, context_lens,
                                                          block_size, window)
    return num_seqs, num_q_heads, head_dim, block_size, block_tables, first, context_lens


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float, window: int = 0) -> torch.Tensor:
    """Torch reference and CPU serving path: gather, mask, batched SDPA (fp32 softmax inside).

    Pages are gathered only up to the longest context in the batch (with a window: from each
    row's first visible block, up to the longest such span). GQA is handled by SDPA's enable_gqa
    (no repeat_interleave of K/V).
    """
    inputs = decode_inputs(q, k_cache, v_cache, block_tables, context_lens, window)
    if inputs is None:
        return q.new_empty(q.shape)
    num_seqs, num_q_heads, head_dim, block_size, block_tables, first, context_lens = inputs
    max_context = int(context_lens.max())
    num_blocks = -(-max_context // block_size)
    keys = gather_pages(k_cache, block_tables, num_blocks, "decode_k").to(q.dtype)
    values = gather_pages(v_cache, block_tables, num_blocks, "decode_v").to(q.dtype)
    positions = torch.arange(num_blocks * block_size, device=q.device)
    visible = positions[None, :] < context_lens[:, None]
    if first is not None:
        # padding and keys before the window may hold anything (even NaN): zero, not just mask
        visible &= positions[None, :] >= first[:, None]
        keys = keys.masked_fill(~visible[:, :, None, None], 0)
        values = values.masked_fill(~visible[:, :, None, None], 0)
    out = F.scaled_dot_product_attention(
        q.view(num_seqs, num_q_heads, 1, head_dim), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=visible.view(num_seqs, 1, 1, -1), scale=scale, enable_gqa=True)
    return out.view(num_seqs, num_q_heads, head_dim)


def _check_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens):
    check_cache_pair("paged_prefill_attention", k_cache, v_cache)
    dims = check_query("paged_prefill_attention", q, k_cache)
    for arg, t, ndim in (("block_tables", block_tables, 2), ("cu_seqlens_q", cu_seqlens_q, 1),
                         ("context_lens", context_lens, 1)):
        check_int_tensor("paged_prefill_attention", arg, t, ndim, torch.int32, k_cache.device)
    num_seqs = context_lens.shape[0]
    require(block_tables.shape[0] == num_seqs and cu_seqlens_q.shape[0] == num_seqs + 1,
            f"paged_prefill_attention: {num_seqs} context_lens need {num_seqs} block_tables rows "
            f"and {num_seqs + 1} cu_seqlens_q entries, got {block_tables.shape[0]} and "
            f"{cu_seqlens_q.shape[0]}")
    return dims


def widen(cache: torch.Tensor, ids: torch.Tensor, context_len: int,
          dtype: torch.dtype) -> torch.Tensor:
    """The first context_len tokens of pages `ids`, as [context_len, Hkv, D] in `dtype`."""
    pages = raw(cache).index_select(0, ids).view(cache.dtype)
    return pages.flatten(0, 1)[:context_len].to(dtype)


def _attend_sequence(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first_key: int,
                     context_len: int, window: int, scale: float) -> torch.Tensor:
    """SDPA of one sequence's chunk q [q_len, Hq, D] (its last q_len positions) over its keys
    first_key .. context_len - 1 ([n, Hkv, D]); returns [q_len, Hq, D]."""
    q_len = q.shape[0]
    if q_len == context_len and window <= 0:
        mask, causal = None, True
    else:
        # bottom-right aligned causal mask (SDPA's is_causal is top-left), and the window
        query_pos = torch.arange(context_len - q_len, context_len, device=q.device)
        key_pos = torch.arange(first_key, context_len, device=q.device)
        mask, causal = key_pos[None, :] <= query_pos[:, None], False
        if window > 0:
            mask &= key_pos[None, :] > query_pos[:, None] - window
    attended = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)
    return attended[0].transpose(0, 1)


def paged_prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                context_lens: torch.Tensor, scale: float,
                                window: int = 0) -> torch.Tensor:
    """Torch reference and CPU serving path.

    Loops over the (few) sequences of a step; within one it gathers the pages up to its context
    (with a window: from the block of its first row's window start) and runs one SDPA over all
    its query rows and heads (fp32 softmax inside, GQA via enable_gqa).
    """
    _, num_q_heads, _, head_dim = _check_prefill(q, k_cache, v_cache, block_tables,
                                                 cu_seqlens_q, context_lens)
    out = _checks.new_output(tuple(q.shape), q)
    block_size = k_cache.shape[1]
    starts = cu_seqlens_q.tolist()
    for seq, context_len in enumerate(context_lens.tolist()):
        q_start, q_end = starts[seq], starts[seq + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        require(q_len <= context_len,
                f"paged_prefill_attention: sequence {seq} has {q_len} query tokens but a "
                f"context of only {context_len}")
        first_block = 0
        if window > 0:
            first_block = max(0, context_len - q_len - window + 1) // block_size
        ids = block_tables[seq, first_block:-(-context_len // block_size)].long()
        first_key = first_block * block_size
        keys = widen(k_cache, ids, context_len - first_key, q.dtype)
        values = widen(v_cache, ids, context_len - first_key, q.dtype)
        out[q_start:q_end] = _attend_sequence(q[q_start:q_end], keys, values, first_key,
                                              context_len, window, scale)
    return out
