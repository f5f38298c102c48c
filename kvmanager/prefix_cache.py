"""The prefix cache over the device pool: finding a prompt's cached leading blocks, and making
blocks findable by their hash once they are full and computed.

KVCacheManager delegates to these functions, which take the manager and work on its device pool
and its per-sequence records (seq_blocks.SeqBlocks).
"""

from __future__ import annotations

import struct
from hashlib import sha256
from typing import TYPE_CHECKING, Iterable, Sequence

from pagedserve.kvmanager.block_pool import Block
from pagedserve.kvmanager.hashing import (
    BlockHash,
    hash_block_tokens,
    hash_full_blocks,
    salt_key,
    token_packer,
)

if TYPE_CHECKING:
    from pagedserve.kvmanager.manager import KVCacheManager
    from pagedserve.kvmanager.seq_blocks import SeqBlocks


def cached_prefix(kv: KVCacheManager, token_ids: Sequence[int], cache_salt: str | None
                  ) -> tuple[list[BlockHash], list[Block]]:
    """Hashes and blocks of the longest cached run of leading full blocks, leaving at least
    the last prompt token to compute (its logits are needed)."""
    hashes: list[BlockHash] = []
    blocks = []
    if not kv.enable_prefix_caching or not token_ids:
        return hashes, blocks
    bs = kv.block_size
    cached = kv.gpu_pool.cached_blocks
    parent = None
    for i in range((len(token_ids) - 1) // bs):
        parent = hash_block_tokens(parent, token_ids[i * bs:(i + 1) * bs], cache_salt)
        block = cached.get(parent)
        if block is None:
            break
        hashes.append(parent)
        blocks.append(block)
    return hashes, blocks


def lower_tier_prefix(kv: KVCacheManager, token_ids: Sequence[int], cache_salt: str | None,
                      hashes: list[BlockHash]) -> list[tuple[BlockHash, str]]:
    """(hash, tier) of the leading full blocks after the device-cached ones (`hashes`) that a
    lower KV tier holds (kvmanager/tiers.py), leaving the last prompt token to compute."""
    found: list[tuple[BlockHash, str]] = []
    tiers = kv.tiers
    if tiers is None or not kv.enable_prefix_caching or kv.sliding_window:
        return found
    bs = kv.block_size
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), (len(token_ids) - 1) // bs):
        parent = hash_block_tokens(parent, token_ids[i * bs:(i + 1) * bs], cache_salt)
        tier = tiers.find(parent)
        if tier is None:
            break
        found.append((parent, tier))
    return found


def cache_full_blocks(kv: KVCacheManager, seq_id: int, seq: SeqBlocks,
                      token_ids: Sequence[int], num_computed_tokens: int) -> None:
    """Full blocks among the sequence's first ``num_computed_tokens`` become findable."""
    if seq.swapped:
        raise ValueError(f"seq {seq_id} is swapped out; cache its blocks before swapping")
    if num_computed_tokens > seq.num_tokens:
        raise ValueError(f"seq {seq_id}: num_computed_tokens {num_computed_tokens} exceeds "
                         f"its {seq.num_tokens} reserved slots")
    if num_computed_tokens > len(token_ids):
        raise ValueError(f"seq {seq_id}: num_computed_tokens {num_computed_tokens} exceeds "
                         f"the {len(token_ids)} token ids given")
    bs = kv.block_size
    hashes = seq.block_hashes
    start = len(hashes)
    num_full = num_computed_tokens // bs
    if num_full <= start:
        return
    new_hashes = hash_full_blocks(token_ids, bs, seq.cache_salt, start=start,
                                  parent_hash=hashes[-1] if start else None,
                                  max_blocks=num_full - start)
    pool = kv.gpu_pool
    cache_block, blocks, block_ids = pool.cache_block, pool.blocks, seq.block_ids
    for i, block_hash in enumerate(new_hashes, start):
        if i >= seq.num_released:  # a placeholder's id is not this sequence's block any more
            cache_block(blocks[block_ids[i]], block_hash)
        hashes.append(block_hash)


def commit_blocks(kv: KVCacheManager, items: Iterable[tuple[int, Sequence[int], int, int]]
                  ) -> None:
    """KVCacheManager.commit_blocks: grow each sequence to its slot count, then cache its newly
    full blocks; a single new block (the decode case) is hashed inline."""
    seqs, bs, caching = kv._seqs, kv.block_size, kv.enable_prefix_caching
    pool = kv.gpu_pool
    blocks, cache_block = pool.blocks, pool.cache_block
    pack = token_packer(bs).pack
    for seq_id, token_ids, num_tokens, num_computed in items:
        seq = seqs.get(seq_id)
        if seq is None or seq.swapped:
            kv._reject_append(seq_id, seq, 0)
        n = seq.num_tokens
        if num_tokens != n:
            block_ids = seq.block_ids
            if (num_tokens < n or num_tokens > len(block_ids) * bs
                    or n % bs and blocks[block_ids[-1]].ref_cnt > 1):
                _reject_commit(seq_id, n, num_tokens)
            seq.num_tokens = num_tokens
        if not caching:
            continue
        hashes = seq.block_hashes
        start = len(hashes)
        if (num_computed // bs != start + 1 or num_computed > num_tokens
                or num_computed > len(token_ids) or start < seq.num_released):
            # not one new block, or wrong: the general path (and its errors)
            cache_full_blocks(kv, seq_id, seq, token_ids, num_computed)
            continue
        # One block filled up (a decode crossing a block boundary): hash it right here, as
        # hashing.hash_block_tokens does.
        i = start * bs
        try:
            packed = pack(*token_ids[i:i + bs])
        except struct.error:
            cache_full_blocks(kv, seq_id, seq, token_ids, num_computed)  # raises the ValueError
            raise
        block_hash = sha256((hashes[-1] if start else b"") + salt_key(seq.cache_salt)
                            + packed).digest()
        cache_block(blocks[seq.block_ids[start]], block_hash)
        hashes.append(block_hash)


def _reject_commit(seq_id: int, n: int, num_tokens: int):
    if num_tokens < n:
        raise ValueError(f"seq {seq_id} already holds {n} slots, cannot shrink to "
                         f"{num_tokens}")
    raise RuntimeError(f"seq {seq_id}: growing from {n} to {num_tokens} slots needs a block "
                       f"or a copy; the slot bookkeeping is wrong")
