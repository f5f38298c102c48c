"""Moving a sequence's blocks between the device pool and the host swap pool.

Only ids and refcounts move here; the workers copy the bytes along the returned (src, dst)
mapping. A full block keeps a link (``Block.swap_copy``) to its copy in the other pool while
neither side has been handed out anew, so sequences sharing a block (forks, prefix hits) share
one copy, and swapping a block back whose old copy is intact costs no copy at all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.kvmanager.block_pool import BlockPool, NoFreeBlocksError

if TYPE_CHECKING:
    from pagedserve.kvmanager.seq_blocks import SeqBlocks


def link_pools(gpu_pool: BlockPool, cpu_pool: BlockPool) -> None:
    """Break the partner's link whenever a linked block is handed out for new contents."""

    def clear_cpu(cpu_block_id: int) -> None:
        cpu_pool.blocks[cpu_block_id].swap_copy = None

    def clear_gpu(gpu_block_id: int) -> None:
        gpu_pool.blocks[gpu_block_id].swap_copy = None

    gpu_pool.on_swap_link_broken = clear_cpu
    cpu_pool.on_swap_link_broken = clear_gpu


def _live_copy(src_pool: BlockPool, block_id: int, full: bool) -> int | None:
    if not full:
        return None  # a partial block may still be written; its copy would go stale
    return src_pool.blocks[block_id].swap_copy


def num_blocks_to_swap(src_pool: BlockPool, dst_pool: BlockPool, block_ids: list[int],
                       num_full_blocks: int) -> int:
    """Free destination blocks a swap of ``block_ids`` would take (linked copies in use: 0)."""
    needed = 0
    for i, block_id in enumerate(block_ids):
        copy = _live_copy(src_pool, block_id, i < num_full_blocks)
        if copy is None or dst_pool.blocks[copy].ref_cnt == 0:
            needed += 1
    return needed


def swap_blocks(src_pool: BlockPool, dst_pool: BlockPool, block_ids: list[int],
                num_full_blocks: int, what: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Move one reference per block from ``src_pool`` to ``dst_pool``.

    Returns the new block ids and the (src, dst) pairs whose bytes must be copied. Raises
    NoFreeBlocksError, changing nothing, when the destination pool is short.
    """
    needed = num_blocks_to_swap(src_pool, dst_pool, block_ids, num_full_blocks)
    if needed > dst_pool.num_free_blocks:
        raise NoFreeBlocksError(
            f"{what} needs {needed} free blocks but only {dst_pool.num_free_blocks} of "
            f"{dst_pool.num_blocks} are free")
    new_ids: list[int] = [-1] * len(block_ids)
    to_copy: list[int] = []
    # Revive linked copies before allocating, so the allocation cannot hand them out.
    for i, block_id in enumerate(block_ids):
        copy = _live_copy(src_pool, block_id, i < num_full_blocks)
        if copy is None:
            to_copy.append(i)
        else:
            dst_pool.touch((dst_pool.blocks[copy],))
            new_ids[i] = copy
    mapping = []
    for i, dst in zip(to_copy, dst_pool.allocate(len(to_copy))):
        src_id = block_ids[i]
        new_ids[i] = dst.block_id
        mapping.append((src_id, dst.block_id))
        if i < num_full_blocks:
            src_pool.blocks[src_id].swap_copy = dst.block_id
            dst.swap_copy = src_id
    src_pool.free(src_pool.blocks[b] for b in reversed(block_ids))
    return new_ids, mapping


def live_part(seq: SeqBlocks, block_size: int,
              num_computed: int | None = None) -> tuple[list[int], int]:
    """The blocks a swap of `seq` moves (those it holds, not the placeholders of blocks
    released out of a sliding window before them) and how many of those are full: every slot
    computed, never written again. `num_computed`: the sequence's computed tokens, when its
    reserved slots run past them (a sampled token not computed yet, drafts' slots); a block
    holding a slot past them is partial, or its linked copy would go stale once it is written."""
    r = seq.num_released
    full = seq.num_tokens if num_computed is None else min(seq.num_tokens, num_computed)
    return seq.block_ids[r:], max(0, full // block_size - r)


def swap_seq(seq: SeqBlocks, src_pool: BlockPool, dst_pool: BlockPool, block_size: int,
             what: str, num_computed: int | None = None) -> list[tuple[int, int]]:
    """Move `seq`'s live blocks to the other pool (swap_blocks); placeholders stay as they are
    (device ids). Returns the (src, dst) pairs to copy."""
    new_ids, mapping = swap_blocks(src_pool, dst_pool,
                                   *live_part(seq, block_size, num_computed), what)
    seq.block_ids[seq.num_released:] = new_ids
    seq.swapped = not seq.swapped
    return mapping
