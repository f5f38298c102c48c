"""The router's HTTP face: OpenAI's routes (the engines' own bodies and errors pass through),
API keys, /health, /metrics.

A body is read as the engines' ingress reads it (pipeline/ingress/validation.py): at most
MAX_BODY_BYTES (413, refused by Content-Length before reading when it says so), all of it
within limits.BODY_TIMEOUT_S (408: a client trickling a body would hold the connection), JSON
of bounded nesting; headers and URL are bounded (431/414) before any route runs."""
from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from fastapi import Depends, FastAPI, Request
from starlette.responses import JSONResponse, Response

from pagedserve.pipeline.config import ServerArgs
from pagedserve.pipeline.ingress.errors import APIError
from pagedserve.pipeline.ingress.limits import HeaderLimits
from pagedserve.pipeline.ingress.streaming import EngineStreamResponse
from pagedserve.pipeline.ingress.validation import read_json_object
from pagedserve.pipeline.ingress.webui import add_webui_routes
from pagedserve.pipeline.router.infill import stream_infill
from pagedserve.pipeline.router.lora import broadcast
from pagedserve.pipeline.router.models import ModelUnavailable
from pagedserve.pipeline.router.passthrough import anthropic_error, stream_messages
from pagedserve.pipeline.router.prompts import NON_GENERATING
from pagedserve.pipeline.router.ratelimit import retry_after_header
from pagedserve.pipeline.router.responses import stream_responses
from pagedserve.pipeline.router.service import Routed, RouterError, RouterService
from pagedserve.pipeline.router.upstream import DONE, ReplicaRefused
from pagedserve.pipeline.router.webui import router_state

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# The ingress's limit (ServerArgs.max_request_bytes): a larger body would only be refused by
# the replica, after the router had held all of it.
MAX_BODY_BYTES = ServerArgs().max_request_bytes


def _error(exc: RouterError) -> JSONResponse:
    headers = dict(exc.headers)
    if exc.retry_after is not None:
        headers["Retry-After"] = retry_after_header(exc.retry_after)
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def _sse(event: dict[str, Any] | str) -> bytes:
    if event == DONE:
        return b"data: [DONE]\n\n"
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


class ApiKeys:
    """The keys `/v1/*` accepts (`Authorization: Bearer <key>`); none configured: open."""

    def __init__(self, keys: list[str], service: RouterService):
        self.keys = [k.encode() for k in keys]
        self.service = service

    def caller(self, request: Request) -> str:
        """The request's key ("" without keys configured); RouterError 401 otherwise."""
        if not self.keys:
            return ""
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = [token.strip()] if scheme.lower() == "bearer" else []
        given.append(request.headers.get("x-api-key", ""))  # Anthropic's clients send this
        for token in given:
            if any(secrets.compare_digest(token.encode(), k) for k in self.keys):
                return token
        self.service.metrics.rejected.labels("unauthorized").inc()
        raise RouterError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>' "
                          "(or 'x-api-key: <key>').", code="invalid_api_key")


# Streams the router passes through as they come (not resumed): the others are OpenAI's.
_STREAMS = {"messages": stream_messages, "infill": stream_infill, "responses": stream_responses}


async def _generate(service: RouterService, keys: ApiKeys, kind: str,
                    request: Request) -> Response:
    error = anthropic_error if kind == "messages" else _error  # each API's own error shape
    try:
        api_key = keys.caller(request)
        body = await _json_body(request, service)
        routed = service.route(kind, body, api_key)
        try:
            await service.models.acquire(routed.model)
        except ModelUnavailable as exc:
            service.unserved(routed)
            service.metrics.rejected.labels("model_unavailable").inc()
            raise RouterError(503, str(exc), code="model_unavailable",
                              retry_after=exc.retry_after) from None
    except RouterError as exc:
        return error(exc)
    if body.get("stream") and kind not in NON_GENERATING:
        return await _STREAMS.get(kind, _streamed)(service, routed)
    try:
        status, content, headers = await service.complete(routed)
    except RouterError as exc:
        return error(exc)
    finally:
        await service.models.release(routed.model)
    return Response(content, status_code=status, headers=headers, media_type="application/json")


