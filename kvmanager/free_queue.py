"""An intrusive doubly linked queue of free blocks.

The links live in the blocks themselves (``prev_free`` / ``next_free``), so popping the head,
appending at either end and removing a block from the middle (a prefix-cache hit on a free
block) are all O(1) with no allocation. A block is in the queue exactly when ``prev_free`` is
not None.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Iterator

if TYPE_CHECKING:
    from pagedserve.kvmanager.block_pool import Block


class _Sentinel:
    __slots__ = ("prev_free", "next_free")

    def __init__(self) -> None:
        self.prev_free = None
        self.next_free = None


class FreeBlockQueue:
    """Free blocks in eviction order: the head is handed out (and evicted from the cache) first."""

    def __init__(self, blocks: Iterable[Block] = ()) -> None:
        self._head = _Sentinel()
        self._tail = _Sentinel()
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def __iter__(self) -> Iterator[Block]:
        node = self._head.next_free
        while node is not self._tail:
            yield node
            node = node.next_free

    def popleft(self) -> Block:
        """Take the block at the head (least recently freed); raises IndexError when empty."""
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("pop from an empty free block queue")
        self._unlink(block)
        return block

    def popleft_n(self, n: int) -> list[Block]:
        """Take the ``n`` blocks at the head, in order; raises IndexError (taking none) when
        fewer are queued."""
        if n > self.num_free_blocks:
            raise IndexError(f"pop of {n} blocks from a free block queue holding "
                             f"{self.num_free_blocks}")
        out = []
        head = self._head
        block = head.next_free
        for _ in range(n):
            out.append(block)
            nxt = block.next_free
            block.prev_free = block.next_free = None
            block = nxt
        head.next_free = block
        block.prev_free = head
        self.num_free_blocks -= n
        return out

    def append(self, block: Block) -> None:
        """Put a block at the tail: it is handed out after every block already queued."""
        self._link_after(self._tail.prev_free, block)

    def appendleft(self, block: Block) -> None:
        """Put a block at the head: it is handed out next."""
        self._link_after(self._head, block)

    def remove(self, block: Block) -> None:
        """Take a block out from anywhere in the queue; raises ValueError if it is not queued."""
        if block.prev_free is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        self._unlink(block)

    def _link_after(self, prev, block: Block) -> None:
        if block.prev_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        nxt = prev.next_free
        block.prev_free = prev
        block.next_free = nxt
        prev.next_free = block
        nxt.prev_free = block
        self.num_free_blocks += 1

    def _unlink(self, block: Block) -> None:
        prev, nxt = block.prev_free, block.next_free
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1
