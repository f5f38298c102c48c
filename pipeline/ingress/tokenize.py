"""POST /tokenize and /detokenize, in vLLM's shapes: clients count a prompt's tokens (text, or
messages through the chat template) before sending it, and turn token ids back into text.

The text goes through the same code as a generation request's (`tokenizer.encode`, the chat
template of chat.render_chat), so the count is the one a completion would use. Nothing reaches
the engine; the work is one pass of the tokenizer over the body (itself bounded by
--max-request-bytes), under the request guard like every route that tokenizes.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedserve.pipeline.ingress.chat import render_chat
from pagedserve.pipeline.ingress.context import IngressContext
from pagedserve.pipeline.ingress.errors import invalid
from pagedserve.pipeline.ingress.json_body import decode_json_object
from pagedserve.pipeline.ingress.openapi import ErrorResponse, request_body
from pagedserve.pipeline.ingress.protocol import (_TOKEN_ID, RESERVED_TEMPLATE_ARGS, ChatMessage,
                                                  RequestBody, documented, check_template_fields)
from pagedserve.pipeline.ingress.tools import plan_tools
from pagedserve.pipeline.ingress.validation import (check_model_name, check_token_ids,
                                                    parse_request, read_body)


class TokenizeCompletionRequest(RequestBody):
    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = Field(True, description="the tokenizer's own (BOS ...)")
    return_token_strs: bool | None = Field(False, description="also each token as a string")


class TokenizeChatRequest(RequestBody):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1, description="rendered by the chat "
                                        "template, as /v1/chat/completions renders them")
    add_generation_prompt: bool | None = Field(True, description="not together with "
                                               "continue_final_message")
    continue_final_message: bool | None = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: documented(dict[str, Any], type="object", propertyNames={
        "not": {"enum": sorted(RESERVED_TEMPLATE_ARGS)}}) | None = None
    add_special_tokens: bool | None = Field(False, description="the template writes its own")
    return_token_strs: bool | None = False


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: documented(list[int], type="array", items=_TOKEN_ID)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


REQUEST_MODELS = (TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest)
# The body is one of the two shapes: `messages` picks the chat one.
_TOKENIZE_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "anyOf": [{"$ref": f"#/components/schemas/{m.__name__}"}
              for m in (TokenizeCompletionRequest, TokenizeChatRequest)]}}}}}


def tokenize_body(ctx: IngressContext, body: dict[str, Any]) -> dict[str, Any]:
    """The /tokenize answer for a decoded body; APIError 400/404 for a bad one."""
    if body.get("messages") is not None:
        if body.get("prompt") is not None:
            raise invalid("give either prompt or messages, not both", "messages")
        req: Any = parse_request(TokenizeChatRequest, body)
        check_model_name(req.model, ctx.served_model_names)
        check_template_fields(req)
        plan = plan_tools(req.tools, "none", None, None)  # checks the tools' shape
        ids = render_chat(ctx.tokenizer, req, plan.tools if plan else None,
                          add_special_tokens=bool(req.add_special_tokens))
    else:
        req = parse_request(TokenizeCompletionRequest, body)
        check_model_name(req.model, ctx.served_model_names)
        ids = ctx.tokenizer.encode(req.prompt, add_special_tokens=bool(req.add_special_tokens))
    out: dict[str, Any] = {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}
    if req.return_token_strs:
        out["token_strs"] = ctx.tokenizer.convert_ids_to_tokens(ids)
    return out


def detokenize_body(ctx: IngressContext, body: dict[str, Any]) -> dict[str, Any]:
    """The /detokenize answer; an id outside the tokenizer's vocabulary is a 400 naming it."""
    req = parse_request(DetokenizeRequest, body)
    check_model_name(req.model, ctx.served_model_names)
    # ids past the tokenizer's last (a model's padded embedding rows) have no text
    check_token_ids(req.tokens, min(ctx.vocab_size, len(ctx.tokenizer)), "tokens")
    return {"prompt": ctx.tokenizer.decode(req.tokens)}


async def _answer(ctx: IngressContext, request: Request, build) -> Response:
    body = await read_body(request, ctx.max_request_bytes)
    key = ctx.guard.admit(request.url.path, body)
    with ctx.guard.section(key):
        out = build(ctx, decode_json_object(body))
    return JSONResponse(out)


def add_token_routes(app: FastAPI, ctx: IngressContext, *, dependencies: list,
                     errors: dict[int, Any]) -> None:
    """Register /tokenize and /detokenize on `app` (behind `dependencies`: the API key)."""
    refusals = {400: {"model": ErrorResponse, "description": "Not a valid body, or a token id "
                      "outside the vocabulary (the message names the field)."},
                404: {"model": ErrorResponse, "description": "`model` is not the served model."},
                408: {"model": ErrorResponse, "description": "The body did not arrive in time."},
                413: {"model": ErrorResponse, "description": "The body is larger than "
                      "--max-request-bytes."}}

    @app.post("/tokenize", dependencies=dependencies, openapi_extra=_TOKENIZE_BODY,
              responses={200: {"model": TokenizeResponse}, **refusals, **errors})
    async def tokenize(request: Request) -> Response:
        """Token ids of a prompt, or of messages through the chat template (vLLM's shape)."""
        return await _answer(ctx, request, tokenize_body)

    @app.post("/detokenize", dependencies=dependencies,
              openapi_extra=request_body(DetokenizeRequest),
              responses={200: {"model": DetokenizeResponse}, **refusals, **errors})
    async def detokenize(request: Request) -> Response:
        """The text of token ids (vLLM's shape)."""
        return await _answer(ctx, request, detokenize_body)
