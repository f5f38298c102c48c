"""POST /v1/responses: OpenAI's Responses API over the chat path.

The body is read through the same gate as every route (body limits, quarantine key, strict
parsing), its items (after those of `previous_response_id`, responses_store.py) translated into
a chat request (responses_protocol.to_chat_request) and prepared by chat.prepare_chat (chat
template, tools, tokenizing, admission); the engine's deltas are shaped by
chat_output.ChoiceShaper and told as output items and events (responses_stream.py). Errors are
OpenAI's, as on every /v1 route; the route sits behind the same API key.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from pagedserve.pipeline.ingress.chat import PreparedChat, prepare_chat
from pagedserve.pipeline.ingress.chat_output import ChoiceShaper
from pagedserve.pipeline.ingress.context import IngressContext
from pagedserve.pipeline.ingress.errors import APIError
from pagedserve.pipeline.ingress.generation import collect_output, prepend, respond
from pagedserve.pipeline.ingress.json_body import decode_json_object
from pagedserve.pipeline.ingress.openapi import generation_responses, request_body
from pagedserve.pipeline.ingress.responses_openapi import ResponseObject, ResponseStreamEvent
from pagedserve.pipeline.ingress.responses_protocol import (ResponsesRequest, input_items,
                                                            to_chat_request)
from pagedserve.pipeline.ingress.responses_store import ResponseStore
from pagedserve.pipeline.ingress.responses_stream import OutputEvents, output_items, usage
from pagedserve.pipeline.ingress.validation import parse_request, read_body
from pagedserve.pipeline.outputs import RequestOutput

# The models /openapi.json adds to its components for this route.
RESPONSES_MODELS = (ResponsesRequest, ResponseObject, ResponseStreamEvent)


def add_responses_route(app: FastAPI, ctx: IngressContext, *, dependencies: list,
                        errors: dict[int, Any]) -> None:
    """Register POST /v1/responses (behind `dependencies`: the API key), with its own store of
    recent responses."""
    store = ResponseStore(ctx.max_request_bytes)
    responses = generation_responses(ResponseObject, ResponseStreamEvent)
    responses[200] = {**responses[200], "description": "One response object, or with `stream: "
                      "true` server-sent events (`event: <type>` and `data: <JSON>`), the last "
                      "response.completed or response.incomplete; an error after the first "
                      "event is an `error` event."}
    responses[404] = {**responses[404], "description": "`model` is not the served model, or "
                      "`previous_response_id` is not kept by this replica "
                      "(previous_response_not_found)."}

    @app.post("/v1/responses", dependencies=dependencies,
              openapi_extra=request_body(ResponsesRequest), responses={**responses, **errors})
    async def create(request: Request) -> Response:
        """OpenAI's Responses API: the input items through the model's chat template."""
        return await create_response(ctx, store, request)


async def create_response(ctx: IngressContext, store: ResponseStore, request: Request
                          ) -> Response:
    arrival = ctx.clock()
    body = await read_body(request, ctx.max_request_bytes)
    key = ctx.guard.admit(request.url.path, body)
    with ctx.guard.section(key):  # up to the engine request: synchronous work only
        req = parse_request(ResponsesRequest, decode_json_object(body))
        items = input_items(req)
        if req.previous_response_id is not None:
            items = store.get(req.previous_response_id) + items
        try:
            prepared = prepare_chat(ctx, to_chat_request(req, items), f"resp_{uuid.uuid4().hex}")
        except APIError as exc:
            raise _in_responses_terms(exc) from None

    def keep(output: list[dict[str, Any]]) -> None:
        if req.store is not False:  # store: false answers without keeping the conversation
            store.put(prepared.engine_request.request_id, items + output)
    return await respond(request, ctx, [prepared.engine_request], prepared.ticket,
                         ResponseView(ctx, req, prepared, key, on_done=keep),
                         stream=bool(req.stream), arrival=arrival, priority=req.priority or 0)


# Fields of the chat request whose errors name them, and their names in this API.
_FIELD_NAMES = {"max_tokens": "max_output_tokens", "messages": "input",
                "response_format": "text.format"}


def _in_responses_terms(exc: APIError) -> APIError:
    """A refusal of the chat path, naming the field as the client sent it."""
    name = (exc.param or "").split(".")[0]
    if name in _FIELD_NAMES:
        exc.param = _FIELD_NAMES[name] + exc.param[len(name):]
        if exc.message.startswith(name):
            exc.message = _FIELD_NAMES[name] + exc.message[len(name):]
    return exc


class ResponseView:
    """Shapes one engine request's deltas into a response object or its events; `on_done`
    receives a finished response's output items (to keep the conversation)."""

    def __init__(self, ctx: IngressContext, req: ResponsesRequest, prepared: PreparedChat,
                 key: str, on_done=lambda output: None) -> None:
        self.ctx, self.req, self.key, self.on_done = ctx, req, key, on_done
        self.engine_request = prepared.engine_request
        self.shaper = ChoiceShaper(prepared.tool_plan, ctx.reasoning_parser)
        self.created_at = int(time.time())
        self.message_id = "msg_" + self.engine_request.request_id.removeprefix("resp_")

    def body(self, status: str, output: list[dict[str, Any]], output_tokens: int | None,
             finish_reason: str | None = None) -> dict[str, Any]:
        """The response object; `output_tokens` None while it runs (no usage yet)."""
        req = self.req
        if status == "completed" and finish_reason == "length":
            status = "incomplete"
        tools = [{"type": "function", "name": t.name, "description": t.description,
                  "parameters": t.parameters, "strict": t.strict} for t in req.tools or ()]
        return {
            "id": self.engine_request.request_id, "object": "response",
            "created_at": self.created_at, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None,
            "model": req.model, "output": output,
            "usage": None if output_tokens is None else usage(
                len(self.engine_request.prompt_token_ids), output_tokens),
            "instructions": req.instructions, "tools": tools,
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "temperature": req.temperature, "top_p": req.top_p,
            "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "text": {"format": (req.text.format if req.text and req.text.format
                                else {"type": "text"})},
            "previous_response_id": req.previous_response_id, "metadata": req.metadata or {},
            "store": req.store is not False, "user": req.user}

    async def collect(self, stream: AsyncIterator) -> RequestOutput:
        return await collect_output(self.engine_request, stream)

    def response(self, out: RequestOutput) -> dict[str, Any]:
        s = out.outputs[0]
        with self.ctx.guard.section(self.key):
            output = output_items(self.shaper.message(s.text), self.message_id)
        self.on_done(output)
        return self.body("completed", output, len(s.token_ids), s.finish_reason)

    async def sse(self, first: tuple[int, Any], stream: AsyncIterator) -> AsyncIterator[bytes]:
        events = OutputEvents(self.message_id)
        running = self.body("in_progress", [], None)
        yield events.emit({"type": "response.created", "response": running})
        yield events.emit({"type": "response.in_progress", "response": running})
        generated, finish = 0, None
        try:
            async for _, delta in prepend(first, stream):
                generated += len(delta.token_ids)
                final = delta.finish_reason is not None
                finish = delta.finish_reason if final else finish
                if self.shaper.plain:
                    parts = [{"content": delta.text}] if delta.text else []
                else:  # tool calls and reasoning: as many parts as the text makes, maybe none
                    with self.ctx.guard.section(self.key):
                        parts = self.shaper.deltas(delta.text, final=final)
                for part in parts:
                    for chunk in events.feed(part):
                        yield chunk
        except APIError as exc:  # after the headers: an `error` event ends the stream
            yield events.emit({"type": "error", "code": exc.code, "message": exc.message,
                               "param": exc.param})
            return
        for chunk in events.finish():
            yield chunk
        self.on_done(events.output)
        done = self.body("completed", events.output, generated, finish)
        yield events.emit({"type": f"response.{done['status']}", "response": done})
