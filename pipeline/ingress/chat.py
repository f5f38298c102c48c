"""POST /v1/chat/completions: messages through the model's chat template, `n` samples."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from pagedserve.pipeline.ingress.context import IngressContext, Ticket
from pagedserve.pipeline.ingress.errors import invalid
from pagedserve.pipeline.ingress.generation import (EngineRequest, collect_output, new_request_id,
                                                    prepend, respond, usage)
from pagedserve.pipeline.ingress.chat_output import ChoiceShaper
from pagedserve.pipeline.ingress.logprobs import chat_logprobs
from pagedserve.pipeline.ingress.reasoning import answer_only
from pagedserve.pipeline.ingress.protocol import ChatCompletionRequest
from pagedserve.pipeline.ingress.streaming import DONE, sse
from pagedserve.pipeline.ingress.tools import ToolPlan, plan_tools
from pagedserve.pipeline.ingress.json_body import decode_json_object
from pagedserve.pipeline.ingress.lora_routes import resolve_model
from pagedserve.pipeline.ingress.validation import (parse_request, read_body,
                                                    resolve_max_tokens, validated_params)
from pagedserve.pipeline.outputs import RequestOutput


def render_chat(tokenizer: Any, req: ChatCompletionRequest, tools: list[dict] | None = None,
                *, add_special_tokens: bool = False) -> list[int]:
    """The messages through the chat template, tokenized (the template writes its own special
    tokens: `add_special_tokens` adds the tokenizer's on top, as /tokenize may ask)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise invalid("this model has no chat template (its tokenizer defines none, as a base "
                      "model's does not): use /v1/completions, or start the server with "
                      "--chat-template (a file or an inline Jinja template)", "messages")
    extra = dict(req.chat_template_kwargs or {})  # its keys were checked by req.check()
    if tools:
        if "tools" not in str(template):
            raise invalid("this model's chat template does not render tools; start the server "
                          "with --chat-template naming one that does", "tools")
        extra["tools"] = tools
    try:
        text = tokenizer.apply_chat_template(
            [m.to_template() for m in req.messages], tokenize=False,
            add_generation_prompt=bool(req.add_generation_prompt),
            continue_final_message=bool(req.continue_final_message), **extra)
    except Exception as exc:  # jinja errors raised by the template itself ("roles must alternate")
        raise invalid(f"the chat template cannot render these messages: {exc}", "messages") from None
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


async def create_chat_completion(ctx: IngressContext, request: Request) -> Response:
    arrival = ctx.clock()
    body = await read_body(request, ctx.max_request_bytes)
    key = ctx.guard.admit(request.url.path, body)
    with ctx.guard.section(key):  # up to the engine request: synchronous work only
        req, engine_request, ticket, view = _prepare(ctx, body, key)
    return await respond(request, ctx, [engine_request], ticket, view, stream=req.stream,
                         arrival=arrival, priority=req.priority or 0, cache_salt=req.cache_salt)


def _prepare(ctx: IngressContext, body: bytes, key: str):
    """Parse and check the body, render and tokenize the messages: (the request, its engine
    request, its admission ticket, the view that shapes its output)."""
    req = parse_request(ChatCompletionRequest, decode_json_object(body))
    prepared = prepare_chat(ctx, req, new_request_id("chatcmpl"))
    view = _ChatView(ctx, req, prepared.engine_request, prepared.tool_plan, key)
    return req, prepared.engine_request, prepared.ticket, view


@dataclass(slots=True)
class PreparedChat:
    """A checked chat request ready to run: the engine request, the admission ticket it holds
    (the caller releases it), and how its output is read (None: no tools)."""
    engine_request: EngineRequest
    ticket: Ticket
    tool_plan: ToolPlan | None


def prepare_chat(ctx: IngressContext, req: ChatCompletionRequest, request_id: str
                 ) -> PreparedChat:
    """Check a parsed chat request against the served model, then render and tokenize its
    messages; every refusal is an APIError. Shared by /v1/chat/completions and /v1/messages."""
    lora = resolve_model(ctx, req.model)
    req.check()
    tool_plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, ctx.tool_call_parser)
    max_tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requested = req.requested_max_tokens
    params = validated_params(
        lambda: req.sampling_params(max_tokens=requested, logprobs=req.num_logprobs),
        vocab_size=ctx.vocab_size, max_n=ctx.max_n,
        param_names={"logprobs": "top_logprobs", "max_tokens": max_tokens_param})
    if tool_plan is not None and tool_plan.constraint is not None:
        if params.structured_outputs is not None:
            raise invalid(f"tool_choice {tool_plan.mode} constrains the output itself: it cannot "
                          "be combined with response_format or structured_outputs", "tool_choice")
        params = msgspec.structs.replace(params, structured_outputs=tool_plan.constraint)
    if ctx.reasoning_parser and params.structured_outputs is not None:
        params = msgspec.structs.replace(params, structured_outputs=answer_only(
            params.structured_outputs, ctx.reasoning_parser, ctx.tokenizer))
    ticket = ctx.admit(1)  # before rendering and tokenizing
    try:
        ids = render_chat(ctx.tokenizer, req, tool_plan.tools if tool_plan else None)
        ctx.guard.poison(ids)
        max_tokens = resolve_max_tokens(len(ids), requested, default=None,
                                        max_model_len=ctx.max_model_len, prompt_param="messages",
                                        max_tokens_param=max_tokens_param)
        params = validated_params(lambda: msgspec.structs.replace(params, max_tokens=max_tokens),
                                  vocab_size=ctx.vocab_size, max_n=ctx.max_n,
                                  param_names={"max_tokens": max_tokens_param})
    except BaseException:
        ticket.release()
        raise
    return PreparedChat(EngineRequest(request_id, ids, params, lora=lora), ticket, tool_plan)


