"""The official anthropic SDK against a launched group: /v1/messages (Anthropic's Messages API)
over the chat path, non-streamed and streamed, with Anthropic's errors and x-api-key auth."""
from __future__ import annotations

import anthropic
import httpx
import pytest

from faults.conftest import Group

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# Sampling fields the SDK no longer names as arguments (2.x); the API still reads them
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(model_dir):
    group = Group(model_dir, http=True, extra=("--api-key", "sekret", "--quantization", "none"))
    base = f"http://127.0.0.1:{group.port}"
    sdk = anthropic.Anthropic(base_url=base, api_key="sekret", max_retries=0, timeout=300)
    model = group_model(base)
    yield group, base, sdk, model
    assert group.close() == 0
    assert group.leftovers() == []


def group_model(base: str) -> str:
    r = httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer sekret"})
    return r.json()["data"][0]["id"]


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_plain_message_is_the_chat_completions_answer(server):
    _, base, sdk, model = server
    m = sdk.messages.create(model=model, max_tokens=24, extra_body=GREEDY, messages=QUESTION)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.model == model
    chat = httpx.post(f"{base}/v1/chat/completions", headers={"Authorization": "Bearer sekret"},
                      json={"model": model, "messages": QUESTION, "max_tokens": 24,
                            "temperature": 0}, timeout=300).json()
    assert text_of(m) == chat["choices"][0]["message"]["content"]
    assert "Paris" in text_of(m)
    assert m.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert m.usage.input_tokens > 0 and 0 < m.usage.output_tokens <= 24


def test_system_and_multi_turn(server):
    _, _, sdk, model = server
    messages = [{"role": "user", "content": "My name is Ada."},
                {"role": "assistant", "content": [{"type": "text", "text": "Nice to meet you, Ada."}]},
                {"role": "user", "content": [{"type": "text", "text": "What is my name?"}]}]
    m = sdk.messages.create(model=model, max_tokens=16, extra_body=GREEDY, messages=messages,
                            system=[{"type": "text", "text": "You are a helpful assistant."}])
    plain = sdk.messages.create(model=model, max_tokens=16, extra_body=GREEDY, messages=messages)
    assert m.usage.input_tokens != plain.usage.input_tokens  # the system prompt was rendered
    assert m.content and m.content[0].type == "text"


def test_stop_sequence_and_max_tokens(server):
    _, _, sdk, model = server
    full = sdk.messages.create(model=model, max_tokens=6, extra_body=GREEDY, messages=QUESTION)
    assert full.stop_reason == "max_tokens" and full.usage.output_tokens == 6
    text = text_of(full)
    stop = text.strip().split()[1] if len(text.split()) > 1 else text.strip()[1:3]
    cut = sdk.messages.create(model=model, max_tokens=6, extra_body=GREEDY, messages=QUESTION,
                              stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert text_of(cut) == text[:text.index(stop)]


def test_stream_helper_matches_the_greedy_message(server):
    _, base, sdk, model = server
    kw = dict(model=model, max_tokens=20, extra_body=GREEDY, messages=QUESTION)
    whole = sdk.messages.create(**kw)
    with sdk.messages.stream(**kw) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text_of(whole) == text_of(final)
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    events = [e.type for e in sdk.messages.create(stream=True, **kw)]
    assert events[:3] == ["message_start", "content_block_start", "content_block_delta"]
    raw = httpx.post(f"{base}/v1/messages", headers={"x-api-key": "sekret"},
                     json={**{k: v for k, v in kw.items() if k != "extra_body"}, **GREEDY,
                           "stream": True}, timeout=300).text
    names = [line[len("event: "):] for line in raw.splitlines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "content_block_start", "ping"]  # the SDK skips pings
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_errors_in_anthropics_shape(server):
    _, base, sdk, model = server
    r = httpx.post(f"{base}/v1/messages", headers={"x-api-key": "sekret"},
                   json={"model": model, "messages": QUESTION})
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                   "message": "'max_tokens' is a required field"}}
    bad = anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=model, max_tokens=4, messages=QUESTION)
    assert e.value.status_code == 401 and e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError):
        sdk.messages.create(model="nope", max_tokens=4, messages=QUESTION)
    # SmolLM2's chat template renders no tools: a clear 400, not a silent drop
    with pytest.raises(anthropic.BadRequestError) as e:
        sdk.messages.create(model=model, max_tokens=4, messages=QUESTION,
                            tools=[{"name": "get_weather", "input_schema": {"type": "object"}}],
                            tool_choice={"type": "any"})
    assert "does not render tools" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        sdk.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}]}])
    assert "image" in e.value.body["error"]["message"]
    ok = sdk.messages.create(model=model, max_tokens=2, messages=QUESTION)  # still serving
    assert ok.usage.output_tokens == 2
