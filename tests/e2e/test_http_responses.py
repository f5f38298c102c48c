"""The official openai SDK's `client.responses` against a launched group: /v1/responses (OpenAI's
Responses API) over the chat path, non-streamed and streamed, instructions and input items,
max_output_tokens, a json_schema text format, and previous_response_id."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from faults.conftest import Group

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server(model_dir):
    group = Group(model_dir, http=True, extra=("--api-key", "sekret", "--quantization", "none"))
    base = f"http://127.0.0.1:{group.port}"
    sdk = openai.OpenAI(base_url=f"{base}/v1", api_key="sekret", max_retries=0, timeout=300)
    model = sdk.models.list().data[0].id
    yield base, sdk, model
    assert group.close() == 0
    assert group.leftovers() == []


def test_plain_input_is_the_chat_completions_answer(server):
    _, sdk, model = server
    r = sdk.responses.create(model=model, input=QUESTION, max_output_tokens=24, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == model
    chat = sdk.chat.completions.create(model=model, max_tokens=24, temperature=0,
                                       messages=[{"role": "user", "content": QUESTION}])
    assert r.output_text == chat.choices[0].message.content and "Paris" in r.output_text
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.status in ("completed", "incomplete") and r.error is None


def test_instructions_items_and_max_output_tokens(server):
    _, sdk, model = server
    items = [{"role": "user", "content": "My name is Ada."},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Hello, Ada."}]},
             {"role": "user", "content": [{"type": "input_text", "text": "What is my name?"}]}]
    told = sdk.responses.create(model=model, input=items, max_output_tokens=16, temperature=0,
                                instructions="You are a helpful assistant.")
    plain = sdk.responses.create(model=model, input=items, max_output_tokens=16, temperature=0)
    assert told.usage.input_tokens != plain.usage.input_tokens  # the instructions were rendered
    assert told.instructions == "You are a helpful assistant."
    cut = sdk.responses.create(model=model, input=QUESTION, max_output_tokens=3, temperature=0)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3


def test_stream_deltas_equal_the_greedy_response(server):
    _, sdk, model = server
    kw = dict(model=model, input=QUESTION, max_output_tokens=20, temperature=0)
    whole = sdk.responses.create(**kw)
    events = list(sdk.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == f"response.{whole.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    with sdk.responses.stream(**kw) as stream:  # the SDK's stream helper assembles it too
        final = stream.get_final_response()
    assert final.output_text == whole.output_text


def test_json_schema_text_format_gives_json_that_fits(server):
    _, sdk, model = server
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"type": "string", "maxLength": 20}},
              "required": ["city", "country"], "additionalProperties": False}
    r = sdk.responses.create(model=model, input=QUESTION + " Answer in JSON.", temperature=0,
                             max_output_tokens=80, text={"format": {
                                 "type": "json_schema", "name": "capital", "schema": schema,
                                 "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_previous_response_id_continues_the_conversation(server):
    base, sdk, model = server
    first = sdk.responses.create(model=model, input="My name is Ada.", max_output_tokens=12,
                                 temperature=0)
    second = sdk.responses.create(model=model, input="What is my name?", max_output_tokens=12,
                                  temperature=0, previous_response_id=first.id)
    items = [{"role": "user", "content": "My name is Ada."},
             {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": "What is my name?"}]
    sent = sdk.responses.create(model=model, input=items, max_output_tokens=12, temperature=0)
    assert second.previous_response_id == first.id
    assert second.output_text == sent.output_text
    assert second.usage.input_tokens == sent.usage.input_tokens
    with pytest.raises(openai.NotFoundError) as e:
        sdk.responses.create(model=model, input="x", previous_response_id="resp_nope")
    assert e.value.body["code"] == "previous_response_not_found"
    r = httpx.post(f"{base}/v1/responses", headers={"Authorization": "Bearer sekret"},
                   json={"model": model, "input": [{"role": "user", "content": [
                       {"type": "input_image", "image_url": "data:,"}]}]})
    assert r.status_code == 400 and "input_image" in r.json()["error"]["message"]
