"""Handing freed heap memory back to the OS (glibc's malloc_trim).

free() keeps what a process freed for its next allocations: the weights released while loading
(mostly heap blocks of a few MB; SmolLM2 fp32 worker: RSS 1,461 MiB packed, 1,216 after the
release, 1,054 after a trim), and a large step's activations (Qwen2.5-Coder-1.5B: a 512-token
prefill leaves ~60 MiB). `trim_heap` returns it; `IdleTrim` does so once whenever a worker has
been idle a while, never between the steps of a busy one (whose next step would fault the pages
back in).
"""
from __future__ import annotations

import ctypes


def trim_heap() -> bool:
    """malloc_trim(0); False where the C library is not glibc."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        return False
    return True


class IdleTrim:
    """`busy()` after each message handled; `idle()` when none came for `after_s`: trims the
    heap once per idle spell."""

    def __init__(self, after_s: float = 1.0) -> None:
        self.after_ms = int(after_s * 1000)
        self.dirty = False
        self.trims = 0

    def busy(self) -> None:
        self.dirty = True

    def idle(self) -> None:
        if self.dirty:
            self.dirty = False
            self.trims += trim_heap()
