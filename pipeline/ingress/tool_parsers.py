"""Reading tool calls out of generated text, complete or still growing.

A parser turns the text so far into `Parsed`: the content before any call, and the calls, each
with its name (once complete) and the raw text of its arguments object (as far as generated).
Arguments are the model's own text, not re-serialised, so the fragments a stream sends are
prefixes of what the whole response carries and assemble to it exactly. A field's value is
scanned with string and nesting awareness, so an arguments object that contains "name" keys or
braces inside strings is read correctly, and a partial one is known to be partial.

Every reading is prefix-consistent: what the text so far says (content, a call's name, its
arguments so far) stays true as the text grows, so a stream can send it at once. Hence a
repeated key counts once (its first value), the arguments are the first of `arguments` /
`parameters` the object holds, and a key or name that is not valid JSON reads as malformed.
`tool_stream.py` reads the same way in one pass over a stream's deltas; these functions read
a whole text (the non-streamed message, and the reference the stream is tested against).

Formats: `hermes` (Qwen2.5 / Qwen3, Hermes: `<tool_call>{"name", "arguments"}</tool_call>`;
without the tags, an answer that opens with a call object naming one of the request's tools,
bare or in a ```json fence, as Qwen2.5-Coder writes its calls and llama.cpp's Hermes parser reads),
`llama3_json` (Llama 3.x: `{"name", "parameters"}` objects, `;`-separated, maybe after
`<|python_tag|>`), and `json_array`, the shape `tool_choice: required` constrains the output to
(`[{"name", "arguments"}, ...]`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from pagedserve.pipeline.ingress.marker_scan import held_prefix

_WS = " \t\r\n"
ARGS_KEYS = ("arguments", "parameters")
OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"


@dataclass
class ParsedCall:
    name: str | None          # None until the name's string is complete
    arguments: str            # raw text of the arguments value so far
    complete: bool            # the arguments value (and so the call) is complete


@dataclass
class Parsed:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """Index after the JSON string starting at text[i] ('"'); None if it is not closed."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """Index after the JSON value starting at text[i]; None if it may still continue."""
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in ",}]" + _WS:
        j += 1
    return j if j < len(text) else None


def object_fields(text: str, start: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """The top-level fields of the object at text[start] ('{'): key -> (value start, value end
    or None while partial), and the object's end (None while partial or malformed)."""
    fields: dict[str, tuple[int, int | None]] = {}
    i = start + 1
    while True:
        i = _skip_ws(text, i)
        if i >= len(text):
            return fields, None
        c = text[i]
        if c == "}":
            return fields, i + 1
        if c == ",":
            i += 1
            continue
        if c != '"':
            return fields, None
        key_end = _string_end(text, i)
        if key_end is None:
            return fields, None
        key = string_value(text[i:key_end])
        if key is None:
            return fields, None
        i = _skip_ws(text, key_end)
        if i >= len(text) or text[i] != ":":
            return fields, None
        v = _skip_ws(text, i + 1)
        if v >= len(text):
            return fields, None
        end = value_end(text, v)
        fields.setdefault(key, (v, end))
        if end is None:
            return fields, None
        i = end


def string_value(token: str) -> str | None:
    """The string a JSON value's text holds; None for another value or text that is not JSON."""
    try:
        value = json.loads(token)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def read_call(text: str, start: int, args_keys=ARGS_KEYS) -> tuple[ParsedCall, int | None, int | None]:
    """The call object at text[start] ('{'), where it ends, and where its name's value ends."""
    fields, end = object_fields(text, start)
    name = name_end = None
    if "name" in fields and fields["name"][1] is not None:
        name_end = fields["name"][1]
        name = string_value(text[fields["name"][0]:name_end])
    present = [fields[key] for key in args_keys if key in fields]
    args, complete = "", False
    if present:
        a_start, a_end = min(present)  # the first in the text: later ones cannot replace it
        args = text[a_start:a_end if a_end is not None else len(text)]
        complete = a_end is not None
    return ParsedCall(name, args, complete and end is not None), end, name_end


def call_at(text: str, start: int, args_keys=ARGS_KEYS) -> tuple[ParsedCall, int | None]:
    """The call object at text[start] ('{'), and where it ends."""
    return read_call(text, start, args_keys)[:2]


def _objects(text: str, i: int, separators: str) -> list[ParsedCall]:
    """Call objects one after another from text[i], between `separators`."""
    calls = []
    while True:
        while i < len(text) and text[i] in _WS + separators:
            i += 1
        if i >= len(text) or text[i] != "{":
            return calls
        call, end = call_at(text, i)
        calls.append(call)
        if end is None:
            return calls
        i = end


