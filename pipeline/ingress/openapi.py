"""The OpenAPI schema served at /openapi.json: every route, its request body, its responses.

The routes read raw bodies so that one gate (protocol.py, validation.py) answers every bad one
with an OpenAI-shaped 400; the schema is documentation of that gate, not a second one. Request
bodies come from protocol.py's models; the response models below are only documentation, and
tests/e2e/test_fuzz_api.py (schemathesis) holds the server to them.
"""
from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from pagedserve.pipeline.ingress.protocol import (LIMIT_KEY, ChatCompletionRequest,
                                                  CompletionRequest)


# -- responses (documentation only) ---------------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """With echo, the prompt's tokens come first; its first token's entries are null."""
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float | None] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    logprob: float
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None
    # vLLM's, with prompt_logprobs (a stream's first chunk of each choice): null for the first
    # prompt token, then token id -> its logprob, for the top-N and the prompt's own token
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(BaseModel):
    """One server-sent event of a streamed completion (`usage` only with include_usage)."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float | None
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion (`usage` only with include_usage)."""
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: None
    max_model_len: int
    capabilities: list[Literal["completion", "chat", "tools", "insert", "thinking",
                               "json_schema", "embedding"]]


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class VersionInfo(BaseModel):
    version: str


# -- per-route response tables (used by app.py's decorators) ---------------------------------------
def _error(description: str, **extra: Any) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description, **extra}


_OVERLOADED = _error("The engine's queue is full or it is unavailable; retry after the given "
                     "seconds.", headers={"Retry-After": {"schema": {"type": "string"},
                                                          "description": "seconds"}})
API_KEY_ERRORS = {401: _error("Missing or wrong `Authorization: Bearer <key>` (only when the "
                              "server runs with --api-key).")}


def generation_responses(response: type[BaseModel], chunk: type[BaseModel]) -> dict[int, Any]:
    return {
        200: {"description": "One JSON body, or with `stream: true` server-sent events: "
                             "`data: <chunk JSON>` per chunk, then `data: [DONE]`; an error "
                             "after the first chunk is one `data: <error JSON>` event, then "
                             "`data: [DONE]`.",
              "content": {"application/json": {"schema": _ref(response)},
                          "text/event-stream": {"schema": _sse_event(chunk)}}},
        400: _error("The body is not a valid request (the message and `param` name the field), "
                    "or it does not fit the model's context."),
        404: _error("`model` is not the served model."),
        408: _error("The body did not arrive in time (a client sending it too slowly)."),
        413: _error("The body is larger than --max-request-bytes."),
        503: _OVERLOADED,
    }


# Every route: refused before routing by limits.HeaderLimits.
LIMIT_ERRORS = {414: _error("The URL is too long."),
                431: _error("The request headers are too large.")}


HEALTH_RESPONSES = {200: {"description": "The engine answers."},
                    503: _error("The engine does not answer.")}
METRICS_RESPONSES = {200: {"description": "Prometheus text format (vLLM's metric names).",
                           "content": {"text/plain": {"schema": {"type": "string"}}}}}


def _sse_event(chunk: type[BaseModel]) -> dict[str, Any]:
    """The schema of each event of a stream (OpenAPI 3.1: `schema` describes one event)."""
    payload = {"anyOf": [_ref(chunk), _ref(ErrorResponse)]}
    return {"type": "object", "required": ["data"], "properties": {"data": {"anyOf": [
        {"const": "[DONE]"},
        {"type": "string", "contentMediaType": "application/json", "contentSchema": payload}]}}}


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route that reads its body itself: the body's documented shape."""
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": _ref(model)}}}}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


# -- the whole schema ------------------------------------------------------------------------------
REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest)


def install_openapi(app: FastAPI, *, limits: dict[str, tuple[str, int]],
                    api_key: bool, request_models: tuple[type[BaseModel], ...] = ()) -> None:
    """Serve the schema, built once: request models (REQUEST_MODELS, and `request_models`: the
    bodies and answers of routes that other modules add) added to the components, each `LIMIT_KEY: name`
    marker replaced by `limits[name]` (a keyword and the served model's value), and bearer
    security on /v1 and every route that documents a 401 when the server has an API key."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                                 description=app.description)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (*REQUEST_MODELS, *request_models, CompletionResponse,
                          CompletionChunk, ChatCompletionResponse, ChatCompletionChunk):
                found = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(found.pop("$defs", {}))
                components[model.__name__] = found
            _fill_limits(schema, limits)
            if api_key:
                _require_bearer(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _fill_limits(node: Any, limits: dict[str, tuple[str, int]]) -> None:
    if isinstance(node, dict):
        name = node.pop(LIMIT_KEY, None)
        if name is not None:
            keyword, value = limits[name]
            node[keyword] = value
        for child in node.values():
            _fill_limits(child, limits)
    elif isinstance(node, list):
        for child in node:
            _fill_limits(child, limits)


def _require_bearer(schema: dict[str, Any]) -> None:
    schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, operations in schema["paths"].items():
        for operation in operations.values():
            # /v1, and the routes outside it that document the key's 401 (/tokenize, /infill)
            if path.startswith("/v1/") or "401" in operation.get("responses", {}):
                operation["security"] = [{"bearer": []}]
