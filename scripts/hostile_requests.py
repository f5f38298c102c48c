"""Generators of the hostile requests of issue 38: each multiplies work by one field (stop strings,
body nesting, n, logit_bias, messages, tools, structured-output specs) far past its limit. A
server must answer each with a 4xx naming the field, quickly, and stay whole.

`cases(model, rng)` returns {name: (body, field)}: the body as a JSON-able dict or raw bytes,
and the word the error message must name (None where the cause is the body's shape). Sizes are
drawn from `rng` around the shapes that once hurt: a 300,000-character stop string grew the
detokenizer to 2.4 GB; a body of escaped quotes cost seconds per 10 KB of regex scanning.
Used by scripts/fuzz_api.py (part `hostile`) and tests/security/test_hostile_requests.py.
"""
from __future__ import annotations

import random
from typing import Any

Body = dict[str, Any] | bytes


def escaped_quotes(size: int) -> bytes:
    """More than 64 brackets, then an unterminated string of escaped quotes."""
    return b'{"a": [' + b"[" * 70 + b'"' + b'\\"' * (size // 2)


def deep_nesting(depth: int) -> bytes:
    return b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def cases(model: str, rng: random.Random) -> dict[str, tuple[Body, str | None]]:
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    return {
        "long_stop_string": ({**chat, "stop": ["x" * rng.randint(100_000, 400_000)]}, "stop"),
        "many_stop_strings": ({**chat, "stop": [f"s{i}" for i in range(rng.randint(17, 8000))]},
                              "stop"),
        "escaped_quotes_body": (escaped_quotes(rng.randint(100_000, 900_000)), None),
        "deep_nesting_body": (deep_nesting(rng.randint(65, 200_000)), None),
        "huge_n": ({**chat, "n": rng.randint(129, 10**6)}, "n"),
        "many_logit_bias": ({**chat, "logit_bias": {str(i): 1 for i in
                                                    range(rng.randint(1025, 30_000))}},
                            "logit_bias"),
        "many_messages": ({**chat, "messages": [{"role": "user", "content": "a"}]
                           * rng.randint(2049, 20_000)}, "messages"),
        "many_tools": ({**chat, "tools": [tool] * rng.randint(129, 5000)}, "tools"),
        "deep_schema": ({**chat, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": nested_schema(rng.randint(65, 400))}}}, None),
    }
