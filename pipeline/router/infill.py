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

from starlette.responses import Response

from pagedserve.pipeline.router.passthrough import NOT_RESUMED, pass_through, router_error
from pagedserve.pipeline.router.service import Routed, RouterService


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


def _failure_event() -> bytes:
    return b"data: " + _refusal(502, NOT_RESUMED.format("/infill"), "replica_failed") + b"\n\n"


async def stream_infill(service: RouterService, routed: Routed) -> Response:
    return await pass_through(service, routed, InfillUsage(), router_error, _failure_event)
