"""Small derived files kept under the cache folder (a model's filled-in config, a vocabulary's
grammar tables): written whole or not at all, and a failure to write costs only time."""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Callable, Iterable
from importlib import metadata
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def write_text_atomic(path: Path, text: str, log: logging.Logger) -> bool:
    """Write `text` to `path` through a temporary file and a rename, so a concurrent reader
    sees the old file, none, or all of the new one. An OSError (a read-only cache, a full
    disk) is logged and False returned: the next reader builds the content again."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
        return True
    except OSError as exc:
        log.info("could not write %s: %s", path, exc)
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        return False


def read_cached(path: Path, parse: Callable[[str], T], log: logging.Logger,
                errors: tuple[type[Exception], ...] = (OSError, ValueError, KeyError, TypeError)
                ) -> T | None:
    """`parse` of the entry's text; None when there is no entry, or when reading or parsing it
    raises one of `errors` (logged: the caller builds the content again and rewrites it)."""
    try:
        return parse(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except errors as exc:
        log.info("ignoring the cache entry %s (%s: %s)", path, type(exc).__name__, exc)
        return None


# The files a tokenizer is made of: what keys anything derived from one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "tokenizer.model")


def cache_key(*parts: str, files: Iterable[Path] = ()) -> str:
    """A short hash of `parts` and of the contents of those of `files` that exist."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode() + b"\0")
    for path in files:
        if path.is_file():
            digest.update(f"{path.name}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:32]


def package_version(name: str) -> str:
    """An installed distribution's version ("none" when it is not installed): what made a file."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "none"
