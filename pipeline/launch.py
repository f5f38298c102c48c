"""Launcher/supervisor: `python -m pagedserve.pipeline.launch [vLLM-style flags]`.

Starts every role as its own OS process (`python -m ...`, never fork), waits until each reports
ready, and watches them: a child's pidfd for its death, heartbeats for a hung scheduler or
detokenizer, the scheduler's StepTimeout for a hung worker group. A dead or hung role is
restarted (the whole worker group for any rank) and the scheduler is told, so that no accepted
request is lost; more than --max-restarts restarts of one role within --restart-window seconds
is a crash loop: every client is told why, and the group exits non-zero.

SIGINT/SIGTERM drain gracefully (ingress first, then the scheduler, which finishes in-flight
requests and stops workers and detokenizer). On exit no child process, ipc socket file or
shared-memory segment of ours is left behind.
"""
from __future__ import annotations

import collections
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import zmq

from pagedserve import cluster_net, envs, transport
from pagedserve.breadcrumb import PrivateFileError, read_breadcrumb, save_keys
from pagedserve.lifecycle import remove_file, setup_logging
from pagedserve.pipeline import messages
from pagedserve.pipeline.cli_args import build_arg_parser, config_from_args
from pagedserve.pipeline.config import SOCKET_NAMES, EngineConfig
from pagedserve.pipeline.model_resolution import resolve_model

log = logging.getLogger("pagedserve.launcher")

HEARTBEAT_ROLES = ("scheduler", "detokenizer", "ingress")
BREADCRUMB_ROLES = ("detokenizer", "ingress")  # many requests in one process: mark the one running
QUARANTINE_SIZE = 1024  # requests an ingress refuses because one like it ended an ingress
ROLE_MODULES = {"scheduler": "pagedserve.pipeline.scheduler.process",
                "worker": "pagedserve.workers.process",
                "detokenizer": "pagedserve.pipeline.detokenizer.process",
                "ingress": "pagedserve.pipeline.ingress.process"}


@dataclass(slots=True)
class Child:
    role: str
    rank: int
    module: str
    proc: subprocess.Popen | None = None
    pidfd: int = -1
    ready: bool = False
    incarnation: int = -1
    last_cause: str = ""
    last_beat: float = 0.0
    config_file: str = ""     # what its latest start reads; removed at its next start and at exit
    hung: bool = False        # killed by us for its silence (held against what it was doing)

    @property
    def name(self) -> str:
        return f"{self.role}{self.rank}" if self.role == "worker" else self.role

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class _Fatal(Exception):
    pass


# Signals a process dies of by its own fault; others (SIGKILL, SIGTERM, ...) come from outside.
_CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL}


def died_of_itself(child: "Child") -> bool:
    """The child raised (it said so: ProcessFatal), exited with an error code, or crashed; not
    killed from outside (SIGKILL, SIGTERM) nor stopped by us."""
    code = child.proc.returncode if child.proc is not None else None
    if child.last_cause and not child.last_cause.startswith("hung"):
        return True
    if code is None:
        return False
    return code > 0 or -code in _CRASH_SIGNALS


