"""Random paged-cache inputs and an obviously-correct attention for the kernel tests."""
from __future__ import annotations

import math
from dataclasses import dataclass

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


def naive_attention(q, k_cache, v_cache, table, context_len, q_len, scale, window=0):
    """Per-sequence softmax(Q K^T) V in float64: q [q_len, Hq, D] at the last q_len positions.
    window > 0: a query at position p sees keys p - window < j <= p; keys before the first
    query's window are not read at all (their blocks may hold NaN)."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    query_pos = torch.arange(context_len - q_len, context_len)
    first = max(0, context_len - q_len - window + 1) if window > 0 else 0
    positions = torch.arange(first, context_len)
    blocks = table.long()[positions // block_size]
    keys = k_cache[blocks, positions % block_size].double()      # [ctx, Hkv, D]
    values = v_cache[blocks, positions % block_size].double()
    keys = keys.repeat_interleave(group, dim=1)                     # [ctx, Hq, D]
    values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale
    hidden = positions[None, :] > query_pos[:, None]
    if window > 0:
        hidden |= positions[None, :] <= query_pos[:, None] - window
    scores = scores.masked_fill(hidden[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def poison_before_windows(k_cache, v_cache, tables, first_query_pos, window):
    """NaN into every block wholly before the window of each row's first query (at position
    first_query_pos[row]): blocks a windowed model's scheduler may free and hand to others."""
    if window <= 0:
        return
    block_size = k_cache.shape[1]
    for row, pos in enumerate(first_query_pos):
        dead = max(0, pos - window + 1) // block_size
        ids = tables[row, :dead].long()
        k_cache[ids] = float("nan")
        v_cache[ids] = float("nan")


def rel_error(actual, expected):
    assert not torch.isnan(actual).any(), "output has NaN (an element was never written)"
    expected = expected.double()
    return ((actual.double() - expected).abs().max() / expected.abs().max()).item()


# (head_dim, Hq, Hkv): GQA groups 1, 4, 7 and 16 over head sizes 64, 128 and 256
WINDOW_SHAPES = [(64, 4, 4), (128, 16, 4), (256, 14, 2), (64, 16, 1)]


@dataclass
class WindowCase:
    """One attention call over a cache whose blocks before each chunk's first window hold NaN,
    and its expected output (naive_attention per sequence, float64)."""
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    tables: torch.Tensor
    cu_seqlens: torch.Tensor
    context_lens: torch.Tensor
    scale: float
    window: int
    expected: torch.Tensor

    def decode_args(self):
        return self.q, self.k_cache, self.v_cache, self.tables, self.context_lens, self.scale

    def prefill_args(self):
        return (self.q, self.k_cache, self.v_cache, self.tables, self.cu_seqlens,
                self.context_lens, self.scale)


def window_case(gen, context_lens, q_lens, block_size, head_dim, num_q_heads, num_kv_heads,
                window, dtype=torch.float32, device="cpu"):
    """q_lens all 1: a decode batch; else prefill chunks (the last q_lens[s] positions)."""
    num_blocks = sum(math.ceil(n / block_size) for n in context_lens) + 3
    kv_cache = make_kv_cache(gen, 1, num_blocks, block_size, num_kv_heads, head_dim, dtype)
    k_cache, v_cache = kv_cache[0, 0], kv_cache[0, 1]
    tables = shuffled_block_tables(gen, context_lens, block_size, num_blocks)
    poison_before_windows(k_cache, v_cache, tables,
                          [n - q_len for n, q_len in zip(context_lens, q_lens)], window)
    cu = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    q = torch.randn(cu[-1], num_q_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    expected = torch.cat([naive_attention(q[cu[s]:cu[s + 1]], k_cache, v_cache, tables[s], n,
                                          q_lens[s], scale, window)
                          for s, n in enumerate(context_lens)])
    return WindowCase(q.to(device), k_cache.to(device), v_cache.to(device), tables.to(device),
                      torch.tensor(cu, dtype=torch.int32, device=device),
                      torch.tensor(context_lens, dtype=torch.int32, device=device), scale,
                      window, expected)


@dataclass
class ChunkStep:
    """One chunk of a chunked prefill: its queries and the expected output."""
    q: torch.Tensor
    start: int               # the chunk's first position
    context_len: int         # start + its length
    expected: torch.Tensor


def chunked_prefill(gen, prompt_len, chunk, block_size, window, head_dim=64, num_q_heads=4,
                    num_kv_heads=2):
    """(k_cache, v_cache, table [1, W], scale, steps): a prompt prefilled `chunk` tokens at a time
    over a filled cache; each step poisons the blocks its first window leaves behind (NaN, as a
    scheduler frees them) when it is reached, so iterate the steps in order."""
    num_blocks = math.ceil(prompt_len / block_size) + 2
    kv_cache = make_kv_cache(gen, 1, num_blocks, block_size, num_kv_heads, head_dim,
                             torch.float32)
    k_cache, v_cache = kv_cache[0, 0], kv_cache[0, 1]
    table = shuffled_block_tables(gen, [prompt_len], block_size, num_blocks)
    scale = head_dim ** -0.5

    def steps():
        for start in range(0, prompt_len, chunk):
            end = min(start + chunk, prompt_len)
            poison_before_windows(k_cache, v_cache, table, [start], window)
            q = torch.randn(end - start, num_q_heads, head_dim, generator=gen)
            yield ChunkStep(q, start, end, naive_attention(q, k_cache, v_cache, table[0], end,
                                                           end - start, scale, window))
    return k_cache, v_cache, table, scale, steps()
