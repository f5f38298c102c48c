"""Ingress role: `python -m pagedserve.pipeline.ingress.process --config-file <path>`.

Loads the tokenizer and model limits, serves the app with uvicorn on uvloop, tells the launcher
it is ready once the port is listening, and on SIGTERM drains: stop accepting connections,
finish the in-flight streams, close the engine client, exit 0.
"""
from __future__ import annotations

import asyncio
import logging
import os
from contextlib import asynccontextmanager

import uvicorn
import uvloop
import zmq

from pagedserve import transport
from pagedserve.breadcrumb import Breadcrumb, load_keys
from pagedserve.lifecycle import start_role
from pagedserve.pipeline.graceful_server import GracefulServer
from pagedserve.pipeline import messages

log = logging.getLogger("pagedserve.ingress")


def _notify_launcher(control_addr: str, msg) -> None:
    ctx = zmq.Context()
    try:
        sock = transport.make_socket(ctx, zmq.PUSH, control_addr, bind=False)
        sock.setsockopt(zmq.LINGER, 2000)  # deliver before the socket goes away
        transport.send(sock, msg)
        sock.close()
    finally:
        ctx.term()


HEARTBEAT_S = 1.0  # the launcher restarts an ingress silent for --heartbeat-timeout


async def heartbeats(control_addr: str) -> None:
    """Tell the launcher the event loop still runs: a hung loop stops these, and the launcher
    restarts the ingress."""
    ctx = zmq.Context()
    sock = transport.make_socket(ctx, zmq.PUSH, control_addr, bind=False)
    try:
        while True:
            try:
                transport.send(sock, messages.Heartbeat("ingress", os.getpid()), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # the launcher is restarting or gone: nothing to tell
            await asyncio.sleep(HEARTBEAT_S)
    finally:
        sock.close(0)
        ctx.term()


def build_server(cfg, faults=None) -> GracefulServer:
    from pagedserve.pipeline.client import AsyncEngineClient
    from pagedserve.pipeline.ingress.app import build_app
    from pagedserve.pipeline.ingress.context import IngressContext
    from pagedserve.pipeline.ingress.limits import uvicorn_settings
    from pagedserve.pipeline.ingress.request_guard import RequestGuard
    from pagedserve.pipeline.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.model_info.tokenizer_dir,
                               chat_template=cfg.model_info.chat_template)
    engine = AsyncEngineClient(cfg.ipc.frontend_addr, cfg.ipc.output_addr,
                               connect_timeout=cfg.env.ready_timeout)
    ctx = IngressContext.from_config(cfg, engine, tokenizer)
    ctx.guard = RequestGuard(Breadcrumb(cfg.ipc.breadcrumb_file("ingress")),
                             load_keys(cfg.ipc.quarantine_file("ingress")), faults)

    @asynccontextmanager
    async def lifespan(_app):
        await engine.connect()
        log.info("connected to the engine (%s)", cfg.ipc.frontend_addr)
        try:
            yield
        finally:
            await engine.close()

    app = build_app(ctx, lifespan=lifespan, replica_secret=cfg.server.replica_secret)
    if faults:  # PAGEDSERVE_FAULT for tests: each HTTP request is a "message" of this role
        @app.middleware("http")
        async def inject_faults(request, call_next):
            faults.on_message()
            return await call_next(request)
    config = uvicorn.Config(app, host=cfg.server.host, port=cfg.server.port, loop="uvloop",
                            access_log=False, log_level="warning", lifespan="on",
                            **uvicorn_settings())
    return GracefulServer(config, log, "draining in-flight requests")


async def serve(server: GracefulServer, on_listening, control_addr: str | None = None) -> None:
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        if task.done():
            await task  # start-up failed: re-raise (uvicorn exits on a bound port, for one)
            raise RuntimeError("the HTTP server stopped during start-up")
        await asyncio.sleep(0.05)
    on_listening()
    beats = asyncio.ensure_future(heartbeats(control_addr)) if control_addr else None
    try:
        await task
    finally:
        if beats is not None:
            beats.cancel()


def main() -> int:
    role = start_role("ingress", "pagedserve HTTP ingress")
    cfg = role.config
    try:
        server = build_server(cfg, role.faults)
    except Exception as exc:
        log.error("cannot start: %s", exc)
        _notify_launcher(cfg.ipc.control_addr,
                         messages.ProcessFatal("ingress", role.rank, os.getpid(), str(exc)))
        return 1

    def on_listening() -> None:
        log.info("ready: listening on http://%s:%d (model %s)", cfg.server.host, cfg.server.port,
                 server.config.app.state.ctx.model_name)
        _notify_launcher(cfg.ipc.control_addr, messages.ProcessReady(
            "ingress", role.rank, os.getpid(), f"http://{cfg.server.host}:{cfg.server.port}"))
        role.faults.started()

    try:
        uvloop.run(serve(server, on_listening, cfg.ipc.control_addr))
    except SystemExit as exc:  # uvicorn's start-up failure (port in use, engine unreachable)
        log.error("stopped during start-up (code %s)", exc.code)
        _notify_launcher(cfg.ipc.control_addr, messages.ProcessFatal(
            "ingress", role.rank, os.getpid(),
            f"HTTP server failed to start on {cfg.server.host}:{cfg.server.port} (see its log)"))
        return 1
    except KeyboardInterrupt:
        return 0
    server.config.app.state.ctx.guard.breadcrumb.close()
    log.info("stop")
    return 0


if __name__ == "__main__":
    from pagedserve.lifecycle import exit_role
    exit_role(main())
