"""Random paged-cache inputs and an obviously-correct attention for the kernel tests."""
from __future__ import annotations

import math

import torch


def make_kv_cache(gen, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype):
    """A random kv_cache[num_layers, 2, num_blocks, block_size, Hkv, D] (every block filled, so a
    kernel reading the wrong block gets wrong numbers, not zeros)."""
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    return torch.randn(shape, generator=gen).to(dtype)


def shuffled_block_tables(gen, context_lens, block_size, num_blocks, pad_to=None):
    """int32 [S, max_blocks] tables of distinct, shuffled (non-contiguous) blocks, padded with -1."""
    needed = [math.ceil(n / block_size) for n in context_lens]
    width = pad_to or max(needed) + 1
    assert sum(needed) <= num_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(context_lens), width), -1, dtype=torch.int32)
    used = 0
    for row, count in enumerate(needed):
        tables[row, :count] = torch.tensor(order[used:used + count], dtype=torch.int32)
        used += count
    return tables


def naive_attention(q, k_cache, v_cache, table, context_len, q_len, scale):
    """Per-sequence softmax(Q K^T) V in float64: q [q_len, Hq, D] at the last q_len positions."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    positions = torch.arange(context_len)
    blocks = table.long()[positions // block_size]
    keys = k_cache[blocks, positions % block_size].double()      # [ctx, Hkv, D]
    values = v_cache[blocks, positions % block_size].double()
    keys = keys.repeat_interleave(group, dim=1)                     # [ctx, Hq, D]
    values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale
    query_pos = torch.arange(context_len - q_len, context_len)
    scores = scores.masked_fill(positions[None, None, :] > query_pos[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def rel_error(actual, expected):
    assert not torch.isnan(actual).any(), "output has NaN (an element was never written)"
    expected = expected.double()
    return ((actual.double() - expected).abs().max() / expected.abs().max()).item()