class _ChatView:
    """Shapes engine deltas into OpenAI chat completion responses and chunks."""

    def __init__(self, ctx: IngressContext, req: ChatCompletionRequest, engine_request: EngineRequest,
                 tool_plan: ToolPlan | None = None, key: str = ""):
        self.ctx = ctx
        self.key = key  # the request's quarantine key (request_guard.py)
        self.req = req
        self.shapers = [ChoiceShaper(tool_plan, ctx.reasoning_parser)
                        for _ in range(engine_request.params.n)]
        self.engine_request = engine_request
        self.n = engine_request.params.n
        self.num_top = req.num_logprobs or 0
        self.created = int(time.time())

    def _logprobs(self, token_ids, logprobs, top_logprobs) -> dict[str, Any] | None:
        if self.req.num_logprobs is None:
            return None
        return chat_logprobs(self.ctx.token_text, token_ids, logprobs, top_logprobs, self.num_top)

    async def collect(self, stream: AsyncIterator) -> RequestOutput:
        return await collect_output(self.engine_request, stream, self.n)

    def response(self, out: RequestOutput) -> dict[str, Any]:
        with self.ctx.guard.section(self.key):
            choices = [{"index": s.index,
                        "message": self.shapers[s.index].message(s.text),
                        "logprobs": self._logprobs(s.token_ids, s.logprobs, s.top_logprobs),
                        "finish_reason": self.shapers[s.index].finish_reason(s.text,
                                                                             s.finish_reason),
                        "stop_reason": s.stop_reason}
                       for s in out.outputs]
        body = {"id": out.request_id, "object": "chat.completion", "created": self.created,
                "model": self.ctx.model_name, "choices": choices,
                "usage": usage(len(out.prompt_token_ids),
                               sum(len(s.token_ids) for s in out.outputs))}
        if self.req.return_token_ids:
            body["prompt_token_ids"] = list(out.prompt_token_ids)
            for choice, s in zip(choices, out.outputs):
                choice["token_ids"] = list(s.token_ids)
        return body

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {"id": self.engine_request.request_id, "object": "chat.completion.chunk",
                 "created": self.created, "model": self.ctx.model_name, "choices": choices}
        if self.req.include_usage:
            chunk["usage"] = None
        return chunk

    async def sse(self, first: tuple[int, Any], stream: AsyncIterator) -> AsyncIterator[bytes]:
        for i in range(self.n):
            chunk = self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}])
            if self.req.return_token_ids:
                chunk["prompt_token_ids"] = list(self.engine_request.prompt_token_ids)
            yield sse(chunk)
        num_generated = 0
        async for _, delta in prepend(first, stream):
            if not (delta.text or delta.token_ids or delta.finish_reason):
                continue
            num_generated += len(delta.token_ids)
            shaper = self.shapers[delta.index]
            if shaper.plain:
                parts = [{"content": delta.text}] if delta.text else [{}]
            else:  # reasoning and tool calls: as many deltas as the text makes, maybe none
                with self.ctx.guard.section(self.key):
                    parts = shaper.deltas(delta.text, final=delta.finish_reason is not None)
                parts = parts or [{}]
            for k, part in enumerate(parts):
                last = k == len(parts) - 1
                if not (part or last):
                    continue
                choice = {"index": delta.index, "delta": part,
                          "logprobs": self._logprobs(delta.token_ids, delta.logprobs,
                                                     delta.top_logprobs) if last else None,
                          "finish_reason": None}
                if last and delta.finish_reason is not None:
                    reason = delta.finish_reason
                    if reason == "stop" and shaper.called:
                        reason = "tool_calls"
                    choice["finish_reason"], choice["stop_reason"] = reason, delta.stop_reason
                if last and self.req.return_token_ids:
                    choice["token_ids"] = list(delta.token_ids)
                if part or last and (delta.finish_reason is not None or delta.token_ids):
                    yield sse(self._chunk([choice]))
        if self.req.include_usage:
            final = self._chunk([])
            final["usage"] = usage(len(self.engine_request.prompt_token_ids), num_generated)
            yield sse(final)
        yield DONE
