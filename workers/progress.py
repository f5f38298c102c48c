"""A byte progress bar on stderr for long fetches: redrawn at most twice a second, in place on a
terminal, as a few plain lines otherwise (logs stay short)."""
from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, label: str, total: int, *, stream: TextIO | None = None,
                 interval: float = 0.5, clock=time.monotonic) -> None:
        self.label, self.total, self.done = label, max(total, 1), 0
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        # off a terminal: a line every 25%, not every half second
        self.interval, self.clock = (interval if self.tty else 0.0), clock
        self.last_draw, self.last_quarter, self.closed = -1e9, -1, False

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        now = self.clock()
        if self.tty and now - self.last_draw >= self.interval:
            self.last_draw = now
            self._draw("\r")
        elif not self.tty and (quarter := 4 * self.done // self.total) > self.last_quarter:
            self.last_quarter = quarter
            self._draw("")

    def line(self) -> str:
        frac = min(self.done / self.total, 1.0)
        bar = "#" * int(frac * 30)
        return (f"{self.label} [{bar:<30}] {frac:4.0%} {self.done / 2**20:.0f}/"
                f"{self.total / 2**20:.0f} MiB")

    def _draw(self, prefix: str) -> None:
        self.stream.write(prefix + self.line() + ("" if self.tty else "\n"))
        self.stream.flush()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.tty:
            self._draw("\r")
            self.stream.write("\n")
            self.stream.flush()