@dataclass
class Supervisor:
    config: EngineConfig
    children: list[Child] = field(default_factory=list)
    draining: bool = False
    exit_code: int = 0

    def __post_init__(self) -> None:
        cfg = self.config
        # Several hosts: tcp on the master address (pagedserve/cluster_net.py); node r > 0 runs
        # only its worker ranks (headless), whose collectives use the interface towards node 0.
        self.node_interface = cluster_net.configure(cfg.cluster, cfg.parallel, cfg.ipc)
        self.headless = cfg.cluster.node_rank > 0
        # One host: the rendezvous is a file store in the 0700 ipc folder, a fresh one for
        # every start of the worker group, and gloo/NCCL talk over loopback only.
        self.local_rendezvous = not cfg.ipc.dist_init_addr
        self.worker_starts = 0
        if self.local_rendezvous:
            cfg.ipc.dist_init_addr = cfg.ipc.rendezvous(0)
        workers = [Child("worker", rank, ROLE_MODULES["worker"])
                   for rank in cfg.cluster.local_ranks(cfg.parallel.tensor_parallel_size)]
        before = [] if self.headless else ["scheduler"]
        after = [] if self.headless else ["detokenizer", *(["ingress"] if cfg.server.http else [])]
        self.children = ([Child(role, 0, ROLE_MODULES[role]) for role in before] + workers
                         + [Child(role, 0, ROLE_MODULES[role]) for role in after])
        self.restarts: dict[str, collections.deque] = collections.defaultdict(collections.deque)
        self.quarantined: collections.deque[str] = collections.deque(maxlen=QUARANTINE_SIZE)
        self.ctx = zmq.Context()
        self.control = transport.make_socket(self.ctx, zmq.PULL, cfg.ipc.control_addr, bind=True)
        self.to_scheduler = transport.make_socket(self.ctx, zmq.PUSH, cfg.ipc.events_addr, bind=False)
        self.to_detok = transport.make_socket(self.ctx, zmq.PUSH, cfg.ipc.detok_addr, bind=False)
        self.dispatcher = transport.Dispatcher("launcher", {
            messages.Heartbeat: self._on_heartbeat, messages.ProcessReady: self._on_ready,
            messages.ProcessFatal: self._on_fatal, messages.StepTimeout: self._on_step_timeout,
        }, log=log, report=lambda tag, why: self._tell_scheduler(
            messages.UnknownMessage("launcher", tag, why)))

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, child: Child) -> None:
        child.incarnation += 1
        child.ready, child.last_cause, child.last_beat = False, "", time.monotonic()
        child.hung = False
        cmd = [sys.executable, "-m", child.module, "--config-file", self._write_config(child),
               "--rank", str(child.rank), "--incarnation", str(child.incarnation)]
        # Without the secrets (the API key): the config file carries what a child needs.
        env = envs.child_environ(**{envs.ROLE_VARIABLE: child.name})
        if child.role == "worker" and self.local_rendezvous:
            for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
                env.setdefault(variable, "lo")
        elif child.role == "worker" and self.node_interface:
            for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
                env.setdefault(variable, self.node_interface)
        # Own session: a terminal's Ctrl-C reaches only the launcher, which orders the drain.
        child.proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        if child.pidfd >= 0:
            os.close(child.pidfd)
        child.pidfd = os.pidfd_open(child.proc.pid)
        log.info("%s %s pid=%d", "restarted" if child.incarnation else "started", child.name,
                 child.proc.pid)

    def _write_config(self, child: Child) -> str:
        """A fresh 0600 file in the private ipc folder for this start of `child` (never argv:
        the config holds the API key). One per start: a restarted worker group reads the new
        rendezvous address."""
        remove_file(child.config_file, log)
        path = self.config.ipc.config_file(child.name, child.incarnation)
        remove_file(path, log)  # left by a killed launcher in a given --ipc-dir (ours, 0700)
        self.config.to_file(path)
        child.config_file = path
        return path

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
        for child in self.children:
            if (child.role in ("ingress", "scheduler") or self.headless) and child.alive:
                child.proc.send_signal(signal.SIGTERM)

    # -- watching ----------------------------------------------------------------------------
    def _poll(self, timeout_ms: int) -> None:
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        for child in self.children:
            if child.pidfd >= 0 and child.alive:
                poller.register(child.pidfd, zmq.POLLIN)
        poller.poll(timeout_ms)
        self._handle_control()

    def _child(self, role: str, rank: int = 0) -> Child | None:
        return next((c for c in self.children if c.role == role and c.rank == rank), None)

    def _handle_control(self) -> None:
        while True:
            try:
                frames = self.control.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.dispatcher.receive(frames)

    def _on_heartbeat(self, msg: messages.Heartbeat) -> None:
        child = self._child(msg.role)
        if child is not None and child.proc is not None and child.proc.pid == msg.pid:
            child.last_beat = time.monotonic()

    def _on_fatal(self, msg: messages.ProcessFatal) -> None:
        child = self._child(msg.role, msg.rank)
        if child is not None:
            child.last_cause = msg.message

    def _on_step_timeout(self, msg: messages.StepTimeout) -> None:
        if not self.draining:
            self._restart_workers(f"step {msg.step_id} ran past --step-timeout "
                                  f"({msg.seconds:.0f}s): the worker group hung")

    def _on_ready(self, msg: messages.ProcessReady) -> None:
        child = self._child(msg.role, msg.rank)
        if child is None or child.proc is None or child.proc.pid != msg.pid:
            return
        child.ready, child.last_beat = True, time.monotonic()
        log.info("%s pid=%d ready%s", child.name, msg.pid, f" ({msg.detail})" if msg.detail else "")
        if child.incarnation and child.role == "detokenizer":
            self._tell_scheduler(messages.RoleRestarted("detokenizer"))
        elif child.incarnation and child.role == "ingress":
            self._tell_scheduler(messages.RoleRestarted("ingress"))

    def _wait_ready(self) -> None:
        ready_timeout = self.config.env.ready_timeout
        deadline = time.monotonic() + ready_timeout
        while not all(c.ready for c in self.children):
            if self.draining:
                raise _Fatal("interrupted before the group was ready")
            if time.monotonic() > deadline:
                missing = ", ".join(c.name for c in self.children if not c.ready)
                raise _Fatal(f"not ready after {ready_timeout:.0f}s: {missing}")
            self._poll(500)
            for c in self.children:
                if c.proc is not None and c.proc.poll() is not None:
                    raise _Fatal(f"{c.name} pid={c.proc.pid} {describe_exit(c.proc.returncode)} "
                                 f"during start-up{': ' + c.last_cause if c.last_cause else ''}")

    def _watch(self) -> None:
        while True:
            self._poll(500)
            if self.draining and self.headless:
                if not any(c.alive for c in self.children):
                    return
                continue
            if self.draining:
                sched = self._child("scheduler")
                if not sched.alive:
                    self.exit_code = 0 if sched.proc.returncode == 0 else 1
                    return
                # Roles stop once the scheduler tells them to; one that dies before that while
                # requests are still draining would leave them hanging: give up on them.
                for child in self.children:
                    if child.role in ("worker", "detokenizer") and child.proc is not None \
                            and child.proc.poll() not in (None, 0):
                        self._give_up(child.role, f"{child.name} "
                                      f"{child.last_cause or describe_exit(child.proc.returncode)}"
                                      " while draining; the requests still in flight fail")
                continue
            now = time.monotonic()
            for child in self.children:
                if child.proc is None:
                    continue
                if not child.alive and self.headless and child.proc.returncode == 0:
                    log.info("%s was stopped by node 0: stopping this node", child.name)
                    self._on_signal(signal.SIGTERM, None)
                    break
                if not child.alive:
                    cause = child.last_cause or describe_exit(child.proc.returncode)
                    log.error("%s pid=%d %s", child.name, child.proc.pid, cause)
                    if child.role == "worker":
                        self._restart_workers(f"{child.name} {cause}",
                                              attributable=died_of_itself(child))
                    else:
                        self._restart(child, cause)
                elif (child.role in HEARTBEAT_ROLES and child.ready
                      and now - child.last_beat > self.config.supervisor.heartbeat_timeout):
                    log.error("%s pid=%d sent no heartbeat for %.0fs: hung; killing it",
                              child.name, child.proc.pid, now - child.last_beat)
                    child.last_cause = f"hung (no heartbeat for {now - child.last_beat:.0f}s)"
                    child.hung = True
                    child.proc.kill()
                    child.proc.wait()

    # -- restarts ----------------------------------------------------------------------------
    def _count_restart(self, role: str, cause: str) -> None:
        sup = self.config.supervisor
        now = time.monotonic()
        times = self.restarts[role]
        times.append(now)
        while times and now - times[0] > sup.restart_window:
            times.popleft()
        if len(times) > sup.max_restarts:
            self._give_up(role, f"{role} failed {len(times)} times within "
                                f"{sup.restart_window:.0f}s (crash loop); last: {cause}")

    def _restart(self, child: Child, cause: str) -> None:
        self._count_restart(child.role, cause)
        suspect = self._suspect(child)
        if suspect is not None:
            log.error("%s %s while working on request %s: that request is quarantined (refused "
                      "from now on, not retried)", child.name, cause, suspect)
            if child.role == "ingress":
                self.quarantined.append(suspect)
                save_keys(self.config.ipc.quarantine_file("ingress"), list(self.quarantined))
        if child.role != "scheduler":
            self._tell_scheduler(messages.RoleDown(child.role, cause, suspect is not None,
                                                   suspect or ""))
        self.start(child)

    def _suspect(self, child: Child) -> str | None:
        """The request a detokenizer's or ingress's death is held against: the one its
        breadcrumb names, when it died of itself or hung (not when killed from outside)."""
        if child.role not in BREADCRUMB_ROLES or not (child.hung or died_of_itself(child)):
            return None
        try:
            return read_breadcrumb(self.config.ipc.breadcrumb_file(child.role))
        except PrivateFileError as exc:
            log.warning("%s", exc)
            return None

    def _restart_workers(self, cause: str, attributable: bool = False) -> None:
        self._count_restart("worker", cause)
        self._tell_scheduler(messages.RoleDown("worker", cause, attributable))
        workers = [c for c in self.children if c.role == "worker"]
        for c in workers:  # surviving ranks are stuck in a collective with the dead one
            if c.alive:
                c.proc.kill()
        for c in workers:
            if c.proc is not None:
                c.proc.wait()
        if self.local_rendezvous:  # a store file holds its keys: the new group needs a new one
            remove_file(self.config.ipc.dist_init_addr.removeprefix("file://"), log)
            self.worker_starts += 1
            self.config.ipc.dist_init_addr = self.config.ipc.rendezvous(self.worker_starts)
        for c in workers:
            self.start(c)

    def _give_up(self, role: str, message: str) -> None:
        log.error("giving up: %s", message)
        for sock in (self.to_scheduler, self.to_detok):
            try:
                transport.send(sock, messages.GroupFailed(role, message), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        time.sleep(1.0)  # let the survivors tell their clients why
        raise _Fatal(message)

    def _tell_scheduler(self, msg) -> None:
        try:
            transport.send(self.to_scheduler, msg, flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    # -- shutdown ----------------------------------------------------------------------------
    def _stop_all(self) -> None:
        graceful = self.draining and self.exit_code == 0
        deadline = time.monotonic() + (self.config.env.drain_timeout if graceful else 5)
        for child in self.children:
            if child.alive and not graceful:
                child.proc.send_signal(signal.SIGTERM)
        for child in self.children:
            if child.proc is None:
                continue
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s pid=%d did not stop in time; killing it", child.name, child.proc.pid)
                child.proc.kill()
                child.proc.wait()
            log.info("stopped %s pid=%d code=%s", child.name, child.proc.pid, child.proc.returncode)
            if child.pidfd >= 0:
                os.close(child.pidfd)
                child.pidfd = -1

    def _cleanup(self) -> None:
        """Remove exactly what this group created: its sockets, config files, rendezvous files
        and shared-memory segments (the scheduler and workers unlink theirs unless they were
        killed), and the ipc folder if the launcher made it."""
        for sock in (self.control, self.to_scheduler, self.to_detok):
            sock.close(0)
        self.ctx.term()
        ipc = self.config.ipc
        for name in SOCKET_NAMES:
            remove_file(ipc.socket_path(name), log)
        for child in self.children:
            if child.config_file:
                remove_file(child.config_file, log)
        for role in BREADCRUMB_ROLES:
            remove_file(ipc.breadcrumb_file(role), log)
        remove_file(ipc.quarantine_file("ingress"), log)
        if self.local_rendezvous:
            for start in range(self.worker_starts + 1):
                remove_file(ipc.rendezvous(start).removeprefix("file://"), log)
        for segment in ipc.shm_segments(self.config.parallel.tensor_parallel_size):
            remove_file(os.path.join("/dev/shm", segment), log)
        if ipc.owns_dir:
            try:
                os.rmdir(ipc.ipc_dir)
            except OSError as exc:  # something not ours is in it: leave it
                log.warning("left %s in place: %s", ipc.ipc_dir, exc)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from pagedserve.pipeline.router.config import wants_router
    if wants_router(argv):  # replicas or several models: the router starts the groups
        from pagedserve.pipeline.router.process import main as router_main
        return router_main(argv)
    parser = build_arg_parser()
    parser.add_argument("--die-with-parent", action="store_true",
                        help="drain and exit when the process that started us dies "
                             "(the offline API and tests use it)")
    ns = parser.parse_args(argv)
    if ns.die_with_parent:
        from pagedserve.lifecycle import die_with_parent
        die_with_parent(signal.SIGTERM)
    del ns.die_with_parent
    try:
        config = config_from_args(ns)
        from pagedserve.faults import parse
        parse(config.env.fault)  # a bad fault spec fails here, once, clearly
    except (ValueError, TypeError) as exc:
        setup_logging("launcher")
        log.error("bad configuration: %s", exc)
        return 2
    setup_logging("launcher", config.env.log_level)
    envs.install(config.env)
    from pagedserve.pipeline.load_error import ModelLoadError
    try:
        resolve_model(config)
    except ModelLoadError as exc:
        log.error("%s", exc)
        return 2
    try:
        supervisor = Supervisor(config)
    except ValueError as exc:   # a multi-node setting that cannot work on this host
        log.error("bad configuration: %s", exc)
        return 2
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
