"""Which output tokens of a stream the client has all the text of.

A replica sends a token's id at once but may hold its text back: the end of a multi-byte
character until the character is complete (pipeline/detokenizer/incremental.py), and text that
could be the start of a stop string until later text shows whether it is
(pipeline/detokenizer/stop_strings.py). When the replica dies, what it held never reaches the
client, so a continuation from every token received would lose that text. A continuation
starts instead after the *confirmed* tokens, those whose text the client has all of; the next
replica generates the rest (the *tail*) again, and the router drops the text and ids of it the
client already has (`Replay`), checking that they came back the same.

A token's text has all been sent
- once a chunk with text ends after it: the detokenizer releases text through its latest token;
- and, when the request has stop strings, once the text sent after that chunk begins with a
  character no stop string begins with: held text would begin a stop string, and the matcher
  releases it before anything else.

Pure, and linear in what is streamed: the tail is kept as pieces, cut at chunk boundaries.
"""
from __future__ import annotations

from collections.abc import Iterable


class Delivery:
    """What the client got of one stream's first choice: confirmed tokens and the tail."""

    def __init__(self, stops: Iterable[str]):
        self.stop_starts = frozenset(s[0] for s in stops if isinstance(s, str) and s)
        self.confirmed_ids: list[int] = []
        self.tail_ids: list[int] = []
        self._tail_text: list[str] = []   # the text sent after confirmed_ids, chunk by chunk
        # The end of the last chunk with text, as (ids, pieces) of the tail, until confirmed
        self._candidate: tuple[int, int] | None = None

    @property
    def num_tokens(self) -> int:
        """Every token the client got."""
        return len(self.confirmed_ids) + len(self.tail_ids)

    @property
    def tail_text(self) -> str:
        return "".join(self._tail_text)

    def sent(self, ids: list[int], text: str) -> None:
        """A chunk went to the client with these token ids and this text."""
        if text and self._candidate is not None and text[0] not in self.stop_starts:
            self._confirm(*self._candidate)
        self.tail_ids.extend(ids)
        if text:
            self._tail_text.append(text)
            self._candidate = (len(self.tail_ids), len(self._tail_text))
            if not self.stop_starts:  # nothing can be held after a chunk with text
                self._confirm(*self._candidate)

    def _confirm(self, num_ids: int, num_pieces: int) -> None:
        self.confirmed_ids.extend(self.tail_ids[:num_ids])
        del self.tail_ids[:num_ids]
        del self._tail_text[:num_pieces]
        self._candidate = None


class ReplayDiverged(Exception):
    """A continuation generated something else than what the client already has."""


class Replay:
    """A continuation's output with the tail the client already has cut off; ReplayDiverged
    when it differs from that tail (sampling without a seed; numerics of another batch)."""

    def __init__(self, ids: list[int], text: str):
        self.ids, self.text = ids, text
        self._ids_at = self._text_at = 0

    @property
    def done(self) -> bool:
        return self._ids_at == len(self.ids) and self._text_at == len(self.text)

    def cut(self, ids: list[int], text: str) -> tuple[list[int], str]:
        """The part of a continuation chunk that is new to the client."""
        take = min(len(ids), len(self.ids) - self._ids_at)
        if take:
            if ids[:take] != self.ids[self._ids_at:self._ids_at + take]:
                raise ReplayDiverged(f"it generated other tokens than the {len(self.ids)} "
                                     "already sent")
            self._ids_at += take
            ids = ids[take:]
        take = min(len(text), len(self.text) - self._text_at)
        if take:
            if text[:take] != self.text[self._text_at:self._text_at + take]:
                raise ReplayDiverged("it generated other text than what was already sent")
            self._text_at += take
            text = text[take:]
        return ids, text
