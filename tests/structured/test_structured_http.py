"""Structured output, tool calls and their errors through a launched group's HTTP API, with
the openai SDK: one group of a tiny random model (its random logits leave every bit of structure
to the masks; tests/structured/conftest.py), a Hermes tool template, --tool-call-parser hermes."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from faults.conftest import Group

pytestmark = pytest.mark.slow
TEMPLATE = Path(__file__).with_name("hermes_template.jinja")


@pytest.fixture(scope="module")
def server(tiny_chat_dir):
    group = Group(tiny_chat_dir, http=True, extra=(
        "--chat-template", str(TEMPLATE), "--tool-call-parser", "hermes",
        "--max-num-seqs", "64"))
    base = f"http://127.0.0.1:{group.port}"
    sdk = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=600)
    yield base, sdk, sdk.models.list().data[0].id
    assert group.close() == 0
    assert group.leftovers() == []


def _str(n=12, **kw):
    """A bounded string, free (any characters) unless a pattern is given. The tiny model's tokens
    are single bytes, so its random logits try every byte sequence; the masks keep each string
    to UTF-8 characters (a sequence that is not would decode as U+FFFD and miscount the length)."""
    return {"type": "string", "maxLength": n, **kw}


# Varied shapes, each bounded so that a sampled output ends: nested objects, arrays, enums,
# anyOf, string patterns, numeric bounds.
SCHEMAS = [
    {"type": "object", "properties": {"name": _str(), "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "ok": {"type": "boolean"}}, "required": ["color", "ok"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999}, "email": _str(20, pattern="^[a-z]{1,8}@[a-z]{1,6}\\.com$")},
        "required": ["id", "email"]}}, "required": ["user"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": _str(8), "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": -50, "maximum": 50},
                                                         {"enum": ["none", "many"]}]}}, "required": ["value"]},
    {"type": "object", "properties": {"code": _str(6, pattern="^[A-Z]{2}-[0-9]{3}$"),
                                      "level": {"type": "integer", "minimum": 1, "maximum": 5}},
     "required": ["code", "level"]},
    {"type": "object", "properties": {"points": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"]}}}, "required": ["points"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "why": _str(24)},
     "required": ["answer", "why"]},
]
TOPICS = ["a cat", "the weather", "a city", "a book", "a robot", "coffee", "the sea", "a car",
          "music", "a tree"]


def chat(sdk, model, content, **kw):
    return sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], **kw)


class Person(BaseModel):
    name: str = Field(max_length=12, pattern="^[A-Za-z ]{0,12}$")
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user"]


def test_sdk_parse_with_a_pydantic_model(server):
    _, sdk, model = server
    r = sdk.chat.completions.parse(model=model, response_format=Person, temperature=0,
                                   max_tokens=200, messages=[{"role": "user",
                                                             "content": "Describe a user."}])
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120


def test_200_schema_requests_validate_greedy_and_at_temperature_1(server):
    _, sdk, model = server

    def one(i):
        schema = SCHEMAS[i % len(SCHEMAS)]
        sampled = i % 2 == 0
        r = chat(sdk, model, f"Answer in JSON about {TOPICS[i % len(TOPICS)]}.", max_tokens=400,
                 temperature=1.0 if sampled else 0.0, seed=i if sampled else None,
                 response_format={"type": "json_schema",
                                  "json_schema": {"name": f"s{i}", "schema": schema}})
        return schema, r.choices[0]

    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(one, range(200)))
    for schema, choice in results:
        assert choice.finish_reason == "stop", choice.message.content
        assert "\ufffd" not in choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


GRAMMAR = 'root ::= "(" num (" " op " " num){0,3} ")"\nop ::= "+" | "-" | "*"\nnum ::= [1-9] [0-9]?'
CONSTRAINTS = {
    "regex": ({"structured_outputs": {"regex": r"[A-Z][a-z]{2,7} [0-9]{1,3}"}},
              lambda t: re.fullmatch(r"[A-Z][a-z]{2,7} [0-9]{1,3}", t)),
    "choice": ({"guided_choice": ["positive", "negative", "neutral"]},
               lambda t: t in ("positive", "negative", "neutral")),
    "grammar": ({"structured_outputs": {"grammar": GRAMMAR}},
                lambda t: re.fullmatch(r"\([1-9][0-9]?( [-+*] [1-9][0-9]?){0,3}\)", t)),
}


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_100_sampled_outputs_match_their_constraint(server, kind):
    _, sdk, model = server
    extra, matches = CONSTRAINTS[kind]

    def one(i):
        r = sdk.completions.create(model=model, prompt=f"Say something about {TOPICS[i % 10]}:",
                                   max_tokens=60, temperature=1.0, seed=i, extra_body=extra)
        return r.choices[0]

    with ThreadPoolExecutor(64) as pool:
        choices = list(pool.map(one, range(100)))
    for c in choices:
        assert c.finish_reason == "stop" and matches(c.text), c.text


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": _str(20), "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                                    "b": {"type": "integer", "minimum": 0, "maximum": 999}},
                   "required": ["a", "b"]}}}
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_required_and_named_always_call_with_valid_arguments(server):
    _, sdk, model = server
    named = {"type": "function", "function": {"name": "add"}}

    def one(k):
        choice = "required" if k % 2 else named
        r = sdk.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, ADD],
                                        tool_choice=choice, parallel_tool_calls=False,
                                        temperature=1.0, seed=k, max_tokens=200)
        return choice, r.choices[0]

    with ThreadPoolExecutor(8) as pool:
        for choice, c in pool.map(one, range(8)):
            assert c.finish_reason == "tool_calls"
            [call] = c.message.tool_calls
            assert call.id and call.type == "function"
            if choice is named:
                assert call.function.name == "add"
            jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


def test_streamed_tool_call_deltas_assemble_to_the_body(server):
    _, sdk, model = server
    kw = dict(model=model, messages=ASK, tools=[WEATHER, ADD], tool_choice="required",
              temperature=0, max_tokens=200)

    def streamed():
        calls, first, reason = [], [], None
        for chunk in sdk.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                reason = c.finish_reason or reason
                for d in c.delta.tool_calls or []:
                    if d.index == len(calls):  # a new call: its id and name come first
                        first.append(bool(d.id and d.function.name))
                        calls.append({"name": d.function.name, "arguments": ""})
                    calls[d.index]["arguments"] += d.function.arguments or ""
        return calls, first, reason

    with ThreadPoolExecutor(2) as pool:
        body_future = pool.submit(lambda: sdk.chat.completions.create(**kw).choices[0])
        calls, first, reason = streamed()
        body = body_future.result()
    assert calls and all(first) and reason == body.finish_reason == "tool_calls"
    assert calls == [{"name": c.function.name, "arguments": c.function.arguments}
                     for c in body.message.tool_calls]


def test_tool_result_round_trip_gives_an_answer(server):
    _, sdk, model = server
    r = sdk.chat.completions.create(model=model, messages=ASK, tools=[WEATHER],
                                    tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                    temperature=0, max_tokens=200)
    call = r.choices[0].message.tool_calls[0]
    follow = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "sunny"}'}]
    final = sdk.chat.completions.create(model=model, messages=follow, tools=[WEATHER],
                                        tool_choice="none", temperature=0, max_tokens=16)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


BAD = [
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "invalid JSON schema"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format type must be"),
    ("completions", {"structured_outputs": {"regex": "ab(c"}}, "parenthesis is not closed"),
    ("completions", {"structured_outputs": {"grammar": "root ::= nothing"}}, 'Rule "nothing" is not defined'),
    ("completions", {"guided_choice": []}, "non-empty list"),
    ("completions", {"guided_regex": "a", "guided_choice": ["a"]}, "only one of"),
    ("chat", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "'nope', which is not among"),
]


@pytest.mark.parametrize("route, extra, words", BAD, ids=[b[2][:24] for b in BAD])
def test_bad_specs_are_400_naming_the_problem_and_the_next_request_runs(server, route, extra, words):
    base, sdk, model = server
    if route == "chat":
        body = {"model": model, "messages": ASK, "max_tokens": 5, **extra}
    else:
        body = {"model": model, "prompt": "Hi", "max_tokens": 5, **extra}
    r = httpx.post(f"{base}/v1/{'chat/completions' if route == 'chat' else 'completions'}",
                   json=body, timeout=60)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    ok = sdk.completions.create(model=model, prompt="Hi", max_tokens=8, temperature=0,
                                extra_body={"guided_choice": ["hello", "bye"]})
    assert ok.choices[0].text in ("hello", "bye")
