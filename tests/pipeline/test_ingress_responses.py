"""/v1/responses (OpenAI's Responses API) against a fake engine: the response object and its
stream events, the translation of input items into a chat request (instructions, messages,
function calls and outputs, tools, tool_choice, text.format), previous_response_id from the
ingress's store, errors in OpenAI's shape, and that a tool call's stream assembles to the
non-streamed output items."""
import asyncio
import json

import pytest
from openai.types.responses import Response as SDKResponse

from pagedserve.pipeline.ingress import build_app
from pagedserve.pipeline.ingress.chat_output import ChoiceShaper
from pagedserve.pipeline.ingress.errors import APIError
from pagedserve.pipeline.ingress.responses_protocol import (ResponsesRequest, input_items,
                                                            to_chat_request)
from pagedserve.pipeline.ingress.responses_store import ResponseStore
from pagedserve.pipeline.ingress.responses_stream import OutputEvents, output_items
from pagedserve.pipeline.ingress import testing
from pagedserve.pipeline.ingress.testing import make_test_context
from pagedserve.pipeline.ingress.tools import plan_tools

KEY = {"Authorization": "Bearer k"}


def run_with_client(test, **ctx_kwargs):
    testing.run_with_client(test, api_key="k", **ctx_kwargs)


def events_of(text: str) -> list[tuple[str, dict]]:
    """(event name, data) of each SSE block, checking the name and the sequence numbers."""
    out = []
    for block in text.split("\n\n")[:-1]:
        name_line, data_line = block.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: "), block
        name, data = name_line[len("event: "):], json.loads(data_line[len("data: "):])
        assert data["type"] == name and data["sequence_number"] == len(out)
        out.append((name, data))
    return out


def test_a_response_and_its_stream_carry_the_same_text():
    async def t(client, ctx, engine):
        body = {"model": "tiny", "input": "hi", "max_output_tokens": 5}
        r = await client.post("/v1/responses", json=body, headers=KEY)
        assert r.status_code == 200, r.text
        resp = r.json()
        sdk = SDKResponse.model_validate(resp)  # the openai SDK reads it
        assert resp["id"].startswith("resp_") and resp["object"] == "response"
        assert resp["status"] == "incomplete"
        assert resp["incomplete_details"] == {"reason": "max_output_tokens"}
        [item] = resp["output"]
        assert item["type"] == "message" and item["id"].startswith("msg_")
        assert item["status"] == "completed" and len(sdk.output_text) == 5
        assert resp["usage"]["input_tokens"] == len(engine.submitted[0].prompt_token_ids)
        assert resp["usage"]["output_tokens"] == 5 and resp["usage"]["total_tokens"] == \
            resp["usage"]["input_tokens"] + 5
        s = await client.post("/v1/responses", json={**body, "stream": True}, headers=KEY)
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        events = events_of(s.text)
        names = [n for n, _ in events]
        assert names[:4] == ["response.created", "response.in_progress",
                             "response.output_item.added", "response.content_part.added"]
        assert names[4:-4] == ["response.output_text.delta"] * 5
        assert names[-4:] == ["response.output_text.done", "response.content_part.done",
                              "response.output_item.done", "response.incomplete"]
        assert events[0][1]["response"]["status"] == "in_progress"
        text = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
        assert text == sdk.output_text == events[-4][1]["text"]
        final = SDKResponse.model_validate(events[-1][1]["response"])
        assert final.output_text == text and final.usage.output_tokens == 5
        assert ctx.admission.in_flight == 0
    run_with_client(t)


def test_instructions_items_and_sampling_fields_reach_the_engine():
    async def t(client, ctx, engine):
        body = {"model": "tiny", "max_output_tokens": 3, "temperature": 0.5, "top_p": 0.9,
                "instructions": "Be brief.", "metadata": {"k": "v"}, "user": "u", "store": True,
                "input": [{"role": "user", "content": "a"},
                          {"type": "message", "role": "assistant",
                           "content": [{"type": "output_text", "text": "b"}]},
                          {"role": "user", "content": [{"type": "input_text", "text": "c"}]}]}
        r = await client.post("/v1/responses", json=body, headers=KEY)
        assert r.status_code == 200, r.text
        sub = engine.submitted[0]
        assert ctx.tokenizer.decode(sub.prompt_token_ids) == (
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\na<|im_end|>\n"
            "<|im_start|>assistant\nb<|im_end|>\n<|im_start|>user\nc<|im_end|>\n"
            "<|im_start|>assistant\n")
        p = sub.params
        assert (p.max_tokens, p.temperature, p.top_p) == (3, 0.5, 0.9)
        resp = r.json()
        assert resp["instructions"] == "Be brief." and resp["temperature"] == 0.5
        assert resp["metadata"] == {"k": "v"} and resp["text"] == {"format": {"type": "text"}}
    run_with_client(t, max_model_len=256)


