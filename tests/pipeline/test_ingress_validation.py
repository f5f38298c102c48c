"""Every bad request of issue 7 gets an OpenAI error body with the right status, never a 500,
and the next good request still succeeds."""
import asyncio
import json

import httpx
import pytest

from pagedserve.pipeline.ingress import build_app
from pagedserve.pipeline.ingress.testing import make_test_context

CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]
GOOD = {COMPL: {"model": "tiny", "prompt": "Hello", "max_tokens": 3},
        CHAT: {"model": "tiny", "messages": MSGS, "max_tokens": 3}}

# (name, path, body (dict/list/...) or raw bytes, expected status, expected param or None,
#  words the message must contain)
CASES = [
    ("malformed json", COMPL, b'{"prompt": "x",', 400, None, "not valid JSON"),
    ("empty body", CHAT, b"", 400, None, "not valid JSON"),
    ("body is a list", COMPL, [1, 2], 400, None, "JSON object"),
    ("body is a number", CHAT, 5, 400, None, "JSON object"),
    ("body is null", COMPL, None, 400, None, "JSON object"),
    ("missing prompt", COMPL, {"model": "tiny"}, 400, "prompt", "required"),
    ("missing messages", CHAT, {"model": "tiny"}, 400, "messages", "required"),
    ("empty prompt", COMPL, {"prompt": ""}, 400, "prompt", "empty"),
    ("empty prompt list", COMPL, {"prompt": []}, 400, "prompt", "empty"),
    ("empty string in prompt list", COMPL, {"prompt": ["a", ""]}, 400, "prompt", "empty"),
    ("empty token list", COMPL, {"prompt": [[1, 2], []]}, 400, "prompt", "empty"),
    ("empty messages", CHAT, {"messages": []}, 400, "messages", "at least 1"),
    ("unknown model", COMPL, {"model": "gpt-9", "prompt": "x"}, 404, "model", "gpt-9"),
    ("unknown model chat", CHAT, {"model": "gpt-9", "messages": MSGS}, 404, "model", "does not exist"),
    ("prompt over max model len", COMPL, {"prompt": "x" * 80}, 400, "prompt",
     "maximum context length is 64 tokens. However, your request has 80 input tokens"),
    ("messages over max model len", CHAT, {"messages": [{"role": "user", "content": "x" * 80}]},
     400, "messages", "maximum context length is 64 tokens"),
    ("prompt + max_tokens too long", COMPL, {"prompt": "x" * 40, "max_tokens": 30}, 400,
     "max_tokens", "you requested 70 tokens (40 in the input, 30 in the completion)"),
    ("chat + max_completion_tokens too long", CHAT,
     {"messages": MSGS, "max_completion_tokens": 60}, 400, "max_completion_tokens",
     "maximum context length is 64 tokens"),
    ("max_tokens 0", COMPL, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "at least 1"),
    ("max_tokens negative", CHAT, {"messages": MSGS, "max_tokens": -5}, 400, "max_tokens", "at least 1"),
    ("max_completion_tokens 0", CHAT, {"messages": MSGS, "max_completion_tokens": 0}, 400,
     "max_completion_tokens", "at least 1"),
    ("temperature < 0", COMPL, {"prompt": "x", "temperature": -0.1}, 400, "temperature", "[0, 2]"),
    ("temperature > 2", CHAT, {"messages": MSGS, "temperature": 2.5}, 400, "temperature", "[0, 2]"),
    ("temperature NaN", COMPL, b'{"prompt": "x", "temperature": NaN}', 400, "temperature", "finite"),
    ("top_p 0", COMPL, {"prompt": "x", "top_p": 0}, 400, "top_p", "(0, 1]"),
    ("top_p > 1", CHAT, {"messages": MSGS, "top_p": 1.5}, 400, "top_p", "(0, 1]"),
    ("top_k 0", COMPL, {"prompt": "x", "top_k": 0}, 400, "top_k", "-1"),
    ("top_k < -1", CHAT, {"messages": MSGS, "top_k": -2}, 400, "top_k", "-1"),
    ("n 0", COMPL, {"prompt": "x", "n": 0}, 400, "n", "between 1 and"),
    ("n over the limit", CHAT, {"messages": MSGS, "n": 1000}, 400, "n", "between 1 and 128"),
    ("top_logprobs over 20", CHAT, {"messages": MSGS, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs", "20"),
    ("top_logprobs without logprobs", CHAT, {"messages": MSGS, "top_logprobs": 2}, 400,
     "top_logprobs", "logprobs"),
    ("logprobs over 20", COMPL, {"prompt": "x", "logprobs": 21}, 400, "logprobs", "20"),
    ("seed over int64", COMPL, {"prompt": "x", "seed": 2**63}, 400, "seed", "64-bit"),
    ("seed under int64", CHAT, {"messages": MSGS, "seed": -(2**63) - 1}, 400, "seed", "64-bit"),
    ("presence_penalty > 2", COMPL, {"prompt": "x", "presence_penalty": 2.5}, 400,
     "presence_penalty", "[-2, 2]"),
    ("frequency_penalty < -2", CHAT, {"messages": MSGS, "frequency_penalty": -3}, 400,
     "frequency_penalty", "[-2, 2]"),
    ("stop_token_ids outside vocab", COMPL, {"prompt": "x", "stop_token_ids": [100000]}, 400,
     "stop_token_ids", "outside the vocabulary"),
    ("token prompt outside vocab", COMPL, {"prompt": [1, 100000]}, 400, "prompt",
     "token id 100000, outside the vocabulary"),
    ("negative token id", COMPL, {"prompt": [[5, -1]]}, 400, "prompt", "outside the vocabulary"),
    ("stream_options without stream", CHAT,
     {"messages": MSGS, "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    ("temperature as string", COMPL, {"prompt": "x", "temperature": "hot"}, 400, "temperature",
     "valid number"),
    ("max_tokens as string", CHAT, {"messages": MSGS, "max_tokens": "5"}, 400, "max_tokens",
     "valid integer"),
    ("n as float", COMPL, {"prompt": "x", "n": 1.5}, 400, "n", "valid integer"),
    ("stream as string", CHAT, {"messages": MSGS, "stream": "yes"}, 400, "stream", "boolean"),
    ("messages as string", CHAT, {"messages": "hi"}, 400, "messages", "valid list"),
    ("unknown role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages.0.role", "system"),
    ("stop as number", COMPL, {"prompt": "x", "stop": 5}, 400, "stop", "string or a list"),
    ("prompt as number", COMPL, {"prompt": 5}, 400, "prompt", "list of token ids"),
    ("prompt mixing types", COMPL, {"prompt": [1, "a"]}, 400, "prompt", "list of token ids"),
    ("best_of above n", COMPL, {"prompt": "x", "best_of": 3}, 400, "best_of", "not supported"),
    ("max_tokens 0 without echo", COMPL, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens",
     "needs echo"),
    ("max_tokens negative with echo", COMPL, {"prompt": "x", "max_tokens": -1, "echo": True},
     400, "max_tokens", "at least 0"),
    ("echo with logprobs over the limit", COMPL, {"prompt": "xy", "echo": True, "logprobs": 21},
     400, "logprobs", "between 0 and 20"),
    ("prompt_logprobs over the limit", COMPL, {"prompt": "xy", "prompt_logprobs": 21}, 400,
     "prompt_logprobs", "between 0 and 20"),
    ("prompt_logprobs negative", COMPL, {"prompt": "xy", "prompt_logprobs": -1}, 400,
     "prompt_logprobs", "between 0 and 20"),
    ("prompt_logprobs as string", COMPL, {"prompt": "xy", "prompt_logprobs": "2"}, 400,
     "prompt_logprobs", "integer"),
    # logit_bias: token ids as string keys (OpenAI's shape), each id in the vocabulary
    ("logit_bias key not an integer", COMPL, {"prompt": "x", "logit_bias": {"a": 1}}, 400,
     "logit_bias", "not a token id"),
    ("logit_bias negative key", CHAT, {"messages": MSGS, "logit_bias": {"-1": 1}}, 400,
     "logit_bias", "not a token id"),
    ("logit_bias key outside vocab", COMPL, {"prompt": "x", "logit_bias": {"100000": 1}}, 400,
     "logit_bias", "outside the vocabulary"),
    ("logit_bias value over 100", CHAT, {"messages": MSGS, "logit_bias": {"5": 100.5}}, 400,
     "logit_bias", "[-100, 100]"),
    ("logit_bias value as string", COMPL, {"prompt": "x", "logit_bias": {"5": "1"}}, 400,
     "logit_bias.5", "valid number"),
    # found by the fuzz (scripts/fuzz_api.py): each was a 500
    ("lone surrogate in prompt", COMPL, b'{"prompt": "a\\ud800"}', 400, "prompt",
     "lone UTF-16 surrogate"),
    ("lone surrogate in model", COMPL, b'{"model": "\\udc00", "prompt": "x"}', 400, "model",
     "lone UTF-16 surrogate"),
    ("lone surrogate in chat content", CHAT,
     b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400, "messages.0.content",
     "lone UTF-16 surrogate"),
    ("lone surrogate in stop", COMPL, b'{"prompt": "x", "stop": ["\\ud800"]}', 400, "stop.0",
     "lone UTF-16 surrogate"),
    ("UTF-8-encoded surrogate", COMPL, b'{"prompt": "\xed\xa0\x80"}', 400, None, "not valid JSON"),
    ("body nested 5000 deep", COMPL, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, None,
     "at most 64 levels"),
    ("top_k over int64", COMPL, {"prompt": "x", "top_k": 2**64}, 400, "top_k", "64-bit"),
    ("priority over int64", CHAT, {"messages": MSGS, "priority": -(2**70)}, 400, "priority",
     "64-bit"),
    ("batch larger than the engine's queue", COMPL, {"prompt": ["a"] * 9}, 400, "prompt",
     "queues at most 8 requests (--max-queued-requests)"),
    ("a template of the client's own", CHAT,
     {"messages": MSGS, "chat_template_kwargs": {"chat_template": "{{ 'x' * 10 }}"}}, 400,
     "chat_template_kwargs", "may not set chat_template"),
]


def _send(client, path, body):
    if isinstance(body, bytes):
        return client.post(path, content=body, headers={"content-type": "application/json"})
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


async def _case(path, body, status, param, words):
    ctx, engine = make_test_context()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(ctx)),
                                 base_url="http://test") as client:
        r = await _send(client, path, body)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "invalid_request_error"
        assert err["param"] == param
        assert words in err["message"], err["message"]
        assert engine.submitted == []  # nothing reached the engine
        assert ctx.admission.in_flight == 0
        good = await _send(client, path, GOOD[path])
        assert good.status_code == 200, good.text
        assert good.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("name,path,body,status,param,words", CASES, ids=[c[0] for c in CASES])
def test_bad_request_then_good(name, path, body, status, param, words):
    asyncio.run(_case(path, body, status, param, words))


def test_body_over_size_limit_is_413_then_good():
    async def run():
        ctx, engine = make_test_context(max_request_bytes=1000)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(ctx)),
                                     base_url="http://test") as client:
            r = await client.post(COMPL, json={"prompt": "x" * 2000})
            assert r.status_code == 413
            assert r.json()["error"]["code"] == "request_too_large"

            async def chunks():  # no Content-Length: the limit applies while reading
                for _ in range(10):
                    yield b" " * 200
            r = await client.post(COMPL, content=chunks())
            assert r.status_code == 413
            assert (await client.post(COMPL, json=GOOD[COMPL])).status_code == 200
    asyncio.run(run())


ACCEPTED_UNUSED = [
    (COMPL, {"prompt": "x", "best_of": 1, "logprobs": None, "user": "u1", "suffix": None,
             "logit_bias": {}, "echo": False, "stream_options": None, "unknown_field": 1}),
    (CHAT, {"messages": MSGS, "best_of": 1, "logprobs": None, "top_logprobs": None,
            "user": "u1", "tool_choice": "none", "response_format": {"type": "text"},
            "parallel_tool_calls": False, "n": None}),
]


@pytest.mark.parametrize("path,extra", ACCEPTED_UNUSED, ids=["completions", "chat"])
def test_fields_the_engine_does_not_use_are_accepted(path, extra):
    async def run():
        ctx, engine = make_test_context()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(ctx)),
                                     base_url="http://test") as client:
            r = await client.post(path, json={"max_tokens": 2, **extra})
            assert r.status_code == 200, r.text
            assert engine.submitted[0].params.logprobs is None
    asyncio.run(run())
