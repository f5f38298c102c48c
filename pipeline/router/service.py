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
from dataclasses import dataclass
from typing import Any

import httpx

from pagedserve.pipeline.router.affinity import prefix_key
from pagedserve.pipeline.router.core import NoReplica, Replica, RouterCore
from pagedserve.pipeline.router.metrics import RouterMetrics
from pagedserve.pipeline.router.models import ModelManager
from pagedserve.pipeline.router.pool import ReplicaPool
from pagedserve.pipeline.router.prompts import affinity_prompt, estimate_tokens
from pagedserve.pipeline.router.ratelimit import RateLimiter
from pagedserve.pipeline.router.resume import ResumableStream
from pagedserve.pipeline.router.upstream import DONE, ReplicaBroken, ReplicaRefused, stream_events

log = logging.getLogger("pagedserve.router")

PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


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

    def __init__(self, status: int, message: str, *, code: str, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.retry_after = status, message, code, retry_after

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
    cost: int
    api_key: str


class RouterService:
    def __init__(self, core: RouterCore, pool: ReplicaPool, models: ModelManager,
                 limiter: RateLimiter, metrics: RouterMetrics, http: httpx.AsyncClient,
                 settings: ProxySettings = ProxySettings(),
                 clock: Callable[[], float] = time.monotonic):
        self.core, self.pool, self.models, self.limiter = core, pool, models, limiter
        self.metrics, self.http, self.settings, self.clock = metrics, http, settings, clock

    # -- admission -----------------------------------------------------------------------------
    def route(self, kind: str, body: dict[str, Any], api_key: str) -> Routed:
        """Checks the model and the key's limits (RouterError 404/429)."""
        model = body.get("model")
        served = self.models.slots.models
        if model is None and len(served) == 1:
            model = served[0]
        if model not in served:
            self.metrics.rejected.labels("unknown_model").inc()
            raise RouterError(404, f"The model `{model}` does not exist (served: "
                              f"{', '.join(served)}).", code="model_not_found")
        cost = estimate_tokens(kind, body)
        wait = self.limiter.admit(api_key, cost, self.clock())
        if wait > 0:
            self.metrics.rejected.labels("rate_limited").inc()
            raise RouterError(429, f"rate limit of this API key reached: retry in {wait:.1f} s",
                              code="rate_limit_exceeded", retry_after=wait)
        key = prefix_key(affinity_prompt(kind, body), block_size=self.settings.block_size,
                         num_blocks=self.settings.affinity_blocks)
        return Routed(kind, {**body, "model": model}, model, key, cost, api_key)

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
        replica's request is sent to another from the start (the client saw nothing yet)."""
        tried: set[str] = set()
        last: ReplicaRefused | None = None
        for attempt in range(self.settings.max_attempts):
            replica = await self._choose(routed, tried, attempt == 0)
            self.core.begin(replica.replica_id, routed.cost)
            try:
                resp = await self.http.post(
                    replica.url + PATHS[routed.kind], json=routed.body,
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
            self._settle(routed, _usage_total(resp))
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
        if used is not None:
            self.limiter.settle(routed.api_key, routed.cost, used, self.clock())

    # -- streamed ----------------------------------------------------------------------------
    async def stream(self, routed: Routed) -> AsyncIterator[dict[str, Any] | str]:
        """The client's SSE events, ending with DONE. Raises ReplicaRefused or RouterError
        only before the first event (the app answers with that status)."""
        state = ResumableStream(routed.kind, routed.body)
        tried: set[str] = set()
        last: ReplicaRefused | None = None
        try:
            for attempt in range(self.settings.max_attempts):
                replica = await self._choose(routed, tried, attempt == 0)
                try:
                    async for event in self._one_replica(state, routed, replica):
                        yield event
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
        finally:
            self._settle(routed, len(state.prompt_token_ids or []) + len(state.output_token_ids)
                         if state.finished else None)

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
            body = state.continuation_body(replica.upstream_model or routed.model,
                                           replica.max_model_len)
            log.info("resuming a stream on %s after %d tokens", replica.replica_id,
                     len(state.output_token_ids))
        else:
            url, body = replica.url + PATHS[routed.kind], state.upstream_body()
        self.core.begin(replica.replica_id, routed.cost)
        try:
            async for event in stream_events(self.http, url, body, headers={},
                                             stall_timeout=self.settings.stall_timeout):
                if event == DONE:
                    usage = state.usage_event() if state.resumed else None
                    if usage is not None:
                        yield usage
                    yield DONE
                    return
                out = state.feed(event)
                if out is not None:
                    yield out
        finally:
            self.core.end(replica.replica_id, routed.cost)


def _error_event(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "server_error", "param": None,
                      "code": "replica_failed"}}


def _usage_total(resp: httpx.Response) -> int | None:
    try:
        return int(json.loads(resp.content)["usage"]["total_tokens"])
    except (ValueError, KeyError, TypeError):
        return None
