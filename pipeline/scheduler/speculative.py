"""N-gram speculative decoding on the scheduler's side: the proposer (docs/ARCHITECTURE.md),
an index per sequence that costs a few dict operations per new token, not a scan of the context.
"""
from __future__ import annotations

from collections import defaultdict

from pagedserve.pipeline.speculative_config import SpeculativeConfig


class NgramIndex:
    """One sequence's n-grams (n in [low, high]) that have a token after them -> the end of
    their latest occurrence. `ended` counts the end positions indexed so far."""

    __slots__ = ("ends", "ended")

    def __init__(self) -> None:
        self.ends: dict[tuple[int, ...], int] = {}
        self.ended = 0

    def propose(self, tokens: list[int], k: int, low: int, high: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
        `tokens` (n from high down to low) seen before; [] when none recurs."""
        size = len(tokens)
        ends = self.ends
        for end in range(max(self.ended, low), size):  # n-grams ending before the last token
            for n in range(low, min(high, end) + 1):
                ends[tuple(tokens[end - n:end])] = end
        self.ended = max(self.ended, size)
        for n in range(min(high, size), low - 1, -1):
            end = ends.get(tuple(tokens[size - n:]))
            if end is not None:
                return tokens[end:end + k]
        return []


class NgramProposer:
    """Drafts for the scheduler's sequences, one index each (dropped when it finishes)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.indexes: defaultdict[int, NgramIndex] = defaultdict(NgramIndex)

    def propose(self, seq_id: int, tokens: list[int], k: int) -> list[int]:
        c = self.config
        return self.indexes[seq_id].propose(tokens, k, c.prompt_lookup_min, c.prompt_lookup_max)

    def forget(self, seq_id: int) -> None:
        self.indexes.pop(seq_id, None)