def test_previous_response_id_continues_the_conversation():
    async def t(client, ctx, engine):
        first = (await client.post("/v1/responses", headers=KEY, json={
            "model": "tiny", "input": "a", "max_output_tokens": 2, "instructions": "S"})).json()
        answer = first["output"][0]["content"][0]["text"]
        r = await client.post("/v1/responses", headers=KEY, json={
            "model": "tiny", "input": "c", "max_output_tokens": 2, "stream": True,
            "previous_response_id": first["id"]})
        assert r.status_code == 200, r.text
        assert ctx.tokenizer.decode(engine.submitted[1].prompt_token_ids) == (
            f"<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n"
            "<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n")  # instructions not kept
        second = events_of(r.text)[-1][1]["response"]
        assert second["previous_response_id"] == first["id"]
        third = await client.post("/v1/responses", headers=KEY, json={
            "model": "tiny", "input": "e", "max_output_tokens": 2,
            "previous_response_id": second["id"]})
        assert third.status_code == 200 and "\nc<|im_end|>" in ctx.tokenizer.decode(
            engine.submitted[2].prompt_token_ids)
        unkept = (await client.post("/v1/responses", headers=KEY, json={
            "model": "tiny", "input": "a", "max_output_tokens": 2, "store": False})).json()
        assert unkept["store"] is False
        assert (await client.post("/v1/responses", headers=KEY, json={
            "model": "tiny", "input": "c", "previous_response_id": unkept["id"]})).status_code \
            == 404
        missing = await client.post("/v1/responses", headers=KEY, json={
            "model": "tiny", "input": "e", "previous_response_id": "resp_nope"})
        assert missing.status_code == 404
        error = missing.json()["error"]
        assert error["code"] == "previous_response_not_found"
        assert error["param"] == "previous_response_id"
    run_with_client(t, max_model_len=256)


def test_the_store_keeps_the_last_n_and_bounds_each_entry():
    store = ResponseStore(max_bytes=100, capacity=2)
    for name in ("a", "b", "c"):
        store.put(name, [{"type": "message", "role": "user", "content": name}])
    assert len(store) == 2 and store.get("b")[0]["content"] == "b"
    with pytest.raises(APIError) as gone:
        store.get("a")
    assert gone.value.status == 404 and gone.value.code == "previous_response_not_found"
    store.put("d", [{"type": "message", "role": "user", "content": "x" * 200}])
    with pytest.raises(APIError) as big:
        store.get("d")
    assert big.value.status == 400 and "--max-request-bytes (100)" in big.value.message
    with pytest.raises(APIError):  # "c" was the least recently used: dropped for "d"
        store.get("c")
    assert store.get("b")


@pytest.mark.parametrize("body, status, param, words", [
    ({"model": "tiny"}, 400, "input", "'input' is a required"),
    ({"model": "tiny", "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:,"}]}]}, 400, "input.0.content.0",
     "input_image content is not supported"),
    ({"model": "tiny", "input": [{"type": "reasoning", "summary": []}]}, 400, "input.0.type",
     "'reasoning' are not supported"),
    ({"model": "tiny", "input": [{"role": "robot", "content": "x"}]}, 400, "input.0.role", "role"),
    ({"model": "tiny", "input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools.0.type",
     "only function tools"),
    ({"model": "tiny", "input": "hi", "text": {"format": {"type": "json_schema"}}}, 400,
     "text.format.schema", "needs its schema"),
    ({"model": "tiny", "input": "hi", "tool_choice": {"type": "file_search"}}, 400,
     "tool_choice", "tool_choice must be"),
    ({"model": "tiny", "input": "hi", "max_output_tokens": 10**6}, 400, "max_output_tokens",
     "maximum context length"),
    ({"model": "tiny", "input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens",
     "max_output_tokens must be at least 1"),
    ({"model": "tiny", "input": []}, 400, "input", "input: list should have at least 1 item"),
    ({"model": "nope", "input": "hi"}, 404, None, "nope"),
])
def test_errors_are_in_openais_shape(body, status, param, words):
    async def t(client, ctx, engine):
        r = await client.post("/v1/responses", json=body, headers=KEY)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert words in error["message"]
        if param is not None:
            assert error["param"] == param
        assert engine.submitted == [] and ctx.admission.in_flight == 0
    run_with_client(t)


