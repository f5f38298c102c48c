"""Stable, chained block hashes for the prefix cache.

A full block's hash covers its parent block's hash, its token ids and the extra keys (the cache
salt), so equal hashes mean equal whole prefixes. sha256 over a fixed little-endian encoding is
the same in every process and run, unlike Python's salted ``hash()``.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

BlockHash = bytes

_ROOT = b""


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int],
                      cache_salt: str | None = None) -> BlockHash:
    """Hash of one full block, chained to its parent's hash (None for the first block)."""
    h = hashlib.sha256()
    h.update(parent_hash if parent_hash is not None else _ROOT)
    if cache_salt is not None:
        salt = cache_salt.encode("utf-8")
        h.update(b"S" + struct.pack("<I", len(salt)) + salt)
    else:
        h.update(b"N")
    try:
        h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    except struct.error as exc:
        raise ValueError(f"token ids must be integers in int64 range: {exc}") from None
    return h.digest()


def hash_full_blocks(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None,
                     *, start: int = 0, parent_hash: BlockHash | None = None,
                     max_blocks: int | None = None) -> list[BlockHash]:
    """Chained hashes of the full blocks of ``token_ids`` from block index ``start`` on.

    ``parent_hash`` is the hash of block ``start - 1`` (None when ``start`` is 0).
    """
    num_full = len(token_ids) // block_size
    if max_blocks is not None:
        num_full = min(num_full, start + max_blocks)
    hashes = []
    parent = parent_hash
    for i in range(start, num_full):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size],
                                   cache_salt)
        hashes.append(parent)
    return hashes
