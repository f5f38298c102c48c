"""Resumable scanners for text that arrives in pieces: each piece is scanned once.

`CallScan` reads one call object as `tool_parsers.read_call` reads it (same states, same
answers at every prefix), and `Opening` decides how a short, whitespace-insensitive opening
reads (a fence, `{"name"`, a `<|python_tag|>`); marker_scan.MarkerScan finds the tags. The scans jump with compiled regexes, so a piece costs C-level work linear
in its length plus O(1) Python steps per token of JSON structure.
"""
from __future__ import annotations

import re
from collections.abc import Callable

from pagedserve.pipeline.ingress.tool_parsers import ARGS_KEYS, string_value

_NOT_WS = re.compile(r"[^ \t\r\n]")
_WS_RUN = re.compile(r"[ \t\r\n]+")
_STRING_STOP = re.compile(r'["\\]')
_NEST_STOP = re.compile(r'["{}\[\]]')
_SCALAR_STOP = re.compile(r"[,}\] \t\r\n]")

# CallScan states: before the '{', between fields, in a key, before its ':', before a value,
# in a string / nested / scalar value, after the '}', malformed (nothing after it counts).
_START, _KEY, _KEY_STR, _COLON, _VALUE, _V_STR, _V_NEST, _V_SCALAR, DONE, BAD = range(10)


class CallScan:
    """One call object fed in pieces from its '{': its name once complete, its arguments' raw
    text as far as fed (`args`, in pieces), where the name's value ended."""

    def __init__(self, args_keys: tuple[str, ...] = ARGS_KEYS) -> None:
        self.args_keys = args_keys
        self.state = _START
        self.consumed = 0               # characters fed and consumed, from the '{'
        self._base = 0
        self.name: str | None = None    # once the name's value is complete and a string
        self.name_end: int | None = None  # offset (from the '{') after the name's value
        self.args: list[str] = []       # the arguments value's raw text, in pieces
        self._keys: set[str] = set()    # a repeated key counts once: its first value
        self._args_seen = False         # the first of args_keys is the arguments
        self._current = ""              # the key whose value comes next
        self._key: list[str] = []
        self._field: str | None = None  # the value being read is "name", "args" or neither
        self._name: list[str] = []
        self._escape = False            # a backslash ended the last piece (in a string)
        self._depth = 0
        self._in_string = False         # in a string inside a nested value

    @property
    def ended(self) -> bool:
        """Nothing after this point belongs to the object (its '}', or malformed)."""
        return self.state >= DONE

    def feed(self, piece: str, i: int = 0) -> int:
        """Scan `piece` from `i`; where the object ended in it (len(piece) while it goes on)."""
        self._base = self.consumed - i  # piece[j] is the object's character _base + j
        while i < len(piece) and self.state < DONE:
            i = _STEPS[self.state](self, piece, i)
        self.consumed = self._base + i
        return i

    def _capture(self, text: str) -> None:
        if self._field == "name":
            self._name.append(text)
        elif self._field == "args" and text:
            self.args.append(text)

    def _start(self, piece: str, i: int) -> int:
        self.state = _KEY if piece[i] == "{" else BAD
        return i + 1

    def _between(self, piece: str, i: int) -> int:
        m = _NOT_WS.search(piece, i)
        if m is None:
            return len(piece)
        j, c = m.start(), piece[m.start()]
        if c == "}":
            self.state = DONE
        elif c == '"':
            self.state, self._key = _KEY_STR, []
        elif c != ",":
            self.state = BAD
            return j
        return j + 1

    def _string_end(self, piece: str, i: int) -> int | None:
        """Index after the closing quote of the string being read; None if not in `piece`."""
        if self._escape:  # the piece opens with the character a backslash escaped
            self._escape, i = False, i + 1
        while True:
            m = _STRING_STOP.search(piece, i)
            if m is None:
                return None
            k = m.start()
            if piece[k] == '"':
                return k + 1
            if k + 1 == len(piece):
                self._escape = True
                return None
            i = k + 2

    def _key_string(self, piece: str, i: int) -> int:
        end = self._string_end(piece, i)
        self._key.append(piece[i:end])
        if end is None:
            return len(piece)
        key = string_value('"' + "".join(self._key))
        if key is None:
            self.state = BAD
        else:
            self.state, self._current = _COLON, key
        return end

    def _colon(self, piece: str, i: int) -> int:
        m = _NOT_WS.search(piece, i)
        if m is None:
            return len(piece)
        if piece[m.start()] != ":":
            self.state = BAD
            return m.start()
        self.state = _VALUE
        return m.start() + 1

    def _value(self, piece: str, i: int) -> int:
        m = _NOT_WS.search(piece, i)
        if m is None:
            return len(piece)
        j, c = m.start(), piece[m.start()]
        key, self._field = self._current, None
        if key not in self._keys:
            self._keys.add(key)
            if key == "name":
                self._field = "name"
            elif key in self.args_keys and not self._args_seen:
                self._field, self._args_seen = "args", True
        if c in ",}]":  # an empty value, ended at once
            self._end_value(j)
            return j
        if c == '"':
            self.state = _V_STR
        elif c in "{[":
            self.state, self._depth, self._in_string = _V_NEST, 1, False
        else:
            self.state = _V_SCALAR
            return j
        self._capture(c)
        return j + 1

    def _string(self, piece: str, i: int) -> int:
        end = self._string_end(piece, i)
        self._capture(piece[i:end])
        if end is None:
            return len(piece)
        self._end_value(end)
        return end

    def _nested(self, piece: str, i: int) -> int:
        j = i
        while j < len(piece):
            if self._in_string:
                end = self._string_end(piece, j)
                if end is None:
                    break
                self._in_string, j = False, end
                continue
            m = _NEST_STOP.search(piece, j)
            if m is None:
                break
            k, c = m.start(), piece[m.start()]
            j = k + 1
            if c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth == 0:
                    self._capture(piece[i:j])
                    self._end_value(j)
                    return j
        self._capture(piece[i:])
        return len(piece)

    def _scalar(self, piece: str, i: int) -> int:
        m = _SCALAR_STOP.search(piece, i)
        if m is None:
            self._capture(piece[i:])
            return len(piece)
        self._capture(piece[i:m.start()])
        self._end_value(m.start())
        return m.start()

    def _end_value(self, j: int) -> None:
        if self._field == "name":
            self.name = string_value("".join(self._name))
            self.name_end = self._base + j
            self._name = []
        self._field, self.state = None, _KEY


