"""The OpenAI-compatible routes against a fake engine: response shapes, streaming, n, echo,
logprobs, finish reasons, auth, models/health/version."""
import json

import pytest

from pagedserve.pipeline.ingress.testing import TOY_ALPHABET, run_with_client

MSGS = [{"role": "user", "content": "hi"}]


def sse_events(text: str) -> list:
    """The JSON payloads of an SSE body; asserts the framing and the final [DONE]."""
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events.pop() == "[DONE]"
    return events


def toy_text(prompt_ids, n_tokens, index=0, seed=None):
    start = sum(prompt_ids) + 3 * index + (seed or 0)
    return "".join(TOY_ALPHABET[(start + s) % len(TOY_ALPHABET)] for s in range(n_tokens))


HELLO = list(b"Hello")  # the tiny tokenizer has one token per byte


def test_completion_text_usage_and_length_finish():
    async def t(client, ctx, engine):
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "Hello",
                                                       "max_tokens": 5, "seed": 3})
        assert r.status_code == 200
        body = r.json()
        assert body["object"] == "text_completion" and body["model"] == "tiny"
        assert body["id"].startswith("cmpl-")
        [choice] = body["choices"]
        assert choice["text"] == toy_text(HELLO, 5, seed=3)
        assert choice["finish_reason"] == "length" and choice["index"] == 0
        assert choice["logprobs"] is None
        assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}
        sub = engine.submitted[0]
        assert sub.prompt_token_ids == HELLO
        assert sub.params.max_tokens == 5 and sub.params.seed == 3
        assert ctx.admission.in_flight == 0
    run_with_client(t)


def test_completion_default_max_tokens_is_16_clamped_to_context():
    async def t(client, ctx, engine):
        r = await client.post("/v1/completions", json={"prompt": "Hello"})
        assert r.json()["usage"]["completion_tokens"] == 16
        r = await client.post("/v1/completions", json={"prompt": "x" * 60})
        assert r.status_code == 200
        assert r.json()["usage"]["completion_tokens"] == 4  # 64 - 60
    run_with_client(t)


def test_completion_stop_finish_reason_eos_and_stop_string():
    async def t(client, ctx, engine):
        r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 10})
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert choice["stop_reason"] == engine.eos_token_id
        assert choice["text"] == toy_text(HELLO, 2)
        r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 10,
                                                       "ignore_eos": True})
        assert r.json()["choices"][0]["finish_reason"] == "length"
        expected = toy_text(HELLO, 2)
        stop = expected[1]
        r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 10,
                                                       "ignore_eos": True, "stop": stop})
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
        assert choice["text"] == expected[0]
        assert engine.submitted[-1].params.stop == [stop]
    run_with_client(t, eos_after=2)


def test_completion_token_id_prompts_batch_and_echo():
    async def t(client, ctx, engine):
        r = await client.post("/v1/completions", json={"prompt": [HELLO, list(b"Hi")], "n": 2,
                                                       "max_tokens": 3, "echo": True})
        body = r.json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
        assert body["choices"][0]["text"] == "Hello" + toy_text(HELLO, 3, 0)
        assert body["choices"][1]["text"] == "Hello" + toy_text(HELLO, 3, 1)
        assert body["choices"][3]["text"] == "Hi" + toy_text(list(b"Hi"), 3, 1)
        assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 12, "total_tokens": 19}
        assert len(engine.submitted) == 2
        assert all(s.params.n == 2 for s in engine.submitted)
    run_with_client(t)


def test_completion_logprobs_shape():
    async def t(client, ctx, engine):
        r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3,
                                                       "logprobs": 2})
        lp = r.json()["choices"][0]["logprobs"]
        text = toy_text(HELLO, 3)
        assert lp["tokens"] == list(text)
        assert lp["token_logprobs"] == [-0.5] * 3
        assert lp["text_offset"] == [0, 1, 2]
        assert len(lp["top_logprobs"]) == 3
        assert lp["top_logprobs"][0][text[0]] == -0.5 and len(lp["top_logprobs"][0]) == 2
        assert engine.submitted[0].params.logprobs == 2
    run_with_client(t)


def test_chat_completion_shape_template_and_logprobs():
    async def t(client, ctx, engine):
        r = await client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "system", "content": "be brief"}] + MSGS,
            "max_completion_tokens": 4, "logprobs": True, "top_logprobs": 2, "n": 2})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
        prompt = engine.submitted[0].prompt_token_ids
        assert ctx.tokenizer.decode(prompt) == ("<|im_start|>system\nbe brief<|im_end|>\n"
                                                "<|im_start|>user\nhi<|im_end|>\n"
                                                "<|im_start|>assistant\n")
        assert engine.submitted[0].params.logprobs == 2
        assert [c["index"] for c in body["choices"]] == [0, 1]
        for c in body["choices"]:
            assert c["message"] == {"role": "assistant", "content": toy_text(prompt, 4, c["index"])}
            assert c["finish_reason"] == "length"
            content = c["logprobs"]["content"]
            assert len(content) == 4
            first = content[0]
            assert first["token"] == c["message"]["content"][0]
            assert first["bytes"] == list(first["token"].encode())
            assert first["logprob"] == -0.5
            assert [x["logprob"] for x in first["top_logprobs"]] == [-0.5, -2.0]
            assert first["top_logprobs"][1]["bytes"] == [200]
        assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 8,
                                 "total_tokens": len(prompt) + 8}
    run_with_client(t)


