"""Stable, chained block hashes for the prefix cache.

A full block's hash covers its parent block's hash, its token ids and the extra keys (the cache
salt), so equal hashes mean equal whole prefixes. sha256 over a fixed little-endian encoding is
the same in every process and run, unlike Python's salted ``hash()``:

    sha256(parent hash (b"" for the first block)
           + (b"N" without a salt | b"S" + u32 len(salt) + salt utf-8)
           + the token ids as int64 little-endian)
"""

from __future__ import annotations

import struct
from functools import lru_cache
from hashlib import sha256
from typing import Sequence

BlockHash = bytes

_ROOT = b""
_packers: dict[int, struct.Struct] = {}  # token count -> its int64 packer (block_size, mostly)


def token_packer(num_tokens: int) -> struct.Struct:
    """The packer of ``num_tokens`` token ids (int64 little-endian)."""
    packer = _packers.get(num_tokens)
    if packer is None:
        packer = _packers[num_tokens] = struct.Struct(f"<{num_tokens}q")
    return packer


@lru_cache(maxsize=1024)
def salt_key(cache_salt: str | None) -> bytes:
    """The bytes a cache salt (or its absence) adds to every block hash."""
    if cache_salt is None:
        return b"N"
    salt = cache_salt.encode("utf-8")
    return b"S" + struct.pack("<I", len(salt)) + salt


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int],
                      cache_salt: str | None = None) -> BlockHash:
    """Hash of one full block, chained to its parent's hash (None for the first block)."""
    try:
        packed = token_packer(len(token_ids)).pack(*token_ids)
    except struct.error as exc:
        raise ValueError(f"token ids must be integers in int64 range: {exc}") from None
    return sha256((parent_hash if parent_hash is not None else _ROOT) + salt_key(cache_salt)
                  + packed).digest()


def hash_full_blocks(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None,
                     *, start: int = 0, parent_hash: BlockHash | None = None,
                     max_blocks: int | None = None) -> list[BlockHash]:
    """Chained hashes of the full blocks of ``token_ids`` from block index ``start`` on.

    ``parent_hash`` is the hash of block ``start - 1`` (None when ``start`` is 0).
    """
    num_full = len(token_ids) // block_size
    if max_blocks is not None:
        num_full = min(num_full, start + max_blocks)
    if num_full <= start:
        return []
    pack = token_packer(block_size).pack
    salt = salt_key(cache_salt)
    hashes = []
    parent = parent_hash if parent_hash is not None else _ROOT
    try:
        for i in range(start * block_size, num_full * block_size, block_size):
            parent = sha256(parent + salt + pack(*token_ids[i:i + block_size])).digest()
            hashes.append(parent)
    except struct.error as exc:
        raise ValueError(f"token ids must be integers in int64 range: {exc}") from None
    return hashes
