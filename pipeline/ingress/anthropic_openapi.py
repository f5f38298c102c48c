"""How /openapi.json documents /v1/messages: its responses and errors in Anthropic's shapes
(documentation only; the fuzz test holds the server to them). openapi.py adds the request
model and the stream event model to the schema's components."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"]
    error: AnthropicErrorDetail


class MessageUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class MessageContentBlock(BaseModel):
    """A `text` block (`text`), a `tool_use` block (`id`, `name`, `input`) or, with a
    --reasoning-parser, a `thinking` block (`thinking`)."""
    type: Literal["text", "tool_use", "thinking"]
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    thinking: str | None = None


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[MessageContentBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: MessageUsage


class MessageStreamEvent(BaseModel):
    """One server-sent event of a streamed message (`event: <type>` names it): message_start,
    content_block_start, ping, content_block_delta, content_block_stop, message_delta,
    message_stop, or error."""
    type: Literal["message_start", "content_block_start", "ping", "content_block_delta",
                  "content_block_stop", "message_delta", "message_stop", "error"]


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _error(description: str, **extra: Any) -> dict[str, Any]:
    return {"model": AnthropicErrorResponse, "description": description, **extra}


def messages_responses(api_key: bool) -> dict[int, Any]:
    """The route's responses (app.py adds the header limits' 414 and 431)."""
    event = {"type": "object", "required": ["data"], "properties": {
        "event": {"type": "string"},
        "data": {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": _ref(MessageStreamEvent)}}}
    responses = {
        200: {"model": MessageResponse,
              "description": "One message, or with `stream: true` Anthropic's server-sent "
                             "events (`event: <type>` and `data: <JSON>`); an error after the "
                             "first event is an `error` event.",
              "content": {"application/json": {"schema": _ref(MessageResponse)},
                          "text/event-stream": {"schema": event}}},
        400: _error("invalid_request_error: the body is not a valid request, or it does not fit "
                    "the model's context."),
        404: _error("not_found_error: `model` is not the served model."),
        408: _error("invalid_request_error: the body did not arrive in time."),
        413: _error("request_too_large: the body is larger than --max-request-bytes."),
        503: _error("overloaded_error: the engine's queue is full or it is unavailable.",
                    headers={"Retry-After": {"schema": {"type": "string"},
                                             "description": "seconds"}}),
    }
    if api_key:
        responses[401] = _error("authentication_error: missing or wrong `x-api-key: <key>` or "
                                "`Authorization: Bearer <key>`.")
    return responses


def messages_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` of the route: it reads its body itself."""
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": _ref(model)}}}}