def test_chat_default_max_tokens_fills_the_context():
    async def t(client, ctx, engine):
        r = await client.post("/v1/chat/completions", json={"messages": MSGS})
        prompt_len = len(engine.submitted[0].prompt_token_ids)
        assert engine.submitted[0].params.max_tokens == 64 - prompt_len
        assert r.json()["usage"]["completion_tokens"] == 64 - prompt_len
    run_with_client(t)


def test_completion_stream_with_usage():
    async def t(client, ctx, engine):
        r = await client.post("/v1/completions", json={
            "prompt": "Hello", "max_tokens": 3, "stream": True, "n": 2,
            "stream_options": {"include_usage": True}})
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.text)
        *chunks, final = events
        assert final["choices"] == []
        assert final["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}
        assert all(c["usage"] is None and c["object"] == "text_completion" for c in chunks)
        for index in (0, 1):
            mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
            assert "".join(c["text"] for c in mine) == toy_text(HELLO, 3, index)
            assert [c["finish_reason"] for c in mine] == [None, None, "length"]
        assert len({c["id"] for c in events}) == 1
    run_with_client(t)


def test_completion_stream_without_usage_and_with_echo_logprobs_chunks():
    async def t(client, ctx, engine):
        r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2,
                                                       "stream": True, "echo": True})
        chunks = sse_events(r.text)
        assert all("usage" not in c for c in chunks)
        assert chunks[0]["choices"][0]["text"] == "Hello" + toy_text(HELLO, 1)
        r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2,
                                                       "stream": True, "logprobs": 0})
        chunks = sse_events(r.text)
        offsets = [c["choices"][0]["logprobs"]["text_offset"] for c in chunks]
        assert offsets == [[0], [1]]
    run_with_client(t)


def test_chat_stream_role_first_then_content_and_usage():
    async def t(client, ctx, engine):
        r = await client.post("/v1/chat/completions", json={
            "messages": MSGS, "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}, "logprobs": True})
        events = sse_events(r.text)
        assert all(e["object"] == "chat.completion.chunk" for e in events)
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        content_chunks = [e["choices"][0] for e in events[1:-1]]
        prompt = engine.submitted[0].prompt_token_ids
        assert "".join(c["delta"].get("content", "") for c in content_chunks) == toy_text(prompt, 3)
        assert [c["finish_reason"] for c in content_chunks] == [None, None, "length"]
        assert all(len(c["logprobs"]["content"]) == 1 for c in content_chunks)
        assert events[-1]["choices"] == []
        assert events[-1]["usage"]["completion_tokens"] == 3
    run_with_client(t)


def test_priority_and_cache_salt_reach_the_engine():
    async def t(client, ctx, engine):
        await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1,
                                                   "priority": 5, "cache_salt": "s"})
        assert (engine.submitted[0].priority, engine.submitted[0].cache_salt) == (5, "s")
    run_with_client(t)


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "x"}),
                                       ("/v1/chat/completions", {"messages": MSGS})])
def test_logit_bias_reaches_the_engine_with_integer_token_ids(path, body):
    """OpenAI sends token ids as JSON object keys (strings); the engine gets ints."""
    async def t(client, ctx, engine):
        r = await client.post(path, json={**body, "max_tokens": 1,
                                          "logit_bias": {"5": 10, "0258": -100.0, "7": 0.5}})
        assert r.status_code == 200, r.text
        assert engine.submitted[0].params.logit_bias == {5: 10.0, 258: -100.0, 7: 0.5}
    run_with_client(t)


@pytest.mark.parametrize("header", [None, "Bearer wrong", "Basic sekrit", "sekrit"])
def test_api_key_required_on_v1(header):
    async def t(client, ctx, engine):
        headers = {"Authorization": header} if header else {}
        for method, path, body in (("POST", "/v1/completions", {"prompt": "x"}),
                                   ("POST", "/v1/chat/completions", {"messages": MSGS}),
                                   ("GET", "/v1/models", None)):
            r = await client.request(method, path, json=body, headers=headers)
            assert r.status_code == 401
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert engine.submitted == []
        assert (await client.get("/health")).status_code == 200  # not under /v1
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1},
                              headers={"Authorization": "Bearer sekrit"})
        assert r.status_code == 200
    run_with_client(t, api_key="sekrit")


def test_models_version_health():
    async def t(client, ctx, engine):
        models = (await client.get("/v1/models")).json()
        assert models["object"] == "list"
        assert [m["id"] for m in models["data"]] == ["tiny"]
        assert models["data"][0]["max_model_len"] == 64
        assert "version" in (await client.get("/version")).json()
        assert (await client.get("/health")).status_code == 200
        engine.healthy = False
        r = await client.get("/health")
        assert r.status_code == 503 and "error" in r.json()
    run_with_client(t)


def test_unknown_route_is_openai_shaped_404():
    async def t(client, ctx, engine):
        r = await client.post("/v1/audio/speech", json={})
        assert r.status_code == 404 and "message" in r.json()["error"]
    run_with_client(t)
