"""Streams the router passes through as a replica sends them, line by line, not resumed on
another replica: Anthropic's /v1/messages, OpenAI's /v1/responses (responses.py) and llama.cpp's
/infill (infill.py). Routing, keys, rate limits and model loading are the chat or completion
route's (`RouterService.route`); a non-streamed request goes through `RouterService.complete`.
`pass_through` opens the stream on a replica before sending headers (so a refusal is a status),
and a replica failing after the first line ends the stream with the API's own error event. The
key pays the usage the stream reports, read by a per-API reader; here Anthropic's
(message_start's input tokens, message_delta's output tokens), whose refusals are in
Anthropic's error shape.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

import httpx
from starlette.responses import JSONResponse, Response

from pagedserve.pipeline.ingress.anthropic_errors import anthropic_error_body
from pagedserve.pipeline.ingress.streaming import EngineStreamResponse
from pagedserve.pipeline.router.ratelimit import retry_after_header
from pagedserve.pipeline.router.service import Routed, RouterError, RouterService
from pagedserve.pipeline.router.upstream import ReplicaRefused

NOT_RESUMED = "the replica failed mid-stream; a {} stream is not resumed on another replica"


def _headers(exc: RouterError) -> dict[str, str]:
    headers = dict(exc.headers)
    if exc.retry_after is not None:
        headers["Retry-After"] = retry_after_header(exc.retry_after)
    return headers


def router_error(exc: RouterError) -> JSONResponse:
    """The router's refusal in OpenAI's error shape."""
    return JSONResponse(exc.body(), status_code=exc.status, headers=_headers(exc))


def anthropic_error(exc: RouterError) -> JSONResponse:
    return JSONResponse(anthropic_error_body(exc.status, exc.message), status_code=exc.status,
                        headers=_headers(exc))


async def pass_through(service: RouterService, routed: Routed, usage,
                       refuse: Callable[[RouterError], Response],
                       failure_event: Callable[[], bytes]) -> Response:
    """Open the stream on a replica before sending headers, then pass its lines through;
    `usage.feed(line)` reads what the key pays (`usage.used`), `refuse` shapes a refusal before
    the stream, `failure_event()` the event that ends a stream whose replica failed."""
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
            yield failure_event()

    async def on_close() -> None:
        await resp.aclose()
        service.close_stream(routed, replica, failure[0] if failure else None, usage.used)
        await service.models.release(routed.model)

    return EngineStreamResponse(body(), on_close)


class StreamUsage:
    """The tokens a passed-through message stream reports, read from its `data:` lines."""

    def __init__(self) -> None:
        self.input_tokens: int | None = None
        self.output_tokens = 0

    def feed(self, line: str) -> None:
        if not line.startswith("data: ") or '"usage"' not in line:
            return
        try:
            payload = json.loads(line[len("data: "):])
        except json.JSONDecodeError:
            return
        kind = payload.get("type") if isinstance(payload, dict) else None
        if kind == "message_start":
            usage = (payload.get("message") or {}).get("usage") or {}
            self.input_tokens = _int(usage.get("input_tokens"))
        elif kind == "message_delta":
            self.output_tokens = _int((payload.get("usage") or {}).get("output_tokens")) or 0

    @property
    def used(self) -> int | None:
        return None if self.input_tokens is None else self.input_tokens + self.output_tokens


def _int(value) -> int | None:
    return value if type(value) is int else None


def _anthropic_failure() -> bytes:
    error = anthropic_error_body(502, NOT_RESUMED.format("message"))
    return b"event: error\ndata: " + json.dumps(error).encode() + b"\n\n"


async def stream_messages(service: RouterService, routed: Routed) -> Response:
    return await pass_through(service, routed, StreamUsage(), anthropic_error, _anthropic_failure)
