"""Local engine groups: each a launcher (`python -m pagedserve.pipeline.launch`) on its own
port and ipc folder, started and stopped by the router.

A group the router stops drains and cleans up after itself (the launcher removes its sockets,
shared memory and ipc folder). A group that died (killed from outside) could not: the router
ends what is left of it (processes whose command line names its private folder) and removes
its shared-memory segments and folders, so nothing leaks either way.

Each start of a group draws a secret (`secrets.token_urlsafe`) that the group's ingress asks
of every request but /health (pipeline/ingress/replica_secret.py): it travels in a 0600 file
in the group's private folder, never on a command line, and the router sends it in a header.
"""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx

from pagedserve import envs
from pagedserve.lifecycle import remove_file
from pagedserve.pipeline.config import REPLICA_SECRET_HEADER, IpcArgs
from pagedserve.private_files import write_private

log = logging.getLogger("pagedserve.router")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True, slots=True)
class GroupSpec:
    model: str                   # the name clients ask for (the engine serves under it too)
    source: str                  # what the launcher's --model takes: a name, folder or .gguf
    engine_args: tuple[str, ...] = ()   # the launcher's other flags (--dtype, --kv-cache-memory ...)


@dataclass(slots=True)
class LocalGroup:
    spec: GroupSpec
    index: int                   # the replica's number among its model's groups
    host: str = "127.0.0.1"
    port: int = 0
    proc: subprocess.Popen | None = None
    parent_dir: str = ""
    starts: int = 0
    started_at: float = 0.0
    secret: str = ""             # this start's; the replica refuses requests without it
    _dirs: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.spec.model}/{self.index}"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        """What every request to this group carries."""
        return {REPLICA_SECRET_HEADER: self.secret}

    @property
    def ipc_dir(self) -> str:
        return os.path.join(self.parent_dir, "ipc")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self) -> None:
        """Start the launcher (a fresh port, ipc folder and secret each time)."""
        # mode 0700; the index in its name tells an operator (and the tests) which replica it is
        self.parent_dir = tempfile.mkdtemp(prefix=f"pagedserve-router-{self.index}-")
        self._dirs.append(self.parent_dir)
        self.port = free_port(self.host)
        self.secret = secrets.token_urlsafe(32)
        secret_file = os.path.join(self.parent_dir, "replica-secret")
        write_private(secret_file, self.secret)
        cmd = [sys.executable, "-m", "pagedserve.pipeline.launch", "--model", self.spec.source,
               "--served-model-name", self.spec.model, "--host", self.host,
               "--port", str(self.port), "--ipc-dir", self.ipc_dir, "--die-with-parent",
               "--replica-secret-file", secret_file, *self.spec.engine_args]
        # Its own session: a signal meant for the router does not reach the group directly.
        self.proc = subprocess.Popen(cmd, env=envs.child_environ(), start_new_session=True)
        self.starts += 1
        self.started_at = time.monotonic()
        log.info("started engine group %s pid=%d port=%d", self.name, self.proc.pid, self.port)

    async def wait_ready(self, client: httpx.AsyncClient, timeout: float) -> dict:
        """Until its /health answers 200; its /v1/models entry. RuntimeError naming the cause
        when it exits or is not ready within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.alive:
                code = None if self.proc is None else self.proc.returncode
                raise RuntimeError(f"engine group {self.name} exited with code {code} before it "
                                   "was ready (its log is above)")
            try:
                if (await client.get(f"{self.url}/health", timeout=2)).status_code == 200:
                    models = (await client.get(f"{self.url}/v1/models", headers=self.headers,
                                               timeout=5)).json()
                    return models["data"][0]
            except (httpx.HTTPError, KeyError, IndexError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine group {self.name} was not ready after {timeout:.0f} s")
            await asyncio.sleep(0.2)

    async def stop(self, timeout: float = 60.0) -> None:
        """Drain and stop (SIGTERM; SIGKILL after `timeout`), then remove what is left."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            if proc.poll() is None:
                log.warning("engine group %s pid=%d did not stop in %.0f s; killing it",
                            self.name, proc.pid, timeout)
                proc.kill()
        if proc is not None:
            proc.wait()
            log.info("stopped engine group %s pid=%d code=%s", self.name, proc.pid,
                     proc.returncode)
        self.reap()

    def reap(self) -> None:
        """Remove what this group's starts left: role processes of a killed launcher, shared
        memory, folders. Safe to call again."""
        for parent in self._dirs:
            ipc_dir = os.path.join(parent, "ipc")
            _kill_processes_naming(ipc_dir)
            tag = IpcArgs(ipc_dir=ipc_dir).tag
            for name in _shm_names():
                if name.startswith(tag):
                    remove_file(os.path.join("/dev/shm", name), log)
            shutil.rmtree(parent, ignore_errors=True)
        self._dirs = [d for d in self._dirs if os.path.exists(d)]


def _shm_names() -> list[str]:
    try:
        return os.listdir("/dev/shm")
    except OSError:
        return []


def _kill_processes_naming(ipc_dir: str) -> None:
    """SIGKILL the processes whose command line holds `ipc_dir`: the roles of one group of
    ours (its private folder is in every role's --config-file)."""
    me = os.getpid()
    needle = ipc_dir.encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if needle not in f.read():
                    continue
            os.kill(int(entry), signal.SIGKILL)
            log.warning("killed pid=%s, left over from a dead engine group", entry)
        except (OSError, ValueError):
            continue
