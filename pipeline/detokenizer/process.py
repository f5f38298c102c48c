"""Detokenizer role: `python -m pagedserve.pipeline.detokenizer.process --config-json ...`.

Thin glue: TokenBatch from the scheduler -> DetokenizerCore -> TextDelta batches to the client
that owns each request (ROUTER, by identity); a stop string found -> StopMatched to the
scheduler; a client unreachable for DELIVERY_GRACE_S -> Abort of its requests to the scheduler.

Streams are idempotent: every SampleTokens carries the offset of its first token, repeated
tokens (a re-feed after a restart) are skipped, and every TextDelta carries its token and text
offsets so that clients drop what they already have.
"""
from __future__ import annotations

import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field

import zmq

from pagedserve.pipeline import ipc, messages
from pagedserve.pipeline.detokenizer.core import DetokenizerCore
from pagedserve.pipeline.faults import FaultInjector
from pagedserve.pipeline.procutil import die_with_parent, load_config, role_arg_parser, setup_logging

log = setup_logging("detokenizer")
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

    def __init__(self, tokenizer, send_to_client, send_to_scheduler, clock=time.monotonic):
        self.tokenizer = tokenizer
        self.core = DetokenizerCore(tokenizer)
        self.owners: dict[str, _Owner] = {}
        self.pending: dict[bytes, _Pending] = {}
        self.send_to_client = send_to_client
        self.send_to_scheduler = send_to_scheduler
        self.clock = clock

    def reset(self) -> None:
        self.core = DetokenizerCore(self.tokenizer)
        self.owners.clear()

    def open(self, msg: messages.DetokOpen) -> None:
        if msg.request_id in self.owners:  # reopened (resubmission, re-feed): start afresh
            self._close_request(msg.request_id)
        n = msg.sampling.n
        for i in range(n):
            self.core.open(sample_key(msg.request_id, i), msg.prompt_token_ids, msg.sampling)
        self.owners[msg.request_id] = _Owner(msg.client_id, len(msg.prompt_token_ids),
                                             [_Sample() for _ in range(n)])

    def on_tokens(self, batch: messages.TokenBatch) -> None:
        per_client: dict[bytes, list[messages.TextDelta]] = defaultdict(list)
        for s in batch.all_samples():
            owner = self.owners.get(s.request_id)
            if owner is None or s.index >= len(owner.samples) or not owner.samples[s.index].open:
                continue  # finished by a stop string already, aborted, or from before a reset
            sample = owner.samples[s.index]
            skip = max(0, sample.tokens - s.offset) if s.offset >= 0 else 0
            token_ids = s.token_ids[skip:]
            if not token_ids and s.finish_reason is None:
                continue  # all seen before
            d = self.core.feed(sample_key(s.request_id, s.index), token_ids,
                               s.finish_reason is not None, s.finish_reason)
            if d is None:
                continue
            finish_reason, stop_reason = d.finish_reason, s.stop_reason
            if d.stop_matched is not None:
                finish_reason, stop_reason = "stop", d.stop_matched
                self.send_to_scheduler(messages.StopMatched(s.request_id, s.index, d.stop_matched))
            n = len(d.token_ids)
            per_client[owner.client_id].append(messages.TextDelta(
                request_id=s.request_id, index=s.index, text=d.text, token_ids=d.token_ids,
                token_offset=sample.tokens, text_offset=sample.chars,
                logprobs=_window(s.logprobs, skip, n), top_logprobs=_window(s.top_logprobs, skip, n),
                finish_reason=finish_reason, stop_reason=stop_reason,
                num_prompt_tokens=owner.num_prompt_tokens, num_output_tokens=sample.tokens + n,
                num_cached_tokens=s.num_cached_tokens))
            sample.tokens += n
            sample.chars += len(d.text)
            if finish_reason is not None:
                self._close_sample(s.request_id, s.index)
        for client_id, deltas in per_client.items():
            self._deliver(client_id, messages.DeltaBatch(deltas))

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


def main() -> int:
    ns = role_arg_parser("pagedserve detokenizer").parse_args()
    cfg = load_config(ns)
    die_with_parent()
    from pagedserve.workers.loader import load_tokenizer
    tokenizer = load_tokenizer(cfg.model.model)
    faults = FaultInjector.from_env("detokenizer")

    ctx = zmq.Context()
    inbox = ipc.make_socket(ctx, zmq.PULL, cfg.ipc.detok_addr, bind=True)
    inbox.setsockopt(zmq.RCVHWM, 1024)  # with the scheduler's SNDHWM: bounded memory
    clients = ipc.make_socket(ctx, zmq.ROUTER, cfg.ipc.output_addr, bind=True)
    events = ipc.make_socket(ctx, zmq.PUSH, cfg.ipc.events_addr, bind=False)
    control = ipc.make_socket(ctx, zmq.PUSH, cfg.ipc.control_addr, bind=False)

    service = DetokenizerService(
        tokenizer,
        send_to_client=lambda cid, msg: ipc.send(clients, msg, identity=cid),
        send_to_scheduler=lambda msg: ipc.send(events, msg))
    ipc.send(control, messages.ProcessReady("detokenizer", 0, os.getpid()))
    log.info("ready")
    faults.started()
    try:
        return _serve(service, inbox, clients, control, faults)
    except KeyboardInterrupt:
        return 0
    finally:
        for s in (inbox, clients, events, control):
            s.close(0)
        ctx.term()


def _serve(service: DetokenizerService, inbox, clients, control, faults: FaultInjector) -> int:
    """The loop: heartbeats, retries of held deltas, clients' hellos, the scheduler's messages;
    returns 0 at Shutdown."""
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    poller.register(clients, zmq.POLLIN)
    last_beat = 0.0
    while True:
        ready = dict(poller.poll(100 if service.pending else 1000))
        now = time.monotonic()
        if now - last_beat >= 1.0:
            ipc.send(control, messages.Heartbeat("detokenizer", os.getpid()))
            last_beat = now
        if service.pending:
            service.retry_pending()
        if clients in ready:
            _answer_hellos(service, clients)
        if inbox in ready and _drain_inbox(service, inbox, faults):
            return 0


def _answer_hellos(service: DetokenizerService, clients) -> None:
    """A client's Hello gets a HelloAck, queued behind any deltas held for it."""
    while clients.get(zmq.EVENTS) & zmq.POLLIN:
        identity, msg = ipc.recv_routed(clients)
        if isinstance(msg, messages.Hello):
            service._deliver(identity, messages.HelloAck(identity))


def _drain_inbox(service: DetokenizerService, inbox, faults: FaultInjector) -> bool:
    """Handle what the scheduler sent, up to 64 messages; True at Shutdown."""
    for _ in range(64):  # then back to heartbeats and retries, even under a flood
        if not inbox.get(zmq.EVENTS) & zmq.POLLIN:
            break
        msg = ipc.recv(inbox)
        faults.on_message()
        if isinstance(msg, messages.TokenBatch):
            service.on_tokens(msg)
        elif isinstance(msg, messages.DetokOpen):
            service.open(msg)
        elif isinstance(msg, messages.RequestFailed):
            service.on_failed(msg)
        elif isinstance(msg, messages.Reset):
            service.reset()
        elif isinstance(msg, messages.GroupFailed):
            service.fail_all(msg.message)
        elif isinstance(msg, messages.Shutdown):
            log.info("stop (%s)", msg.reason or "shutdown")
            return True
    return False


if __name__ == "__main__":
    sys.exit(main())
