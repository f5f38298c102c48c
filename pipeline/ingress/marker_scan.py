"""Finding a tag in text that arrives in pieces, each piece scanned once.

A tag may be cut between two deltas, so the tail that may begin it is held back (not yet told
to be text before the tag) until the next piece decides: `<tool_call>`, `</tool_call>`,
`</think>`.
"""
from __future__ import annotations


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that begins `marker` (held back from content)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class MarkerScan:
    """Finds `marker` in text fed in pieces; holds back a tail that may be its beginning."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.held = ""

    def feed(self, piece: str, i: int = 0) -> tuple[str, int | None]:
        """Scan `piece` from `i`: (the text now known to come before the marker, the index in
        `piece` after the marker, or None while it has not come)."""
        m = len(self.marker)
        if self.held:  # a marker begun in what was held ends in the next m - 1 characters
            head = self.held + piece[i:i + m - 1]
            k = head.find(self.marker)
            if k >= 0:
                after = i + k + m - len(self.held)
                self.held = ""
                return head[:k], after
        k = piece.find(self.marker, i)
        if k >= 0:
            before, self.held = self.held + piece[i:k], ""
            return before, k + m
        text = self.held + piece[i:] if len(piece) - i < m else None
        tail = text if text is not None else piece[len(piece) - m + 1:]
        keep = held_prefix(tail, self.marker)
        if text is None:
            before = self.held + piece[i:len(piece) - keep]
        else:
            before = text[:len(text) - keep]
        self.held = tail[len(tail) - keep:] if keep else ""
        return before, None
