"""The disk tier's files: one full KV block per file, named by its prefix-cache hash.

Shared by the scheduler (which lists the directory to know what it holds) and the workers
(which write and read the blocks), so it lives in the ground, importing no role.

Layout: ``<root>/<namespace hex>/<block hash hex>.kvb``. The namespace is a digest of what
makes bytes interchangeable - the model's files, the cache dtype, the block size and the
per-rank layout - so a different model or configuration never sees another's blocks; the
adapter (cache salt) is already part of every block hash. A file is

    magic b"PSKVBLK1" | namespace (32 bytes) | block hash (32 bytes) | payload length (u64)
    | crc32 of the payload (u32) | payload

written under a temporary name (``.tmp-<pid>-<random>``) and renamed into place, so a reader
sees a whole file or none; a torn, corrupt or foreign file fails its checks and is never
loaded. Directories are 0700 and files 0600, created by us and checked before use.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import time
import zlib

from pagedserve.private_files import PRIVATE_MODE, PrivateFileError, check_private

MAGIC = b"PSKVBLK1"
HEADER = struct.Struct("<8s32s32sQI")
SUFFIX = ".kvb"
TMP_PREFIX = ".tmp-"
HASH_LEN = 32
# A temporary file left by a process that is gone is removed by the next scan after this long.
STALE_TMP_S = 60.0


class TierFileError(Exception):
    """A block file that cannot be used; the message names the file and the cause."""


def namespace_digest(**parts) -> bytes:
    """The 32-byte namespace of blocks computed under `parts` (JSON-able values)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).digest()


def model_fingerprint(path: str) -> list:
    """What identifies a model's weights on disk cheaply: each file's name, size and mtime
    (a directory's top-level files, or the file itself)."""
    try:
        if os.path.isdir(path):
            names = sorted(os.listdir(path))
            infos = [(n, os.stat(os.path.join(path, n))) for n in names]
            return [(n, s.st_size, s.st_mtime_ns) for n, s in infos if stat.S_ISREG(s.st_mode)]
        info = os.stat(path)
        return [(os.path.basename(path), info.st_size, info.st_mtime_ns)]
    except OSError:
        return [path]  # a model named by id only: its name is all there is


def _private_dir(path: str, what: str) -> None:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise PrivateFileError(f"{what} {path} is not a directory (a link or a file): refused")
    check_private(info, f"{what} {path}")


def open_tier_dir(root: str, namespace: bytes) -> str:
    """The namespace's directory under `root`, both created 0700 if missing and checked to be
    ours and private (PrivateFileError naming the cause otherwise)."""
    root = os.path.abspath(root)
    _private_dir(root, "--kv-offload-dir")
    sub = os.path.join(root, namespace.hex()[:32])
    _private_dir(sub, "--kv-offload-dir namespace")
    return sub


def block_path(directory: str, block_hash: bytes) -> str:
    return os.path.join(directory, block_hash.hex() + SUFFIX)


def write_block(directory: str, namespace: bytes, block_hash: bytes, payload) -> None:
    """Write one block under a temporary name and rename it into place. Raises OSError (a
    full disk: ENOSPC), leaving no file behind."""
    data = memoryview(payload).cast("B")
    header = HEADER.pack(MAGIC, namespace, block_hash, data.nbytes, zlib.crc32(data))
    tmp = os.path.join(directory, f"{TMP_PREFIX}{os.getpid()}-{os.urandom(6).hex()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 PRIVATE_MODE)
    try:
        try:
            for chunk in (header, data):
                view = memoryview(chunk)
                while view.nbytes:
                    view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, block_path(directory, block_hash))
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_block(directory: str, namespace: bytes, block_hash: bytes, nbytes: int) -> bytearray:
    """The payload of the block file of `block_hash`, checked: ours and private, a regular
    file of the right size, its header naming this namespace and hash, its checksum right.
    Raises TierFileError (or OSError) naming the cause."""
    path = block_path(directory, block_hash)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise TierFileError(f"{path} is not a regular file")
        try:
            check_private(info, path)
        except PrivateFileError as exc:
            raise TierFileError(str(exc)) from None
        if info.st_size != HEADER.size + nbytes:
            raise TierFileError(f"{path} has {info.st_size} bytes, a block file of this model "
                                f"has {HEADER.size + nbytes}")
        buf = bytearray(info.st_size)
        view, got = memoryview(buf), 0
        while got < len(buf):
            n = os.readv(fd, [view[got:]])
            if n == 0:
                raise TierFileError(f"{path} ended after {got} bytes (truncated while read)")
            got += n
    finally:
        os.close(fd)
    magic, ns, stored_hash, length, crc = HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise TierFileError(f"{path} is not a KV block file (bad magic)")
    if ns != namespace:
        raise TierFileError(f"{path} belongs to another model or configuration (namespace)")
    if stored_hash != block_hash or length != nbytes:
        raise TierFileError(f"{path} holds another block than its name says")
    payload = memoryview(buf)[HEADER.size:]
    if zlib.crc32(payload) != crc:
        raise TierFileError(f"{path} is corrupt (checksum mismatch)")
    return buf[HEADER.size:]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stale_tmp(name: str, mtime: float, now: float) -> bool:
    """A temporary file whose writer is gone (or that is old): never renamed, never read."""
    pid = name[len(TMP_PREFIX):].partition("-")[0]
    return (not pid.isdigit() or not _pid_alive(int(pid))) and now - mtime > STALE_TMP_S \
        or now - mtime > 3600.0


def scan_blocks(directory: str, now: float | None = None) -> list[tuple[bytes, float]]:
    """(block hash, mtime) of every block file in the directory, oldest first; stale temporary
    files are removed on the way. Names that are not block files are ignored."""
    now = time.time() if now is None else now
    found = []
    with os.scandir(directory) as entries:
        for entry in entries:
            name = entry.name
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if name.startswith(TMP_PREFIX):
                if _stale_tmp(name, info.st_mtime, now):
                    try:
                        os.unlink(entry.path)
                    except OSError:
                        pass
                continue
            if not name.endswith(SUFFIX) or not stat.S_ISREG(info.st_mode):
                continue
            try:
                block_hash = bytes.fromhex(name[:-len(SUFFIX)])
            except ValueError:
                continue
            if len(block_hash) == HASH_LEN:
                found.append((block_hash, info.st_mtime))
    found.sort(key=lambda item: item[1])
    return found


def has_block(directory: str, block_hash: bytes) -> bool:
    """A file for the block exists (written by this group or another replica sharing it)."""
    return os.path.exists(block_path(directory, block_hash))


def remove_block(directory: str, block_hash: bytes) -> None:
    try:
        os.unlink(block_path(directory, block_hash))
    except FileNotFoundError:
        pass
