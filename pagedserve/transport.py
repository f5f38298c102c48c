"""The transport every role shares: ZeroMQ sockets, the wire framing, and dispatch.

Every message is [type tag, msgpack payload] (after any ROUTER identity). The tag is the message
class name (the classes of `pagedserve.pipeline.messages`); the payload is standard msgpack
(msgspec's encoder), so any language's msgpack library can read the wire. Never pickle.

The transport knows no message module: the messages are contracts above it. A receiver says
which types it takes: each process hands what it receives to a `Dispatcher`, its {message type:
handler} table, which decodes exactly those types; other readers build a `Codec` of theirs. A
message no handler takes - an unknown tag, a bad payload, or a type this role does not handle -
is logged and counted, never dropped silently.
"""
from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

import msgspec
import zmq

_ENCODER = msgspec.msgpack.Encoder()


class WireError(ValueError):
    """A frame that is not one of our messages; `tag` is what its type frame said."""

    def __init__(self, message: str, tag: str = "?") -> None:
        super().__init__(message)
        self.tag = tag


def encode(msg: msgspec.Struct) -> list[bytes]:
    return [type(msg).__name__.encode(), _ENCODER.encode(msg)]


def send(sock: zmq.Socket, msg: msgspec.Struct, identity: bytes | None = None, flags: int = 0) -> None:
    frames = encode(msg)
    if identity is not None:
        frames.insert(0, identity)
    sock.send_multipart(frames, flags=flags, copy=False)


def send_to_peer(sock: zmq.Socket, msg: msgspec.Struct, identity: bytes) -> bool:
    """Send on a ROUTER to `identity` without waiting; False, nothing sent, when that peer is
    gone (a client that disconnected before its reply: there is no one left to tell) or its
    queue is full (a client that does not read its replies)."""
    try:
        send(sock, msg, identity=identity, flags=zmq.NOBLOCK)
    except zmq.ZMQError as exc:
        if exc.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
            raise
        return False
    return True


def message_types(module: ModuleType) -> list[type[msgspec.Struct]]:
    """The message classes `module` defines (its msgspec Structs), e.g. every message of
    pipeline/messages.py for a reader that takes them all."""
    return [cls for cls in vars(module).values()
            if isinstance(cls, type) and issubclass(cls, msgspec.Struct)
            and cls.__module__ == module.__name__]


class Codec:
    """Decodes the frames of the message types it was given; a tag of another type is a
    WireError, as a bad payload is."""

    def __init__(self, types: Iterable[type[msgspec.Struct]]) -> None:
        self._decoders = {cls.__name__.encode(): msgspec.msgpack.Decoder(cls) for cls in types}

    def takes(self, tag: bytes) -> bool:
        return bytes(tag) in self._decoders

    def decode(self, frames: list[bytes]) -> Any:
        if len(frames) != 2:
            raise WireError(f"expected 2 frames [tag, payload], got {len(frames)}",
                            f"<{len(frames)} frames>")
        tag = bytes(frames[0])[:40].decode(errors="replace")
        decoder = self._decoders.get(bytes(frames[0]))
        if decoder is None:
            raise WireError(f"unknown message tag {tag!r}", tag)
        try:
            return decoder.decode(frames[1])
        except msgspec.DecodeError as exc:
            raise WireError(f"bad {tag} payload: {exc}", tag) from exc

    def recv(self, sock: zmq.Socket, flags: int = 0) -> Any:
        return self.decode(sock.recv_multipart(flags=flags))

    def recv_routed(self, sock: zmq.Socket, flags: int = 0) -> tuple[bytes, Any]:
        frames = sock.recv_multipart(flags=flags)
        return frames[0], self.decode(frames[1:])


# No message of ours comes near this (a plan of 256 new 8k-token sequences is ~10 MB): a
# larger frame is a broken or hostile peer, and ZeroMQ drops its connection.
MAX_MESSAGE_BYTES = 256 * 2**20
# Messages queued per peer on the sockets that face clients: a client that stops reading stops
# getting messages (the detokenizer holds them a while, then aborts the client's requests)
# instead of growing the engine's memory without bound.
CLIENT_HWM = 10_000


