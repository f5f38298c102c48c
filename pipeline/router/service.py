"""The router's request path: check the key and its limits, make sure the model is loaded,
choose a replica, proxy the request, and when the replica fails, go on elsewhere (a stream
resumes where it was: `resume.py`). No sockets of its own: HTTP in is the app's, HTTP out
the `httpx` client's."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import httpx

from pagedserve.pipeline.router.affinity import prefix_key
from pagedserve.pipeline.router.core import NoReplica, Replica, RouterCore
from pagedserve.pipeline.router.lora import RouterAdapters, adapter_key
from pagedserve.pipeline.router.metrics import RouterMetrics
from pagedserve.pipeline.router.models import ModelManager
from pagedserve.pipeline.router.pool import ReplicaPool
from pagedserve.pipeline.router.priority import DEFAULT_PRIORITY_FLOOR, clamp_priority
from pagedserve.pipeline.router.prompts import (affinity_prompt, estimate_generation,
                                                estimate_prompt_tokens)
from pagedserve.pipeline.router.ratelimit import RateLimiter
from pagedserve.pipeline.router.resume import ReplayDiverged, ResumableStream
from pagedserve.pipeline.router.upstream import DONE, ReplicaBroken, ReplicaRefused, stream_events

log = logging.getLogger("pagedserve.router")

PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions",
         "messages": "/v1/messages", "responses": "/v1/responses",
         "tokenize": "/tokenize", "detokenize": "/detokenize", "infill": "/infill",
         "embeddings": "/v1/embeddings"}


@dataclass(frozen=True, slots=True)
class ProxySettings:
    block_size: int = 16            # the engines' --block-size: the affinity key's unit
    affinity_blocks: int = 4        # how many leading blocks the affinity key hashes
    stall_timeout: float = 60.0     # a stream silent this long is a failed replica
    request_timeout: float = 600.0  # a non-streamed request's whole answer
    replica_wait: float = 30.0      # how long a request waits for a healthy replica
    max_attempts: int = 4           # replicas one request may be sent to


class RouterError(Exception):
    """An answer of the router's own: an OpenAI-shaped error with a status."""

    def __init__(self, status: int, message: str, *, code: str, retry_after: float | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.retry_after = status, message, code, retry_after
        self.headers = headers or {}  # e.g. Connection: close after a body that came too slowly

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": None,
                          "code": self.code}}


@dataclass(slots=True)
class Routed:
    """A request on its way: what the router decided for it."""
    kind: str
    body: dict[str, Any]
    model: str
    key: bytes
    cost: int            # estimated tokens: the replica's load while it runs
    api_key: str
    prompt_estimate: int
    charged: int         # tokens the key is charged for it now (settled as it streams and ends)
    adapter: str | None = None   # the LoRA adapter its `model` named (`model`: its base)