def build_router_app(service: RouterService, api_keys: list[str],
                     lifespan: Callable[[FastAPI], AbstractAsyncContextManager] | None = None
                     ) -> FastAPI:
    app = FastAPI(title="pagedserve router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(HeaderLimits)
    keys = ApiKeys(api_keys, service)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _generate(service, keys, "chat", request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(service, keys, "completion", request)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await _generate(service, keys, "messages", request)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await _generate(service, keys, "responses", request)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await _generate(service, keys, "embeddings", request)

    # vLLM's /tokenize and /detokenize, llama.cpp's /infill: the same keys and limits
    for path, kind in (("/tokenize", "tokenize"), ("/detokenize", "detokenize"),
                       ("/infill", "infill")):
        app.add_api_route(path, _forwarder(service, keys, kind), methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            keys.caller(request)
        except RouterError as exc:
            return _error(exc)
        created = int(time.time())
        return JSONResponse({"object": "list", "data": [
            _model_card(service, m, created) for m in service.models.slots.models]
            + service.adapters.cards(created)})

    add_lora_routes(app, service, keys)

    @app.get("/health")
    async def health() -> Response:
        """200 while some replica of a loaded model is healthy, or models wait to be loaded."""
        loaded = service.models.slots.loaded_models()
        if not loaded or any(service.core.of_model(m) for m in loaded):
            return Response(status_code=200)
        return JSONResponse({"error": {"message": "no healthy replica", "type": "server_error"}},
                            status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.render(service.core), media_type=PROMETHEUS_CONTENT_TYPE)

    # the engines' web page; its /engine/state lists every replica, behind the keys
    app.add_exception_handler(RouterError, lambda _request, exc: _error(exc))
    add_webui_routes(app, router_state(service), dependencies=[Depends(keys.caller)])

    return app


def add_lora_routes(app: FastAPI, service: RouterService, keys: ApiKeys) -> None:
    """vLLM's adapter loading, sent to every replica of the model (`base_model`: which one,
    when the router serves several) and remembered for routing (lora.py)."""
    for path, loading in (("/v1/load_lora_adapter", True), ("/v1/unload_lora_adapter", False)):
        app.add_api_route(path, _lora_forwarder(service, keys, path, loading), methods=["POST"])


def _lora_forwarder(service: RouterService, keys: ApiKeys, path: str, loading: bool):
    async def forward(request: Request) -> Response:
        try:
            keys.caller(request)
            body = await _json_body(request, service)
        except RouterError as exc:
            return _error(exc)
        name, served = body.get("lora_name"), service.models.slots.models
        base = body.pop("base_model", None) or (served[0] if len(served) == 1 else None)
        if not loading:
            base = service.adapters.base(name) or base
        if base not in served:
            return _error(RouterError(400, f"base_model must name one of the served models "
                                           f"({', '.join(served)})", code="invalid_base_model"))
        status, content = await broadcast(service.http, service.core.of_model(base), path, body)
        if status == 200 and isinstance(name, str):
            if loading:
                service.adapters.add(name, base, body)
            else:
                service.adapters.remove(name)
        return Response(content, status_code=status, media_type="application/json")
    return forward


def _model_card(service: RouterService, model: str, created: int) -> dict[str, Any]:
    """A served model as /v1/models lists it: its state, and what its replicas reported of
    themselves once one was ready (capabilities, max_model_len; absent before)."""
    card = {"id": model, "object": "model", "created": created, "owned_by": "pagedserve",
            "state": service.models.state(model).value}
    for replica in service.core.of_model(model, healthy_only=False):
        if replica.capabilities:
            card["capabilities"] = list(replica.capabilities)
            card["max_model_len"] = replica.max_model_len
            break
    return card


def _forwarder(service: RouterService, keys: ApiKeys, kind: str):
    async def forward(request: Request) -> Response:
        return await _generate(service, keys, kind, request)
    return forward


async def _json_body(request: Request, service: RouterService) -> dict[str, Any]:
    try:
        return await read_json_object(request, MAX_BODY_BYTES)
    except APIError as exc:
        service.metrics.rejected.labels(exc.code or "invalid_body").inc()
        raise RouterError(exc.status, exc.message, code=exc.code or "invalid_body",
                          headers=exc.headers) from None


async def _streamed(service: RouterService, routed: Routed) -> Response:
    """Wait for the first event before the headers, so that a refusal is still a status."""
    events = service.stream(routed)
    try:
        first = await events.__anext__()
    except ReplicaRefused as refused:
        await service.models.release(routed.model)
        return Response(refused.body, status_code=refused.status, headers=refused.headers,
                        media_type="application/json")
    except RouterError as exc:
        await service.models.release(routed.model)
        return _error(exc)
    except BaseException:
        await service.models.release(routed.model)
        raise

    async def body() -> AsyncIterator[bytes]:
        yield _sse(first)
        try:
            async for event in events:
                yield _sse(event)
        except RouterError as exc:  # after the headers: only the stream can tell
            yield _sse(exc.body())
            yield _sse(DONE)

    async def on_close() -> None:
        await events.aclose()
        await service.models.release(routed.model)

    return EngineStreamResponse(body(), on_close)
