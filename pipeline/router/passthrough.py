"""Anthropic's /v1/messages through the router.

Routing, keys, rate limits and model loading are the chat route's (`RouterService.route`; the
affinity key is the system prompt and the first user turn). A non-streamed request goes through
`RouterService.complete` like a chat one. A stream is passed through line by line as the
replica sends it (Anthropic's `event:` / `data:` lines; there is no `[DONE]`) and is not
resumed: a replica that fails after the first line ends the stream with an `error` event. The
key pays the usage the stream reports (message_start's input tokens, message_delta's output
tokens). The router's own refusals on this route are in Anthropic's error shape.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
from starlette.responses import JSONResponse, Response

from pagedserve.pipeline.ingress.anthropic_errors import anthropic_error_body
from pagedserve.pipeline.ingress.streaming import EngineStreamResponse
from pagedserve.pipeline.router.ratelimit import retry_after_header
from pagedserve.pipeline.router.service import Routed, RouterError, RouterService
from pagedserve.pipeline.router.upstream import ReplicaRefused


def anthropic_error(exc: RouterError) -> JSONResponse:
    headers = dict(exc.headers)
    if exc.retry_after is not None:
        headers["Retry-After"] = retry_after_header(exc.retry_after)
    return JSONResponse(anthropic_error_body(exc.status, exc.message), status_code=exc.status,
                        headers=headers)


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


async def stream_messages(service: RouterService, routed: Routed) -> Response:
    """Open the stream on a replica before sending headers, so that a refusal is a status."""
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
        return anthropic_error(exc)
    except BaseException:
        await service.models.release(routed.model)
        raise
    usage = StreamUsage()
    failure: list[str] = []

    async def body() -> AsyncIterator[bytes]:
        try:
            async for line in resp.aiter_lines():
                usage.feed(line)
                yield line.encode() + b"\n"
        except httpx.HTTPError as exc:  # after the headers: only the stream can tell
            failure.append(f"{type(exc).__name__}: {exc}")
            error = anthropic_error_body(502, "the replica failed mid-stream; a message stream "
                                         "is not resumed on another replica")
            yield b"event: error\ndata: " + json.dumps(error).encode() + b"\n\n"

    async def on_close() -> None:
        await resp.aclose()
        service.close_stream(routed, replica, failure[0] if failure else None, usage.used)
        await service.models.release(routed.model)

    return EngineStreamResponse(body(), on_close)
