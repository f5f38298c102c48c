"""A choice's tool-call deltas, read in one pass over the stream.

`ToolDeltaStream` sends what `tools.ToolCallStream` sends (a call's id, type and name first,
then fragments of its arguments' raw text) without reading the text so far again per delta:
each delta is scanned once (tool_scan.py), a call's name is decoded once when its value ends,
and only the last call can still grow. The whole text is joined only at the few points where
a reading decides what everything so far was (content or calls), and once at the end, where
the final reading is the non-streamed message's (`ToolPlan.parse(text, final=True)`).

Each reader reads as the matching parser in tool_parsers.py reads at every prefix; the tests
feed both the same deltas and compare (tests/security/test_tool_stream_linear.py).
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedserve.pipeline.ingress.tool_parsers import (CLOSE_TAG, OPEN_TAG, _call_opening,
                                                    _skip_ws)
from pagedserve.pipeline.ingress.marker_scan import MarkerScan
from pagedserve.pipeline.ingress.tool_scan import BAD, STOP, WAIT, CallScan, Opening

_NOT_WS = re.compile(r"[^ \t\r\n]")
_PYTHON_TAG = "<|python_tag|>"
Text = Callable[[], str]  # the whole text so far, for the readings that need it once


@dataclass
class _Fixed:
    """A call known from the start (tool_choice naming a function): the output is its arguments."""
    name: str
    args: list[str] = field(default_factory=list)


def _opening_at(text: str, i: int) -> int:
    start, possible = _call_opening(text, i)
    return start if start is not None else WAIT if possible else STOP


def _first_opening(text: str) -> int:
    i = _skip_ws(text, 0)
    return WAIT if i >= len(text) else _opening_at(text, i)


def _next_opening(text: str) -> int:
    """After an untagged call: maybe its closing fence, then the next call's opening."""
    i = _skip_ws(text, 0)
    if not text.startswith("```", i):
        if "```".startswith(text[i:i + 4]):
            return WAIT
    else:
        i = _skip_ws(text, i + 3)
    return WAIT if i >= len(text) else _opening_at(text, i)


def _llama3_opening(text: str) -> int:
    if _PYTHON_TAG.startswith(text.lstrip()):
        return WAIT
    i = _skip_ws(text, len(_PYTHON_TAG) if text.startswith(_PYTHON_TAG) else 0)
    return WAIT if i >= len(text) else i if text[i] == "{" else STOP


class _Objects:
    """Call objects one after another, between `separators` (tool_parsers._objects)."""

    def __init__(self, separators: str) -> None:
        self._next = re.compile("[^ \t\r\n" + re.escape(separators) + "]")
        self.calls: list[CallScan] = []   # those with a name, in order
        self.scan: CallScan | None = None
        self.stopped = False

    def feed(self, piece: str, i: int = 0) -> None:
        while i < len(piece) and not self.stopped:
            if self.scan is None:
                m = self._next.search(piece, i)
                if m is None:
                    return
                if piece[m.start()] != "{":
                    self.stopped = True
                    return
                self.scan, i = CallScan(), m.start()
            i = self.scan.feed(piece, i)
            if self.scan.name is not None and (not self.calls or self.calls[-1] is not self.scan):
                self.calls.append(self.scan)
            if self.scan.ended:
                self.stopped, self.scan = self.scan.state == BAD, None


class _Tagged:
    """hermes' <tool_call> regions, from just after the first opening tag."""

    def __init__(self) -> None:
        self.calls: list[CallScan] = []
        self._close, self._open = MarkerScan(CLOSE_TAG), MarkerScan(OPEN_TAG)
        self._in_region = True
        self._scan: CallScan | None = None
        self._skip = False  # this region does not open with a call object

    def feed(self, piece: str, i: int = 0) -> None:
        while True:
            if self._in_region:
                region, after = self._close.feed(piece, i)
                self._region(region)
                if after is None:
                    return
                self._in_region, self._scan, self._skip = False, None, False
            else:
                after = self._open.feed(piece, i)[1]
                if after is None:
                    return
                self._in_region = True
            i = after

    def _region(self, text: str) -> None:
        j = 0
        if self._scan is None:
            m = None if self._skip else _NOT_WS.search(text)
            if m is None:
                return
            if text[m.start()] != "{":
                self._skip = True
                return
            self._scan, j = CallScan(), m.start()
        if not self._scan.ended:
            self._scan.feed(text, j)
            if self._scan.name is not None and (not self.calls or self.calls[-1] is not self._scan):
                self.calls.append(self._scan)


