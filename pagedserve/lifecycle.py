"""What every role process does first: read the launcher's hand-off, install its environment,
log with its name, and arrange to die with the launcher."""
from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

from pagedserve import envs
from pagedserve.faults import FaultInjector, parse
from pagedserve.private_files import PrivateFileError

if TYPE_CHECKING:
    from pagedserve.pipeline.config import EngineConfig

_PR_SET_PDEATHSIG = 1


@dataclass(slots=True)
class RoleStart:
    name: str                 # scheduler, worker0, worker1, detokenizer, ingress
    rank: int
    incarnation: int          # 0 at first start, then 1, 2, ... after each restart
    config: EngineConfig
    log: logging.Logger
    faults: FaultInjector


def start_role(kind: str, description: str, argv: list[str] | None = None) -> RoleStart:
    """Parse `--config-file/--rank/--incarnation`, read the config once, install its
    environment settings, set up logging and the parent-death signal. `kind` "worker" names
    the role worker<rank>. A config file another user owns or may read ends the process
    (exit code 2) naming the file and the cause."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--config-file", required=True,
                   help="EngineConfig as JSON, a 0600 file of ours (from the launcher)")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--incarnation", type=int, default=0,
                   help="how many times the launcher restarted this role before")
    ns = p.parse_args(argv)
    # The config is a contract above the ground (pipeline/config.py), so the ground names it
    # only here, where a role reads its hand-off: no module of the ground loads it at import.
    from pagedserve.pipeline.config import EngineConfig
    try:
        config = EngineConfig.from_file(ns.config_file)
    except PrivateFileError as exc:
        p.error(str(exc))
    envs.install(config.env)
    name = f"{kind}{ns.rank}" if kind == "worker" else kind
    log = setup_logging(name, config.env.log_level)
    die_with_parent()
    return RoleStart(name, ns.rank, ns.incarnation, config, log,
                     FaultInjector(name, parse(config.env.fault), ns.incarnation))


def stop_process_group(proc: subprocess.Popen, timeout: float) -> int:
    """SIGTERM a launched group's leader (if it still runs), wait up to `timeout` seconds, then
    SIGKILL its whole process group (started with start_new_session); its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def exit_role(code: int | None) -> NoReturn:
    """End a role process once its main returned (sockets closed, contexts terminated, files
    removed) without the interpreter's finalization, which takes 1-2 s with torch and
    transformers loaded and only frees memory the exit frees anyway. Logs and stdio are
    flushed first."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code if isinstance(code, int) else 0)


class SignalWakeup:
    """A socket a zmq poller can watch that turns readable when a signal arrives, so a loop
    idling in a long poll sees SIGTERM at once (Python handlers run only between calls)."""

    def __init__(self) -> None:
        self._read, self._write = socket.socketpair()
        for end in (self._read, self._write):
            end.setblocking(False)
        signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)

    def fileno(self) -> int:
        return self._read.fileno()

    def drain(self) -> None:
        try:
            while self._read.recv(4096):
                pass
        except BlockingIOError:
            pass


def remove_file(path: str, log: logging.Logger) -> None:
    """Unlink `path` if it is there; another failure is logged, not raised (a clean-up goes on
    with the rest)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not remove %s: %s", path, exc)


def setup_logging(role: str, level: str = "INFO") -> logging.Logger:
    logging.basicConfig(level=level, format=f"%(asctime)s [{role} pid=%(process)d] %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)
    return logging.getLogger(f"pagedserve.{role}")


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to signal us when the launcher dies, so no role outlives its group."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the launcher's cleanup still applies
        pass
    if os.getppid() == 1:  # parent already gone before prctl took effect
        os.kill(os.getpid(), sig)
