"""HTTP limits on what a client may make the ingress hold: header bytes, URL length, the time
a request body may take to arrive, and the fields of a chat request that only the ingress reads
(messages, tools). The sampling fields' limits are SamplingParams.validate's
(pipeline/sampling_params.py), the structured-output spec's pipeline/structured/spec.py's, and
the body's nesting pipeline/ingress/json_body.py's.

uvicorn's h11 parser bounds only an *incomplete* header block (`h11_max_incomplete_event_size`):
64 KiB of headers or a 64 KiB URL that arrive in one read pass through to the app. So the app
refuses them itself, before routing, with OpenAI-shaped 431 and 414 errors. `uvicorn_settings()`
holds the server-level values for pipeline/ingress/process.py.
"""
from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedserve.pipeline.ingress.errors import error_body

MAX_HEADER_BYTES = 16 * 1024  # all header names and values; Node's and h11's default
MAX_URL_BYTES = 8 * 1024      # path + query
BODY_TIMEOUT_S = 60.0         # from the headers to the body's last byte
KEEP_ALIVE_S = 30             # an idle kept-alive connection is closed after this
MAX_CHAT_MESSAGES = 2048      # OpenAI's limit; each is a turn of the chat template
MAX_TOOLS = 128               # OpenAI's limit; each is rendered into the prompt
MAX_TOOLS_JSON_CHARS = 200_000  # all tools as JSON: required / named turn them into a grammar


def uvicorn_settings() -> dict[str, Any]:
    """Keyword arguments of uvicorn.Config that bound what a client can hold open."""
    return {"h11_max_incomplete_event_size": MAX_HEADER_BYTES,
            "timeout_keep_alive": KEEP_ALIVE_S}


class HeaderLimits:
    """ASGI middleware: 414 for a URL over `max_url_bytes`, 431 for headers over
    `max_header_bytes`; everything else passes through untouched."""

    def __init__(self, app: ASGIApp, max_header_bytes: int = MAX_HEADER_BYTES,
                 max_url_bytes: int = MAX_URL_BYTES):
        self.app = app
        self.max_header_bytes = max_header_bytes
        self.max_url_bytes = max_url_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> JSONResponse | None:
        path = scope.get("raw_path") or scope["path"].encode()
        url = len(path) + len(scope.get("query_string", b""))
        if url > self.max_url_bytes:
            return _error(414, f"the URL has {url} bytes; at most {self.max_url_bytes} are allowed",
                          "uri_too_long")
        headers = sum(len(name) + len(value) + 4 for name, value in scope["headers"])
        if headers > self.max_header_bytes:
            return _error(431, f"the request headers have {headers} bytes; at most "
                               f"{self.max_header_bytes} are allowed", "headers_too_large")
        return None


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse(error_body(message, code=code), status_code=status,
                        headers={"Connection": "close"})
