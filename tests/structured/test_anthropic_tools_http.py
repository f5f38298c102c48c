"""Tool use over /v1/messages with the anthropic SDK: a launched group of the tiny random model
with a Hermes tool template (tests/structured/conftest.py; SmolLM2's template renders no tools),
so the grammar alone makes the calls: tool_choice any / tool give tool_use blocks whose input
fits the schema, the stream helper's message equals the non-streamed one, and a tool_result
turn gets a text answer."""
from __future__ import annotations

from pathlib import Path

import anthropic
import httpx
import jsonschema
import pytest

from faults.conftest import Group

pytestmark = pytest.mark.slow
TEMPLATE = Path(__file__).with_name("hermes_template.jinja")

WEATHER = {"name": "get_weather", "description": "The current weather in a city",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["C", "F"]}},
               "required": ["city", "unit"]}}
ADD = {"name": "add", "description": "Add two integers",
       "input_schema": {"type": "object", "properties": {
           "a": {"type": "integer", "minimum": 0, "maximum": 999},
           "b": {"type": "integer", "minimum": 0, "maximum": 999}}, "required": ["a", "b"]}}
SCHEMA_OF = {t["name"]: t["input_schema"] for t in (WEATHER, ADD)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}  # the 2.x SDK names no sampling arguments; the API reads them


@pytest.fixture(scope="module")
def server(tiny_chat_dir):
    group = Group(tiny_chat_dir, http=True, extra=(
        "--chat-template", str(TEMPLATE), "--tool-call-parser", "hermes"))
    base = f"http://127.0.0.1:{group.port}"
    model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
    yield anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=600), model
    assert group.close() == 0
    assert group.leftovers() == []


def test_any_and_named_tool_choice_give_valid_tool_use_blocks(server):
    sdk, model = server
    for choice in ({"type": "any", "disable_parallel_tool_use": True},
                   {"type": "tool", "name": "add"}):
        m = sdk.messages.create(model=model, max_tokens=200, messages=ASK, tools=[WEATHER, ADD],
                                tool_choice=choice, extra_body=GREEDY)
        assert m.stop_reason == "tool_use"
        [call] = [b for b in m.content if b.type == "tool_use"]
        assert call.id.startswith("toolu_")
        if choice["type"] == "tool":
            assert call.name == "add"
        jsonschema.validate(call.input, SCHEMA_OF[call.name])


def test_streamed_tool_use_equals_the_message_and_a_result_gets_an_answer(server):
    sdk, model = server
    kw = dict(model=model, max_tokens=200, messages=ASK, tools=[WEATHER],
              tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    whole = sdk.messages.create(**kw)
    with sdk.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    as_blocks = [(b.type, getattr(b, "name", None), getattr(b, "input", None))
                 for b in whole.content]
    assert [(b.type, getattr(b, "name", None), getattr(b, "input", None))
            for b in final.content] == as_blocks
    assert final.stop_reason == whole.stop_reason == "tool_use"
    call = next(b for b in whole.content if b.type == "tool_use")
    follow = ASK + [{"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                      for b in whole.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                  "content": '{"temperature": 21}'}]}]
    answer = sdk.messages.create(model=model, max_tokens=16, messages=follow, tools=[WEATHER],
                                 tool_choice={"type": "none"}, extra_body=GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in answer.content] == ["text"]