class _Untagged:
    """hermes' untagged calls: an answer opening with call objects that name one of the tools.
    `decided`: None while undecided, then whether the answer is calls (`first_name_end`: where
    the first call's name ended, from the text's start)."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self.calls: list[CallScan] = []
        self.decided: bool | None = None
        self.first_name_end = 0
        self._opening = Opening(_first_opening)
        self._scan: CallScan | None = None
        self._scan_at = 0       # where the current call's '{' is, from the text's start
        self._judged = False    # the current call's name was checked against the tools
        self._fed = 0
        self._stopped = False

    def feed(self, piece: str) -> None:
        i = 0
        while i < len(piece) and not self._stopped:
            if self._scan is None:
                at, text, i = self._opening.feed(piece, i)
                if at == WAIT:
                    break
                if at == STOP:
                    self._stop()
                    break
                self._scan, self._judged = CallScan(), False
                self._scan_at = self._fed + i - (len(text) - at)
                self._scan.feed(text, at)  # the opening ends inside the first key
                continue
            i = self._scan.feed(piece, i)
            self._judge()
            if self._scan.ended:  # malformed: no call after it (and, first, none at all)
                self._stopped = self._stopped or self._scan.state == BAD
                self._scan, self._opening = None, Opening(_next_opening)
        self._fed += len(piece)

    def _judge(self) -> None:
        scan = self._scan
        if self._judged or scan.name_end is None:
            return
        self._judged = True
        if scan.name is not None and scan.name in self.names:
            self.calls.append(scan)
            if self.decided is None:
                self.decided, self.first_name_end = True, self._scan_at + scan.name_end
        elif self.calls or scan.name is not None:  # not a call: the answer, or its end
            self._stop()
        else:  # `{"name": <not a string>`: undecided for good (the final reading decides)
            self._stopped = True

    def _stop(self) -> None:
        self._stopped = True
        if self.decided is None:
            self.decided = False


class _Hermes:
    """`parse_hermes`: untagged calls if the answer opens with one (named before any tag),
    else <tool_call> regions, else content (holding back what may begin a tag)."""

    def __init__(self, names: frozenset[str]) -> None:
        self.untagged = _Untagged(names)
        self.tagged: _Tagged | None = None
        self._open = MarkerScan(OPEN_TAG)
        self._mode = "undecided" if names else "content"
        self._fed = 0

    @property
    def calls(self) -> list[CallScan]:
        return self.tagged.calls if self.tagged is not None else self.untagged.calls

    def feed(self, piece: str, text: Text) -> str:
        if self._mode == "untagged":
            self.untagged.feed(piece)
            return ""
        if self._mode == "tagged":
            self.tagged.feed(piece)
            return ""
        before, after = self._open.feed(piece)
        tag_at = None if after is None else self._fed + after - len(OPEN_TAG)
        self._fed += len(piece)
        if self._mode == "content":
            if after is not None:
                self._to_tagged(piece, after)
            return before
        self.untagged.feed(piece)
        if self.untagged.decided and (tag_at is None or self.untagged.first_name_end <= tag_at):
            self._mode = "untagged"
            return ""
        if tag_at is not None:
            self._to_tagged(piece, after)
            return text()[:tag_at]
        if self.untagged.decided is False:
            self._mode = "content"
            whole = text()
            return whole[:len(whole) - len(self._open.held)]
        return ""

    def _to_tagged(self, piece: str, after: int) -> None:
        self._mode, self.tagged = "tagged", _Tagged()
        self.tagged.feed(piece, after)


class _Llama3:
    """`parse_llama3_json`: `{"name", "parameters"}` objects, `;`-separated, maybe after
    <|python_tag|>; anything else is content."""

    def __init__(self) -> None:
        self.objects = _Objects(";")
        self._opening = Opening(_llama3_opening)
        self._mode = "undecided"

    @property
    def calls(self) -> list[CallScan]:
        return self.objects.calls

    def feed(self, piece: str, text: Text) -> str:
        if self._mode == "content":
            return piece
        if self._mode == "calls":
            self.objects.feed(piece)
            return ""
        at, seen, i = self._opening.feed(piece)
        if at == WAIT:
            return ""
        if at == STOP:
            self._mode = "content"
            return text()
        self._mode = "calls"
        self.objects.feed(seen, at)
        self.objects.feed(piece, i)
        return ""


class _JsonArray:
    """`parse_json_array`: tool_choice required's `[{"name", "arguments"}, ...]`."""

    def __init__(self) -> None:
        self.objects: _Objects | None = None
        self._stopped = False

    @property
    def calls(self) -> list[CallScan]:
        return self.objects.calls if self.objects is not None else []

    def feed(self, piece: str, text: Text) -> str:
        i = 0
        if self.objects is None:
            m = None if self._stopped else _NOT_WS.search(piece)
            if m is None:
                return ""
            if piece[m.start()] != "[":
                self._stopped = True
                return ""
            self.objects, i = _Objects(","), m.start() + 1
        self.objects.feed(piece, i)
        return ""


