"""OpenAI's /v1/responses through the router.

Routing, keys, rate limits and model loading are the chat route's (`RouterService.route`; the
affinity key is the instructions and the input up to its first user message). A non-streamed
request goes through `RouterService.complete`. A stream (`event:` / `data:` lines, no `[DONE]`)
is passed through line by line from the replica that took it and is not resumed: a replica
failing after the first line ends the stream with an `error` event. The key pays the usage the
last event (response.completed or response.incomplete) reports.

`previous_response_id` names a response kept in the memory of the replica that answered it;
the request may be routed to another replica (the affinity key of a continued conversation
differs from its first turn's), which answers 404 previous_response_not_found, passed back as
is. A client that needs continuity over replicas sends the conversation as `input` instead.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

import httpx
from starlette.responses import JSONResponse, Response

from pagedserve.pipeline.ingress.streaming import EngineStreamResponse
from pagedserve.pipeline.router.ratelimit import retry_after_header
from pagedserve.pipeline.router.service import Routed, RouterError, RouterService
from pagedserve.pipeline.router.upstream import ReplicaRefused

_FINAL = ('"response.completed"', '"response.incomplete"')


class ResponsesStreamUsage:
    """The tokens a passed-through response stream reports: its final event's usage."""

    def __init__(self) -> None:
        self.used: int | None = None

    def feed(self, line: str) -> None:
        if not line.startswith("data: ") or not any(f in line for f in _FINAL):
            return
        try:
            usage = json.loads(line[len("data: "):])["response"]["usage"]
            used = int(usage["input_tokens"]) + int(usage["output_tokens"])
        except (ValueError, KeyError, TypeError):
            return
        self.used = used


def _router_error(exc: RouterError) -> JSONResponse:
    headers = dict(exc.headers)
    if exc.retry_after is not None:
        headers["Retry-After"] = retry_after_header(exc.retry_after)
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def _failure_event(message: str) -> bytes:
    error = {"type": "error", "code": "replica_failed", "message": message, "param": None}
    return b"event: error\ndata: " + json.dumps(error).encode() + b"\n\n"


async def stream_responses(service: RouterService, routed: Routed) -> Response:
    return await pass_through(service, routed, ResponsesStreamUsage(), _router_error,
                              _failure_event)


async def pass_through(service: RouterService, routed: Routed, usage, refuse: Callable[
                       [RouterError], Response], failure_event: Callable[[str], bytes]
                       ) -> Response:
    """Open the stream on a replica before sending headers, so that a refusal is a status, then
    pass its lines through; `usage.feed(line)` reads what the key pays (`usage.used`)."""
    try:
        replica, resp = await service.open_stream(routed)
    except ReplicaRefused as refused:
        service.unserved(routed)
        await service.models.release(routed.model)
        return Response(refused.body, status_code=refused.status, headers=refused.headers,
                        media_type="application/json")
    except RouterError as exc:
        service.unserved(routed)
        await service.models.release(routed.model)
        return refuse(exc)
    except BaseException:
        await service.models.release(routed.model)
        raise
    failure: list[str] = []

    async def body() -> AsyncIterator[bytes]:
        try:
            async for line in resp.aiter_lines():
                usage.feed(line)
                yield line.encode() + b"\n"
        except httpx.HTTPError as exc:  # after the headers: only the stream can tell
            failure.append(f"{type(exc).__name__}: {exc}")
            yield failure_event("the replica failed mid-stream; a response stream is not "
                                "resumed on another replica")

    async def on_close() -> None:
        await resp.aclose()
        service.close_stream(routed, replica, failure[0] if failure else None, usage.used)
        await service.models.release(routed.model)

    return EngineStreamResponse(body(), on_close)
