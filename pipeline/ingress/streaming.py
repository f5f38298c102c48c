"""Server-sent events: `data: <json>\\n\\n` per chunk, `data: [DONE]\\n\\n` at the end."""
from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedserve.pipeline.ingress.errors import APIError

_ENCODER = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"


def sse(chunk: Any) -> bytes:
    return b"data: " + _ENCODER.encode(chunk) + b"\n\n"


def named_event(payload: dict[str, Any]) -> bytes:
    """`event: <payload's type>` then its data: the event streams of Anthropic's Messages and
    OpenAI's Responses APIs."""
    return (b"event: " + payload["type"].encode() + b"\ndata: " + _ENCODER.encode(payload)
            + b"\n\n")


def sse_error(exc: APIError) -> bytes:
    return sse(exc.body())


async def with_error_event(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """An error after the headers went out can only be told inside the stream."""
    try:
        async for chunk in chunks:
            yield chunk
    except APIError as exc:
        yield sse_error(exc)
        yield DONE


class EngineStreamResponse(StreamingResponse):
    """A streaming response that always runs `on_close` when it ends, however it ends.

    Starlette cancels the body when the client disconnects; if that happens before the body
    iterator ever started, the iterator's own `finally` never runs. `on_close` does: it closes
    the body (aborting the engine requests) and releases the request's in-flight slots.
    """

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()
