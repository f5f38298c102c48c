"""POST /v1/embeddings, in OpenAI's shape: one vector per input (a string, strings, token ids
or lists of token ids), `dimensions` (the first d components, normalized again),
`encoding_format` float or base64 (little-endian float32, as OpenAI's), and usage.

Each input is an engine request with `pooling` set: prefill-only, batched by the scheduler with
everything else (pipeline/pooling.py). The checks are the completions route's: the body is
bounded by --max-request-bytes, the inputs by MAX_EMBEDDING_INPUTS and the queue, each input by
the model's context (a longer one is a 400 naming both numbers, never truncated), and admission
is asked before any tokenization.
"""
from __future__ import annotations

import base64
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, Field
from starlette.requests import Request
from starlette.responses import Response

from pagedserve.pipeline.ingress.context import IngressContext
from pagedserve.pipeline.ingress.errors import invalid
from pagedserve.pipeline.ingress.generation import EngineRequest, new_request_id, respond
from pagedserve.pipeline.ingress.json_body import decode_json_object
from pagedserve.pipeline.ingress.openapi import ErrorResponse, request_body
from pagedserve.pipeline.ingress.protocol import LIMIT_KEY, Prompt, RequestBody, documented
from pagedserve.pipeline.ingress.validation import (check_model_name, check_token_ids,
                                                    parse_request, read_body)
from pagedserve.pipeline.pooling import (MAX_EMBEDDING_INPUTS, PoolingParams, from_bytes,
                                         truncate)
from pagedserve.pipeline.sampling_params import INT64_MAX, INT64_MIN, SamplingParams


class EmbeddingRequest(RequestBody):
    model: str | None = None
    input: Prompt = Field(description="a string, strings, token ids or lists of token ids; "
                                      "each within the model's context (never truncated)")
    encoding_format: Literal["float", "base64"] | None = Field(
        "float", description="base64: the little-endian float32 bytes, as OpenAI's")
    dimensions: documented(int, type="integer", minimum=1, **{LIMIT_KEY: "dimensions"}
                           ) | None = Field(None, description="keep the first this many "
                                            "components, normalized again")
    user: str | None = None
    add_special_tokens: bool | None = Field(True, description="the tokenizer's own (text input)")
    priority: documented(int, type="integer", minimum=INT64_MIN, maximum=INT64_MAX) | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


MODELS = (EmbeddingRequest, EmbeddingResponse)


def _inputs(req: EmbeddingRequest, ctx: IngressContext) -> list[str | list[int]]:
    value = req.input
    inputs = [value] if isinstance(value, str) or (value and isinstance(value[0], int)) \
        else list(value)
    most = min(MAX_EMBEDDING_INPUTS, ctx.admission.max_queued_requests)
    if not inputs:
        raise invalid("input must not be empty", "input")
    if len(inputs) > most:
        raise invalid(f"input is a batch of {len(inputs)} inputs, but at most {most} are "
                      f"allowed per request", "input")
    for i, item in enumerate(inputs):
        if len(item) == 0:
            raise invalid(f"input[{i}] is empty", "input")
    return inputs


def _prepare(ctx: IngressContext, body: bytes):
    req = parse_request(EmbeddingRequest, decode_json_object(body))
    check_model_name(req.model, ctx.served_model_names)
    inputs = _inputs(req, ctx)
    if req.priority is not None and not INT64_MIN <= req.priority <= INT64_MAX:
        raise invalid(f"priority must be a 64-bit integer, got {req.priority}", "priority")
    try:
        pooling = PoolingParams(dimensions=req.dimensions).validate(ctx.hidden_size)
    except ValueError as exc:
        raise invalid(str(exc), "dimensions") from None
    ticket = ctx.admit(len(inputs))  # before any tokenization
    try:
        request_id = new_request_id("embd")
        engine_requests = []
        for i, item in enumerate(inputs):
            if isinstance(item, str):
                ids = ctx.tokenizer.encode(item, add_special_tokens=req.add_special_tokens
                                           is not False)
            else:
                check_token_ids(item, ctx.vocab_size, "input")
                ids = list(item)
            if len(ids) > ctx.max_model_len:
                raise invalid(f"input[{i}] has {len(ids)} tokens but the model takes at most "
                              f"{ctx.max_model_len} (its maximum input length)", "input")
            ctx.guard.poison(ids)
            engine_requests.append(EngineRequest(
                f"{request_id}-{i}" if len(inputs) > 1 else request_id, ids,
                SamplingParams(max_tokens=None), pooling))
    except BaseException:
        ticket.release()
        raise
    return req, engine_requests, ticket, _EmbeddingView(ctx, req, request_id, engine_requests)


class _EmbeddingView:
    """Collects each request's vector and shapes OpenAI's answer (never streamed)."""

    def __init__(self, ctx: IngressContext, req: EmbeddingRequest, request_id: str,
                 engine_requests: list[EngineRequest]) -> None:
        self.ctx, self.req, self.request_id = ctx, req, request_id
        self.engine_requests = engine_requests

    async def collect(self, stream: AsyncIterator) -> list[bytes | None]:
        vectors: list[bytes | None] = [None] * len(self.engine_requests)
        async for pos, delta in stream:
            if delta.embedding is not None:
                vectors[pos] = delta.embedding
        return vectors

    def response(self, vectors: list[bytes | None]) -> dict[str, Any]:
        data = []
        for index, raw in enumerate(vectors):
            if raw is None:
                raise RuntimeError(f"input {index} finished without a vector")
            vector = truncate(from_bytes(raw), self.req.dimensions)
            if self.req.encoding_format == "base64":
                encoded: Any = base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
            else:
                encoded = vector.tolist()
            data.append({"object": "embedding", "index": index, "embedding": encoded})
        tokens = sum(len(r.prompt_token_ids) for r in self.engine_requests)
        return {"id": self.request_id, "object": "list", "created": int(time.time()),
                "model": self.ctx.model_name, "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


async def create_embedding(ctx: IngressContext, request: Request) -> Response:
    arrival = ctx.clock()
    body = await read_body(request, ctx.max_request_bytes)
    key = ctx.guard.admit(request.url.path, body)
    with ctx.guard.section(key):  # up to the engine requests: synchronous work only
        req, engine_requests, ticket, view = _prepare(ctx, body)
    return await respond(request, ctx, engine_requests, ticket, view, stream=False,
                         arrival=arrival, priority=req.priority or 0)


def add_embeddings_route(router, ctx: IngressContext, *, errors: dict[int, Any]) -> None:
    """Register POST /embeddings on `router` (the /v1 router: the API key applies)."""
    refusals = {400: {"model": ErrorResponse, "description": "Not a valid body (the message "
                      "and `param` name the field), an input longer than the model's context, "
                      "or `dimensions` outside 1 .. the model's hidden size."},
                404: {"model": ErrorResponse, "description": "`model` is not the served model."},
                408: {"model": ErrorResponse, "description": "The body did not arrive in time."},
                413: {"model": ErrorResponse, "description": "The body is larger than "
                      "--max-request-bytes."}}

    @router.post("/embeddings", openapi_extra=request_body(EmbeddingRequest),
                 responses={200: {"model": EmbeddingResponse}, **refusals, **errors})
    async def embeddings(request: Request) -> Response:
        """One vector per input, pooled by the model's pooler (OpenAI's shape)."""
        return await create_embedding(ctx, request)