def test_api_key_and_body_limit():
    async def t(client, ctx, engine):
        body = {"model": "tiny", "input": "hi", "max_output_tokens": 2}
        assert (await client.post("/v1/responses", json=body)).status_code == 401
        big = await client.post("/v1/responses", headers=KEY, json={**body, "input": "x" * 70000})
        assert big.status_code == 413 and "error" in big.json()
    run_with_client(t)


TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
          "strict": True}]


def test_function_items_tools_and_formats_translate_to_the_chat_request():
    req = ResponsesRequest.model_validate({
        "model": "m", "max_output_tokens": 8, "tools": TOOLS, "parallel_tool_calls": False,
        "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_schema", "name": "w", "strict": True,
                            "schema": {"type": "object"}}},
        "input": [
            {"role": "developer", "content": "Use tools."},
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather",
             "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]})
    chat = to_chat_request(req, input_items(req))
    msgs = [m.to_template() for m in chat.messages]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool"]
    assert msgs[2]["tool_calls"] == [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert msgs[3] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert chat.tools == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": TOOLS[0]["parameters"]}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.parallel_tool_calls is False and chat.max_tokens == 8
    assert chat.response_format == {"type": "json_schema", "json_schema": {
        "name": "w", "schema": {"type": "object"}, "strict": True}}
    for fmt, expected in (({"type": "json_object"}, {"type": "json_object"}),
                          ({"type": "text"}, None)):
        r = ResponsesRequest.model_validate({"model": "m", "input": "x", "text": {"format": fmt}})
        assert to_chat_request(r, input_items(r)).response_format == expected


def test_a_tool_calls_stream_assembles_to_the_output_items():
    chat_tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    plan = plan_tools(chat_tools, "auto", None, "hermes")
    text = ('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>')
    items = output_items(ChoiceShaper(plan, None).message(text), "msg_1")
    assert [i["type"] for i in items] == ["message", "function_call"]
    call = items[1]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
    assert call["status"] == "completed"
    shaper, events = ChoiceShaper(plan, None), OutputEvents("msg_1")
    raw = []
    for i in range(0, len(text), 7):
        for part in shaper.deltas(text[i:i + 7], final=i + 7 >= len(text)):
            raw += events.feed(part)
    raw += events.finish()
    parsed = [json.loads(e.split(b"\ndata: ")[1]) for e in raw]
    assert [p["sequence_number"] for p in parsed] == list(range(len(parsed)))
    added = [p["item"] for p in parsed if p["type"] == "response.output_item.added"]
    assert [i["type"] for i in added] == ["message", "function_call"]
    assert added[1]["arguments"] == "" and added[1]["status"] == "in_progress"
    args = "".join(p["delta"] for p in parsed
                   if p["type"] == "response.function_call_arguments.delta")
    done = [p for p in parsed if p["type"] == "response.function_call_arguments.done"]
    assert json.loads(args) == {"city": "Paris"} and done[0]["arguments"] == args
    streamed = events.output
    assert streamed[0]["content"] == items[0]["content"]
    assert json.loads(streamed[1]["arguments"]) == json.loads(call["arguments"])
    assert streamed[1]["name"] == call["name"] and streamed[1]["status"] == "completed"


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "response"])
def test_a_client_that_goes_away_aborts_its_request(stream):
    from test_ingress_disconnect import FakeConnection, wait_for

    async def main():
        ctx, engine = make_test_context(max_model_len=1024, step_delay=0.002)
        conn = FakeConnection(build_app(ctx), "/v1/responses",
                              {"model": "tiny", "max_output_tokens": 500, "input": "hi",
                               "stream": stream})
        task = conn.start()
        await wait_for(lambda: conn.chunks >= 3 if stream else engine.running)
        conn.drop()
        await asyncio.wait_for(task, 5)
        assert engine.running == set() and engine.finished == []
        assert engine.aborted == [engine.submitted[0].request_id]
        assert ctx.admission.in_flight == 0
    asyncio.run(main())