_STEPS = {_START: CallScan._start, _KEY: CallScan._between, _KEY_STR: CallScan._key_string,
          _COLON: CallScan._colon, _VALUE: CallScan._value, _V_STR: CallScan._string,
          _V_NEST: CallScan._nested, _V_SCALAR: CallScan._scalar}


WAIT = -1   # Opening's answer while the text so far may still open either way
STOP = -2   # ... once it cannot open
_WS_AT = re.compile(r"[ \t\r\n]+")


class Opening:
    """Text fed in pieces until `decide(text)` (WAIT, STOP or the index where what it looks for
    starts) makes up its mind, read up to the character that decides and no further. `decide`
    must read whitespace only by skipping it: a run is kept as one space while waiting, so what
    it reads stays a few characters long; the answer is then given on the text as it came."""

    def __init__(self, decide: Callable[[str], int]) -> None:
        self.decide = decide
        self._pieces: list[str] = []
        self._short = ""

    def feed(self, piece: str, i: int = 0) -> tuple[int, str, int]:
        """(WAIT, "", len(piece)) while undecided; else (STOP or the start index in `text`,
        `text`: all this opening read, the index in `piece` after the deciding character)."""
        while i < len(piece):
            run = _WS_AT.match(piece, i)
            j = run.end() if run else i + 1
            self._pieces.append(piece[i:j])
            if run and self._short.endswith(" "):
                i = j
                continue  # a longer run of whitespace reads as the same
            self._short += " " if run else piece[i]
            i = j
            if self.decide(self._short) != WAIT:
                text = "".join(self._pieces)
                self._pieces, self._short = [], ""
                return self.decide(text), text, i
        return WAIT, "", i
