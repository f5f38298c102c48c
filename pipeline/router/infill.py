"""llama.cpp's /infill streams through the router.

Routing, keys, rate limits and model loading are a completion's (`RouterService.route`; the
affinity key is the context before the gap). A non-streamed request goes through
`RouterService.complete`. A stream is llama.cpp's (`data: {content, stop, ...}` events, no
`[DONE]`), which the router does not resume: it is passed through line by line from the
replica that took it (`RouterService.open_stream`), and a replica failing after the first line
ends the stream with an error event. The key pays what the last event reports
(tokens_evaluated + tokens_predicted).
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
from starlette.responses import JSONResponse, Response

from pagedserve.pipeline.ingress.streaming import EngineStreamResponse
from pagedserve.pipeline.router.ratelimit import retry_after_header
from pagedserve.pipeline.router.service import Routed, RouterError, RouterService
from pagedserve.pipeline.router.upstream import ReplicaRefused


class InfillUsage:
    """The tokens an /infill stream reports: its last event's counts."""

    def __init__(self) -> None:
        self.used: int | None = None

    def feed(self, line: str) -> None:
        if not line.startswith("data: ") or '"tokens_predicted"' not in line:
            return
        try:
            event = json.loads(line[len("data: "):])
            used = int(event["tokens_evaluated"]) + int(event["tokens_predicted"])
        except (ValueError, KeyError, TypeError):
            return
        self.used = used


def _refusal(status: int, message: str, code: str) -> bytes:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": code}}).encode()


async def stream_infill(service: RouterService, routed: Routed) -> Response:
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
        headers = dict(exc.headers)
        if exc.retry_after is not None:
            headers["Retry-After"] = retry_after_header(exc.retry_after)
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)
    except BaseException:
        await service.models.release(routed.model)
        raise
    usage = InfillUsage()
    failure: list[str] = []

    async def body() -> AsyncIterator[bytes]:
        try:
            async for line in resp.aiter_lines():
                usage.feed(line)
                yield line.encode() + b"\n"
        except httpx.HTTPError as exc:  # after the headers: only the stream can tell
            failure.append(f"{type(exc).__name__}: {exc}")
            yield b"data: " + _refusal(502, "the replica failed mid-stream; an /infill stream "
                                       "is not resumed on another replica",
                                       "replica_failed") + b"\n\n"

    async def on_close() -> None:
        await resp.aclose()
        service.close_stream(routed, replica, failure[0] if failure else None, usage.used)
        await service.models.release(routed.model)

    return EngineStreamResponse(body(), on_close)
