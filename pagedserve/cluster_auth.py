"""Authentication of the engine's tcp sockets across hosts (multi-node tensor parallelism).

Every node reads the same cluster secret (`--cluster-secret-file`). The scheduler's plan socket
(the only ZeroMQ socket that crosses hosts) runs ZeroMQ's CURVE: the server's and the client's
key pairs are derived from the secret, so only a peer holding it completes the handshake; every
frame after it is encrypted and authenticated. A peer without the secret (a plain connection, or
keys from another secret) is refused by the handshake and logged by `log_refusals`. A ZAP
handler on the server's context also checks the client's public key against an allow-list (the
cluster's client key), so a peer must hold both derived key pairs.

The rendezvous store (torch's TCPStore) and gloo's collective traffic carry no authentication
of their own: they bind only the --master-addr interface (cluster_net.py), which must be a
private network between the nodes (a VPC subnet, a VLAN, WireGuard), as docs/ARCHITECTURE.md says.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

MIN_SECRET_BYTES = 16


def read_secret(path: str) -> bytes:
    """The secret in `path` (surrounding whitespace dropped). Refused when missing, shorter than
    16 bytes, or readable by other users."""
    if not path:
        raise ValueError("--nnodes > 1 needs --cluster-secret-file: the tcp sockets between "
                         "hosts are authenticated with it")
    try:
        info = os.stat(path)
        with open(path, "rb") as f:
            secret = f.read().strip()
    except OSError as exc:
        raise ValueError(f"--cluster-secret-file {path}: {exc.strerror}") from None
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"--cluster-secret-file {path} is open to other users (mode "
                         f"{info.st_mode & 0o777:04o}); chmod 600 {path}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"--cluster-secret-file {path} holds {len(secret)} bytes; use at least "
                         f"{MIN_SECRET_BYTES} (e.g. head -c 32 /dev/urandom | base64)")
    return secret


@dataclass(frozen=True, slots=True)
class CurveKeys:
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def _key_pair(secret: bytes, purpose: bytes) -> tuple[bytes, bytes]:
    seed = hmac.new(secret, b"pagedserve curve " + purpose, hashlib.sha256).digest()
    secret_z85 = z85.encode(seed)
    return zmq.curve_public(secret_z85), secret_z85


def curve_keys(secret: bytes) -> CurveKeys:
    """The cluster's key pairs, the same on every node holding `secret`."""
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq has no CURVE support: cannot authenticate tcp sockets")
    return CurveKeys(*_key_pair(secret, b"server"), *_key_pair(secret, b"client"))


class ClientAllowList:
    """ZAP's check of a CURVE client: only the cluster's client key (derived from the secret)
    is let in. Without a ZAP handler libzmq admits any client key once the handshake with the
    server's key succeeds; with one, a peer must also hold a listed client key pair."""

    def __init__(self, allowed: set[bytes]):
        self.allowed = frozenset(allowed)
        self.refused = 0

    def callback(self, _domain: str, client_key: bytes) -> bool:
        allowed = client_key in self.allowed
        self.refused += not allowed
        return allowed


ZAP_DOMAIN = "pagedserve"
# One ZAP handler per context, started before its first CURVE server socket binds.
_authenticators: dict[int, tuple[zmq.Context, object, ClientAllowList]] = {}


def allow_only(context: zmq.Context, client_public: bytes) -> ClientAllowList:
    """Start (once per context) the ZAP handler that admits only `client_public`."""
    from zmq.auth.thread import ThreadAuthenticator
    entry = _authenticators.get(id(context))
    if entry is None or entry[0] is not context:
        auth = ThreadAuthenticator(context, log=logging.getLogger("pagedserve.zap"))
        auth.start()
        allow_list = ClientAllowList({client_public})
        auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=allow_list)
        entry = _authenticators[id(context)] = (context, auth, allow_list)
    return entry[2]


def stop_allow_list(context: zmq.Context) -> None:
    """Stop the context's ZAP handler (before the context terminates)."""
    entry = _authenticators.pop(id(context), None)
    if entry is not None:
        entry[1].stop()


def curve_server(keys: CurveKeys) -> Callable[[zmq.Socket], None]:
    def configure(sock: zmq.Socket) -> None:
        allow_only(sock.context, keys.client_public)
        sock.zap_domain = ZAP_DOMAIN.encode()
        sock.curve_server = True
        sock.curve_secretkey = keys.server_secret
        sock.curve_publickey = keys.server_public
    return configure


def curve_client(keys: CurveKeys) -> Callable[[zmq.Socket], None]:
    def configure(sock: zmq.Socket) -> None:
        sock.curve_serverkey = keys.server_public
        sock.curve_publickey = keys.client_public
        sock.curve_secretkey = keys.client_secret
    return configure


def for_address(addr: str, secret_file: str, *, server: bool) -> Callable[[zmq.Socket], None] | None:
    """The CURVE configuration of a socket at `addr`: None for ipc:// (one host: the 0700 ipc
    folder guards it), else the server's or the client's side from the cluster secret."""
    if not addr.startswith("tcp://"):
        return None
    keys = curve_keys(read_secret(secret_file))
    return curve_server(keys) if server else curve_client(keys)


_FAILED = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "no detail",
           zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol error",
           zmq.EVENT_HANDSHAKE_FAILED_AUTH: "authentication refused"}
_PROTOCOL_ERRORS = {getattr(zmq, name): name.removeprefix("PROTOCOL_ERROR_").lower()
                    for name in dir(zmq) if name.startswith("PROTOCOL_ERROR_")}
REFUSAL_LOG_INTERVAL_S = 10.0   # a refused peer reconnects every few ms: one line per interval


def describe_refusal(kind: int, value: int) -> str:
    return f"{_FAILED[kind]}: {_PROTOCOL_ERRORS.get(value, hex(value))}"


def log_refusals(sock: zmq.Socket, endpoint: str, log: logging.Logger,
                 clock: Callable[[], float] = time.monotonic) -> threading.Thread:
    """Log the handshakes on `sock` that fail (a peer without the cluster secret: refused; one
    line per REFUSAL_LOG_INTERVAL_S with the count since the last) or succeed, from a daemon
    thread reading the socket's monitor."""
    events = zmq.EVENT_HANDSHAKE_SUCCEEDED
    for event in _FAILED:
        events |= event
    monitor = sock.get_monitor_socket(events)

    def watch() -> None:
        try:
            _watch(monitor, endpoint, log, clock)
        finally:
            monitor.close(0)        # else the context's term() waits for it forever
    thread = threading.Thread(target=watch, name="handshake-monitor", daemon=True)
    thread.start()
    return thread


def _watch(monitor: zmq.Socket, endpoint: str, log: logging.Logger,
           clock: Callable[[], float]) -> None:
    unlogged, last_logged = 0, -REFUSAL_LOG_INTERVAL_S
    while True:
        try:
            event = recv_monitor_message(monitor)
        except zmq.ZMQError:
            return                          # the context is terminating
        kind = event["event"]
        if kind == zmq.EVENT_MONITOR_STOPPED:
            return
        if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            log.info("authenticated a connection on %s", endpoint)
            continue
        unlogged += 1
        if clock() - last_logged >= REFUSAL_LOG_INTERVAL_S:
            log.warning("refused %d connection(s) on %s: handshake failed (%s): a peer "
                        "without the cluster secret", unlogged, endpoint,
                        describe_refusal(kind, event["value"]))
            unlogged, last_logged = 0, clock()
