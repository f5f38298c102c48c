"""POST /infill: llama.cpp's fill-in-the-middle endpoint, as editor plugins (llama.vim,
Continue, Tabby) call it.

The body: `input_prefix` (the text before the cursor), `input_suffix` (after it),
`input_extra` ([{filename, text}]: other files, as repository context), `prompt` (the start of
the middle, continued by the model), `n_predict` (llama.cpp's max tokens; -1: up to the
context) and the sampling fields of /v1/completions. The answer is llama.cpp's: one JSON body
`{content, tokens, stop, stop_type, stopping_word, tokens_predicted, tokens_evaluated, ...}`, or
with `stream: true` one such event per delta (`stop: false`), then a last one with `stop: true`
and no `[DONE]` (llama.cpp's own endpoints send none). The prompt is fim.py's.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Literal

import msgspec
from fastapi import FastAPI
from pydantic import BaseModel, Field
from starlette.requests import Request
from starlette.responses import Response

from pagedserve.pipeline.ingress.context import IngressContext
from pagedserve.pipeline.ingress.errors import invalid
from pagedserve.pipeline.ingress.fim import ExtraFile, fim_prompt, require_fim
from pagedserve.pipeline.ingress.generation import (EngineRequest, collect_output, new_request_id,
                                                    prepend, respond)
from pagedserve.pipeline.ingress.json_body import decode_json_object
from pagedserve.pipeline.ingress.openapi import generation_responses, request_body
from pagedserve.pipeline.ingress.protocol import RequestBody, documented, SamplingFields
from pagedserve.pipeline.ingress.streaming import sse
from pagedserve.pipeline.ingress.validation import (check_model_name, parse_request, read_body,
                                                    resolve_max_tokens, validated_params)
from pagedserve.pipeline.outputs import RequestOutput


class InfillExtra(RequestBody):
    filename: str | None = "tmp"  # llama.cpp's default name
    text: str | None = ""


class InfillRequest(SamplingFields):
    input_prefix: str | None = Field("", description="the text before the gap")
    input_suffix: str | None = Field("", description="the text after the gap")
    input_extra: list[InfillExtra] | None = Field(None, description="other files: context")
    prompt: str | None = Field("", description="the start of the middle, continued")
    n_predict: documented(int, type="integer", minimum=-1, **{"not": {"const": 0}}) | None = Field(
        None, description="llama.cpp's max_tokens (max_tokens wins); -1: up to the context")
    return_tokens: bool | None = Field(False, description="the generated token ids in `tokens`")

    def check(self) -> None:
        self.check_common()
        if self.n not in (None, 1):
            raise invalid(f"/infill answers one completion: n must be 1, got {self.n}", "n")
        if self.n_predict is not None and self.n_predict < -1 or self.n_predict == 0:
            raise invalid(f"n_predict must be -1 (up to the context) or at least 1, got "
                          f"{self.n_predict}", "n_predict")

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_tokens is not None:
            return self.max_tokens
        return None if self.n_predict in (None, -1) else self.n_predict


class InfillResponse(BaseModel):
    """llama.cpp's answer (and, with `stop: false`, each event of a stream)."""
    index: int
    content: str
    tokens: list[int]
    id_slot: int
    stop: bool
    model: str
    tokens_predicted: int
    tokens_evaluated: int
    has_new_line: bool | None = None
    truncated: bool | None = None
    stop_type: Literal["none", "eos", "limit", "word"] | None = None
    stopping_word: str | None = None


def _prepare(ctx: IngressContext, body: bytes):
    req = parse_request(InfillRequest, decode_json_object(body))
    check_model_name(req.model, ctx.served_model_names)
    req.check()
    fim = require_fim(ctx.tokenizer, "input_suffix")
    requested = req.requested_max_tokens
    param = "max_tokens" if req.max_tokens is not None else "n_predict"
    params = validated_params(lambda: req.sampling_params(max_tokens=requested, logprobs=None),
                              vocab_size=ctx.vocab_size, max_n=ctx.max_n,
                              param_names={"max_tokens": param})
    ticket = ctx.admit(1)  # before tokenizing
    try:
        extra = [ExtraFile(e.filename or "tmp", e.text or "") for e in req.input_extra or ()]
        ids = fim_prompt(ctx.tokenizer, fim, req.input_prefix or "", req.input_suffix or "",
                         middle=req.prompt or "", extra=extra)
        ctx.guard.poison(ids)
        max_tokens = resolve_max_tokens(len(ids), requested, default=None,
                                        max_model_len=ctx.max_model_len,
                                        prompt_param="input_prefix", max_tokens_param=param)
        params = validated_params(lambda: msgspec.structs.replace(params, max_tokens=max_tokens),
                                  vocab_size=ctx.vocab_size, max_n=ctx.max_n,
                                  param_names={"max_tokens": param})
    except BaseException:
        ticket.release()
        raise
    engine_request = EngineRequest(new_request_id("infill"), ids, params)
    return req, engine_request, ticket, _InfillView(ctx, req, engine_request)


