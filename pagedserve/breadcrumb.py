"""Which request a role is working on, readable after the role dies.

A role that serves many requests in one process (the detokenizer, the ingress) marks the
request whose work it is running, for exactly as long as that synchronous work runs, in a
small private file mapped into memory: a mark is a copy of a few bytes, and it outlives the
process (the page cache holds it). When the role dies of itself or hangs, the launcher reads
the mark: the request it names is the one the death is held against (quarantined), so that
one request cannot take the role down again and again until the group gives up.

Layout: two bytes of length (little-endian), then the key (ASCII, at most MAX_KEY bytes). The
key is written before its length, so a process killed between the two leaves the previous
mark (or none), never a torn one.
"""
from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator

from pagedserve.private_files import (PRIVATE_MODE, PrivateFileError, check_private,
                                      read_private, write_private)

MAX_KEY = 254
SIZE = 256


class Breadcrumb:
    """The mark of one role process; `path` is created afresh (exclusive, 0600)."""

    def __init__(self, path: str) -> None:
        self.path = path
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a previous incarnation's, in our private folder: read already
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     PRIVATE_MODE)
        try:
            os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self._current = b""

    @contextlib.contextmanager
    def mark(self, key: str) -> Iterator[None]:
        """While the block runs, `key` is the request this process works on."""
        previous = self._current
        self._write(key.encode("ascii", "replace")[:MAX_KEY])
        try:
            yield
        finally:
            self._write(previous)

    def mark_now(self, key: str) -> None:
        """Inside a `mark` block: the work moved on to `key` (the block's end restores the
        mark from before it)."""
        self._write(key.encode("ascii", "replace")[:MAX_KEY])

    def _write(self, data: bytes) -> None:
        self._map[2:2 + len(data)] = data
        self._map[0:2] = len(data).to_bytes(2, "little")
        self._current = data

    def close(self) -> None:
        """At a clean exit: nothing was running."""
        self._map.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class NoBreadcrumb:
    """Marks nothing: a role run in-process (tests, the offline engine)."""

    @contextlib.contextmanager
    def mark(self, key: str) -> Iterator[None]:
        yield

    def mark_now(self, key: str) -> None:
        pass

    def close(self) -> None:
        pass


def read_breadcrumb(path: str) -> str | None:
    """The key a dead role's mark names; None when it marked nothing (or left no file). A file
    that is not ours and private is refused (PrivateFileError)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        check_private(os.fstat(fd), f"breadcrumb {path}")
        data = os.pread(fd, SIZE, 0)
    finally:
        os.close(fd)
    if len(data) < 2:
        return None
    length = int.from_bytes(data[:2], "little")
    if not 0 < length <= min(MAX_KEY, len(data) - 2):
        return None
    return data[2:2 + length].decode("ascii", "replace")


def save_keys(path: str, keys: list[str]) -> None:
    """The quarantined keys a role reads at its next start, one per line (a fresh 0600 file)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    write_private(path, "\n".join(keys))


def load_keys(path: str) -> frozenset[str]:
    """What save_keys wrote; empty when there is no file."""
    if not os.path.exists(path):
        return frozenset()
    return frozenset(filter(None, read_private(path, "quarantine list").splitlines()))


__all__ = ["Breadcrumb", "NoBreadcrumb", "PrivateFileError", "load_keys", "read_breadcrumb",
           "save_keys"]
