"""A request body's bytes to a JSON object, refusing what the rest of the server cannot hold.

`json.loads` alone accepts three things that fail later as 500s: nesting deep enough to raise
RecursionError (in the parser, or in anything that walks the value afterwards), strings with a
lone UTF-16 surrogate (a `\\ud800` escape: no tokenizer, msgpack or UTF-8 response can carry
one), and bytes that are not UTF-8. Each becomes a 400 here.
"""
from __future__ import annotations

import json
import re
from typing import Any

from pagedserve.pipeline.ingress.errors import invalid

MAX_JSON_DEPTH = 64  # nested arrays/objects; a real request uses 4 (messages -> parts -> part)

# A string token (skipped whole) or a bracket: enough to measure nesting without parsing.
_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # also matches escaped valid pairs
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # after decoding, a pair is one code point


def decode_json_object(raw: bytes) -> dict[str, Any]:
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH:
        depth = nesting_depth(raw)
        if depth > MAX_JSON_DEPTH:
            raise invalid(f"the request body nests arrays and objects {depth} deep; at most "
                          f"{MAX_JSON_DEPTH} levels are allowed")
    try:
        body = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise invalid(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {json_type(body)}")
    if _SURROGATE_ESCAPE.search(raw):
        where = lone_surrogate_path(body)
        if where is not None:
            where = where[:200]
            raise invalid(f"{where} contains a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                          "escape), which is not a character", where)
    return body


def nesting_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in `raw` (brackets inside strings skipped)."""
    depth = deepest = 0
    for match in _TOKENS.finditer(raw):
        token = match.group()
        if token in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        elif token in (b"]", b"}"):
            depth -= 1
    return deepest


def lone_surrogate_path(value: Any) -> str | None:
    """The dotted path ("messages.0.content") of the first string, key or value, holding a lone
    surrogate; None when there is none."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if _LONE_SURROGATE.search(item):
                return path or "the request body"
        elif isinstance(item, dict):
            for key, child in item.items():
                child_path = f"{path}.{key}" if path else key
                if _LONE_SURROGATE.search(key):
                    return path or "the request body"
                stack.append((child_path, child))
        elif isinstance(item, list):
            stack.extend((f"{path}.{i}" if path else str(i), child) for i, child in enumerate(item))
    return None


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else type(value).__name__
