"""Block tables in POSIX shared memory: int32 ``[max_num_seqs, max_blocks_per_seq]``.

The scheduler's manager owns and writes the segment; workers on the same host attach by name
and read it without copying. Unused entries are -1. The owner creates and unlinks the segment;
an attached reader opens it read-only (``PROT_READ``) and never registers it with Python's
resource tracker, so a reader exiting can neither unlink the owner's segment nor warn about it.

The owner creates the segment exclusively with mode 0600 (`SharedMemory(create=True)`:
O_CREAT | O_EXCL, 0600), so it never adopts one already there; a reader attaches only to a
segment this user owns and no one else may open (`private_files.check_private`): one another
local user planted under the name would otherwise feed the workers block ids of their choosing.
"""

from __future__ import annotations

import mmap
import os
import secrets
from multiprocessing import shared_memory

import numpy as np

from pagedserve.private_files import PrivateFileError, check_private

try:
    import _posixshmem
except ImportError:  # pragma: no cover - non-POSIX platforms
    _posixshmem = None

NAME_PREFIX = "pagedserve_bt_"


def _nbytes(max_num_seqs: int, max_blocks_per_seq: int) -> int:
    if max_num_seqs <= 0 or max_blocks_per_seq <= 0:
        raise ValueError(f"block table shape must be positive, got "
                         f"[{max_num_seqs}, {max_blocks_per_seq}]")
    return max_num_seqs * max_blocks_per_seq * 4


class SharedBlockTables:
    """int32 block tables in shared memory; the creating process is the owner and unlinks it."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, name: str | None = None):
        nbytes = _nbytes(max_num_seqs, max_blocks_per_seq)
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.name = name or f"{NAME_PREFIX}{os.getpid()}_{secrets.token_hex(4)}"
        self.is_owner = True
        self._shm: shared_memory.SharedMemory | None = shared_memory.SharedMemory(
            name=self.name, create=True, size=nbytes)
        self._mmap: mmap.mmap | None = None
        self._unlinked = False
        self.array = np.ndarray((max_num_seqs, max_blocks_per_seq), dtype=np.int32,
                                buffer=self._shm.buf)
        self.array.fill(-1)

    @classmethod
    def attach(cls, name: str, max_num_seqs: int, max_blocks_per_seq: int) -> SharedBlockTables:
        """Open an existing segment of ours, private to this user, read-only (PrivateFileError
        otherwise); ``array`` is a non-writable view of it."""
        if _posixshmem is None:  # pragma: no cover
            raise OSError("shared block tables need POSIX shared memory")
        nbytes = _nbytes(max_num_seqs, max_blocks_per_seq)
        try:
            fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, 0)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"no shared block tables named {name!r}: the owner has not created it or "
                f"has already unlinked it") from None
        except PermissionError:
            raise PrivateFileError(f"shared block tables /dev/shm/{name} exist and this user "
                                   "cannot open them: another user created them; refused") from None
        try:
            info = os.fstat(fd)
            check_private(info, f"shared block tables /dev/shm/{name}")
            size = info.st_size
            if size < nbytes:
                raise ValueError(
                    f"shared block tables {name!r} hold {size} bytes, fewer than the "
                    f"[{max_num_seqs}, {max_blocks_per_seq}] int32 shape asked for needs "
                    f"({nbytes})")
            mapped = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self = cls.__new__(cls)
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.name = name
        self.is_owner = False
        self._shm = None
        self._mmap = mapped
        self._unlinked = False
        self.array = np.frombuffer(mapped, dtype=np.int32).reshape(max_num_seqs,
                                                                  max_blocks_per_seq)
        return self

    def close(self) -> None:
        """Drop this process's mapping; the owner also unlinks the segment. Idempotent."""
        self.array = None
        try:
            if self._shm is not None:
                self._shm.close()
            if self._mmap is not None:
                self._mmap.close()
                self._mmap = None
        except BufferError:
            # Someone still holds a view of the array; the mapping goes when it is collected.
            pass
        finally:
            if self.is_owner:
                self.unlink()

    def unlink(self) -> None:
        """Remove the segment's name (owner only); attached readers keep their mapping."""
        if not self.is_owner:
            raise PermissionError(f"only the owner may unlink shared block tables {self.name!r}")
        if self._unlinked or self._shm is None:
            return
        self._unlinked = True
        try:
            self._shm.unlink()
        except FileNotFoundError:
            pass

    def __enter__(self) -> SharedBlockTables:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "is_owner", False) and not getattr(self, "_unlinked", True):
            try:
                self.close()
            except Exception:
                pass
