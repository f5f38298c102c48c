"""The detokenizer's routing, without sockets: TokenBatch in -> DetokenizerCore -> TextDelta
batches out to the client that owns each request; a stop string found -> StopMatched to the
scheduler; a client unreachable for DELIVERY_GRACE_S -> Abort of its requests.

Streams are idempotent: every SampleTokens carries the offset of its first token, repeated
tokens (a re-feed after a restart) are skipped, and every TextDelta carries its token and text
offsets so that clients drop what they already have.

One request cannot take the others down: an exception while opening or detokenizing a request
fails that request alone (its client hears why, the scheduler aborts it). What no exception
reports (a hang, a native crash) ends the process; the request being worked on is marked in a
breadcrumb (pagedserve/breadcrumb.py) so that the launcher can hold the death against it.
"""
from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from pagedserve.breadcrumb import NoBreadcrumb
from pagedserve.pipeline import messages
from pagedserve.pipeline.detokenizer.core import DetokenizerCore

log = logging.getLogger("pagedserve.detokenizer")
DELIVERY_GRACE_S = 5.0  # a client may be reconnecting (after our restart): keep its deltas


@dataclass(slots=True)
class _Sample:
    tokens: int = 0   # output ids fed so far
    chars: int = 0    # text emitted so far
    open: bool = True


@dataclass(slots=True)
class _Owner:
    client_id: bytes
    num_prompt_tokens: int
    samples: list[_Sample]


@dataclass(slots=True)
class _Pending:
    since: float
    msgs: list = field(default_factory=list)


def sample_key(request_id: str, index: int) -> str:
    return f"{request_id}\x1f{index}"


