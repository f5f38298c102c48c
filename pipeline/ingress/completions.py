"""POST /v1/completions: text or token-id prompt(s), `n` samples each, optional echo."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from pagedserve.pipeline.ingress.context import IngressContext
from pagedserve.pipeline.ingress.errors import invalid
from pagedserve.pipeline.ingress.fim import fim_prompt, require_fim
from pagedserve.pipeline.ingress.generation import EngineRequest, new_request_id, prepend, respond, usage
from pagedserve.pipeline.ingress.logprobs import (CompletionLogprobs, joined, prompt_part,
                                                  vllm_prompt_logprobs)
from pagedserve.pipeline.ingress.protocol import CompletionRequest
from pagedserve.pipeline.ingress.streaming import DONE, sse
from pagedserve.pipeline.ingress.json_body import decode_json_object
from pagedserve.pipeline.ingress.lora_routes import resolve_model
from pagedserve.pipeline.ingress.validation import (DEFAULT_COMPLETION_MAX_TOKENS,
                                                    check_token_ids, parse_request, read_body,
                                                    resolve_max_tokens, validated_params)
from pagedserve.pipeline.outputs import RequestOutput


async def create_completion(ctx: IngressContext, request: Request) -> Response:
    arrival = ctx.clock()
    body = await read_body(request, ctx.max_request_bytes)
    key = ctx.guard.admit(request.url.path, body)
    with ctx.guard.section(key):  # up to the engine requests: synchronous work only
        req, engine_requests, ticket, view = _prepare(ctx, body)
    return await respond(request, ctx, engine_requests, ticket, view, stream=req.stream,
                         arrival=arrival, priority=req.priority or 0, cache_salt=req.cache_salt)


def _prepare(ctx: IngressContext, body: bytes):
    """Parse and check the body, tokenize the prompts: (the request, its engine requests,
    their admission ticket, the view that shapes their output)."""
    req = parse_request(CompletionRequest, decode_json_object(body))
    lora = resolve_model(ctx, req.model)
    req.check()
    prompts = req.prompts()
    # Each prompt is an engine request, and they all arrive in the scheduler's queue at once: a
    # batch larger than the queue would be a 503 forever, never admissible.
    most = ctx.admission.max_queued_requests
    if len(prompts) > most:
        raise invalid(f"prompt is a batch of {len(prompts)} prompts, but the engine queues at most "
                      f"{most} requests (--max-queued-requests)", "prompt")
    # max_tokens 0 (with echo): the prompt alone, as lm-evaluation-harness's loglikelihood asks;
    # the engine generates one token, which is dropped
    requested = 1 if req.max_tokens == 0 else req.max_tokens
    params = validated_params(
        lambda: msgspec.structs.replace(
            req.sampling_params(max_tokens=requested if requested is not None
                                else DEFAULT_COMPLETION_MAX_TOKENS, logprobs=req.logprobs),
            prompt_logprobs=req.num_prompt_logprobs),
        vocab_size=ctx.vocab_size, max_n=ctx.max_n)
    fim = require_fim(ctx.tokenizer, "suffix") if req.suffix else None
    ticket = ctx.admit(len(prompts))  # before any tokenization
    try:
        request_id = new_request_id("cmpl")
        engine_requests, prompt_texts = [], []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                prompt_texts.append(prompt)
            else:
                check_token_ids(prompt, ctx.vocab_size, "prompt")
                prompt_texts.append(ctx.tokenizer.decode(prompt) if req.echo else "")
            if fim is not None:  # fill in the middle: the prompt is the text before the gap
                ids = fim_prompt(ctx.tokenizer, fim, prompt, req.suffix)
            else:
                ids = ctx.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            ctx.guard.poison(ids)
            max_tokens = resolve_max_tokens(
                len(ids), requested, default=DEFAULT_COMPLETION_MAX_TOKENS,
                max_model_len=ctx.max_model_len, prompt_param="prompt",
                max_tokens_param="max_tokens")
            engine_requests.append(EngineRequest(
                f"{request_id}-{i}" if len(prompts) > 1 else request_id, ids,
                validated_params(lambda: msgspec.structs.replace(params, max_tokens=max_tokens),
                                 vocab_size=ctx.vocab_size, max_n=ctx.max_n), lora=lora))
    except BaseException:
        ticket.release()
        raise
    view = _CompletionView(ctx, req, request_id, engine_requests,
                           prompt_texts if req.echo else [""] * len(prompts))
    return req, engine_requests, ticket, view


class _CompletionView:
    """Shapes engine deltas into OpenAI completion responses and chunks."""

    def __init__(self, ctx: IngressContext, req: CompletionRequest, request_id: str,
                 engine_requests: list[EngineRequest], echo_texts: list[str]):
        self.ctx = ctx
        self.req = req
        self.request_id = request_id
        self.engine_requests = engine_requests
        self.echo_texts = echo_texts
        self.n = engine_requests[0].params.n
        self.created = int(time.time())
        self.num_prompt_tokens = sum(len(r.prompt_token_ids) for r in engine_requests)

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": "text_completion", "created": self.created,
                "model": self.ctx.model_name, "choices": choices}

    async def collect(self, stream: AsyncIterator) -> list[RequestOutput]:
        outputs = [RequestOutput.start(r.request_id, None, r.prompt_token_ids, r.params)
                   for r in self.engine_requests]
        async for pos, delta in stream:
            outputs[pos].apply(delta)
        return outputs

    def response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        choices, num_generated = [], 0
        for pos, out in enumerate(outputs):
            for sample in out.outputs:
                token_ids, text, lps, tops = self._generated(
                    sample.token_ids, sample.text, sample.logprobs, sample.top_logprobs)
                num_generated += len(token_ids)
                choice = {"index": pos * self.n + sample.index,
                          "text": self.echo_texts[pos] + text,
                          "logprobs": self._logprobs(out, CompletionLogprobs(
                              self.ctx.token_text, len(self.echo_texts[pos])), token_ids, lps, tops),
                          "finish_reason": sample.finish_reason,
                          "stop_reason": sample.stop_reason}
                self._first_chunk_extras(choice, out)
                if self.req.return_token_ids:
                    choice["token_ids"] = list(token_ids)
                choices.append(choice)
        body = self._envelope(choices)
        body["usage"] = usage(self.num_prompt_tokens, num_generated)
        return body

    def _generated(self, token_ids, text, logprobs, top_logprobs):
        """A sample's output as the client sees it: nothing for max_tokens 0 (echo alone)."""
        if self.req.max_tokens == 0:
            return [], "", None, None
        return token_ids, text, logprobs, top_logprobs

    def _logprobs(self, out: RequestOutput | None, shaper: CompletionLogprobs, token_ids,
                  logprobs, top_logprobs) -> dict[str, Any] | None:
        """Completions' logprobs of these output tokens; with echo and `out` given (the
        choice's first chunk), the prompt's first."""
        if self.req.logprobs is None:
            return None
        part = shaper.chunk(token_ids, logprobs, top_logprobs)
        if not self.req.echo or out is None:
            return part
        return joined(prompt_part(self.ctx.token_text, out.prompt_token_ids, out.prompt_logprobs,
                                  self.req.logprobs), part)

    def _first_chunk_extras(self, choice: dict[str, Any], out: RequestOutput) -> None:
        """What a choice's first chunk (or its whole answer) carries once: vLLM's
        prompt_logprobs, the prompt's token ids (return_token_ids)."""
        if self.req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(
                self.ctx.token_text, out.prompt_token_ids, out.prompt_logprobs)
        if self.req.return_token_ids:
            choice["prompt_token_ids"] = list(out.prompt_token_ids)

    async def sse(self, first: tuple[int, Any], stream: AsyncIterator) -> AsyncIterator[bytes]:
        include_usage = self.req.include_usage
        # each prompt's logprobs as they arrive (ahead of its first token)
        prompts = [RequestOutput(r.request_id, None, r.prompt_token_ids, [])
                   for r in self.engine_requests]
        shapers: dict[int, CompletionLogprobs] = {}
        num_generated = 0
        async for pos, delta in prepend(first, stream):
            if delta.prompt_logprobs is not None:
                prompts[pos].add_prompt_logprobs(delta.prompt_logprobs)
            token_ids, text, lps, tops = self._generated(
                delta.token_ids, delta.text, delta.logprobs, delta.top_logprobs)
            if not (text or token_ids or delta.finish_reason):
                continue
            index = pos * self.n + delta.index
            num_generated += len(token_ids)
            first_chunk = index not in shapers
            if first_chunk:  # the echo, and with logprobs the prompt's
                shapers[index] = CompletionLogprobs(self.ctx.token_text,
                                                    len(self.echo_texts[pos]))
                text = self.echo_texts[pos] + text
            out = prompts[pos] if first_chunk else None
            choice = {"index": index, "text": text,
                      "logprobs": self._logprobs(out, shapers[index], token_ids, lps, tops),
                      "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}
            if first_chunk:
                self._first_chunk_extras(choice, out)
            if self.req.return_token_ids:
                choice["token_ids"] = list(token_ids)
            chunk = self._envelope([choice])
            if include_usage:
                chunk["usage"] = None
            yield sse(chunk)
        if include_usage:
            final = self._envelope([])
            final["usage"] = usage(self.num_prompt_tokens, num_generated)
            yield sse(final)
        yield DONE
