"""The router against clients that push its limits (issue 38): a key pays for the tokens a
stream actually sent however the stream ends, a client cannot name a priority better than its
key allows, and a body is bounded in size and time. The router's service and app over fake
replicas (httpx.MockTransport), with a fixed clock: no processes, nothing timed."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pagedserve.pipeline.ingress import limits
from pagedserve.pipeline.router.app import MAX_BODY_BYTES, build_router_app
from pagedserve.pipeline.router.core import Replica, RouterCore
from pagedserve.pipeline.router.metrics import RouterMetrics
from pagedserve.pipeline.router.model_slots import ModelSlots
from pagedserve.pipeline.router.models import ModelManager
from pagedserve.pipeline.router.pool import ReplicaPool
from pagedserve.pipeline.router.priority import clamp_priority
from pagedserve.pipeline.router.prompts import DEFAULT_GENERATION_ESTIMATE
from pagedserve.pipeline.router.ratelimit import KeyLimit, RateLimiter
from pagedserve.pipeline.router.service import RouterError, RouterService
from pagedserve.pipeline.router.upstream import DONE

PROMPT_IDS = [1, 2, 3]
TPM = 6000.0              # a bucket of 6000 tokens (60 s of burst), never refilled: the clock stands
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
CHAT_ESTIMATE = 4 + DEFAULT_GENERATION_ESTIMATE  # "hi": 0 tokens of text + 4 per message


def sse(events) -> bytes:
    return b"".join(b"data: " + (e.encode() if e == DONE else json.dumps(e).encode()) + b"\n\n"
                    for e in events)


def chunks(count: int, *, finish: bool = True) -> list:
    """A chat stream of `count` one-token chunks after the role chunk."""
    out = [{"id": "c", "object": "chat.completion.chunk", "prompt_token_ids": PROMPT_IDS,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
    for i in range(count):
        out.append({"id": "c", "object": "chat.completion.chunk", "choices": [{
            "index": 0, "delta": {"content": f" w{i}"}, "token_ids": [100 + i],
            "finish_reason": "length" if finish and i == count - 1 else None}]})
    return out


class Broken(httpx.AsyncByteStream):
    def __init__(self, data: bytes):
        self.data = data

    async def __aiter__(self):
        yield self.data
        raise httpx.RemoteProtocolError("peer closed connection")


def make_service(handler, *, limits_by_key=None, floors=None, replicas=("m/0",)):
    core = RouterCore()
    for rid in replicas:
        core.add(Replica(rid, "m", f"http://{rid.replace('/', '-')}", healthy=True,
                         max_model_len=4096, upstream_model="m"))
    metrics = RouterMetrics()
    http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    pool = ReplicaPool(core, metrics, http)
    models = ModelManager({}, ModelSlots(["m"]), pool, metrics)
    models.mark_loaded("m")
    limiter = RateLimiter(limits_by_key or {"k": KeyLimit(tokens_per_minute=TPM)})
    return RouterService(core, pool, models, limiter, metrics, http, clock=lambda: 0.0,
                         priority_floors=floors)


def left(service: RouterService) -> float:
    return service.limiter.tokens_left("k", 0.0)


# -- token accounting ---------------------------------------------------------------------------
def test_without_max_tokens_the_charge_is_the_prompt_estimate_plus_a_reservation():
    service = make_service(lambda r: httpx.Response(500))
    routed = service.route("completion", {"model": "m", "prompt": "x" * 400}, "k")
    assert routed.charged == 100 + DEFAULT_GENERATION_ESTIMATE
    assert left(service) == TPM - 100 - DEFAULT_GENERATION_ESTIMATE


def test_a_client_gone_mid_stream_is_charged_the_prompt_and_the_tokens_it_was_sent():
    service = make_service(lambda r: httpx.Response(200, content=sse(chunks(6) + [DONE])))

    async def run():
        events = service.stream(service.route("chat", CHAT, "k"))
        got = [await events.__anext__() for _ in range(3)]  # the role chunk and 2 tokens
        assert left(service) == TPM - CHAT_ESTIMATE
        await events.aclose()  # what the app does when the client disconnects
        return got

    got = asyncio.run(run())
    assert [c["delta"].get("content") for e in got for c in e["choices"]] == ["", " w0", " w1"]
    assert left(service) == TPM - (len(PROMPT_IDS) + 2)


def test_a_long_stream_pays_as_it_passes_its_reservation_and_exactly_at_the_end():
    count = DEFAULT_GENERATION_ESTIMATE + 40
    service = make_service(lambda r: httpx.Response(200, content=sse(chunks(count) + [DONE])))

    async def run():
        events = service.stream(service.route("chat", CHAT, "k"))
        for _ in range(1 + count - 10):
            await events.__anext__()
        mid = left(service)  # 3 prompt + count - 10 tokens sent: past the estimate of 260
        rest = [e async for e in events]
        return mid, rest

    mid, rest = asyncio.run(run())
    assert mid == TPM - (len(PROMPT_IDS) + count - 10)
    assert rest[-1] == DONE
    assert left(service) == TPM - (len(PROMPT_IDS) + count)


def test_a_replica_failing_mid_stream_is_charged_what_was_sent_and_a_refusal_nothing():
    def handler(request):
        body = json.loads(request.content)
        if body.get("n") == 2:  # not resumable: the stream ends with an error event
            return httpx.Response(200, stream=Broken(sse(chunks(2, finish=False))))
        return httpx.Response(400, content=b'{"error": {"message": "no"}}')

    async def run():
        events = [e async for e in service.stream(service.route("chat", {**CHAT, "n": 2}, "k"))]
        after_break = left(service)
        with pytest.raises(Exception, match="400"):
            async for _ in service.stream(service.route("chat", CHAT, "k")):
                pass
        return events, after_break

    service = make_service(handler, replicas=("m/0", "m/1"))  # the broken one is suspect
    events, after_break = asyncio.run(run())
    assert "n > 1" in events[-2]["error"]["message"] and events[-1] == DONE
    assert after_break == TPM - (len(PROMPT_IDS) + 2)
    assert left(service) == after_break  # the refused request was given its charge back


def test_a_non_streamed_answer_is_charged_its_usage_and_an_error_nothing():
    answers = iter([httpx.Response(200, content=json.dumps({"usage": {"total_tokens": 7}})),
                    httpx.Response(400, content=b'{"error": {"message": "no"}}')])
    service = make_service(lambda r: next(answers))

    async def run():
        await service.complete(service.route("completion", {"model": "m", "prompt": "hi"}, "k"))
        await service.complete(service.route("completion", {"model": "m", "prompt": "hi"}, "k"))

    asyncio.run(run())
    assert left(service) == TPM - 7


# -- priority -----------------------------------------------------------------------------------
def test_priority_is_clamped_to_the_keys_floor():
    assert clamp_priority({"priority": -1000}, 0) == {"priority": 0}
    assert clamp_priority({"priority": 5}, 0) == {"priority": 5}       # less urgent: kept
    assert clamp_priority({}, 0) == {}                                 # the engine's 0
    assert clamp_priority({"priority": -1000}, -10) == {"priority": -10}
    assert clamp_priority({"priority": -3}, -10) == {"priority": -3}
    assert clamp_priority({}, 3) == {"priority": 3}                    # a low-priority key
    for bad in ("-1000", -1000.0, True):
        with pytest.raises(ValueError, match="priority must be an integer"):
            clamp_priority({"priority": bad}, 0)


def test_the_replica_gets_the_clamped_priority_of_each_key():
    sent = []

    def handler(request):
        sent.append(json.loads(request.content).get("priority"))
        return httpx.Response(200, content=json.dumps({"usage": {"total_tokens": 1}}))

    service = make_service(handler, limits_by_key={}, floors={"ops": -10})

    async def run():
        for key, priority in (("k", -1000), ("ops", -1000), ("ops", -4), ("", -1)):
            body = {"model": "m", "prompt": "hi", "priority": priority}
            await service.complete(service.route("completion", body, key))

    asyncio.run(run())
    assert sent == [0, -10, -4, 0]
    with pytest.raises(RouterError) as refused:
        service.route("completion", {"model": "m", "prompt": "hi", "priority": "-9"}, "k")
    assert refused.value.status == 400 and refused.value.code == "invalid_priority"


# -- bodies -------------------------------------------------------------------------------------
def _post(service, content, headers=None):
    async def run():
        app = build_router_app(service, [])
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://router") as client:
            return await client.post("/v1/completions", content=content, headers=headers or {})
    return asyncio.run(run())


def test_a_body_over_the_ingress_limit_is_a_413_declared_or_not():
    service = make_service(lambda r: httpx.Response(500))
    assert MAX_BODY_BYTES == 1 << 20  # ServerArgs.max_request_bytes, the replicas' own
    big = b'{"prompt": "' + b"x" * MAX_BODY_BYTES + b'"}'
    declared = _post(service, big)
    assert declared.status_code == 413
    assert f"limit of {MAX_BODY_BYTES} bytes" in declared.json()["error"]["message"]

    async def pieces():  # chunked: no Content-Length to refuse by
        for _ in range(3):
            yield b"x" * (MAX_BODY_BYTES // 2)
    assert _post(service, pieces()).status_code == 413


def test_a_body_that_does_not_arrive_in_time_is_a_408(monkeypatch):
    monkeypatch.setattr(limits, "BODY_TIMEOUT_S", 0.05)
    service = make_service(lambda r: httpx.Response(500))

    async def never_finished():
        yield b'{"prompt": "'
        await asyncio.Event().wait()  # a client that stops sending
        yield b'"}'

    slow = _post(service, never_finished())
    assert slow.status_code == 408 and slow.headers["connection"] == "close"
    assert "did not arrive within" in slow.json()["error"]["message"]
    bad = _post(service, b"[" * 100 + b"]" * 100)
    assert bad.status_code == 400 and "nests" in bad.json()["error"]["message"]


def test_a_keys_priority_floor_reaches_the_router_from_its_spec():
    from pagedserve.pipeline.router.config import config_from_argv
    from pagedserve.pipeline.router.process import build
    cfg, _ = config_from_argv(["--model", "a=/m", "--api-key", "ops:::-10", "--api-key", "k:60"])
    _app, service = build(cfg)
    asyncio.run(service.http.aclose())
    assert service.priority_floors == {"ops": -10, "k": 0}
