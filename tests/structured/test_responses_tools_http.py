"""Function tools over /v1/responses with the openai SDK: a launched group of the tiny random model
with a Hermes tool template (tests/structured/conftest.py), so the grammar alone makes the calls:
tool_choice required / named give function_call items whose arguments fit the schema, the
stream's items equal the non-streamed ones, and a function_call_output turn gets a text answer."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from faults.conftest import Group

pytestmark = pytest.mark.slow
TEMPLATE = Path(__file__).with_name("hermes_template.jinja")

WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["C", "F"]}},
               "required": ["city", "unit"]}}
ADD = {"type": "function", "name": "add", "description": "Add two integers",
       "parameters": {"type": "object", "properties": {
           "a": {"type": "integer", "minimum": 0, "maximum": 999},
           "b": {"type": "integer", "minimum": 0, "maximum": 999}}, "required": ["a", "b"]}}
SCHEMA_OF = {t["name"]: t["parameters"] for t in (WEATHER, ADD)}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server(tiny_chat_dir):
    group = Group(tiny_chat_dir, http=True, extra=(
        "--chat-template", str(TEMPLATE), "--tool-call-parser", "hermes"))
    base = f"http://127.0.0.1:{group.port}"
    model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
    yield openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=600), model
    assert group.close() == 0
    assert group.leftovers() == []


def calls_of(response) -> list:
    return [item for item in response.output if item.type == "function_call"]


def test_required_and_named_tool_choice_give_valid_function_calls(server):
    sdk, model = server
    for choice in ("required", {"type": "function", "name": "add"}):
        r = sdk.responses.create(model=model, input=ASK, tools=[WEATHER, ADD], temperature=0,
                                 tool_choice=choice, parallel_tool_calls=False,
                                 max_output_tokens=200)
        [call] = calls_of(r)
        assert call.call_id.startswith("call_") and call.id.startswith("fc_")
        if isinstance(choice, dict):
            assert call.name == "add"
        jsonschema.validate(json.loads(call.arguments), SCHEMA_OF[call.name])


def test_streamed_calls_equal_the_response_and_an_output_gets_an_answer(server):
    sdk, model = server
    kw = dict(model=model, input=ASK, tools=[WEATHER], temperature=0, max_output_tokens=200,
              tool_choice={"type": "function", "name": "get_weather"})
    whole = sdk.responses.create(**kw)
    events = list(sdk.responses.create(stream=True, **kw))
    final = events[-1].response
    assert [(c.name, json.loads(c.arguments)) for c in calls_of(final)] == \
        [(c.name, json.loads(c.arguments)) for c in calls_of(whole)]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [c.arguments for c in calls_of(final)]
    [call] = calls_of(whole)
    follow = [{"role": "user", "content": ASK},
              {"type": "function_call", "call_id": call.call_id, "name": call.name,
               "arguments": call.arguments},
              {"type": "function_call_output", "call_id": call.call_id,
               "output": '{"temperature": 21}'}]
    answer = sdk.responses.create(model=model, input=follow, tools=[WEATHER], tool_choice="none",
                                  temperature=0, max_output_tokens=16)
    assert [item.type for item in answer.output] == ["message"] and not calls_of(answer)
