"""The scheduler's KV-cache bookkeeping: block pool, prefix cache, copy-on-write, swap pool and
shared-memory block tables. Pure Python (numpy only for the shared tables)."""

from pagedserve.kvmanager.block_pool import Block, BlockPool, NoFreeBlocksError
from pagedserve.kvmanager.free_queue import FreeBlockQueue
from pagedserve.kvmanager.hashing import BlockHash, hash_block_tokens, hash_full_blocks
from pagedserve.kvmanager.manager import KVCacheManager, KVStats
from pagedserve.shm_tables import SharedBlockTables

__all__ = [
    "Block", "BlockHash", "BlockPool", "FreeBlockQueue", "KVCacheManager", "KVStats",
    "NoFreeBlocksError", "SharedBlockTables", "hash_block_tokens", "hash_full_blocks",
]
