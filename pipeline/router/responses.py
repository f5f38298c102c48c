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

from starlette.responses import Response

from pagedserve.pipeline.router.passthrough import NOT_RESUMED, pass_through, router_error
from pagedserve.pipeline.router.service import Routed, RouterService

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


def _failure_event() -> bytes:
    error = {"type": "error", "code": "replica_failed", "message": NOT_RESUMED.format("response"),
             "param": None}
    return b"event: error\ndata: " + json.dumps(error).encode() + b"\n\n"


async def stream_responses(service: RouterService, routed: Routed) -> Response:
    return await pass_through(service, routed, ResponsesStreamUsage(), router_error,
                              _failure_event)
