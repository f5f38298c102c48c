"""ZeroMQ client library: submit, stream, abort and call utilities on a running group.

`AsyncEngineClient` is the implementation (zmq.asyncio); `EngineClient` is the same client run
on a private event-loop thread for synchronous code. Any number of clients, in any processes,
can talk to one group: each has its own identity on the scheduler's and detokenizer's ROUTERs.
"""
from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from pagedserve import transport
from pagedserve.pipeline import messages
from pagedserve.pipeline.outputs import (EmbeddingOutput, EmbeddingRequestOutput,
                                          RequestError, RequestOutput)
from pagedserve.pipeline.lora_request import LoRARequest
from pagedserve.pipeline.pooling import PoolingParams, from_bytes, truncate
from pagedserve.pipeline.sampling_params import SamplingParams

_DONE = object()
HEARTBEAT_S = 1.0        # the scheduler aborts the requests of a client silent for 5 s
ENGINE_LOST_S = 30.0     # no answer from the scheduler this long: fail what is in flight


class _Sample:
    __slots__ = ("token_ids", "chars", "finished")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.chars = 0
        self.finished = False


class _Stream:
    """A request in flight: enough to resubmit it, and what each sample has received."""

    __slots__ = ("add", "queue", "samples", "num_prompt_logprobs")

    def __init__(self, add: messages.AddRequest) -> None:
        self.add = add
        self.queue: asyncio.Queue = asyncio.Queue()
        self.samples = [_Sample() for _ in range(add.sampling.n)]
        self.num_prompt_logprobs = 1  # prompt tokens whose logprobs arrived (the first has none)

    def accept(self, d: messages.TextDelta) -> messages.TextDelta | None:
        """Drop what was already received (a re-fed stream after a restart)."""
        if d.index >= len(self.samples):
            return None
        sample = self.samples[d.index]
        if sample.finished:
            return None
        if d.prompt_logprobs is not None:
            return self._accept_prompt_logprobs(d)
        skip_t = max(0, len(sample.token_ids) - d.token_offset)
        skip_c = max(0, sample.chars - d.text_offset)
        if skip_t or skip_c:
            if skip_t >= len(d.token_ids) and skip_c >= len(d.text) and d.finish_reason is None:
                return None
            d = msgspec.structs.replace(
                d, token_ids=d.token_ids[skip_t:], text=d.text[skip_c:],
                token_offset=d.token_offset + skip_t, text_offset=d.text_offset + skip_c,
                logprobs=None if d.logprobs is None else d.logprobs[skip_t:],
                top_logprobs=None if d.top_logprobs is None else d.top_logprobs[skip_t:])
        sample.token_ids.extend(d.token_ids)
        sample.chars += len(d.text)
        sample.finished = d.finish_reason is not None
        return d

    def _accept_prompt_logprobs(self, d: messages.TextDelta) -> messages.TextDelta | None:
        """A delta of prompt logprobs (no tokens): the part not received yet, if it follows."""
        chunk = d.prompt_logprobs.after(self.num_prompt_logprobs)
        if chunk is None or chunk.start != self.num_prompt_logprobs:
            return None
        self.num_prompt_logprobs = chunk.start + len(chunk.logprobs)
        return msgspec.structs.replace(d, prompt_logprobs=chunk)

    def resubmission(self) -> messages.AddRequest | None:
        """The AddRequest that continues this stream on a restarted scheduler, if possible."""
        received = [s.token_ids for s in self.samples]
        if not any(received):
            return msgspec.structs.replace(self.add, resubmitted=True)
        if len(self.samples) > 1:
            return None  # the n samples of one request can only be resumed together from scratch
        return msgspec.structs.replace(self.add, output_token_ids=[list(received[0])],
                                       text_offsets=[self.samples[0].chars], resubmitted=True)