class _Named:
    def __init__(self, function: str) -> None:
        self.calls = [_Fixed(function)]

    def feed(self, piece: str, text: Text) -> str:
        if piece:
            self.calls[0].args.append(piece)
        return ""


def _reader(plan):
    if plan.mode == "auto":
        return _Hermes(plan.names) if plan.parser == "hermes" else _Llama3()
    if plan.mode == "required":
        return _JsonArray()
    return _Named(plan.function)


class ToolDeltaStream:
    """One choice's deltas: content, then each call's header and argument fragments."""

    def __init__(self, plan, new_id: Callable[[], str]) -> None:
        self.plan = plan
        self.new_id = new_id
        self._reader = _reader(plan)
        self._chunks: list[str] = []
        self.content_sent = 0
        self.ids: list[str] = []          # one per call whose header went out
        self.args_sent: list[int] = []    # characters of each call's arguments sent
        self._pieces_sent: list[int] = []

    def feed(self, text: str, final: bool = False) -> list[dict[str, Any]]:
        """Deltas ({"content": ...} or {"tool_calls": [...]}) for `text` appended."""
        self._chunks.append(text)
        if final:
            return self._final()
        out = []
        content = self._reader.feed(text, self._text)
        if content:
            out.append({"content": content})
            self.content_sent += len(content)
        calls = self._reader.calls
        for index in range(max(len(self.ids) - 1, 0), len(calls)):  # only the last can grow
            call = calls[index]
            if index == len(self.ids):
                out.append(self._header(index, call.name))
                self._pieces_sent.append(0)
            if len(call.args) > self._pieces_sent[index]:
                fragment = "".join(call.args[self._pieces_sent[index]:])
                self._pieces_sent[index] = len(call.args)
                out.append(self._fragment(index, fragment))
        return out

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def _text(self) -> str:
        text = "".join(self._chunks)
        self._chunks = [text]
        return text

    def _final(self) -> list[dict[str, Any]]:
        parsed = self.plan.parse(self._text(), final=True)
        out = []
        if len(parsed.content) > self.content_sent:
            out.append({"content": parsed.content[self.content_sent:]})
            self.content_sent = len(parsed.content)
        for index, call in enumerate(c for c in parsed.calls if c.name is not None):
            if index == len(self.ids):
                out.append(self._header(index, call.name))
            fragment = call.arguments[self.args_sent[index]:]
            if fragment:
                out.append(self._fragment(index, fragment))
        return out

    def _header(self, index: int, name: str) -> dict[str, Any]:
        self.ids.append(self.new_id())
        self.args_sent.append(0)
        return {"tool_calls": [{"index": index, "id": self.ids[index], "type": "function",
                                "function": {"name": name, "arguments": ""}}]}

    def _fragment(self, index: int, fragment: str) -> dict[str, Any]:
        self.args_sent[index] += len(fragment)
        return {"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}
