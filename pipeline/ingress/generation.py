"""Running engine requests for one HTTP request: submit, merge their streams, time them,
map engine errors, and abort everything when the client goes away.

Aborting is the engine client's job: leaving `AsyncEngineClient.generate` early (close or
cancellation) sends Abort. So every exit path here closes or cancels its generators.
"""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedserve.pipeline.ingress.context import IngressContext, Ticket
from pagedserve.pipeline.ingress.errors import APIError, from_engine_error
from pagedserve.pipeline.ingress.streaming import EngineStreamResponse, with_error_event
from pagedserve.pipeline.outputs import CompletionOutput, RequestError, RequestOutput
from pagedserve.pipeline.lora_request import LoRARequest
from pagedserve.pipeline.pooling import PoolingParams
from pagedserve.pipeline.sampling_params import SamplingParams

T = TypeVar("T")


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    pooling: PoolingParams | None = None  # an embedding request (ingress/embeddings.py)
    lora: LoRARequest | None = None  # the LoRA adapter its `model` named (lora_routes.py)


async def collect_output(request: EngineRequest, stream: AsyncIterator, n: int = 1
                         ) -> RequestOutput:
    """One request's whole output, its `n` samples' deltas applied as they come."""
    out = RequestOutput(request.request_id, None, request.prompt_token_ids,
                        [CompletionOutput(index=i) for i in range(n)])
    async for _, delta in stream:
        out.apply(delta)
    return out


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def _timed(ctx: IngressContext, req: EngineRequest, arrival: float, priority: int,
                 cache_salt: str | None) -> AsyncIterator[Any]:
    timer = ctx.metrics.timer(arrival)
    extra = {} if req.pooling is None else {"pooling": req.pooling}
    if req.lora is not None:
        extra["lora"] = req.lora
    stream = ctx.engine.generate(req.prompt_token_ids, req.params, request_id=req.request_id,
                                 priority=priority, cache_salt=cache_salt, **extra)
    timer.submitted(ctx.clock())
    accepted = False
    try:
        async for delta in stream:
            accepted = True
            timer.on_delta(delta, ctx.clock())
            yield delta
        timer.finished(ctx.clock())
    except RequestError as exc:
        if exc.status == 503 and not accepted:  # refused at the door: the queue is full
            ctx.admission.observe_rejection(ctx.clock())
        raise from_engine_error(exc.status, exc.message) from None
    except (ConnectionError, RuntimeError) as exc:
        raise APIError(503, f"the engine is unavailable: {exc}", type="server_error",
                       code="engine_unavailable") from None
    except (GeneratorExit, asyncio.CancelledError):  # the client left: the engine aborts it
        if req.pooling is None:
            timer.abandoned(req.params.n)
        raise
    finally:
        await stream.aclose()


async def stream_requests(ctx: IngressContext, requests: list[EngineRequest], *, arrival: float,
                          priority: int = 0, cache_salt: str | None = None
                          ) -> AsyncIterator[tuple[int, Any]]:
    """(request position, TextDelta) in arrival order across all `requests` until all finish."""
    streams = [_timed(ctx, r, arrival, priority, cache_salt) for r in requests]
    if len(streams) == 1:
        try:
            async for delta in streams[0]:
                yield 0, delta
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(pos: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for delta in stream:
                queue.put_nowait((pos, delta, None))
            queue.put_nowait((pos, None, None))
        except Exception as exc:  # handed to the consumer, which re-raises it
            queue.put_nowait((pos, None, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(tasks)
        while open_streams:
            pos, delta, exc = await queue.get()
            if exc is not None:
                raise exc
            if delta is None:
                open_streams -= 1
            else:
                yield pos, delta
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def prepend(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    yield first
    async for item in rest:
        yield item


async def until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Run `work`; if the client disconnects first, cancel it (aborting its engine requests)
    and return None. Only for a request whose body has been read."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # Also reached when this handler itself is cancelled (the server shutting down).
        watch_task.cancel()
        if not work_task.done():
            work_task.cancel()
        await asyncio.gather(watch_task, work_task, return_exceptions=True)
    if work_task.cancelled():
        return None
    return work_task.result()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def first_item(stream: AsyncIterator[T], ticket: Ticket) -> T:
    """Wait for a stream's first item before sending headers, so that a refusal from the engine
    (400, 503 + Retry-After) is still an HTTP status and not an error inside a 200 stream."""
    try:
        return await stream.__anext__()
    except BaseException:
        ticket.release()
        await stream.aclose()
        raise


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}


async def sse_response(request: Request, stream: AsyncIterator, ticket: Ticket,
                       render: Callable[[Any, AsyncIterator], AsyncIterator[bytes]],
                       error_event: Callable[[AsyncIterator[bytes]], AsyncIterator[bytes]]
                       = with_error_event) -> Response:
    """Prime `stream`, then stream `render(first, stream)` as SSE, a failure after the headers
    sent as `error_event` writes it (an API's own shape); when the response ends in any way,
    close every layer (aborting unfinished engine requests) and release the ticket."""
    first = await until_disconnect(request, first_item(stream, ticket))
    if first is None:
        return Response(status_code=499)  # gone before the first token; already aborted
    body = render(first, stream)
    wrapped = error_event(body)

    async def on_close() -> None:
        await wrapped.aclose()
        await body.aclose()
        await stream.aclose()
        ticket.release()

    return EngineStreamResponse(wrapped, on_close)


async def collect_until_done(request: Request, stream: AsyncIterator, ticket: Ticket,
                             collect: Callable[[AsyncIterator], Awaitable[T]]) -> T | None:
    """`await collect(stream)` for a non-streaming response; None when the client left first
    (its engine requests are aborted by then). Releases the ticket either way."""
    try:
        return await until_disconnect(request, collect(stream))
    finally:
        ticket.release()
        await stream.aclose()


async def respond(request: Request, ctx: IngressContext, engine_requests: list[EngineRequest],
                  ticket: Ticket, view, *, stream: bool, arrival: float, priority: int,
                  cache_salt: str | None = None,
                  error_event: Callable[[AsyncIterator[bytes]], AsyncIterator[bytes]]
                  = with_error_event) -> Response:
    """Run the engine requests and answer with SSE chunks or one JSON body shaped by `view`
    (an object with `sse`, `collect` and `response`); `error_event`: see `sse_response`."""
    events = stream_requests(ctx, engine_requests, arrival=arrival, priority=priority,
                             cache_salt=cache_salt)
    if stream:
        return await sse_response(request, events, ticket, view.sse, error_event)
    collected = await collect_until_done(request, events, ticket, view.collect)
    if collected is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return JSONResponse(view.response(collected))