def parse_hermes(text: str, final: bool, names: frozenset[str] = frozenset()) -> Parsed:
    start = text.find(OPEN_TAG)
    untagged = _untagged_calls(text, final, names, start if start >= 0 else len(text))
    if untagged is not None:
        return untagged
    if start < 0:
        held = 0 if final else held_prefix(text, OPEN_TAG)
        return Parsed(text[:len(text) - held])
    calls, i = [], start
    while i >= 0:
        body = i + len(OPEN_TAG)
        close = text.find(CLOSE_TAG, body)
        region = text[body:close if close >= 0 else len(text)]
        if close < 0 and not final:  # what may be the closing tag is not arguments yet
            region = region[:len(region) - held_prefix(region, CLOSE_TAG)]
        j = _skip_ws(region, 0)
        if j < len(region) and region[j] == "{":
            calls.append(call_at(region, j)[0])
        if close < 0:
            break
        i = text.find(OPEN_TAG, close)
    return Parsed(text[:start], calls)


_FENCES = ("```json", "```")


def _call_opening(text: str, i: int) -> tuple[int | None, bool]:
    """Where the call object of an untagged block at text[i] starts ('{'), and whether the text
    so far may still become one (a partial fence or `{"name"`)."""
    for fence in _FENCES:
        if text.startswith(fence, i):
            i = _skip_ws(text, i + len(fence))
            break
        if fence.startswith(text[i:i + len(fence) + 1]):  # bounded: no copy of the rest
            return None, True
    if i >= len(text):
        return None, True
    if text[i] != "{":
        return None, False
    key = _skip_ws(text, i + 1)
    if text.startswith('"name"', key):
        return i, True
    return None, '"name"'.startswith(text[key:key + 7])


def _untagged_calls(text: str, final: bool, names: frozenset[str], tag_at: int) -> Parsed | None:
    """The calls of an answer that opens with an untagged call object (one after another, each
    maybe fenced); None when the text is not one, or an empty Parsed while it may become one
    (held back from content). A call counts once its name is complete and one of `names`, so
    what a stream has sent as a call stays one; the first one's name must end before `tag_at`
    (the first <tool_call>), else the tags decide."""
    calls, i = [], _skip_ws(text, 0)
    while i < len(text):
        start = _call_opening(text, i)[0]
        if start is None:
            break
        call, end, name_end = read_call(text, start)
        if call.name is None or call.name not in names or not calls and name_end > tag_at:
            break
        calls.append(call)
        if end is None:
            break
        i = _skip_ws(text, end)
        if text.startswith("```", i):
            i = _skip_ws(text, i + 3)
    if calls:
        return Parsed("", calls)
    if final or not names or tag_at < len(text):
        return None
    i = _skip_ws(text, 0)
    start, possible = _call_opening(text, i) if i < len(text) else (None, True)
    if start is not None:  # `{"name"`: undecided until the name's string is complete
        possible = call_at(text, start)[0].name is None
    return Parsed("") if possible else None


def parse_llama3_json(text: str, final: bool, names: frozenset[str] = frozenset()) -> Parsed:
    if not final and "<|python_tag|>".startswith(text.lstrip()):
        return Parsed("")  # the tag may be on its way
    body = text.removeprefix("<|python_tag|>")
    i = _skip_ws(body, 0)
    if i >= len(body):
        return Parsed(text if final else "")  # nothing but whitespace: a call may follow
    if body[i] != "{":
        return Parsed(text)
    calls = _objects(body, i, ";")
    if final and (not calls or any(c.name is None or not c.complete for c in calls)):
        return Parsed(text)  # JSON-looking text that is not a call: it is the answer
    return Parsed("", calls)


def parse_json_array(text: str, final: bool, names: frozenset[str] = frozenset()) -> Parsed:
    i = _skip_ws(text, 0)
    if i < len(text) and text[i] == "[":
        return Parsed("", _objects(text, i + 1, ","))
    return Parsed("")


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}


def parser_for_template(template: str | None) -> str | None:
    """The parser that reads the calls a chat template asks its model for, from the markers
    the template writes: `<tool_call>` tags (Qwen2.5 / Qwen3, Hermes) -> hermes; Llama 3.x's
    `<|python_tag|>` or its `"parameters"` call objects -> llama3_json. None: a template that
    renders no tools, or a format no parser here reads (Mistral's `[TOOL_CALLS]`)."""
    if not template or "tools" not in template:
        return None
    if OPEN_TAG in template:
        return "hermes"
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template
                                         and '"parameters"' in template):
        return "llama3_json"
    return None
