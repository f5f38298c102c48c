"""Detokenizer role: `python -m pagedserve.pipeline.detokenizer.process --config-file ...`.

Sockets only: a PULL for the scheduler's messages, a ROUTER to the clients (deltas out, hellos
in), a PUSH to the scheduler's events (StopMatched, Abort, UnknownMessage) and one to the
launcher (readiness, heartbeats). What each message means is DetokenizerService's business.
"""
from __future__ import annotations

import json
import logging
import os
import time

import zmq

from pagedserve import transport
from pagedserve.breadcrumb import Breadcrumb
from pagedserve.faults import FaultInjector
from pagedserve.lifecycle import start_role
from pagedserve.pipeline import messages
from pagedserve.pipeline.detokenizer.service import DetokenizerService

log = logging.getLogger("pagedserve.detokenizer")
INBOX_BATCH = 64  # messages handled before heartbeats and retries get a turn, even in a flood


class _Stop(Exception):
    """Shutdown received."""


def main() -> int:
    role = start_role("detokenizer", "pagedserve detokenizer")
    cfg = role.config
    from pagedserve.pipeline.detokenizer.decoder import load_decoder
    tokenizer = load_decoder(cfg.model_info.tokenizer_dir, cfg.env.cache_root)

    ctx = zmq.Context()
    inbox = transport.make_socket(ctx, zmq.PULL, cfg.ipc.detok_addr, bind=True)
    inbox.setsockopt(zmq.RCVHWM, 1024)  # with the scheduler's SNDHWM: bounded memory
    clients = transport.make_socket(ctx, zmq.ROUTER, cfg.ipc.output_addr, bind=True,
                                    hwm=transport.CLIENT_HWM)
    events = transport.make_socket(ctx, zmq.PUSH, cfg.ipc.events_addr, bind=False)
    control = transport.make_socket(ctx, zmq.PUSH, cfg.ipc.control_addr, bind=False)

    service = DetokenizerService(
        tokenizer,
        # Without waiting: a client whose queue is full has its deltas held, then is dropped.
        send_to_client=lambda cid, msg: transport.send(clients, msg, identity=cid,
                                                       flags=zmq.NOBLOCK),
        send_to_scheduler=lambda msg: transport.send(events, msg),
        breadcrumb=Breadcrumb(cfg.ipc.breadcrumb_file("detokenizer")), faults=role.faults)

    def shutdown(msg: messages.Shutdown, _peer=None) -> None:
        log.info("stop (%s)", msg.reason or "shutdown")
        raise _Stop

    handlers = service.handlers()
    if cfg.env.step_trace:
        handlers[messages.TokenBatch] = _traced(handlers[messages.TokenBatch], cfg.env.step_trace)
    dispatcher = transport.Dispatcher(
        "detokenizer", {**handlers, messages.Shutdown: shutdown}, log=log,
        report=lambda tag, why: transport.send(
            events, messages.UnknownMessage("detokenizer", tag, why)))
    transport.send(control, messages.ProcessReady("detokenizer", 0, os.getpid()))
    log.info("ready")
    role.faults.started()
    try:
        _serve(service, dispatcher, inbox, clients, control, role.faults)
        return 0
    except (KeyboardInterrupt, _Stop):
        return 0
    finally:
        service.breadcrumb.close()
        for s in (inbox, clients, events, control):
            s.close(0)
        ctx.term()


def _traced(on_tokens, path: str):
    """PAGEDSERVE_STEP_TRACE: a line per TokenBatch beside the scheduler's (same file):
    queue_ms from the scheduler's send to here, detokenize_ms to text deltas sent."""
    trace = open(path, "a", encoding="utf-8")

    def handle(batch: messages.TokenBatch, *args) -> None:
        started = time.monotonic()
        on_tokens(batch, *args)
        done = time.monotonic()
        trace.write(json.dumps({"role": "detokenizer", "step": batch.step_id,
                                "queue_ms": round((started - batch.sent) * 1e3, 3),
                                "detokenize_ms": round((done - started) * 1e3, 3)}) + "\n")
        trace.flush()
    return handle


def _serve(service: DetokenizerService, dispatcher: transport.Dispatcher, inbox, clients,
           control, faults: FaultInjector) -> None:
    """The loop: heartbeats, retries of held deltas, clients' hellos, the scheduler's messages."""
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    poller.register(clients, zmq.POLLIN)
    last_beat = 0.0
    while True:
        ready = dict(poller.poll(100 if service.pending else 1000))
        now = time.monotonic()
        if now - last_beat >= 1.0:
            transport.send(control, messages.Heartbeat("detokenizer", os.getpid()))
            last_beat = now
        if service.pending:
            service.retry_pending()
        if clients in ready:
            _receive(clients, dispatcher, routed=True, limit=None)
        if inbox in ready:
            _receive(inbox, dispatcher, routed=False, limit=INBOX_BATCH, faults=faults)


def _receive(sock, dispatcher: transport.Dispatcher, *, routed: bool, limit: int | None,
             faults: FaultInjector | None = None) -> None:
    """Dispatch what is waiting on `sock` (at most `limit` messages)."""
    handled = 0
    while (limit is None or handled < limit) and sock.get(zmq.EVENTS) & zmq.POLLIN:
        frames = sock.recv_multipart()
        handled += 1
        if faults is not None:
            faults.on_message()
        dispatcher.receive(frames, routed=routed, with_sender=True)


if __name__ == "__main__":
    from pagedserve.lifecycle import exit_role
    exit_role(main())
