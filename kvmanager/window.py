"""Sliding-window attention over the paged cache: which blocks a windowed sequence still needs.

For a model whose every layer attends only the last W positions (a query at position p reads
keys p-W < j <= p), a step that computes tokens from position c on reads keys from c-W+1 on.
A block whose last slot lies before that is never read again, so the KV manager gives it back
to the pool while the sequence runs (`KVCacheManager.slide_window`).

A released block's entry in the sequence's table keeps its old id, as a placeholder: positions
still index the table directly, the workers' copies of the table (plan diffs, shared rows) need
no update, and every entry stays a valid device block id. The attention kernels skip the blocks
before each query's window and never read a placeholder; nothing is ever written there (a step
writes only the slots of the positions it computes).

Models with some global layers (Gemma 3's mix) are not windowed here: window 0, every block kept.
"""
from __future__ import annotations

NO_RELEASE = 1 << 62  # release_at() of a model without a window: never


def num_out_of_window(num_computed_tokens: int, window: int, block_size: int) -> int:
    """Leading blocks that a step computing from position `num_computed_tokens` never reads."""
    if window <= 0:
        return 0
    return max(0, (num_computed_tokens - window + 1) // block_size)


def release_at(num_released: int, window: int, block_size: int) -> int:
    """The smallest num_computed_tokens at which block `num_released` slides out of the window."""
    if window <= 0:
        return NO_RELEASE
    return (num_released + 1) * block_size + window - 1


def max_blocks_per_step(num_tokens: int, max_chunk: int, window: int, block_size: int) -> int:
    """The most device blocks one sequence of `num_tokens` tokens holds while a step computes up
    to `max_chunk` of them: all of them without a window, else the W-1 keys before the chunk
    plus the chunk (one more block when they straddle block boundaries)."""
    full = -(-num_tokens // block_size)
    if window <= 0:
        return full
    span = min(num_tokens, window - 1 + max_chunk)
    return min(full, -(-span // block_size) + 1)
