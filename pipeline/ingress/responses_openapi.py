"""How /openapi.json documents /v1/responses's answers (documentation only; the fuzz test holds
the server to them). openapi.py adds these models and the request model to the components."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel


class ResponseUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int


class ResponseOutputItem(BaseModel):
    """A `message` item (`role`, `content`: output_text parts) or a `function_call` item
    (`call_id`, `name`, `arguments`)."""
    type: Literal["message", "function_call"]
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] | None = None
    content: list[dict[str, Any]] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    incomplete_details: dict[str, Any] | None
    model: str
    output: list[ResponseOutputItem]
    usage: ResponseUsage | None
    error: dict[str, Any] | None
    previous_response_id: str | None


class ResponseStreamEvent(BaseModel):
    """One server-sent event of a streamed response (`event: <type>` names it), each with its
    `sequence_number`."""
    type: Literal["response.created", "response.in_progress", "response.output_item.added",
                  "response.content_part.added", "response.output_text.delta",
                  "response.output_text.done", "response.content_part.done",
                  "response.function_call_arguments.delta",
                  "response.function_call_arguments.done", "response.output_item.done",
                  "response.completed", "response.incomplete", "error"]
    sequence_number: int
