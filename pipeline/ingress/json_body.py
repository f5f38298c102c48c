"""A request body's bytes to a JSON object, refusing what the rest of the server cannot hold.

`json.loads` alone accepts three things that fail later as 500s: nesting deep enough to raise
RecursionError (in the parser, or in anything that walks the value afterwards), strings with a
lone UTF-16 surrogate (a `\\ud800` escape: no tokenizer, msgpack or UTF-8 response can carry
one), and bytes that are not UTF-8. Each becomes a 400 here.

Every check is linear in the body's size whatever its bytes (scripts/bench_body_scan.py
measures it): no pattern here can backtrack, and the nesting is measured by C
loops, never by a Python loop per byte or per token.
"""
from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

from pagedserve.pipeline.ingress.errors import invalid

MAX_JSON_DEPTH = 64  # nested arrays/objects; a real request uses 4 (messages -> parts -> part)

# A string, skipped whole: possessive (nothing is given back to retry), and ending at its
# closing quote or at the end of the body, so an unterminated string swallows the rest instead
# of failing and being retried from each quote inside it (which was quadratic).
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_STEP = tuple(1 if b in b"[{" else -1 if b in b"]}" else 0 for b in range(256))
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
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    return max(accumulate(map(_DEPTH_STEP.__getitem__, brackets), initial=0))


def lone_surrogate_path(value: Any) -> str | None:
    """The dotted path ("messages.0.content") of the first string, key or value, holding a lone
    surrogate; None when there is none."""
    # Each item carries a link to its parent's (link, key), not its path: a path string per
    # item would copy a long key once per item beneath it (quadratic in the body's size).
    stack: list[tuple[tuple | None, Any]] = [(None, value)]
    while stack:
        link, item = stack.pop()
        if isinstance(item, str):
            if _LONE_SURROGATE.search(item):
                return _dotted(link) or "the request body"
        elif isinstance(item, dict):
            for key, child in item.items():
                if _LONE_SURROGATE.search(key):
                    return _dotted(link) or "the request body"
                stack.append(((link, key), child))
        elif isinstance(item, list):
            stack.extend(((link, i), child) for i, child in enumerate(item))
    return None


def _dotted(link: tuple | None) -> str:
    keys = []
    while link is not None:
        link, key = link
        keys.append(str(key))
    return ".".join(reversed(keys))


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
