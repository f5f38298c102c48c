"""The FastAPI application: routes, API-key check, and OpenAI-shaped errors for everything."""
from __future__ import annotations

import logging
import secrets
import time
from contextlib import AbstractAsyncContextManager
from collections.abc import Callable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, PlainTextResponse, Response

from pagedserve.pipeline.ingress.anthropic_messages import MESSAGES_MODELS, add_messages_route
from pagedserve.pipeline.ingress.capabilities import model_capabilities
from pagedserve.pipeline.ingress.chat import create_chat_completion
from pagedserve.pipeline.ingress.completions import create_completion
from pagedserve.pipeline.ingress.context import IngressContext
from pagedserve.pipeline.ingress.embeddings import MODELS as EMBEDDING_MODELS
from pagedserve.pipeline.ingress.embeddings import add_embeddings_route
from pagedserve.pipeline.ingress.errors import APIError, error_body
from pagedserve.pipeline.ingress.infill import InfillRequest, InfillResponse, add_infill_route
from pagedserve.pipeline.ingress.limits import HeaderLimits
from pagedserve.pipeline.ingress.lora_routes import LORA_MODELS, add_lora_routes, model_cards
from pagedserve.pipeline.ingress.openapi import (API_KEY_ERRORS, HEALTH_RESPONSES,
                                                 LIMIT_ERRORS, METRICS_RESPONSES,
                                                 ChatCompletionChunk,
                                                 ChatCompletionResponse, CompletionChunk,
                                                 CompletionResponse, ModelList, VersionInfo,
                                                 generation_responses, install_openapi,
                                                 request_body)
from pagedserve.pipeline.ingress.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.pipeline.ingress.replica_secret import ReplicaSecretCheck
from pagedserve.pipeline.ingress.responses_api import RESPONSES_MODELS, add_responses_route
from pagedserve.pipeline.ingress.tokenize import REQUEST_MODELS as TOKENIZE_MODELS
from pagedserve.pipeline.ingress.tokenize import add_token_routes
from pagedserve.pipeline.ingress.webui import add_webui_routes, ingress_state

log = logging.getLogger("pagedserve.ingress")

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("pagedserve")
    except Exception:  # running from a source tree that was never installed
        return "0.1.0"


def build_app(ctx: IngressContext,
              lifespan: Callable[[FastAPI], AbstractAsyncContextManager] | None = None,
              replica_secret: str | None = None) -> FastAPI:
    """`replica_secret`: the router's, when this engine is one of its replicas (every route
    but /health then needs it)."""
    app = FastAPI(title="pagedserve", version=_version(), lifespan=lifespan,
                  description="An OpenAI-compatible LLM server (vLLM's sampling extras).",
                  docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.ctx = ctx
    _install_error_handlers(app)
    if replica_secret is not None:
        app.add_middleware(ReplicaSecretCheck, secret=replica_secret)
    app.add_middleware(HeaderLimits)  # outermost: bounds the headers before anything reads them
    install_openapi(app, limits=openapi_limits(ctx), api_key=ctx.api_key is not None,
                    request_models=(*TOKENIZE_MODELS, InfillRequest, InfillResponse,
                                    *MESSAGES_MODELS, *RESPONSES_MODELS, *EMBEDDING_MODELS,
                                    *LORA_MODELS))
    v1_errors = {**LIMIT_ERRORS, **(API_KEY_ERRORS if ctx.api_key is not None else {})}

    async def check_api_key(request: Request) -> None:
        if ctx.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(),
                                                                    ctx.api_key.encode()):
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                           code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @v1.post("/completions", openapi_extra=request_body(CompletionRequest),
             responses={**generation_responses(CompletionResponse, CompletionChunk),
                        **v1_errors})
    async def completions(request: Request) -> Response:
        """Text completion of a prompt, a batch of prompts, or token ids."""
        return await create_completion(ctx, request)

    @v1.post("/chat/completions", openapi_extra=request_body(ChatCompletionRequest),
             responses={**generation_responses(ChatCompletionResponse, ChatCompletionChunk),
                        **v1_errors})
    async def chat_completions(request: Request) -> Response:
        """Chat completion: the messages through the model's chat template."""
        return await create_chat_completion(ctx, request)

    add_embeddings_route(v1, ctx, errors=v1_errors)
    add_lora_routes(v1, ctx, errors=v1_errors)

    capabilities = model_capabilities(ctx.tokenizer, ctx.tool_call_parser, ctx.reasoning_parser,
                                      encoder=ctx.is_encoder)

    @v1.get("/models", response_model=None, responses={200: {"model": ModelList}, **v1_errors})
    async def models() -> dict:
        """The served model, with what it can do (`capabilities`)."""
        created = int(time.time())
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "pagedserve",
             "root": ctx.model_root or name, "parent": None, "max_model_len": ctx.max_model_len,
             "capabilities": capabilities}
            for name in ctx.served_model_names] + model_cards(ctx, created, capabilities)}

    app.include_router(v1)
    # vLLM's and llama.cpp's routes outside /v1, behind the same key
    add_token_routes(app, ctx, dependencies=[Depends(check_api_key)], errors=v1_errors)
    add_infill_route(app, ctx, dependencies=[Depends(check_api_key)], errors=v1_errors)
    add_messages_route(app, ctx, LIMIT_ERRORS)  # Anthropic's API: its own errors and keys
    add_responses_route(app, ctx, dependencies=[Depends(check_api_key)], errors=v1_errors)
    # the web page (open: it asks for the key) and its engine panel's state (behind the key)
    add_webui_routes(app, ingress_state(ctx), dependencies=[Depends(check_api_key)])

    @app.get("/health", response_class=Response, responses={**HEALTH_RESPONSES, **LIMIT_ERRORS})
    async def health() -> Response:
        """200 while the engine answers, else 503."""
        if await ctx.engine.health():
            return Response(status_code=200)
        return JSONResponse(error_body("the engine is not healthy", type="server_error",
                                       code="engine_unavailable"), status_code=503)

    @app.get("/version", response_model=None,
             responses={200: {"model": VersionInfo}, **LIMIT_ERRORS})
    async def version() -> dict:
        return {"version": _version()}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={**METRICS_RESPONSES, **LIMIT_ERRORS})
    async def metrics() -> Response:
        """Prometheus metrics: the engine's gauges and counters, the ingress's latencies."""
        await ctx.refresh_stats()
        return Response(ctx.metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)

    return app


def openapi_limits(ctx: IngressContext) -> dict[str, tuple[str, int]]:
    """The served model's limits, as the schema keyword that documents each."""
    return {"token_id": ("maximum", ctx.vocab_size - 1), "n": ("maximum", ctx.max_n),
            "max_tokens": ("maximum", ctx.max_model_len - 1),
            "prompts": ("maxItems", ctx.admission.max_queued_requests),
            "dimensions": ("maximum", max(ctx.hidden_size, 1))}


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), type=kind), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(str(exc)), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        return JSONResponse(error_body(f"internal server error: {type(exc).__name__}",
                                       type="server_error"), status_code=500)