class RouterService:
    def __init__(self, core: RouterCore, pool: ReplicaPool, models: ModelManager,
                 limiter: RateLimiter, metrics: RouterMetrics, http: httpx.AsyncClient,
                 settings: ProxySettings = ProxySettings(),
                 clock: Callable[[], float] = time.monotonic,
                 priority_floors: dict[str, int] | None = None):
        self.core, self.pool, self.models, self.limiter = core, pool, models, limiter
        self.metrics, self.http, self.settings, self.clock = metrics, http, settings, clock
        self.priority_floors = priority_floors or {}  # by API key (priority.py)
        self.adapters = RouterAdapters()  # LoRA adapters by name (lora.py)

    # -- admission -----------------------------------------------------------------------------
    def route(self, kind: str, body: dict[str, Any], api_key: str) -> Routed:
        """Checks the model, the priority and the key's limits (RouterError 404/400/429);
        charges the key the prompt's estimate and the most it may generate (a reservation
        when it names no max_tokens), settled as the answer comes (`_settle`)."""
        model = body.get("model")
        served = self.models.slots.models
        if model is None and len(served) == 1:
            model = served[0]
        adapter, base = (model, self.adapters.base(model)) if model not in served else (None, None)
        if model not in served and base is None:
            self.metrics.rejected.labels("unknown_model").inc()
            raise RouterError(404, f"The model `{model}` does not exist (served: "
                              f"{', '.join(served)}).", code="model_not_found")
        try:
            body = clamp_priority(body, self.priority_floors.get(api_key, DEFAULT_PRIORITY_FLOOR))
        except ValueError as exc:
            raise RouterError(400, str(exc), code="invalid_priority") from None
        prompt = estimate_prompt_tokens(kind, body)
        cost = max(1, prompt + estimate_generation(body, kind))
        wait = self.limiter.admit(api_key, cost, self.clock())
        if wait > 0:
            self.metrics.rejected.labels("rate_limited").inc()
            raise RouterError(429, f"rate limit of this API key reached: retry in {wait:.1f} s",
                              code="rate_limit_exceeded", retry_after=wait)
        if adapter is not None:   # its requests gather on the replica that holds it
            return Routed(kind, body, base, adapter_key(adapter), cost, api_key, prompt, cost,
                          adapter)
        key = prefix_key(affinity_prompt(kind, body), block_size=self.settings.block_size,
                         num_blocks=self.settings.affinity_blocks)
        return Routed(kind, {**body, "model": model}, model, key, cost, api_key, prompt, cost)

    async def _choose(self, routed: Routed, tried: set[str], first: bool) -> Replica:
        """A healthy replica, preferring ones not tried yet; waits for one (bounded)."""
        deadline = self.clock() + self.settings.replica_wait
        while True:
            for exclude in (tried, ()):
                try:
                    choice = self.core.pick(routed.model, routed.key, routed.cost, exclude)
                except NoReplica:
                    continue
                self.metrics.requests.labels(routed.model, choice.replica_id).inc()
                if first and self.core.policy.affinity:
                    (self.metrics.affinity_hits if choice.affinity
                     else self.metrics.spills).labels(routed.model).inc()
                return self.core.replicas[choice.replica_id]
            if self.clock() > deadline:
                raise RouterError(503, f"no healthy replica serves model {routed.model!r}; "
                                  "retry later", code="no_replica", retry_after=5)
            await asyncio.sleep(0.2)

    # -- non-streamed ------------------------------------------------------------------------
    async def complete(self, routed: Routed) -> tuple[int, bytes, dict[str, str]]:
        """(status, body, headers) of the first replica that answers; a failed or overloaded
        replica's request is sent to another from the start (the client saw nothing yet).
        The key pays the answer's usage, nothing for a refusal or a failure."""
        try:
            status, content, headers = await self._complete(routed)
        except RouterError:
            self._settle(routed, 0)
            raise
        self._settle(routed, _usage_total(content) if status == 200 else 0)
        return status, content, headers

    async def _complete(self, routed: Routed) -> tuple[int, bytes, dict[str, str]]:
        tried: set[str] = set()
        last: ReplicaRefused | None = None
        for attempt in range(self.settings.max_attempts):
            replica = await self._choose(routed, tried, attempt == 0)
            self.core.begin(replica.replica_id, routed.cost)
            try:
                resp = await self.http.post(
                    replica.url + PATHS[routed.kind], json=routed.body, headers=replica.headers,
                    timeout=httpx.Timeout(10.0, read=self.settings.request_timeout))
            except httpx.HTTPError as exc:
                self._failed(routed, replica, f"{type(exc).__name__}: {exc}")
                tried.add(replica.replica_id)
                continue
            finally:
                self.core.end(replica.replica_id, routed.cost)
            headers = {k: v for k, v in resp.headers.items() if k.lower() == "retry-after"}
            if resp.status_code == 503 and self._others_left(routed, tried | {replica.replica_id}):
                tried.add(replica.replica_id)
                last = ReplicaRefused(503, resp.content, headers)
                continue
            return resp.status_code, resp.content, headers
        if last is not None:
            return last.status, last.body, last.headers
        raise RouterError(503, f"{self.settings.max_attempts} replicas failed this request",
                          code="replicas_failed", retry_after=5)

    def _others_left(self, routed: Routed, tried: set[str]) -> bool:
        return any(r.replica_id not in tried for r in self.core.of_model(routed.model))

    def _failed(self, routed: Routed, replica: Replica, why: str) -> None:
        log.warning("replica %s failed a request: %s; trying another", replica.replica_id, why)
        self.pool.suspect(replica.replica_id)
        self.metrics.retries.labels(routed.model).inc()

    def _settle(self, routed: Routed, used: int | None) -> None:
        """Make the key's charge for `routed` what it used (None: unknown, the charge stays)."""
        if used is not None and used != routed.charged:
            self.limiter.settle(routed.api_key, routed.charged, used, self.clock())
            routed.charged = used

    def unserved(self, routed: Routed) -> None:
        """`routed` is answered without reaching a replica: its key is charged no tokens."""
        self._settle(routed, 0)

    def _charge_streamed(self, routed: Routed, state: ResumableStream) -> None:
        """As a stream passes its charge, the key pays for it at once, not at the end: a
        stream without max_tokens (charged a reservation) holds no credit while it runs."""
        used = _streamed_tokens(routed, state)
        if used > routed.charged:
            self._settle(routed, used)

    # -- streamed ----------------------------------------------------------------------------
    async def stream(self, routed: Routed) -> AsyncIterator[dict[str, Any] | str]:
        """The client's SSE events, ending with DONE. Raises ReplicaRefused or RouterError
        only before the first event (the app answers with that status). However it ends
        (done, the client gone, every replica failed), the key pays what was streamed."""
        state = ResumableStream(routed.kind, routed.body)
        try:
            async for event in self._stream(state, routed):
                yield event
        finally:
            self._settle(routed, _streamed_tokens(routed, state))

    async def _stream(self, state: ResumableStream, routed: Routed
                      ) -> AsyncIterator[dict[str, Any] | str]:
        tried: set[str] = set()
        last: ReplicaRefused | None = None
        for attempt in range(self.settings.max_attempts):
            replica = await self._choose(routed, tried, attempt == 0)
            try:
                async with aclosing(self._one_replica(state, routed, replica)) as events:
                    async for event in events:
                        yield event
                return
            except ReplayDiverged as exc:
                yield _error_event(f"the replica failed mid-stream and the stream could not "
                                   f"be resumed: the continuation on {replica.replica_id} "
                                   f"diverged ({exc})")
                yield DONE
                return
            except ReplicaRefused as refused:
                if not state.started():
                    if refused.status != 503 or not self._others_left(
                            routed, tried | {replica.replica_id}):
                        raise
                    last = refused
                else:
                    ending = self._broken(state, routed, replica, f"it answered "
                                          f"{refused.status} to the continuation")
                    if ending:
                        for event in ending:
                            yield event
                        return
            except ReplicaBroken as exc:
                ending = self._broken(state, routed, replica, str(exc))
                if ending:
                    for event in ending:
                        yield event
                    return
            tried.add(replica.replica_id)
        if last is not None and not state.started():
            raise last
        yield _error_event(f"{self.settings.max_attempts} replicas failed this request")
        yield DONE

    def _broken(self, state: ResumableStream, routed: Routed, replica: Replica, why: str
                ) -> list[dict[str, Any] | str]:
        """After a replica failed a stream: the events that end it, or [] to go on elsewhere
        (resuming where the client is)."""
        self._failed(routed, replica, why)
        if state.finished:  # everything arrived but the [DONE]
            return [DONE]
        why_not = state.why_not_resumable() if state.started() else None
        if why_not:
            return [_error_event(f"the replica failed mid-stream and the stream cannot be "
                                 f"resumed: {why_not}"), DONE]
        if state.started():
            state.begin_continuation()
        return []

    async def _one_replica(self, state: ResumableStream, routed: Routed, replica: Replica
                           ) -> AsyncIterator[dict[str, Any] | str]:
        if state.resumed:
            url = replica.url + PATHS["completion"]
            body = state.continuation_body(routed.adapter or replica.upstream_model
                                           or routed.model, replica.max_model_len)
            log.info("resuming a stream on %s after %d tokens (%d of them again)",
                     replica.replica_id, state.delivery.num_tokens,
                     len(state.delivery.tail_ids))
        else:
            url, body = replica.url + PATHS[routed.kind], state.upstream_body()
        self.core.begin(replica.replica_id, routed.cost)
        # aclosing: a client gone, or a stream given up, closes the upstream request at once,
        # so the replica stops generating for no one
        upstream = stream_events(self.http, url, body, headers=replica.headers,
                                 stall_timeout=self.settings.stall_timeout)
        try:
            async with aclosing(upstream) as events:
                async for event in events:
                    if event == DONE:
                        usage = state.usage_event() if state.resumed else None
                        if usage is not None:
                            yield usage
                        yield DONE
                        return
                    out = state.feed(event)
                    self._charge_streamed(routed, state)
                    if out is not None:
                        yield out
        finally:
            self.core.end(replica.replica_id, routed.cost)


    # -- passed through (Anthropic's /v1/messages streams: passthrough.py) --------------------
    async def open_stream(self, routed: Routed) -> tuple[Replica, httpx.Response]:
        """The first replica that accepts `routed` as a stream, and its open response (status
        200, body unread; the caller closes it and calls `close_stream`). An overloaded
        replica's 503 is retried on the others; any other refusal raises ReplicaRefused."""
        tried: set[str] = set()
        last: ReplicaRefused | None = None
        for attempt in range(self.settings.max_attempts):
            replica = await self._choose(routed, tried, attempt == 0)
            tried.add(replica.replica_id)
            self.core.begin(replica.replica_id, routed.cost)
            request = self.http.build_request(
                "POST", replica.url + PATHS[routed.kind], json=routed.body,
                headers=replica.headers,
                timeout=httpx.Timeout(10.0, read=self.settings.stall_timeout))
            try:
                resp = await self.http.send(request, stream=True)
            except httpx.HTTPError as exc:
                self.close_stream(routed, replica, f"{type(exc).__name__}: {exc}")
                continue
            if resp.status_code == 200:
                return replica, resp
            body = await resp.aread()
            await resp.aclose()
            self.close_stream(routed, replica)
            refused = ReplicaRefused(resp.status_code, body, {
                k: v for k, v in resp.headers.items() if k.lower() == "retry-after"})
            if resp.status_code != 503 or not self._others_left(routed, tried):
                raise refused
            last = refused
        if last is not None:
            raise last
        raise RouterError(503, f"{self.settings.max_attempts} replicas failed this request",
                          code="replicas_failed", retry_after=5)

    def close_stream(self, routed: Routed, replica: Replica, failure: str | None = None,
                     used: int | None = None) -> None:
        """A passed-through stream ended: the replica's load drops, a failure marks it
        suspect, and the key pays `used` tokens (None: the charge stays)."""
        self.core.end(replica.replica_id, routed.cost)
        if failure is not None:
            self._failed(routed, replica, failure)
        self._settle(routed, used)


def _error_event(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "server_error", "param": None,
                      "code": "replica_failed"}}


def _usage_total(content: bytes) -> int | None:
    """OpenAI's usage.total_tokens, Anthropic's input_tokens + output_tokens, or llama.cpp's
    tokens_evaluated + tokens_predicted."""
    try:
        answer = json.loads(content)
        if isinstance(answer, dict) and "tokens_predicted" in answer:  # llama.cpp's /infill
            return int(answer["tokens_evaluated"]) + int(answer["tokens_predicted"])
        usage = answer["usage"]
        if "total_tokens" in usage:
            return int(usage["total_tokens"])
        return int(usage["input_tokens"]) + int(usage["output_tokens"])
    except (ValueError, KeyError, TypeError):
        return None


def _streamed_tokens(routed: Routed, state: ResumableStream) -> int:
    """What a stream has cost: its prompt, once a replica has taken it, and every token the
    client was sent (so far)."""
    if not state.started():
        return 0
    return state.prompt_tokens(routed.prompt_estimate) + state.generated_tokens
