"""/v1/messages (Anthropic's API) through the router over fake replicas: x-api-key accepted,
the router's own refusals in Anthropic's shape, a message and a stream passed through as the
replica sent them, a 503 retried on the other replica, a broken stream ended with an error
event, and the key charged the usage the answer reports."""
import asyncio
import json

import httpx

from pagedserve.pipeline.router.app import build_router_app
from pagedserve.pipeline.router.passthrough import StreamUsage
from test_router_resume import Broken, make_service

BODY = {"model": "m", "max_tokens": 8, "system": "Be brief.",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
MESSAGE = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
           "content": [{"type": "text", "text": "hello"}], "stop_reason": "end_turn",
           "stop_sequence": None, "usage": {"input_tokens": 7, "output_tokens": 2}}


def anthropic_sse(events):
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)


STREAM = [{"type": "message_start", "message": {**MESSAGE, "content": [], "stop_reason": None,
                                                "usage": {"input_tokens": 7, "output_tokens": 0}}},
          {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
          {"type": "ping"},
          {"type": "content_block_delta", "index": 0,
           "delta": {"type": "text_delta", "text": "hello"}},
          {"type": "content_block_stop", "index": 0},
          {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
           "usage": {"output_tokens": 2}},
          {"type": "message_stop"}]


class Limiter:
    """Records what the service charges and settles."""

    def __init__(self):
        self.settled = []

    def admit(self, key, tokens, now):
        return 0.0

    def settle(self, key, charged, used, now):
        self.settled.append((key, charged, used))


def run(handler, test):
    async def main():
        service, core, metrics = make_service(handler)
        service.limiter = Limiter()
        app = build_router_app(service, ["k"])
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://router") as client:
            await test(client, service)
        assert all(r.outstanding_tokens == 0 for r in core.replicas.values())
    asyncio.run(main())


def test_keys_refusals_and_a_message_passed_through():
    seen = []

    def handler(request):
        seen.append((request.url.path, json.loads(request.content)))
        return httpx.Response(200, json=MESSAGE)

    async def test(client, service):
        missing = await client.post("/v1/messages", json=BODY)
        assert missing.status_code == 401
        assert missing.json()["type"] == "error"
        assert missing.json()["error"]["type"] == "authentication_error"
        unknown = await client.post("/v1/messages", json={**BODY, "model": "x"},
                                    headers={"x-api-key": "k"})
        assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
        ok = await client.post("/v1/messages", json=BODY, headers={"x-api-key": "k"})
        assert ok.status_code == 200 and ok.json() == MESSAGE
        bearer = await client.post("/v1/messages", json=BODY, headers={"Authorization": "Bearer k"})
        assert bearer.status_code == 200
        assert service.limiter.settled[0][2] == 9  # input + output tokens of the answer
    run(handler, test)
    assert [path for path, _ in seen] == ["/v1/messages", "/v1/messages"]
    assert seen[0][1]["system"] == "Be brief." and seen[0][1]["max_tokens"] == 8


def test_a_stream_is_passed_through_after_a_503_is_retried_elsewhere():
    hosts = []

    def handler(request):
        hosts.append(request.url.host)
        if len(hosts) == 1:
            return httpx.Response(503, json={"type": "error", "error": {
                "type": "overloaded_error", "message": "full"}}, headers={"Retry-After": "1"})
        return httpx.Response(200, content=anthropic_sse(STREAM),
                              headers={"content-type": "text/event-stream"})

    async def test(client, service):
        r = await client.post("/v1/messages", json={**BODY, "stream": True},
                              headers={"x-api-key": "k"})
        assert r.status_code == 200 and r.content == anthropic_sse(STREAM)
        assert service.limiter.settled[-1][2] == 9
    run(handler, test)
    assert len(set(hosts)) == 2


def test_a_refused_stream_keeps_the_status_and_a_broken_one_ends_with_an_error_event():
    def refusing(request):
        return httpx.Response(400, json={"type": "error", "error": {
            "type": "invalid_request_error", "message": "bad"}})

    async def refused(client, service):
        r = await client.post("/v1/messages", json={**BODY, "stream": True},
                              headers={"x-api-key": "k"})
        assert r.status_code == 400 and r.json()["error"]["message"] == "bad"
    run(refusing, refused)

    def breaking(request):
        return httpx.Response(200, stream=Broken(anthropic_sse(STREAM[:4])))

    async def broken(client, service):
        r = await client.post("/v1/messages", json={**BODY, "stream": True},
                              headers={"x-api-key": "k"})
        assert r.status_code == 200
        assert r.text.startswith(anthropic_sse(STREAM[:4]).decode())
        last = r.text.strip().split("\n\n")[-1]
        assert last.startswith("event: error\ndata: ")
        assert json.loads(last.split("data: ", 1)[1])["error"]["type"] == "api_error"
    run(breaking, broken)


def test_stream_usage_is_read_from_the_start_and_delta_events():
    usage = StreamUsage()
    assert usage.used is None
    for line in anthropic_sse(STREAM).decode().splitlines():
        usage.feed(line)
    assert (usage.input_tokens, usage.output_tokens, usage.used) == (7, 2, 9)
