"""Small derived files kept under the cache folder (a model's filled-in config, a vocabulary's
grammar tables): written whole or not at all, and a failure to write costs only time."""
from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path


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
