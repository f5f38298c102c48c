"""POST /v1/messages: Anthropic's Messages API over the chat path.

The body is read through the same gate as every route (body limits, quarantine key, strict
parsing), translated into a chat request (anthropic_protocol.to_chat_request) and prepared by
chat.prepare_chat (chat template, tools, tokenizing, admission); the engine's deltas are shaped
by chat_output.ChoiceShaper and told in Anthropic's terms (anthropic_stream.py). Every error of
this route, the API key's included, is answered in Anthropic's shape (anthropic_errors.py).
Clients send their key as `x-api-key: <key>`; `Authorization: Bearer <key>` works too.
"""
from __future__ import annotations

import logging
import secrets
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from pagedserve.pipeline.ingress.anthropic_errors import anthropic_error_response
from pagedserve.pipeline.ingress.anthropic_openapi import (MessageStreamEvent, messages_body,
                                                           messages_responses)
from pagedserve.pipeline.ingress.anthropic_protocol import MessagesRequest, to_chat_request
from pagedserve.pipeline.ingress.anthropic_stream import (BlockEvents, content_blocks, event,
                                                          stop_fields,
                                                          with_anthropic_error_event)
from pagedserve.pipeline.ingress.chat import PreparedChat, prepare_chat
from pagedserve.pipeline.ingress.chat_output import ChoiceShaper
from pagedserve.pipeline.ingress.context import IngressContext
from pagedserve.pipeline.ingress.errors import APIError
from pagedserve.pipeline.ingress.generation import collect_output, prepend, respond
from pagedserve.pipeline.ingress.json_body import decode_json_object
from pagedserve.pipeline.ingress.validation import parse_request, read_body
from pagedserve.pipeline.outputs import RequestOutput

log = logging.getLogger("pagedserve.ingress")

# The models /openapi.json adds to its components for this route.
MESSAGES_MODELS = (MessagesRequest, MessageStreamEvent)


def add_messages_route(app: FastAPI, ctx: IngressContext, responses: dict[int, Any]) -> None:
    """Register POST /v1/messages; `responses`: the app-wide errors to document with it."""
    @app.post("/v1/messages", openapi_extra=messages_body(MessagesRequest),
              responses={**messages_responses(ctx.api_key is not None), **responses})
    async def messages(request: Request) -> Response:
        """Anthropic's Messages API: the messages through the model's chat template."""
        try:
            return await create_message(ctx, request)
        except APIError as exc:
            return anthropic_error_response(exc)
        except Exception:
            log.exception("internal error")
            return anthropic_error_response(APIError(500, "internal server error",
                                                     type="server_error"))


def check_api_key(ctx: IngressContext, request: Request) -> None:
    """`x-api-key: <key>` (Anthropic's clients) or `Authorization: Bearer <key>`."""
    if ctx.api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    given = [request.headers.get("x-api-key", "")]
    if scheme.lower() == "bearer":
        given.append(token.strip())
    expected = ctx.api_key.encode()
    if not any(secrets.compare_digest(g.encode(), expected) for g in given):
        raise APIError(401, "Incorrect or missing API key: send 'x-api-key: <key>' or "
                            "'Authorization: Bearer <key>'.", code="invalid_api_key")


async def create_message(ctx: IngressContext, request: Request) -> Response:
    check_api_key(ctx, request)
    arrival = ctx.clock()
    body = await read_body(request, ctx.max_request_bytes)
    key = ctx.guard.admit(request.url.path, body)
    with ctx.guard.section(key):  # up to the engine request: synchronous work only
        req = parse_request(MessagesRequest, decode_json_object(body))
        prepared = prepare_chat(ctx, to_chat_request(req, ctx.tool_call_parser),
                                f"msg_{uuid.uuid4().hex}")
    return await respond(request, ctx, [prepared.engine_request], prepared.ticket,
                         _MessageView(ctx, req, prepared, key), stream=bool(req.stream),
                         arrival=arrival, priority=req.priority or 0,
                         error_event=with_anthropic_error_event)


class _MessageView:
    """Shapes one engine request's deltas into an Anthropic message or its events."""

    def __init__(self, ctx: IngressContext, req: MessagesRequest, prepared: PreparedChat,
                 key: str) -> None:
        self.ctx, self.req, self.key = ctx, req, key
        self.engine_request = prepared.engine_request
        self.shaper = ChoiceShaper(prepared.tool_plan, ctx.reasoning_parser)

    def _message(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
                 output_tokens: int) -> dict[str, Any]:
        return {"id": self.engine_request.request_id, "type": "message", "role": "assistant",
                "model": self.req.model, "content": content, "stop_reason": stop[0],
                "stop_sequence": stop[1],
                "usage": {"input_tokens": len(self.engine_request.prompt_token_ids),
                          "output_tokens": output_tokens}}

    async def collect(self, stream: AsyncIterator) -> RequestOutput:
        return await collect_output(self.engine_request, stream)

    def response(self, out: RequestOutput) -> dict[str, Any]:
        s = out.outputs[0]
        with self.ctx.guard.section(self.key):
            message = self.shaper.message(s.text)
            called = self.shaper.finish_reason(s.text, s.finish_reason) == "tool_calls"
        stop = stop_fields(s.finish_reason, s.stop_reason, called, self.req.stop_sequences)
        return self._message(content_blocks(message), stop, len(s.token_ids))

    async def sse(self, first: tuple[int, Any], stream: AsyncIterator) -> AsyncIterator[bytes]:
        yield event({"type": "message_start", "message": self._message([], (None, None), 0)})
        blocks = BlockEvents()
        generated, finish, stop_reason = 0, None, None
        async for _, delta in prepend(first, stream):
            if not (delta.text or delta.token_ids or delta.finish_reason):
                continue
            generated += len(delta.token_ids)
            final = delta.finish_reason is not None
            if final:
                finish, stop_reason = delta.finish_reason, delta.stop_reason
            if self.shaper.plain:
                parts = [{"content": delta.text}] if delta.text else []
            else:  # reasoning and tool calls: as many parts as the text makes, maybe none
                with self.ctx.guard.section(self.key):
                    parts = self.shaper.deltas(delta.text, final=final)
            for part in parts:
                for chunk in blocks.feed(part):
                    yield chunk
        for chunk in blocks.finish():
            yield chunk
        stop = stop_fields(finish, stop_reason, self.shaper.called, self.req.stop_sequences)
        yield event({"type": "message_delta",
                     "delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                     "usage": {"output_tokens": generated}})
        yield event({"type": "message_stop"})
