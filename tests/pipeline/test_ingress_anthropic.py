"""/v1/messages (Anthropic's Messages API) against a fake engine: the message and its stream
events, the translation into a chat request (system, turns, tool use and results, tool_choice),
stop reasons, errors in Anthropic's shape, x-api-key auth, and that a tool call's stream
assembles to the non-streamed content blocks."""
import asyncio
import json

import pytest

from pagedserve.pipeline.ingress import build_app
from pagedserve.pipeline.ingress.anthropic_protocol import MessagesRequest, to_chat_request
from pagedserve.pipeline.ingress.anthropic_stream import BlockEvents, content_blocks
from pagedserve.pipeline.ingress.chat_output import ChoiceShaper
from pagedserve.pipeline.ingress.errors import APIError
from pagedserve.pipeline.ingress import testing
from pagedserve.pipeline.ingress.testing import make_test_context
from pagedserve.pipeline.ingress.tools import plan_tools

HI = [{"role": "user", "content": "hi"}]
KEY = {"x-api-key": "k"}


def run_with_client(test, **ctx_kwargs):
    testing.run_with_client(test, api_key="k", **ctx_kwargs)


def events_of(text: str) -> list[tuple[str, dict]]:
    """(event name, data) of each SSE block; the name is the data's type, as Anthropic sends."""
    out = []
    for block in text.split("\n\n")[:-1]:
        name_line, data_line = block.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: "), block
        name, data = name_line[len("event: "):], json.loads(data_line[len("data: "):])
        assert data["type"] == name
        out.append((name, data))
    return out


def test_a_message_and_its_stream_carry_the_same_text():
    async def t(client, ctx, engine):
        body = {"model": "tiny", "max_tokens": 5, "messages": HI}
        r = await client.post("/v1/messages", json=body, headers=KEY)
        assert r.status_code == 200
        m = r.json()
        assert m["id"].startswith("msg_") and m["type"] == "message"
        assert m["role"] == "assistant" and m["model"] == "tiny"
        assert m["stop_reason"] == "max_tokens" and m["stop_sequence"] is None
        [block] = m["content"]
        assert block["type"] == "text" and len(block["text"]) == 5
        assert m["usage"] == {"input_tokens": len(engine.submitted[0].prompt_token_ids),
                              "output_tokens": 5}
        s = await client.post("/v1/messages", json={**body, "stream": True},
                              headers={"Authorization": "Bearer k"})
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        events = events_of(s.text)
        names = [n for n, _ in events]
        assert names[:3] == ["message_start", "content_block_start", "ping"]
        assert names[3:-3] == ["content_block_delta"] * 5
        assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
        start = events[0][1]["message"]
        assert start["content"] == [] and start["usage"]["output_tokens"] == 0
        text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
        assert text == block["text"]
        assert events[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
        assert events[-2][1]["usage"] == {"output_tokens": 5}
        assert ctx.admission.in_flight == 0
    run_with_client(t)


def test_system_turns_and_sampling_fields_reach_the_engine():
    async def t(client, ctx, engine):
        body = {"model": "tiny", "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "top_k": 4,
                "metadata": {"user_id": "u1"}, "system": [{"type": "text", "text": "Be brief."}],
                "messages": [{"role": "user", "content": "a"},
                             {"role": "assistant", "content": [{"type": "text", "text": "b"}]},
                             {"role": "user", "content": [{"type": "text", "text": "c"}]}]}
        r = await client.post("/v1/messages", json=body, headers=KEY)
        assert r.status_code == 200, r.text
        sub = engine.submitted[0]
        prompt = ctx.tokenizer.decode(sub.prompt_token_ids)
        assert prompt == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\na<|im_end|>\n"
                          "<|im_start|>assistant\nb<|im_end|>\n<|im_start|>user\nc<|im_end|>\n"
                          "<|im_start|>assistant\n")
        p = sub.params
        assert (p.max_tokens, p.temperature, p.top_p, p.top_k) == (3, 0.5, 0.9, 4)
    run_with_client(t, max_model_len=256)