class DetokenizerService:
    """Routing around DetokenizerCore; no sockets here, `send_*` callbacks are injected."""

    def __init__(self, tokenizer, send_to_client, send_to_scheduler, clock=time.monotonic,
                 breadcrumb=None, faults=None):
        self.tokenizer = tokenizer
        self.breadcrumb = breadcrumb or NoBreadcrumb()
        self.faults = faults if faults is not None and faults.wants_tokens else None
        self.core = DetokenizerCore(tokenizer)
        self.owners: dict[str, _Owner] = {}
        self.pending: dict[bytes, _Pending] = {}
        self.send_to_client = send_to_client
        self.send_to_scheduler = send_to_scheduler
        self.clock = clock

    def handlers(self) -> dict[type, Callable]:
        """The messages this service takes, as a dispatch table: handler(msg, sender), the
        sender being a client's identity for Hello and None for the scheduler's messages."""
        return {
            messages.TokenBatch: lambda msg, _sender: self.on_tokens(msg),
            messages.DetokOpen: lambda msg, _sender: self.open(msg),
            messages.RequestFailed: lambda msg, _sender: self.on_failed(msg),
            messages.Reset: lambda msg, _sender: self.reset(),
            messages.GroupFailed: lambda msg, _sender: self.fail_all(msg.message),
            messages.Hello: lambda msg, client_id: self.hello(client_id),
        }

    def reset(self) -> None:
        self.core = DetokenizerCore(self.tokenizer)
        self.owners.clear()

    def open(self, msg: messages.DetokOpen) -> None:
        with self.breadcrumb.mark(msg.request_id):
            try:
                if self.faults is not None:  # PAGEDSERVE_FAULT's token=<id>: a poison request
                    self.faults.on_tokens(msg.prompt_token_ids)
                self._open(msg)
            except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
                self._fail_one(msg.request_id, msg.client_id, exc)

    def _open(self, msg: messages.DetokOpen) -> None:
        if msg.request_id in self.owners:  # reopened (resubmission, re-feed): start afresh
            self._close_request(msg.request_id)
        n = msg.sampling.n
        self.owners[msg.request_id] = _Owner(msg.client_id, len(msg.prompt_token_ids),
                                             [_Sample() for _ in range(n)])
        for i in range(n):
            self.core.open(sample_key(msg.request_id, i), msg.prompt_token_ids, msg.sampling)

    def on_tokens(self, batch: messages.TokenBatch) -> None:
        per_client: dict[bytes, list[messages.TextDelta]] = defaultdict(list)
        for request_id, chunk in batch.prompt_logprobs:  # before the tokens that follow them
            owner = self.owners.get(request_id)
            if owner is not None and owner.samples[0].open:
                sample = owner.samples[0]
                per_client[owner.client_id].append(messages.TextDelta(
                    request_id=request_id, index=0, text="", token_ids=[],
                    token_offset=sample.tokens, text_offset=sample.chars, prompt_logprobs=chunk,
                    num_prompt_tokens=owner.num_prompt_tokens, num_output_tokens=sample.tokens))
        with self.breadcrumb.mark(""):
            for s in batch.all_samples():
                owner = self.owners.get(s.request_id)
                if owner is None or s.index >= len(owner.samples) \
                        or not owner.samples[s.index].open:
                    continue  # finished by a stop string already, aborted, or from before a reset
                self.breadcrumb.mark_now(s.request_id)
                try:
                    delta = self._sample_delta(s, owner)
                except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
                    self._fail_one(s.request_id, owner.client_id, exc)
                    continue
                if delta is not None:
                    per_client[owner.client_id].append(delta)
        for client_id, deltas in per_client.items():
            self._deliver(client_id, messages.DeltaBatch(deltas))

    def _sample_delta(self, s: messages.SampleTokens, owner: _Owner) -> messages.TextDelta | None:
        sample = owner.samples[s.index]
        skip = max(0, sample.tokens - s.offset) if s.offset >= 0 else 0
        token_ids = s.token_ids[skip:]
        if not token_ids and s.finish_reason is None:
            return None  # all seen before
        d = self.core.feed(sample_key(s.request_id, s.index), token_ids,
                           s.finish_reason is not None, s.finish_reason)
        if d is None:
            return None
        finish_reason, stop_reason = d.finish_reason, s.stop_reason
        if d.stop_matched is not None:
            finish_reason, stop_reason = "stop", d.stop_matched
            self.send_to_scheduler(messages.StopMatched(s.request_id, s.index, d.stop_matched))
        n = len(d.token_ids)
        delta = messages.TextDelta(
            request_id=s.request_id, index=s.index, text=d.text, token_ids=d.token_ids,
            token_offset=sample.tokens, text_offset=sample.chars,
            logprobs=_window(s.logprobs, skip, n), top_logprobs=_window(s.top_logprobs, skip, n),
            finish_reason=finish_reason, stop_reason=stop_reason,
            num_prompt_tokens=owner.num_prompt_tokens, num_output_tokens=sample.tokens + n,
            num_cached_tokens=s.num_cached_tokens, embedding=s.embedding)
        sample.tokens += n
        sample.chars += len(d.text)
        if finish_reason is not None:
            self._close_sample(s.request_id, s.index)
        return delta

    def _fail_one(self, request_id: str, client_id: bytes, exc: Exception) -> None:
        """An exception while working on one request: it fails alone, with the cause."""
        log.exception("request %s failed in the detokenizer; the others go on", request_id)
        if request_id in self.owners:
            self._close_request(request_id)
        self._deliver(client_id, messages.RequestFailed(
            request_id, 500, f"the detokenizer failed on this request "
                             f"({type(exc).__name__}: {exc}); the server goes on"))
        self.send_to_scheduler(messages.Abort([request_id]))

    def on_failed(self, msg: messages.RequestFailed) -> None:
        owner = self.owners.get(msg.request_id)
        if owner is not None:
            self._deliver(owner.client_id, msg)
            self._close_request(msg.request_id)

    def fail_all(self, message: str) -> None:
        for rid in list(self.owners):
            self.on_failed(messages.RequestFailed(rid, 503, message))

    def _close_sample(self, request_id: str, index: int) -> None:
        owner = self.owners[request_id]
        owner.samples[index].open = False
        self.core.close(sample_key(request_id, index))
        if not any(s.open for s in owner.samples):
            del self.owners[request_id]

    def _close_request(self, request_id: str) -> None:
        owner = self.owners.pop(request_id)
        for i in range(len(owner.samples)):
            self.core.close(sample_key(request_id, i))

    # -- delivery --------------------------------------------------------------------------
    def hello(self, client_id: bytes) -> None:
        """A client announced itself: answer, queued behind any deltas held for it."""
        self._deliver(client_id, messages.HelloAck(client_id))

    def _deliver(self, client_id: bytes, msg) -> None:
        pending = self.pending.get(client_id)
        if pending is not None:  # keep the order: behind what is already waiting
            pending.msgs.append(msg)
            return
        try:
            self.send_to_client(client_id, msg)
        except zmq.ZMQError:
            self.pending[client_id] = _Pending(self.clock(), [msg])

    def retry_pending(self) -> None:
        """Resend held deltas; a client unreachable past the grace period is gone."""
        for client_id in list(self.pending):
            pending = self.pending[client_id]
            while pending.msgs:
                try:
                    self.send_to_client(client_id, pending.msgs[0])
                except zmq.ZMQError:
                    break
                pending.msgs.pop(0)
            if not pending.msgs:
                del self.pending[client_id]
            elif self.clock() - pending.since > DELIVERY_GRACE_S:
                del self.pending[client_id]
                gone = [rid for rid, o in self.owners.items() if o.client_id == client_id]
                for rid in gone:
                    self._close_request(rid)
                log.info("client %s unreachable for %.0fs; aborting its %d request(s)",
                         client_id, DELIVERY_GRACE_S, len(gone))
                if gone:
                    self.send_to_scheduler(messages.Abort(gone))


def _window(values, skip: int, n: int):
    """Per-token lists follow the token ids (a re-feed skips some, a stop string cuts some)."""
    return None if values is None else values[skip:skip + n]
