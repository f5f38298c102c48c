"""A pool of KV-cache blocks: refcounts, the free queue and the prefix-cache map."""

from __future__ import annotations

from typing import Iterable

from pagedserve.kvmanager.free_queue import FreeBlockQueue
from pagedserve.kvmanager.hashing import BlockHash


class NoFreeBlocksError(Exception):
    """Raised when a pool has fewer free blocks than an operation needs (nothing was changed)."""


class Block:
    """One block of ``block_size`` token slots.

    ``block_hash`` is set only while the block is full and registered in the prefix cache; it
    survives a free so the block stays findable until the free queue hands it out again.
    ``swap_copy`` is the id of a block in the other pool (device <-> host) holding the same
    bytes; the link is broken as soon as either block is handed out for new contents.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "swap_copy", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.swap_copy: int | None = None
        self.prev_free = None
        self.next_free = None

    @property
    def is_free(self) -> bool:
        return self.prev_free is not None

    def __repr__(self) -> str:
        cached = " cached" if self.block_hash is not None else ""
        return f"Block({self.block_id}, ref={self.ref_cnt}{cached})"


class BlockPool:
    """``num_blocks`` blocks; a block is in the free queue exactly when its refcount is 0.

    Freed blocks that carry a hash go to the tail of the free queue (LRU eviction); freed blocks
    without one go to the head, so they are reused before any cached block is evicted.
    """

    def __init__(self, num_blocks: int, *, enable_caching: bool = True) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[BlockHash, Block] = {}
        # Called with the other pool's block id when a linked block is handed out anew.
        self.on_swap_link_broken = None
        # Called with (block, hash) when a block becomes findable (kvmanager/tiers.py).
        self.on_cached = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.free_block_queue.num_free_blocks

    def allocate(self, num_blocks: int) -> list[Block]:
        """Hand out ``num_blocks`` blocks with refcount 1, evicting their cached hashes."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise NoFreeBlocksError(
                f"need {num_blocks} blocks but only {self.num_free_blocks} of "
                f"{self.num_blocks} are free")
        out = self.free_block_queue.popleft_n(num_blocks)
        for block in out:
            if block.block_hash is not None:
                del self.cached_blocks[block.block_hash]
                block.block_hash = None
            if block.swap_copy is not None:
                if self.on_swap_link_broken is not None:
                    self.on_swap_link_broken(block.swap_copy)
                block.swap_copy = None
            block.ref_cnt = 1
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take one more reference on each block; a free (cached) block is revived in O(1)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference on each block, in the order given; raises on a double free."""
        blocks = list(blocks)
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of block {block.block_id}: it is already free")
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is not None or block.swap_copy is not None:
                    self.free_block_queue.append(block)
                else:
                    self.free_block_queue.appendleft(block)

    def get_cached_block(self, block_hash: BlockHash) -> Block | None:
        return self.cached_blocks.get(block_hash)

    def cache_block(self, block: Block, block_hash: BlockHash) -> bool:
        """Register a full, computed block under its hash; False if another block has it."""
        if not self.enable_caching:
            return False
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise ValueError(
                    f"block {block.block_id} is already cached under another hash: the token "
                    f"ids given do not match the ones it was computed from")
            return True
        if block_hash in self.cached_blocks:
            return False
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block
        if self.on_cached is not None:
            self.on_cached(block, block_hash)
        return True
