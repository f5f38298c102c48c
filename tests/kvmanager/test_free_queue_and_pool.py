import pytest

from pagedserve.kvmanager import Block, BlockPool, FreeBlockQueue, NoFreeBlocksError


def ids(queue):
    return [b.block_id for b in queue]


def test_free_queue_popleft_append_remove_are_ordered():
    blocks = [Block(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert ids(queue) == [0, 1, 2, 3, 4] and len(queue) == 5
    queue.remove(blocks[2])
    assert ids(queue) == [0, 1, 3, 4]
    assert queue.popleft() is blocks[0]
    queue.append(blocks[2])
    queue.appendleft(blocks[0])
    assert ids(queue) == [0, 1, 3, 4, 2] and len(queue) == 5
    assert blocks[0].is_free and not Block(9).is_free


def test_free_queue_popleft_n_takes_the_head_in_order():
    blocks = [Block(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert queue.popleft_n(0) == [] and ids(queue) == [0, 1, 2, 3, 4]
    assert queue.popleft_n(2) == blocks[:2] and ids(queue) == [2, 3, 4] and len(queue) == 3
    assert not blocks[0].is_free and blocks[1].next_free is None
    with pytest.raises(IndexError):
        queue.popleft_n(4)
    assert ids(queue) == [2, 3, 4]
    queue.appendleft(blocks[1])
    assert queue.popleft_n(4) == [blocks[1]] + blocks[2:] and len(queue) == 0 and ids(queue) == []
    queue.append(blocks[0])
    assert ids(queue) == [0] and queue.popleft() is blocks[0]


def test_free_queue_rejects_double_insert_and_foreign_remove():
    blocks = [Block(i) for i in range(2)]
    queue = FreeBlockQueue(blocks[:1])
    with pytest.raises(ValueError, match="already in the free queue"):
        queue.append(blocks[0])
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(blocks[1])
    queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft()


def test_pool_allocate_free_and_double_free():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert (a.block_id, b.block_id) == (0, 1) and a.ref_cnt == b.ref_cnt == 1
    assert pool.num_free_blocks == 2 and pool.num_used_blocks == 2
    with pytest.raises(NoFreeBlocksError, match="need 3 blocks but only 2 of 4"):
        pool.allocate(3)
    assert pool.num_free_blocks == 2
    pool.free([b, a])
    with pytest.raises(ValueError, match="double free of block 0"):
        pool.free([a])
    assert pool.num_free_blocks == 4


def test_pool_uncached_freed_blocks_are_reused_before_cached_ones():
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    assert pool.cache_block(a, b"h-a") and pool.cache_block(b, b"h-b")
    assert not pool.cache_block(c, b"h-a")  # another block already holds the hash
    pool.free([d, c, b, a])
    # Cached blocks queue at the tail in free order; uncached ones go to the head.
    assert ids(pool.free_block_queue) == [2, 3, 1, 0]
    assert pool.get_cached_block(b"h-b") is b
    (x,) = pool.allocate(1)
    assert x is c
    pool.touch([a])  # a hit on a free cached block revives it from the middle of the queue
    assert a.ref_cnt == 1 and ids(pool.free_block_queue) == [3, 1]
    y, z = pool.allocate(2)
    assert (y, z) == (d, b)
    assert b.block_hash is None and pool.get_cached_block(b"h-b") is None  # evicted on reuse
    assert pool.get_cached_block(b"h-a") is a


def test_cache_block_rejects_conflicting_hash():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache_block(a, b"one")
    with pytest.raises(ValueError, match="already cached under another hash"):
        pool.cache_block(a, b"two")
