"""Files and shared-memory segments that hold secrets or a group's state: created only by us,
exclusively, mode 0600, and read or attached only after checking that they are still ours
and private. Another local user could otherwise plant one under a name we use (and read
what we write into it), or read one we left open."""
from __future__ import annotations

import os
import stat

PRIVATE_MODE = 0o600


class PrivateFileError(ValueError):
    """A file or segment that is not ours, not private, or cannot be read; the message names
    it and the cause."""


def check_private(info: os.stat_result, what: str) -> None:
    """Refuse what another user owns or what group or others may open."""
    if info.st_uid != os.getuid():
        raise PrivateFileError(f"{what} belongs to uid {info.st_uid}, not to this user "
                               f"({os.getuid()}): refused, another user could have planted it")
    if info.st_mode & 0o077:
        raise PrivateFileError(f"{what} is open to other users (mode "
                               f"{stat.S_IMODE(info.st_mode):04o}): refused; it must be "
                               f"private (chmod 600)")


def write_private(path: str, text: str) -> None:
    """Create `path` with mode 0600 and write `text`; never opens what is already there
    (O_EXCL: FileExistsError) nor follows a link."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 PRIVATE_MODE)
    try:
        data = text.encode()
        while data:
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)


def read_private(path: str, what: str) -> str:
    """The text of a regular file of ours that only we may read (PrivateFileError otherwise,
    naming `what`: the flag that gave the path)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise PrivateFileError(f"{what} {path}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise PrivateFileError(f"{what} {path} is not a regular file")
        check_private(info, f"{what} {path}")
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    finally:
        os.close(fd)
    try:
        return b"".join(chunks).decode()
    except UnicodeDecodeError as exc:
        raise PrivateFileError(f"{what} {path} is not UTF-8 text: {exc}") from None
