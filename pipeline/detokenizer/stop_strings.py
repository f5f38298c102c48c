"""Stop-string matching over a stream of text deltas.

A stop string may arrive split across deltas, so text that could be the start of one is held
back until the next delta shows whether it is (at most max(len(stop)) - 1 characters). The
match reported is the stop string that *completes* first in the text, which is where generation
would have stopped had the text arrived one character at a time; the result therefore does not
depend on how the text was split into deltas.
"""
from __future__ import annotations

from typing import Iterable


class StopStringMatcher:
    """Feed text deltas; get back the text safe to show and the stop string once one matched."""

    def __init__(self, stops: Iterable[str], include_stop_str_in_output: bool = False):
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stops if s))
        self.include_stop_str_in_output = include_stop_str_in_output
        self.matched: str | None = None
        self._held = ""
        # Every proper prefix of a stop string, for finding the longest one the text ends with.
        self._prefixes = frozenset(s[:i] for s in self.stops for i in range(1, len(s)))
        self._max_held = max((len(s) for s in self.stops), default=1) - 1

    @property
    def finished(self) -> bool:
        return self.matched is not None

    def feed(self, delta: str, *, can_stop: bool = True) -> tuple[str, str | None]:
        """Returns (text to emit, stop string matched by this delta or None).

        After a match, the text up to the stop string (or through it, with
        include_stop_str_in_output) is emitted and all later deltas are dropped.
        With can_stop=False (min_tokens not reached) stop strings pass through as text.
        """
        if self.matched is not None:
            return "", None
        if not self.stops:
            return delta, None
        text = self._held + delta
        if can_stop:
            match = self._first_completed(text)
            if match is not None:
                start, stop = match
                self.matched, self._held = stop, ""
                end = start + len(stop) if self.include_stop_str_in_output else start
                return text[:end], stop
        keep = self._longest_partial_suffix(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], None

    def flush(self) -> str:
        """The sequence ended without a match: the held-back text is final."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _first_completed(self, text: str) -> tuple[int, str] | None:
        # Earliest end wins; among stops ending at the same place the longer one started first.
        best: tuple[int, int, str] | None = None
        for stop in self.stops:
            start = text.find(stop)
            if start < 0:
                continue
            key = (start + len(stop), -len(stop), stop)
            if best is None or key < best:
                best = key
        if best is None:
            return None
        end, neg_len, stop = best
        return end + neg_len, stop

    def _longest_partial_suffix(self, text: str) -> int:
        for keep in range(min(self._max_held, len(text)), 0, -1):
            if text[len(text) - keep:] in self._prefixes:
                return keep
        return 0
