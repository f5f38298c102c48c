"""Detokenizer role: `python -m pipeline.detokenizer_process --config-json ...`.

Thin glue: TokenBatch from the scheduler -> DetokenizerCore -> TextDelta batches to the client
that owns each request (ROUTER, by identity); a stop string found -> StopMatched to the
scheduler; a client that is gone -> Abort of its requests to the scheduler.
"""
from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import dataclass

import zmq

from pipeline import ipc, messages
from pipeline.detokenizer_core import DetokenizerCore
from pipeline.procutil import die_with_parent, load_config, role_arg_parser, setup_logging

log = setup_logging("detokenizer")


@dataclass(slots=True)
class _Owner:
    client_id: bytes
    num_prompt_tokens: int
    open_samples: set[int]


def sample_key(request_id: str, index: int) -> str:
    return f"{request_id}\x1f{index}"


class DetokenizerService:
    """Routing around DetokenizerCore; no sockets here, `send_*` callbacks are injected."""

    def __init__(self, tokenizer, send_to_client, send_to_scheduler):
        self.core = DetokenizerCore(tokenizer)
        self.owners: dict[str, _Owner] = {}
        self.send_to_client = send_to_client
        self.send_to_scheduler = send_to_scheduler

    def open(self, msg: messages.DetokOpen) -> None:
        n = msg.sampling.n
        offsets = msg.text_offsets or [0] * n
        for i in range(n):
            self.core.open(sample_key(msg.request_id, i), msg.prompt_token_ids, msg.sampling,
                           text_offset=offsets[i])
        self.owners[msg.request_id] = _Owner(msg.client_id, len(msg.prompt_token_ids), set(range(n)))

    def on_tokens(self, batch: messages.TokenBatch) -> None:
        per_client: dict[bytes, list[messages.TextDelta]] = defaultdict(list)
        for s in batch.samples:
            owner = self.owners.get(s.request_id)
            if owner is None or s.index not in owner.open_samples:
                continue  # finished by a stop string already, or aborted
            key = sample_key(s.request_id, s.index)
            d = self.core.feed(key, s.token_ids, s.finish_reason is not None, s.finish_reason)
            if d is None:
                continue
            finish_reason, stop_reason = d.finish_reason, s.stop_reason
            if d.stop_matched is not None:
                finish_reason, stop_reason = "stop", d.stop_matched
                self.send_to_scheduler(messages.StopMatched(s.request_id, s.index, d.stop_matched))
            per_client[owner.client_id].append(messages.TextDelta(
                request_id=s.request_id, index=s.index, text=d.text, token_ids=d.token_ids,
                logprobs=_trim(s.logprobs, len(d.token_ids)),
                top_logprobs=_trim(s.top_logprobs, len(d.token_ids)), finish_reason=finish_reason,
                stop_reason=stop_reason, num_prompt_tokens=owner.num_prompt_tokens,
                num_output_tokens=d.num_output_tokens, num_cached_tokens=s.num_cached_tokens))
            if finish_reason is not None:
                self._close_sample(s.request_id, s.index)
        for client_id, deltas in per_client.items():
            self._deliver(client_id, messages.DeltaBatch(deltas))

    def on_failed(self, msg: messages.RequestFailed) -> None:
        owner = self.owners.get(msg.request_id)
        if owner is not None:
            self._deliver(owner.client_id, msg)
            for i in list(owner.open_samples):
                self._close_sample(msg.request_id, i)

    def _close_sample(self, request_id: str, index: int) -> None:
        owner = self.owners[request_id]
        owner.open_samples.discard(index)
        self.core.close(sample_key(request_id, index))
        if not owner.open_samples:
            del self.owners[request_id]

    def _deliver(self, client_id: bytes, msg) -> None:
        try:
            self.send_to_client(client_id, msg)
        except zmq.ZMQError:  # the client is gone: stop its requests and free their blocks
            gone = [rid for rid, o in self.owners.items() if o.client_id == client_id]
            for rid in gone:
                for i in list(self.owners[rid].open_samples):
                    self._close_sample(rid, i)
            if gone:
                log.info("client %s is gone; aborting its %d request(s)", client_id, len(gone))
                self.send_to_scheduler(messages.Abort(gone))


def _trim(values, n: int):
    """Per-token lists follow the token ids a stop string cut short."""
    return None if values is None else values[:n]


def main() -> int:
    ns = role_arg_parser("pagedserve detokenizer").parse_args()
    cfg = load_config(ns)
    die_with_parent()
    from workers.loader import load_tokenizer
    tokenizer = load_tokenizer(cfg.model.model)

    ctx = zmq.Context()
    inbox = ipc.make_socket(ctx, zmq.PULL, cfg.ipc.detok_addr, bind=True)
    clients = ipc.make_socket(ctx, zmq.ROUTER, cfg.ipc.output_addr, bind=True)
    events = ipc.make_socket(ctx, zmq.PUSH, cfg.ipc.events_addr, bind=False)
    control = ipc.make_socket(ctx, zmq.PUSH, cfg.ipc.control_addr, bind=False)

    service = DetokenizerService(
        tokenizer,
        send_to_client=lambda cid, msg: ipc.send(clients, msg, identity=cid),
        send_to_scheduler=lambda msg: ipc.send(events, msg))
    ipc.send(control, messages.ProcessReady("detokenizer", 0, _pid()))
    log.info("ready")
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    poller.register(clients, zmq.POLLIN)
    try:
        while True:
            for sock, _ in poller.poll():
                if sock is clients:
                    identity, msg = ipc.recv_routed(clients)
                    if isinstance(msg, messages.Hello):
                        ipc.send(clients, messages.HelloAck(identity), identity=identity)
                    continue
                msg = ipc.recv(inbox)
                if isinstance(msg, messages.TokenBatch):
                    service.on_tokens(msg)
                elif isinstance(msg, messages.DetokOpen):
                    service.open(msg)
                elif isinstance(msg, messages.RequestFailed):
                    service.on_failed(msg)
                elif isinstance(msg, messages.Shutdown):
                    log.info("stop (%s)", msg.reason or "shutdown")
                    return 0
    except KeyboardInterrupt:
        return 0
    finally:
        for s in (inbox, clients, events, control):
            s.close(0)
        ctx.term()


def _pid() -> int:
    import os
    return os.getpid()


if __name__ == "__main__":
    sys.exit(main())