class AsyncEngineClient:
    def __init__(self, frontend_addr: str, output_addr: str, *, tokenizer=None,
                 client_id: bytes | None = None, connect_timeout: float = 30.0):
        self.frontend_addr = frontend_addr
        self.output_addr = output_addr
        self.tokenizer = tokenizer
        self.client_id = client_id or f"client-{uuid.uuid4().hex[:12]}".encode()
        self.connect_timeout = connect_timeout
        self._ctx = zmq.asyncio.Context()
        self._frontend: zmq.asyncio.Socket | None = None
        self._output: zmq.asyncio.Socket | None = None
        self._streams: dict[str, _Stream] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._reader: asyncio.Task | None = None
        self._heartbeat: asyncio.Task | None = None
        self._instance: str | None = None  # the scheduler's; a new one means it restarted
        self._answered = False  # the scheduler has answered a health call: _instance is known
        self._learning: asyncio.Future | None = None  # asking for the instance, once at a time
        self._last_answer = time.monotonic()
        self._closed = False
        self.dispatcher = transport.Dispatcher("client", {
            messages.DeltaBatch: self._on_deltas, messages.RequestRejected: self._on_request_error,
            messages.RequestFailed: self._on_request_error,
            messages.UtilityReply: self._on_utility_reply,
            messages.HelloAck: lambda msg: None,  # a repeated hello's answer
        })

    # -- connection --------------------------------------------------------------------------
    async def connect(self) -> "AsyncEngineClient":
        self._frontend = transport.make_socket(self._ctx, zmq.DEALER, self.frontend_addr, bind=False,
                                         identity=self.client_id)
        self._output = transport.make_socket(self._ctx, zmq.DEALER, self.output_addr, bind=False,
                                       identity=self.client_id)
        # Until the detokenizer has seen us, its ROUTER cannot route our outputs: say hello and
        # wait for the answer before submitting anything.
        deadline = time.monotonic() + self.connect_timeout
        while True:
            transport.send(self._output, messages.Hello(self.client_id))
            if await self._output.poll(250):
                msg = self.dispatcher.codec.decode(await self._output.recv_multipart())
                if isinstance(msg, messages.HelloAck):
                    break
            if time.monotonic() > deadline:
                self._close_sockets()
                raise ConnectionError(f"no engine answered at {self.output_addr} within "
                                      f"{self.connect_timeout:.0f}s")
        self._reader = asyncio.ensure_future(self._read_loop())
        self._heartbeat = asyncio.ensure_future(self._heartbeat_loop())
        return self

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in (self._heartbeat, self._reader):
            if task is not None:
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass
        err = RequestError(503, "client closed")
        for st in self._streams.values():
            st.queue.put_nowait(err)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(err)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._frontend, self._output):
            if sock is not None:
                sock.close(0)
        self._ctx.term()

    async def __aenter__(self) -> "AsyncEngineClient":
        return await self.connect()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # -- reading -------------------------------------------------------------------------------
    async def _read_loop(self) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(self._frontend, zmq.POLLIN)
        poller.register(self._output, zmq.POLLIN)
        while True:
            for sock, _ in await poller.poll():
                while sock.get(zmq.EVENTS) & zmq.POLLIN:
                    self.dispatcher.receive(await sock.recv_multipart())

    async def _heartbeat_loop(self) -> None:
        """Keep the scheduler aware of us, notice its restarts, and give up on a dead engine."""
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                self._observe(await self.call("health", timeout=2 * HEARTBEAT_S))
            except (asyncio.TimeoutError, RuntimeError):
                lost = self._engine_lost()
                if self._streams and lost is not None:
                    self._fail_all(lost)

    def _engine_lost(self) -> RequestError | None:
        if time.monotonic() - self._last_answer <= ENGINE_LOST_S:
            return None
        return RequestError(503, f"no answer from the engine's scheduler for {ENGINE_LOST_S:.0f}s")

    def _observe(self, health: dict) -> None:
        """A health answer from the scheduler: a new instance means it restarted and lost
        what it held, so everything in flight is sent again."""
        self._last_answer = time.monotonic()
        instance = health.get("instance")
        if self._answered and instance != self._instance:
            self._resubmit_all()
        self._instance, self._answered = instance, True

    async def _known_instance(self) -> None:
        """Until the scheduler has answered once. A request is only sent once the client knows
        which scheduler instance takes it: sent earlier, a scheduler dying before the first
        answer would take it along unnoticed (the first instance seen would be its successor)."""
        if self._answered:
            return
        if self._learning is None or self._learning.done():
            self._learning = asyncio.ensure_future(self._learn_instance())
        await asyncio.shield(self._learning)

    async def _learn_instance(self) -> None:
        while not self._answered:
            try:
                self._observe(await self.call("health", timeout=2 * HEARTBEAT_S))
            except (asyncio.TimeoutError, RuntimeError):
                if (lost := self._engine_lost()) is not None:
                    raise lost from None
                await asyncio.sleep(0.1)  # an error answer comes at once: do not spin

    def _resubmit_all(self) -> None:
        for rid, st in list(self._streams.items()):
            add = st.resubmission()
            if add is None:
                st.queue.put_nowait(RequestError(
                    503, "the scheduler restarted and a request with n > 1 that had started "
                         "cannot be resumed; resubmit it", rid))
                continue
            transport.send(self._frontend, add)

    def _fail_all(self, err: RequestError) -> None:
        for st in self._streams.values():
            st.queue.put_nowait(err)

    def _on_deltas(self, msg: messages.DeltaBatch) -> None:
        for delta in msg.deltas:
            st = self._streams.get(delta.request_id)
            if st is not None:
                delta = st.accept(delta)
                if delta is not None:
                    st.queue.put_nowait(delta)

    def _on_request_error(self, msg: messages.RequestRejected | messages.RequestFailed) -> None:
        st = self._streams.get(msg.request_id)
        if st is not None:
            st.queue.put_nowait(RequestError(msg.status, msg.message, msg.request_id))

    def _on_utility_reply(self, msg: messages.UtilityReply) -> None:
        fut = self._calls.pop(msg.call_id, None)
        if fut is not None and not fut.done():
            if msg.error is not None:
                fut.set_exception(RuntimeError(msg.error))
            else:
                fut.set_result(msg.result)

    # -- requests --------------------------------------------------------------------------------
    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer: pass tokenizer= to the client "
                                 "or submit token ids")
            return list(self.tokenizer.encode(prompt))
        return [int(t) for t in prompt]

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                       request_id: str | None = None, priority: int = 0,
                       cache_salt: str | None = None, pooling: PoolingParams | None = None,
                       lora: LoRARequest | None = None
                       ) -> AsyncIterator[messages.TextDelta]:
        """Stream TextDeltas of every sample until all n samples finish. With `pooling` (an
        embedding request: `embed` is the short way) the one delta is the finished sample
        carrying the vector.

        Raises RequestError when the engine refuses or loses the request. Leaving the loop early
        (break, cancellation) aborts the request in the engine.
        """
        params = params or SamplingParams()
        params.validate()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight on this client")
        ids = self._prompt_ids(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        st = _Stream(messages.AddRequest(
            request_id=request_id, prompt_token_ids=ids, sampling=params,
            arrival_time=time.time(), priority=priority, cache_salt=cache_salt, pooling=pooling,
            lora=lora))
        self._streams[request_id] = st
        remaining = params.n
        try:
            await self._known_instance()
            transport.send(self._frontend, st.add)
            while remaining:
                item = await st.queue.get()
                if isinstance(item, RequestError):
                    raise item
                if item.finish_reason is not None:
                    remaining -= 1
                yield item
        finally:
            self._streams.pop(request_id, None)
            if remaining and not self._closed:
                transport.send(self._frontend, messages.Abort([request_id]))

    async def complete(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                       **kwargs: Any) -> RequestOutput:
        """Run one request to the end and return its accumulated output."""
        params = params or SamplingParams()
        out = RequestOutput.start(kwargs.get("request_id") or uuid.uuid4().hex,
                                  prompt if isinstance(prompt, str) else None,
                                  self._prompt_ids(prompt), params)
        kwargs["request_id"] = out.request_id
        async for delta in self.generate(out.prompt_token_ids, params, **kwargs):
            out.apply(delta)
        return out

    async def embed(self, prompt: str | Sequence[int], pooling: PoolingParams | None = None, *,
                    request_id: str | None = None, priority: int = 0) -> EmbeddingRequestOutput:
        """The prompt's pooled vector (the model's pooler; `pooling.dimensions` truncates and
        normalizes again). Raises RequestError when the engine refuses or loses it."""
        pooling = pooling or PoolingParams()
        request_id = request_id or uuid.uuid4().hex
        ids = self._prompt_ids(prompt)
        vector = None
        async for delta in self.generate(ids, SamplingParams(max_tokens=None),
                                         request_id=request_id, priority=priority,
                                         pooling=pooling):
            vector = delta.embedding if delta.embedding is not None else vector
        if vector is None:
            raise RequestError(500, "the engine finished the embedding request without a "
                                    "vector", request_id)
        embedding = truncate(from_bytes(vector), pooling.dimensions)
        return EmbeddingRequestOutput(request_id, ids, EmbeddingOutput(embedding.tolist()))

    async def abort(self, *request_ids: str) -> None:
        transport.send(self._frontend, messages.Abort(list(request_ids)))

    async def call(self, method: str, timeout: float = 10.0) -> dict:
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        transport.send(self._frontend, messages.UtilityCall(call_id, method))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._calls.pop(call_id, None)

    async def stats(self) -> dict:
        return await self.call("stats")

    async def health(self, timeout: float = 5.0) -> bool:
        try:
            result = await self.call("health", timeout)
        except (asyncio.TimeoutError, RuntimeError, RequestError):
            return False
        self._observe(result)
        return bool(result.get("ok"))


class EngineClient:
    """Synchronous facade: the async client on a private event-loop thread."""

    def __init__(self, frontend_addr: str, output_addr: str, **kwargs: Any):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pagedserve-client",
                                        daemon=True)
        self._thread.start()
        self._async = AsyncEngineClient(frontend_addr, output_addr, **kwargs)
        try:
            self._run(self._async.connect())
        except BaseException:
            self._stop_loop()
            raise

    def _run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    @property
    def tokenizer(self):
        return self._async.tokenizer

    def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                 **kwargs: Any) -> Iterator[messages.TextDelta]:
        """Stream TextDeltas; closing the iterator early aborts the request."""
        q: queue.Queue = queue.Queue()

        async def pump() -> None:
            try:
                async for delta in self._async.generate(prompt, params, **kwargs):
                    q.put(delta)
                q.put(_DONE)
            except BaseException as exc:  # delivered to the caller's thread
                q.put(exc)

        fut = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while True:
                item = q.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not fut.done():
                fut.cancel()

    def complete(self, prompt, params=None, **kwargs: Any) -> RequestOutput:
        return self._run(self._async.complete(prompt, params, **kwargs))

    def submit(self, prompt, params=None, **kwargs: Any):
        """Start a request without waiting; returns a concurrent.futures.Future[RequestOutput]."""
        return asyncio.run_coroutine_threadsafe(self._async.complete(prompt, params, **kwargs),
                                                self._loop)

    def embed(self, prompt, pooling=None, **kwargs: Any) -> EmbeddingRequestOutput:
        return self._run(self._async.embed(prompt, pooling, **kwargs))

    def submit_embed(self, prompt, pooling=None, **kwargs: Any):
        """Start an embedding request without waiting: a Future[EmbeddingRequestOutput]."""
        return asyncio.run_coroutine_threadsafe(self._async.embed(prompt, pooling, **kwargs),
                                                self._loop)

    def abort(self, *request_ids: str) -> None:
        self._run(self._async.abort(*request_ids))

    def stats(self) -> dict:
        return self._run(self._async.stats())

    def health(self, timeout: float = 5.0) -> bool:
        return self._run(self._async.health(timeout))

    def close(self) -> None:
        if self._thread.is_alive():
            try:
                self._run(self._async.close(), timeout=10)
            finally:
                self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def __enter__(self) -> "EngineClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