async def create_infill(ctx: IngressContext, request: Request) -> Response:
    arrival = ctx.clock()
    body = await read_body(request, ctx.max_request_bytes)
    key = ctx.guard.admit(request.url.path, body)
    with ctx.guard.section(key):
        req, engine_request, ticket, view = _prepare(ctx, body)
    return await respond(request, ctx, [engine_request], ticket, view, stream=bool(req.stream),
                         arrival=arrival, priority=req.priority or 0, cache_salt=req.cache_salt)


def _stop_type(finish_reason: str | None, stop_reason: Any) -> str:
    if finish_reason == "length":
        return "limit"
    if finish_reason == "stop":
        return "word" if isinstance(stop_reason, str) else "eos"
    return "none"


class _InfillView:
    """Shapes engine deltas into llama.cpp's /infill answer and stream events."""

    def __init__(self, ctx: IngressContext, req: InfillRequest, engine_request: EngineRequest):
        self.ctx, self.req, self.engine_request = ctx, req, engine_request

    def _event(self, content: str, token_ids: list[int], num_generated: int, stop: bool
               ) -> dict[str, Any]:
        return {"index": 0, "content": content,
                "tokens": list(token_ids) if self.req.return_tokens else [],
                "id_slot": -1, "stop": stop, "model": self.ctx.model_name,
                "tokens_predicted": num_generated,
                "tokens_evaluated": len(self.engine_request.prompt_token_ids)}

    def _final(self, event: dict[str, Any], text: str, finish_reason: str | None,
               stop_reason: Any) -> dict[str, Any]:
        event.update(has_new_line="\n" in text, truncated=False,
                     stop_type=_stop_type(finish_reason, stop_reason),
                     stopping_word=stop_reason if isinstance(stop_reason, str) else "")
        return event

    async def collect(self, stream: AsyncIterator) -> RequestOutput:
        return await collect_output(self.engine_request, stream)

    def response(self, out: RequestOutput) -> dict[str, Any]:
        sample = out.outputs[0]
        event = self._event(sample.text, sample.token_ids, len(sample.token_ids), stop=True)
        return self._final(event, sample.text, sample.finish_reason, sample.stop_reason)

    async def sse(self, first: tuple[int, Any], stream: AsyncIterator) -> AsyncIterator[bytes]:
        num_generated, text = 0, []
        async for _, delta in prepend(first, stream):
            num_generated += len(delta.token_ids)
            text.append(delta.text)
            if delta.text or delta.token_ids:
                yield sse(self._event(delta.text, delta.token_ids, num_generated, stop=False))
            if delta.finish_reason is not None:
                final = self._event("", [], num_generated, stop=True)
                yield sse(self._final(final, "".join(text), delta.finish_reason,
                                      delta.stop_reason))
                return


def add_infill_route(app: FastAPI, ctx: IngressContext, *, dependencies: list,
                     errors: dict[int, Any]) -> None:
    """Register POST /infill on `app` (behind `dependencies`: the API key)."""
    responses = generation_responses(InfillResponse, InfillResponse)
    responses[200] = {**responses[200], "description": "One JSON body, or with `stream: true` "
                      "server-sent events: `data: <event JSON>` per delta (`stop: false`), then "
                      "one with `stop: true`, and no `[DONE]` (llama.cpp's way); an error after "
                      "the first event is one `data: <error JSON>` event, then `data: [DONE]`."}

    @app.post("/infill", dependencies=dependencies, openapi_extra=request_body(InfillRequest),
              responses={**responses, **errors})
    async def infill(request: Request) -> Response:
        """Fill in the middle of a file (llama.cpp's /infill; a model with FIM tokens)."""
        return await create_infill(ctx, request)
