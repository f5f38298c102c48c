"""Launcher/supervisor: `python -m pipeline.launch [vLLM-style flags]`.

Starts every role as its own OS process (`python -m ...`, never fork), waits until each reports
ready, watches every child's pidfd, forwards SIGINT/SIGTERM as a graceful drain (ingress first,
then the scheduler, which finishes in-flight requests and tells workers and detokenizer to
stop), and on exit leaves no child process, ipc socket file or shared-memory segment behind.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import zmq

from pipeline import ipc, messages
from pipeline.config import EngineConfig, build_arg_parser, config_from_args
from pipeline.procutil import setup_logging

log = setup_logging("launcher")

READY_TIMEOUT_S = float(os.environ.get("PAGEDSERVE_READY_TIMEOUT", "600"))
DRAIN_TIMEOUT_S = float(os.environ.get("PAGEDSERVE_DRAIN_TIMEOUT", "120"))


@dataclass(slots=True)
class Child:
    role: str
    rank: int
    module: str
    proc: subprocess.Popen | None = None
    pidfd: int = -1
    ready: bool = False

    @property
    def name(self) -> str:
        return f"{self.role}{self.rank}" if self.role == "worker" else self.role


def free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Supervisor:
    config: EngineConfig
    children: list[Child] = field(default_factory=list)
    draining: bool = False
    exit_code: int = 0

    def __post_init__(self) -> None:
        cfg = self.config
        if not cfg.ipc.dist_init_addr:
            cfg.ipc.dist_init_addr = f"tcp://127.0.0.1:{free_tcp_port()}"
        self.children = [Child("scheduler", 0, "pipeline.scheduler_process")]
        self.children += [Child("worker", r, "workers.worker_process")
                          for r in range(cfg.parallel.tensor_parallel_size)]
        self.children.append(Child("detokenizer", 0, "pipeline.detokenizer_process"))
        if cfg.server.http:
            self.children.append(Child("ingress", 0, "pipeline.ingress"))
        self.ctx = zmq.Context()
        self.control = ipc.make_socket(self.ctx, zmq.PULL, cfg.ipc.control_addr, bind=True)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, child: Child) -> None:
        cmd = [sys.executable, "-m", child.module, "--config-json", self.config.to_json(),
               "--rank", str(child.rank)]
        env = dict(os.environ, PAGEDSERVE_ROLE=child.name)
        # Own session: a terminal's Ctrl-C reaches only the launcher, which orders the drain.
        child.proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        child.pidfd = os.pidfd_open(child.proc.pid)
        log.info("started %s pid=%d", child.name, child.proc.pid)

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        try:
            for child in self.children:
                self.start(child)
            self._wait_ready()
            log.info("all %d processes ready; serving%s", len(self.children),
                     f" on http://{self.config.server.host}:{self.config.server.port}"
                     if self.config.server.http else "")
            self._watch()
        except _Fatal as exc:
            log.error("%s", exc)
            self.exit_code = 1
        finally:
            self._stop_all()
            self._cleanup()
        return self.exit_code

    def _on_signal(self, signum: int, _frame) -> None:
        if self.draining:
            return
        self.draining = True
        log.info("received %s: draining (in-flight requests finish, new ones are refused)",
                 signal.Signals(signum).name)
        self._begin_drain()

    def _begin_drain(self) -> None:
        # The ingress stops accepting connections and finishes its streams; the scheduler
        # refuses new requests, completes the rest, then stops workers and detokenizer.
        for child in self.children:
            if child.role in ("ingress", "scheduler") and child.proc and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)

    def _poller(self) -> zmq.Poller:
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        for child in self.children:
            if child.pidfd >= 0:
                poller.register(child.pidfd, zmq.POLLIN)
        return poller

    def _handle_control(self) -> None:
        while True:
            try:
                msg = ipc.recv(self.control, zmq.NOBLOCK)
            except zmq.Again:
                return
            if isinstance(msg, messages.ProcessReady):
                for child in self.children:
                    if child.role == msg.role and child.rank == msg.rank:
                        child.ready = True
                        log.info("%s pid=%d ready%s", child.name, msg.pid,
                                 f" ({msg.detail})" if msg.detail else "")
            elif isinstance(msg, messages.ProcessFatal):
                raise _Fatal(f"{msg.role}{msg.rank if msg.role == 'worker' else ''} "
                             f"pid={msg.pid} failed: {msg.message}")

    def _exited_children(self) -> list[Child]:
        return [c for c in self.children if c.proc is not None and c.proc.poll() is not None]

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        poller = self._poller()
        while not all(c.ready for c in self.children):
            if self.draining:
                raise _Fatal("interrupted before the group was ready")
            if time.monotonic() > deadline:
                missing = ", ".join(c.name for c in self.children if not c.ready)
                raise _Fatal(f"not ready after {READY_TIMEOUT_S:.0f}s: {missing}")
            poller.poll(500)
            self._handle_control()
            dead = self._exited_children()
            if dead:
                c = dead[0]
                raise _Fatal(f"{c.name} pid={c.proc.pid} exited with code {c.proc.returncode} "
                             "during start-up (see its log above)")

    def _watch(self) -> None:
        poller = self._poller()
        while True:
            poller.poll(1000)
            self._handle_control()
            dead = self._exited_children()
            if not dead:
                continue
            if self.draining:
                sched = next(c for c in self.children if c.role == "scheduler")
                if sched.proc.poll() is not None:
                    self.exit_code = 0 if sched.proc.returncode == 0 else 1
                    return
                # Other roles stopping during a drain is expected: wait for the scheduler.
                for c in dead:
                    if c.pidfd >= 0:
                        poller.unregister(c.pidfd)
                        os.close(c.pidfd)
                        c.pidfd = -1
                continue
            c = dead[0]
            raise _Fatal(f"{c.name} pid={c.proc.pid} died unexpectedly with code "
                         f"{c.proc.returncode}; stopping the group")

    def _stop_all(self) -> None:
        deadline = time.monotonic() + (DRAIN_TIMEOUT_S if self.draining and self.exit_code == 0 else 5)
        for child in self.children:
            if child.proc and child.proc.poll() is None and not self.draining:
                child.proc.send_signal(signal.SIGTERM)
        for child in self.children:
            if child.proc is None:
                continue
            remaining = max(0.1, deadline - time.monotonic())
            try:
                child.proc.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                log.warning("%s pid=%d did not stop in time; killing it", child.name, child.proc.pid)
                child.proc.kill()
                child.proc.wait()
            if child.proc.returncode not in (0, -signal.SIGTERM) and self.exit_code == 0 and not self.draining:
                self.exit_code = 1
            log.info("stopped %s pid=%d code=%s", child.name, child.proc.pid, child.proc.returncode)
            if child.pidfd >= 0:
                os.close(child.pidfd)
                child.pidfd = -1

    def _cleanup(self) -> None:
        self.control.close(0)
        self.ctx.term()
        ipc_dir = self.config.ipc.ipc_dir
        if ipc_dir and os.path.isdir(ipc_dir) and os.path.basename(ipc_dir).startswith("pagedserve-"):
            shutil.rmtree(ipc_dir, ignore_errors=True)
        # Shared-memory segments are owned (and unlinked) by the scheduler; if it was killed,
        # remove what it left, named after the ipc folder.
        tag = os.path.basename(ipc_dir)
        if tag and os.path.isdir("/dev/shm"):
            for name in os.listdir("/dev/shm"):
                if name.startswith(tag):
                    try:
                        os.unlink(os.path.join("/dev/shm", name))
                    except OSError:
                        pass


class _Fatal(Exception):
    pass


def resolve_model_once(config: EngineConfig) -> None:
    """Fetch/convert the model in the launcher so the children only read the cache."""
    from workers.loader import ModelLoadError, resolve_model
    try:
        config.model.model = str(resolve_model(config.model.model))
    except ModelLoadError as exc:
        log.error("%s", exc)
        raise SystemExit(2) from None


def main(argv: list[str] | None = None) -> int:
    ns = build_arg_parser().parse_args(argv)
    try:
        config = config_from_args(ns)
    except (ValueError, TypeError) as exc:
        log.error("bad configuration: %s", exc)
        return 2
    if config.model.served_model_name is None:
        config.model.served_model_name = os.path.basename(config.model.model.rstrip("/"))
    resolve_model_once(config)
    return Supervisor(config).run()


if __name__ == "__main__":
    sys.exit(main())
