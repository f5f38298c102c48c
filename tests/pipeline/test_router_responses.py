"""/v1/responses (OpenAI's Responses API) through the router over fake replicas: keys, a
response and a stream passed through as the replica sent them, a replica's 404 for an unknown
previous_response_id passed back as is, a broken stream ended with an error event, the key
charged the usage the answer reports, and the affinity key read from instructions and input."""
import json

import httpx

from pagedserve.pipeline.router.prompts import (affinity_prompt, estimate_generation,
                                                estimate_prompt_tokens)
from pagedserve.pipeline.router.responses import ResponsesStreamUsage
from test_router_messages import run
from test_router_resume import Broken

BODY = {"model": "m", "max_output_tokens": 8, "instructions": "Be brief.", "input": "hi"}
USAGE = {"input_tokens": 7, "output_tokens": 2, "total_tokens": 9}
RESPONSE = {"id": "resp_1", "object": "response", "status": "completed", "model": "m",
            "output": [{"type": "message", "id": "msg_1", "role": "assistant",
                        "status": "completed", "content": [
                            {"type": "output_text", "text": "hello", "annotations": []}]}],
            "usage": USAGE}
STREAM = [{"type": "response.created", "sequence_number": 0,
           "response": {**RESPONSE, "status": "in_progress", "output": [], "usage": None}},
          {"type": "response.output_text.delta", "sequence_number": 1, "item_id": "msg_1",
           "output_index": 0, "content_index": 0, "delta": "hello"},
          {"type": "response.completed", "sequence_number": 2, "response": RESPONSE}]
KEY = {"Authorization": "Bearer k"}


def sse(events):
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)


def test_keys_a_response_and_a_missing_previous_response_passed_through():
    seen = []

    def handler(request):
        body = json.loads(request.content)
        seen.append((request.url.path, body))
        if body.get("previous_response_id"):
            return httpx.Response(404, json={"error": {
                "message": "not found", "type": "invalid_request_error",
                "param": "previous_response_id", "code": "previous_response_not_found"}})
        return httpx.Response(200, json=RESPONSE)

    async def test(client, service):
        missing = await client.post("/v1/responses", json=BODY)
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
        ok = await client.post("/v1/responses", json=BODY, headers=KEY)
        assert ok.status_code == 200 and ok.json() == RESPONSE
        assert service.limiter.settled[0][2] == 9
        gone = await client.post("/v1/responses", headers=KEY,
                                 json={**BODY, "previous_response_id": "resp_x"})
        assert gone.status_code == 404
        assert gone.json()["error"]["code"] == "previous_response_not_found"
    run(handler, test)
    assert [path for path, _ in seen] == ["/v1/responses"] * 2
    assert seen[0][1]["instructions"] == "Be brief." and seen[0][1]["max_output_tokens"] == 8


def test_a_stream_is_passed_through_and_a_broken_one_ends_with_an_error_event():
    def streaming(request):
        return httpx.Response(200, content=sse(STREAM),
                              headers={"content-type": "text/event-stream"})

    async def passed(client, service):
        r = await client.post("/v1/responses", json={**BODY, "stream": True}, headers=KEY)
        assert r.status_code == 200 and r.content == sse(STREAM)
        assert service.limiter.settled[-1][2] == 9
    run(streaming, passed)

    def breaking(request):
        return httpx.Response(200, stream=Broken(sse(STREAM[:2])))

    async def broken(client, service):
        r = await client.post("/v1/responses", json={**BODY, "stream": True}, headers=KEY)
        assert r.status_code == 200 and r.text.startswith(sse(STREAM[:2]).decode())
        last = r.text.strip().split("\n\n")[-1]
        assert last.startswith("event: error\ndata: ")
        assert json.loads(last.split("data: ", 1)[1])["code"] == "replica_failed"
    run(breaking, broken)


def test_usage_affinity_and_estimates_read_the_responses_body():
    usage = ResponsesStreamUsage()
    for line in sse(STREAM).decode().splitlines():
        usage.feed(line)
    assert usage.used == 9
    items = {**BODY, "input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}]},
                               {"role": "assistant", "content": "b"},
                               {"role": "user", "content": "c"}]}
    assert affinity_prompt("responses", items) == "system\x00Be brief.\x00user\x00a\x00"
    assert affinity_prompt("responses", BODY) == "system\x00Be brief.\x00user\x00hi\x00"
    assert estimate_prompt_tokens("responses", items) > 0
    assert estimate_generation(BODY, "responses") == 8
