"""Reading a request body (issue 38): 1 MB crafted bodies that were quadratic are answered
correctly, and the nesting scan agrees with a byte-by-byte state machine."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.pipeline.ingress.errors import APIError
from pagedserve.pipeline.ingress.json_body import (MAX_JSON_DEPTH, decode_json_object,
                                                   lone_surrogate_path, nesting_depth)

MB = 1 << 20
FLAT = b'{"a":[' + b"[]," * 70  # more brackets than the depth limit, nested 2 deep


def depth_by_state_machine(raw: bytes) -> int:
    """The reference: strings (an unterminated one runs to the end) hide their brackets."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == ord("\\"):
                escaped = True
            elif byte == ord('"'):
                in_string = False
        elif byte == ord('"'):
            in_string = True
        elif byte in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif byte in b"]}":
            depth -= 1
    return deepest


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from([b"[", b"]", b"{", b"}", b'"', b"\\", b"a", b"\n", b'\\"']),
                max_size=60))
def test_nesting_depth_equals_the_state_machine(parts):
    raw = b"".join(parts)
    assert nesting_depth(raw) == depth_by_state_machine(raw)


def refusal(raw: bytes) -> str:
    with pytest.raises(APIError) as err:
        decode_json_object(raw)
    assert err.value.status == 400
    return err.value.message


def test_1mb_unterminated_string_of_escaped_quotes_is_invalid_json():
    # Each quote began a new scan to the end: 40 KB took 8 s, 1 MB would take hours.
    body = FLAT + b'"' + b'\\"' * (MB // 2)
    assert refusal(body).startswith("the request body is not valid JSON: Unterminated string")


def test_1mb_of_brackets_inside_an_unterminated_string_do_not_count_as_nesting():
    body = FLAT + b'"' + b"[{" * (MB // 2)
    assert refusal(body).startswith("the request body is not valid JSON: Unterminated string")


def test_1mb_deep_nesting_is_refused_with_its_depth():
    body = b"[" * (MB // 2) + b"]" * (MB // 2)
    assert refusal(body) == (f"the request body nests arrays and objects {MB // 2} deep; at "
                             f"most {MAX_JSON_DEPTH} levels are allowed")


def test_1mb_of_flat_brackets_and_strings_is_accepted():
    body = FLAT + b'"\\\\\\"",' * (MB // 8) + b"[]]}"
    assert len(decode_json_object(body)["a"]) == 70 + MB // 8 + 1


def test_nesting_at_the_limit_is_accepted_one_more_is_not():
    at_limit = b'{"a":' + b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1) + b"}"
    assert decode_json_object(at_limit)
    over = b'{"a":' + b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH + b"}"
    assert "65 deep" in refusal(over)


def test_a_lone_surrogate_under_a_1mb_key_is_found_without_copying_the_key_per_item():
    # The walk built each item's path string: a 500 KB key copied for each of 125,000 items.
    body = (b'{"x":"\\ud800","' + b"k" * (MB // 2) + b'":[' + b"0," * (MB // 8) + b"0]}")
    assert refusal(body).startswith("x contains a lone UTF-16 surrogate")


def test_lone_surrogate_paths():
    assert lone_surrogate_path({"a": [1, {"b": "\ud800"}]}) == "a.1.b"
    assert lone_surrogate_path({"a": {"\udc00": 1}}) == "a"
    assert lone_surrogate_path("\udfff") == "the request body"
    assert lone_surrogate_path({"a": ["\U0001f600"]}) is None


def test_bench_body_scan_prints_one_json_object_last(capsys):
    import json

    from script_module import load_script

    load_script("bench_body_scan").main(["--sizes", "2000,4000", "--repeat", "1", "--no-store"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result["shapes"]) >= {"escaped_quotes", "deep_nesting", "long_string",
                                     "many_brackets"}
    assert all(shape["complete"] for shape in result["shapes"].values())
    assert result["worst_s_per_byte"] > 0