def make_socket(ctx: zmq.Context, kind: int, addr: str, *, bind: bool,
                identity: bytes | None = None, hwm: int = 0,
                max_message_bytes: int = MAX_MESSAGE_BYTES,
                secure: Callable[[zmq.Socket], None] | None = None) -> zmq.Socket:
    """`hwm`: messages queued per peer each way (0: unbounded, for the engine's own sockets,
    where a message dropped for a full queue would be a lost request); `max_message_bytes`:
    larger incoming frames drop their sender; `secure`: sets a tcp socket's authentication
    before it binds or connects (pagedserve/cluster_auth.py)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if kind == zmq.ROUTER:
        # Sending to a peer that is gone raises instead of silently dropping: that is how a
        # process learns that a client disconnected.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    for opt in (zmq.SNDHWM, zmq.RCVHWM):
        sock.setsockopt(opt, hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    if secure is not None:
        secure(sock)
    if bind:
        if addr.startswith("ipc://"):
            path = addr[len("ipc://"):]
            if os.path.exists(path):
                os.unlink(path)
        sock.bind(addr)
    else:
        sock.connect(addr)
    return sock


class Dispatcher:
    """One process's {message type: handler} table: `dispatch(msg, *args)` calls
    `handlers[type(msg)](msg, *args)`; `receive` decodes frames of the listed types only (a new
    table given to `handlers` changes what it decodes). A message of no listed type, or one that
    did not decode (`reject`), is logged - the first of each type at WARNING - and counted in
    `unknown`; the optional `report(tag, reason)` tells someone who exports metrics (the
    scheduler)."""

    def __init__(self, role: str, handlers: dict[type, Callable[..., Any]], *,
                 log: logging.Logger | None = None,
                 report: Callable[[str, str], None] | None = None) -> None:
        self.role = role
        self.handlers = handlers
        self.log = log or logging.getLogger(f"pagedserve.{role}")
        self.report = report
        self.unknown: Counter[str] = Counter()

    @property
    def handlers(self) -> dict[type, Callable[..., Any]]:
        return self._handlers

    @handlers.setter
    def handlers(self, table: dict[type, Callable[..., Any]]) -> None:
        """A new table; the codec follows it (decodes the types it handles, no others)."""
        self._handlers = dict(table)
        self.codec = Codec(self._handlers)

    def dispatch(self, msg: Any, *args: Any) -> Any:
        handler = self.handlers.get(type(msg))
        if handler is None:
            self.reject(type(msg).__name__, f"{self.role} has no handler for it")
            return None
        return handler(msg, *args)

    def receive(self, frames: list[bytes], *, routed: bool = False,
                with_sender: bool | None = None) -> Any:
        """Decode one received frame set and dispatch it; one that does not decode is rejected.
        `routed`: it starts with the sender's identity (a ROUTER's). `with_sender` (default:
        `routed`): pass the sender (None when not routed) to the handler."""
        sender = frames[0] if routed else None
        body = frames[1:] if routed else frames
        if len(body) == 2 and not self.codec.takes(body[0]):
            self.reject(bytes(body[0])[:40].decode(errors="replace"),
                        f"{self.role} has no handler for it")
            return None
        try:
            msg = self.codec.decode(body)
        except WireError as exc:
            self.reject(exc.tag, f"undecodable: {exc}")
            return None
        if routed if with_sender is None else with_sender:
            return self.dispatch(msg, sender)
        return self.dispatch(msg)

    def reject(self, tag: str, reason: str) -> None:
        self.unknown[tag] += 1
        count = self.unknown[tag]
        self.log.log(logging.WARNING if count == 1 else logging.DEBUG,
                     "dropped a %s message: %s (%d so far)", tag, reason, count)
        if self.report is not None:
            try:
                self.report(tag, reason)
            except Exception:  # noqa: BLE001 - a report must never take the receiver down
                self.log.debug("could not report the dropped %s message", tag, exc_info=True)