def test_stop_sequences_and_end_turn():
    async def t(client, ctx, engine):
        body = {"model": "tiny", "max_tokens": 10, "messages": HI}
        full = (await client.post("/v1/messages", json=body, headers=KEY)).json()
        text = full["content"][0]["text"]
        stop = text[3]  # one character: the fake engine holds no text back for a longer one
        cut = (await client.post("/v1/messages", json={**body, "stop_sequences": [stop]},
                                 headers=KEY)).json()
        assert cut["stop_reason"] == "stop_sequence" and cut["stop_sequence"] == stop
        assert cut["content"][0]["text"] == text[:text.index(stop)]
        assert engine.submitted[1].params.stop == [stop]
        streamed = await client.post("/v1/messages", json={**body, "stop_sequences": [stop],
                                                           "stream": True}, headers=KEY)
        delta = [d for n, d in events_of(streamed.text) if n == "message_delta"][0]
        assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}
    run_with_client(t)

    async def eos(client, ctx, engine):
        m = (await client.post("/v1/messages", json={"model": "tiny", "max_tokens": 10,
                                                     "messages": HI}, headers=KEY)).json()
        assert m["stop_reason"] == "end_turn" and len(m["content"][0]["text"]) == 2
    run_with_client(eos, eos_after=2)


@pytest.mark.parametrize("body, status, kind, words", [
    ({"model": "tiny", "messages": HI}, 400, "invalid_request_error", "'max_tokens' is a required"),
    ({"model": "tiny", "max_tokens": 4, "messages": []}, 400, "invalid_request_error", "messages"),
    ({"model": "tiny", "max_tokens": 4, "temperature": 1.5, "messages": HI}, 400,
     "invalid_request_error", "temperature"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "data": "AAAA"}}]}]}, 400,
     "invalid_request_error", "image content blocks are not supported"),
    ({"model": "tiny", "max_tokens": 4, "messages": HI,
      "tools": [{"name": "f", "input_schema": {"type": "object"}}]}, 400,
     "invalid_request_error", "--tool-call-parser"),
    ({"model": "tiny", "max_tokens": 4, "messages": HI,
      "tools": [{"name": "f", "input_schema": {"type": "object"}}],
      "tool_choice": {"type": "any"}}, 400, "invalid_request_error", "does not render tools"),
    ({"model": "tiny", "max_tokens": 10**6, "messages": HI}, 400, "invalid_request_error",
     "maximum context length"),
    ({"model": "nope", "max_tokens": 4, "messages": HI}, 404, "not_found_error", "nope"),
])
def test_errors_are_in_anthropics_shape(body, status, kind, words):
    async def t(client, ctx, engine):
        r = await client.post("/v1/messages", json=body, headers=KEY)
        assert r.status_code == status, r.text
        error = r.json()
        assert set(error) == {"type", "error"} and error["type"] == "error"
        assert error["error"]["type"] == kind and words in error["error"]["message"]
        assert engine.submitted == [] and ctx.admission.in_flight == 0
    run_with_client(t)


def test_api_key_body_limit_and_overload():
    async def t(client, ctx, engine):
        body = {"model": "tiny", "max_tokens": 2, "messages": HI}
        for headers in ({}, {"x-api-key": "bad"}, {"Authorization": "Bearer bad"}):
            r = await client.post("/v1/messages", json=body, headers=headers)
            assert r.status_code == 401
            assert r.json()["error"]["type"] == "authentication_error"
        big = await client.post("/v1/messages", headers=KEY,
                                json={**body, "system": "x" * (1 << 16)})
        assert big.status_code == 413 and big.json()["error"]["type"] == "request_too_large"
        ctx.admission.enter(ctx.admission.max_queued_requests + ctx.admission.max_num_seqs)
        busy = await client.post("/v1/messages", json=body, headers=KEY)
        assert busy.status_code == 503 and "Retry-After" in busy.headers
        assert busy.json()["error"]["type"] == "overloaded_error"
    run_with_client(t)


TOOLS = [{"name": "get_weather", "description": "Weather of a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]


def test_tool_use_and_results_translate_to_the_chat_request():
    req = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 8, "tools": TOOLS, "stop_sequences": ["X"],
        "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "sunny"}]},
                {"type": "text", "text": "And tomorrow?"}]}]})
    chat = to_chat_request(req, tool_call_parser=None)
    msgs = [m.to_template() for m in chat.messages]
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "user"]
    assert msgs[1]["content"] == "Let me look."
    assert msgs[1]["tool_calls"] == [{"id": "toolu_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert msgs[2] == {"role": "tool", "content": "sunny", "tool_call_id": "toolu_1"}
    assert msgs[3]["content"] == "And tomorrow?"
    assert chat.tools == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": TOOLS[0]["input_schema"]}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.parallel_tool_calls is False and chat.stop == ["X"] and chat.max_tokens == 8
    any_choice = to_chat_request(req.model_copy(update={"tool_choice": None}), "hermes")
    assert any_choice.tool_choice == "auto"
    for choice, expected in (({"type": "any"}, "required"), ({"type": "none"}, "none")):
        r = MessagesRequest.model_validate({**req.model_dump(), "tool_choice": choice})
        assert to_chat_request(r, None).tool_choice == expected


@pytest.mark.parametrize("messages, tool_choice, words", [
    ([{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}],
     None, "tool_use block belongs in an assistant message"),
    ([{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "a"}]}],
     None, "tool_result block belongs in a user message"),
    (HI, {"type": "tool", "name": "other"}, "not among the tools"),
    (HI, {"type": "tool"}, "needs the tool's name"),
])
def test_misplaced_blocks_and_unknown_tools_are_refused(messages, tool_choice, words):
    body = {"model": "m", "max_tokens": 4, "messages": messages, "tools": TOOLS}
    if tool_choice:
        body["tool_choice"] = tool_choice
    with pytest.raises(APIError) as e:
        to_chat_request(MessagesRequest.model_validate(body), "hermes")
    assert e.value.status == 400 and words in e.value.message


def test_a_tool_calls_stream_assembles_to_the_messages_blocks():
    chat_tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    plan = plan_tools(chat_tools, "auto", None, "hermes")
    text = ('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>')
    blocks = content_blocks(ChoiceShaper(plan, None).message(text))
    assert [b["type"] for b in blocks] == ["text", "tool_use"]
    assert blocks[1]["name"] == "get_weather" and blocks[1]["input"] == {"city": "Paris"}
    assert blocks[1]["id"].startswith("toolu_")
    shaper, events = ChoiceShaper(plan, None), BlockEvents()
    raw = []
    for i in range(0, len(text), 7):
        for part in shaper.deltas(text[i:i + 7], final=i + 7 >= len(text)):
            raw += events.feed(part)
    raw += events.finish()
    assert shaper.called
    parsed = [json.loads(e.split(b"\ndata: ")[1]) for e in raw]
    started = [p["content_block"] for p in parsed if p["type"] == "content_block_start"]
    assert [b["type"] for b in started] == ["text", "tool_use"]
    assert started[1]["name"] == "get_weather" and started[1]["input"] == {}
    streamed_text = "".join(p["delta"].get("text", "") for p in parsed
                            if p["type"] == "content_block_delta" and p["index"] == 0)
    args = "".join(p["delta"].get("partial_json", "") for p in parsed
                   if p["type"] == "content_block_delta" and p["index"] == 1)
    assert streamed_text == blocks[0]["text"] and json.loads(args) == blocks[1]["input"]
    assert [p["type"] for p in parsed].count("content_block_stop") == 2


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "message"])
def test_a_client_that_goes_away_aborts_its_request(stream):
    from test_ingress_disconnect import FakeConnection, wait_for

    async def main():
        ctx, engine = make_test_context(max_model_len=1024, step_delay=0.002)
        conn = FakeConnection(build_app(ctx), "/v1/messages",
                              {"model": "tiny", "max_tokens": 500, "messages": HI,
                               "stream": stream})
        task = conn.start()
        await wait_for(lambda: conn.chunks >= 3 if stream else engine.running)
        conn.drop()
        await asyncio.wait_for(task, 5)
        assert engine.running == set() and engine.finished == []
        assert engine.aborted == [engine.submitted[0].request_id]
        assert ctx.admission.in_flight == 0
    asyncio.run(main())
